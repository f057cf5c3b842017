"""transformers' recent hybrid and MoE families (tiny configs of ``tests/recent_families.py``):
really sharded on tp, equal to one device, and what context parallelism gathers said.

- state-space / linear-attention layers (Mamba-2, Falcon-H1, GraniteMoeHybrid; Qwen3-Next and
  Kimi-Linear with ``FXSHARD_RECENT=all``): the fused ``in_proj`` split part by part through
  the depthwise ``conv1d``, at most 0.55 of the layer matrices on rank 0 at tp=2;
- experts stored as 3-D parameters (Llama 4 through ``bmm``, gpt-oss with its interleaved
  gate/up and per-expert biases);
- Jamba's layer list of two block classes on pp2;
- ring_cp2: a warning naming the layers that gather the sequence (gpt-oss's attention with
  sinks, Mamba-2's convolution);
- training on tp2: the loss and every gradient equal one device's (1e-5).
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.passes.rules import FallbackWarning, lookup
from fxshard.passes.rules.conv import SequenceGatherWarning
from tests.families import layer_param_fraction
from tests.recent_families import RECENT
from tests.train_checks import loss_and_grads_equal

pytest.importorskip("transformers")

FAST = ["mamba2", "falcon_h1", "granitemoehybrid", "llama4", "gpt_oss"]
SLOW = ["qwen3_next", "kimi_linear"]          # 1-2 minutes each on 2 loaded cores
TP_FAMILIES = FAST + (SLOW if os.environ.get("FXSHARD_RECENT") == "all" else [])
LAYERS = {"granitemoehybrid": 2, "qwen3_next": 2, "kimi_linear": 2}   # a mamba and an attention


def ids(seed: int = 0, batch: int = 2, seq: int = 16):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_recent_family_is_sharded_on_tp_and_equals_one_device(name):
    model = RECENT[name](LAYERS.get(name, 1))
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh(tp=2))
        with torch.no_grad():
            got = pm(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert layer_param_fraction(pm, model) <= 0.55, pm.explain()
    fell = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert not fell, fell


def test_mamba2_conv_and_in_proj_are_split_part_by_part():
    """in_proj's five parts (gate, x, B, C, dt) each split in half; the conv keeps its local
    channels (groups = local channels) and its weight holds x, B and C halves."""
    model = RECENT["mamba2"](1)
    pm = fxshard.parallelize(model, mesh(tp=2), example_inputs=(ids(),))
    shards = pm.shards(0)
    w_in = model.backbone.layers[0].mixer.in_proj.weight
    parts = (128, 128, 16, 16, 8)
    starts = [sum(parts[:j]) for j in range(len(parts))]
    want = torch.cat([w_in[a:a + k // 2] for a, k in zip(starts, parts)])
    torch.testing.assert_close(shards["backbone.layers.0.mixer.in_proj.weight"], want)
    assert shards["backbone.layers.0.mixer.conv1d.weight"].shape == (80, 1, 4)


@pytest.mark.grad
def test_mamba2_trains_on_tp2_like_one_device():
    model = RECENT["mamba2"](1)
    ref = copy.deepcopy(model)
    x = ids(1)
    labels = x.roll(1, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh(tp=2))

        def loss_of(module):
            return F.cross_entropy(module(x).logits.flatten(0, 1).float(), labels.flatten())
        try:
            loss_and_grads_equal(pm, ref, loss_of)
        finally:
            pm.close()
    fell = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert not fell, fell


@pytest.mark.grad
def test_llama4_experts_train_on_tp2_like_one_device():
    model = RECENT["llama4"](1)
    ref = copy.deepcopy(model)
    x = ids(2)
    pm = fxshard.parallelize(model, mesh(tp=2))

    def loss_of(module):
        return module(x).logits.float().pow(2).mean()
    try:
        loss_and_grads_equal(pm, ref, loss_of)
        gate_up = pm.shards(0)["model.layers.0.feed_forward.experts.gate_up_proj"]
        assert gate_up.shape == (4, 64, 32)      # [E, H, 2I] with I = 32 split in half
    finally:
        pm.close()


@pytest.mark.parametrize("name,layer", [("gpt_oss", "model.layers.*.self_attn"),
                                        ("mamba2", "backbone.layers.0.mixer")])
def test_ring_cp_equals_one_device_and_names_what_gathers(name, layer):
    model = RECENT[name](1)
    x = ids(3)
    with torch.no_grad():
        want = model(x).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh(ring_cp=2))
        with torch.no_grad():
            got = pm(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    said = [str(w.message) for w in caught if issubclass(w.category, SequenceGatherWarning)]
    assert any(layer in m and "ring_cp" in m for m in said), said


def test_jamba_mixed_layer_classes_split_over_pp():
    model = RECENT["jamba"](4)
    kinds = {type(m).__name__ for m in model.model.layers}
    assert len(kinds) == 2, kinds
    x = ids(4)
    with torch.no_grad():
        want = model(x).logits
    pm = fxshard.parallelize(model, mesh(pp=2))
    with torch.no_grad():
        got = pm(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_conv_and_split_rules_are_registered():
    aten = torch.ops.aten
    for op in (aten.conv1d.default, aten.convolution.default, aten.convolution_backward.default,
               aten.tensor_split.indices, aten.pad.default, aten.einsum.default,
               aten.flip.default):
        assert lookup(op) is not None, op
