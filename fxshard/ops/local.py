"""Ops that read the rank's coordinate on a mesh axis; all but ``zigzag_gather`` (an all-gather
put back in zigzag order) are local, moving no data between ranks.

``fxshard::vocab_embedding(weight, ids, axis, size)``: the rank holds rows
``[r * V/size, (r + 1) * V/size)`` of a vocab-sharded embedding; ids outside that range look up
zeros, so the sum over ``axis`` (the all-reduce that follows) is the full embedding; an id outside
the whole vocabulary is an ``IndexError``, as on one device.

``fxshard::partial_from_replicate(x, axis, size)``: Replicate -> Partial, ``x`` on coordinate
0 and zeros elsewhere.

``fxshard::zigzag_shard`` / ``fxshard::zigzag_gather``: the sequence layout ring attention
balances causal work with (rank j of ``n`` holds chunks j and ``2n-1-j`` of ``2n``).
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op
from fxshard.runtime.context import current_backend

__all__ = ["vocab_embedding", "partial_from_replicate", "zigzag_shard", "zigzag_gather"]


@define_op("fxshard::vocab_embedding", "(Tensor weight, Tensor ids, str axis, int size) -> Tensor")
def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: str, size: int
                    ) -> torch.Tensor:
    rows = weight.shape[0]
    vocab = rows * size
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):  # each rank sees zeros for the id: without this the sum would be 0
        raise IndexError(
            f"fxshard::vocab_embedding: token id {int(ids[bad][0])} is outside the vocabulary "
            f"[0, {vocab}) of an embedding sharded over mesh axis {axis!r} (the single-device "
            f"model raises IndexError too); check that the input ids come from a tokenizer "
            f"with at most {vocab} tokens")
    start = current_backend().axis_index(axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@vocab_embedding.register_fake
def _(weight, ids, axis, size):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@define_op("fxshard::partial_from_replicate", "(Tensor x, str axis, int size) -> Tensor")
def partial_from_replicate(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """Replicate -> Partial on ``axis``: coordinate 0 keeps ``x``, the others hold zeros, so
    the sum over the axis is ``x`` (how a bias joins a row-parallel partial sum once)."""
    if current_backend().axis_index(axis) == 0:
        return x.clone()
    return torch.zeros_like(x)


@partial_from_replicate.register_fake
def _(x, axis, size):
    return torch.empty_like(x)


def _zigzag_order(size: int) -> list[int]:
    """Chunk order of a zigzag layout: rank j holds chunks j and 2*size-1-j of the dim."""
    order = []
    for j in range(size):
        order += [j, 2 * size - 1 - j]
    return order


@define_op("fxshard::zigzag_shard", "(Tensor x, int dim, str axis, int size) -> Tensor")
def zigzag_shard(x: torch.Tensor, dim: int, axis: str, size: int) -> torch.Tensor:
    """Replicate -> zigzag shard on ``axis``: of ``2 * size`` equal chunks of ``dim``, rank j
    keeps chunks j and ``2*size-1-j``, so every rank gets the same share of causal attention
    work (the first and the last queries see the fewest and the most keys)."""
    if x.shape[dim] % (2 * size):
        raise ValueError(f"torch.ops.fxshard.zigzag_shard: dim {dim} of size {x.shape[dim]} "
                         f"does not split into 2 x {size} equal chunks for mesh axis {axis!r}")
    j = current_backend().axis_index(axis)
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[j], chunks[2 * size - 1 - j]], dim)


@zigzag_shard.register_fake
def _(x, dim, axis, size):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


@define_op("fxshard::zigzag_gather", "(Tensor x, int dim, str axis, int size) -> Tensor")
def zigzag_gather(x: torch.Tensor, dim: int, axis: str, size: int) -> torch.Tensor:
    """Zigzag shard -> Replicate on ``axis``: all-gather, then put the chunks back in order."""
    dim = dim % x.dim()
    backend = current_backend()
    if backend.axis_size(axis) != size:
        raise ValueError(f"torch.ops.fxshard.zigzag_gather: size={size} but mesh axis {axis!r} "
                         f"has {backend.axis_size(axis)} ranks")
    if x.shape[dim] % 2:
        raise ValueError(f"torch.ops.fxshard.zigzag_gather: dim {dim} of size {x.shape[dim]} "
                         f"is not two equal chunks of a zigzag shard on mesh axis {axis!r}")
    gathered = backend.all_gather(x.contiguous(), dim, axis).chunk(2 * size, dim)
    pieces: list = [None] * (2 * size)
    for k, chunk in zip(_zigzag_order(size), gathered):
        pieces[k] = chunk
    return torch.cat(pieces, dim)


@zigzag_gather.register_fake
def _(x, dim, axis, size):
    shape = list(x.shape)
    shape[dim % x.dim()] *= size
    return x.new_empty(shape)
