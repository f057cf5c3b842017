"""Refinements the joint graph's propagation repeats its sweep for (``program.py``).

A backward has patterns a forward rarely has, where a rule's local choice costs extra
collectives; each refinement finds one after a sweep and the next sweep avoids it:

- ``reduced_many_times``: a partial sum flowing through linear ops into several reductions
  (the input gradient of a column-parallel block, summed over q, k, v, then the norm's
  backward) is reduced once, at the latest value every path passes through, where that moves
  no more bytes than the reductions it replaces (an MoE expert output ``[T * k, H]`` is not:
  its ``[T, H]`` top-k sum and its ``[T * k]`` router gradient are reduced apart)::

      add_16 = add(add_15, view_31)          # P: q, k and v input gradients
      mul_35 = mul(add_16, w_norm); sum_6 = sum(mul(mul_35, x), [2]); mul_38 = ...
      before: all_reduce(sum_6), all_reduce(mul_38), all_reduce(view_32)   (three)
      after:  all_reduce(add_16)                                             (Megatron's one)

- ``gathered_many_times``: a sharded value whose views are gathered separately (sequence
  parallelism's gradient ``view_15`` and its transpose ``t_12`` for the weight gradient) is
  gathered once, before the views;
- ``mirrored_inputs``: the gradient of a matmul's input, where the backward's local choice
  shards it otherwise than the forward holds the input (whole, or sharded on another dim),
  is redistributed to the input's placement where it is made. A tied table split on the
  hidden dim (``plan={"lm_head": "embed_dim"}``): the head's input gradient
  ``mm(grad_logits, w)`` comes out hidden-sharded; kept so, it reached every layer's
  backward, where each weight was all-to-all'ed into its layout. Gathered (sequence
  parallel: to its sequence shard, where the input held one), the layers run Megatron's
  backward::

      mm_9 = mm(view_12, t_10)              # tp: R x S(1) -> S(1), the input was R
      before: view_13 ... add_7 S(2) ... all_to_all(down_proj.weight) ... (per layer)
      after:  all_gather(mm_9)              # one [B * S, H] gather

- ``tag_sliced``: each ``slice_backward`` is told the tensor its forward slice cut (the
  same autograd ``seq_nr``), so the gradient of q, k or v is padded into the fused layout of
  ``qkv_proj``'s output rather than gathered (``rules/backward.py``);
- ``dedupe_views_pass``: identical views of one value (aot_autograd's decomposed ``linear``
  reshapes its input once per projection) become one node, so q, k and v share one gather.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..passes import PassCtx
from ..passes.rules import held, tensor_inputs
from ..placement import Partial, R, local_shape, shard_dim

aten = torch.ops.aten

__all__ = ["reduced_many_times", "gathered_many_times", "mirrored_inputs", "dedupe_views_pass",
           "tag_sliced"]

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default,
          aten.transpose.int, aten.permute.default)


def reduced_many_times(gm: fx.GraphModule, ctx: PassCtx) -> dict:
    """(node, axis index) -> placement for each Partial value whose partial sum reaches more
    than one reduction through Partial consumers, taking the latest such value (none of its
    consumers reaches all of its reductions)."""
    return _reaching_many(gm, ctx, held=lambda p: isinstance(p, Partial),
                          ends=lambda need: not isinstance(need, Partial), views_only=False,
                          cheaper=True)


def gathered_many_times(gm: fx.GraphModule, ctx: PassCtx) -> dict:
    """(node, axis index) -> Replicate for each sharded value that, itself and through views
    that keep a shard, is gathered more than once; the latest such value."""
    return _reaching_many(gm, ctx, held=lambda p: shard_dim(p) is not None,
                          ends=lambda need: need == R, views_only=True)


def mirrored_inputs(gm: fx.GraphModule, ctx: PassCtx, tangents) -> dict:
    """(node, axis index) -> the input's placement for each backward ``mm`` (one that
    depends on a node of ``tangents``) that makes the gradient of a forward ``mm`` or
    ``addmm``'s input ``a`` (aot_autograd gives both the same ``seq_nr``): ``mm(grad, w)``
    with ``w`` a view of the forward's other operand and ``a``'s shape, sharded on an axis
    where ``a`` is whole or sharded on another dim (its placement as its consumers see it). A
    parameter's gradient is left alone (it leaves in the parameter's placement). Under
    sequence parallelism a whole input on ``tp`` is one gathered from sequence shards, where
    its gradient is headed: that is left to the sweep (an all-to-all to them moves half an
    all-gather). An input in a fused layout (``StridedShard``: the batch's rows' sequence
    halves) is reached by a gather and a local slice: GPT-2's head under sequence
    parallelism moves ``[B * S, H / tp]`` where the sweep's all-to-all moved half that, a
    small price for Llama's, whose layers otherwise all-to-all every weight."""
    from ..mesh import TP
    backward = set(tangents)
    for node in gm.graph.nodes:
        if any(t in backward for t in node.all_input_nodes):
            backward.add(node)
    forward: dict = {}
    for node in gm.graph.nodes:
        if node.target in _MATMULS and node not in backward and \
                node.meta.get("seq_nr") is not None:
            forward.setdefault(node.meta["seq_nr"], []).append(node)
    out = {}
    for node in gm.graph.nodes:
        if node.target is not aten.mm.default or node not in backward:
            continue
        spec = node.meta.get("fxshard_spec")
        shape = tuple(node.meta["val"].shape)
        for f in forward.get(node.meta.get("seq_nr"), []):
            a, b = f.args[-2], f.args[-1]
            a_spec = held(a)
            if not isinstance(spec, tuple) or not isinstance(a_spec, tuple) or \
                    a.op == "placeholder" or tuple(a.meta["val"].shape) != shape or \
                    not _view_of(node.args[1], b):
                continue
            for i, (axis, n) in enumerate(zip(ctx.mesh.axis_names, ctx.mesh.shape)):
                whole_on_sp = a_spec[i] == R and ctx.sequence_parallel and axis == TP
                if n > 1 and shard_dim(spec[i]) is not None and spec[i] != a_spec[i] and \
                        (a_spec[i] == R and not whole_on_sp or
                         shard_dim(a_spec[i]) is not None):
                    out[(node.name, i)] = a_spec[i]
    return out


