"""Grouped KV heads on more ``tp`` ranks than KV heads, in the joint graph.

A model that attends with its KV heads unrepeated (``enable_gqa``: the bundled Llama) hands
CPU flash attention ``Hkv < Hq`` heads. When ``tp`` does not divide ``Hkv``, no shard of K/V
gives each rank the KV heads of its query heads; so K/V are repeated to ``Hq`` heads first
(what HuggingFace's ``repeat_kv`` does in the model) and the gradient of the repeated K/V is
summed back over each group, both as plain ops that the rules place (K/V arrive replicated,
the repeat is sliced to the rank's heads, the summed gradient is a partial sum)::

    before: flash = _scaled_dot_product_flash_attention_for_cpu(q, k, v, ...)    # k [B, 2, S, D]
            bwd = ..._backward(g, q, k, v, out, lse, ...);  grad_k = bwd[1]
    after:  k_rep = reshape(expand(unsqueeze(k, 2), [B, 2, 2, S, D]), [B, 4, S, D])
            flash = ...(q, k_rep, v_rep, ...);  bwd = ..._backward(g, q, k_rep, v_rep, ...)
            grad_k = sum(reshape(bwd[1], [B, 2, 2, S, D]), [2])
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..passes import PassCtx
from ..mesh import TP

aten = torch.ops.aten

__all__ = ["repeat_kv_pass"]

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _call(graph: fx.Graph, op, args: tuple, like: torch.Tensor, shape) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = torch.empty(shape, dtype=like.dtype, device="meta")
    return node


def _repeat(graph: fx.Graph, kv: fx.Node, r: int) -> fx.Node:
    val = kv.meta["val"]
    b, h, s, d = val.shape
    u = _call(graph, aten.unsqueeze.default, (kv, 2), val, (b, h, 1, s, d))
    e = _call(graph, aten.expand.default, (u, [b, h, r, s, d]), val, (b, h, r, s, d))
    return _call(graph, aten.reshape.default, (e, [b, h * r, s, d]), val, (b, h * r, s, d))


def _unrepeat(graph: fx.Graph, grad: fx.Node, h: int, r: int) -> fx.Node:
    val = grad.meta["val"]
    b, _, s, d = val.shape
    v = _call(graph, aten.reshape.default, (grad, [b, h, r, s, d]), val, (b, h, r, s, d))
    return _call(graph, aten.sum.dim_IntList, (v, [2]), val, (b, h, s, d))


def repeat_kv_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    tp = ctx.mesh.axis_size(TP) if TP in ctx.mesh.axis_names else 1
    graph, changed = gm.graph, 0
    for node in list(graph.nodes):
        if node.target is not _FLASH:
            continue
        q, k, v = node.args[:3]
        hq, hkv = q.meta["val"].shape[1], k.meta["val"].shape[1]
        if hq == hkv or hkv % tp == 0 or hq % hkv:
            continue
        r = hq // hkv
        with graph.inserting_before(node):
            k_rep, v_rep = _repeat(graph, k, r), _repeat(graph, v, r)
        node.update_arg(1, k_rep)
        node.update_arg(2, v_rep)
        for bwd in [u for u in k.users if u.target is _FLASH_BACKWARD and u.args[1] is q]:
            with graph.inserting_before(bwd):
                bk, bv = _repeat(graph, k, r), _repeat(graph, v, r)
            bwd.update_arg(2, bk)
            bwd.update_arg(3, bv)
            rep = bk.meta["val"]
            bwd.meta["val"] = [bwd.meta["val"][0], rep, rep]    # grads of the repeated K/V
            for g in [u for u in bwd.users if u.target is operator.getitem and u.args[1] in (1, 2)]:
                g.meta["val"] = rep
                with graph.inserting_before(g.next):
                    summed = _unrepeat(graph, g, hkv, r)
                g.replace_all_uses_with(summed, delete_user_cb=lambda u: u is not summed.args[0])
        changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    ctx.report("repeat_kv_pass", changed=False, kv_heads_repeated=changed)
    return gm
