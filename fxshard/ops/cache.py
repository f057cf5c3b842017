"""The KV-cache write of text generation (``fxshard.passes.kv_cache`` puts it in rank programs).

``fxshard::cache_write(Tensor(a!) cache, Tensor x, Tensor pos) -> ()``
    writes ``x`` ``[B, H, S, D]`` into slots ``pos .. pos + S`` of ``cache`` ``[B, H, L, D]``
    (dim 2) in place: the cache is the ParallelModule's state, updated where it lives, never
    copied per token. The mutation is in the schema, so ``Graph.eliminate_dead_code`` keeps the
    call and torch.compile functionalises it (later reads of ``cache`` see the write).

The ops that read the cache (``decode_attention``, ``merge_pieces``) and greedy decode's
``sharded_argmax`` are in :mod:`fxshard.ops.decode`.
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op

__all__ = ["cache_write"]


@define_op("fxshard::cache_write", "(Tensor(a!) cache, Tensor x, Tensor pos) -> ()")
def cache_write(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> None:
    if x.dim() != 4 or cache.dim() != 4 or x.shape[:2] != cache.shape[:2] or \
            x.shape[3] != cache.shape[3]:
        raise ValueError(f"fxshard::cache_write: x of shape {tuple(x.shape)} does not fit a "
                         f"cache of shape {tuple(cache.shape)} (both [B, H, S, D])")
    index = pos.reshape(1).to(torch.int64) + torch.arange(x.shape[2], device=cache.device)
    cache.index_copy_(2, index, x.to(cache.dtype))


@cache_write.register_direct
def _cache_write_direct(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> None:
    """Eager rank programs: a decode step's one new slot (``x`` ``[B, H, 1, D]`` of the
    cache's dtype, ``pos`` the runner's int64 ``[1]``) is ``pos`` itself as the index, with no
    index tensor built per call."""
    if x.shape[2] == 1 and x.dtype == cache.dtype and pos.dtype == torch.int64:
        cache.index_copy_(2, pos, x)
    else:
        cache_write(cache, x, pos)


@cache_write.register_fake
def _(cache, x, pos):
    return None
