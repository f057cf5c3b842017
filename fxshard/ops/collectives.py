"""Collectives and point-to-point messages as ``torch.library`` ops: what rank programs call.

The graph passes emit these calls into per-rank programs; each names a mesh axis and carries
the axis size, so the fake (meta) impls need no runtime state and the graphs stay exportable
and compilable::

    fxshard::all_gather(Tensor x, int dim, str axis, int size) -> Tensor
    fxshard::all_reduce(Tensor x, str axis, int size) -> Tensor
    fxshard::reduce_scatter(Tensor x, int dim, str axis, int size) -> Tensor
    fxshard::all_to_all(Tensor x, int split_dim, int concat_dim, str axis, int size) -> Tensor
    fxshard::local_shard(Tensor x, int dim, str axis, int size) -> Tensor
    fxshard::all_gather_bucket(Tensor[] xs, int[] dims, str axis, int size) -> Tensor[]
    fxshard::reduce_scatter_bucket(Tensor[] xs, int[] dims, str axis, int size) -> Tensor[]
    fxshard::send(Tensor x, str axis, int peer) -> ()
    fxshard::recv(int[] shape, ScalarType dtype, Device device, str axis, int peer) -> Tensor

In a graph: ``all_gather = torch.ops.fxshard.all_gather.default(mm, 2, 'tp', 2)``.

The two bucket ops are many all-gathers (reduce-scatters) in one collective, as FSDP2 groups a
layer's parameters: output ``i`` equals ``all_gather(xs[i], dims[i], axis, size)``
(``reduce_scatter(...)``), computed as one ``all_gather`` (``reduce_scatter``) on dim 0 of a
flat buffer of the inputs (copy-in, one collective, copy-out into fresh tensors; on
torch.distributed ``all_gather_into_tensor`` / ``reduce_scatter_tensor``). Inputs share a dtype
and a device (:mod:`fxshard.passes.fsdp_buckets` makes the buckets).

Eager training programs issue the fsdp collectives in the background through plain functions
(``all_gather_start``, ``all_gather_bucket_start``, ``reduce_scatter_start``,
``reduce_scatter_bucket_start``; :data:`START` maps each op to its function) and take the
result with :func:`collective_wait`: the same values as the op.

The real impls dispatch to the current backend (``fxshard.runtime.context``: the simulated
mesh or torch.distributed); their argument checks and the buckets' flat layout are
:mod:`fxshard.ops.collective_args`. A size-1 axis is the identity (a copy: custom ops never
return views of their inputs).

Purity. The collectives are pure functions of their inputs (every rank of a group runs the same
program, so an unused collective is dropped on all of them alike). ``send`` and ``recv`` are
registered with torch's effect system (``EffectType.ORDERED``): ``Node.is_impure`` is true for
them, so ``Graph.eliminate_dead_code`` keeps them, and under ``torch.export`` / AOTAutograd /
``torch.compile`` they are threaded with effect tokens, so two identical ``recv`` calls stay two
messages and keep their order. A hand-written CSE over a raw graph must skip them too: use
:func:`is_point_to_point`.
"""
from __future__ import annotations

import torch
from torch._library.effects import EffectType

from fxshard.ops.collective_args import (bucket_dims, check_peer, checked_backend, chunk_length,
                                         gather_bucket_in, gather_bucket_out, gathered_shape,
                                         norm_dim, scatter_bucket_in, scatter_bucket_out,
                                         scattered_shape, size_mismatch)
from fxshard.ops.experts import EXPERT_OPS
from fxshard.ops.library import define_op
from fxshard.runtime.context import CURRENT_BACKEND, current_backend

__all__ = ["COLLECTIVE_OPS", "POINT_TO_POINT_OPS", "is_communication", "is_point_to_point",
           "all_reduce_consuming", "all_reduce_start", "collective_wait", "Pending",
           "all_gather_start", "all_gather_bucket_start", "reduce_scatter_start",
           "reduce_scatter_bucket_start", "START",
           "checked_backend", "size_mismatch"]

_LIB = "fxshard"


def _define(name: str, schema: str):
    return define_op(f"{_LIB}::{name}", schema)


# --- all_gather ---------------------------------------------------------------------------

@_define("all_gather", "(Tensor x, int dim, str axis, int size) -> Tensor")
def _all_gather(x, dim, axis, size):
    backend = checked_backend("all_gather", axis, size)
    dim = norm_dim("all_gather", x, dim)
    return x.clone() if size == 1 else backend.all_gather(x, dim, axis)


