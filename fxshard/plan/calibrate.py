"""``fxshard.calibrate()``: this machine as a :class:`~fxshard.plan.hardware.Hardware`.

Measures, with torch's own kernels on the CPU:

- matmul flop/s per dtype (float32, bfloat16): the best of a few ``n x n @ n x n`` matmuls,
  with ``torch.get_num_threads()`` threads (set it as the ranks will run, e.g. 1);
- memory bandwidth: a large tensor copied (read + write bytes over the time);
- the time of one small op (the dispatch overhead every node of a program pays);
- gloo latency and bandwidth: an all-reduce between two local processes at a small and a
  large message size (``latency`` = the small one's time per ring step, ``bandwidth`` from the
  large one's wire bytes); skipped with ``links=False`` (then the links are taken as memory
  copies, which is what a simulated mesh does).

Every efficiency factor is 1.0: the measured rates are the achieved ones. ``devices_per_node``
is ``ranks`` (one machine): every axis is ``intra_node``; the same link figures are used for
``inter_node``.
"""
from __future__ import annotations

import time

import torch

from .hardware import INTER, INTRA, Hardware, Link

__all__ = ["calibrate"]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_flops(dtype: torch.dtype, n: int, repeat: int) -> float:
    a = torch.randn(n, n, dtype=torch.float32, device="cpu").to(dtype)
    b = torch.randn(n, n, dtype=torch.float32, device="cpu").to(dtype)
    a @ b
    return 2 * n ** 3 / _best(lambda: a @ b, repeat)


def _bandwidth(nbytes: int, repeat: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cpu")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeat)


def _op_latency(repeat: int) -> float:
    """Seconds per small op (the dispatch overhead a program pays per node)."""
    a = torch.ones(64, device="cpu")
    b = torch.ones(64, device="cpu")

    def ops():
        for _ in range(200):
            torch.add(a, b)
    ops()
    return _best(ops, repeat) / 200


def _gloo_worker(rank: int, path: str, sizes: list, repeat: int, queue) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        out = {}
        for n in sizes:
            x = torch.ones(n // 4, dtype=torch.float32, device="cpu")
            dist.all_reduce(x)
            dist.barrier()
            out[n] = _best(lambda: dist.all_reduce(x), repeat)
        queue.put(out)
    finally:
        dist.destroy_process_group()


def _gloo(repeat: int) -> tuple[float, float]:
    """(latency per step, bandwidth) of a 2-process gloo all-reduce on loopback."""
    import os
    import tempfile
    import torch.multiprocessing as mp
    small, large = 4096, 32 * 2 ** 20
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_gloo_worker, args=(r, path, [small, large], repeat,
                                                         queue)) for r in range(2)]
        for p in procs:
            p.start()
        res = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
    t_small = max(r[small] for r in res)
    t_large = max(r[large] for r in res)
    latency = t_small / 2                      # 2 (n - 1) steps for n = 2
    bandwidth = large / max(t_large - t_small, 1e-9)   # wire: 2 (n - 1) / n * size = size
    return latency, bandwidth


def calibrate(*, ranks: int = 2, size: int = 1024, repeat: int = 5, links: bool = True,
              memory_bytes: int | None = None) -> Hardware:
    """This machine's :class:`Hardware` (module docstring). ``size``: the matmul's n;
    ``memory_bytes``: the memory a rank may use (default: the available RAM / ``ranks``)."""
    flops = {torch.float32: _matmul_flops(torch.float32, size, repeat)}
    try:
        flops[torch.bfloat16] = _matmul_flops(torch.bfloat16, size, max(repeat // 2, 1))
    except RuntimeError:
        pass
    bw = _bandwidth(64 * 2 ** 20, repeat)
    op = _op_latency(repeat)
    latency, link_bw = (_gloo(repeat) if links else (1e-6, bw / 2))
    if memory_bytes is None:
        from ..runtime.memory import available_bytes
        have = available_bytes(torch.device("cpu"))
        memory_bytes = (have[0] if have else 8 * 2 ** 30) // max(ranks, 1)
    link = Link(link_bw, latency)
    return Hardware(name=f"this CPU ({torch.get_num_threads()} threads, calibrated)",
                    flops=flops, memory_bytes=int(memory_bytes), memory_bandwidth=bw,
                    links={INTRA: link, INTER: link}, devices_per_node=max(ranks, 1),
                    matmul_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                    link_efficiency=1.0, usable_memory=1.0, op_latency=op,
                    source="fxshard.calibrate() on this machine",
                    measured={"matmul_flops": dict(flops), "copy_bandwidth": bw,
                              "op_latency": op,
                              "gloo_latency": latency, "gloo_bandwidth": link_bw})
