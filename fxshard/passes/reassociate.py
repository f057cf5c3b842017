"""Partial sums added together before they meet a whole value: one reduction, not two.

A parallel block (attention and MLP side by side, ``x + attn(n(x)) + mlp(n(x))``) written as
``mlp_out + (attn_out + x)`` adds the residual ``x`` (whole, or a sequence shard) to the first
row-parallel partial sum before the second one arrives: each partial sum is then reduced on its
own (two all-reduces per layer). Addition being associative, the pass adds the two partial sums
first, so they are reduced once. It runs on the propagated graph (``fxshard_spec`` on every
node), right after ``propagate_pass``; tp=2, ``a``/``m`` the row-parallel outputs (P)::

    before: add   = add(a, x)        # needs (R, R): a all-reduced
            add_1 = add(m, add)      # needs (R, R): m all-reduced
    after:  add   = add(a, m)        # (P, P) -> P
            add_1 = add(add, x)      # needs (R, R): one all-reduce

Only where the result's placement stays what it was, with each partial sum used by that add
alone, of one shape and dtype with the result. The sum is the same up to rounding:
``(a + x) + m`` and ``(a + m) + x`` round differently in floating point (one ulp of the
addends, per element), like any change of a reduction's order.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..placement import Partial
from . import PassCtx

aten = torch.ops.aten

__all__ = ["reassociate_partials_pass"]


def _spec(node) -> tuple | None:
    if not isinstance(node, fx.Node):
        return None
    spec = node.meta.get("fxshard_then") or node.meta.get("fxshard_spec")
    return spec if isinstance(spec, tuple) else None


def _plain_add(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.add.Tensor and \
        len(node.args) == 2 and not node.kwargs and \
        all(isinstance(a, fx.Node) for a in node.args)


def _same_tensor(*nodes: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in nodes]
    return all(isinstance(v, torch.Tensor) for v in vals) and \
        len({(tuple(v.shape), v.dtype) for v in vals}) == 1


def _partial_axes(spec: tuple) -> tuple[bool, ...]:
    return tuple(isinstance(p, Partial) for p in spec)


def _match(outer: fx.Node):
    """``(inner, a, x, m)`` when ``outer = m + inner`` (either order), ``inner = a + x``
    (either order), ``a`` and ``m`` partial sums on the same axes, ``x`` partial on none."""
    if not _plain_add(outer) or outer.meta.get("fxshard_then") is not None:
        return None
    for inner, m in (outer.args, outer.args[::-1]):
        if not isinstance(inner, fx.Node) or not _plain_add(inner) or \
                len(inner.users) != 1 or inner.meta.get("fxshard_then") is not None:
            continue
        sm = _spec(m)
        if sm is None or not any(_partial_axes(sm)) or len(m.users) != 1:
            continue
        for a, x in (inner.args, inner.args[::-1]):
            sa, sx = _spec(a), _spec(x)
            if sa is None or sx is None or _partial_axes(sa) != _partial_axes(sm) or \
                    any(_partial_axes(sx)) or len(a.users) != 1 or a is m:
                continue
            if any(not isinstance(p, Partial) and p != q for p, q in zip(sa, sm)):
                continue   # the two partial sums must agree on every other axis
            if _spec(inner) != _spec(outer) or not _same_tensor(a, m, x, inner, outer):
                continue
            return inner, a, x, m
    return None


def reassociate_partials_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """``m + (a + x)`` with ``a``, ``m`` partial sums becomes ``(a + m) + x`` (see the module
    docstring); the placement annotations are updated in place (no new propagation)."""
    done = 0
    for outer in list(gm.graph.nodes):
        found = _match(outer)
        if found is None:
            continue
        inner, a, x, m = found
        need_inner = dict(zip(inner.args, inner.meta["fxshard_need"]))
        outer.prepend(inner)           # after m, which may come after the inner add
        inner.args = (a, m)
        inner.meta["fxshard_spec"] = _spec(a)
        inner.meta["fxshard_need"] = [_spec(a), _spec(m)]
        outer.args = (inner, x)
        # the outer add now meets (partial, x) exactly as the inner one did
        outer.meta["fxshard_need"] = [need_inner[a], need_inner[x]]
        done += 1
    ctx.report("reassociate_partials_pass", partial_sums_added_first=done)
    return gm
