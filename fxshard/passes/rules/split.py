"""``tensor_split`` and ``pad``, and the parts of a fused projection split twice.

``tensor_split(x, indices, dim)`` is ``split_with_sizes`` with boundaries instead of sizes: a
shard of another dim passes to every piece; a split of the sharded dim gathers it first, but
for a fused dim (``StridedShard``) whose boundaries fall on part boundaries, which gives each
piece its parts. ``pad(x, pads, "constant", value)`` pads dims from the last one backwards: a
shard of a dim it does not pad passes, a partial sum stays partial for a zero pad (the padded
entries are zero on every rank). Padding the sharded dim needs it whole (the pad would land
inside the rank's block), and the rule says so by asking for ``R``.

A state-space layer splits its fused ``in_proj`` twice: into (gate, xBC, dt), then, after the
depthwise convolution, xBC into (x, B, C). :func:`nested_pieces` follows one piece of the first
split through transposes, the convolution and elementwise ops to the second split, so that
``linear.fused_parts`` sees all five parts and the weight is split part by part::

    in_proj [B, S, 296]: split [128, 160, 8] -> xBC -> transpose -> conv1d -> silu
                         -> transpose -> split [128, 16, 16]
    parts (128, 128, 16, 16, 8): w S(0|128+128+16+16+8); conv1d w S(0|128+16+16)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Shard, StridedShard
from . import Decision, RuleCtx, rule
from .linear import fused_out, split_intervals

aten = torch.ops.aten

__all__ = ["tensor_split_rule", "pad_rule", "nested_pieces", "tensor_split_intervals",
           "flip_rule", "softplus_backward_rule"]

_PERMUTES = (aten.transpose.int, aten.permute.default)


def tensor_split_intervals(node: fx.Node, dim: int) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` pieces a ``tensor_split`` takes out of dim ``dim`` of its input."""
    if node.target not in (aten.tensor_split.indices, aten.tensor_split.sections):
        return None
    x = node.args[0]
    nd, size = x.meta["val"].dim(), x.meta["val"].shape[dim]
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if d % nd != dim:
        return None
    if node.target is aten.tensor_split.sections:
        n = node.args[1]
        sizes = [size // n + (i < size % n) for i in range(n)]
        bounds = [0]
        for k in sizes:
            bounds.append(bounds[-1] + k)
    else:
        bounds = [0] + [min(max(i + size if i < 0 else i, 0), size) for i in node.args[1]] \
            + [size]
        for i in range(1, len(bounds)):
            bounds[i] = max(bounds[i], bounds[i - 1])
    return list(zip(bounds[:-1], bounds[1:]))


@rule(aten.tensor_split.indices, aten.tensor_split.sections)
def tensor_split_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    nd = ctx.ndim(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    n = len(node.meta["val"])
    if isinstance(p, Partial):
        return Decision(ins=[P], out=[P] * n)
    if isinstance(p, StridedShard) and p.dim == dim:
        got = [fused_out(p, a, b) for a, b in tensor_split_intervals(node, dim)]
        if all(q is not None for q in got):
            return Decision(ins=[p], out=got)
        return Decision(ins=[R], out=[R] * n)
    if isinstance(p, (Shard, StridedShard)) and p.dim == dim:
        pieces = tensor_split_intervals(node, dim)
        if len([1 for a, b in pieces if b > a]) == 1 and \
                next(b - a for a, b in pieces if b > a) == ctx.shape(node.args[0])[dim]:
            # one piece is all of it, the others empty (Mamba-2's scan without cached steps)
            return Decision(ins=[p], out=[p if b > a else R for a, b in pieces])
        return Decision(ins=[R], out=[R] * n)
    return Decision(ins=[p], out=[p] * n)


def _padded_dims(node: fx.Node) -> dict[int, tuple[int, int]]:
    nd = node.args[0].meta["val"].dim()
    pads = list(node.args[1])
    return {nd - 1 - i // 2: (pads[i], pads[i + 1]) for i in range(0, len(pads), 2)}


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    if node.target is aten.constant_pad_nd.default:
        mode, value = "constant", node.args[2] if len(node.args) > 2 else 0
    padded = {d for d, lr in _padded_dims(node).items() if lr != (0, 0)}
    if isinstance(p, Partial):
        zero = mode == "constant" and (value is None or value == 0)
        return Decision(ins=[P], out=P) if zero else Decision(ins=[R], out=R)
    if isinstance(p, (Shard, StridedShard)) and p.dim in padded:
        return Decision(ins=[R], out=R)
    if isinstance(p, (Shard, StridedShard)) and mode != "constant" and padded:
        return Decision(ins=[R], out=R)   # reflect / replicate read along the padded dims only
    return Decision(ins=[p], out=p)


@rule(aten.flip.default)
def flip_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``flip(x, dims)`` (the gradient of a ``cumsum``): a shard of a dim not flipped passes,
    a partial sum stays partial; a flipped dim must be whole."""
    p = ins[0]
    nd = ctx.ndim(node.args[0])
    flipped = {d % nd for d in node.args[1]}
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    if isinstance(p, (Shard, StridedShard)) and p.dim not in flipped:
        return Decision(ins=[p], out=p)
    return Decision(ins=[R], out=R)


@rule(aten.softplus_backward.default)
def softplus_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``softplus_backward(grad, x, beta, threshold)``: elementwise, without torch's tag."""
    from .pointwise import pointwise_decision
    from . import tensor_inputs
    return pointwise_decision(node, ins, ctx, tensor_inputs(node))


def _follow(u: fx.Node, cur: fx.Node, d: int) -> int | None:
    """The dim of ``u``'s output that holds dim ``d`` of its input ``cur`` element for element
    (a transpose, a slice or pad of another dim, a depthwise conv's channels), or None."""
    from .conv import _depthwise, conv_groups_arg
    from .linear import _carries
    if not u.args or u.args[0] is not cur:
        return _carries(u, cur, d)
    nd = cur.meta["val"].dim()
    if u.target in _PERMUTES:
        from .views import permutation
        return permutation(u, nd).index(d)
    if u.target is aten.slice.Tensor:
        return d if (u.args[1] if len(u.args) > 1 else 0) % nd != d else None
    if u.target in (aten.pad.default, aten.constant_pad_nd.default):
        return d if _padded_dims(u).get(d, (0, 0)) == (0, 0) else None
    if conv_groups_arg(u) is not None:
        from types import SimpleNamespace
        ok = d == 1 and _depthwise(u, SimpleNamespace(shape=RuleCtx.shape, ndim=RuleCtx.ndim))
        return 1 if ok else None
    return _carries(u, cur, d)


def nested_pieces(split: fx.Node, dim: int, budget: int = 48
                  ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For each piece ``[a, b)`` of ``split`` (a split of dim ``dim``) whose every use ends,
    through :func:`_follow`'s ops, in splits of that dim into the same sub-pieces covering it,
    those sub-pieces (offsets in ``split``'s input)."""
    intervals = split_intervals(split, dim)
    out = {}
    for g in split.users:
        if g.target is not operator.getitem or not intervals:
            continue
        a, b = intervals[g.args[1]]
        subs = _sub_pieces(g, dim, b - a, budget)
        if subs and len(subs) > 1:
            out[a, b] = [(a + s, a + e) for s, e in subs]
    return out


def _sub_pieces(node: fx.Node, dim: int, size: int, budget: int):
    found: set[tuple[int, int]] = set()
    stack = [(node, dim)]
    while stack:
        cur, d = stack.pop()
        if not cur.users:
            return None
        for u in cur.users:
            budget -= 1
            if budget < 0 or u.op != "call_function":
                return None
            iv = split_intervals(u, d) if u.args and u.args[0] is cur else None
            if iv is not None:
                found.update(iv)
                continue
            e = _follow(u, cur, d)
            if e is None:
                return None
            stack.append((u, e))
    bounds = sorted({x for iv in found for x in iv})
    subs = list(zip(bounds[:-1], bounds[1:]))
    if not bounds or bounds[0] != 0 or bounds[-1] != size or \
            any(sum(1 for x in bounds if s < x < e) for s, e in found):
        return None
    return subs
