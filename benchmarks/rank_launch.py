"""The benchmarks' gloo launcher: :func:`launch` runs a worker on N gloo ranks on loopback (a
free port held by the launcher's store, ``torch.set_num_threads`` per rank), returns every
rank's result, shuts the ranks down cleanly (fxshard's backends released first), and names the
rank that failed with its traceback (:class:`RankFailed`); :func:`free_port` for launchers that
cannot take a held store. Scripts import it through :mod:`benchmarks.common`.
"""
from __future__ import annotations

import datetime
import queue as queue_lib
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["RankFailed", "free_port", "launch"]


class RankFailed(RuntimeError):
    """A rank of a :func:`launch` raised, died or outlived the timeout."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for launchers that cannot take a held store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release_fxshard() -> None:
    mod = sys.modules.get("fxshard.runtime.distributed")
    if mod is not None:  # fxshard's backends hold process groups: drop them before destroy
        mod.release_all()


def _rank_main(rank, world, port, threads, timeout_s, results, worker, args) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        try:
            out = worker(rank, *args)
        finally:
            _release_fxshard()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the launcher, which names this rank
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, out))


def launch(worker, world: int, *args, threads: int = 1, timeout_s: float = 900.0) -> list:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes joined in one gloo process
    group on 127.0.0.1 (the launcher holds the rendezvous store on a port the OS picks, so no
    other process can take it), each with ``torch.set_num_threads(threads)``. Returns the
    workers' return values (picklable), by rank. The group is destroyed (fxshard's backends
    released first) when the worker returns or raises.

    A rank that raises, exits without a result, or is still running after ``timeout_s``
    seconds: the other ranks are stopped (they may wait on it in a collective) and
    :class:`RankFailed` names the first failing rank, with its traceback."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, store.port, threads, timeout_s, results, worker, args))
             for r in range(world)]
    for p in procs:
        p.start()
    done, failed = {}, {}
    deadline = time.monotonic() + timeout_s
    exited: dict[int, float] = {}   # rank -> when its process was first seen gone
    first_failure = None
    clean = False                   # every rank returned: give them time to exit by themselves
    try:
        while len(done) + len(failed) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
                (done if ok else failed)[rank] = value
            except queue_lib.Empty:
                pass
            t = time.monotonic()
            for r, p in enumerate(procs):  # gone without a report (a signal, os._exit)
                if r not in done and r not in failed and p.exitcode is not None:
                    if t - exited.setdefault(r, t) > 2.0:  # its report may still be queued
                        failed[r] = f"exited with code {p.exitcode} without a result"
            if failed and first_failure is None:
                first_failure = t
            if first_failure is not None and t - first_failure > 5.0:
                break   # the others had time to report their own error; stop them
            if t > deadline:
                missing = [r for r in range(world) if r not in done and r not in failed]
                raise RankFailed(f"launch: rank(s) {missing} of {world} still running after "
                                 f"{timeout_s} s; finished: {sorted(done)}; failed: "
                                 f"{sorted(failed)}")
        clean = not failed
    finally:  # also on a timeout or Ctrl-C: no rank outlives the launcher
        stuck = []
        for r, p in enumerate(procs):
            p.join(60.0 if clean else 0.5)
            if p.is_alive():
                stuck.append(r)
                p.kill()
                p.join()
        del store  # the rendezvous store lives until every rank has gone
    if failed:
        # the root cause, not a peer's "connection closed" that followed it
        def secondary(r):
            return any(w in failed[r] for w in ("Connection closed", "Connection reset",
                                                "ConnectionReset", "Broken pipe"))
        first = min(failed, key=lambda r: (secondary(r), r))
        others = ", ".join(f"rank {r}: {str(v).strip().splitlines()[-1]}"
                           for r, v in sorted(failed.items()) if r != first)
        raise RankFailed(f"launch: rank {first} of {world} failed:\n{failed[first]}"
                         + (f"\n(also: {others})" if others else ""))
    for r, p in enumerate(procs):
        if r in stuck:  # a hang at exit after a correct run: say so, keep the results
            print(f"warning: rank {r} had not exited 60 s after returning its result; killed",
                  file=sys.stderr)
        elif p.exitcode != 0:
            print(f"warning: rank {r} exited with code {p.exitcode} after returning its "
                  f"result", file=sys.stderr)
    return [done[r] for r in range(world)]
