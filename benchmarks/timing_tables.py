"""The benchmarks' timing and reports: :func:`time_calls`, :func:`stats_ms` (median, p10, p90),
:func:`interleaved` (variants alternated round by round, so a burst of other load hits all of
them alike), :func:`rotated`, :func:`slowest_rank`, :func:`format_table` (fixed-width text
tables), :func:`write_json`, and a report's header (:func:`environment`, :func:`reproduce`).
Scripts import them through :mod:`benchmarks.common`.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["now", "time_calls", "percentile", "stats_ms", "slowest_rank", "write_json",
           "rotated", "interleaved", "format_table", "cpu_model", "environment", "reproduce"]


def now() -> tuple[float, float]:
    """(wall, this thread's CPU time) in seconds."""
    return time.perf_counter(), time.thread_time()


def time_calls(fn, n: int, cpu: list | None = None,
               proc: list | None = None) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``fn``; with a list ``cpu``, also appends each
    call's CPU seconds on this thread (compute + Python + dispatch; not the time spent blocked
    on a peer, nor gloo's own threads); with a list ``proc``, each call's CPU seconds of the
    whole process (every thread: gloo's spinning waits included)."""
    out = []
    for _ in range(n):
        p0 = time.process_time()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
        if proc is not None:
            proc.append(time.process_time() - p0)
    return out


def percentile(xs, q: float) -> float:
    """Linear-interpolated ``q``-quantile (0..1) of ``xs``; NaN when empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(samples_s) -> dict:
    """``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``max_ms`` and ``n`` of samples in
    seconds."""
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms) if ms else float("nan"),
            "p10_ms": percentile(ms, 0.1), "p90_ms": percentile(ms, 0.9),
            "min_ms": min(ms, default=float("nan")), "max_ms": max(ms, default=float("nan")),
            "n": len(ms)}


def slowest_rank(per_rank: list) -> list[float]:
    """Lockstep samples: ``per_rank[r][i]`` is rank r's time for call i (the ranks run the calls
    together); call i's sample is the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def write_json(path, obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder made if missing)."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def rotated(names: list, k: int) -> list:
    """``names`` starting at ``k mod len``: every variant takes every position in turn, so none
    always runs right after the same neighbour (cache and scheduler effects even out)."""
    k %= len(names)
    return names[k:] + names[:k]


def interleaved(variants: dict, rounds: int, *, calls: int = 1, warmup: int = 1,
                order: str = "fixed", before=None, per_call: bool = True) -> dict:
    """Time ``variants`` (name -> callable) interleaved: each round runs a block of ``calls``
    calls of every variant, after ``warmup`` untimed calls each. ``order``: ``"fixed"``,
    ``"alternate"`` (reversed every other round) or ``"rotate"`` (:func:`rotated`).
    ``before()`` runs before each block (e.g. ``dist.barrier``). Returns name ->
    ``{"wall": [...], "cpu": [...], "proc": [...]}`` in seconds (``cpu``: this thread's,
    ``proc``: the whole process's, see :func:`time_calls`): every call's (``per_call``) or
    each block's mean per call."""
    for fn in variants.values():
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    out = {name: {"wall": [], "cpu": [], "proc": []} for name in variants}
    names = list(variants)
    for rnd in range(rounds):
        seq = {"fixed": names, "alternate": names if rnd % 2 == 0 else names[::-1],
               "rotate": rotated(names, rnd)}[order]
        for name in seq:
            if before is not None:
                before()
            cpu: list = []
            proc: list = []
            wall = time_calls(variants[name], calls, cpu, proc)
            for key, xs in (("wall", wall), ("cpu", cpu), ("proc", proc)):
                if per_call:
                    out[name][key] += xs
                else:
                    out[name][key].append(sum(xs) / calls)
    return out


def format_table(columns, rows) -> str:
    """A fixed-width text table. ``columns``: ``(title, spec)`` pairs, ``spec`` a format spec
    with a width (``"<31"``, ``">9.3f"``); ``rows``: sequences of values, one per column (None
    prints as a right-aligned ``-``, a str as is, aligned like the column). Columns are joined
    by one space; titles are aligned like their column."""
    def width(spec):
        digits = "".join(c if c.isdigit() else " " for c in spec.split(".")[0]).split()
        return int(digits[0]) if digits else 0

    def align(spec):
        return "<" if spec.startswith("<") else ">"

    def cell(value, spec):
        if value is None:
            return "-".rjust(width(spec))
        if isinstance(value, str):
            return format(value, f"{align(spec)}{width(spec)}")
        return format(value, spec)

    lines = [" ".join(format(t, f"{align(s)}{width(s)}") for t, s in columns)]
    lines += [" ".join(cell(v, s) for v, (_, s) in zip(row, columns)).rstrip() for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(**extra) -> dict:
    """Date (UTC), versions, CPUs and the 1-minute load average, for a report's header."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": cpu_model(),
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], **extra}


def reproduce(script: str) -> str:
    """The command line that reran this script with these flags."""
    return " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])
