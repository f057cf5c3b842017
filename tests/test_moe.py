"""Mixture-of-experts (HF Mixtral / Qwen2-MoE, tiny random configs) and the rules MoE routing
and ALiBi need: grouped expert matmuls, histc, index_put, index_add, scatter, copy, baddbmm,
repeat.

Models: outputs equal the single-device model; each expert's intermediate dim is sharded on tp
(0.5 of the layer weights per rank), the router stays whole and is listed with its reason; the
routing (sort by expert, grouped matmuls, un-sort) runs on each rank's own tokens under dp and
CP; one reduction per MoE layer. Rules: every rank's local result is its block of the global
result (``tests/test_rules.py``'s check)."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.passes.rules import FallbackWarning
from tests.families import collectives_by_kind, layer_param_fraction, mixtral, qwen2_moe
from tests.test_rules import check, meshes, specs

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _run(model, axes, sp=False, ids=IDS, **options):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with torch.no_grad():
        want = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp, **options)
        with torch.no_grad():
            got = pm(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    e = pm.explain()
    assert not e.fallbacks
    assert e.passes["propagate_pass"]["routing_regions_gathered"] == 0, e.passes  # no fallback
    if "tp" in axes:
        assert layer_param_fraction(pm, model) <= 0.55, e
    for a in axes:   # a token axis never gathers the routing: one gather, of the logits
        if a != "tp":
            assert sum(1 for c in e.collectives[0] if c.axis == a and
                       c.op in ("all_gather", "zigzag_gather")) == 1, e
    return pm


def test_mixtral_tp2_experts_sharded_one_all_reduce_per_moe_layer():
    counts = []
    for layers in (1, 2):
        pm = _run(mixtral(layers), dict(tp=2))
        counts.append(collectives_by_kind(pm))
        e = pm.explain()
        pm.close()
    grown = {k: counts[1][k] - counts[0][k] for k in counts[1] | counts[0]}
    # attention's o_proj and the experts' down_proj: one all-reduce each
    assert {k: v for k, v in grown.items() if v} == {("all_reduce", "full"): 2}
    placed = {f: s for f, s, _, _ in e.placements}
    assert "tp:S(1|64+64)" in placed["model.layers.0.mlp.experts.gate_up_proj"]
    assert "tp:S(2)" in placed["model.layers.0.mlp.experts.down_proj"]
    # every expert's intermediate dim split on tp, not expert-parallel: both layers' two weights
    assert "tp:S(2)" in placed["model.layers.1.mlp.experts.down_proj"]
    assert e.passes["propagate_pass"]["experts_split_on_tp"] == 4, e.passes
    router = dict(e.replicated)
    assert set(router) == {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}
    assert "gathered before use (by softmax" in router["model.layers.0.mlp.gate.weight"]


@pytest.mark.parametrize("build", [mixtral, qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_sequence_parallel_gathers_the_tokens_once_per_moe_layer(build):
    """The router and the routing read one all-gather of the normed tokens (the router runs
    on every token): Megatron-SP's 2 all-gathers + 2 reduce-scatters in the layer."""
    from collections import Counter
    pm = _run(build(1), dict(tp=2), sp=True)
    layer = Counter(c.op for c in pm.explain().collectives[0]
                    if c.axis == "tp" and c.module.startswith("model.layers.0."))
    assert layer == {"reduce_scatter": 2, "all_gather": 2}, pm.explain()
    # one value gathered once on tp: an expert-routing region and the router both read it
    assert pm.explain().passes["propagate_pass"]["gathered_for_routing"] == 1, pm.explain()
    pm.close()


def test_mixtral_ring_cp_routes_each_ranks_tokens():
    pm = _run(mixtral(1), dict(tp=2, ring_cp=2))
    assert pm.rank_module(0).code.count("fxshard.ring_attention") == 1
    assert pm.explain().passes["moe_routing_pass"] == {"routing_sorts": 1}
    pm.close()


