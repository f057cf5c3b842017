"""Local ops of training programs (they read the rank's coordinate, move no data).

``fxshard::vocab_embedding_backward(grad, ids, rows, padding_idx, axis, size)``: the gradient
of the rank's rows ``[r * rows, (r + 1) * rows)`` of a vocab-sharded embedding (the backward of
``fxshard::vocab_embedding``): tokens outside the range add nothing::

    before: embedding_dense_backward(grad, ids, 96, -1, False)                 # table S(0)
    after:  vocab_embedding_backward(grad, ids, 48, -1, 'tp', 2)              # rank's 48 rows
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op
from fxshard.runtime.context import current_backend

__all__ = ["vocab_embedding_backward"]


@define_op("fxshard::vocab_embedding_backward",
           "(Tensor grad, Tensor ids, int rows, int padding_idx, str axis, int size) -> Tensor")
def vocab_embedding_backward(grad: torch.Tensor, ids: torch.Tensor, rows: int, padding_idx: int,
                             axis: str, size: int) -> torch.Tensor:
    start = current_backend().axis_index(axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    return torch.ops.aten.embedding_dense_backward(
        grad.masked_fill(outside.unsqueeze(-1), 0), local.masked_fill(outside, 0), rows, pad,
        False)


@vocab_embedding_backward.register_fake
def _(grad, ids, rows, padding_idx, axis, size):
    return grad.new_empty((rows, grad.shape[-1]))
