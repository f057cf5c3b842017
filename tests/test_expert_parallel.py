"""Expert parallelism (``ep``, issue 44): inference on HF Mixtral and Qwen3-MoE (tiny random
configs). Logits equal one device; each rank holds E/ep whole experts (its own slice of the
experts' tensors, 1/ep of their bytes); per MoE layer one counts exchange and two token
all-to-alls, no gather of the tokens on ep; routing forced by the router's weights (every
token to the same experts, experts and ranks that get no token, uneven counts, ties) keeps
one program equal to one device."""
from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from tests.families import _common, _make, mixtral

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def qwen3_moe(layers: int):
    import transformers as T
    cfg = T.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, num_key_value_heads=2, head_dim=16,
                           **_common(layers))
    return _make(T.Qwen3MoeForCausalLM, cfg)


def _ids(batch: int, seed: int = 1):
    return torch.randint(0, 128, (batch, 8), generator=torch.Generator().manual_seed(seed))


def _parallel(model, axes: dict):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the router kept whole on tp
        return fxshard.parallelize(model, mesh)


def _expert_layers_checked(pm, model, ep: int, layers: int) -> None:
    """Every rank holds its own E/ep experts: the slice of the global tensor by expert index."""
    full = model.state_dict()
    world = pm.spec.world_size
    for rank in range(world):
        shards = pm.shards(rank)
        coord = pm.spec.axis_index(rank, "ep")
        held = 0
        for fqn, t in shards.items():
            if not fqn.endswith(EXPERTS):
                continue
            e = full[fqn].shape[0] // ep
            whole = full[fqn][coord * e:(coord + 1) * e]
            if pm.spec.axis_size("tp") == 1:
                torch.testing.assert_close(t, whole, rtol=0, atol=0)
            held += t.numel()
        total = sum(v.numel() for k, v in full.items() if k.endswith(EXPERTS))
        assert held * ep * pm.spec.axis_size("tp") == total, (rank, held, total)


CASES = [(mixtral, dict(ep=2), 2, 2), (mixtral, dict(ep=4), 4, 1),
         (mixtral, dict(ep=2, tp=2), 2, 1), (mixtral, dict(dp=2, ep=2), 4, 1),
         (qwen3_moe, dict(ep=2), 2, 1)]


@pytest.mark.parametrize("build,axes,batch,layers", CASES,
                         ids=["mixtral-ep2", "mixtral-ep4", "mixtral-ep2tp2", "mixtral-dp2ep2",
                              "qwen3_moe-ep2"])
def test_logits_equal_one_device_with_whole_experts_per_rank(build, axes, batch, layers):
    model = build(layers)
    ids = _ids(batch)
    with torch.no_grad():
        want = model(ids).logits
    pm = _parallel(model, axes)
    with torch.no_grad():
        got = pm(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ep = axes["ep"]
    _expert_layers_checked(pm, model, ep, layers)
    e = pm.explain()
    assert e.passes["expert_parallel_pass"] == {
        "moe_layers": layers, "dispatches": layers, "combines": layers,
        "experts_per_rank": 4 // ep}, e.passes
    for rank in range(pm.spec.world_size):
        on_ep = Counter(c.op for c in e.collectives[rank] if c.axis == "ep")
        # per MoE layer: one counts exchange, the rows out and back; on ep the only gather
        # is of the returned logits (never the tokens)
        assert on_ep["expert_counts"] == on_ep["expert_dispatch"] == \
            on_ep["expert_combine"] == layers, on_ep
        gathers = [c for c in e.collectives[rank] if c.axis == "ep" and c.op == "all_gather"]
        assert [c.module for c in gathers] == [""], gathers
    code = pm.rank_module(0).code
    assert "fxshard.expert_dispatch" in code and "fxshard.expert_combine" in code
    pm.close()


def test_ep_errors_name_the_axis_and_the_fix():
    ids = _ids(2)
    with pytest.raises(ValueError, match=r"routed rows .* not split on ep=4.*multiple of"):
        _parallel(mixtral(1), dict(ep=4))(ids)
    import torch.nn as nn
    dense = nn.Sequential(nn.Embedding(128, 16), nn.Linear(16, 16))
    with pytest.raises(NotImplementedError, match=r"ep=2 but the model has no grouped-matmul "
                                                  r"MoE experts.*use dp instead of ep"):
        _parallel(dense, dict(ep=2))(ids)
    three = mixtral(1)
    with pytest.raises(ValueError, match=r"has 4 experts, which ep=3 .* cannot split"):
        mesh = fxshard.init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
        fxshard.parallelize(three, mesh)(_ids(3))


def _force_routing(model, plus: list[int], minus: list[int]) -> None:
    """Route every token by its id alone: even ids put 10 in hidden coordinate 0, odd ids in
    coordinate 1, which attention and the experts leave alone (their output rows 0 and 1
    zeroed); the router reads only those coordinates, so an even id's experts are the top-k
    of ``plus`` (an odd id's of ``minus``), equal scores tying exactly."""
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, :2] = 0
        emb[0::2, 0] = 10
        emb[1::2, 1] = 10
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:2] = 0
            layer.mlp.experts.down_proj[:, :2] = 0
            gate = layer.mlp.gate.weight
            gate.zero_()
            gate[:, 0] = torch.tensor(plus, dtype=gate.dtype)
            gate[:, 1] = torch.tensor(minus, dtype=gate.dtype)


