"""Context-parallel training: ring attention and Ulysses marks in the joint graph.

On ``ring_cp`` the rules (``passes/rules/attention_cp.py``) keep CPU flash attention and its
backward sequence-sharded and note ``ring``; after ``localize`` this pass swaps both for the
ring ops, whose ``(out, lse)`` outputs and ``(dq, dk, dv)`` gradients have the aten ops'
layouts, so every user stays as it is (the forward's lse is the *global* merged one, which the
partition saves for the backward)::

    before: flash = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                      scale=0.25)
            bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                      g, q, k, v, flash[0], flash[1], 0.0, True, scale=0.25)
    after:  flash = fxshard.ring_attention(q, k, v, True, 0.25, 'ring_cp', 2, 1, 0, True)
            bwd = fxshard.ring_attention_backward(g, q, k, v, flash[0], flash[1], True, 0.25,
                                                  'ring_cp', 2, 1, 0, True)

``ulysses_cp`` needs no lowering: the rules trade the sequence shard for heads around the
aten ops, and the redistribution table's all-to-alls (forward, and their inverses on the
backward's inputs and outputs) do the rest. ``mark_ulysses_pass`` (before propagation) puts a
``ulysses_out`` marker after each attention result its users read, so that they get it back
sequence-sharded (one all-to-all) rather than computing on heads; ``drop_marks_pass`` (after
``insert_collectives``) removes the markers::

    getitem = flash[0]; transpose = transpose(getitem, 1, 2)                 # before
    getitem = flash[0]; mark = ulysses_out(getitem); transpose = transpose(mark, 1, 2)
    all_to_all = fxshard.all_to_all(getitem, 2, 1, 'ulysses_cp', 2)          # after both
    transpose = transpose(all_to_all, 1, 2)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxshard.ops.ring  # noqa: F401  (registers fxshard::ring_attention[_backward])
from ..mesh import ULYSSES
from ..passes import PassCtx
from ..passes.rules.attention_cp import ulysses_out

aten = torch.ops.aten

__all__ = ["lower_ring_pass", "mark_ulysses_pass", "drop_marks_pass"]

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

def lower_ring_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """CPU flash attention (and its backward) noted ``ring`` -> the ring ops."""
    lowered = 0
    for node in list(gm.graph.nodes):
        if node.target not in (_FLASH, _FLASH_BACKWARD):
            continue
        ring = (node.meta.get("fxshard_notes", {}).get("ring") or [None])[0]
        if ring is None:
            continue
        backward = node.target is _FLASH_BACKWARD
        names = ["grad_out"] * backward + ["query", "key", "value"] + \
            ["out", "logsumexp"] * backward + ["dropout_p", "is_causal"]
        a = dict(dropout_p=0.0, is_causal=False, attn_mask=None, scale=None)
        a.update(zip(names, node.args))
        a.update(node.kwargs)
        if a["dropout_p"]:
            raise NotImplementedError(f"fxshard.training: attention {node.name} has dropout_p="
                                      f"{a['dropout_p']}; use dropout 0")
        layout = (bool(a["is_causal"]), a["scale"], ring, ctx.mesh.axis_size(ring), 1, 0,
                  ring in ctx.zigzag_axes, -1)
        mask = () if a["attn_mask"] is None else (0.0, a["attn_mask"])
        if backward:
            node.target = torch.ops.fxshard.ring_attention_backward.default
            node.args = (a["grad_out"], a["query"], a["key"], a["value"], a["out"],
                         a["logsumexp"]) + layout + mask
        else:
            node.target = torch.ops.fxshard.ring_attention.default
            node.args = (a["query"], a["key"], a["value"]) + layout + mask
        node.kwargs = {}
        lowered += 1
    if lowered:
        gm.recompile()
    ctx.report("lower_ring_pass", lowered=lowered)
    return gm


def mark_ulysses_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """A ``ulysses_out`` marker after the output of each attention and each of its gradients
    (not the lse, which only the backward reads) when ``ulysses_cp`` is active."""
    marked = 0
    if ctx.mesh.axis_size(ULYSSES) > 1:
        graph = gm.graph
        for node in list(graph.nodes):
            keep = (0,) if node.target is _FLASH else (0, 1, 2) \
                if node.target is _FLASH_BACKWARD else ()
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] in keep:
                    with graph.inserting_after(user):
                        mark = graph.call_function(ulysses_out, (user,))
                    mark.meta.update(user.meta)
                    # the backward's own copy of out (detach) keeps the heads layout
                    user.replace_all_uses_with(mark, delete_user_cb=lambda n: n is not mark
                                               and n.target is not aten.detach.default)
                    marked += 1
        gm.recompile()
    ctx.report("mark_ulysses_pass", marked=marked)
    return gm


def drop_marks_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Remove the ``ulysses_out`` markers (their collectives are in place)."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.target is ulysses_out:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    ctx.report("drop_marks_pass", dropped=dropped)
    return gm
