"""``fsdp``: parameters stored sharded over the axis, used whole on it (ZeRO-3 / FSDP2).

Propagation places every op on ``fsdp`` as on ``dp`` (the batch is split, a parameter is used
Replicate). :func:`fsdp_storage_pass` then gives each parameter the placement it is *stored*
in: ``S(d)`` on fsdp, with the used placement as ``fxshard_then`` (the placement a value moves
to right after it is made), so ``insert_collectives`` adds one all-gather per parameter, placed
before its first use. In training the gradient (a partial sum over the batch-split data) must
leave in the stored placement: a reduce-scatter ``P -> S(d)``. The rank programs then group
these per layer (:mod:`fxshard.passes.fsdp_buckets`: one all-gather, one reduce-scatter per
layer, as FSDP2).

The dim: 0 when it divides, else the first that does. Shards of one dim by several axes nest
in mesh order; fsdp's all-gather is a plain concatenation only when no axis after fsdp in the
mesh (inner) shards the same dim, so such dims come last (still correct: the redistribution
then gathers the inner axis too). No dim dividing is a ValueError naming the parameter.

Before (mesh (fsdp=2, tp=2), a column-parallel weight)::

    w_q    [48, 48]   spec (R, S(0))
    t = t(w_q);  mm = mm(x, t)

After::

    w_q    [48, 48]   spec (S(1), S(0))  then (R, S(0))      # local [24, 24]
    all_gather = fxshard.all_gather(w_q, 1, 'fsdp', 2)         # local [24, 48]
    t = t(all_gather);  mm = mm(x, t)
"""
from __future__ import annotations

import torch.fx as fx

from ..mesh import FSDP, MeshSpec
from ..placement import R, Shard, StridedShard, local_shape, shard_dim
from . import PassCtx

__all__ = ["AXIS", "used_spec", "stored_spec", "fsdp_storage_pass"]

AXIS = FSDP


def _index(mesh: MeshSpec) -> int | None:
    if AXIS not in mesh.axis_names or mesh.axis_size(AXIS) == 1:
        return None
    return mesh.axis_names.index(AXIS)


def used_spec(spec: tuple, mesh: MeshSpec) -> tuple:
    """The placement a parameter stored as ``spec`` is used in: whole on fsdp."""
    i = _index(mesh)
    if i is None:
        return tuple(spec)
    return tuple(R if j == i else p for j, p in enumerate(spec))


def stored_spec(fqn: str, shape: tuple, used: tuple, mesh: MeshSpec) -> tuple:
    """``used`` with fsdp's placement set to the shard the parameter is stored in."""
    i = _index(mesh)
    if i is None:
        return tuple(used)
    used = used_spec(used, mesh)
    n = mesh.shape[i]
    plain, nested = [], []
    for d in range(len(shape)):
        others = [(j, p) for j, p in enumerate(used) if j != i and mesh.shape[j] > 1
                  and shard_dim(p) == d]
        if any(isinstance(p, StridedShard) for _, p in others):
            continue   # a fused dim's parts are split part by part: leave it to that axis
        spec = tuple(Shard(d) if j == i else p for j, p in enumerate(used))
        try:
            local_shape(shape, spec, mesh)
        except ValueError:
            continue
        (nested if any(j > i for j, _ in others) else plain).append(spec)
    if plain or nested:
        return (plain or nested)[0]
    raise ValueError(
        f"fxshard: parameter {fqn} of shape {tuple(shape)} cannot be sharded over mesh axis "
        f"{AXIS!r} of size {n} (mesh {mesh.describe()}, used as {used}): no dim has a size "
        f"that divides by {n} (after the other axes' shards). Use an {AXIS} size that divides "
        f"one of its dims, or put that parallelism on 'dp' (weights replicated).")


def fsdp_storage_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Set every parameter placeholder's stored placement (see the module docstring)."""
    if _index(ctx.mesh) is None:
        return gm
    sharded = 0
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param")
        if node.op != "placeholder" or fqn is None:
            continue
        used = tuple(node.meta["fxshard_spec"])
        stored = stored_spec(fqn, tuple(node.meta["val"].shape), used, ctx.mesh)
        if stored != used:
            node.meta["fxshard_spec"] = stored
            node.meta["fxshard_then"] = used
            sharded += 1
    ctx.report("fsdp_storage_pass", changed=False, parameters_sharded=sharded)
    return gm
