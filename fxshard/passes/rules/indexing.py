"""Indexing ops: a shard survives on the dims that are not looked up.

``index.Tensor(x, [None, idx])`` with the index tensors on consecutive dims ``a..b`` of ``x``
gives ``x.shape[:a] + broadcast(idx shapes) + x.shape[b+1:]``::

    index(table: R [P, D], [pos: S(1) [B, S]])      -> S(1) [B, S, D]   (RoPE table by position)
    index(x: S(0) [B, S, D], [None, idx: R [K]])    -> S(0) [B, K, D]

``gather(x, dim, idx)``, ``topk(x, k, dim)``, ``sort`` and ``argsort`` keep a shard of any dim
but ``dim``; the looked-up / sorted dim must be whole. ``repeat_interleave(x, n, dim)`` keeps a shard of
``dim`` too (each entry's copies stay next to it: a rank's KV heads become its query heads).
A partial sum indexed by replicated indices stays partial (a Partial MoE output un-permuted
by expert).

The writing side (MoE routing, HF's eager experts) mirrors it: ``index_put``, ``index_add``,
``scatter``/``scatter_add`` keep a shard of a dim they do not write along; ``index_add`` and
``scatter_add`` of rows sharded along the written dim give a partial sum (``self`` added on one
rank); ``index_put(.., accumulate=True)`` of partial values stays partial (an MoE input
gradient added back to its tokens: reduced on ``[T, H]``); ``histc`` of a shard is the partial
sum of the shards' counts::

    index_add(out: R [T, H], 0, idx: S(0) [N], src: S(0) [N, H])  -> out P (ins P, S(0), S(0))
    histc(ids: S(0) [N], bins=E)                                   -> counts P [E]
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard, shard_dim
from . import Decision, RuleCtx, rule, tensor_inputs, token_local

aten = torch.ops.aten


def rows_like(p, n_from: int, n_to: int):
    """The placement of a ``[n_to, ..]`` tensor whose rows are laid out like ``p``'s rows of a
    ``[n_from]`` one (``x[T, H]`` vs the routing's ``[T * k]`` pairs), or None."""
    if isinstance(p, Shard) and p.dim == 0:
        return p
    if isinstance(p, StridedShard) and p.dim == 0 and not p.whole and \
            all(k * n_to % n_from == 0 for k in p.parts):
        return StridedShard(0, tuple(k * n_to // n_from for k in p.parts))
    return None


@rule(aten.index.Tensor)
def index_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    indices = list(node.args[1])
    if token_local(node, ctx) and len(ins) == 2 and shard_dim(ins[1]) == 0:
        # rank-local positions into the rank's own rows (passes/moe_routing.py)
        need = rows_like(ins[1], ctx.shape(indices[0])[0], ctx.shape(x)[0])
        if need is not None:
            return Decision(ins=[need, ins[1]], out=ins[1])
    nd = ctx.ndim(x)
    where = [i for i, t in enumerate(indices) if t is not None]
    tensors = tensor_inputs(node)
    if not where or where != list(range(where[0], where[-1] + 1)) or \
            any(not isinstance(indices[i], fx.Node) for i in where) or \
            len(tensors) != 1 + len(where):
        return Decision(ins=[R] * len(ins), out=R)
    a, b = where[0], where[-1]
    idx = [indices[i] for i in where]
    bshape = tuple(torch.broadcast_shapes(*(ctx.shape(t) for t in idx)))
    bnd = len(bshape)
    px, pidx = ins[0], ins[1:]
    if isinstance(px, Partial) and not any(isinstance(p, Shard) for p in pidx):
        return Decision(ins=[P] + [R] * len(idx), out=P)   # picking addends = addends picked
    if isinstance(px, Shard) and (px.dim < a or px.dim > b):
        out = px.dim if px.dim < a else px.dim - (b - a + 1) + bnd
        return Decision(ins=[px] + [R] * len(idx), out=Shard(out))
    for t, p in zip(idx, pidx):
        if isinstance(p, Shard):
            k = p.dim + bnd - ctx.ndim(t)
            if ctx.shape(t)[p.dim] != bshape[k]:
                continue
            need = []
            for u in idx:
                d = k - (bnd - ctx.ndim(u))
                need.append(Shard(d) if d >= 0 and ctx.shape(u)[d] == bshape[k] else R)
            return Decision(ins=[R] + need, out=Shard(a + k))
    return Decision(ins=[R] * len(ins), out=R)


def _dim_arg(node: fx.Node, pos: int, default: int) -> int:
    d = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
    return d % max(RuleCtx.ndim(node.args[0]), 1)


@rule(aten.gather.default)
def gather_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``gather(x, dim, idx)``: out has idx's shape; a shard of another dim of both passes."""
    dim = _dim_arg(node, 1, 0)
    x, idx = tensor_inputs(node)[:2]
    if token_local(node, ctx) and dim == 0 and len(ins) == 2 and shard_dim(ins[1]) == 0:
        # an MoE backward takes each routed row's gradient from its token (the rank's own)
        need = rows_like(ins[1], ctx.shape(idx)[0], ctx.shape(x)[0])
        if need is not None:
            return Decision(ins=[need, ins[1]], out=ins[1])
    for p in ins[:2]:
        if isinstance(p, Shard) and p.dim != dim and \
                ctx.shape(x)[p.dim] == ctx.shape(idx)[p.dim]:
            return Decision(ins=[p, p] + [R] * (len(ins) - 2), out=Shard(p.dim))
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def topk_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``topk`` / ``sort`` along ``dim`` (default last): other dims' shards pass through."""
    if node.target is aten.topk.default:
        dim = _dim_arg(node, 2, -1)
    else:
        dim = _dim_arg(node, 1, -1)
    p = ins[0]
    if token_local(node, ctx) and shard_dim(p) == dim == 0:
        return Decision(ins=[p], out=[p, p])   # each rank sorts its own routing pairs
    if shard_dim(p) is not None and p.dim != dim:
        return Decision(ins=[p], out=[p, p])
    return Decision(ins=[R], out=[R, R])


@rule(aten.argsort.default, aten.argsort.stable)
def argsort_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``argsort`` along ``dim`` (default last; ``stable`` takes it as a keyword): like ``sort``,
    whose indices it returns."""
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 and
                          node.target is aten.argsort.default else -1)
    dim %= max(ctx.ndim(node.args[0]), 1)
    p = ins[0]
    if token_local(node, ctx) and shard_dim(p) == dim == 0:
        return Decision(ins=[p], out=p)        # each rank sorts its own routing pairs
    if shard_dim(p) is not None and p.dim != dim:
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.repeat_interleave.self_int)
def repeat_interleave_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``repeat_interleave(x, n, dim)`` repeats each entry of ``dim`` ``n`` times in place, so
    a contiguous block of ``dim`` (a rank's KV heads) becomes the contiguous block of the output
    that the same rank holds (its query heads): a shard of ``dim`` passes through too. (A
    zigzag shard's two chunks map to the output's two chunks alike.) A shard of any other
    dim passes; a given ``output_size`` becomes the local one (``rules/local_args.py``)."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    p = ins[0]
    if dim is None or not isinstance(p, Shard):
        return Decision(ins=[R], out=R)
    dim %= ctx.ndim(node.args[0])
    if p.dim != dim or isinstance(node.args[1], int):   # (a given output_size: local_args.py)
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.where.default, aten.nonzero.default, aten.argwhere.default)
def nonzero_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``torch.where(mask)`` / ``nonzero``: the positions of the true entries, a data-dependent
    count of global indices. A rank's shard would give positions within its own block (and its
    own count), so the mask is gathered first and every rank computes all the positions."""
    n = len(node.meta["val"]) if isinstance(node.meta["val"], (list, tuple)) else None
    return Decision(ins=[R], out=[R] * n if n is not None else R)


def _written_dim(node: fx.Node, pos: int) -> int:
    return node.args[pos] % max(RuleCtx.ndim(node.args[0]), 1)


@rule(aten.index_put.default)
def index_put_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``index_put(self, [i0, i1, ..], values)`` writes along the leading dims ``0..m-1``;
    ``values`` is ``broadcast(indices) + self.shape[m:]``: a shard of a later dim passes."""
    indices = list(node.args[1])
    tensors = tensor_inputs(node)
    m = len(indices)
    if token_local(node, ctx) and m == 1 and len(ins) == 3 and shard_dim(ins[1]) == 0:
        # the inverse permutation of the rank's own sort; in a backward, a gradient added
        # back to the rank's own rows (of the routing pairs, or of the tokens: ``self``'s rows
        # laid out like the pairs')
        p = ins[1]
        need = rows_like(p, ctx.shape(indices[0])[0], ctx.shape(node.args[0])[0])
        if need is not None:
            return Decision(ins=[need, p, p], out=need)
    if any(not isinstance(t, fx.Node) for t in indices) or len(tensors) != m + 2:
        return Decision(ins=[R] * len(ins), out=R)
    px, pv = ins[0], ins[-1]
    if isinstance(pv, Partial) and not any(isinstance(p, Shard) for p in ins[1:-1]) and \
            len(node.args) > 3 and node.args[3] is True:
        # self + the values added at the indices: linear in both (an MoE gradient added back
        # to its tokens is reduced once, on [T, H], not on the [T * k, H] rows)
        return Decision(ins=[P] + [R] * m + [P], out=P)
    values = node.args[2]
    if isinstance(pv, Shard) and not isinstance(px, Shard):   # self follows the values' shard
        d = pv.dim + ctx.ndim(node.args[0]) - ctx.ndim(values)
        if d >= m and ctx.shape(values)[pv.dim] == ctx.shape(node.args[0])[d]:
            px = Shard(d)
    if isinstance(px, Shard) and px.dim >= m:
        vd = px.dim - ctx.ndim(node.args[0]) + ctx.ndim(values)   # aligned from the right
        if 0 <= vd < ctx.ndim(values) and \
                ctx.shape(values)[vd] == ctx.shape(node.args[0])[px.dim]:
            return Decision(ins=[px] + [R] * m + [Shard(vd)], out=px)
        return Decision(ins=[px] + [R] * m + [R], out=px)
    return Decision(ins=[R] * len(ins), out=R)


def _added_back(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision | None:
    """Inside an expert-routing region (``passes/moe_routing.py``) on an axis that shards the
    tokens, ``scatter_add`` / ``index_add`` along dim 0 adds the rank's own sorted rows back to
    the rank's own tokens: ``self`` (the tokens) takes the rows' token shard."""
    if not token_local(node, ctx) or node.args[1] != 0 or len(ins) != 3 or \
            shard_dim(ins[1]) != 0:
        return None
    need = rows_like(ins[1], ctx.shape(node.args[2])[0], ctx.shape(node.args[0])[0])
    if need is None:
        return None
    return Decision(ins=[need, ins[1], ins[1]], out=need)


@rule(aten.index_add.default)
def index_add_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``index_add(self, dim, index, source)``: ``self[index[i]] += source[i]`` along ``dim``."""
    dim = _written_dim(node, 1)
    x, idx, src = tensor_inputs(node)[:3]
    if len(ins) != 3 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 4:
        return Decision(ins=[R] * len(ins), out=R)
    back = _added_back(node, ins, ctx)
    if back is not None:
        return back
    ps, pi, psrc = ins
    for p in (ps, psrc):
        if isinstance(p, Shard) and p.dim != dim and \
                ctx.shape(x)[p.dim] == ctx.shape(src)[p.dim]:
            return Decision(ins=[p, R, Shard(p.dim)], out=p)
    if isinstance(psrc, Shard) and psrc.dim == dim or isinstance(pi, Shard):
        return Decision(ins=[P, Shard(0), Shard(dim)], out=P)     # each rank adds its rows
    if isinstance(psrc, Partial) or isinstance(ps, Partial):
        return Decision(ins=[P, R, P], out=P)
    return Decision(ins=[R, R, R], out=R)


@rule(aten.scatter.src, aten.scatter.value, aten.scatter_add.default)
def scatter_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``scatter(self, dim, index, src | value)``: a shard of any other dim of all three (same
    size there) passes; ``scatter_add`` of partial sources onto a partial self stays partial."""
    dim = _written_dim(node, 1)
    back = _added_back(node, ins, ctx)
    if back is not None:
        return back
    tensors = tensor_inputs(node)
    shapes = [ctx.shape(t) for t in tensors]
    for p in ins:
        if isinstance(p, Shard) and p.dim != dim and \
                all(len(s) > p.dim and s[p.dim] == shapes[0][p.dim] for s in shapes):
            return Decision(ins=[Shard(p.dim)] * len(ins), out=Shard(p.dim))
    if node.target is aten.scatter_add.default and len(ins) == 3 and \
            any(isinstance(p, Partial) for p in (ins[0], ins[2])):
        return Decision(ins=[P, R, P], out=P)
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.histc.default)
def histc_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """Counts of a shard add up to the counts of the whole."""
    if shard_dim(ins[0]) is not None:
        return Decision(ins=[ins[0]], out=P)
    return Decision(ins=[R], out=R)


@rule(aten.copy.default)
def copy_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``copy(self, src)`` (a functionalised ``copy_``): ``src``'s values in ``self``'s shape
    and dtype; ``self`` only lends its shape, so it is sliced to match."""
    dst, src = tensor_inputs(node)[:2]
    out_shape, src_shape = ctx.shape(dst), ctx.shape(src)
    p = ins[1]
    if isinstance(p, Shard):
        od = p.dim + len(out_shape) - len(src_shape)
        if od >= 0 and out_shape[od] == src_shape[p.dim]:
            return Decision(ins=[Shard(od), p] + [R] * (len(ins) - 2), out=Shard(od))
    if isinstance(p, Partial) and out_shape == src_shape and \
            dst.meta["val"].dtype == src.meta["val"].dtype:
        return Decision(ins=[R, P] + [R] * (len(ins) - 2), out=P)
    if isinstance(ins[0], Shard) and not isinstance(p, Partial):
        d = ins[0].dim
        sd = d - (len(out_shape) - len(src_shape))
        need = Shard(sd) if sd >= 0 and src_shape[sd] == out_shape[d] else R
        return Decision(ins=[ins[0], need] + [R] * (len(ins) - 2), out=ins[0])
    return Decision(ins=[R] * len(ins), out=R)
