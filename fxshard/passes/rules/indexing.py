"""Indexing ops: a shard survives on the dims that are not looked up.

``index.Tensor(x, [None, idx])`` with the index tensors on consecutive dims ``a..b`` of ``x``
gives ``x.shape[:a] + broadcast(idx shapes) + x.shape[b+1:]``::

    index(table: R [P, D], [pos: S(1) [B, S]])      -> S(1) [B, S, D]   (RoPE table by position)
    index(x: S(0) [B, S, D], [None, idx: R [K]])    -> S(0) [B, K, D]

``gather(x, dim, idx)``, ``topk(x, k, dim)``, ``sort`` and ``repeat_interleave(x, n, dim)``
keep a shard of any dim but ``dim``; the looked-up / sorted dim must be whole.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import R, Shard
from . import Decision, RuleCtx, rule, tensor_inputs

aten = torch.ops.aten


@rule(aten.index.Tensor)
def index_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    indices = list(node.args[1])
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
    if isinstance(p, Shard) and p.dim != dim:
        return Decision(ins=[p], out=[p, p])
    return Decision(ins=[R], out=[R, R])


@rule(aten.repeat_interleave.self_int)
def repeat_interleave_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    p = ins[0]
    if dim is not None and isinstance(p, Shard) and p.dim != dim % ctx.ndim(node.args[0]):
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)
