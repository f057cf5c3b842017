"""Placements of one tensor over a mesh: one torch placement per mesh axis.

A *spec* is a tuple with one ``Shard(dim)`` / ``Replicate()`` / ``Partial()`` per mesh axis, in
mesh order, as in DTensor. Several axes may shard the same dim; they nest in mesh order (the
first axis splits the dim into chunks, the next splits each chunk), exactly as DTensor lays
out ``(Shard(1), Shard(1))``.

Example on a ``(dp=2, tp=2)`` mesh: a ``[4, 6, 8]`` activation with spec ``(S(0), S(2))`` holds
a ``[2, 6, 4]`` block on every rank; rank 3 (dp=1, tp=1) holds ``x[2:4, :, 4:8]``.

``StridedShard(dim, parts)`` is the shard of a *fused* tensor: dim is the concatenation of parts
of the given global sizes (q, k, v of a ``qkv_proj``) and each rank holds its contiguous share of
every part, in part order. On ``tp=2`` a ``[.., 128]`` value with parts ``(64, 32, 32)`` holds
``x[.., 0:32] ++ x[.., 64:80] ++ x[.., 96:112]`` on rank 0, so a later split into the parts is
local (DTensor's ``_StridedShard`` is the equal-parts case). Parts listed in ``whole`` are held
whole by every rank (``S(0|64+R16+R16)``: a multi-query ``qkv`` whose K/V part is one head; rank
0 holds ``x[.., 0:32] ++ x[.., 64:96]``), as vLLM's QKV layer keeps multi-query K/V replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .mesh import MeshSpec, PP

__all__ = ["Shard", "Replicate", "Partial", "Placement", "StridedShard", "Spec", "R", "P",
           "short", "short_spec", "local_shape", "shard_slices", "local_block", "shard_dim",
           "block_pieces", "block_index", "owned_block", "add_block", "padded_block",
           "pad_to", "cut_to"]

Spec = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class StridedShard(Placement):
    """Shard of a fused dim: every part (global sizes ``parts``) split evenly over the axis,
    except the parts numbered in ``whole``, which every rank holds whole (a multi-query
    projection's one K/V head next to its split query heads)."""

    dim: int
    parts: tuple
    whole: frozenset = frozenset()

    def local_parts(self, n: int) -> tuple:
        return tuple(k if j in self.whole else k // n for j, k in enumerate(self.parts))

    def local_bound(self, b: int, n: int) -> int:
        """The local offset of the global part boundary ``b``."""
        out = acc = 0
        for k, loc in zip(self.parts, self.local_parts(n)):
            if acc >= b:
                break
            acc, out = acc + k, out + loc
        assert acc == b, (self, b)
        return out


def shard_dim(p) -> int | None:
    """The tensor dim a ``Shard`` or ``StridedShard`` splits, else None."""
    return p.dim if isinstance(p, (Shard, StridedShard)) else None


def short(p) -> str:
    """``S(1)``, ``R`` or ``P``: the short spelling used in explain tables."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, StridedShard):
        parts = [("R" if j in p.whole else "") + str(k) for j, k in enumerate(p.parts)]
        return f"S({p.dim}|{'+'.join(parts)})"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    return str(p)


def short_spec(spec, mesh: MeshSpec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, list):
        return "[" + ", ".join(short_spec(s, mesh) for s in spec) + "]"
    # pp places whole layers on stages, not tensor shards: the stage column says where
    parts = [f"{a}:{short(p)}" for a, n, p in zip(mesh.axis_names, mesh.shape, spec)
             if n > 1 and a != PP]
    return " ".join(parts) if parts else "R"


def local_shape(shape: Sequence[int], spec: Spec, mesh: MeshSpec, *, what: str = "tensor"
                ) -> tuple[int, ...]:
    """Shape of one rank's block; a dim that does not split evenly is a ValueError."""
    out = list(shape)
    for axis, n, p in zip(mesh.axis_names, mesh.shape, spec):
        if n > 1 and isinstance(p, StridedShard):
            assert sum(p.parts) == shape[p.dim], (what, tuple(shape), p)  # a rule's invariant
            bad = [k for j, k in enumerate(p.parts) if k % n and j not in p.whole]
            if bad:
                raise ValueError(
                    f"fxshard: {what} of global shape {tuple(shape)} is a fused tensor with parts "
                    f"{p.parts} on dim {p.dim}, sharded part by part over mesh axis {axis!r} of "
                    f"size {n} (mesh {mesh.describe()}), but parts {bad} do not divide by {n}. "
                    f"Use a {axis} size that divides every part.")
            # (an earlier axis may have cut the dim already: equal parts, none whole)
            out[p.dim] = sum(p.local_parts(n)) if p.whole else out[p.dim] // n
        elif n > 1 and isinstance(p, Shard):
            d = p.dim
            if out[d] % n:
                cut = "" if out[d] == shape[d] else " per shard after the earlier axes"
                raise ValueError(
                    f"fxshard: {what} of global shape {tuple(shape)} is sharded on dim {d} over "
                    f"mesh axis {axis!r} of size {n} (mesh {mesh.describe()}), but dim {d} has "
                    f"{out[d]} elements{cut}, which does not divide by {n}. "
                    f"Make dim {d} a multiple of {n} or use a smaller {axis} axis.")
            out[d] //= n
    return tuple(out)


def shard_slices(shape: Sequence[int], spec: Spec, mesh: MeshSpec, rank: int) -> tuple[slice, ...]:
    """The index of rank ``rank``'s block in the global tensor (Partial/Replicate: whole dims);
    a ``StridedShard`` block is several pieces: use :func:`block_pieces`."""
    assert not any(isinstance(p, StridedShard) for p in spec), spec
    coords = mesh.coords(rank)
    start = [0] * len(shape)
    size = list(shape)
    for n, c, p in zip(mesh.shape, coords, spec):
        if n > 1 and isinstance(p, Shard):
            d = p.dim
            size[d] //= n
            start[d] += c * size[d]
    return tuple(slice(s, s + k) for s, k in zip(start, size))


def block_pieces(shape: Sequence[int], spec: Spec, mesh: MeshSpec, rank: int
                 ) -> tuple[int | None, list[tuple[slice, ...]]]:
    """Rank ``rank``'s block as pieces of the global tensor to concatenate along the returned
    dim: one piece per part of a ``StridedShard`` (on at most one axis), else one piece."""
    strided = [(i, p) for i, (n, p) in enumerate(zip(mesh.shape, spec))
               if n > 1 and isinstance(p, StridedShard)]
    if not strided:
        return None, [shard_slices(shape, spec, mesh, rank)]
    assert len(strided) == 1, spec
    i, p = strided[0]
    n, c = mesh.shape[i], mesh.coords(rank)[i]
    rest = tuple(R if j == i else q for j, q in enumerate(spec))
    base = list(shard_slices(shape, rest, mesh, rank))
    assert base[p.dim] == slice(0, shape[p.dim]), (spec, "a fused dim split by two axes")
    pieces, start = [], 0
    for j, k in enumerate(p.parts):
        piece = list(base)
        piece[p.dim] = slice(start, start + k) if j in p.whole else \
            slice(start + c * (k // n), start + (c + 1) * (k // n))
        pieces.append(tuple(piece))
        start += k
    return p.dim, pieces


def block_index(shape: Sequence[int], spec: Spec, mesh: MeshSpec, rank: int) -> list[list[int]]:
    """The global indices rank ``rank`` holds along each dim, axes applied in mesh order. A
    ``StridedShard`` takes the axis's share of every part; when an earlier axis has cut the dim
    already, of every run of the (equal) part size in what is left."""
    coords = mesh.coords(rank)
    index = [list(range(n)) for n in shape]
    for n, c, p in zip(mesh.shape, coords, spec):
        if n == 1:
            continue
        if isinstance(p, Shard):
            cur = index[p.dim]
            k = len(cur) // n
            index[p.dim] = cur[c * k:(c + 1) * k]
        elif isinstance(p, StridedShard):
            cur = index[p.dim]
            parts = p.parts if sum(p.parts) == len(cur) else \
                (p.parts[0],) * (len(cur) // p.parts[0])
            assert sum(parts) == len(cur) and all(k == parts[0] for k in parts) \
                and not p.whole or parts == p.parts, (spec, shape)
            out, start = [], 0
            for j, k in enumerate(parts):
                out += cur[start:start + k] if j in p.whole else \
                    cur[start + c * (k // n):start + (c + 1) * (k // n)]
                start += k
            index[p.dim] = out
    return index


def local_block(t: torch.Tensor, spec: Spec, mesh: MeshSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of the global tensor ``t`` (Partial: the full value on coordinate 0
    of each partial axis, zeros elsewhere, so the sum over the axis is ``t``)."""
    local_shape(t.shape, spec, mesh)
    if any(isinstance(p, StridedShard) for p in spec):
        block = t
        for d, ix in enumerate(block_index(t.shape, spec, mesh, rank)):
            if len(ix) != t.shape[d]:
                block = block.index_select(d, torch.tensor(ix, dtype=torch.long,
                                                           device=t.device))
    else:
        block = t[shard_slices(t.shape, spec, mesh, rank)]
    coords = mesh.coords(rank)
    if any(isinstance(p, Partial) and n > 1 and c != 0
           for n, c, p in zip(mesh.shape, coords, spec)):
        return torch.zeros_like(block)
    return block.clone()


def _whole_replicas(spec: Spec, mesh: MeshSpec, coords: Sequence[int]) -> dict[int, list[int]]:
    """{dim: the local positions this rank owns} for each dim a ``StridedShard`` with parts
    kept whole splits on an axis where the rank is not coordinate 0: every rank of the axis
    holds those parts, coordinate 0's copy is the one that counts."""
    keep: dict[int, list[int]] = {}
    for i, (n, c, p) in enumerate(zip(mesh.shape, coords, spec)):
        if n == 1 or c == 0 or not isinstance(p, StridedShard) or not p.whole:
            continue
        assert p.dim not in keep and not any(shard_dim(q) == p.dim for q in spec[i + 1:]), spec
        pos, mine = 0, []
        for j, k in enumerate(p.local_parts(n)):
            if j not in p.whole:
                mine += range(pos, pos + k)
            pos += k
        keep[p.dim] = mine
    return keep


def owned_block(block: torch.Tensor, spec: Spec, mesh: MeshSpec,
                coords: Sequence[int]) -> torch.Tensor:
    """``block`` without the parts this rank holds as a copy of coordinate 0's (a fused
    ``StridedShard``'s whole parts): what a norm or sum over ranks counts once."""
    for d, mine in _whole_replicas(spec, mesh, coords).items():
        block = block.index_select(d, torch.tensor(mine, dtype=torch.long, device=block.device))
    return block


def add_block(out: torch.Tensor, block: torch.Tensor, spec: Spec, mesh: MeshSpec,
              rank: int) -> None:
    """Add rank ``rank``'s ``block`` into the global ``out`` where it belongs (Partial blocks
    sum; parts a ``StridedShard`` keeps whole are added from coordinate 0 only). The caller
    skips the replicas of a ``Replicate`` axis."""
    if not out.dim():          # a 0-dim tensor (a learnable scale): index_put_ has no grid
        out.add_(block.to(out.device))
        return
    index = block_index(tuple(out.shape), spec, mesh, rank)
    for d, mine in _whole_replicas(spec, mesh, mesh.coords(rank)).items():
        index[d] = [index[d][k] for k in mine]
    block = owned_block(block, spec, mesh, mesh.coords(rank))
    grid = torch.meshgrid(*[torch.tensor(ix, dtype=torch.long, device=out.device)
                            for ix in index], indexing="ij")
    out.index_put_(grid, block.to(out.device), accumulate=True)


# -- a vocab padded for tp (fxshard.passes.pad_vocab) ------------------------------------------

def pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` with zeros appended on each dim where ``shape`` is longer (the model's table as
    the rank programs hold it: rows padded to a multiple of ``tp``)."""
    extra = [k - n for n, k in zip(t.shape, shape)]
    assert len(shape) == t.dim() and min(extra, default=0) >= 0, (tuple(t.shape), shape)
    if not any(extra):
        return t
    pad = []
    for e in reversed(extra):
        pad += [0, e]
    return torch.nn.functional.pad(t, pad)


def cut_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` cut to ``shape`` (the padded rows dropped: the model's shape again)."""
    for d, n in enumerate(shape):
        if t.shape[d] != n:
            t = t.narrow(d, 0, n)
    return t


def padded_block(read, shape: Sequence[int], padded: Sequence[int], spec: Spec,
                 mesh: MeshSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block, under ``spec`` of the ``padded`` shape, of a tensor of ``shape``
    zero-padded to ``padded``; ``read(index)`` returns the slices ``index`` of the unpadded
    tensor (a tensor's ``__getitem__``, a checkpoint's reader)."""
    dim, pieces = block_pieces(tuple(padded), spec, mesh, rank)
    parts = []
    for index in pieces:
        want = [s.stop - s.start for s in index]
        clipped = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(index, shape))
        parts.append(pad_to(read(clipped), want))
    block = torch.cat(parts, dim) if dim is not None else parts[0]
    return block.clone() if any(b is block for b in parts) else block

