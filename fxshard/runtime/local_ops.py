"""Local ops that depend on a rank's coordinate but move no data between ranks.

``fxshard::vocab_embedding(weight, ids, axis, size)``: the rank holds rows
``[r * V/size, (r + 1) * V/size)`` of a vocab-sharded embedding; ids outside that range look up
zeros, so the sum over ``axis`` (the all-reduce that follows) is the full embedding.

``fxshard::partial_from_replicate(x, axis, size)``: Replicate -> Partial, ``x`` on coordinate
0 and zeros elsewhere.
"""
from __future__ import annotations

import torch

from .context import current_backend

__all__ = ["vocab_embedding", "partial_from_replicate"]


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


@torch.library.custom_op("fxshard::partial_from_replicate", mutates_args=())
def partial_from_replicate(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """Replicate -> Partial on ``axis``: coordinate 0 keeps ``x``, the others hold zeros, so
    the sum over the axis is ``x`` (how a bias joins a row-parallel partial sum once)."""
    if current_backend().axis_index(axis) == 0:
        return x.clone()
    return torch.zeros_like(x)


@partial_from_replicate.register_fake
def _(x, axis, size):
    return torch.empty_like(x)
