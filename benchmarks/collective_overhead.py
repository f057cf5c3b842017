"""Per-call cost of one collective on real ranks: fxshard's paths vs plain ``torch.distributed``.

Issue 9 asks why fxshard's eager runner costs rank 0 0.5-0.8 ms more thread CPU per forward
than hand-written Megatron on gloo (``runtime_tp.py``) but not on the loopback
(``eager_overhead.py``). This isolates the six collectives of that forward:

    python benchmarks/collective_overhead.py                    # ~1 minute on 2 cores
    python benchmarks/collective_overhead.py --rounds 40 --calls 25

Two processes (``benchmarks/common.launch``: spawn, gloo, tp=2 mesh from
``fxshard.init_device_mesh``, one torch thread each), same tensor sizes as ``runtime_tp.py``'s
defaults: the hidden ``[2, 64, 256]`` (all-reduce after o_proj / down_proj), the embedding shard
``[2, 64, 128]`` and the logits shard ``[2, 64, 256]`` (all-gathers on the last dim). Variants:

  dist world        ``dist.all_reduce(t)`` / ``dist.all_gather(parts, t)`` + ``cat`` on the
                    default group: exactly what ``common.MegatronLlama`` calls.
  dist mesh group   the same calls on ``device_mesh.get_group("tp")``, the group fxshard uses.
  fxshard consuming ``fxshard.ops.collectives.all_reduce_consuming`` (what the eager runner calls
                    for an all-reduce of a dead input: in place, no dispatcher).
  fxshard op        ``torch.ops.fxshard.all_reduce`` / ``all_gather`` (dispatcher, a copy for
                    the all-reduce): what a GraphModule called directly runs.
  fxshard kernel    the all-gather's Python kernel without the dispatcher
                    (``fxshard.ops.library.direct_kernel``): what the eager runner calls.
  into_tensor       all-gather as ``dist.all_gather_into_tensor`` on dim 0 + ``movedim`` /
                    ``reshape`` copy to the last dim (one collective output buffer, no list).

Timing: variants interleaved call by call in every round, their order rotated each time
(A B C, B C A, C A B, ...), so a slow spell of the loaded machine hits all of them alike.
Each call's input is made before the clock starts (Megatron's is a fresh matmul output). By
default a ``dist.barrier`` precedes every timed call, so that both ranks arrive together and
the peer's compute skew is equal for all variants; ``--no-sync`` times back-to-back calls.
The table gives, for rank 0, median thread CPU us (``time.thread_time``: this thread only,
i.e. the caller's share of the collective: enqueue, wait, wake-up, and any Python around it;
gloo's own threads are not counted) and median wall us, over ``rounds x calls`` samples,
plus the ratio to "dist world". Skew probes repeat "dist world" with rank 1 busy for each of
``--skew-us`` before the call: if rank 0's thread CPU rises with the skew, the caller's wait
burns CPU and CPU time measures skew, not overhead. The "no-op us" column is
each path's rank-local CPU with ``dist.all_reduce`` / ``dist.all_gather`` replaced by no-ops:
its Python and dispatch cost alone.

Then whole forwards (``--forward-rounds``; runtime_tp's default model, ``common.RUNTIME_TP`` at
``--hidden`` / ``--vocab``, batch 2, seq 64): Megatron (``common.MegatronLlama``), ``pm(ids)``
and ``run_rank`` (pm without its ``ParallelModule.__call__`` wrapper), interleaved and rotated
like the calls, with ``dist.all_reduce`` / ``dist.all_gather`` wrapped so that rank 0's thread
CPU per forward splits into "in coll." (inside those calls: gloo's enqueue, the wait, the
wake-up) and "outside" (compute and Python, fxshard's backend code included), each forward's
logits checked against the single-device model first.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (RUNTIME_TP, MegatronLlama, add_model_args,  # noqa: E402
                               bundled_llama, launch, rotated, token_ids)

TP = 2


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _cases(group, hidden, embed, logits):
    """name -> (make_input, call): make_input runs before the clock, call is timed."""
    from fxshard.ops.collectives import all_reduce_consuming
    from fxshard.ops.library import direct_kernel

    gather_kernel = direct_kernel(torch.ops.fxshard.all_gather.default)

    def gather_list(g):
        def call(t):
            parts = [torch.empty_like(t) for _ in range(TP)]
            dist.all_gather(parts, t, group=g)
            return torch.cat(parts, -1)
        return call

    def gather_into(t):
        out = t.new_empty((TP * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=group)
        return out.view(TP, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], -1)

    def fresh(x):
        return lambda: x.clone()

    def world_ar(t):
        dist.all_reduce(t)

    def mesh_ar(t):
        dist.all_reduce(t, group=group)

    h = f"all_reduce {list(hidden.shape)}"
    cases = {
        f"{h} dist world": (fresh(hidden), world_ar),
        f"{h} dist mesh group": (fresh(hidden), mesh_ar),
        f"{h} fxshard consuming": (fresh(hidden), lambda t: all_reduce_consuming(t, "tp", TP)),
        f"{h} fxshard op (copy)": (lambda: hidden, lambda t: torch.ops.fxshard.all_reduce(
            t, "tp", TP)),
    }
    for x in (embed, logits):
        g = f"all_gather {list(x.shape)}"
        cases.update({
            f"{g} dist world": (lambda x=x: x, gather_list(None)),
            f"{g} dist mesh group": (lambda x=x: x, gather_list(group)),
            f"{g} fxshard op": (lambda x=x: x, lambda t: torch.ops.fxshard.all_gather(
                t, 2, "tp", TP)),
            f"{g} fxshard kernel": (lambda x=x: x, lambda t: gather_kernel(t, 2, "tp", TP)),
            f"{g} into_tensor mesh": (lambda x=x: x, gather_into),
        })
    return cases


def _run(rank: int, args) -> dict:
    import fxshard
    from fxshard.runtime import backend_for, use_backend

    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    backend = backend_for(mesh)
    group = mesh.get_group("tp")
    world = dist.group.WORLD
    info = {"mesh group is WORLD": group is world,
            "mesh group name": group.group_name, "world group name": world.group_name,
            "mesh group ranks": dist.get_process_group_ranks(group)}
    g = torch.Generator().manual_seed(rank)
    b, s, hid, voc = args.batch, args.seq, args.hidden, args.vocab
    hidden = torch.randn(b, s, hid, generator=g)
    embed = torch.randn(b, s, hid // TP, generator=g)
    logits = torch.randn(b, s, voc // TP, generator=g)
    cases = _cases(group, hidden, embed, logits)
    base = f"all_reduce {list(hidden.shape)} dist world"
    skews = {f"{base}, rank 1 {us:g} us late": us for us in args.skew_us}
    for name in skews:
        cases[name] = cases[base]
    cpu = {n: [] for n in cases}
    wall = {n: [] for n in cases}
    with use_backend(backend), torch.no_grad():
        for rnd in range(args.rounds + 1):  # round 0 is warm-up
            for i in range(args.calls):
                for name in rotated(list(cases), rnd * args.calls + i):
                    make, call = cases[name]
                    t = make()
                    if args.sync:
                        dist.barrier()
                    if name in skews and rank == 1:
                        _busy(skews[name])
                    c0, w0 = time.thread_time(), time.perf_counter()
                    call(t)
                    w1, c1 = time.perf_counter(), time.thread_time()
                    if rnd:
                        cpu[name].append((c1 - c0) * 1e6)
                        wall[name].append((w1 - w0) * 1e6)
        stub = _python_only(cases, skews, args)
        fwd = _forwards(rank, mesh, args) if args.forward_rounds else {}
    return {"info": info, "cpu": cpu, "wall": wall, "stub": stub, "forward": fwd}


def _forwards(rank: int, mesh, args) -> dict:
    """runtime_tp's Megatron and ``pm(ids)``, interleaved forward by forward, with this
    thread's CPU split into "inside ``dist.all_reduce`` / ``dist.all_gather``" (the caller's
    share of each collective: enqueue, wait, wake-up) and the rest (compute, Python)."""
    import fxshard

    model = bundled_llama(argparse.Namespace(**dict(RUNTIME_TP, hidden=args.hidden,
                                                    vocab=args.vocab)))
    cfg = model.config
    ids = token_ids(cfg.vocab_size, args.batch, args.seq)
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    megatron = MegatronLlama(model, rank, TP)
    inside = [0.0, 0.0, 0]
    real = dist.all_reduce, dist.all_gather

    def timed(fn):
        def call(*a, **k):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.thread_time() - c0
                inside[1] += time.perf_counter() - w0
                inside[2] += 1
        return call

    c, micro = pm.programs.get((ids,), {})
    variants = {"megatron": lambda: megatron(ids), "fxshard pm(ids)": lambda: pm(ids),
                "fxshard run_rank (no pm wrapper)": lambda: pm.executor.run_rank(c, rank, micro)[0]}
    ref = model(ids)
    rows = {n: {"cpu": [], "in_cpu": [], "wall": [], "in_wall": [], "calls": 0}
            for n in variants}
    dist.all_reduce, dist.all_gather = timed(real[0]), timed(real[1])
    try:
        for name, fn in variants.items():
            err = (fn().float() - ref).abs().max().item()
            assert err < 1e-4, (name, err)
        for rnd in range(args.forward_rounds + 1):
            for i in range(args.calls):
                for name in rotated(list(variants), rnd * args.calls + i):
                    fn = variants[name]
                    if args.sync:
                        dist.barrier()
                    inside[:] = [0.0, 0.0, 0]
                    c0, w0 = time.thread_time(), time.perf_counter()
                    fn()
                    w1, c1 = time.perf_counter(), time.thread_time()
                    if rnd:
                        r = rows[name]
                        r["cpu"].append((c1 - c0) * 1e3)
                        r["wall"].append((w1 - w0) * 1e3)
                        r["in_cpu"].append(inside[0] * 1e3)
                        r["in_wall"].append(inside[1] * 1e3)
                        r["calls"] = inside[2]
    finally:
        dist.all_reduce, dist.all_gather = real
    return {n: {"cpu": statistics.median(r["cpu"]), "in_cpu": statistics.median(r["in_cpu"]),
                "out_cpu": statistics.median([a - b for a, b in zip(r["cpu"], r["in_cpu"])]),
                "wall": statistics.median(r["wall"]), "in_wall": statistics.median(r["in_wall"]),
                "calls": r["calls"], "n": len(r["cpu"])} for n, r in rows.items()}


def _python_only(cases, skip, args) -> dict:
    """Rank-local CPU us per call with ``dist.all_reduce`` / ``dist.all_gather`` replaced by
    no-ops: the Python + dispatch cost of each path around the collective, nothing else."""
    real = dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor
    dist.all_reduce = dist.all_gather = dist.all_gather_into_tensor = lambda *a, **k: None
    out = {n: [] for n in cases if n not in skip}
    try:
        for _ in range(args.rounds):
            for _ in range(args.calls):
                for name in out:
                    make, call = cases[name]
                    t = make()
                    c0 = time.thread_time()
                    call(t)
                    out[name].append((time.thread_time() - c0) * 1e6)
    finally:
        dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = real
    return {n: statistics.median(v) for n, v in out.items()}


def worker(rank: int, args) -> dict | None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    res = _run(rank, args)
    return res if rank == 0 else None


def format_table(res: dict) -> str:
    cpu, wall = res["cpu"], res["wall"]
    lines = []
    base = None
    for name in cpu:
        if name.endswith("dist world"):
            base = (statistics.median(cpu[name]), statistics.median(wall[name]))
        elif ", rank 1 " in name:  # the skew probe: against its no-skew twin
            twin = name.split(", rank 1 ")[0]
            base = (statistics.median(cpu[twin]), statistics.median(wall[twin]))
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        stub = res["stub"].get(name)
        stub = f"{stub:9.1f}" if stub is not None else f"{'-':>9}"
        lines.append(f"{name:<58} {c:8.1f} {c / base[0]:6.2f} {w:9.1f} {w / base[1]:6.2f} "
                     f"{stub}")
    head = f"{'rank 0, per call (median of ' + str(len(next(iter(cpu.values())))) + ')':<58} " \
           f"{'CPU us':>8} {'ratio':>6} {'wall us':>9} {'ratio':>6} {'no-op us':>9}"
    fwd = res["forward"]
    if fwd:
        base = fwd["megatron"]
        lines += ["", f"{'rank 0, per forward (median of ' + str(base['n']) + ')':<33} "
                  f"{'CPU ms':>7} {'ratio':>6} {'in coll.':>9} {'outside':>8} {'ratio':>6} "
                  f"{'calls':>5} {'wall ms':>8} {'in coll.':>9}"]
        for name, r in fwd.items():
            lines.append(f"{name:<33} {r['cpu']:7.3f} {r['cpu'] / base['cpu']:6.3f} "
                         f"{r['in_cpu']:9.3f} {r['out_cpu']:8.3f} "
                         f"{r['out_cpu'] / base['out_cpu']:6.3f} {r['calls']:5d} "
                         f"{r['wall']:8.3f} {r['in_wall']:9.3f}")
    return "\n".join([head, *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, hidden=RUNTIME_TP["hidden"], vocab=RUNTIME_TP["vocab"], batch=2, seq=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10, help="calls per variant per round")
    ap.add_argument("--skew-us", type=float, nargs="*", default=[1000.0, 4000.0],
                    help="skew probes: rank 1 busy this long before a 'dist world' all-reduce")
    ap.add_argument("--forward-rounds", type=int, default=10,
                    help="rounds of whole forwards (runtime_tp's model; 0 skips them)")
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="no barrier before each timed call")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    res = launch(worker, TP, args, threads=1, timeout_s=300)[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__} python "
          f"{platform.python_version()} gloo tp={TP}, sync={args.sync}, load avg {load:.1f}")
    print("; ".join(f"{k}: {v}" for k, v in res["info"].items()))
    print(format_table(res))


if __name__ == "__main__":
    main()
