"""Convolutions: the depthwise short convolution of state-space and linear-attention layers.

Mamba-2, Falcon-H1, GraniteMoeHybrid, Qwen3-Next and Kimi-Linear mix positions with a causal
depthwise ``conv1d(x[B, C, L], w[C, 1, k], b[C], padding=k-1, groups=C)``: every channel is
filtered by its own ``k`` taps, so a shard of the channels is local work on ``tp`` (the weight
and bias split with them, ``groups`` becomes the local channel count)::

    in_proj -> split -> xBC [B, L, C] S(2|parts) -> transpose -> conv1d(w S(0|parts), groups=C)
    tp=2:   conv1d(xBC_local [B, C/2, L], w_local [C/2, 1, k], b_local, groups=C/2)  S(1|parts)

A shard of the batch passes through. A shard of the length (context parallelism) would need the
``k - 1`` positions before each rank's block from the rank before it (a halo); fxshard moves the
shard to the channels instead (an all-to-all on ``ulysses_cp``; on ``ring_cp``, whose zigzag
blocks are not contiguous, the sequence is gathered and each rank keeps its channels) and says
so with a :class:`SequenceGatherWarning`. A convolution that mixes channels (``groups < C``)
contracts them: a channel shard of ``x`` and of the weight's input channels gives a partial sum.

``convolution_backward(grad, x, w, ..)`` of the depthwise conv follows the forward: channels
sharded, ``grad_x``, ``grad_w`` and ``grad_b`` are the rank's channels; a batch shard gives
``grad_x`` on the batch and partial ``grad_w``, ``grad_b`` (summed over the batch).
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard
from . import UNDECIDED, Decision, RuleCtx, caller_level, rule, tensor_inputs
from .local_args import local_args

aten = torch.ops.aten

__all__ = ["conv_rule", "SequenceGatherWarning", "conv_groups_arg", "local_conv_groups",
           "warn_sequence_gather"]


class SequenceGatherWarning(UserWarning):
    """A layer reads its whole sequence on a context-parallel axis (no ring or halo form)."""


def conv_groups_arg(node: fx.Node) -> int | None:
    """Index of ``groups`` in the positional arguments of a conv node."""
    if node.target is aten.conv1d.default:
        return 6
    if node.target is aten.convolution.default:
        return 8
    if node.target is aten.convolution_backward.default:
        return 9
    return None


def _groups(node: fx.Node) -> int:
    i = conv_groups_arg(node)
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get("groups", 1)


def _depthwise(node: fx.Node, ctx: RuleCtx) -> bool:
    x, w = tensor_inputs(node)[:2]
    if node.target is aten.convolution_backward.default:
        x, w = tensor_inputs(node)[1:3]
    c = ctx.shape(x)[1]
    return ctx.ndim(x) == 3 and _groups(node) == c and ctx.shape(w)[:2] == (c, 1) and \
        not (node.target is aten.convolution.default and node.args[6]) and \
        not (node.target is aten.convolution_backward.default and node.args[7])


def warn_sequence_gather(node: fx.Node, ctx: RuleCtx, what: str) -> None:
    """Say that ``node`` gathers the sequence on ``ctx.axis``."""
    stack = node.meta.get("nn_module_stack") or {}
    layer = next(reversed(stack.values()))[0] if stack else node.name
    warnings.warn(
        f"fxshard: {layer} ({node.name}: {what}) reads the whole sequence on mesh axis "
        f"{ctx.axis!r} of size {ctx.size}: {ctx.axis} gathers its input and splits it by "
        f"channels instead (correct; no halo exchange for a sequence-sharded convolution). "
        f"Leave {ctx.axis!r} off for this model to avoid the gather", SequenceGatherWarning,
        stacklevel=caller_level())


@rule(aten.conv1d.default, aten.convolution.default)
def conv_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    bias = [] if b is None else [b]

    def decide(xp, wp, bp, out) -> Decision:
        return Decision(ins=[xp, wp] + ([bp] if b is not None else []), out=out)

    if ctx.ndim(node.args[0]) != 3:
        return decide(R, R, R, R)
    if isinstance(x, Shard) and x.dim == 0:                       # batch: local
        return decide(x, R, R, x)
    depthwise = _depthwise(node, ctx)
    if depthwise and isinstance(w, (Shard, StridedShard)) and w.dim == 0:
        chan = Shard(1) if isinstance(w, Shard) else StridedShard(1, w.parts, w.whole)
        return decide(chan, w, w, chan)
    if depthwise and isinstance(x, (Shard, StridedShard)) and x.dim == 1 and \
            w in (UNDECIDED, R) and (b is None or b in (UNDECIDED, R)):
        wp = Shard(0) if isinstance(x, Shard) else StridedShard(0, x.parts, x.whole)
        return decide(x, wp, wp, x)
    if depthwise and isinstance(x, Shard) and x.dim == 2:          # the sequence
        warn_sequence_gather(node, ctx, "a depthwise convolution along the sequence")
        if ctx.shape(node.args[0])[1] % ctx.size == 0:
            return decide(Shard(1), Shard(0), Shard(0), Shard(1))
        return decide(R, R, R, R)
    if not depthwise and _groups(node) == 1 and isinstance(x, Shard) and x.dim == 1 and \
            ctx.is_tp and w in (UNDECIDED, Shard(1)) and (b is None or b is UNDECIDED):
        return decide(x, Shard(1), P, P)                          # channels contracted
    if isinstance(x, Partial) and b is None:
        return decide(P, R, R, P)
    return decide(R, R, R, R)


@rule(aten.convolution_backward.default)
def conv_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    g, x, w = ins[:3]
    outs = node.meta["val"]
    depthwise = _depthwise(node, ctx)

    def on(p):   # the placement of each returned gradient that is computed (mask True)
        return [p[k] if outs[k] is not None else R for k in range(3)]
    if isinstance(x, Shard) and x.dim == 0 or isinstance(g, Shard) and g.dim == 0:
        return Decision(ins=[Shard(0), Shard(0), R], out=on([Shard(0), P, P]))
    for p in (w, x, g):
        if depthwise and isinstance(p, (Shard, StridedShard)) and \
                p.dim == (0 if p is w else 1):
            chan = Shard(1) if isinstance(p, Shard) else replace(p, dim=1)
            wp = Shard(0) if isinstance(p, Shard) else replace(p, dim=0)
            return Decision(ins=[chan, chan, wp], out=on([chan, wp, wp]))
    return Decision(ins=[R, R, R], out=on([R, R, R]))


@local_args(aten.conv1d.default, aten.convolution.default, aten.convolution_backward.default)
def local_conv_groups(node: fx.Node, local_in) -> bool:
    """Set a depthwise conv's ``groups`` to the rank's channel count (``localize``)."""
    i = conv_groups_arg(node)
    local_in = local_in(node.args[0])
    if i is None or local_in is None:
        return False
    groups = _groups(node)
    c = node.args[0].meta["val"].shape[1]
    if groups != c or local_in[1] == c:
        return False
    args = list(node.args)   # (a depthwise conv's gradient has the input's channels too)
    defaults = [None, None, None, 1, 0, 1, 1] if node.target is aten.conv1d.default else []
    while len(args) <= i:
        args.append(defaults[len(args)])
    args[i] = local_in[1]
    node.args = tuple(args)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "groups"}
    return True