def test_qwen2_moe_shared_expert_and_uneven_routing_on_dp_tp():
    """Shared expert + its sigmoid gate beside the routed experts; ids that send one dp rank's
    tokens to few experts (the ranks' expert counts differ)."""
    model = qwen2_moe(1)
    ids = torch.cat([torch.full((1, 16), 7), IDS[1:]])
    pm = _run(model, dict(dp=2, tp=2), ids=ids)
    assert sum(1 for c in pm.explain().collectives[0] if c.axis == "tp" and
               c.op == "all_reduce") == 2
    pm.close()


def test_router_kept_whole_is_a_strict_error():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(NotImplementedError, match=r"weight model\.layers\.0\.mlp\.gate\.weight "
                                                  r"\(4, 64\) stays whole on mesh axis 'tp'"):
        fxshard.parallelize(mixtral(1), mesh, strict=True, example_inputs=(IDS,))


def test_batched_mm_experts_are_listed_whole():
    """HF's other experts implementation picks whole expert matrices per token: kept whole
    on tp (correct), with the reason and the fix in explain()."""
    model = mixtral(1)
    model.config._experts_implementation = "batched_mm"
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(IDS,))
    why = dict(pm.explain().replicated)["model.layers.0.mlp.experts.gate_up_proj"]
    assert "experts_implementation='batched_mm'" in why
    pm.close()


def _grouped_mm(x, w, offs):
    import transformers.integrations.moe  # noqa: F401  (registers the op)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


@pytest.mark.parametrize("op", ["grouped_mm", "histc", "index_put", "index_add", "scatter",
                                "scatter_add", "copy", "baddbmm", "repeat"])
@settings(max_examples=max(4, settings.default.max_examples // 3))
@given(data=st.data())
def test_moe_and_alibi_rules(op, data):
    m = data.draw(meshes())
    n, h, e = (data.draw(st.sampled_from([2, 3, 4, 6])) for _ in range(3))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    x = torch.randn(n, h, generator=g)
    draw = data.draw
    if op == "grouped_mm":
        w = torch.randn(e, h, 6, generator=g)
        offs = torch.sort(torch.randint(0, n + 1, (e,), generator=g)).values.to(torch.int32)
        offs[-1] = n
        check(_grouped_mm, (x, w, offs), m, [specs(draw, m, 2, True), specs(draw, m, 3),
                                             specs(draw, m, 1)])
    elif op == "histc":
        ids = torch.randint(0, e, (n, 2), generator=g).float()
        check(lambda i: torch.histc(i, bins=e, min=0, max=e - 1), (ids,), m, [specs(draw, m, 2)])
    elif op == "index_put":
        perm = torch.randperm(n, generator=g)
        check(lambda p, v: torch.zeros(n, h).index_put((p,), v), (perm, x), m,
              [specs(draw, m, 1), specs(draw, m, 2)])
    elif op in ("index_add", "scatter", "scatter_add"):
        idx = torch.randint(0, e, (n,), generator=g)
        out = torch.randn(e, h, generator=g)
        if op == "index_add":
            fn = lambda o, i, s: o.index_add(0, i, s)  # noqa: E731
        elif op == "scatter":
            fn = lambda o, i, s: o.scatter(0, i[:, None].expand(n, h), s)  # noqa: E731
        else:
            fn = lambda o, i, s: o.scatter_add(0, i[:, None].expand(n, h), s)  # noqa: E731
        check(fn, (out, idx, x), m, [specs(draw, m, 2, True), specs(draw, m, 1),
                                     specs(draw, m, 2, True)])
    elif op == "copy":
        check(lambda a, b: torch.zeros_like(a).copy_(b), (x, torch.randn(h, generator=g)), m,
              [specs(draw, m, 2), specs(draw, m, 1, True)])
    elif op == "repeat":
        check(lambda a: a.repeat(2, 1, 3), (x,), m, [specs(draw, m, 2)])
    else:
        b1, b2 = torch.randn(e, n, h, generator=g), torch.randn(e, h, 3, generator=g)
        bias = torch.randn(e, 1, 3, generator=g)
        check(lambda s, a, b: torch.baddbmm(s, a, b, beta=0.5, alpha=2.0), (bias, b1, b2), m,
              [specs(draw, m, 3, True), specs(draw, m, 3, True), specs(draw, m, 3)])
