"""Launch a multi-process gloo job for a test and collect each rank's JSON report.

Workers get ``(rank, port, out_dir, *args)``, run their checks, write ``rank{r}.json`` (and may
write ``rank{r}.log``) into ``out_dir`` and exit. A job that outlives ``timeout_s`` is killed and
fails the test with whatever the ranks reported, never hangs the suite.
"""
from __future__ import annotations

import json
import os
import socket
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    procs = [ctx.Process(target=_run, args=(worker, grad, r, port, out_dir, *args), daemon=True)
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
