"""The ops of decode programs (``fxshard.passes.kv_cache`` puts them in rank programs).

``fxshard::decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths,
float? scale, bool causal, float softcap=0.0) -> (Tensor, Tensor)``
    :func:`fxshard.kernels.decode.decode_attention` (Triton on CUDA, torch on CPU): the new
    queries against the first ``lengths[b]`` slots of the cache, ``(out, lse)``; ``softcap``
    (Gemma-2's ``cap * tanh(s / cap)`` of each scaled score) 0 is off. Eager rank
    programs call :func:`fxshard.kernels.decode.decode_attention_unchecked` directly.

``fxshard::merge_pieces(Tensor outs, Tensor lses) -> Tensor``
    the attention results of one query over disjoint pieces of the keys, stacked on dim 0
    (``[n, B, H, S, D]`` and ``[n, B, H, S]``, e.g. gathered over ``ring_cp``), merged by
    logsumexp into ``[B, H, S, D]``: flash-decoding across ranks.

``fxshard::sharded_argmax(Tensor x, str axis, int size) -> Tensor``
    ``torch.argmax(all_gather(x, -1, axis, size), -1)`` without gathering ``x``: each rank
    takes the first maximum of its shard of the last dim (the vocab), and the ranks of
    ``axis`` exchange one ``(value, global index)`` pair per row (``[..., 2]`` float64, exact
    for every float dtype and any index below 2**53) instead of their ``[..., V / size]``
    shards. The winner is the first coordinate holding the row's maximum (coordinate ``j``
    holds indices ``j * V / size ..``): the lowest global index on ties, and the first NaN
    when there is one, as ``torch.argmax`` on the whole row. Greedy decode programs end
    with it (``fxshard.passes.kv_cache.greedy_tokens_pass``).

The cache write itself is ``fxshard::cache_write`` (:mod:`fxshard.ops.cache`).
"""
from __future__ import annotations

from typing import Optional

import torch

from fxshard.kernels.decode import decode_attention as _decode_attention
from fxshard.kernels.decode import decode_attention_unchecked
from fxshard.ops.collectives import checked_backend
from fxshard.ops.library import define_op

__all__ = ["decode_attention", "merge_pieces", "sharded_argmax"]


@define_op("fxshard::decode_attention",
           "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, float? scale, "
           "bool causal, float softcap=0.0) -> (Tensor, Tensor)")
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: Optional[float], causal: bool,
                     softcap: float = 0.0):
    return _decode_attention(q, k_cache, v_cache, lengths, scale=scale, causal=causal,
                             softcap=softcap)


decode_attention.register_direct(decode_attention_unchecked)


@decode_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale, causal, softcap=0.0):   # out: v's head size (MLA)
    return q.new_empty((*q.shape[:3], v_cache.shape[3])), \
        q.new_empty(q.shape[:3], dtype=torch.float32)


@define_op("fxshard::merge_pieces", "(Tensor outs, Tensor lses) -> Tensor")
def merge_pieces(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    cdtype = torch.float64 if outs.dtype == torch.float64 else torch.float32
    lses = lses.to(cdtype)
    top = lses.amax(0)
    top = torch.where(torch.isneginf(top), 0.0, top)
    w = torch.exp(lses - top)                    # [n, B, H, S]; 0 for a piece with no key
    total = w.sum(0)
    total = torch.where(total == 0, 1.0, total)
    out = (outs.to(cdtype) * (w / total).unsqueeze(-1)).sum(0)
    return out.to(outs.dtype)


@merge_pieces.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:])


@define_op("fxshard::sharded_argmax", "(Tensor x, str axis, int size) -> Tensor")
def sharded_argmax(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    backend = checked_backend("sharded_argmax", axis, size)
    best, local = x.max(-1)             # the first maximum of the shard (or its first NaN)
    if size == 1:
        return local
    offset = backend.axis_index(axis) * x.shape[-1]
    pair = torch.stack([best.to(torch.float64), local + offset])   # [2, ...] float64
    pairs = backend.all_gather(pair.unsqueeze(0), 0, axis)          # [size, 2, ...]
    winner = pairs.select(1, 0).argmax(0, keepdim=True)             # first coordinate wins ties
    return pairs.select(1, 1).gather(0, winner).squeeze(0).to(torch.int64)


@sharded_argmax.register_fake
def _(x, axis, size):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)
