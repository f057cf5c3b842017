"""Rules of the loss: log-softmax and NLL over a vocab-sharded class dim stay sharded.

Megatron's vocab-parallel cross-entropy, as placements (``passes/vocab_loss.py`` rewrites the
nodes these rules keep sharded into local ops and the collectives the placements imply)::

    _log_softmax(x: S(1) [N, V], dim=1)                     -> S(1)  (max, sum-exp reduced)
    nll_loss_forward(logp: S(1), target: R)                  -> [P, R] (own targets picked)
    nll_loss_forward(logp: S(0), target: S(0), sum)          -> [P, P] (rows: local sums)
    nll_loss_backward(g: R, logp: S(1), target: R, .., tw: R) -> S(1)
    _log_softmax_backward_data(g: S(1), out: S(1), dim=1)    -> S(1)  (sum(g) reduced)

A shard of another dim passes through as before (``reductions.softmax_rule``,
``backward.softmax_backward_rule``). Class weights (``weight=``) and ``half_to_float`` keep
the class dim whole (replicated; correct).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard
from . import Decision, RuleCtx, rule
from .backward import softmax_backward_rule
from .reductions import softmax_rule

aten = torch.ops.aten

LOG_SOFTMAX = (aten._log_softmax.default, aten.log_softmax.int)


def log_softmax_dim(node: fx.Node) -> int:
    return node.args[1] % node.args[0].meta["val"].dim()


def sharded_dim_ok(node: fx.Node) -> bool:
    """A log-softmax the vocab-parallel rewrite can compute over a sharded dim: same dtype
    out as in (no ``half_to_float`` / ``dtype=`` cast)."""
    if node.target is aten._log_softmax.default:
        return not node.args[2]
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    return dtype is None or dtype == node.args[0].meta["val"].dtype


@rule(*LOG_SOFTMAX)
def log_softmax_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Shard) and p.dim == log_softmax_dim(node) and sharded_dim_ok(node):
        return Decision(ins=[p], out=p)
    return softmax_rule(node, ins, ctx)


def _weighted(node: fx.Node) -> bool:
    return isinstance(node.args[2], fx.Node)


@rule(aten.nll_loss_forward.default)
def nll_loss_forward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``nll_loss_forward(logp [N, C], target [N], weight, reduction, ignore_index)``."""
    p, n = ins[0], len(ins)
    reduction = node.args[3]
    if ctx.ndim(node.args[0]) == 2 and not _weighted(node):
        if p == Shard(1):
            return Decision(ins=[p, R], out=[P, R])
        if p == Shard(0) and reduction in (0, 2):     # rows: mean was split into sum / total
            return Decision(ins=[p, Shard(0)], out=[Shard(0), P] if reduction == 0 else [P, P])
    return Decision(ins=[R] * n, out=[R, R])


@rule(aten.nll_loss_backward.default)
def nll_loss_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``nll_loss_backward(grad, logp, target, weight, reduction, ignore_index, total)``."""
    p, n = ins[1], len(ins)
    reduction = node.args[4]
    if ctx.ndim(node.args[1]) == 2 and not isinstance(node.args[3], fx.Node):
        if p == Shard(1):
            return Decision(ins=[R, p, R, R], out=p)
        if p == Shard(0):   # rows: the local gradient, the global total
            return Decision(ins=[Shard(0) if reduction == 0 else R, p, Shard(0), R], out=p)
    return Decision(ins=[R] * n, out=R)


@rule(aten._log_softmax_backward_data.default)
def log_softmax_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``grad - exp(out) * sum(grad, dim)``: over a sharded dim the sum is all-reduced."""
    dim = node.args[2] % ctx.ndim(node)
    same_dtype = node.args[3] == node.meta["val"].dtype == node.args[0].meta["val"].dtype
    if same_dtype and not any(isinstance(p, Partial) for p in ins) and Shard(dim) in ins:
        return Decision(ins=[Shard(dim), Shard(dim)], out=Shard(dim))
    return softmax_backward_rule(node, ins, ctx)

