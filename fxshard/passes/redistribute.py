"""The redistribution table: from one spec to another as a list of collective steps.

Per mesh axis::

    S(d) -> R      all_gather(dim=d)
    P    -> R      all_reduce
    P    -> S(d)   reduce_scatter(dim=d)
    S(a) -> S(b)   all_to_all(split_dim=b, concat_dim=a)
    R    -> S(d)   local_shard(dim=d)            (no communication)
    R    -> P      partial_from_replicate        (coordinate 0 keeps it, the others zeros)
    S(d|parts) -> R  fused_gather: all_gather(dim=d), then the pieces re-ordered part by part
    R    -> S(d|parts)  fused_shard: split into the parts, local_shard each, cat
                     (no communication; zigzag_shard per part on ``ring_cp``)
    P    -> S(d|parts)  fused_reduce_scatter: a local re-order (rank-major: every part's
                     chunk r side by side for rank r), then one reduce_scatter(dim=d): the
                     bytes of a plain reduce-scatter (on ``ring_cp``, or with parts kept
                     whole: all_reduce, then fused_shard)
    S(e) -> S(d|parts)  all_gather(dim=e), then fused_shard: the bytes of a plain all-gather
                     (an all-to-all would move 1/n of them but needs a re-order per part)

On the ``ring_cp`` axis the sequence is sharded zigzag (``zigzag_shard``/``zigzag_gather``).

Several axes change one at a time. Shards of one dim by several axes nest in mesh order, so an
outer axis may only be gathered (or sliced) while no inner axis shards that dim: gathers run
innermost axis first, slices outermost first, and an inner shard that is in the way is
gathered and sliced again. Example, mesh (a=2, b=2)::

    (S(1), S(1)) -> (R, S(1))    all_gather(1, b); all_gather(1, a); local_shard(1, b)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..mesh import MeshSpec
from ..placement import R, Partial, Replicate, Shard, StridedShard

__all__ = ["Step", "plan_redistribution"]


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one mesh axis; ``after`` is the spec it produces."""

    op: str
    axis: str
    size: int
    args: tuple
    after: tuple


def _touches(p, dim) -> bool:
    return isinstance(p, Shard) and p.dim == dim


def plan_redistribution(src: tuple, dst: tuple, mesh: MeshSpec,
                        zigzag_axes: tuple[str, ...] = ()) -> list[Step]:
    """Steps that turn a tensor laid out as ``src`` into ``dst`` (both one placement per axis).

    On ``zigzag_axes`` a shard is the zigzag layout ring attention balances causal work with
    (rank j holds chunks j and 2n-1-j of 2n): it is made by ``zigzag_shard`` and undone by
    ``zigzag_gather``, never by a reduce-scatter or all-to-all (whose chunks are contiguous)."""
    zigzag = {i for i, a in enumerate(mesh.axis_names) if a in zigzag_axes}
    axes = [i for i, n in enumerate(mesh.shape) if n > 1]
    src = tuple(p if n > 1 else R for p, n in zip(src, mesh.shape))  # size-1 axes are off
    dst = tuple(p if n > 1 else R for p, n in zip(dst, mesh.shape))
    cur = list(src)
    changing = [i for i in axes if src[i] != dst[i]]
    if not changing:
        return []
    # axes whose current placement must be undone (gathered / reduced) first
    undo = {i for i in changing if not isinstance(src[i], Replicate)}
    for i in changing:
        dims = {p.dim for p in (src[i], dst[i]) if isinstance(p, Shard)}
        if isinstance(dst[i], StridedShard):
            dims.add(dst[i].dim)
        for j in axes:
            if j > i and any(_touches(cur[j], d) for d in dims):
                undo.add(j)
    steps: list[Step] = []

    def emit(op, i, args, new):
        cur[i] = new
        steps.append(Step(op, mesh.axis_names[i], mesh.shape[i], args, tuple(cur)))

    def alone(i, dims) -> bool:
        """No inner axis shards any of ``dims`` now or in the target, and no outer axis still
        has to change on them. An outer axis that keeps its shard is fine: the collective then
        works inside that axis's chunk, which is the nested layout."""
        return not any((_touches(cur[j], d) or _touches(dst[j], d))
                       and (j > i or cur[j] != dst[j]) for j in axes if j != i for d in dims)

    for i in sorted(undo, reverse=True):
        s, t = cur[i], dst[i]
        if isinstance(s, StridedShard):
            if s.whole:
                raise NotImplementedError(
                    f"fxshard: no gather of a fused shard with parts kept whole, {src} -> {dst} "
                    f"(propagation keeps such a projection's parts local)")
            # gather, then put the parts back in order (rank-major -> part-major); an inner
            # axis still sharding the dim is gathered first (undo runs innermost first)
            emit("fused_gather", i, (s.dim, s.parts), R)
            continue
        if i in zigzag:
            if isinstance(s, Partial):
                emit("all_reduce", i, (), R)
            else:
                emit("zigzag_gather", i, (s.dim,), R)
            continue
        if isinstance(s, Partial):
            if isinstance(t, Shard) and alone(i, [t.dim]):
                emit("reduce_scatter", i, (t.dim,), t)
            elif isinstance(t, StridedShard) and not t.whole and alone(i, [t.dim]):
                emit("fused_reduce_scatter", i, (t.dim, t.parts), t)
            else:
                emit("all_reduce", i, (), R)
        elif isinstance(s, Shard):
            if isinstance(t, Shard) and t.dim != s.dim and alone(i, [s.dim, t.dim]):
                emit("all_to_all", i, (t.dim, s.dim), t)
            else:
                emit("all_gather", i, (s.dim,), R)
    for i in axes:
        if cur[i] == dst[i]:
            continue
        assert isinstance(cur[i], Replicate), (src, dst, cur)
        t = dst[i]
        if isinstance(t, Shard):
            emit("zigzag_shard" if i in zigzag else "local_shard", i, (t.dim,), t)
        elif isinstance(t, StridedShard):
            emit("fused_shard", i, (t.dim, t.parts), t)
        else:
            assert isinstance(t, Partial), t
            emit("partial_from_replicate", i, (), t)
    assert tuple(cur) == tuple(dst), (src, dst, cur)
    return steps
