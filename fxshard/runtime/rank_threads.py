"""The threads of a simulated mesh: one persistent worker thread per rank, and the intra-op
threads each rank's torch ops may use.

::

    pool = RankThreads(["rank0", "rank1"])                  # started at the first submit
    threads = intra_op_threads(2)                           # the caller's count // 2, >= 1
    futures = [pool.submit(r, functools.partial(with_intra_op_threads, call, threads))
               for r in (0, 1)]                             # call() on rank r's thread
    pool.close()

How ``torch.set_num_threads`` acts across Python threads (torch 2.13, OpenMP build, measured):
it sets the calling thread's own count and the process-wide default that a thread started
later takes at its first torch op; threads that already ran one keep theirs. So the caller's
count is not changed by a rank, but a rank that set 1 would hand 1 to every thread started
afterwards. A rank therefore sets its count for the call and then sets the caller's count
again (the default is then what the caller uses, as before the run).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["RankThreads", "intra_op_threads", "with_intra_op_threads"]


def intra_op_threads(ranks: int) -> int:
    """Intra-op threads for each of ``ranks`` concurrent rank threads: the calling thread's
    ``torch.get_num_threads()`` (by default the machine's cores; ``torch.set_num_threads``
    changes it) shared out, at least 1. Without it every rank would use all cores: ``ranks``
    times too many threads, each busy-waiting for the others."""
    return max(1, torch.get_num_threads() // ranks)


def with_intra_op_threads(call: Callable[[], Any], threads: int, restore: int) -> Any:
    """``call()`` with ``threads`` intra-op threads in this thread, then ``restore`` (the
    caller's count: also the default of threads started later, see the module docstring)."""
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(restore)


def _worker_loop(tasks: queue.SimpleQueue) -> None:
    """Body of a rank thread: run ``(call, future)`` tasks until a ``None`` arrives.

    It holds no reference to its owner between tasks, so an unclosed world can be collected.
    """
    while True:
        item = tasks.get()
        if item is None:
            return
        call, future = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the owner, which re-raises it
                future.set_exception(exc)
                del exc
        del call, future


def _stop_workers(queues: list[queue.SimpleQueue]) -> None:
    for q in queues:
        q.put(None)


class RankThreads:
    """One daemon thread per rank, named ``names[rank]``, started at the first ``submit``;
    each runs the calls submitted to its rank in order. The threads stop at :meth:`close` or
    when this object is collected."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self._queues: list[queue.SimpleQueue] = []
        self.threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None

    def submit(self, rank: int, call: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``call()`` on ``rank``'s thread; its result or exception in the future."""
        if not self.threads:
            self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queues[rank].put((call, future))
        return future

    def _start(self) -> None:
        self._queues = [queue.SimpleQueue() for _ in self.names]
        self.threads = [threading.Thread(target=_worker_loop, args=(q,), daemon=True, name=n)
                        for n, q in zip(self.names, self._queues)]
        for t in self.threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop_workers, self._queues)

    def close(self, timeout: float) -> None:
        """Stop the threads after the calls already submitted; wait up to ``timeout`` seconds
        for each (not for the calling thread itself)."""
        if self._finalizer is not None:
            self._finalizer()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=timeout)
        self.threads = []
