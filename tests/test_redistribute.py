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
