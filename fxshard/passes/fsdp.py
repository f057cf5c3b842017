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
then gathers the inner axis too).

A parameter with no such dim is stored whole on fsdp, as on ``dp`` (``ctx.fsdp_whole`` lists
it with its bytes for ``explain()``): no all-gather, and in training its gradient (a partial
sum over the batch-split data) is all-reduced over fsdp, ``P -> R``. That is a bias of odd
length on fsdp=2, or a fused bias split part by part on tp (GPT-2's ``c_attn.bias``, 144 =
48+48+48 as ``S(0|48+48+48)``): fsdp cannot nest a plain shard inside tp's per-part split,
and a second per-part split of the same dim (``StridedShard`` on two axes) is not a layout
the weight loading (``block_pieces``), the fused gathers or the backward's fused pads
handle; such a parameter is a bias, small next to the weights.

Before (mesh (fsdp=2, tp=2), a column-parallel weight)::

    w_q    [48, 48]   spec (R, S(0))
    t = t(w_q);  mm = mm(x, t)

After::

    w_q    [48, 48]   spec (S(1), S(0))  then (R, S(0))      # local [24, 24]
    all_gather = fxshard.all_gather(w_q, 1, 'fsdp', 2)         # local [24, 48]
    t = t(all_gather);  mm = mm(x, t)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..mesh import FSDP, MeshSpec
from ..placement import R, Shard, StridedShard, local_shape, shard_dim, short
from . import PassCtx

__all__ = ["AXIS", "used_spec", "stored_spec", "why_whole", "fsdp_storage_pass"]

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


def stored_spec(shape: tuple, used: tuple, mesh: MeshSpec) -> tuple:
    """``used`` with fsdp's placement set to the shard the parameter is stored in; whole on
    fsdp (Replicate, the used placement) when no dim takes a shard (:func:`why_whole`)."""
    i = _index(mesh)
    if i is None:
        return tuple(used)
    used = used_spec(used, mesh)
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
    return (plain or nested or [used])[0]


def why_whole(shape: tuple, used: tuple, mesh: MeshSpec) -> str:
    """Why a parameter used as ``used`` takes no shard on fsdp, dim by dim (sizes after the
    other axes' shards)."""
    i = _index(mesh)
    n = mesh.shape[i]
    local = local_shape(shape, used_spec(used, mesh), mesh)
    why = []
    for d in range(len(shape)):
        fused = [p for j, p in enumerate(used) if j != i and mesh.shape[j] > 1
                 and isinstance(p, StridedShard) and p.dim == d]
        if fused:
            axis = mesh.axis_names[used.index(fused[0])]
            why.append(f"dim {d} is split part by part on {axis} ({short(fused[0])})")
        else:
            why.append(f"dim {d} has {local[d]} per shard, not divisible by {n}")
    return "; ".join(why) or "a scalar"


def fsdp_storage_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Set every parameter placeholder's stored placement (see the module docstring); list
    those kept whole on fsdp in ``ctx.fsdp_whole``: (FQN, shape, bytes per rank, why)."""
    if _index(ctx.mesh) is None:
        return gm
    ctx.fsdp_whole.clear()
    sharded = 0
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param")
        if node.op != "placeholder" or fqn is None:
            continue
        used = tuple(node.meta["fxshard_spec"])
        stored = stored_spec(tuple(node.meta["val"].shape), used, ctx.mesh)
        if stored != used:
            node.meta["fxshard_spec"] = stored
            node.meta["fxshard_then"] = used
            sharded += 1
        else:
            val = node.meta["val"]
            shape = tuple(val.shape)
            nbytes = int(torch.Size(local_shape(shape, used, ctx.mesh)).numel()) * \
                val.element_size()
            ctx.fsdp_whole.append((fqn, shape, nbytes, why_whole(shape, used, ctx.mesh)))
    ctx.report("fsdp_storage_pass", changed=False, parameters_sharded=sharded,
               kept_whole=len(ctx.fsdp_whole))
    return gm
