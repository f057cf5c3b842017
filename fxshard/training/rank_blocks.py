"""One weight's blocks across ranks: every rank's block cut from the whole, the whole
assembled from the blocks, and the bytes the blocks hold.

::

    w [8, 6], spec (S(0),) on tp=2:   rank_block(w, spec, mesh, r) -> w[4r:4r+4] (a copy)
    assemble([b0, b1], (8, 6), spec, mesh)                        -> cat([b0, b1])
"""
from __future__ import annotations

import torch

from ..mesh import MeshSpec
from ..placement import Partial, add_block, local_block, padded_block, shard_dim

__all__ = ["assemble", "rank_block", "storage_bytes", "shard_dim_of"]


def assemble(blocks: list[torch.Tensor], shape: tuple, spec: tuple, mesh: MeshSpec
             ) -> torch.Tensor:
    """The global tensor from every rank's block (``blocks[rank]``): shards placed where they
    belong, Partial axes summed, Replicate axes read from coordinate 0."""
    out = torch.zeros(shape, dtype=blocks[0].dtype, device=blocks[0].device)
    for rank, block in enumerate(blocks):
        coords = mesh.coords(rank)
        if any(n > 1 and c != 0 and not isinstance(p, Partial) and shard_dim_of(p) is None
               for n, c, p in zip(mesh.shape, coords, spec)):
            continue    # a replica of a block another rank gave already
        add_block(out, block, spec, mesh, rank)
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def rank_block(value, spec: tuple, mesh: MeshSpec, rank: int, shape: tuple | None = None
               ) -> torch.Tensor:
    """Rank ``rank``'s block of ``value`` (a tensor, or a checkpoint source), a new tensor.
    ``shape``: the program's global shape, where it pads the model's rows (a vocab padded
    for tp, :mod:`fxshard.passes.pad_vocab`)."""
    if hasattr(value, "block"):   # a checkpoint's block is read into a tensor of its own
        block = value.block(spec, mesh, rank, shape=shape)
        return block if getattr(value, "fresh_blocks", False) else block.clone()
    if shape is not None and tuple(value.shape) != tuple(shape):
        return padded_block(value.detach().__getitem__, tuple(value.shape), tuple(shape),
                            spec, mesh, rank)
    return local_block(value.detach(), spec, mesh, rank)     # a copy


def shard_dim_of(p):
    """The tensor dim ``p`` splits (None: Replicate or Partial)."""
    return shard_dim(p)
