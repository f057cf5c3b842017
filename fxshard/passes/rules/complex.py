"""Complex views and complex arithmetic (complex RoPE, as Meta's reference Llama and torchtitan
write it): ``view_as_complex`` folds a last dim of 2 into complex numbers, ``view_as_real``
unfolds it; a shard of any other dim passes through both, a partial sum stays partial (both
are linear)::

    view_as_complex(xq: S(2) [B, S, H, D/2, 2])     -> S(2) [B, S, H, D/2]   (complex)
    mul(xq_: S(2), freqs_cis: R [1, S, 1, D/2])     -> S(2)                  (pointwise)
    view_as_real(S(2) [B, S, H, D/2])               -> S(2) [B, S, H, D/2, 2]

A shard of the folded dim of 2 needs it whole first. ``polar(abs, angle)`` and
``complex(real, imag)`` are elementwise; ``real``/``imag``/``conj`` keep the placement (all
linear over the reals); ``outer(a[n], b[m])`` (a RoPE angle table) keeps a shard of either
factor on its own output dim.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard
from . import Decision, RuleCtx, rule
from .pointwise import pointwise_decision

aten = torch.ops.aten


@rule(aten.view_as_complex.default)
def view_as_complex_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    last = ctx.ndim(node.args[0]) - 1
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    if isinstance(p, (Shard, StridedShard)) and p.dim < last:
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.view_as_real.default)
def view_as_real_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    if isinstance(p, (Shard, StridedShard)):
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.polar.default, aten.complex.default)
def polar_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """Elementwise in its two real inputs (not linear: a partial sum is reduced first)."""
    from . import tensor_inputs
    return pointwise_decision(node, ins, ctx, tensor_inputs(node))


@rule(aten.real.default, aten.imag.default, aten.conj.default, aten._conj.default,
      aten.conj_physical.default, aten.resolve_conj.default)
def complex_part_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    return Decision(ins=[ins[0]], out=ins[0])


@rule(aten.outer.default)
def outer_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a, b = ins
    if isinstance(a, Shard):
        return Decision(ins=[a, R], out=Shard(0))
    if isinstance(b, Shard):
        return Decision(ins=[R, b], out=Shard(1))
    if isinstance(a, Partial) != isinstance(b, Partial):
        return Decision(ins=[a, b], out=P)
    return Decision(ins=[R, R], out=R)
