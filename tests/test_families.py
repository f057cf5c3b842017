"""HuggingFace families with the model patterns beyond the plain Llama (tests/families.py):
every one matches the single-device model on tp=2, dp=2·tp=2, tp=2 with sequence parallelism
and a context-parallel mesh, with no op falling back; holds at most 0.55 of the layer weights
per rank at tp=2; and communicates the Megatron minimum per layer (counted in the rank program
as the layer count grows)."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

import fxshard
from fxshard.passes.rules import FallbackWarning
from tests import families
from tests.families import FAMILIES, collectives_by_kind, layer_param_fraction

# each model is built once and exported once for all the meshes it runs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
_models: dict = {}


def built(make, layers: int, **kwargs):
    """``make(layers, **kwargs)`` (a builder of ``tests.families``), built once for the module
    (no test here changes a model)."""
    key = (make.__name__, layers, tuple(sorted(kwargs.items())))
    if key not in _models:
        _models[key] = make(layers, **kwargs)
    return _models[key]


MESHES = {
    "tp2": (dict(tp=2), False),
    "dp2_tp2": (dict(dp=2, tp=2), False),
    "tp2_sp": (dict(tp=2), True),
    "tp2_ring2": (dict(tp=2, ring_cp=2), False),
}


def _parallel(model, axes: dict, sp: bool, ids, strict: bool = False):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp, strict=strict)
        with torch.no_grad():
            out = pm(ids).logits
    return pm, out


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_single_device(family, mesh_name):
    model = built(FAMILIES[family][1], 2)
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
        pm, _ = _parallel(built(build, layers), dict(tp=2), sp, ids)
        counts.append(collectives_by_kind(pm))
        pm.close()
    grown = {k: counts[1][k] - counts[0][k] for k in counts[1] | counts[0]}
    assert {k: v for k, v in grown.items() if v} == (per_layer_sp if sp else per_layer)


@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(ulysses_cp=2), dict(tp=2, ring_cp=2)],
                         ids=["ring2", "ulysses2", "tp2_ring2"])
def test_eager_attention_is_lowered_like_sdpa(axes):
    model = built(families.llama_eager, 2)
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
    assert pm.explain().passes["eager_attention_pass"] == {
        "attentions": 2, "causal_masks": 2, "soft_capped": 0, "biases_in_mask": 0}
    pm.close()


@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(ulysses_cp=2), dict(tp=2, ring_cp=2)],
                         ids=["ring2", "ulysses2", "tp2_ring2"])
def test_soft_capped_eager_attention_is_lowered_like_sdpa(axes):
    """Gemma-2's ``tanh(s / cap) * cap`` scores: ring / Ulysses attention with the cap, no
    gather of K/V along the sequence."""
    model = built(families.gemma2, 1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm, got = _parallel(model, axes, False, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    code = pm.rank_module(0).code
    assert "aten.matmul" not in code and "aten.softmax" not in code, code
    assert code.count("aten.tanh") == 1, code  # the final logits' soft-cap only
    calls = [line for line in code.splitlines() if "attention.default(" in line]
    assert len(calls) == 1 and ", 5.0)" in calls[0], calls
    axis = "ring_cp" if "ring_cp" in axes else "ulysses_cp"
    gathers = [line for line in code.splitlines() if "gather" in line and axis in line]
    assert len(gathers) == 1 and "lm_head" not in code.split(gathers[0])[1], gathers
    if "ring_cp" in axes:
        assert all("ring_attention" in c for c in calls), calls
    else:
        assert code.count("fxshard.all_to_all") == 4, code
    assert pm.explain().passes["eager_attention_pass"] == {
        "attentions": 1, "causal_masks": 1, "soft_capped": 1, "biases_in_mask": 0}
    assert not pm.explain().gathered
    pm.close()


def test_sliding_window_attention_runs_ring_attention_with_its_mask():
    """A sliding-window mask (not causal) rides the ring sharded by query rows: both layers run
    ring attention (one with the mask, one causal), no K/V gathered, strict=True accepts it."""
    model = built(families.gemma2, 2, sliding_window=5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm, got = _parallel(model, dict(ring_cp=2), False, ids, strict=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    code = pm.rank_module(0).code
    calls = [line for line in code.splitlines() if "fxshard.ring_attention.default(" in line]
    assert len(calls) == 2 and "fxshard.attention.default(" not in code, code
    assert sum("zigzag_shard" in c.split("0.0625")[1] for c in calls) == 1, calls  # the mask
    assert code.count("zigzag_gather.default(") == 1, code   # the logits only
    assert "all_gather" not in code
    assert not pm.explain().gathered
    pm.close()


def test_generate_soft_capped_attention_equals_greedy():
    """The decode kernel applies the soft-cap (the cap bends the scores here: q/k x20): greedy
    generation on tp2·ring2 (heads split, cache pieces merged across the ring) equals a greedy
    single-device loop."""
    from tests.external_models import greedy
    from tests.families import gemma2
    model = gemma2(1)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ring_cp"))
    pm = fxshard.parallelize(model, mesh)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    try:
        assert torch.equal(pm.generate(ids, max_new_tokens=3), greedy(model, ids, 3))
    finally:
        pm.close()


@pytest.mark.parametrize("mesh_name", list(MESHES) + ["ulysses2", "ring2"])
def test_bloom_alibi_shards_heads(mesh_name):
    """BLOOM's heads-merged ``baddbmm`` attention with ALiBi becomes SDPA with the bias in the
    mask: query_key_value and dense split on tp (each rank's ALiBi slopes are its heads'), the
    values equal single device; on ring_cp the bias rides the ring by query rows (strict)."""
    model = built(families.bloom, 2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    axes, sp = MESHES.get(mesh_name) or ({"ulysses2": dict(ulysses_cp=2),
                                          "ring2": dict(ring_cp=2)}[mesh_name], False)
    pm, got = _parallel(model, axes, sp, ids, strict="ring_cp" in axes)
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if "tp" in axes:
            assert layer_param_fraction(pm, model) <= 0.55, pm.explain()
        if "ulysses_cp" in axes:   # heads split around attention (4 all-to-alls a layer)
            assert pm.rank_module(0).code.count("fxshard.all_to_all") == 8
        code = pm.rank_module(0).code
        assert "baddbmm" not in code and "aten.bmm" not in code, code
        ring = "ring_cp" in axes
        assert code.count("fxshard.attention.default(") == (0 if ring else 2), code
        assert code.count("fxshard.ring_attention.default(") == (2 if ring else 0), code
        if ring:   # no K/V gathered along the sequence: only the logits at the end
            assert code.count("zigzag_gather.default(") == 1, code
        assert pm.explain().passes["eager_attention_pass"] == {   # ALiBi added to the mask
            "attentions": 2, "causal_masks": 0, "soft_capped": 0, "biases_in_mask": 2}
        assert not pm.explain().gathered
        if mesh_name in ("tp2", "tp2_sp"):   # the Megatron minimum in the last layer
            layer = Counter(c.op for c in pm.explain().collectives[0] if c.axis == "tp" and
                            c.op != "local_shard" and c.module.startswith("transformer.h.1."))
            assert layer == ({"all_gather": 2, "reduce_scatter": 2} if sp else
                             {"all_reduce": 2}), pm.explain()
    finally:
        pm.close()


USP_MASKED = {
    # family, mesh (in mesh order), ulysses_cp collectives in rank 0's program: 4 all-to-alls
    # a layer; all-gathers: the logits (+ K and V per layer when tp leaves 1 KV head for 2
    # ulysses ranks). None moves a mask: HF builds it whole, so it is re-sliced locally.
    "bloom-u2r2": ("bloom", dict(ulysses_cp=2, ring_cp=2), 8, 1),
    "bloom-tp2u2r2": ("bloom", dict(tp=2, ulysses_cp=2, ring_cp=2), 8, 1),
    "mistral-u2r2": ("mistral", dict(ulysses_cp=2, ring_cp=2), 8, 1),
    "mistral-r2tp2u2": ("mistral", dict(ring_cp=2, tp=2, ulysses_cp=2), 4, 1 + 2 * 2),
}


@pytest.mark.parametrize("case", list(USP_MASKED))
def test_masked_attention_under_usp_runs_ring_attention(case):
    """USP (ulysses_cp and ring_cp) with an explicit mask, strict=True: BLOOM's per-head ALiBi
    bias and Mistral's sliding window (one mask both layers share), in both mesh orders
    (segments 2 and 1), with tp splitting heads first. Ring attention per layer with the
    mask, no q/K/V gathered along the sequence, no collective for the mask, values equal to
    one device."""
    family, axes, all_to_all, all_gather = USP_MASKED[case]
    model = built(getattr(families, family), 2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm, got = _parallel(model, axes, False, ids, strict=True)
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        code = pm.rank_module(0).code
        lines = code.splitlines()
        calls = [ln for ln in lines if "fxshard.ring_attention.default(" in ln]
        assert len(calls) == 2 and "fxshard.attention.default(" not in code, code
        segments = 2 if list(axes).index("ulysses_cp") < list(axes).index("ring_cp") else 1
        assert all(f"'ring_cp', 2, {segments}, " in c for c in calls), calls
        masks = [c.split("(")[1].split(")")[0].split(", ")[-1] for c in calls]  # last arg
        assert all(m.startswith(("cat", "local_shard", "zigzag_shard")) for m in masks), masks
        assert len(set(masks)) == (1 if family == "mistral" else 2), masks  # made once
        ulysses = Counter(ln.split("fxshard.")[1].split(".")[0] for ln in lines
                          if "'ulysses_cp'" in ln and ".default(" in ln)
        assert (ulysses["all_to_all"], ulysses["all_gather"]) == (all_to_all, all_gather), code
        # on ring_cp only the logits are gathered: q, K and V stay sharded
        assert [ln for ln in lines if "'ring_cp'" in ln and "gather.default(" in ln] == \
            [ln for ln in lines if "zigzag_gather.default(" in ln] and \
            code.count("zigzag_gather.default(") == 1, code
        assert not pm.explain().gathered
    finally:
        pm.close()


class _ScoresChanged(torch.nn.Module):
    """Attention whose scores go through a sine (not a tanh soft-cap, which any numbers
    before and after it would be): not attention fxshard can lower."""

    def forward(self, x):
        q = x.view(2, 8, 2, 8).transpose(1, 2)
        s = torch.sin(q @ q.transpose(-1, -2) * 0.25 / 50.0) * 30.0
        return (torch.softmax(s, dim=-1) @ q).transpose(1, 2).reshape(2, 8, 16)


def test_changed_scores_stay_correct_under_cp_listed_and_refused_by_strict():
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    model = _ScoresChanged()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    (node, why), = pm.explain().gathered   # not silent: listed with its reason
    assert "(mul -> div -> sin -> mul between q @ k^T and softmax)" in why, why
    assert "all-gathered along the sequence on ring_cp" in why, why
    pm.close()
    with pytest.raises(NotImplementedError, match=r"strict=True\): attention at softmax on mesh "
                                                  r"\(ring_cp=2\): scores change .*sin"):
        fxshard.parallelize(model, mesh, strict=True, example_inputs=(x,))


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
