"""Memory checks before large allocations: say what is needed, what there is, and what fits.

``generate`` allocates every rank's KV caches (on a simulated mesh all ranks live in this
process) for the prompt plus ``max_new_tokens``. A model without ``max_position_embeddings``
asked for ``max_new_tokens=10**9`` would otherwise try to allocate hundreds of GB and die of an
allocation error or the OOM killer. :func:`check_kv_cache_fits` compares the caches' bytes with
the memory at hand first::

    check_kv_cache_fits(pm, prefill, ranks, capacity, capacity_of, max_new_tokens)
    -> ValueError: ParallelModule.generate: the KV caches ... need 256 GB in this process
       but 7.6 GB is available (cpu: MemAvailable); the largest max_new_tokens that fits is ...
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch

__all__ = ["available_bytes", "check_kv_cache_fits"]

_WHERE = "ParallelModule.generate"


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """``(bytes, where the figure comes from)`` of memory free for new tensors on ``device``:
    CUDA's free device memory, the CPU's available RAM (``MemAvailable`` of /proc/meminfo, else
    the free pages of ``os.sysconf``); None where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "torch.cuda.mem_get_info"
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "free pages (os.sysconf)")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def check_kv_cache_fits(pm, prefill, ranks, capacity: int, capacity_of: Callable[[int], int],
                        max_new_tokens: int) -> None:
    """A ValueError before the caches are allocated when the KV caches of ``ranks`` (those this
    process holds) for ``capacity`` positions exceed the memory available on the mesh's device,
    naming the size, what is available and the largest ``max_new_tokens`` that fits
    (``capacity_of(n)``: the capacity ``n`` new tokens need; the bytes grow with it)."""
    need = 0
    for rank in ranks:
        for _, shape, dtype in prefill.programs[pm.stage_of(rank)].kv_caches:
            need += shape[0] * pm.microbatches * math.prod(shape[1:]) * dtype.itemsize
    device = torch.device(pm.spec.device_type)
    have = available_bytes(device)
    if have is None or need <= have[0]:
        return
    per_position = need / capacity
    low, high = 0, max_new_tokens   # the largest n with capacity_of(n) * per_position <= have
    while low < high:
        mid = (low + high + 1) // 2
        if capacity_of(mid) * per_position <= have[0]:
            low = mid
        else:
            high = mid - 1
    fits = (f"the largest max_new_tokens that fits is {low}" if low >= 1 else
            "not even max_new_tokens=1 fits: use a shorter prompt, a smaller batch or a mesh "
            "with more ranks")
    held = (f"{len(ranks)} ranks' caches: a simulated mesh holds every rank in this process"
            if len(ranks) > 1 else "this rank's caches")
    raise ValueError(
        f"{_WHERE}: the KV caches for max_new_tokens={max_new_tokens} ({capacity} positions "
        f"per cache, {held}) need {_gb(need)}, but {_gb(have[0])} is available on "
        f"{device.type} ({have[1]}); {fits}")
