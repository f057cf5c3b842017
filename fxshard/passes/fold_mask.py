"""Fold constant causal masks into ``is_causal=True`` before placements are chosen.

HuggingFace builds its attention mask from ``arange`` and constants (no input, no weight);
others fill a ``[S, S]`` tensor with ``-inf`` and zero each row's visible keys (a sliding
window wider than the sequence). The mask is evaluated once at trace time, reading buffers from
``ctx.constants`` (the trace's constants and the buffers as loaded); when it is the plain causal
mask, boolean (True where a key is seen) or additive (0 there, ``-inf`` or below half the
dtype's lowest value elsewhere), the attention call gets ``is_causal=True`` and no mask, so the fused kernel runs without it and context parallelism
sees causal attention rather than an opaque ``[B, 1, S, S]`` tensor.

The evaluation runs on CPU whatever device the model was traced on: the mask's subgraph bakes
the model's device into its factory ops (``arange(8, device=cuda)`` or ``device=meta``), and
the fold rewrites every device it meets to CPU, so a model on ``cuda`` or built on ``meta``
folds exactly like one on CPU. A mask that reads a buffer still on ``meta`` cannot be
evaluated: that is reported with a warning naming the buffer (build the model under
:func:`fxshard.init_empty_weights` so buffers are real), never guessed::

    before: le = le(kv_idx, q_idx); mask = expand(le, [2, -1, 8, 8])
            sdpa = scaled_dot_product_attention(q, k, v, mask, scale=0.25)
    after:  sdpa = scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25)
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from . import PassCtx
from .rules.attention import sdpa_args

aten = torch.ops.aten

__all__ = ["fold_causal_mask_pass", "is_additive_causal"]


_CPU = torch.device("cpu")
# a mask's subgraph evaluated at most this big (a mask filled row by row in a Python loop
# unrolls into a few nodes per row of the sequence)
_MAX_MASK_NODES = 8192


def _on_cpu(a):
    """``a`` with every device in it (a kwarg, a ``to.device`` argument, a tensor) on CPU."""
    if isinstance(a, torch.device):
        return _CPU
    if isinstance(a, torch.Tensor):
        return a.to(_CPU)
    if isinstance(a, (list, tuple)):
        return type(a)(_on_cpu(x) for x in a)
    return a


class MetaBuffer(Exception):
    """The mask reads a buffer that has no value yet (a model built on meta)."""

    def __init__(self, fqn: str):
        super().__init__(fqn)
        self.fqn = fqn


def _constant_value(node: fx.Node, constants: dict):
    """Evaluate ``node`` on CPU if it depends only on constants and factory ops, else None.
    Raises :class:`MetaBuffer` when it would depend on a buffer that is still on meta."""
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

    if not visit(node) or len(order) > _MAX_MASK_NODES:
        return None
    env: dict[fx.Node, object] = {}
    for n in order:
        if n.op == "placeholder":
            v = constants.get(n.meta["fxshard_buffer"])
            if not isinstance(v, torch.Tensor) or v.device.type == "meta":
                raise MetaBuffer(n.meta["fxshard_buffer"])
            env[n] = v.to(_CPU)
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*_on_cpu(args), **{k: _on_cpu(v) for k, v in kwargs.items()})
    return env[node]


def is_additive_causal(value: torch.Tensor, sq: int, skv: int) -> bool:
    """``value`` (broadcast over leading dims) is 0 on and below the diagonal and ``-inf`` or
    at most half the dtype's lowest value above it: softmax gives the causal weights."""
    if not value.is_floating_point() or value.shape[-2:] != (sq, skv):
        return False
    below = torch.ones(sq, skv, dtype=torch.bool, device=value.device).tril()
    huge = value <= torch.finfo(value.dtype).min / 2
    return bool((value[..., below] == 0).all() and huge[..., ~below].all())


def _is_causal_mask(mask: torch.Tensor, sq: int, skv: int) -> bool:
    if mask.is_floating_point():
        return is_additive_causal(mask, sq, skv)
    if mask.dtype != torch.bool or mask.shape[-2:] != (sq, skv):
        return False
    causal = torch.ones(sq, skv, dtype=torch.bool, device=mask.device).tril()  # top-left
    return bool((mask == causal).all())


def fold_causal_mask_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    folded = on_meta = 0
    causal: dict[tuple, bool] = {}  # (mask node, sq, skv) -> is it causal; layers share masks
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        mask = a["attn_mask"]
        if not isinstance(mask, fx.Node) or a["is_causal"]:
            continue
        sq, skv = a["query"].meta["val"].shape[-2], a["key"].meta["val"].shape[-2]
        key = (mask, sq, skv)
        if key not in causal:
            try:
                with torch.no_grad():
                    value = _constant_value(mask, ctx.constants)
            except MetaBuffer as e:
                warnings.warn(
                    f"fxshard.parallelize: the attention mask of {node.name} reads the buffer "
                    f"{e.fqn!r}, which is on the meta device, so fxshard cannot tell whether it "
                    f"is the causal mask; attention keeps the explicit mask (context "
                    f"parallelism then gathers the sequence). Build the model under "
                    f"fxshard.init_empty_weights() so buffers are real", stacklevel=2)
                on_meta += 1
                value = None
            causal[key] = value is not None and _is_causal_mask(value, sq, skv)
        if not causal[key]:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "is_causal",
                                                                      "dropout_p")}
        node.args = (a["query"], a["key"], a["value"], None, a["dropout_p"], True)
        node.kwargs = kwargs
        folded += 1
    ctx.report("fold_causal_mask_pass", changed=folded > 0, folded_masks=folded,
               masks_on_meta=on_meta)
    return gm