_MATMULS = (aten.mm.default, aten.addmm.default)


def _view_of(node, value: fx.Node) -> bool:
    """``node`` is ``value`` or made from it by views alone (``t(t(w))``)."""
    while isinstance(node, fx.Node) and node is not value and node.target in _VIEWS:
        node = node.args[0]
    return node is value


def _bytes(node: fx.Node, mesh) -> int:
    """Bytes of ``node``'s value on one rank."""
    val, spec = node.meta.get("val"), node.meta.get("fxshard_spec")
    if not isinstance(val, torch.Tensor) or not isinstance(spec, tuple):
        return 0
    return int(torch.Size(local_shape(tuple(val.shape), spec, mesh)).numel()) * \
        val.element_size()


def _reaching_many(gm: fx.GraphModule, ctx: PassCtx, *, held, ends, views_only: bool,
                   cheaper: bool = False) -> dict:
    """Per mesh axis: each value whose placement is ``held`` reaches, directly or through
    consumers that hold it too (only views if ``views_only``), the uses whose need ``ends``
    it; the latest value reaching two or more, and no other value reaching all of them, gets
    the placement its uses need (Replicate when they differ). ``cheaper``: only where it is no
    bigger than those uses' values together (an MoE expert output ``[T * k, H]`` reaches the
    forward's ``[T, H]`` sum over top-k and the backward's ``[T * k]`` router gradient: each
    reduced apart moves less)."""
    out = {}
    nodes = list(gm.graph.nodes)
    by_name = {node.name: node for node in nodes}
    for i, n in enumerate(ctx.mesh.shape):
        if n == 1:
            continue
        sinks: dict = {}
        for node in reversed(nodes):
            spec = node.meta.get("fxshard_spec")
            if not isinstance(spec, tuple) or not held(spec[i]) or node.op == "placeholder":
                continue
            found = set()
            for u in node.users:
                uspec = u.meta.get("fxshard_spec")
                for t, need in zip(tensor_inputs(u), u.meta.get("fxshard_need") or []):
                    if t is not node or need is None:
                        continue
                    if ends(need[i]):          # one reduction / gather of node
                        found.add((node.name, tuple(need)))
                    elif (not views_only or u.target in _VIEWS) and \
                            isinstance(uspec, tuple) and held(uspec[i]):
                        found |= sinks.get(u, frozenset())
            sinks[node] = frozenset(found)
        chosen: list = []
        for node, reached in sorted(sinks.items(), key=lambda kv: -len(kv[1])):
            if len(reached) < 2 or any(u in sinks and sinks[u] >= reached for u in node.users) \
                    or any(reached <= other for _, other in chosen):
                continue
            if cheaper and _bytes(node, ctx.mesh) > sum(_bytes(by_name[x[0]], ctx.mesh)
                                                        for x in reached):
                continue
            chosen.append((node, reached))
            wants = {x[1][i] for x in reached}
            out[(node.name, i)] = wants.pop() if len(wants) == 1 else R
    return out


def dedupe_views_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Merge views with the same input and arguments."""
    seen: dict = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS:
            continue
        key = (node.target, node.args[0], repr(node.args[1:]), repr(node.kwargs))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            merged += 1
    if merged:
        gm.graph.lint()
        gm.recompile()
    ctx.report("dedupe_views_pass", changed=False, views_merged=merged)
    return gm


def tag_sliced(gm: fx.GraphModule) -> int:
    """``meta["fxshard_sliced"]`` of each ``slice_backward``: the input of the forward slice
    it is the gradient of (aot_autograd gives both the op's ``seq_nr``; the slice's dim,
    bounds and input shape must match too)."""
    forward: dict = {}
    for node in gm.graph.nodes:
        if node.target is aten.slice.Tensor and node.meta.get("seq_nr") is not None:
            forward.setdefault(node.meta["seq_nr"], []).append(node)
    tagged = 0
    for node in gm.graph.nodes:
        if node.target is not aten.slice_backward.default:
            continue
        sizes, dim, start, end = list(node.args[1]), node.args[2], node.args[3], node.args[4]
        for f in forward.get(node.meta.get("seq_nr"), []):
            x = f.args[0]
            args = list(f.args) + [0, 0, None][len(f.args) - 1:]
            if list(x.meta["val"].shape) == sizes and args[1] % len(sizes) == dim % len(sizes) \
                    and (args[2] or 0) == start and min(args[3] or sizes[dim], sizes[dim]) == \
                    min(end, sizes[dim]):
                node.meta["fxshard_sliced"] = x
                tagged += 1
                break
    return tagged
