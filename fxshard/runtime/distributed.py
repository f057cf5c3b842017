"""The real backend: torch.distributed on a ``DeviceMesh`` (gloo on CPU, nccl on GPU).

::

    mesh = fxshard.init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))  # torchrun
    with use_backend(backend_for(mesh)):
        out = rank_module(x)          # torch.ops.fxshard.* run on the mesh's process groups

Collectives are torch.distributed's in-place collectives on ``device_mesh.get_group(axis)``
into fresh buffers, complete when the op returns; ``all_reduce_start``, ``all_gather_start``
and ``reduce_scatter_start`` issue the same with ``async_op`` and return a work whose
``wait()`` gives the result (the sync ops are start + wait: one implementation each); on CPU
a reduce-scatter is one all-to-all
and a local sum in rank order (gloo has none of its own: torch would all-reduce a clone of
the whole input and copy the block out). ``send`` is an ``isend`` whose completion is
checked later (so a ring where every rank sends before it receives cannot deadlock);
``recv`` is an ``irecv`` waited on at once; :meth:`DistributedBackend.flush` waits for the
outstanding sends. Every wait is bounded by the timeout of the axis's process group. Errors
from torch.distributed (a peer died, a timeout) come back as a RuntimeError naming the
fxshard op and the mesh axis, chained to the original.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fxshard.mesh import mesh_spec

__all__ = ["DistributedBackend", "backend_for", "release", "release_all"]

_WHERE = "fxshard.runtime.DistributedBackend"
_MAX_PENDING_SENDS = 64
# torch >= 2.13 names the single-tensor collectives ``*_single`` and deprecates the
# ``*_into_tensor`` / ``*_tensor`` names, which older torch (2.11, the GPU image's) has alone
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor


def _group_timeout(group: dist.ProcessGroup, device_type: str) -> datetime.timedelta:
    """The timeout the backend of ``group`` enforces on its collectives (torch keeps it in the
    backend's options); point-to-point waits use it too, since gloo's ``recv().wait()`` would
    otherwise wait forever for a peer that is alive but never sends."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


class DistributedBackend:
    """Runs the ``fxshard::*`` ops of this process's rank on a torch ``DeviceMesh``."""

    def __init__(self, device_mesh: DeviceMesh):
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(f"{_WHERE}: expected a torch DeviceMesh (from "
                             f"fxshard.init_device_mesh under torchrun), got "
                             f"{type(device_mesh).__name__}")
        self.device_mesh = device_mesh
        self.mesh = mesh_spec(device_mesh, where=_WHERE)
        coords = device_mesh.get_coordinate()
        if coords is None:
            raise ValueError(f"{_WHERE}: global rank {dist.get_rank()} is not part of the "
                             f"DeviceMesh {self.mesh.describe()}; build the mesh on every rank "
                             f"with all ranks in it")
        self.coords = tuple(coords)
        self.rank = self.mesh.rank_of(self.coords)
        self.global_rank = dist.get_rank()
        self._groups = {axis: device_mesh.get_group(axis) for axis in self.mesh.axis_names}
        self._sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))  # read by every op
        for axis, group in self._groups.items():
            self._check_group_order(axis, group)
        self._pending: list[tuple[dist.Work, torch.Tensor, str, int]] = []

    def __repr__(self) -> str:
        return f"DistributedBackend(rank {self.rank} {self._where()})"

    def _where(self) -> str:
        return "(" + ", ".join(f"{a}={c}" for a, c in zip(self.mesh.axis_names, self.coords)) + \
            f") of {self.mesh.describe()}"

    def _check_group_order(self, axis: str, group: dist.ProcessGroup) -> None:
        """The ops rely on group rank == coordinate along the axis; check it once, locally."""
        i = self.mesh.axis_names.index(axis)
        index = list(self.coords)
        along = []
        for k in range(self.mesh.shape[i]):
            index[i] = k
            along.append(int(self.device_mesh.mesh[tuple(index)]))
        if dist.get_process_group_ranks(group) != along:
            raise ValueError(
                f"{_WHERE}: the process group of mesh axis {axis!r} orders its ranks as "
                f"{dist.get_process_group_ranks(group)}, not by coordinate {along}; build the "
                f"mesh with fxshard.init_device_mesh (row-major ranks)")

    # --- geometry ---------------------------------------------------------------------------

    def axis_index(self, axis: str) -> int:
        if axis not in self._groups:
            return 0
        return self.coords[self.mesh.axis_names.index(axis)]

    def axis_size(self, axis: str) -> int:
        return self._sizes.get(axis, 1)

    @property
    def device(self) -> torch.device:
        """This process's device on the mesh, with its index (cuda: the current device,
        which ``fxshard.init_device_mesh`` sets to ``LOCAL_RANK``'s)."""
        kind = self.mesh.device_type
        return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else \
            torch.device(kind)

    def _group(self, op: str, axis: str) -> dist.ProcessGroup:
        group = self._groups.get(axis)
        if group is None:
            raise ValueError(f"torch.ops.fxshard.{op}: mesh axis {axis!r} is not an axis of "
                             f"{self.mesh.describe()}")
        return group

    def _timeout(self, axis: str) -> datetime.timedelta:
        """The axis group's timeout now (read at each use: it may be changed after this
        backend was made, e.g. by ``torch.distributed.distributed_c10d._set_pg_timeout``)."""
        return _group_timeout(self._groups[axis], self.mesh.device_type)

    def _call(self, op: str, axis: str, fn: Callable[[], torch.Tensor | None],
              detail: str = "") -> torch.Tensor | None:
        try:
            return fn()
        except Exception as exc:
            raise self._failed(op, axis, exc, detail) from exc

    def _failed(self, op: str, axis: str, exc: Exception, detail: str = "") -> RuntimeError:
        """The error for a failed torch.distributed call (raise it ``from exc``)."""
        return RuntimeError(
            f"torch.ops.fxshard.{op} on mesh axis {axis!r}{detail} failed on rank "
            f"{self.rank} {self._where()}: {type(exc).__name__}: {exc}. A rank of the "
            f"{axis!r} group probably exited, crashed, skipped this call or took longer "
            f"than the timeout of the axis's process group ({self._timeout(axis)}); check "
            f"that rank's log.")

    # --- collectives ------------------------------------------------------------------------

    # In-place c10d collectives on fresh buffers: about half the CPU time per call of the
    # functional collectives (which add autograd/redispatch layers and an async wrapper).

    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        return self.all_gather_start(x, dim, axis).wait()

    def all_gather_start(self, x: torch.Tensor, dim: int, axis: str) -> "_PendingWork":
        """:meth:`all_gather` issued in the background (``async_op``: gloo's threads, NCCL's
        stream); the returned work's ``wait()`` gives the gathered tensor. ``x`` must not
        change until then (a weight shard: it does not)."""
        group = self._group("all_gather", axis)
        size = self.axis_size(axis)
        x_c = x.contiguous()
        out = x_c.new_empty((x_c.shape[0] * size, *x_c.shape[1:]))
        d = dim % x_c.dim()

        def finish() -> torch.Tensor:
            if d == 0:
                return out
            # the peers' blocks side by side on ``dim``: one copy in runs of each block's
            # trailing size (a list all-gather would copy from gloo's flat buffer into the
            # list first, then concatenate: two). A block of one on ``dim`` reshapes to a
            # strided view instead: ``contiguous`` makes that copy, as the op's fake kernel
            # promises a contiguous result (Inductor asserts it)
            stacked = out.view(size, *x_c.shape).movedim(0, d)
            shape = list(x_c.shape)
            shape[d] *= size
            return stacked.reshape(shape).contiguous()
        work = self._call("all_gather", axis, lambda: _all_gather_single(
            out, x_c, group=group, async_op=True))
        return _PendingWork(finish, work, self, axis, "all_gather", keep=x_c)

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return self.all_reduce_(x.contiguous().clone(), axis)

    def all_reduce_(self, x: torch.Tensor, axis: str, size: int | None = None) -> torch.Tensor:
        """Sum into ``x`` itself (contiguous, referenced by nobody else: see
        ``fxshard.ops.collectives.all_reduce_consuming``) and return it; ``size``: the axis
        size the program was built for, checked here (the op's own check, without its
        frames; 1 returns ``x``). The most frequent op of a tensor-parallel step: no
        closure, no frame beyond torch's own."""
        if size is not None and self._sizes.get(axis, 1) != size:
            from fxshard.ops.collectives import size_mismatch
            raise size_mismatch("all_reduce", axis, size, self)
        if size == 1:
            return x
        group = self._groups.get(axis)
        if group is None:
            self._group("all_reduce", axis)   # raises: not an axis of this mesh
        try:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        except Exception as exc:
            raise self._failed("all_reduce", axis, exc) from exc
        return x

    def all_reduce_start(self, x: torch.Tensor, axis: str, size: int) -> "_PendingWork":
        """:meth:`all_reduce_` issued in the background (``async_op``: gloo's and NCCL's own
        threads or streams run it): the returned work's ``wait()`` gives ``x``, summed.
        Collectives of one group run in issue order, the same on every rank."""
        if self._sizes.get(axis, 1) != size:
            from fxshard.ops.collectives import size_mismatch
            raise size_mismatch("all_reduce", axis, size, self)
        group = self._group("all_reduce", axis)
        try:
            work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True)
        except Exception as exc:
            raise self._failed("all_reduce", axis, exc) from exc
        return _PendingWork(lambda: x, work, self, axis, "all_reduce")

    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        return self.reduce_scatter_start(x, dim, axis).wait()

    def reduce_scatter_start(self, x: torch.Tensor, dim: int, axis: str) -> "_PendingWork":
        """:meth:`reduce_scatter` issued in the background (``async_op``); the returned
        work's ``wait()`` gives this rank's summed block."""
        group = self._group("reduce_scatter", axis)
        size = self.axis_size(axis)
        # rank i's block of ``dim`` moved to the front as a whole: one copy in runs of the
        # block's trailing size (a column shard of a weight gradient copies rows of its
        # block, not single elements, as a transpose would), and the result lands in this
        # rank's layout: no copy out
        d = dim % x.dim()
        blocks = x.unflatten(d, (size, x.shape[d] // size)).movedim(d, 0)
        out = blocks.new_empty(blocks.shape[1:])
        blocks = blocks.contiguous()
        if blocks.device.type == "cpu":
            # gloo has no reduce-scatter of its own: torch runs it as an all-reduce of a
            # clone of the whole input, then copies this rank's block out (twice the bytes
            # on the wire and two copies). An all-to-all hands every rank its block from
            # each peer, summed here in rank order: the bytes of a reduce-scatter, one add.
            got = torch.empty_like(blocks)

            def finish() -> torch.Tensor:
                torch.add(got[0], got[1], out=out)
                for part in got[2:]:
                    out.add_(part)
                return out
            work = self._call("reduce_scatter", axis, lambda: dist.all_to_all_single(
                got, blocks, group=group, async_op=True))
        else:
            def finish() -> torch.Tensor:
                return out
            work = self._call("reduce_scatter", axis, lambda: _reduce_scatter_single(
                out, blocks.flatten(0, 1), op=dist.ReduceOp.SUM, group=group,  # dim 0: size
                async_op=True))                                              # x out's
        return _PendingWork(finish, work, self, axis, "reduce_scatter", keep=blocks)

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int,
                   axis: str) -> torch.Tensor:
        group = self._group("all_to_all", axis)
        size = self.axis_size(axis)

        def run() -> torch.Tensor:
            # all_to_all_single splits and concatenates along dim 0: move split_dim there,
            # then put each received block back in its layout and concatenate on concat_dim.
            moved = x.movedim(split_dim, 0).contiguous()
            out = torch.empty_like(moved)
            dist.all_to_all_single(out, moved, group=group)
            blocks = [b.movedim(0, split_dim) for b in out.chunk(size, 0)]
            return torch.cat(blocks, concat_dim)
        return self._call("all_to_all", axis, run)

    def all_to_all_single(self, x: torch.Tensor, in_splits: Sequence[int],
                          out_splits: Sequence[int], axis: str) -> torch.Tensor:
        """torch.distributed's ``all_to_all_single`` with this rank's split sizes on dim 0."""
        group = self._group("all_to_all_single", axis)

        def run() -> torch.Tensor:
            out = x.new_empty((sum(out_splits), *x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(out_splits),
                                   input_split_sizes=list(in_splits), group=group)
            return out
        return self._call("all_to_all_single", axis, run)

    # --- point to point ---------------------------------------------------------------------

    def send(self, x: torch.Tensor, axis: str, peer: int) -> None:
        group = self._group("send", axis)
        self._reap()
        payload = x.detach().contiguous()
        work = self._call("send", axis, lambda: dist.isend(payload, group=group, group_dst=peer),
                          f" to coordinate {peer}")
        self._pending.append((work, payload, axis, peer))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, axis: str,
             peer: int) -> torch.Tensor:
        group = self._group("recv", axis)
        out = torch.empty(list(shape), dtype=dtype, device=device)

        def run() -> torch.Tensor:
            dist.irecv(out, group=group, group_src=peer).wait(self._timeout(axis))
            return out
        return self._call("recv", axis, run, f" from coordinate {peer}")

    def _reap(self) -> None:
        """Drop finished sends; past a bound, wait for the oldest (surfacing its error)."""
        still = []
        for item in self._pending:
            work, _, axis, peer = item
            if work.is_completed():
                self._wait_send(work, axis, peer)
            else:
                still.append(item)
        self._pending = still
        while len(self._pending) >= _MAX_PENDING_SENDS:
            work, _, axis, peer = self._pending.pop(0)
            self._wait_send(work, axis, peer)

    def flush(self) -> None:
        """Wait until every send issued so far has completed (raises on a failed send)."""
        pending, self._pending = self._pending, []
        for work, _, axis, peer in pending:
            self._wait_send(work, axis, peer)

    def _wait_send(self, work: dist.Work, axis: str, peer: int) -> None:
        self._call("send", axis, lambda: work.wait(self._timeout(axis)),
                   f" to coordinate {peer}")


_BACKENDS: dict[int, DistributedBackend] = {}
"""Registry: one backend per mesh object, so sends still in flight survive between forward
passes. Keyed by identity, not equality: torch's ``DeviceMesh`` compares equal to any mesh of the
same ranks and names, though each ``init_device_mesh`` call makes its own process groups (with
their own timeouts). The backend holds its mesh, so an ``id`` stays unique while it is a key."""


class _PendingWork:
    """A collective issued in the background (``all_reduce_start``, ``all_gather_start``,
    ``reduce_scatter_start``): ``wait()`` waits for it, then returns ``finish()`` (the
    result: the summed tensor, the gathered one laid out, the block summed). On CPU (gloo)
    the host blocks until it is done, bounded by the group's timeout; on CUDA (NCCL) the
    current stream waits for NCCL's and the host goes on (the group's own timeout holds).
    ``keep``: the buffer the collective reads from, held until then."""

    __slots__ = ("finish", "work", "backend", "axis", "op", "keep")

    def __init__(self, finish, work, backend, axis, op, keep=None):
        self.finish, self.work, self.backend, self.axis = finish, work, backend, axis
        self.op, self.keep = op, keep

    def wait(self) -> torch.Tensor:
        try:
            if self.backend.mesh.device_type == "cpu":
                self.work.wait(self.backend._timeout(self.axis))
            else:   # NCCL: a timeout given here would block the host until the kernel ends;
                self.work.wait()   # without one the stream waits (the PG's timeout holds)
        except Exception as exc:
            raise self.backend._failed(self.op, self.axis, exc) from exc
        self.keep = None
        return self.finish()


def backend_for(device_mesh: DeviceMesh) -> DistributedBackend:
    """The :class:`DistributedBackend` of this process on ``device_mesh`` (one per mesh)."""
    backend = _BACKENDS.get(id(device_mesh))
    if backend is None:
        atexit.unregister(release_all)  # registered once, however often backends come back
        atexit.register(release_all)
        backend = _BACKENDS[id(device_mesh)] = DistributedBackend(device_mesh)
    return backend


def release(device_mesh: DeviceMesh) -> None:
    """Wait for ``device_mesh``'s outstanding sends and drop its backend with its references to
    the mesh's process groups (``ParallelModule.close``). Process groups that outlive
    ``destroy_process_group`` inside a registry and are torn down at interpreter exit make gloo
    abort ("terminate called without an active exception") after a correct run."""
    backend = _BACKENDS.pop(id(device_mesh), None)
    if backend is None:
        return
    try:
        backend.flush()
    finally:
        backend._groups.clear()
        backend._pending.clear()


def release_all() -> None:
    """Release every backend of this process (registered with ``atexit`` once one exists)."""
    for backend in list(_BACKENDS.values()):
        try:
            release(backend.device_mesh)
        except RuntimeError as exc:  # a peer gone at exit: say so, release the rest
            warnings.warn(f"fxshard: at exit, {exc}", stacklevel=1)
    _BACKENDS.clear()
    gc.collect()
