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

The same pass keeps an accumulation of partial sums partial: an MoE written as a loop over
experts, ``y = zeros_like(x); for e: y[idx_e] += w_e * expert_e(x[idx_e])``, reads and writes
rows of ``y`` by replicated indices, which is linear in ``y`` and the expert's row-parallel
output ``v_e``. Each ``v_e`` would be reduced before it is added; instead every rank
accumulates its addends and ``y`` is reduced once, after the loop (on the axis where every
``v_e`` is a partial sum)::

    before: index = index(zeros_like, [i0]); add = add(index, v0)       # v0 all-reduced
            index_put = index_put(zeros_like, [i0], add); ... (each expert)
    after:  the same ops on partial sums; one all-reduce of the last index_put

(Indices repeated within one expert's rows write one of the rows, as ``index_put`` does on one
device; ``torch.where`` over a top-k routing mask gives each token once per expert.)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..placement import Partial, Replicate
from . import PassCtx
from .rules import held

aten = torch.ops.aten

__all__ = ["reassociate_partials_pass"]


def _spec(node) -> tuple | None:
    if not isinstance(node, fx.Node):
        return None
    spec = held(node)
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


_ZEROS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _with(spec: tuple, axis: int, p) -> tuple:
    return spec[:axis] + (p,) + spec[axis + 1:]


def _accumulation(y: fx.Node, axis: int) -> list[tuple]:
    """The steps ``(index, add, index_put)`` of ``y = index_put(y, idx, index(y, idx) + v)``
    from the zeros ``y``, each ``v`` a partial sum on ``axis`` where the rest is whole."""
    steps = []
    while len(y.users) == 2:
        get = next((u for u in y.users if u.target is aten.index.Tensor and u.args[0] is y),
                   None)
        put = next((u for u in y.users if u.target is aten.index_put.default and
                    u.args[0] is y and not (len(u.args) > 3 and u.args[3]) and not u.kwargs),
                   None)
        if get is None or put is None or list(put.args[1]) != list(get.args[1]):
            break
        add = put.args[2]
        if not isinstance(add, fx.Node) or not _plain_add(add) or get not in add.args or \
                add.args[0] is add.args[1] or len(get.users) != 1 or len(add.users) != 1:
            break
        v = add.args[1] if add.args[0] is get else add.args[0]
        idx = [i for i in get.args[1] if i is not None]
        whole = [y, get, add, put] + idx
        if any(not isinstance(n, fx.Node) or _spec(n) is None or
               not isinstance(_spec(n)[axis], Replicate) for n in whole) or \
                _spec(v) is None or not isinstance(_spec(v)[axis], Partial):
            break
        steps.append((get, add, put))
        y = put
    return steps


def _keep_partial(zeros: fx.Node, steps: list, axis: int) -> None:
    """Mark the accumulation partial on ``axis`` (the needs of its inputs with it)."""
    zeros.meta["fxshard_spec"] = _with(zeros.meta["fxshard_spec"], axis, Partial())
    for get, add, put in steps:
        for node, partial_inputs in ((get, {0}), (add, {0, 1}), (put, {0, len(put.meta[
                "fxshard_need"]) - 1})):
            node.meta["fxshard_spec"] = _with(node.meta["fxshard_spec"], axis, Partial())
            node.meta["fxshard_need"] = [_with(nd, axis, Partial()) if k in partial_inputs
                                         else nd for k, nd in enumerate(node.meta[
                                             "fxshard_need"])]


def _accumulate_partials(gm: fx.GraphModule) -> int:
    done = 0
    for node in list(gm.graph.nodes):
        spec = _spec(node)
        if node.op != "call_function" or node.target not in _ZEROS or spec is None:
            continue
        for axis in range(len(spec)):
            steps = _accumulation(node, axis)
            if len(steps) >= 2:   # one step: one reduction either way (of fewer rows so)
                _keep_partial(node, steps, axis)
                done += 1
    return done


def reassociate_partials_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """``m + (a + x)`` with ``a``, ``m`` partial sums becomes ``(a + m) + x``, and an
    accumulation of partial sums into zeros stays partial (see the module docstring); the
    placement annotations are updated in place (no new propagation)."""
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
    ctx.report("reassociate_partials_pass", partial_sums_added_first=done,
               accumulations_reduced_once=_accumulate_partials(gm))
    return gm
