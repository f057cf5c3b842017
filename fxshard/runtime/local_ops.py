"""Local ops that depend on a rank's coordinate but move no data between ranks.

``fxshard::vocab_embedding(weight, ids, axis, size)``: the rank holds rows
``[r * V/size, (r + 1) * V/size)`` of a vocab-sharded embedding; ids outside that range look up
zeros, so the sum over ``axis`` (the all-reduce that follows) is the full embedding.
"""
from __future__ import annotations

import torch

from .context import current_backend

__all__ = ["vocab_embedding"]


@torch.library.custom_op("fxshard::vocab_embedding", mutates_args=())
def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: str, size: int
                    ) -> torch.Tensor:
    rows = weight.shape[0]
    start = current_backend().axis_index(axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@vocab_embedding.register_fake
def _(weight, ids, axis, size):
    return weight.new_empty((*ids.shape, weight.shape[1]))
