"""Factory ops: tensors made from constants are replicated (a consumer that needs a shard
slices it locally, which is how ``arange(S)`` position ids follow a sequence shard)."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import R, Shard, StridedShard
from . import Decision, RuleCtx, rule

aten = torch.ops.aten


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
      aten.zeros.default, aten.ones.default, aten.empty.memory_format,
      aten.scalar_tensor.default)
def factory_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
      aten.new_empty.default)
def new_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``x.new_empty(size)``: ``x`` lends only its dtype and device, so it stays where it is
    (no gather of a sharded ``x``); the new tensor of the global ``size`` is replicated."""
    return Decision(ins=list(ins[:1]) + [R] * (len(ins) - 1), out=R)


@rule(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
      aten.empty_like.default)
def like_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``*_like`` keeps the shard of its input (its values do not depend on the input's)."""
    p = ins[0]
    return Decision(ins=[p], out=p) if isinstance(p, (Shard, StridedShard)) \
        else Decision(ins=[R], out=R)


@rule(aten.fill.Tensor, aten.fill.Scalar)
def fill_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``fill(x, value)``: ``x``'s shape filled with one value; ``x`` lends only its shape, so
    its shard passes (a functionalised ``mask.fill_(v)``); the 0-d value is whole."""
    p = ins[0]
    keep = p if isinstance(p, (Shard, StridedShard)) else R
    return Decision(ins=[keep] + [R] * (len(ins) - 1), out=keep)
