"""Pointwise ops (every op tagged ``torch.Tag.pointwise``, plus casts and identities).

Broadcast-aware: inputs are aligned to the output from the right; an input dim that is
broadcast (size 1 or missing) stays ``Replicate`` while the output dim is sharded. The first
sharded input decides the output shard, the other inputs follow it (a replicated input is
sliced locally, which is how RoPE tables line up with sequence-sharded queries)::

    mul(q: S(2) [B,H,S,D], cos: R [1,1,S,D])  ->  needs (S(2), S(2)), out S(2)

``Partial`` survives only where the op is linear in it: ``add``/``sub`` of partials, ``neg``,
``mul`` by a replicated factor, ``div`` by a replicated divisor. Narrowing casts reduce
first (the rounding of a sum differs from the sum of roundings); a widening one (bf16 -> fp32)
casts each addend exactly and stays partial. A partial meeting a sharded input is
reduce-scattered to that shard (sequence parallelism's residual add).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Replicate, Shard, StridedShard
from . import Decision, RuleCtx, rule

aten = torch.ops.aten

_IDENTITY = (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default,
             aten.clone.default, aten.contiguous.default, aten.alias.default,
             aten.detach.default, aten.detach_.default, aten.lift_fresh_copy.default,
             aten.type_as.default, aten.dropout.default, aten.masked_fill.Scalar,
             aten.masked_fill.Tensor)

# Identities that copy a Partial value's addends unchanged (no rounding, no fill)
_PARTIAL_SAFE = {aten.clone.default, aten.contiguous.default, aten.alias.default,
                 aten.detach.default, aten.lift_fresh_copy.default, aten.dropout.default}


def _dropout_active(node: fx.Node) -> bool:
    args = list(node.args) + [None, None]
    p = args[1] if args[1] is not None else node.kwargs.get("p", 0.5)
    train = args[2] if args[2] is not None else node.kwargs.get("train", True)
    return bool(train) and p > 0


# Ops linear in their Partial argument(s): name -> which tensor inputs may be Partial.
_LINEAR_ALL = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default}
_LINEAR_FIRST = {aten.mul.Tensor, aten.div.Tensor}


def _aligned_dim(node_in: fx.Node, out_shape: tuple, out_dim: int) -> int | None:
    """The input dim that feeds ``out_dim`` without broadcasting, or None."""
    in_shape = tuple(node_in.meta["val"].shape)
    d = out_dim - (len(out_shape) - len(in_shape))
    if d < 0 or in_shape[d] != out_shape[out_dim]:
        return None
    return d


def _out_dim(node_in: fx.Node, out_shape: tuple, in_dim: int) -> int | None:
    in_shape = tuple(node_in.meta["val"].shape)
    od = in_dim + len(out_shape) - len(in_shape)
    if in_shape[in_dim] != out_shape[od]:
        return None
    return od


def pointwise_decision(node: fx.Node, ins: list, ctx: RuleCtx, tensors: list[fx.Node],
                       *, partial_ok: set[int] = frozenset()) -> Decision:
    """Shared by every elementwise op; ``partial_ok``: input positions in which the op is linear."""
    out_shape = tuple(node.meta["val"].shape)
    strided = next((p for p in ins if isinstance(p, StridedShard)), None)
    if strided is not None:
        # a fused projection's output: passes through when every other input broadcasts along
        # its dim or is the same fused layout (its bias); anything else computes it whole
        t0 = tensors[ins.index(strided)]
        od = _out_dim(t0, out_shape, strided.dim)
        need = []
        for t, p in zip(tensors, ins):
            d = _aligned_dim(t, out_shape, od) if od is not None else None
            need.append(R if d is None else replace(strided, dim=d)
                        if p in (strided, replace(strided, dim=d)) or isinstance(p, Replicate)
                        else None)   # (a whole full-width operand is sliced part by part)
        if od is not None and None not in need:
            return Decision(ins=need, out=replace(strided, dim=od))
        return Decision(ins=[R] * len(ins), out=R)
    target = None
    for t, p in zip(tensors, ins):
        if isinstance(p, Shard):
            od = _out_dim(t, out_shape, p.dim)
            if od is not None:
                target = od
                break
    if target is not None:
        need = []
        for t, p in zip(tensors, ins):
            d = _aligned_dim(t, out_shape, target)
            need.append(Shard(d) if d is not None else R)
        return Decision(ins=need, out=Shard(target))
    partial = [isinstance(p, Partial) for p in ins]
    if any(partial):
        if len(ins) == len(partial_ok) and all(partial) and partial_ok == set(range(len(ins))):
            return Decision(ins=[P] * len(ins), out=P)
        if all((i in partial_ok) == partial[i] for i in range(len(ins))) and \
                sum(partial) == 1:
            return Decision(ins=[P if partial[i] else R for i in range(len(ins))], out=P)
        if ctx.is_tp and ctx.sequence_parallel and len(out_shape) >= 3 and \
                out_shape[1] % ctx.chunks == 0 and out_shape[-1] > 1:
            # sequence parallelism: reduce-scatter an activation to the sequence shard, not
            # all-reduce it (a post-norm block normalises the row-parallel output on sequence
            # shards); a [B, S, 1] statistic stays a cheap all-reduce
            need = [Shard(d) if (d := _aligned_dim(t, out_shape, 1)) is not None else R
                    for t in tensors]
            return Decision(ins=need, out=Shard(1))
    return Decision(ins=[R] * len(ins), out=R)


def _tensors(node):
    from . import tensor_inputs
    return tensor_inputs(node)


def pointwise_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    tensors = _tensors(node)
    if node.target in _LINEAR_ALL:
        # add(P, 1.0) would add the scalar on every rank: only tensor-only sums stay partial
        scalars = [a for a in node.args if isinstance(a, (int, float, bool))]
        ok = set() if scalars else set(range(len(ins)))
    elif node.target in _LINEAR_FIRST:
        ok = {0}
    else:
        ok = set()
    if node.target in _LINEAR_FIRST and len(ins) == 2 and node.target is aten.mul.Tensor:
        # mul is linear in either factor, as long as the other is replicated
        if isinstance(ins[1], Partial) and not isinstance(ins[0], Partial):
            ok = {1}
    return pointwise_decision(node, ins, ctx, tensors, partial_ok=ok)


def _widening(node: fx.Node) -> bool:
    """A cast to a float type that holds every value of the source's exactly (bf16 -> fp32):
    the cast addends sum to the value itself, with no rounding of the sum in the narrow type
    (so no reduction is needed before it: a bf16 expert output reduced once, in fp32, later)."""
    src, val = node.args[0], node.meta.get("val")
    if node.target not in (aten._to_copy.default, aten.to.dtype, aten.type_as.default) or \
            not isinstance(val, torch.Tensor) or not isinstance(src, fx.Node):
        return False
    a, b = src.meta["val"].dtype, val.dtype
    if not (a.is_floating_point and b.is_floating_point) or a == b:
        return False
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fb.bits > fa.bits and fb.eps <= fa.eps and fb.max >= fa.max and \
        fb.smallest_normal <= fa.smallest_normal


@rule(*_IDENTITY)
def identity_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """Casts, copies and aliases: the placement passes through; a narrowing float cast of a
    partial value is reduced first so that rounding matches the single-device model (a widening
    one rounds nothing: each addend is cast, the sum stays partial)."""
    p = ins[0]
    need = [p] + [R] * (len(ins) - 1)
    if node.target is aten.type_as.default and len(ins) == 2:
        need[1] = ins[1]   # ``other`` lends its dtype only: taken as it is, never moved
    if isinstance(p, Partial):
        if node.target in _PARTIAL_SAFE and not (
                node.target is aten.dropout.default and _dropout_active(node)) or \
                _widening(node):
            return Decision(ins=need, out=P)   # a copy of each rank's addend
        need[0] = R
        return Decision(ins=need, out=R)
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        tensors = _tensors(node)
        return pointwise_decision(node, ins, ctx, tensors)
    return Decision(ins=need, out=p if isinstance(p, (Shard, StridedShard, Replicate)) else R)


def is_pointwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


@rule(aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.where.ScalarOther,
      aten.where.ScalarSelf, aten.where.Scalar, aten.floor_divide.default)
def untagged_pointwise_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """Elementwise ops that lack the ``pointwise`` tag."""
    return pointwise_decision(node, ins, ctx, _tensors(node))
