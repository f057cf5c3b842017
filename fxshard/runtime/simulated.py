"""The simulated mesh: every rank is a thread of this process, collectives meet in memory.

::

    world = SimulatedWorld(mesh)                  # one persistent worker thread per rank
    outs = world.run(lambda rank: programs[rank](*inputs[rank]))   # results in rank order

Inside ``run`` each thread has a :class:`SimulatedBackend` installed, so the ``fxshard::*`` ops
of a per-rank program rendezvous with the other ranks of their mesh-axis group. Calls are
matched by a per-(axis, rank) sequence number: the k-th collective a rank issues on ``tp`` meets
the k-th collective of every other rank of its ``tp`` group. The participants must agree on the
op, its non-tensor arguments, dtype and shape, otherwise the per-rank programs diverged and the
call raises a RuntimeError naming both ranks.

Failures never hang: when a rank raises, every rank blocked in a collective or a ``recv`` is
woken and fails, and ``run`` re-raises the first error naming its rank; a rank that waits longer
than ``timeout`` raises a TimeoutError naming itself, the op, the axis and the missing ranks.

Each collective is two rendezvous: *arrive* (all inputs present; each rank then computes its
own result from them, in parallel, outside the lock) and *depart* (no rank reads the inputs any
more, so their owners may go on). ``all_reduce`` instead has the last rank to arrive sum once
and every rank copy the sum. Results are fresh tensors, never views of another rank's.

The ranks of a run share the caller's intra-op threads (``torch.get_num_threads()`` divided
by the number of ranks, at least 1) and give them back afterwards: every rank using all cores
would run ``ranks`` times too many threads. The rank threads and that choice are in
:mod:`fxshard.runtime.rank_threads`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fxshard.mesh import MeshSpec, mesh_spec
from fxshard.runtime.context import use_backend
from fxshard.runtime.rank_threads import RankThreads, intra_op_threads, with_intra_op_threads

__all__ = ["SimulatedWorld", "SimulatedBackend"]

# Exceptions re-raised by ``run`` as the same type (with the failing rank in the message);
# others become a RuntimeError. Both chain the original.
_SAME_TYPE = (RuntimeError, ValueError, TypeError, TimeoutError, AssertionError, KeyError,
              IndexError, NotImplementedError, ZeroDivisionError, ArithmeticError)


class _PeerFailed(RuntimeError):
    """Raised in a rank that was waiting when another rank failed (not the root cause)."""


@dataclass
class _Signature:
    """What every participant of one collective must agree on."""

    op: str
    args: tuple[tuple[str, Any], ...]
    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args)
        return f"{self.op}({args}) on {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"

    def differences(self, other: "_Signature") -> list[str]:
        if self.op != other.op:
            out = ["the op"]
        else:
            out = [k for (k, v), (_, w) in zip(self.args, other.args) if v != w]
        if self.dtype != other.dtype:
            out.append("the dtype")
        if self.shape != other.shape:
            out.append("the shape")
        return out


@dataclass
class _Slot:
    """One collective of one group: inputs by axis coordinate, arrival and departure counts."""

    signature: _Signature
    first_rank: int
    cond: threading.Condition
    inputs: list[torch.Tensor | None]
    arrived: list[int] = field(default_factory=list)
    departed: int = 0
    result: torch.Tensor | None = None


@dataclass
class _Message:
    axis: str
    tensor: torch.Tensor


@dataclass
class _Mailbox:
    cond: threading.Condition
    messages: collections.deque = field(default_factory=collections.deque)


class SimulatedWorld:
    """All ranks of ``mesh`` as persistent threads of this process.

    ``timeout`` (seconds) bounds every wait in a collective or ``recv``; past it the waiting rank
    raises a TimeoutError that says which ranks did not arrive. Use as a context manager or call
    :meth:`close` to stop the threads (an unreferenced world stops them too).
    """

    def __init__(self, mesh, *, timeout: float = 60.0):
        self.mesh: MeshSpec = mesh_spec(mesh, where="fxshard.runtime.SimulatedWorld")
        if not timeout > 0:
            raise ValueError(f"fxshard.runtime.SimulatedWorld: timeout={timeout!r}; give a "
                             f"positive number of seconds")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._slots: dict[tuple, _Slot] = {}
        self._mailboxes: dict[tuple[int, int], _Mailbox] = {}
        self._failure: tuple[int, BaseException] | None = None
        self._threads = RankThreads(
            [f"fxshard-{self.describe_rank(r).replace(' ', '')}"
             for r in range(self.mesh.world_size)])
        self._closed = False

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.mesh.describe()}, timeout={self.timeout})"

    def __enter__(self) -> "SimulatedWorld":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker threads; the world cannot run anything afterwards."""
        self._closed = True
        self._threads.close(timeout=self.timeout)

    def describe_rank(self, rank: int) -> str:
        coords = self.mesh.coords(rank)
        return f"rank {rank} (" + ", ".join(
            f"{a}={c}" for a, c in zip(self.mesh.axis_names, coords)) + ")"

    # --- running ----------------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any], *, ranks: Sequence[int] | None = None) -> list:
        """Call ``fn(rank)`` on every rank's thread with its backend installed; return the
        results in the order of ``ranks`` (default: all ranks, ascending)."""
        where = "fxshard.runtime.SimulatedWorld.run"
        if self._closed:
            raise RuntimeError(f"{where}: this world was closed; create a new SimulatedWorld")
        if threading.current_thread() in self._threads.threads:
            raise RuntimeError(f"{where}: called from inside a rank of the same world; a rank "
                               f"cannot start another run of its own world")
        ranks = list(range(self.mesh.world_size)) if ranks is None else [int(r) for r in ranks]
        for r in ranks:
            self.mesh.coords(r)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: ranks={ranks} repeats a rank; give each rank once")
        with self._run_lock:
            with self._lock:
                self._slots.clear()
                self._mailboxes.clear()
                self._failure = None
            # the caller's intra-op threads, shared by the ranks, the caller's count restored
            threads, caller = intra_op_threads(len(ranks)), torch.get_num_threads()
            futures = [self._threads.submit(r, functools.partial(
                with_intra_op_threads, functools.partial(self._run_rank, fn, r), threads,
                caller)) for r in ranks]
            try:
                concurrent.futures.wait(futures)
            except BaseException as exc:  # e.g. KeyboardInterrupt: wake the ranks, then leave
                self._fail(-1, exc)
                concurrent.futures.wait(futures)
                raise
            if self._failure is not None:
                rank, exc = self._failure
                raise self._rank_error(rank, exc) from exc
            self._check_mailboxes_drained()
            return [f.result() for f in futures]

    def _run_rank(self, fn: Callable[[int], Any], rank: int) -> Any:
        try:
            with use_backend(SimulatedBackend(self, rank)):
                return fn(rank)
        except BaseException as exc:
            self._fail(rank, exc)
            raise

    def _fail(self, rank: int, exc: BaseException) -> None:
        """Record the first failure and wake every waiting rank."""
        with self._lock:
            if self._failure is None and not isinstance(exc, _PeerFailed):
                self._failure = (rank, exc)
            for slot in self._slots.values():
                slot.cond.notify_all()
            for box in self._mailboxes.values():
                box.cond.notify_all()

    def _rank_error(self, rank: int, exc: BaseException) -> BaseException:
        prefix = f"SimulatedWorld {self.mesh.describe()}: "
        who = "the caller of run()" if rank < 0 else self.describe_rank(rank)
        msg = str(exc) if str(exc).startswith(prefix) else \
            f"{prefix}{who} raised {type(exc).__name__}: {exc}"
        return type(exc)(msg) if type(exc) in _SAME_TYPE else RuntimeError(msg)

    def _check_mailboxes_drained(self) -> None:
        left = [(src, dst, box) for (src, dst), box in self._mailboxes.items() if box.messages]
        if left:
            src, dst, box = left[0]
            raise RuntimeError(
                f"SimulatedWorld {self.mesh.describe()}: {self.describe_rank(src)} sent "
                f"{len(box.messages)} message(s) on axis {box.messages[0].axis!r} to "
                f"{self.describe_rank(dst)} that were never received; every send needs a "
                f"matching recv in the same run (the per-rank programs diverged)")

    # --- waiting ----------------------------------------------------------------------------

    def _wait(self, cond: threading.Condition, done: Callable[[], bool], deadline: float,
              what: Callable[[], str], rank: int) -> None:
        """Wait on ``cond`` (lock held) until ``done()``, a failure elsewhere, or the deadline."""
        while not done():
            if self._failure is not None:
                raise self._abandoned(rank, what())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"SimulatedWorld {self.mesh.describe()}: {self.describe_rank(rank)} waited "
                    f"{self.timeout:g} s {what()}. A rank skipped or reordered this call (the "
                    f"per-rank programs diverged) or is stuck; if it is only slow, pass a larger "
                    f"timeout= to SimulatedWorld")
            cond.wait(remaining)

    def _abandoned(self, rank: int, what: str) -> _PeerFailed:
        failed, exc = self._failure
        who = "the caller of run()" if failed < 0 else self.describe_rank(failed)
        return _PeerFailed(f"{self.describe_rank(rank)} stopped waiting {what} because {who} "
                           f"raised {type(exc).__name__}: {exc}")

    def _check_failed(self, rank: int, what: Callable[[], str]) -> None:
        if self._failure is not None:
            raise self._abandoned(rank, what())

    # --- collectives ------------------------------------------------------------------------

    def _collective(self, backend: "SimulatedBackend", sig: _Signature, axis: str,
                    x: torch.Tensor, compute: Callable[[list[torch.Tensor], int], torch.Tensor],
                    *, shared: bool = False) -> torch.Tensor:
        """Rendezvous of ``backend``'s rank with its ``axis`` group; ``compute(inputs, index)``
        makes this rank's result from the inputs in coordinate order. ``shared``: the last rank
        to arrive computes one result (``index`` -1) that every rank copies (all_reduce: n-1
        additions in all instead of n-1 per rank)."""
        rank, group = backend.rank, backend.group(axis)
        index = group.index(rank)
        seq = backend.next_seq(axis)
        key = (axis, group[0], seq)
        deadline = time.monotonic() + self.timeout

        def what(phase: str) -> Callable[[], str]:
            def text() -> str:
                slot = self._slots.get(key)
                arrived = sorted(slot.arrived) if slot else []
                missing = [r for r in group if r not in arrived]
                return (f"in fxshard.{sig.op} on axis {axis!r} (collective #{seq} of group "
                        f"{group}) {phase}; arrived: {arrived}, missing: {missing}")
            return text

        with self._lock:
            self._check_failed(rank, what("to start"))
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(sig, rank, threading.Condition(self._lock),
                                                [None] * len(group))
            else:
                diff = slot.signature.differences(sig)
                if diff:
                    raise RuntimeError(
                        f"SimulatedWorld {self.mesh.describe()}: collective #{seq} on axis "
                        f"{axis!r} of group {group} does not match: "
                        f"{self.describe_rank(slot.first_rank)} called "
                        f"{slot.signature.describe()} but {self.describe_rank(rank)} called "
                        f"{sig.describe()} (they differ in {', '.join(diff)}). Every rank of a "
                        f"group must issue the same collectives in the same order; the per-rank "
                        f"programs diverged.")
            slot.inputs[index] = x
            slot.arrived.append(rank)
            last = len(slot.arrived) == len(group)
            if last and not shared:
                slot.cond.notify_all()
            elif not last:
                done = ((lambda: slot.result is not None) if shared
                        else (lambda: len(slot.arrived) == len(group)))
                self._wait(slot.cond, done, deadline, what("for the other ranks to arrive"), rank)
        if shared:
            if last:
                result = compute(slot.inputs, -1)
                with self._lock:
                    slot.result, slot.inputs = result, []
                    del self._slots[key]
                    slot.cond.notify_all()
            return slot.result.clone(memory_format=torch.contiguous_format)
        out = compute(slot.inputs, index)
        with self._lock:
            slot.departed += 1
            if slot.departed == len(group):
                del self._slots[key]
                slot.inputs = []
                slot.cond.notify_all()
            else:
                self._wait(slot.cond, lambda: slot.departed == len(group), deadline,
                           lambda: (f"in fxshard.{sig.op} on axis {axis!r} (collective #{seq} "
                                    f"of group {group}) for the other ranks to read its input"),
                           rank)
        return out

    # --- point to point ---------------------------------------------------------------------

    def _send(self, src: int, dst: int, axis: str, x: torch.Tensor) -> None:
        payload = x.detach().clone(memory_format=torch.contiguous_format)
        with self._lock:
            self._check_failed(src, lambda: (f"in fxshard.send on axis {axis!r} to "
                                             f"{self.describe_rank(dst)}"))
            box = self._mailbox(src, dst)
            box.messages.append(_Message(axis, payload))
            box.cond.notify_all()

    def _recv(self, src: int, dst: int, axis: str, shape: list[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        def what() -> str:
            return (f"in fxshard.recv on axis {axis!r} for a message from "
                    f"{self.describe_rank(src)}; none arrived")
        deadline = time.monotonic() + self.timeout
        with self._lock:
            self._check_failed(dst, what)
            box = self._mailbox(src, dst)
            self._wait(box.cond, lambda: bool(box.messages), deadline, what, dst)
            msg = box.messages.popleft()
        t = msg.tensor
        if msg.axis != axis or list(t.shape) != list(shape) or t.dtype != dtype:
            raise RuntimeError(
                f"SimulatedWorld {self.mesh.describe()}: {self.describe_rank(dst)} expected "
                f"fxshard.recv(axis={axis!r}) of {str(dtype).removeprefix('torch.')}"
                f"{list(shape)} from {self.describe_rank(src)}, but the next message it sent is "
                f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on axis {msg.axis!r}; "
                f"the sender's send and the receiver's recv must match in order, shape and dtype")
        return t.to(device)

    def _mailbox(self, src: int, dst: int) -> _Mailbox:
        box = self._mailboxes.get((src, dst))
        if box is None:
            box = self._mailboxes[(src, dst)] = _Mailbox(threading.Condition(self._lock))
        return box


class SimulatedBackend:
    """The backend of one rank of a :class:`SimulatedWorld` (created by ``run``)."""

    def __init__(self, world: SimulatedWorld, rank: int):
        self.world = world
        self.mesh = world.mesh
        self.rank = rank
        self._seq: dict[str, int] = {}
        self._groups: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"SimulatedBackend({self.world.describe_rank(self.rank)})"

    def axis_index(self, axis: str) -> int:
        return self.mesh.axis_index(self.rank, axis)

    def axis_size(self, axis: str) -> int:
        return self.mesh.axis_size(axis)

    def group(self, axis: str) -> list[int]:
        group = self._groups.get(axis)
        if group is None:
            group = self._groups[axis] = self.mesh.axis_group(self.rank, axis)
        return group

    def next_seq(self, axis: str) -> int:
        seq = self._seq.get(axis, 0)
        self._seq[axis] = seq + 1
        return seq

    def _sig(self, op: str, x: torch.Tensor, **args) -> _Signature:
        return _Signature(op, tuple(args.items()), x.dtype, tuple(x.shape))

    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        return self.world._collective(self, self._sig("all_gather", x, dim=dim), axis, x,
                                      lambda xs, i: torch.cat(xs, dim))

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return self.world._collective(self, self._sig("all_reduce", x), axis, x,
                                      lambda xs, i: _sum(xs), shared=True)

    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        def compute(xs: list[torch.Tensor], i: int) -> torch.Tensor:
            n = x.shape[dim] // len(xs)
            return _sum([t.narrow(dim, i * n, n) for t in xs])
        return self.world._collective(self, self._sig("reduce_scatter", x, dim=dim), axis, x,
                                      compute)

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int,
                   axis: str) -> torch.Tensor:
        def compute(xs: list[torch.Tensor], i: int) -> torch.Tensor:
            n = x.shape[split_dim] // len(xs)
            return torch.cat([t.narrow(split_dim, i * n, n) for t in xs], concat_dim)
        sig = self._sig("all_to_all", x, split_dim=split_dim, concat_dim=concat_dim)
        return self.world._collective(self, sig, axis, x, compute)

    def all_to_all_single(self, x: torch.Tensor, in_splits: Sequence[int],
                          out_splits: Sequence[int], axis: str) -> torch.Tensor:
        """Rows ``in_splits[j]`` of ``x`` (in order) go to coordinate j; the rows received,
        ``out_splits[s]`` from each coordinate s, concatenate on dim 0 in coordinate order.
        The split sizes differ per rank: they are no part of the signature, but the sizes a
        rank receives must be those its peers send."""
        def compute(xs: list, i: int) -> torch.Tensor:
            parts = []
            for s, (t, splits) in enumerate(xs):
                if splits[i] != out_splits[s]:
                    raise RuntimeError(
                        f"fxshard.all_to_all_single on axis {axis!r}: "
                        f"{self.world.describe_rank(self.rank)} expects {out_splits[s]} rows "
                        f"from coordinate {s}, which sends {splits[i]}; the split sizes of "
                        f"the group disagree")
                parts.append(t.narrow(0, sum(splits[:i]), splits[i]))
            return torch.cat(parts, 0)
        sig = _Signature("all_to_all_single", (), x.dtype, ("rows", *x.shape[1:]))
        return self.world._collective(self, sig, axis, (x, list(in_splits)), compute)

    def send(self, x: torch.Tensor, axis: str, peer: int) -> None:
        self.world._send(self.rank, self.group(axis)[peer], axis, x)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, axis: str,
             peer: int) -> torch.Tensor:
        return self.world._recv(self.group(axis)[peer], self.rank, axis, list(shape), dtype,
                                torch.device(device))

    def flush(self) -> None:
        """Nothing to wait for: a simulated send is delivered when it returns."""


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Sum in coordinate order, so every rank of a group gets bit-identical results."""
    out = xs[0].clone(memory_format=torch.contiguous_format)
    for t in xs[1:]:
        out.add_(t)
    return out
