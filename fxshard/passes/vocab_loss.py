"""The vocab-parallel loss: cross-entropy over vocab-sharded logits without gathering them.

Two passes around ``propagate``. ``split_loss_pass`` (before) spells the loss in the ops the
rules of ``rules/loss.py`` place, and a mean as sum / count (so rows sharded on ``dp`` sum
locally and only two scalars are all-reduced)::

    before: loss = cross_entropy_loss(logits, target)                        # [N, V], mean
    after:  logp = _log_softmax(logits, 1, False)
            nll = nll_loss_forward(logp, target, None, 2, -100)              # sum, count
            loss = div(nll[0], nll[1])

``vocab_parallel_loss_pass`` (after) rewrites what the rules kept sharded over the class dim
into local ops whose placements say which collectives ``insert_collectives`` adds: the row
max is gathered from the ranks (``[N, tp]``, a scalar per row and rank), the sum of
exponentials all-reduced (``[N, 1]``); the target's log-probability is picked by the rank
that holds it (``fxshard::vocab_nll_loss_forward``) and the partial sums all-reduced::

    before: logp = _log_softmax(logits, 1, False)                            # S(1) -> S(1)
    after:  m_r = amax(logits, [1], True)       # S(1) of [N, tp]: each rank's max
            m = amax(m_r, [1], True)            # R: all_gather(m_r) first
            z = sub(logits, m); s = sum(exp(z), [1], True)                   # s: P
            logp = sub(z, log(s))               # all_reduce(s) first

    _log_softmax_backward_data(g, logp, 1):  g - exp(logp) * all_reduce(sum(g, [1], True))
    nll_loss_backward(..):                   fxshard::vocab_nll_loss_backward (own targets)

and when the NLL's gradient is all the log-softmax's backward sees (a cross-entropy), the two
backward ops are one pass over the rank's logits with no collective
(``fxshard::vocab_cross_entropy_backward`` on the forward's ``e`` and ``lse``)::

    before: g = vocab_nll_loss_backward(grad, logp, t, ..)
            dx = sub(g, mul(exp(logp), all_reduce(sum(g, [1], True))))
    after:  dx = vocab_cross_entropy_backward(grad, e, lse, t, ..)  # e * w/exp(lse), -w at t

Nothing ``[N, V]``-sized moves: per row ``tp`` maxima and one sum (forward), nothing
(backward; one sum when the log-probabilities have other uses), and the scalar loss.

bf16 / fp16 logits (cast to float32 for the loss, as HF's ``logits.float()``, or not) upcast
per block: each rank's block is read in its dtype and reduced in float32 a slice of rows at
a time (``fxshard::vocab_sum_exp``); the loss is ``lse - x[t]`` and the gradient is written in
the logits' dtype (``fxshard::vocab_cross_entropy_grad``), so no float32 copy of the rank's
logits is made or saved (``fxshard/ops/loss.py``)::

    before: x = reshape(_to_copy(logits_bf16, float32), [N, V])          # float32 [N, V/tp]
            logp = _log_softmax(x, 1, False); nll_loss_forward(logp, t, ..)
    after:  xb = reshape(logits_bf16, [N, V]); m = amax(all_gather(amax(xb)))
            lse = add(log(all_reduce(vocab_sum_exp(xb, m))), m)           # float32 [N, 1]
            vocab_nll_loss_forward(xb, t, .., lse, float32)
    backward: dx = vocab_cross_entropy_grad(g, xb, lse, t, ..)            # bf16, the cast gone
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..mesh import TP
from ..placement import P, R, Shard
from . import PassCtx
from .rules.loss import LOG_SOFTMAX, log_softmax_dim, sharded_dim_ok

aten = torch.ops.aten

__all__ = ["split_loss_pass", "vocab_parallel_loss_pass"]

_KEEP = ("fxshard_spec", "fxshard_need", "fxshard_then", "val")


def _fake(fn, *vals):
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode(vals)
    if mode is None:
        return fn(*vals)
    with mode:
        return fn(*vals)


def _node(graph: fx.Graph, like: fx.Node, target, args, val, spec=None, need=None):
    n = graph.call_function(target, tuple(args))
    n.meta.update({k: v for k, v in like.meta.items() if k not in _KEEP})
    n.meta["val"] = val
    if spec is not None:
        n.meta["fxshard_spec"], n.meta["fxshard_need"] = spec, need
    return n


def _ce_args(node: fx.Node):
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, None, None, 1, -100, 0.0)
    args = list(node.args) + [node.kwargs.get(k, d) for k, d in
                              zip(names[len(node.args):], defaults[len(node.args):])]
    return args


def split_loss_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    graph, changed = gm.graph, 0
    for node in list(graph.nodes):
        if node.target is aten.cross_entropy_loss.default:
            x, t, weight, reduction, ignore, smoothing = _ce_args(node)
            xv, tv = x.meta["val"], t.meta["val"]
            if weight is not None or smoothing or xv.dim() != 2 or tv.dim() != 1 or \
                    tv.is_floating_point():
                continue
            with graph.inserting_before(node):
                logp = _node(graph, node, aten._log_softmax.default, (x, 1, False),
                             _fake(lambda a: aten._log_softmax(a, 1, False), xv))
                nll = _node(graph, node, aten.nll_loss_forward.default,
                            (logp, t, None, reduction, ignore),
                            _fake(lambda a, b: aten.nll_loss_forward(a, b, None, reduction,
                                                                     ignore), logp.meta["val"], tv))
                loss = _mean_of(graph, node, nll)
            node.replace_all_uses_with(loss)
            graph.erase_node(node)
            changed += 1
        elif node.target is aten.nll_loss_forward.default and node.args[3] == 1 and \
                node.args[2] is None and node.args[0].meta["val"].dim() == 2:
            users = [u for u in node.users if u.args[1] == 0]
            node.update_arg(3, 2)
            with graph.inserting_before(node.next):
                loss = _mean_of(graph, node, node, after=True)
            for u in users:
                u.replace_all_uses_with(loss)
                graph.erase_node(u)
            changed += 1
    ctx.report("split_loss_pass", losses=changed)
    return gm


def _mean_of(graph: fx.Graph, like: fx.Node, nll: fx.Node, after: bool = False) -> fx.Node:
    """``nll[0] / nll[1]`` (sum over count) for a node that was a mean (or reduces so)."""
    import operator
    reduction = nll.args[3]
    if after:
        reduction = 1
    else:
        nll.update_arg(3, 2 if reduction == 1 else reduction)
    vals = nll.meta["val"] = _fake(lambda a, b: aten.nll_loss_forward(a, b, None, nll.args[3],
                                                                      nll.args[4]),
                                   nll.args[0].meta["val"], nll.args[1].meta["val"])
    total = _node(graph, like, operator.getitem, (nll, 0), vals[0])
    if reduction != 1:
        return total
    count = _node(graph, like, operator.getitem, (nll, 1), vals[1])
    return _node(graph, like, aten.div.Tensor, (total, count),
                 _fake(lambda a, b: a / b, vals[0], vals[1]))


def _axes(spec, dim: int, ctx: PassCtx) -> list[int]:
    return [i for i, (n, p) in enumerate(zip(ctx.mesh.shape, spec))
            if n > 1 and p == Shard(dim)]


def _with(spec, axes, q) -> tuple:
    return tuple(q if i in axes else p for i, p in enumerate(spec))


def _empty(val, dim: int, size: int):
    shape = list(val.shape)
    shape[dim] = size
    return _fake(lambda v: v.new_empty(shape), val)


_LOW = (torch.bfloat16, torch.float16)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _is_cast(n: fx.Node, dtype) -> bool:
    """``n`` is ``_to_copy(x, dtype=dtype)`` and changes nothing else (layout, device)."""
    if n.op != "call_function" or n.target is not aten._to_copy.default or n.args[1:]:
        return False
    kw = dict(n.kwargs)
    device = kw.pop("device", None)
    return kw.pop("dtype", None) == dtype and kw.pop("layout", torch.strided) == torch.strided \
        and not kw and (device is None or device == n.args[0].meta["val"].device)


def _low_precision_source(graph: fx.Graph, x: fx.Node, node: fx.Node) -> fx.Node | None:
    """The bf16 / fp16 logits ``x`` is (through views) an upcast of, as a node of ``x``'s
    shape in that dtype (the views repeated on it); ``x`` itself when it is bf16 / fp16;
    None otherwise (float32 logits: the float32 path)."""
    if x.meta["val"].dtype in _LOW:
        return x
    views, up = [], x
    while up.op == "call_function" and up.target in _VIEWS:
        views.append(up)
        up = up.args[0]
    if not _is_cast(up, x.meta["val"].dtype):
        return None
    low = up.args[0]
    if low.meta["val"].dtype not in _LOW:
        return None
    with graph.inserting_before(node):
        for v in reversed(views):
            low = _node(graph, v, v.target, (low, *v.args[1:]),
                        _fake(lambda a, d=low.meta["val"].dtype: a.to(d), v.meta["val"]),
                        v.meta.get("fxshard_spec"), v.meta.get("fxshard_need"))
    return low


def _log_softmax_low(graph: fx.Graph, node: fx.Node, ctx: PassCtx, saved: dict, xb: fx.Node,
                     axes: list[int], dim: int) -> None:
    """The log-softmax of bf16 / fp16 logits ``xb`` (or their float32 upcast), per block in
    float32: the maxima in ``xb``'s dtype (exact), the sum of exponentials and ``lse`` in
    float32 (``[N, 1]``); ``logp`` itself only where something other than the NLL reads it."""
    from ..ops.loss import vocab_sum_exp
    spec, xv = node.meta["fxshard_spec"], xb.meta["val"]
    k = math.prod(ctx.mesh.shape[i] for i in axes)
    s, sr, sp = spec, _with(spec, axes, R), _with(spec, axes, P)
    one = _empty(xv, dim, 1)
    one32 = _fake(lambda v: v.to(torch.float32), one)
    with graph.inserting_before(node):
        m_r = _node(graph, node, aten.amax.default, (xb, [dim], True), _empty(xv, dim, k), s, [s])
        m = _node(graph, node, aten.amax.default, (m_r, [dim], True), one, sr, [sr])
        se = _node(graph, node, vocab_sum_exp.default, (xb, m), one32, sp, [s, sr])
        log = _node(graph, node, aten.log.default, (se,), one32, sr, [sr])
        lse = _node(graph, node, aten.add.Tensor, (log, m), one32, sr, [sr, sr])
        x32 = node.args[0]
        if x32 is xb:       # bf16 logits into the log-softmax: its float32 form, if read
            x32 = _node(graph, node, aten._to_copy.default, (xb,),
                        _fake(lambda v: v.to(torch.float32), xv), s, [s])
            x32.kwargs = {"dtype": torch.float32}
        out = _node(graph, node, aten.sub.Tensor, (x32, lse),
                    _fake(lambda v: v.to(torch.float32), node.meta["val"]), s, [s, sr])
        if node.meta["val"].dtype != torch.float32:
            out = _node(graph, node, aten._to_copy.default, (out,), node.meta["val"], s, [s])
            out.kwargs = {"dtype": node.meta["val"].dtype}
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    saved[out] = ("low", xb, lse)


def _log_softmax(graph: fx.Graph, node: fx.Node, ctx: PassCtx, saved: dict) -> bool:
    dim, spec = log_softmax_dim(node), node.meta.get("fxshard_spec")
    axes = _axes(spec, dim, ctx) if isinstance(spec, tuple) else []
    if not axes or not sharded_dim_ok(node):
        return False
    x, xv = node.args[0], node.args[0].meta["val"]
    xb = _low_precision_source(graph, x, node)
    if xb is not None:
        _log_softmax_low(graph, node, ctx, saved, xb, axes, dim)
        return True
    k = math.prod(ctx.mesh.shape[i] for i in axes)
    s, sr, sp = spec, _with(spec, axes, R), _with(spec, axes, P)
    one = _empty(xv, dim, 1)
    with graph.inserting_before(node):
        m_r = _node(graph, node, aten.amax.default, (x, [dim], True), _empty(xv, dim, k), s, [s])
        m = _node(graph, node, aten.amax.default, (m_r, [dim], True), one, sr, [sr])
        z = _node(graph, node, aten.sub.Tensor, (x, m), _empty(xv, dim, xv.shape[dim]), s,
                  [s, sr])
        e = _node(graph, node, aten.exp.default, (z,), z.meta["val"], s, [s])
        se = _node(graph, node, aten.sum.dim_IntList, (e, [dim], True), one, sp, [s])
        lse = _node(graph, node, aten.log.default, (se,), one, sr, [sr])
        out = _node(graph, node, aten.sub.Tensor, (z, lse), node.meta["val"], s, [s, sr])
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    saved[out] = (e, lse)
    return True


def _log_softmax_backward(graph: fx.Graph, node: fx.Node, ctx: PassCtx, saved: dict) -> bool:
    g, y, dim, dtype = node.args
    spec = node.meta.get("fxshard_spec")
    dim %= node.meta["val"].dim()
    axes = _axes(spec, dim, ctx) if isinstance(spec, tuple) else []
    if not axes:
        return False
    if _fused_backward(graph, node, saved):
        return True
    if dtype != node.meta["val"].dtype or g.meta["val"].dtype != dtype:
        raise NotImplementedError(
            f"fxshard: {node.name} (_log_softmax_backward_data over the sharded dim {dim}, "
            f"mesh {ctx.mesh.describe()}) casts {g.meta['val'].dtype} to {dtype}; compute "
            f"the loss in one dtype (logits.float() before it)")
    s, sr, sp = spec, _with(spec, axes, R), _with(spec, axes, P)
    one = _empty(node.meta["val"], dim, 1)
    with graph.inserting_before(node):
        sg = _node(graph, node, aten.sum.dim_IntList, (g, [dim], True), one, sp, [s])
        ey = _node(graph, node, aten.exp.default, (y,), node.meta["val"], s, [s])
        prod = _node(graph, node, aten.mul.Tensor, (ey, sg), node.meta["val"], s, [s, sr])
        out = _node(graph, node, aten.sub.Tensor, (g, prod), node.meta["val"], s, [s, s])
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


def _fused_backward(graph: fx.Graph, node: fx.Node, saved: dict) -> bool:
    """``node`` (the log-softmax's backward over the class dim) of the gradient of an NLL only
    (``vocab_nll_loss_backward``, its one user), on rows of a log-softmax this pass rewrote:
    both become ``fxshard::vocab_cross_entropy_backward`` on the forward's ``e`` and ``lse``."""
    from ..ops.loss import (vocab_cross_entropy_backward, vocab_cross_entropy_grad,
                            vocab_nll_loss_backward)
    g, y = node.args[0], node.args[1]
    while y.target is aten.detach.default and y not in saved:
        y = y.args[0]
    if g.target is not vocab_nll_loss_backward.default or len(g.users) != 1 or y not in saved:
        return False
    low = saved[y][0] == "low"
    e, lse = saved[y][-2:]
    grad, _, target, reduction, ignore, total, names, sizes = g.args
    need = g.meta["fxshard_need"]           # grad, logp, target, total
    op = vocab_cross_entropy_grad if low else vocab_cross_entropy_backward
    val = _fake(lambda v: v.to(e.meta["val"].dtype), node.meta["val"]) if low else \
        node.meta["val"]
    with graph.inserting_before(node):
        out = _node(graph, node, op.default,
                    (grad, e, lse, target, reduction, ignore, total, names, sizes),
                    val, node.meta["fxshard_spec"],
                    [need[0], e.meta["fxshard_spec"], lse.meta["fxshard_spec"], need[2],
                     need[3]])
        if low:
            out = _in_dtype(graph, node, out)
    node.replace_all_uses_with(out)
    for dead in (node, g, node.args[1]):
        while dead.op == "call_function" and not dead.users:
            up = dead.args[0] if dead.target is aten.detach.default else None
            graph.erase_node(dead)
            if not isinstance(up, fx.Node):
                break
            dead = up
    return True


def _in_dtype(graph: fx.Graph, node: fx.Node, grad: fx.Node) -> fx.Node:
    """``grad`` (the logits' gradient, in their bf16 / fp16) where ``node`` (the float32
    gradient it replaces) flows, through views, into one device's cast back to that dtype:
    the views now carry ``grad``'s dtype and the cast goes. Otherwise ``grad`` cast to
    ``node``'s dtype (what its readers expect)."""
    dtype, want = grad.meta["val"].dtype, node.meta["val"].dtype
    if dtype == want:
        return grad
    chain, down = [], node
    while len(down.users) == 1:
        down = next(iter(down.users))
        if down.op == "call_function" and down.target in _VIEWS:
            chain.append(down)
            continue
        if _is_cast(down, dtype):
            for v in chain:
                v.meta["val"] = _fake(lambda a: a.to(dtype), v.meta["val"])
            down.replace_all_uses_with(chain[-1] if chain else node)
            graph.erase_node(down)
            return grad
        break
    cast = _node(graph, node, aten._to_copy.default, (grad,), node.meta["val"],
                 node.meta["fxshard_spec"], [node.meta["fxshard_spec"]])
    cast.kwargs = {"dtype": want}
    return cast


def _valid_classes(logp: fx.Node, ctx: PassCtx) -> int | None:
    """The model's vocab where ``logp``'s class dim is a vocab ``pad_vocab`` padded."""
    from .pad_vocab import padded_rows
    width = logp.meta["val"].shape[1]
    n = ctx.mesh.axis_size(TP) if TP in ctx.mesh.axis_names else 1
    rows = {shape[0] for shape in ctx.padded.values()
            if shape[0] != width and padded_rows(shape[0], n) == width}
    assert len(rows) <= 1, (width, rows)
    return rows.pop() if rows else None


def _nll(node: fx.Node, ctx: PassCtx, saved: dict) -> bool:
    from ..ops.loss import vocab_nll_loss_backward, vocab_nll_loss_forward
    forward = node.target is aten.nll_loss_forward.default
    needs = node.meta.get("fxshard_need") or []
    logp_need = needs[0 if forward else 1] if len(needs) > 1 else None
    axes = _axes(logp_need, 1, ctx) if isinstance(logp_need, tuple) else []
    if not axes:
        return False
    names = [ctx.mesh.axis_names[i] for i in axes]
    sizes = [ctx.mesh.shape[i] for i in axes]
    if forward:
        logp, t, _, reduction, ignore = node.args
        node.target, node.args = vocab_nll_loss_forward.default, (logp, t, reduction, ignore,
                                                                  names, sizes)
        valid = _valid_classes(logp, ctx)
        if valid is not None:       # a padded vocab: its bound, not the padded width
            node.args = (*node.args, valid)
        if logp in saved and saved[logp][0] == "low":    # x[t] - lse, in float32
            _, xb, lse = saved[logp]
            dtype = node.meta["val"][0].dtype
            node.args = (xb, t, reduction, ignore, names, sizes,
                         -1 if valid is None else valid, lse, dtype)
            node.meta["fxshard_need"] = [xb.meta["fxshard_spec"], needs[1],
                                         lse.meta["fxshard_spec"]]
    else:
        g, logp, t, _, reduction, ignore, total = node.args
        node.target = vocab_nll_loss_backward.default
        node.args = (g, logp, t, reduction, ignore, total, names, sizes)
    return True


def vocab_parallel_loss_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    graph, counts = gm.graph, {"log_softmax": 0, "log_softmax_backward": 0, "nll": 0}
    saved: dict = {}    # rewritten log-softmax output -> its (e, lse)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in LOG_SOFTMAX:
            counts["log_softmax"] += _log_softmax(graph, node, ctx, saved)
        elif node.target is aten._log_softmax_backward_data.default:
            counts["log_softmax_backward"] += _log_softmax_backward(graph, node, ctx, saved)
        elif node.target in (aten.nll_loss_forward.default, aten.nll_loss_backward.default):
            counts["nll"] += _nll(node, ctx, saved)
    ctx.report("vocab_parallel_loss_pass", **counts)
    return gm
