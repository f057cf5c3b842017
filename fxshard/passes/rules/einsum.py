"""``einsum``: the equation's letters are the dimension labels of the generic matmul rule.

A shard of a letter kept in the output passes to it (every operand holding that letter is
split alike); a shard of a letter summed over, held by every operand, gives a partial sum.
Mamba-2's chunked scan, heads on ``tp``::

    einsum("bclhn,bcshn->bclsh", C S(3), B S(3))  -> S(4)      (h kept)
    einsum("bclsh,bcshp->bclhp", M S(4), x S(3))  -> S(3)
An equation with ``...`` or a repeated letter in one operand (a diagonal) needs R.

``tril`` / ``triu`` (the causal masks inside a chunk of a linear-attention or state-space scan)
zero entries by their place in the last two dims: a shard of a dim before them passes (heads on
``tp``), a partial sum stays partial, a shard of the last two dims needs them whole.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard
from . import Decision, RuleCtx, rule, tensor_inputs
from .linear import einsum_decision

aten = torch.ops.aten

__all__ = ["einsum_rule", "triangle_rule"]


@rule(aten.einsum.default)
def einsum_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    eq = node.args[0].replace(" ", "")
    tensors = tensor_inputs(node)
    if "..." in eq or "->" not in eq:
        return Decision(ins=[R] * len(ins), out=R)
    lhs, out = eq.split("->")
    labels = [list(t) for t in lhs.split(",")]
    if len(labels) != len(tensors) or any(len(set(l)) != len(l) for l in labels) or \
            any(len(l) != ctx.ndim(t) for l, t in zip(labels, tensors)):
        return Decision(ins=[R] * len(ins), out=R)
    return einsum_decision(node, ins, labels, list(out), ctx, tensors=tensors)


@rule(aten.tril.default, aten.triu.default)
def triangle_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    if isinstance(p, (Shard, StridedShard)) and p.dim < ctx.ndim(node.args[0]) - 2:
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)
