"""A mixed-precision policy's casts in the rank programs (:mod:`fxshard.mixed_precision`).

Every pass before these ran on the model traced with its parameters in ``param_dtype``; the
rank programs take the fp32 masters instead. Each floating parameter input gets one cast to
``param_dtype`` right before its first use (an fsdp all-gather, bucketed or not, then moves
bf16: half FSDP2's fp32 bytes, as FSDP2), and in the backward program each gradient is cast
to ``reduce_dtype`` before its first reduction and to the master's dtype after it. A
column-parallel weight on (fsdp=2, tp=2)::

    forward, before                            forward, after
    w_q = placeholder  (bf16 [24, 24])         w_q = placeholder  (fp32 [24, 24])
    all_gather(w_q, 1, 'fsdp', 2)              _to_copy = _to_copy(w_q, dtype=bf16)
                                               all_gather(_to_copy, 1, 'fsdp', 2)
    backward, before                           backward, after
    mm_8 = mm(t_8, view_11)      (bf16)        mm_8 = mm(t_8, view_11)         (bf16)
    reduce_scatter(mm_8, 1, 'fsdp', 2)         _to_copy_1 = _to_copy(mm_8, dtype=fp32)
    output(..., reduce_scatter, ...)           reduce_scatter(_to_copy_1, 1, 'fsdp', 2)
                                               output(..., reduce_scatter, ...)

``reduce_dtype=None`` reduces in ``param_dtype`` (FSDP2's default), then casts to fp32.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..mesh import FSDP
from ..mixed_precision import current_policy

__all__ = ["cast_weights_pass", "cast_inference_program", "working_copy_bytes"]

aten = torch.ops.aten


def _fake_as(val, dtype):
    return val.to(dtype) if isinstance(val, torch.Tensor) else val


def _spec_of(node: fx.Node) -> dict:
    """The placement meta a cast of ``node`` keeps (explain() reads it)."""
    return {k: v for k, v in node.meta.items() if k == "fxshard_spec"}


def _cast_after(graph: fx.Graph, node: fx.Node, master: torch.dtype, order: dict) -> fx.Node:
    """``node`` (a weight in the working dtype) becomes the master's input, cast to the
    working dtype right before its first use (the copy lives from its first use to its
    last), which every former use reads."""
    val = node.meta["val"]
    first = min(node.users, key=order.__getitem__, default=None)
    with graph.inserting_before(first) if first is not None else graph.inserting_after(node):
        cast = graph.call_function(aten._to_copy.default, (node,), {"dtype": val.dtype})
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    cast.meta.update(_spec_of(node), val=val)
    node.meta["val"] = _fake_as(val, master)
    return cast


_REDUCTIONS = ("all_reduce", "reduce_scatter", "all_reduce_bucket", "reduce_scatter_bucket")


def _is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and \
        getattr(node.target, "__name__", "").split(".")[0] in _REDUCTIONS


def _reduce_in(graph: fx.Graph, out: fx.Node, grad: fx.Node, reduce: torch.dtype,
               master: torch.dtype) -> None:
    """The gradient ``grad`` (an output) reduced in ``reduce`` and returned in ``master``:
    the chain of reductions and single-use value-preserving nodes that ends in ``grad`` gets
    its input cast to ``reduce``, each node of it the dtype, and a cast to ``master`` after.
    A gradient of a layer's bucket (``getitem(reduce_scatter_bucket([...]), i)``, fsdp's
    buckets) has its entry ``i`` of the bucket cast."""
    chain, node = [], grad
    while isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1 \
            and (_is_reduction(node) or node.target in _KEEPS_VALUES):
        chain.append(node)
        node = node.args[0]
    while chain and not _is_reduction(chain[-1]):
        chain.pop()     # (views before the first reduction stay in the working dtype)
    bucket = grad.args[0] if grad.target is operator.getitem and \
        _is_reduction(grad.args[0]) else None
    if bucket is not None and not chain:    # one entry of a bucket of gradients
        entry = bucket.args[0][grad.args[1]]
        if entry.meta["val"].dtype != reduce:
            with graph.inserting_before(bucket):
                cast = graph.call_function(aten._to_copy.default, (entry,), {"dtype": reduce})
            cast.meta.update(_spec_of(entry), val=_fake_as(entry.meta["val"], reduce))
            xs = list(bucket.args[0])
            xs[grad.args[1]] = cast
            bucket.update_arg(0, xs)
            vals = list(bucket.meta["val"])
            vals[grad.args[1]] = _fake_as(vals[grad.args[1]], reduce)
            bucket.meta["val"] = vals
            grad.meta["val"] = _fake_as(grad.meta["val"], reduce)
    elif chain and reduce != node.meta["val"].dtype:
        first = chain[-1]
        with graph.inserting_before(first):
            cast = graph.call_function(aten._to_copy.default, (first.args[0],),
                                       {"dtype": reduce})
        cast.meta.update(_spec_of(first.args[0]), val=_fake_as(first.args[0].meta["val"],
                                                               reduce))
        first.replace_input_with(first.args[0], cast)
        for n in chain:
            n.meta["val"] = _fake_as(n.meta["val"], reduce)
    if grad.meta["val"].dtype != master:
        with graph.inserting_after(grad):
            back = graph.call_function(aten._to_copy.default, (grad,), {"dtype": master})
        back.meta.update(_spec_of(grad), val=_fake_as(grad.meta["val"], master))
        out.replace_input_with(grad, back)


_KEEPS_VALUES = (aten.view.default, aten.reshape.default, aten.slice.Tensor,
                 aten.clone.default, aten.contiguous.default, aten.t.default,
                 aten.permute.default)


def cast_weights_pass(gm: fx.GraphModule, *, ctx) -> fx.GraphModule:
    """Training's rank programs under the policy being built (:func:`policy_scope`): each
    floating parameter input is its master, cast to ``param_dtype`` once, first; in the
    backward program each gradient is reduced in ``reduce_dtype`` and returned in the
    master's dtype (see the module docstring). Without a policy: nothing."""
    policy, cast = current_policy()
    if policy is None or not cast:
        ctx.report("cast_weights_pass", casts=0)
        return gm
    graph, n = gm.graph, 0
    order = {x: i for i, x in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        fqn = node.meta.get("fxshard_param")
        if node.op == "placeholder" and fqn in cast and \
                node.meta["val"].dtype == policy.param_dtype:
            _cast_after(graph, node, cast[fqn], order)
            n += 1
    split = getattr(ctx, "split", None)
    if split is not None and gm is split.backward:
        out = next(x for x in graph.nodes if x.op == "output")
        flat = list(out.args[0])
        grads = flat[len(flat) - len(split.grads):]
        reduce = policy.reduce_dtype or policy.param_dtype
        for fqn, g in zip(split.grads, grads):
            if fqn in cast and isinstance(g, fx.Node) and \
                    g.meta["val"].dtype == policy.param_dtype:
                _reduce_in(graph, out, g, reduce, cast[fqn])
                n += 1
    ctx.report("cast_weights_pass", casts=n)
    ctx.changed = bool(n)
    return gm


def cast_inference_program(program) -> int:
    """An inference program (:class:`fxshard.passes.emit.Program`) under the policy being
    built: each floating parameter's slot holds its master (the model's dtype) and the graph
    casts it to ``param_dtype`` once, before anything reads it (an fsdp all-gather included).
    Returns how many casts it added."""
    policy, cast = current_policy()
    if policy is None or not cast:
        return 0
    graph, n = program.graph, 0
    order = {x: i for i, x in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        slot = program.slots.get(node.target) if node.op == "get_attr" else None
        if slot is not None and slot.kind == "param" and slot.fqn in cast and \
                slot.dtype == policy.param_dtype:
            _cast_after(graph, node, cast[slot.fqn], order)
            slot.dtype = cast[slot.fqn]
            n += 1
    if n:
        graph.lint()
    return n


def working_copy_bytes(gm: fx.GraphModule, mesh) -> int:
    """The bytes of ``param_dtype`` working copies a forward rank program under a policy
    holds at its peak, as ``explain()`` counts them: the largest fsdp all-gather (one layer's
    bucket: gathered, used and dropped before the next) plus every copy not gathered on fsdp
    (cast from the rank's own shard and kept until its last use). 0 without the casts."""
    from ..placement import local_shape
    gathered, kept = 0, 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten._to_copy.default or \
                not isinstance(node.args[0], fx.Node) or \
                node.args[0].op not in ("placeholder", "get_attr") or \
                node.args[0].meta["val"].dtype == node.meta["val"].dtype:
            continue
        val = node.meta["val"]
        mine = int(torch.Size(local_shape(tuple(val.shape), node.meta["fxshard_spec"],
                                          mesh)).numel()) * val.element_size()
        users = list(node.users)
        if len(users) == 1 and FSDP in users[0].args and \
                getattr(users[0].target, "__name__", "").startswith("all_gather"):
            size = mesh.axis_size(FSDP)
            gathered = max(gathered, _gathered(users[0], mesh, size))
        else:
            kept += mine
    return gathered + kept


def _gathered(gather: fx.Node, mesh, size: int) -> int:
    """The bytes an fsdp all-gather (or a bucket of them) makes."""
    from ..placement import local_shape
    xs = gather.args[0] if isinstance(gather.args[0], (list, tuple)) else [gather.args[0]]
    return size * sum(int(torch.Size(local_shape(tuple(x.meta["val"].shape),
                                                 x.meta["fxshard_spec"], mesh)).numel())
                      * x.meta["val"].element_size() for x in xs)
