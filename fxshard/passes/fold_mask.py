"""Fold constant causal masks into ``is_causal=True`` before placements are chosen.

HuggingFace builds its attention mask from ``arange`` and constants (no input, no weight). The
mask is evaluated once at trace time; when it is the plain causal mask the attention call gets
``is_causal=True`` and no mask, so the fused kernel runs without it and context parallelism
sees causal attention rather than an opaque ``[B, 1, S, S]`` tensor::

    before: le = le(kv_idx, q_idx); mask = expand(le, [2, -1, 8, 8])
            sdpa = scaled_dot_product_attention(q, k, v, mask, scale=0.25)
    after:  sdpa = scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassCtx
from .rules.attention import sdpa_args

aten = torch.ops.aten

__all__ = ["fold_causal_mask_pass"]


def _constant_value(node: fx.Node, constants: dict):
    """Evaluate ``node`` if it depends only on constants and factory ops, else None."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op == "placeholder":
            if n.meta.get("fxshard_buffer") is None:
                return False
        elif n.op != "call_function" or str(n.target).startswith("fxshard"):
            return False
        for a in n.all_input_nodes:
            if not visit(a):
                return False
        order.append(n)
        return True

    if not visit(node) or len(order) > 200:
        return None
    env: dict[fx.Node, object] = {}
    for n in order:
        if n.op == "placeholder":
            v = constants.get(n.meta["fxshard_buffer"])
            if v is None or v.device.type == "meta":
                return None
            env[n] = v
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
    return env[node]


def _is_causal_mask(mask: torch.Tensor, sq: int, skv: int) -> bool:
    if mask.dtype != torch.bool or mask.shape[-2:] != (sq, skv):
        return False
    causal = torch.ones(sq, skv, dtype=torch.bool).tril()  # top-left, as SDPA's is_causal
    return bool((mask == causal).all())


def fold_causal_mask_pass(gm: fx.GraphModule, *, ctx: PassCtx, constants: dict
                          ) -> fx.GraphModule:
    folded = 0
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        mask = a["attn_mask"]
        if not isinstance(mask, fx.Node) or a["is_causal"]:
            continue
        sq, skv = a["query"].meta["val"].shape[-2], a["key"].meta["val"].shape[-2]
        value = _constant_value(mask, constants)
        if value is None or not _is_causal_mask(value, sq, skv):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "is_causal",
                                                                      "dropout_p")}
        node.args = (a["query"], a["key"], a["value"], None, a["dropout_p"], True)
        node.kwargs = kwargs
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    ctx.report("fold_causal_mask_pass", f"folded {folded} constant masks to is_causal=True")
    return gm
