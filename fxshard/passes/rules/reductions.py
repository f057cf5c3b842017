"""Reductions and softmax: reduced dims must be whole, except sums and means, which turn a
shard into a partial sum::

    mean(x: S(1) [B,S,H], dim=-1, keepdim)   -> S(1)     (RMSNorm on sequence shards)
    sum(x: S(2) [B,S,H], dim=-1)             -> P        (all-reduce deferred to the consumer)
    mean(x: S(2) [B,S,H], dim=-1, keepdim)   -> P        (local mean / axis size; localize
                                                          divides: a norm over a tp-sharded
                                                          width all-reduces a [B,S,1] tensor)
    softmax(x: S(3), dim=-1)                 -> needs R on dim 3
    mean(x: P, dim=-1)                       -> P        (mean is linear)
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard, shard_dim
from . import Decision, RuleCtx, rule, token_local

aten = torch.ops.aten

_LINEAR = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}


def _reduced_dims(node: fx.Node, ndim: int) -> tuple[list[int], bool]:
    """(reduced dims, keepdim) of a reduction node."""
    args = list(node.args) + [None] * 3
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(ndim)), False
    dims = args[1] if args[1] is not None else node.kwargs.get("dim")
    keep = args[2] if args[2] is not None else node.kwargs.get("keepdim", False)
    if dims is None or dims == []:
        dims = list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim if ndim else 0 for d in dims), bool(keep)


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
      aten.amax.default, aten.amin.default, aten.any.dim, aten.all.dim,
      aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
      aten.max.dim, aten.min.dim)
def reduction_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    ndim = ctx.ndim(node.args[0])
    dims, keep = _reduced_dims(node, ndim)
    multi = isinstance(node.meta["val"], (list, tuple))

    def outs(q):
        return [q, q] if multi else q

    if isinstance(p, Partial):
        if node.target in _LINEAR:
            return Decision(ins=[P], out=P)
        return Decision(ins=[R], out=outs(R))
    if isinstance(p, Shard):
        if p.dim in dims:
            if node.target in _LINEAR:
                return Decision(ins=[p], out=P)
            return Decision(ins=[R], out=outs(R))
        out_dim = p.dim if keep else p.dim - sum(d < p.dim for d in dims)
        return Decision(ins=[p], out=outs(Shard(out_dim)))
    if isinstance(p, StridedShard) and p.dim not in dims:   # flattened tokens: rows pass
        out_dim = p.dim if keep else p.dim - sum(d < p.dim for d in dims)
        return Decision(ins=[p], out=outs(replace(p, dim=out_dim)))
    return Decision(ins=[R], out=outs(R))


@rule(aten.cumsum.default)
def cumsum_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """Shards of other dims pass; a partial sum of counts (``histc``, an integer ``sum``) stays
    partial (cumsum is linear, and a cast of whole numbers rounds nothing). Inside an expert-routing
    region the rank's own positions are wanted: a local cumsum along the token shard."""
    p = ins[0]
    dim = node.args[1] % ctx.ndim(node.args[0])
    if token_local(node, ctx) and shard_dim(p) == dim:
        return Decision(ins=[p], out=p)
    if isinstance(p, Partial) and (node.args[0].target is aten.histc.default or not (
            node.args[0].meta["val"].is_floating_point() or node.meta["val"].is_floating_point()
            or node.meta["val"].is_complex())):
        return Decision(ins=[P], out=P)   # integer sums: exact (wrapping is linear too)
    return softmax_rule(node, ins, ctx)


@rule(aten._softmax.default, aten.softmax.int,   # log_softmax: rules/loss.py
      aten._safe_softmax.default)   # (a row of -inf gives zeros: SDPA's math path)
def softmax_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    dim = node.args[1] % ctx.ndim(node.args[0])
    if shard_dim(p) is not None and p.dim != dim:
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.diff.default)
def diff_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``diff`` along ``dim`` needs that dim whole; other shards pass through."""
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) \
        % ctx.ndim(node.args[0])
    p = ins[0]
    if isinstance(p, Shard) and p.dim != dim:
        from . import tensor_inputs
        size = ctx.shape(node.args[0])[p.dim]
        # prepend/append join the input along dim: they follow its shard where they match it
        rest = [Shard(p.dim) if ctx.ndim(t) == ctx.ndim(node.args[0])
                and ctx.shape(t)[p.dim] == size else R for t in tensor_inputs(node)[1:]]
        return Decision(ins=[p] + rest, out=p)
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """LayerNorm / RMSNorm over the last ``len(normalized_shape)`` dims: those dims whole, a
    shard of a leading dim (batch, or the sequence under sequence parallelism) passes through;
    weight and bias replicated."""
    p = ins[0]
    ndim = ctx.ndim(node.args[0])
    first_normalized = ndim - len(node.args[1])
    if isinstance(p, Shard) and p.dim < first_normalized:
        return Decision(ins=[p] + [R] * (len(ins) - 1), out=p)
    return Decision(ins=[R] * len(ins), out=R)
