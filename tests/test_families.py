"""HuggingFace families with the model patterns beyond the plain Llama (tests/families.py):
every one matches the single-device model on tp=2, dp=2·tp=2, tp=2 with sequence parallelism
and a context-parallel mesh, with no op falling back; holds at most 0.55 of the layer weights
per rank at tp=2; and communicates the Megatron minimum per layer (counted in the rank program
as the layer count grows)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxshard
from fxshard.passes.rules import FallbackWarning
from tests.families import FAMILIES, collectives_by_kind, layer_param_fraction

MESHES = {
    "tp2": (dict(tp=2), False),
    "dp2_tp2": (dict(dp=2, tp=2), False),
    "tp2_sp": (dict(tp=2), True),
    "tp2_ring2": (dict(tp=2, ring_cp=2), False),
}


def _parallel(model, axes: dict, sp: bool, ids):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp)
        with torch.no_grad():
            out = pm(ids).logits
    return pm, out


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_single_device(family, mesh_name):
    model = FAMILIES[family][1](2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    axes, sp = MESHES[mesh_name]
    pm, got = _parallel(model, axes, sp, ids)
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert layer_param_fraction(pm, model) <= 0.55, pm.explain()
        assert not pm.explain().fallbacks
        if "ring_cp" in axes:
            code = pm.rank_module(0).code
            assert code.count("fxshard.ring_attention") == 2, code
            assert "fxshard.attention.default" not in code
    finally:
        pm.close()


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_collectives_per_layer_are_the_megatron_minimum(family, sp):
    _, build, per_layer, per_layer_sp = FAMILIES[family]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    counts = []
    for layers in (1, 2):
        pm, _ = _parallel(build(layers), dict(tp=2), sp, ids)
        counts.append(collectives_by_kind(pm))
        pm.close()
    grown = {k: counts[1][k] - counts[0][k] for k in counts[1] | counts[0]}
    assert {k: v for k, v in grown.items() if v} == (per_layer_sp if sp else per_layer)


@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(ulysses_cp=2), dict(tp=2, ring_cp=2)],
                         ids=["ring2", "ulysses2", "tp2_ring2"])
def test_eager_attention_is_lowered_like_sdpa(axes):
    from tests.families import llama_eager
    model = llama_eager(2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm, got = _parallel(model, axes, False, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    code = pm.rank_module(0).code
    assert "aten.matmul" not in code and "aten.softmax" not in code, code
    if "ring_cp" in axes:
        assert code.count("fxshard.ring_attention") == 2, code
        assert "zigzag_gather" not in code.split("ring_attention")[0]
    else:
        assert code.count("fxshard.all_to_all") == 8, code
    edits = dict(pm.explain().edits)
    assert edits["eager_attention_pass"] == "recognised 2 eager attentions as SDPA (2 with a " \
                                           "constant causal mask)"
    pm.close()


def test_soft_capped_eager_attention_stays_correct_under_cp():
    """Gemma-2's tanh soft-cap is not SDPA: left as matmuls, sharded by the rules."""
    import transformers as T
    from tests.families import _common
    cfg = T.Gemma2Config(intermediate_size=128, num_key_value_heads=2, head_dim=16,
                         **_common(1))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm, got = _parallel(model, dict(ring_cp=2), False, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "recognised 0 eager" in dict(pm.explain().edits)["eager_attention_pass"]
    (node, why), = pm.explain().gathered   # not silent: listed with its reason
    assert "tanh" in why and "all-gathered along the sequence on ring_cp" in why, why
    assert "Attention not lowered on the CP axes (sequence gathered): 1" in str(pm.explain())
    pm.close()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    with pytest.raises(NotImplementedError, match=r"strict=True\): attention at softmax on mesh "
                                                  r"\(ring_cp=2\): scores change .*tanh"):
        fxshard.parallelize(model, mesh, strict=True, example_inputs=(ids,))


def test_softmax_as_the_right_operand_is_not_attention():
    """``x @ softmax(q @ k^T)`` is no attention: the eager-attention pass must leave it."""
    class RightOperand(torch.nn.Module):
        def forward(self, q, k, x):
            return torch.matmul(x, torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1))

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g)
    x = torch.randn(2, 2, 8, 8, generator=g)
    model = RightOperand().eval()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(q, k, x))
    torch.testing.assert_close(pm(q, k, x), model(q, k, x), rtol=1e-4, atol=1e-4)
    assert "attention" not in pm.rank_module(0).code
