"""Grouped-query attention kept grouped: drop ``repeat_kv`` in front of attention.

HuggingFace's attention repeats each KV head for its ``G`` query heads before calling SDPA
(``repeat_kv``: unsqueeze, expand, reshape; litgpt and others write the same heads as
``repeat_interleave(k, G, dim=1)``). fxshard's attention maps query head ``h`` to KV head
``h // G`` itself (``enable_gqa``), so the repeat only costs: ring attention would pass
``G`` times the K/V bytes around the ring, Ulysses would exchange ``G`` times the K/V, and a KV
cache would hold every head ``G`` times. The pass feeds the un-repeated K/V to attention::

    before: unsqueeze = unsqueeze(k, 2); expand = expand(unsqueeze, [2, 2, 4, 8, 16])
            reshape = reshape(expand, [2, 8, 8, 16]); ...(same for v)
            sdpa = scaled_dot_product_attention(q, reshape, reshape_1, None, 0.0, True)
    after:  sdpa = scaled_dot_product_attention(q, k, v, None, 0.0, True, enable_gqa=True)

Only the exact patterns (repeat factor ``G`` on a new dim 2 merged into the heads, or each
head repeated ``G`` times in place on dim 1; the same ``G`` for K and V, ``Hq == Hkv * G``)
are rewritten: the result is identical.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassCtx
from .rules.attention import sdpa_args

aten = torch.ops.aten

__all__ = ["unrepeat_kv_pass"]

_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _unrepeated(t: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, G)`` when ``t`` is ``reshape(expand(unsqueeze(x, 2), [B, H, G, S, D]),
    [B, H * G, S, D])``, else None."""
    if isinstance(t, fx.Node) and t.target is aten.repeat_interleave.self_int:
        return _interleaved(t)
    if not isinstance(t, fx.Node) or t.target not in _RESHAPES:
        return None
    expand = t.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default or \
            len(expand.users) != 1:
        return None
    unsq = expand.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target is not aten.unsqueeze.default or \
            unsq.args[1] not in (2, -3) or len(unsq.users) != 1:
        return None
    x = unsq.args[0]
    xv, ev, tv = x.meta.get("val"), expand.meta.get("val"), t.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (xv, ev, tv)) or xv.dim() != 4 or \
            ev.dim() != 5:
        return None
    b, h, s, d = xv.shape
    g = ev.shape[2]
    if tuple(ev.shape) != (b, h, g, s, d) or tuple(tv.shape) != (b, h * g, s, d):
        return None
    return x, g


def _interleaved(t: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, G)`` when ``t`` is ``repeat_interleave(x, G, 1)`` of a 4-D ``[B, H, S, D]``."""
    args = list(t.args) + [None, None][:4 - len(t.args)]
    x, g, dim = args[0], args[1], t.kwargs.get("dim", args[2])
    if not isinstance(g, int) or dim is None or t.kwargs.get("output_size") is not None \
            or args[3] is not None:
        return None
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(xv, torch.Tensor) or xv.dim() != 4 or dim % 4 != 1:
        return None
    return x, g


def unrepeat_kv_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    changed = 0
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        k, v = _unrepeated(a["key"]), _unrepeated(a["value"])
        if k is None or v is None or k[1] != v[1] or k[1] == 1:
            continue
        if a["query"].meta["val"].shape[1] != k[0].meta["val"].shape[1] * k[1]:
            continue
        node.args = (a["query"], k[0], v[0], a["attn_mask"], a["dropout_p"], a["is_causal"])
        node.kwargs = {"scale": a["scale"], "enable_gqa": True}
        changed += 1
    ctx.report("unrepeat_kv_pass", unrepeated_attentions=changed)
    return gm