@_all_gather.register_fake
def _(x, dim, axis, size):
    dim = norm_dim("all_gather", x, dim)
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


# --- all_reduce ---------------------------------------------------------------------------

@_define("all_reduce", "(Tensor x, str axis, int size) -> Tensor")
def _all_reduce(x, axis, size):
    backend = checked_backend("all_reduce", axis, size)
    return x.clone() if size == 1 else backend.all_reduce(x, axis)


@_all_reduce.register_fake
def _(x, axis, size):
    return x.new_empty(x.shape)


def all_reduce_consuming(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """``fxshard::all_reduce`` for an ``x`` nothing reads afterwards and nothing else
    references (eager rank programs pick it per node: ``fxshard.compile.eager_stage``): the
    sum may be written into ``x``'s own memory, as hand-written Megatron does, instead of a
    fresh copy. Backends without an in-place ``all_reduce_`` (the simulated mesh) and
    non-contiguous ``x`` take the copying path. The in-place path checks ``size`` against the
    mesh itself (:meth:`fxshard.runtime.distributed.DistributedBackend.all_reduce_`): one
    frame per all-reduce, the most frequent op of a tensor-parallel step, where
    :func:`checked_backend` costs three."""
    inplace = getattr(CURRENT_BACKEND.get(), "all_reduce_", None)
    if inplace is not None and x.is_contiguous():
        return inplace(x, axis, size)
    backend = checked_backend("all_reduce", axis, size)
    return x if size == 1 else backend.all_reduce(x, axis)


class Pending:
    """A collective issued by :func:`all_reduce_start` and not waited for yet: ``wait()``
    returns its result (once; a backend's own pending work subclasses this)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def all_reduce_start(x: torch.Tensor, axis: str, size: int, consume: bool) -> Pending:
    """Issue ``fxshard::all_reduce(x, axis, size)`` and return at once where the backend can
    run it in the background (``DistributedBackend.all_reduce_start``: an ``async_op``
    c10d call); :func:`collective_wait` gives the sum. ``consume``: ``x`` is read by nothing
    else (:func:`all_reduce_consuming`'s condition), so the sum may be written into it.
    Other backends (the simulated mesh) reduce here and the wait only hands the result over.
    Eager rank programs call it (``fxshard.passes.post_emit.overlap_collectives_pass``)."""
    start = getattr(CURRENT_BACKEND.get(), "all_reduce_start", None)
    if start is not None and size > 1:
        return start(x if consume and x.is_contiguous() else x.contiguous().clone(), axis, size)
    return Pending(all_reduce_consuming(x, axis, size) if consume
                   else _all_reduce.__wrapped__(x, axis, size))


def collective_wait(pending: Pending) -> torch.Tensor:
    """The result of a collective issued in the background (:func:`all_reduce_start`,
    :data:`START`'s functions): waits for it."""
    return pending.wait()


# --- reduce_scatter -----------------------------------------------------------------------

@_define("reduce_scatter", "(Tensor x, int dim, str axis, int size) -> Tensor")
def _reduce_scatter(x, dim, axis, size):
    backend = checked_backend("reduce_scatter", axis, size)
    dim = norm_dim("reduce_scatter", x, dim)
    chunk_length("reduce_scatter", x, dim, axis, size)
    return x.clone() if size == 1 else backend.reduce_scatter(x, dim, axis)


@_reduce_scatter.register_fake
def _(x, dim, axis, size):
    dim = norm_dim("reduce_scatter", x, dim)
    shape = list(x.shape)
    shape[dim] = chunk_length("reduce_scatter", x, dim, axis, size)
    return x.new_empty(shape)


# --- all_to_all ---------------------------------------------------------------------------

@_define("all_to_all", "(Tensor x, int split_dim, int concat_dim, str axis, int size) -> Tensor")
def _all_to_all(x, split_dim, concat_dim, axis, size):
    backend = checked_backend("all_to_all", axis, size)
    split_dim = norm_dim("all_to_all", x, split_dim, "split_dim")
    concat_dim = norm_dim("all_to_all", x, concat_dim, "concat_dim")
    chunk_length("all_to_all", x, split_dim, axis, size, "split_dim")
    if size == 1:
        return x.clone()
    return backend.all_to_all(x, split_dim, concat_dim, axis)


@_all_to_all.register_fake
def _(x, split_dim, concat_dim, axis, size):
    split_dim = norm_dim("all_to_all", x, split_dim, "split_dim")
    concat_dim = norm_dim("all_to_all", x, concat_dim, "concat_dim")
    shape = list(x.shape)
    shape[split_dim] = chunk_length("all_to_all", x, split_dim, axis, size, "split_dim")
    shape[concat_dim] *= size
    return x.new_empty(shape)


# --- local_shard --------------------------------------------------------------------------

@_define("local_shard", "(Tensor x, int dim, str axis, int size) -> Tensor")
def _local_shard(x, dim, axis, size):
    backend = checked_backend("local_shard", axis, size)
    dim = norm_dim("local_shard", x, dim)
    n = chunk_length("local_shard", x, dim, axis, size)
    start = backend.axis_index(axis) * n
    return x.narrow(dim, start, n).clone(memory_format=torch.contiguous_format)


@_local_shard.register_fake
def _(x, dim, axis, size):
    dim = norm_dim("local_shard", x, dim)
    shape = list(x.shape)
    shape[dim] = chunk_length("local_shard", x, dim, axis, size)
    return x.new_empty(shape)


# --- all_gather_bucket / reduce_scatter_bucket ----------------------------------------------

@_define("all_gather_bucket", "(Tensor[] xs, int[] dims, str axis, int size) -> Tensor[]")
def _all_gather_bucket(xs, dims, axis, size):
    backend = checked_backend("all_gather_bucket", axis, size)
    dims = bucket_dims("all_gather_bucket", xs, dims)
    if size == 1:
        return [x.clone() for x in xs]
    return gather_bucket_out(backend.all_gather(gather_bucket_in(xs), 0, axis), xs, dims, size)


@_all_gather_bucket.register_fake
def _(xs, dims, axis, size):
    dims = bucket_dims("all_gather_bucket", xs, dims)
    return [x.new_empty(gathered_shape(x.shape, d, size)) for x, d in zip(xs, dims)]


@_define("reduce_scatter_bucket", "(Tensor[] xs, int[] dims, str axis, int size) -> Tensor[]")
def _reduce_scatter_bucket(xs, dims, axis, size):
    backend = checked_backend("reduce_scatter_bucket", axis, size)
    dims = bucket_dims("reduce_scatter_bucket", xs, dims)
    shapes = [scattered_shape("reduce_scatter_bucket", x, d, axis, size)
              for x, d in zip(xs, dims)]
    if size == 1:
        return [x.clone() for x in xs]
    flat = scatter_bucket_in(xs, dims, shapes, size)
    return scatter_bucket_out(backend.reduce_scatter(flat, 0, axis), shapes)


@_reduce_scatter_bucket.register_fake
def _(xs, dims, axis, size):
    dims = bucket_dims("reduce_scatter_bucket", xs, dims)
    return [x.new_empty(scattered_shape("reduce_scatter_bucket", x, d, axis, size))
            for x, d in zip(xs, dims)]


# --- collectives in the background -----------------------------------------------------------
# Eager rank programs call these (``fxshard.passes.post_emit.prefetch_fsdp_pass``): each issues
# the op where the backend can run it in the background (``DistributedBackend.*_start``:
# ``async_op`` c10d calls) and returns a :class:`Pending` whose :func:`collective_wait` gives
# exactly what the op gives. The simulated mesh computes the op at once. The inputs are read
# when the collective is issued (a bucket's copy-in) or held until the wait.

class _Then(Pending):
    """A backend's pending collective and what turns its result into the op's."""

    __slots__ = ("work", "then")

    def __init__(self, work, then):
        super().__init__(None)
        self.work, self.then = work, then

    def wait(self):
        return self.then(self.work.wait())


def _starter(op: str, axis: str, size: int, kind: str):
    """The backend's ``<kind>_start`` after the size check, or None (compute at once)."""
    start = getattr(CURRENT_BACKEND.get(), f"{kind}_start", None)
    if start is None or size == 1:
        return None
    checked_backend(op, axis, size)
    return start


def all_gather_start(x: torch.Tensor, dim: int, axis: str, size: int) -> Pending:
    """``fxshard::all_gather(x, dim, axis, size)`` in the background."""
    start = _starter("all_gather", axis, size, "all_gather")
    if start is None:
        return Pending(_all_gather.__wrapped__(x, dim, axis, size))
    return start(x, norm_dim("all_gather", x, dim), axis)


def all_gather_bucket_start(xs, dims, axis: str, size: int) -> Pending:
    """``fxshard::all_gather_bucket(xs, dims, axis, size)`` in the background."""
    start = _starter("all_gather_bucket", axis, size, "all_gather")
    if start is None:
        return Pending(_all_gather_bucket.__wrapped__(xs, dims, axis, size))
    dims = bucket_dims("all_gather_bucket", xs, dims)
    return _Then(start(gather_bucket_in(xs), 0, axis),
                 lambda gathered: gather_bucket_out(gathered, xs, dims, size))


def reduce_scatter_start(x: torch.Tensor, dim: int, axis: str, size: int) -> Pending:
    """``fxshard::reduce_scatter(x, dim, axis, size)`` in the background."""
    start = _starter("reduce_scatter", axis, size, "reduce_scatter")
    if start is None:
        return Pending(_reduce_scatter.__wrapped__(x, dim, axis, size))
    dim = norm_dim("reduce_scatter", x, dim)
    chunk_length("reduce_scatter", x, dim, axis, size)
    return start(x, dim, axis)


def reduce_scatter_bucket_start(xs, dims, axis: str, size: int) -> Pending:
    """``fxshard::reduce_scatter_bucket(xs, dims, axis, size)`` in the background."""
    start = _starter("reduce_scatter_bucket", axis, size, "reduce_scatter")
    if start is None:
        return Pending(_reduce_scatter_bucket.__wrapped__(xs, dims, axis, size))
    dims = bucket_dims("reduce_scatter_bucket", xs, dims)
    shapes = [scattered_shape("reduce_scatter_bucket", x, d, axis, size)
              for x, d in zip(xs, dims)]
    return _Then(start(scatter_bucket_in(xs, dims, shapes, size), 0, axis),
                 lambda mine: scatter_bucket_out(mine, shapes))


START = {}
"""A collective op -> the function that issues it in the background (filled below)."""


# --- send / recv --------------------------------------------------------------------------

@_define("send", "(Tensor x, str axis, int peer) -> ()")
def _send(x, axis, peer):
    backend = current_backend("torch.ops.fxshard.send")
    check_peer("send", backend, axis, peer)
    backend.send(x, axis, peer)


@_send.register_fake
def _(x, axis, peer):
    return None


@_define("recv", "(int[] shape, ScalarType dtype, Device device, str axis, int peer) -> Tensor")
def _recv(shape, dtype, device, axis, peer):
    backend = current_backend("torch.ops.fxshard.recv")
    check_peer("recv", backend, axis, peer)
    return backend.recv(list(shape), dtype, device, axis, peer)


@_recv.register_fake
def _(shape, dtype, device, axis, peer):
    return torch.empty(shape, dtype=dtype, device=device)


_ops = torch.ops.fxshard
for _p2p in (_ops.send.default, _ops.recv.default):
    torch.library._register_effectful_op(_p2p, EffectType.ORDERED)

COLLECTIVE_OPS = frozenset({
    _ops.all_gather.default, _ops.all_reduce.default, _ops.reduce_scatter.default,
    _ops.all_to_all.default, _ops.all_gather_bucket.default, _ops.reduce_scatter_bucket.default,
}) | EXPERT_OPS
"""The ops that communicate within a mesh-axis group (``local_shard`` does not; the expert
exchanges of :mod:`fxshard.ops.experts` do)."""

START.update({_ops.all_gather.default: all_gather_start,
              _ops.all_gather_bucket.default: all_gather_bucket_start,
              _ops.reduce_scatter.default: reduce_scatter_start,
              _ops.reduce_scatter_bucket.default: reduce_scatter_bucket_start})

POINT_TO_POINT_OPS = frozenset({_ops.send.default, _ops.recv.default})
"""``send`` and ``recv``: effectful, never dead-code eliminated or merged."""


def is_communication(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a collective or a point-to-point op."""
    return node.op == "call_function" and (node.target in COLLECTIVE_OPS
                                           or node.target in POINT_TO_POINT_OPS)


def is_point_to_point(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ``send``/``recv``: a CSE must never merge two of them."""
    return node.op == "call_function" and node.target in POINT_TO_POINT_OPS