@pytest.fixture(scope="module")
def forced():
    model = mixtral(1)
    pm = _parallel(model, dict(ep=2))
    yield model, pm
    pm.close()


@settings(max_examples=8)
@given(plus=st.lists(st.integers(-2, 2), min_size=4, max_size=4),
       minus=st.lists(st.integers(-2, 2), min_size=4, max_size=4),
       ids=st.lists(st.integers(0, 127), min_size=16, max_size=16),
       one_group=st.booleans())
def test_forced_routing_equals_one_device(forced, plus, minus, ids, one_group):
    model, pm = forced
    _force_routing(model, plus, minus)
    pm.load_state_dict(model.state_dict())
    ids = torch.tensor(ids).view(2, 8)
    if one_group:   # every token even: the same top-2 experts for all
        ids = ids - ids % 2
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_every_token_to_one_expert_and_a_rank_with_none(forced):
    """Top-2 on experts 0 and 1 (both on ep rank 0) for every token: rank 1 receives no row,
    experts 2 and 3 none; then every token on rank 1's experts."""
    model, pm = forced
    ids = _ids(2, seed=3)
    for plus in ([2, 1, 0, -1], [-1, 0, 2, 1]):
        _force_routing(model, plus, plus)
        pm.load_state_dict(model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    import transformers as T
    cfg = T.MixtralConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=1, **_common(1))
    top1 = _make(T.MixtralForCausalLM, cfg)
    _force_routing(top1, [0, 0, 3, 0], [0, 0, 3, 0])   # every token to expert 2 (rank 1)
    pm1 = _parallel(top1, dict(ep=2))
    with torch.no_grad():
        torch.testing.assert_close(pm1(ids).logits, top1(ids).logits, rtol=1e-4, atol=1e-4)
    assert math.isclose(pm1.explain().passes["expert_parallel_pass"]["moe_layers"], 1)
    pm1.close()


def test_generate_routes_prefill_and_decode_through_ep():
    """Greedy generation on ep2 (each decode step's one token per sequence still reaches its
    experts' ranks) equals one device's."""
    model = mixtral(2)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = _parallel(model, dict(ep=2))
    got = pm.generate(ids, max_new_tokens=5)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want), (got, want)
    pm.close()


@settings(max_examples=10)
@given(n=st.integers(2, 3), local=st.integers(1, 3), rows=st.integers(1, 6), data=st.data())
def test_exchange_ops_route_each_row_to_its_experts_rank(n, local, rows, data):
    """``expert_counts`` / ``expert_dispatch`` / ``expert_combine`` on a simulated axis against
    a loop: rank j gets, expert by expert and source by source, the rows routed to its experts
    (then zeros up to n * rows); the combine gives every rank its own rows back."""
    from fxshard.runtime.simulated import SimulatedWorld
    ops = torch.ops.fxshard
    E = n * local
    ids = [sorted(data.draw(st.lists(st.integers(0, E - 1), min_size=rows, max_size=rows)))
           for _ in range(n)]
    xs = [torch.randn(rows, 3) for _ in range(n)]

    def run(r):
        offs = torch.cumsum(torch.bincount(torch.tensor(ids[r]), minlength=E), 0).int()
        counts = ops.expert_counts(offs, "ep", n)
        sent = ops.expert_dispatch(xs[r], offs, counts, "ep", n)
        return counts, sent, ops.expert_combine(sent * 2, offs, counts, "ep", n)

    mesh = fxshard.init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))
    with SimulatedWorld(mesh) as world:
        results = world.run(run)
    for j, (counts, sent, back) in enumerate(results):
        mine = range(j * local, (j + 1) * local)
        want = [xs[s][i] for e in mine for s in range(n) for i in range(rows) if ids[s][i] == e]
        assert counts.tolist() == [[ids[s].count(e) for e in mine] for s in range(n)]
        assert sent.shape == (n * rows, 3)
        got = sent[:len(want)]
        assert torch.equal(got, torch.stack(want) if want else got)
        assert not sent[len(want):].any()
        assert torch.equal(back, xs[j] * 2)
