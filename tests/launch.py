"""Launch a multi-process gloo job for a test and collect each rank's JSON report.

``gloo_job(body, world, out_dir, *args, timeout_s=)`` is what a test uses: each spawned rank
sends its output to ``rank{r}.log``, joins the process group, runs ``body(rank, report, *args)``
(``report`` a dict holding ``rank`` and ``errors``, which the body fills) and writes
``rank{r}.json``; an exception in the body lands in ``report["errors"]`` and fails the test. A
job that outlives ``timeout_s`` is killed (each rank's stacks dumped to its log first) and fails
the test with whatever the ranks reported, never hangs the suite.

``launch(worker, ...)`` is the bare form for a worker that writes its own report: it gets
``(rank, port, out_dir, *args)`` and joins the process group with ``init_gloo``.

The rendezvous store is served by the test process itself (a ``TCPStore`` on a port the OS
picks and that stays bound for the whole job), so two jobs running at once cannot race for a
port.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import pytest


def free_port() -> int:
    """A port free now (for a process that binds it itself, as torchrun does)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, port: int, world: int, timeout_s: float = 60) -> None:
    """Join the job's gloo process group through the store the test process serves on
    ``port``."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def mesh(**axes):
    """The torch DeviceMesh on cpu with ``axes`` (name -> size, outermost first)."""
    import fxshard
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def worst_block(shards: dict, full: dict, specs: dict, spec, rank: int,
                of=lambda t: t.detach(), full_of=None) -> float:
    """The largest ``|of(shard) - rank's block of full_of(full tensor)|`` over a rank's
    ``shards`` (name -> tensor), ``full`` the single-device tensors by name; ``full_of``
    defaults to ``of``."""
    from fxshard.placement import local_block
    full_of = full_of or of
    return max((of(p) - local_block(full_of(full[n]), specs[n], spec, rank)).abs().max().item()
               for n, p in shards.items())


def _write(out_dir: str, rank: int, report: dict) -> None:
    """Atomically: a reader never sees half a report."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def _gloo_rank(rank: int, port: int, out_dir: str, body, world: int, pg_timeout_s: float,
               job_timeout_s: float, *args) -> None:
    import faulthandler
    report = {"rank": rank, "errors": []}
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(max(1.0, job_timeout_s - 15), file=log)  # where a hang sits
    try:
        import warnings
        warnings.simplefilter("ignore")
        import torch
        torch.set_num_threads(1)
        init_gloo(rank, port, world, pg_timeout_s)
        body(rank, report, *args)
    except BaseException:  # noqa: BLE001 - reported to the test process
        report["errors"].append(traceback.format_exc())
    _write(out_dir, rank, report)
    os._exit(0)   # skip process-group teardown, which may wait on a failed rank


def gloo_job(body, world: int, out_dir: str, *args, timeout_s: float, grad: bool = False,
             pg_timeout_s: float = 60, check_errors: bool = True) -> dict:
    """Run ``body(rank, report, *args)`` on ``world`` gloo ranks; return ``{rank: report}``.
    Fails the test if a rank's body raised (unless not ``check_errors``: a module fixture whose
    tests look at the errors themselves). ``grad`` as for ``launch``."""
    reports = launch(_gloo_rank, world, out_dir, body, world, pg_timeout_s, timeout_s, *args,
                     timeout_s=timeout_s, grad=grad)
    if check_errors:
        for rank, r in reports.items():
            assert not r["errors"], f"rank {rank}: {r['errors'][0]}"
    return reports


def _run(worker, grad: bool, *args) -> None:
    """``worker(*args)`` with autograd on only for a training test (``pm(x)`` with grad
    enabled trains; the inference tests call it as inference)."""
    import torch
    torch.set_grad_enabled(grad)
    worker(*args)


def launch(worker, world: int, out_dir: str, *args, timeout_s: float,
           grad: bool = False) -> dict:
    """Run ``worker`` on ``world`` spawned processes; return ``{rank: report}``. The workers
    run with grad disabled unless ``grad`` (``pm(x)`` with grad enabled trains)."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_gloo_available()):
            pytest.skip("torch.distributed with the gloo backend is not available in this build")
    except ImportError as exc:
        pytest.skip(f"torch.distributed is not importable: {exc}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    # held until the workers are gone: the port is ours, no other job can take it meanwhile
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    procs = [ctx.Process(target=_run, args=(worker, grad, r, store.port, out_dir, *args),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    del store
    out, logs = {}, {}
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
        path = os.path.join(out_dir, f"rank{r}.log")
        if os.path.exists(path):
            with open(path) as f:
                logs[r] = f.read()[-4000:]
    assert not hung, (f"ranks {hung} were still running after {timeout_s} s; reports: {out}; "
                      f"logs: {logs}")
    assert sorted(out) == list(range(world)), f"missing reports: {out}; logs: {logs}"
    return out
