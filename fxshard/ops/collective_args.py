"""What the collective ops (:mod:`fxshard.ops.collectives`) check and how their buckets are laid
out, shared by the ops and the functions that issue them in the background.

Checks raise a ValueError naming ``torch.ops.fxshard.<op>``, the argument and the fix:
:func:`checked_backend` (the program's axis size against the backend's mesh), :func:`norm_dim`,
:func:`chunk_length` (a dim the axis splits into equal chunks), :func:`check_peer`,
:func:`bucket_dims`. A bucket of ``all_gather_bucket`` / ``reduce_scatter_bucket`` is one flat
buffer::

    all_gather_bucket(xs, dims):      gather_bucket_in(xs) = cat(x.flatten() for x in xs)
                                      -> all_gather on dim 0 -> [size, sum numel] rank-major
                                      -> gather_bucket_out: x_i's blocks side by side on dims[i]
    reduce_scatter_bucket(xs, dims):  scatter_bucket_in: row r = rank r's chunk of every x_i
                                      -> reduce_scatter on dim 0 -> scatter_bucket_out: my row
"""
from __future__ import annotations

import math

import torch

from fxshard.runtime.context import Backend, current_backend

__all__ = ["checked_backend", "size_mismatch", "norm_dim", "chunk_length", "check_peer",
           "bucket_dims", "gathered_shape", "gather_bucket_in", "gather_bucket_out",
           "scattered_shape", "scatter_bucket_in", "scatter_bucket_out"]


def checked_backend(op: str, axis: str, size: int) -> Backend:
    """The current backend, after checking that ``size`` is the size of ``axis`` on it."""
    backend = current_backend(f"torch.ops.fxshard.{op}")
    if size != backend.axis_size(axis):
        raise size_mismatch(op, axis, size, backend)
    return backend


def size_mismatch(op: str, axis: str, size: int, backend: Backend) -> ValueError:
    """The error for a program built for another mesh (``size`` is not ``axis``'s size)."""
    return ValueError(
        f"torch.ops.fxshard.{op}: the program says mesh axis {axis!r} has size {size}, but "
        f"the backend's mesh {backend.mesh.describe()} gives it size {backend.axis_size(axis)}. "
        f"The per-rank program was built for another mesh; rebuild it with "
        f"fxshard.parallelize for this mesh.")


def norm_dim(op: str, x: torch.Tensor, dim: int, name: str = "dim") -> int:
    """``dim`` of ``x`` made non-negative, or a ValueError naming the op and ``x``'s shape."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"torch.ops.fxshard.{op}: {name}={dim} is out of range for a tensor "
                         f"of shape {list(x.shape)}")
    return dim % x.dim()


def chunk_length(op: str, x: torch.Tensor, dim: int, axis: str, size: int,
                 name: str = "dim") -> int:
    """Length of one of ``size`` equal chunks of ``x`` along ``dim``, or a ValueError."""
    if size < 1:
        raise ValueError(f"torch.ops.fxshard.{op}: size={size} for mesh axis {axis!r}; an axis "
                         f"size is >= 1")
    n = x.shape[dim]
    if n % size:
        raise ValueError(
            f"torch.ops.fxshard.{op}: {name}={dim} of a tensor of shape {list(x.shape)} has "
            f"size {n}, which mesh axis {axis!r} of size {size} cannot split into equal chunks; "
            f"pad that dim to a multiple of {size} or do not shard it on {axis!r}")
    return n // size


def check_peer(op: str, backend: Backend, axis: str, peer: int) -> None:
    """A ValueError unless ``peer`` is another coordinate of ``axis`` (send / recv)."""
    size, me = backend.axis_size(axis), backend.axis_index(axis)
    if not 0 <= peer < size or peer == me:
        raise ValueError(
            f"torch.ops.fxshard.{op}: peer={peer} on mesh axis {axis!r} of size {size} from "
            f"coordinate {me}; the peer must be another coordinate in 0..{size - 1}")


def bucket_dims(op: str, xs, dims) -> list[int]:
    """A bucket's dims, normalised, after checking one dim per tensor and one dtype and
    device for all of them."""
    if len(xs) != len(dims) or not xs:
        raise ValueError(f"torch.ops.fxshard.{op}: {len(xs)} tensors and {len(dims)} dims; give "
                         f"one dim per tensor, at least one tensor")
    if len({(x.dtype, x.device) for x in xs}) > 1:
        raise ValueError(
            f"torch.ops.fxshard.{op}: the tensors of one bucket must share a dtype and a "
            f"device, got {sorted({f'{x.dtype} on {x.device}' for x in xs})}; bucket them by "
            f"dtype")
    return [norm_dim(op, x, d) for x, d in zip(xs, dims)]


def gathered_shape(shape, dim: int, size: int) -> list[int]:
    """``shape`` after an all-gather of ``size`` blocks along ``dim``."""
    shape = list(shape)
    shape[dim] *= size
    return shape


def gather_bucket_in(xs) -> torch.Tensor:
    """An all-gather bucket's copy-in: the tensors flattened into one buffer."""
    return torch.cat([x.reshape(-1) for x in xs])                        # copy-in


def gather_bucket_out(gathered: torch.Tensor, xs, dims, size: int) -> list[torch.Tensor]:
    """An all-gather bucket's copy-out: the gathered buffer (rank-major) as each tensor
    gathered along its dim, fresh tensors."""
    gathered = gathered.view(size, -1)                                   # rank-major
    out = []
    for part, x, d in zip(gathered.split([x.numel() for x in xs], 1), xs, dims):
        # rank r's block of x at row r: put the ranks next to each other along dim d
        y = part.reshape(size, *x.shape).movedim(0, d).reshape(gathered_shape(x.shape, d, size))
        y = y.contiguous()   # (the per-tensor all_gather's layout)
        if len(xs) > 1 and y.untyped_storage().data_ptr() == \
                gathered.untyped_storage().data_ptr():
            y = y.clone()   # never a view that keeps the whole bucket alive
        out.append(y)
    return out


def scattered_shape(op: str, x, dim: int, axis: str, size: int) -> list[int]:
    """``x``'s shape after a reduce-scatter along ``dim`` over ``size`` (or a ValueError)."""
    shape = list(x.shape)
    shape[dim] = chunk_length(op, x, dim, axis, size)
    return shape


def scatter_bucket_in(xs, dims, shapes, size: int) -> torch.Tensor:
    """A reduce-scatter bucket's copy-in: rank ``r``'s chunk of every tensor in row ``r``."""
    # rank r's chunk of every tensor in row r, flattened in the chunk's own (contiguous) order
    rows = [x.reshape(*x.shape[:d], size, s[d], *x.shape[d + 1:]).movedim(d, 0).reshape(size, -1)
            for x, d, s in zip(xs, dims, shapes)]
    return torch.cat(rows, 1).reshape(-1)


def scatter_bucket_out(mine: torch.Tensor, shapes) -> list[torch.Tensor]:
    """A reduce-scatter bucket's copy-out: this rank's row as fresh tensors of ``shapes``."""
    return [p.reshape(s).clone() for p, s in
            zip(mine.split([math.prod(s) for s in shapes]), shapes)]
