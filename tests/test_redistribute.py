"""Redistribution: hypothesis-drawn mesh (<= 3 axes, <= 8 ranks), tensor (sizes that do not
divide too), source and target placements. The steps run on a simulated mesh; the result must
be the target slicing of the global tensor, or a ValueError naming tensor, dim, size and axis."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from fxshard.mesh import AXIS_NAMES, MeshSpec
from fxshard.passes.insert_collectives import collective_target
from fxshard.passes.redistribute import plan_redistribution
from fxshard.placement import Partial, Replicate, Shard, local_block, local_shape
from fxshard.runtime.simulated import SimulatedWorld
from fxshard.testing import assemble_check


@st.composite
def cases(draw):
    n_axes = draw(st.integers(1, 3))
    names = draw(st.permutations(AXIS_NAMES))[:n_axes]
    shape = [draw(st.integers(1, 3)) for _ in names]
    while math.prod(shape) > 8:
        shape[shape.index(max(shape))] -= 1
    mesh = MeshSpec(tuple(shape), tuple(names))
    ndim = draw(st.integers(1, 3))
    # mostly sizes that split over these axes (12 and 24 do over any 2 or 3 of them), a few
    # that do not, so both the redistribution and the refusal are exercised
    tshape = tuple(draw(st.sampled_from([12, 24, 12, 6, 4, 5, 7, 1])) for _ in range(ndim))
    opts = [Replicate(), Partial()] + [Shard(d) for d in range(ndim)]
    src = tuple(draw(st.sampled_from(opts)) for _ in names)
    dst = tuple(draw(st.sampled_from(opts[:1] + opts[2:])) for _ in names)  # no R->P
    if any(isinstance(p, Partial) for p in dst):
        dst = tuple(Replicate() if isinstance(p, Partial) else p for p in dst)
    keep_p = draw(st.booleans())
    if keep_p:  # a partial that stays partial
        dst = tuple(s if isinstance(s, Partial) else d for s, d in zip(src, dst))
    active = [n > 1 for n in mesh.shape]
    assume([p for p, a in zip(src, active) if a] != [p for p, a in zip(dst, active) if a])
    return mesh, tshape, src, dst


def run_steps(mesh, x, src, dst):
    steps = plan_redistribution(src, dst, mesh)

    def rank(r):
        t = local_block(x, src, mesh, r)
        for s in steps:
            t = collective_target(s.op)(t, *s.args, s.axis, s.size)
        return t
    with SimulatedWorld(mesh) as world:
        return world.run(rank), steps


S, R_, P_ = Shard, Replicate(), Partial()
NESTED = MeshSpec((2, 3, 2), ("dp", "tp", "ulysses_cp"))


@example((NESTED, (12, 24), (S(1), S(1), S(1)), (R_, S(0), S(1))))
@example((NESTED, (12, 24), (S(0), P_, S(0)), (S(0), S(0), S(1))))
@example((NESTED, (12, 24), (S(1), S(0), P_), (S(0), S(1), S(1))))
@example((NESTED, (12, 12, 4), (R_, S(2), S(1)), (S(1), S(1), S(2))))
@given(cases())
def test_redistribute_matches_target_slicing(case):
    mesh, tshape, src, dst = case
    x = torch.randn(tshape)
    try:
        local_shape(tshape, src, mesh)
        local_shape(tshape, dst, mesh)
    except ValueError as e:
        msg = str(e)
        assert "dim" in msg and "axis" in msg and str(tshape) in msg.replace(" ", "").replace(
            ",)", ")") or "does not divide" in msg
        return
    outs, steps = run_steps(mesh, x, src, dst)
    assemble_check(x, outs, dst, mesh, rtol=1e-5, atol=1e-5)
    for s in steps:
        assert s.op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all",
                        "local_shard")


def test_single_axis_table():
    mesh = MeshSpec((2,), ("tp",))
    table = {
        ((Shard(1),), (Replicate(),)): "all_gather",
        ((Partial(),), (Replicate(),)): "all_reduce",
        ((Partial(),), (Shard(0),)): "reduce_scatter",
        ((Shard(0),), (Shard(1),)): "all_to_all",
        ((Replicate(),), (Shard(1),)): "local_shard",
    }
    for (src, dst), op in table.items():
        steps = plan_redistribution(src, dst, mesh)
        assert [s.op for s in steps] == [op]


def test_nested_shards_gather_inner_axis_first():
    mesh = MeshSpec((2, 2), ("dp", "tp"))
    steps = plan_redistribution((Shard(1), Shard(1)), (Replicate(), Shard(1)), mesh)
    assert [(s.op, s.axis) for s in steps] == [("all_gather", "tp"), ("all_gather", "dp"),
                                               ("local_shard", "tp")]
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    outs, _ = run_steps(mesh, x, (Shard(1), Shard(1)), (Replicate(), Shard(1)))
    assemble_check(x, outs, (Replicate(), Shard(1)), mesh)


def test_uneven_dim_is_a_value_error_naming_dim_size_axis():
    mesh = MeshSpec((3,), ("tp",))
    with pytest.raises(ValueError, match=r"dim 1 .*axis 'tp' of size 3.*7 elements"):
        local_shape((4, 7), (Shard(1),), mesh, what="activation x")



def _run_chain(mesh, x, src, dst):
    """The graph ``insert_collectives`` emits from ``src`` to ``dst``, run on every rank of a
    simulated mesh; returns the rank blocks and the emitted fxshard ops."""
    import torch.fx as fx

    from fxshard.passes import PassCtx
    from fxshard.passes.insert_collectives import _chain
    g = fx.Graph()
    node = g.placeholder("x")
    node.meta.update({"val": x, "fxshard_spec": src})
    end, _ = _chain(g, node, src, dst, PassCtx(mesh=mesh))
    g.output(end)
    gm = fx.GraphModule(torch.nn.Module(), g)
    ops = [(str(n.target).split(".")[1], n.args[-2]) for n in g.nodes
           if str(n.target).startswith("fxshard.")]
    with SimulatedWorld(mesh) as world:
        return world.run(lambda r: gm(local_block(x, src, mesh, r))), ops


def _fused(*parts, whole=()):
    from fxshard.placement import StridedShard
    return StridedShard(1, parts, frozenset(whole))


TP2, TP3, DP_TP = (((2,), ("tp",)), ((3,), ("tp",)), ((2, 2), ("dp", "tp")))


@pytest.mark.parametrize("mesh,src,dst,ops", [
    (TP2, (R_,), (_fused(8, 4, 4),), [("local_shard", "tp")] * 3),
    (TP2, (P_,), (_fused(8, 4, 4),), [("reduce_scatter", "tp")]),
    (TP3, (P_,), (_fused(6, 6, 6, 6),), [("reduce_scatter", "tp")]),
    (TP2, (S(1),), (_fused(8, 4, 4),), [("all_gather", "tp")] + [("local_shard", "tp")] * 3),
    (TP2, (S(0),), (_fused(8, 4, 4),), [("all_gather", "tp")] + [("local_shard", "tp")] * 3),
    # parts kept whole (a multi-query qkv's one K/V head) are not sliced
    (TP2, (R_,), (_fused(8, 4, 4, whole={1, 2}),), [("local_shard", "tp")]),
    (TP2, (P_,), (_fused(8, 4, 4, whole={1, 2}),), [("all_reduce", "tp"), ("local_shard", "tp")]),
    # an outer dp shard of the fused dim (a flattened [B*S] whose batch dp splits): runs of
    # the equal part size inside each dp chunk
    (DP_TP, (S(1), R_), (S(1), _fused(4, 4, 4, 4)), [("local_shard", "tp")] * 2),
    (DP_TP, (S(1), P_), (S(1), _fused(4, 4, 4, 4)), [("reduce_scatter", "tp")]),
    (DP_TP, (R_, S(1)), (S(1), _fused(4, 4, 4, 4)),
     [("all_gather", "tp"), ("local_shard", "dp")] + [("local_shard", "tp")] * 2),
])
def test_redistribute_into_a_fused_shard(mesh, src, dst, ops):
    """From Replicate, Partial or a plain Shard into ``S(1|parts)`` on tp: every rank holds
    its share of every part (``placement.local_block``), by local slices (no communication),
    one reduce-scatter after a local re-order, or an all-gather and the slices."""
    mesh = MeshSpec(*mesh)
    x = torch.randn(6, sum(dst[-1].parts))
    outs, emitted = _run_chain(mesh, x, src, dst)
    assert emitted == ops, emitted
    for r, out in enumerate(outs):
        torch.testing.assert_close(out, local_block(x, dst, mesh, r), msg=f"rank {r}")
