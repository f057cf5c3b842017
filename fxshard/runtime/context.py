"""The backend protocol and the current backend of this thread.

The collective custom ops (``fxshard.ops.collectives``) carry no process group: they name a mesh
axis. At run time each op asks :func:`current_backend` which backend executes it::

    with use_backend(SimulatedBackend(world, rank)):     # or DistributedBackend(device_mesh)
        out = rank_module(x)                              # torch.ops.fxshard.* dispatch here

The current backend lives in a :class:`contextvars.ContextVar`, so every thread (every
simulated rank) has its own. ``axis`` always means a mesh axis name, ``dim`` a tensor dim.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch

from fxshard.mesh import MeshSpec

__all__ = ["Backend", "CURRENT_BACKEND", "current_backend", "use_backend", "axis_index",
           "axis_size"]


@runtime_checkable
class Backend(Protocol):
    """What executes the ``fxshard::*`` ops for one rank.

    Dims arrive normalised (non-negative, in range) and the op's ``size`` argument has already
    been checked against :meth:`axis_size`; size-1 axes never reach a backend. Results must be
    fresh tensors that alias neither the input nor another rank's memory.
    """

    rank: int
    """This rank's row-major index in :attr:`mesh`."""
    mesh: MeshSpec
    """The geometry of the mesh this backend runs on."""

    def axis_index(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (0 for an axis the mesh does not have)."""
        ...

    def axis_size(self, axis: str) -> int:
        """The size of ``axis`` (1 for an axis the mesh does not have)."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        """Concatenate the group's tensors along ``dim`` in axis-coordinate order."""
        ...

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """Sum over the group."""
        ...

    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        """Sum over the group, keep chunk ``axis_index(axis)`` of ``dim``."""
        ...

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int,
                   axis: str) -> torch.Tensor:
        """Chunk j of ``split_dim`` goes to coordinate j; received chunks concatenate on
        ``concat_dim`` in coordinate order."""
        ...

    def all_to_all_single(self, x: torch.Tensor, in_splits: Sequence[int],
                          out_splits: Sequence[int], axis: str) -> torch.Tensor:
        """Rows ``in_splits[j]`` of ``x`` go to coordinate j; ``out_splits[s]`` rows come from
        coordinate s and concatenate on dim 0 in coordinate order (sizes differ per rank)."""
        ...

    def send(self, x: torch.Tensor, axis: str, peer: int) -> None:
        """Send ``x`` to the rank at coordinate ``peer`` along ``axis`` (may return before the
        peer received it)."""
        ...

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, axis: str,
             peer: int) -> torch.Tensor:
        """Block until the next message from coordinate ``peer`` along ``axis`` arrives."""
        ...

    def flush(self) -> None:
        """Wait until every send issued so far has been delivered (call after a forward)."""
        ...


CURRENT_BACKEND: ContextVar[Backend | None] = ContextVar("fxshard_runtime_backend", default=None)
"""The backend installed in this thread (None outside one). :func:`current_backend` reads it
with a helpful error; hot paths that only probe for an optional method (a backend's in-place
or background collectives, ``fxshard.ops.collectives``) read ``CURRENT_BACKEND.get()``."""


def current_backend(op: str = "fxshard runtime") -> Backend:
    """The backend installed in this thread, or a RuntimeError telling how to install one."""
    backend = CURRENT_BACKEND.get()
    if backend is None:
        raise RuntimeError(
            f"{op} was called outside any fxshard backend. Per-rank programs contain "
            f"collectives that need a rank to run on: run the per-rank program through "
            f"fxshard.parallelize's ParallelModule or fxshard.runtime.SimulatedWorld.run "
            f"(or install a backend with fxshard.runtime.use_backend).")
    return backend


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Install ``backend`` as the current backend of this thread for the ``with`` block."""
    token = CURRENT_BACKEND.set(backend)
    try:
        yield backend
    finally:
        CURRENT_BACKEND.reset(token)


def axis_index(axis: str) -> int:
    """This rank's coordinate along mesh ``axis``, from the current backend."""
    return current_backend(f"fxshard.runtime.axis_index({axis!r})").axis_index(axis)


def axis_size(axis: str) -> int:
    """The size of mesh ``axis``, from the current backend."""
    return current_backend(f"fxshard.runtime.axis_size({axis!r})").axis_size(axis)
