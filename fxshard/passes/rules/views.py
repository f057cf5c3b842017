"""View and layout ops: dimension maps from input dims to output dims.

Reshapes use one rule: a shard on input dim ``d`` survives as a shard on output dim ``e`` when
the dims before them hold the same number of elements and ``e`` divides by the axis size, so
each rank's block is the same elements before and after. That covers merging and splitting::

    view([B, S, H*D] -> [B, S, H, D])     S(2) -> S(2)   (heads; H % tp == 0)
    reshape([B, H, S, D] -> [B, H*S, D])  S(1) -> S(1)
    view([B, S, H*D] -> [B, S, H, D])     S(2) -> needs R when H % tp != 0

Transpose/permute map dims; unsqueeze/squeeze/expand shift them; slicing, selecting, splitting
or concatenating along a sharded dim needs it whole first. A fused projection's
``StridedShard(d, parts)`` survives reshapes that keep dim ``d`` whole, and slicing or splitting
``d`` into its parts gives each part a plain ``Shard(d)`` (``localize`` divides the bounds)::

    slice(qkv: S(2|64+32+32), 2, 64, 96)     -> S(2)      (local bounds 32..48 on tp=2)
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard
from . import Decision, RuleCtx, rule
from .linear import fused_out, split_intervals

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def reshape_dim_map(in_shape, out_shape, d: int, size: int) -> int | None:
    """Output dim that carries a ``size``-way shard of input dim ``d``, or None."""
    prefix = math.prod(in_shape[:d])
    acc = 1
    for e, n in enumerate(out_shape):
        if acc == prefix and n != 1:
            return e if n % size == 0 and math.prod(out_shape[e:]) == math.prod(in_shape[d:]) \
                else None
        acc *= n
        if acc > prefix:
            return None
    return None


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
      aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
      aten.flatten.using_ints, aten.unflatten.int)
def reshape_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    in_shape, out_shape = ctx.shape(node.args[0]), ctx.shape(node)
    if isinstance(p, StridedShard):
        before = math.prod(in_shape[:p.dim])
        for e, n in enumerate(out_shape):
            if n == in_shape[p.dim] and math.prod(out_shape[:e]) == before:
                return Decision(ins=[p], out=replace(p, dim=e))
        e = None if p.whole else _unmerge_dim(in_shape, out_shape, p)
        if e is not None:
            return Decision(ins=[p], out=Shard(e))
        q = _rescale_rows(in_shape, out_shape, p)
        if q is not None and p.whole:   # (whole parts: only when every split part's heads
            q = replace(q, whole=p.whole)   # split evenly, the whole ones kept whole)
            if any(k % ctx.size for j, k in enumerate(q.parts) if j not in q.whole):
                q = None
        if q is not None:
            return Decision(ins=[p], out=q)
        return Decision(ins=[R], out=R)
    if isinstance(p, Shard):
        e = reshape_dim_map(in_shape, out_shape, p.dim, ctx.chunks)
        if e is not None:
            return Decision(ins=[p], out=Shard(e))
        merged = _merge_dim(in_shape, out_shape, p.dim)
        if merged is not None and in_shape[p.dim] % ctx.chunks == 0:
            return Decision(ins=[p], out=merged)
    return Decision(ins=[R], out=R)


def _merge_dim(in_shape, out_shape, d: int) -> StridedShard | None:
    """``[B, S, H] -> [B*S, H]`` with S sharded: each rank's rows are its share of every run of
    ``S`` (a ``StridedShard`` with ``B`` equal parts; GPT-2's ``Conv1D`` flattens tokens so)."""
    for a in range(d):
        for e in range(len(out_shape)):
            if math.prod(out_shape[:e]) == math.prod(in_shape[:a]) and \
                    out_shape[e] == math.prod(in_shape[a:d + 1]) and \
                    math.prod(out_shape[e + 1:]) == math.prod(in_shape[d + 1:]):
                return StridedShard(e, (in_shape[d],) * math.prod(in_shape[a:d]))
    return None


def _rescale_rows(in_shape, out_shape, p: StridedShard) -> StridedShard | None:
    """``[T, k] -> [T*k]`` or ``[T*k, H] -> [T, k, H]`` (MoE routing pairs): the strided dim
    merged with, or split off, dims after it; every part grows or shrinks by that factor."""
    d = p.dim
    before, after = math.prod(in_shape[:d]), math.prod(in_shape[d + 1:])
    for e, n in enumerate(out_shape):
        if math.prod(out_shape[:e]) != before:
            continue
        rest = math.prod(out_shape[e + 1:])
        if n % in_shape[d] == 0 and after % (n // in_shape[d]) == 0 and \
                rest == after // (n // in_shape[d]):
            m = n // in_shape[d]
            if any(math.prod(in_shape[d + 1:d + j]) == m for j in range(1, len(in_shape) - d + 1)):
                return StridedShard(e, tuple(k * m for k in p.parts))
        if in_shape[d] % n == 0 and rest == after * (in_shape[d] // n):
            m = in_shape[d] // n
            if all(k % m == 0 for k in p.parts) and \
                    any(math.prod(out_shape[e + 1:e + j]) == m
                        for j in range(1, len(out_shape) - e + 1)):
                return StridedShard(e, tuple(k // m for k in p.parts))
    return None


def _unmerge_dim(in_shape, out_shape, p: StridedShard) -> int | None:
    """The inverse of :func:`_merge_dim`: ``[B*S, H] -> [B, S, H]`` gives back ``Shard`` of S."""
    k = p.parts[0]
    if any(x != k for x in p.parts):
        return None
    before = math.prod(in_shape[:p.dim])
    for e in range(1, len(out_shape)):
        if out_shape[e] == k and math.prod(out_shape[:e]) == before * len(p.parts) and \
                math.prod(out_shape[e + 1:]) == math.prod(in_shape[p.dim + 1:]):
            return e
    return None


@rule(aten.repeat.default)
def repeat_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``repeat(x, sizes)`` tiles ``x`` (aligned to the right of ``sizes``): a shard of a dim
    repeated once passes (BLOOM repeats its ALiBi slopes along the batch)."""
    p = ins[0]
    sizes = list(node.args[1])
    if isinstance(p, Shard):
        e = p.dim + len(sizes) - ctx.ndim(node.args[0])
        if sizes[e] == 1:
            return Decision(ins=[p], out=Shard(e))
    return Decision(ins=[R], out=R)


@rule(aten.expand.default)
def expand_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    if isinstance(p, (Shard, StridedShard)):
        in_shape, out_shape = ctx.shape(node.args[0]), ctx.shape(node)
        e = p.dim + len(out_shape) - len(in_shape)
        if in_shape[p.dim] == out_shape[e]:   # a dim not expanded keeps its (strided) shard
            return Decision(ins=[p], out=replace(p, dim=e) if isinstance(p, StridedShard)
                            else Shard(e))
    return Decision(ins=[R], out=R)


def permutation(node: fx.Node, ndim: int) -> list[int]:
    """perm[out_dim] = in_dim."""
    if node.target is aten.permute.default:
        return [_norm(d, ndim) for d in node.args[1]]
    if node.target is aten.numpy_T.default:     # ``x.T``: every dim reversed
        return list(range(ndim))[::-1]
    perm = list(range(ndim))
    if node.target is aten.t.default:
        d0, d1 = 0, ndim - 1
    else:
        d0, d1 = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


@rule(aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default)
def permute_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Shard):
        perm = permutation(node, ctx.ndim(node.args[0]))
        return Decision(ins=[p], out=Shard(perm.index(p.dim)))
    if isinstance(p, StridedShard):
        perm = permutation(node, ctx.ndim(node.args[0]))
        return Decision(ins=[p], out=replace(p, dim=perm.index(p.dim)))
    return Decision(ins=[p], out=p)


@rule(aten.slice.Tensor)
def slice_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    x = node.args[0]
    ndim = ctx.ndim(x)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, ndim)
    if isinstance(p, StridedShard):
        if p.dim != dim:
            return Decision(ins=[p], out=p)
        (start, end), = split_intervals(node, dim) or [(None, None)]
        out = fused_out(p, start, end) if start is not None else None
        return Decision(ins=[p], out=out) if out is not None else Decision(ins=[R], out=R)
    if isinstance(p, Shard) and p.dim == dim:
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = ctx.shape(x)[dim]
        whole = (start in (None, 0)) and (end is None or end >= size) and step == 1
        # every step-th entry from start < step (gpt-oss's interleaved gate/up, x[..., ::2] and
        # x[..., 1::2]): local when each rank's block starts at a multiple of the step
        strided = step > 1 and (start or 0) in range(step) and \
            (end is None or end >= size) and (size // ctx.chunks) % step == 0 and \
            size % ctx.chunks == 0
        if not whole and not strided:
            return Decision(ins=[R], out=R)
    return Decision(ins=[p], out=p)


@rule(aten.select.int)
def select_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    dim = _norm(node.args[1], ctx.ndim(node.args[0]))
    if isinstance(p, Shard):
        if p.dim == dim:
            return Decision(ins=[R], out=R)
        return Decision(ins=[p], out=Shard(p.dim - (p.dim > dim)))
    if isinstance(p, StridedShard):
        if p.dim == dim:  # one index of a fused dim: gather the parts, then pick
            return Decision(ins=[R], out=R)
        return Decision(ins=[p], out=replace(p, dim=p.dim - (p.dim > dim)))
    return Decision(ins=[p], out=p)


@rule(aten.cat.default)
def cat_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    from . import tensor_inputs
    tensors = tensor_inputs(node)
    ndim = ctx.ndim(node)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, ndim)
    live = [t.meta["val"].dim() == ndim for t in tensors]  # cat skips legacy empty [0] inputs
    for t, p, ok in zip(tensors, ins, live):
        if ok and isinstance(p, Shard) and p.dim != dim:
            return Decision(ins=[Shard(p.dim) if o else R for o in live], out=Shard(p.dim))
    if all(isinstance(p, Partial) for p in ins):
        return Decision(ins=[P] * len(ins), out=P)
    sizes = tuple(ctx.shape(t)[dim] for t, ok in zip(tensors, live) if ok)
    if ctx.is_tp and len(sizes) > 1 and all(k % ctx.size == 0 for k in sizes) and \
            all(p == Shard(dim) for p, ok in zip(ins, live) if ok):
        # parts each split on the cat dim (the gradient of a fused projection's q, k, v or
        # gate, up): the local cat is the fused layout, part by part, with no gather
        return Decision(ins=[Shard(dim) if o else R for o in live],
                        out=StridedShard(dim, sizes))
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
      aten.unbind.int, aten.narrow.default)
def split_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    x = node.args[0]
    ndim = ctx.ndim(x)
    default = 0
    if node.target is aten.narrow.default:
        dim = _norm(node.args[1], ndim)
    elif node.target is aten.unbind.int:
        dim = _norm(node.args[1] if len(node.args) > 1 else default, ndim)
    else:
        dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
    val = node.meta["val"]
    n = len(val) if isinstance(val, (list, tuple)) else None

    def outs(q):
        return [q] * n if n is not None else q

    if isinstance(p, StridedShard) and p.dim == dim:
        pieces = split_intervals(node, dim) if node.target is not aten.narrow.default and \
            node.target is not aten.unbind.int else None
        got = [fused_out(p, a, b) for a, b in pieces or []]
        if pieces and all(q is not None for q in got) and n == len(got):
            return Decision(ins=[p], out=got)
        return Decision(ins=[R], out=outs(R))
    if isinstance(p, StridedShard) and node.target is aten.unbind.int:
        return Decision(ins=[R], out=outs(R))
    if isinstance(p, Shard):
        if p.dim == dim:
            return Decision(ins=[R], out=outs(R))
        if node.target is aten.unbind.int:
            return Decision(ins=[p], out=outs(Shard(p.dim - (p.dim > dim))))
    return Decision(ins=[p], out=outs(p))


@rule(aten.stack.default)
def stack_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``stack(xs, dim)``: a new dim at ``dim``; a shard of an input dim (all inputs alike, as
    in interleaved RoPE's ``stack((-x2, x1), -1)``) moves past it, partials stay partial."""
    ndim = ctx.ndim(node)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, ndim)
    for p in ins:
        if isinstance(p, Shard):
            return Decision(ins=[p] * len(ins), out=Shard(p.dim + (p.dim >= dim)))
    if ins and all(isinstance(p, Partial) for p in ins):
        return Decision(ins=[P] * len(ins), out=P)
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.slice_scatter.default, aten.select_scatter.default)
def slice_scatter_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``slice_scatter(self, src, dim, start, end, step)`` (a functionalised ``x[..., a:b] = y``:
    HF DeepSeek-V3 writes the rotary part of its query heads so) and ``select_scatter(self,
    src, dim, index)``: a shard of another dim of ``self`` and ``src`` (same size there)
    passes through; two partial sums give a partial sum (the write is linear in both); the
    written dim must be whole."""
    from . import tensor_inputs
    tensors = tensor_inputs(node)
    if len(tensors) != 2:
        return Decision(ins=[R] * len(ins), out=R)
    self_shape, src_shape = ctx.shape(tensors[0]), ctx.shape(tensors[1])
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0),
                len(self_shape))
    select = node.target is aten.select_scatter.default

    def src_dim(d: int) -> int | None:   # the dim of src that dim d of self maps to
        if d == dim:
            return None
        sd = d - (select and d > dim)
        return sd if src_shape[sd] == self_shape[d] else None

    for p, from_src in ((ins[0], False), (ins[1], True)):
        if not isinstance(p, Shard):
            continue
        d = p.dim + (select and from_src and p.dim >= dim) if from_src else p.dim
        sd = src_dim(d)
        if sd is not None:
            return Decision(ins=[Shard(d), Shard(sd)], out=Shard(d))
    if all(isinstance(p, Partial) for p in ins):
        return Decision(ins=[P, P], out=P)
    return Decision(ins=[R, R], out=R)
