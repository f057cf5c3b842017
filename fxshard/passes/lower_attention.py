"""Lower ``aten.scaled_dot_product_attention`` to ``fxshard.attention`` on the rank's heads.

Before::

    sdpa = aten.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25, enable_gqa=True)

After::

    attention = torch.ops.fxshard.attention(q, k, v, None, True, 0.25, 0, 0)
    getitem = attention[0]

``fxshard.attention`` (``fxshard.kernels``) maps GQA inside the kernel and returns the
logsumexp as well, which context parallelism merges with. When ``tp`` exceeds the KV heads,
the KV heads arrive replicated and each rank keeps the one its query heads use::

    k_local = local_shard(repeat_interleave(k, tp // Hkv, dim=1), 1, "tp", tp)

A constant mask (one that depends on no input, like HuggingFace's causal mask built from
``arange``) is evaluated once at trace time; if it is the plain causal mask it becomes
``causal=True`` and the mask is dropped, so the fused kernel runs without it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import kernels  # noqa: F401  (registers torch.ops.fxshard.attention)
from ..placement import Shard
from . import PassCtx
from .insert_collectives import collective_target
from .rules.attention import sdpa_args

aten = torch.ops.aten

__all__ = ["lower_attention_pass"]


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
    causal = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    return bool((mask == causal).all())


def lower_attention_pass(gm: fx.GraphModule, *, ctx: PassCtx, constants: dict | None = None
                         ) -> fx.GraphModule:
    graph = gm.graph
    lowered = folded = 0
    for node in list(graph.nodes):
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        if a["dropout_p"]:
            raise NotImplementedError(
                f"fxshard.parallelize: attention {node.name} has dropout_p={a['dropout_p']}; "
                f"fxshard runs inference graphs (put the model in eval mode)")
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        causal = bool(a["is_causal"])
        sq, skv = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
        if isinstance(mask, fx.Node) and constants is not None:
            value = _constant_value(mask, constants)
            if value is not None and not causal and _is_causal_mask(value, sq, skv):
                mask, causal = None, True
                folded += 1
        with graph.inserting_before(node):
            axis = node.meta.get("fxshard_notes", {}).get("kv_heads_replicated")
            if axis is not None:
                size = ctx.mesh.axis_size(axis)
                hkv = k.meta["val"].shape[1]
                k, v = (_pick_kv_heads(graph, t, axis, size, hkv, ctx.mesh) for t in (k, v))
            att = graph.call_function(torch.ops.fxshard.attention.default,
                                      (q, k, v, mask, causal, a["scale"], 0, 0))
            att.meta.update({key: node.meta[key] for key in ("fxshard_stage",)
                             if key in node.meta})
            out = graph.call_function(operator.getitem, (att, 0))
        out.meta.update(node.meta)
        att.meta["val"] = (node.meta["val"], None)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        lowered += 1
    if lowered:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    ctx.report("lower_attention_pass", f"lowered {lowered} attention ops "
                                       f"({folded} constant masks folded to causal)")
    return gm


def _pick_kv_heads(graph: fx.Graph, t: fx.Node, axis: str, size: int, hkv: int,
                   mesh) -> fx.Node:
    """Rank r of ``axis`` keeps KV head ``r // (size // hkv)``: the one its query heads use."""
    val = t.meta["val"]
    rep = graph.call_function(aten.repeat_interleave.self_int, (t, size // hkv, 1))
    rep.meta["val"] = val.new_empty((val.shape[0], size, *val.shape[2:]))
    rep.meta["fxshard_spec"] = t.meta.get("fxshard_spec")
    out = graph.call_function(collective_target("local_shard"), (rep, 1, axis, size))
    spec = list(t.meta["fxshard_spec"])
    spec[mesh.axis_names.index(axis)] = Shard(1)
    out.meta["val"] = rep.meta["val"]
    out.meta["fxshard_spec"] = tuple(spec)
    return out
