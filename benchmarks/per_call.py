"""Per-call cost on small steps: fxshard vs hand-written Megatron vs DTensor on the seed lesson's
TransformerBlocks, tp=2 on real ranks, eager (issue 22, item 7: median <= 1.05 of Megatron).

    python benchmarks/per_call.py --runs 5                   # the target: median of 5 launches
    python benchmarks/per_call.py                            # 8 blocks, hidden 256, batch 4, seq 16
    python benchmarks/per_call.py --hidden 512 --rounds 40
    python benchmarks/per_call.py --layers 1 --hidden 64 --rounds 1 --iters 1   # does it run?

One launch of 2 processes (``benchmarks/common.launch``: spawn, gloo, fp32, CPU, ``--threads``
torch threads each, default 1). Both build the same ``--layers`` blocks of ``tests/models.py``'s
``TransformerBlock`` (``common.tutorial_blocks``: q + k + v then wo, a GELU MLP, all with
biases) and the same input ``[--batch, --seq, --hidden]``. Variants:

  megatron   ``common.MegatronBlocks``: column-parallel wq/wk/wv/w1 and row-parallel wo/w2 on
             weight slices, an in-place ``dist.all_reduce`` after each row-parallel matmul, the
             row-parallel biases added after it (two all-reduces a block). The baseline (1.00).
  fxshard    ``fxshard.parallelize(model, mesh, example_inputs=(x,))`` called as ``pm(x)``
             (the ParallelModule wrapper and its per-call checks included).
  dtensor    ``parallelize_module`` with the lesson's plan (``common.dtensor_tp``:
             ColwiseParallel wq/wk/wv/w1, RowwiseParallel wo/w2) on a copy of the model.

Every variant's output is checked against the single-device model first (``max |err|``). Then
``--rounds`` rounds of ``--iters`` forwards each, variants interleaved round by round (``--order
rotate``, the default: each round starts one variant later, so none always runs right after the
same neighbour), a barrier before each block, under ``torch.no_grad()``, after ``--warmup``. A sample is the slower rank's
wall time for that forward. Columns: ``median ms`` / ``p10`` / ``p90`` over all samples, ``vs
megatron`` (ratio of the medians), ``rounds p10 / med / p90`` (the spread of the per-round
ratio: that round's median over Megatron's median of the same round), ``CPU ms`` (median
thread CPU time of rank 0's main thread per forward: compute, Python and dispatch, not the time
blocked on the peer), ``process CPU ms by rank`` (median CPU time of each rank's whole
process per forward: every thread, gloo's own included; on a machine with as many cores as
ranks this is what the ranks take from each other). ``--profile N``: afterwards, N calls each of fxshard and Megatron under
cProfile (CPU time) on rank 0, in alternating blocks of 10: Python calls and CPU per call, the
top entries by own time.
``--runs N``: N launches one after another (fresh processes), a table each, then fxshard /
Megatron of every run, their median (the target: <= 1.05 over ``--runs 5``), min and max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (MegatronBlocks, add_model_args, dtensor_tp,  # noqa: E402
                               environment, format_table, interleaved, launch, percentile,
                               reproduce, rotated,
                               slowest_rank, stats_ms, tutorial_blocks, write_json)

TP = 2
BASELINE = "megatron"


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    import fxshard
    model = tutorial_blocks(args)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(x,))
    megatron = MegatronBlocks(model, rank, TP)
    dmodel = dtensor_tp(model, mesh)
    variants = {BASELINE: lambda: megatron(x), "fxshard": lambda: pm(x),
                "dtensor": lambda: dmodel(x)}
    with torch.no_grad():
        want = model(x)
        errors = {name: (fn() - want).abs().max().item() for name, fn in variants.items()}
        t = interleaved(variants, args.rounds, calls=args.iters, warmup=args.warmup,
                        order=args.order, before=dist.barrier)
        profiles = profile_calls({name: variants[name] for name in ("fxshard", BASELINE)},
                                 args.profile, rank == 0, args.profile_top) \
            if args.profile else {}
    pm.close()
    n = args.iters
    return {"rounds": {k: [v["wall"][i:i + n] for i in range(0, len(v["wall"]), n)]
                       for k, v in t.items()},
            "cpu": {k: v["cpu"] for k, v in t.items()},
            "proc": {k: v["proc"] for k, v in t.items()}, "errors": errors,
            "profiles": profiles}


def profile_calls(fns: dict, calls: int, profiled: bool, top: int,
                  block: int = 10) -> dict:
    """``calls`` calls of each of ``fns`` (name -> callable) after a barrier, in alternating
    blocks of ``block`` calls (so a burst of other load, or the cache state one leaves for the
    next, hits them alike: profiling one after the other once showed a +8 % "linear" cost
    that reversed when the order did), each under its own cProfile where ``profiled`` (rank
    0; the other ranks make the same calls unprofiled, so the collectives pair up): name ->
    the Python calls and CPU time per call, and the top ``top`` entries by own time."""
    import cProfile
    import io
    import pstats
    profs = {name: cProfile.Profile(time.thread_time) for name in fns}  # CPU: waits don't count
    names = list(fns)
    for i in range(0, calls, block):
        for name in rotated(names, i // block):
            dist.barrier()
            if profiled:
                profs[name].enable()
            for _ in range(min(block, calls - i)):
                fns[name]()
            if profiled:
                profs[name].disable()
    if not profiled:
        return {}
    out = {}
    for name, prof in profs.items():
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        print(f"{stats.total_calls / calls:.0f} Python function calls and "
              f"{stats.total_tt / calls * 1e6:.0f} us CPU per call (profiled, {calls} calls "
              f"in blocks of {block}, alternating)", file=text)
        stats.sort_stats("tottime").print_stats(top)
        out[name] = text.getvalue()
    return out


def summarize(gathered: list, args) -> dict:
    """One launch's figures by variant: the samples' stats (a sample: the slower rank's time
    for that forward), rank 0's CPU, the max error, and the per-round ratios to Megatron."""
    per_round = {name: [slowest_rank([g["rounds"][name][r] for g in gathered])
                        for r in range(args.rounds)] for name in gathered[0]["rounds"]}
    results = {}
    for name, rounds in per_round.items():
        r = results[name] = stats_ms([t for rnd in rounds for t in rnd])
        r["cpu_ms_rank0"] = statistics.median(gathered[0]["cpu"][name]) * 1e3
        r["proc_cpu_ms_by_rank"] = [statistics.median(g["proc"][name]) * 1e3 for g in gathered]
        r["max_abs_err"] = max(g["errors"][name] for g in gathered)
        r["round_ratios"] = [statistics.median(a) / statistics.median(b)
                             for a, b in zip(rounds, per_round[BASELINE])]
        q = r["round_ratios"]
        r["round_ratio_p10_median_p90"] = [percentile(q, 0.1), statistics.median(q),
                                           percentile(q, 0.9)]
    base = results[BASELINE]["median_ms"]
    for r in results.values():
        r["vs_megatron"] = r["median_ms"] / base
    return results


def table(results: dict) -> str:
    rows = [[name, r["median_ms"], r["p10_ms"], r["p90_ms"], r["vs_megatron"],
             " / ".join(f"{v:.2f}" for v in r["round_ratio_p10_median_p90"]),
             r["cpu_ms_rank0"], " / ".join(f"{v:.2f}" for v in r["proc_cpu_ms_by_rank"]),
             r["max_abs_err"]] for name, r in results.items()]
    return format_table([("variant", "<9"), ("median ms", ">9.3f"), ("p10", ">7.3f"),
                         ("p90", ">7.3f"), ("vs megatron", ">11.3f"),
                         ("rounds p10 / med / p90", ">22"), ("CPU ms", ">7.3f"),
                         ("process CPU ms by rank", ">22"), ("max |err|", ">9.2e")], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, hidden=256, heads=8, layers=8, batch=4, seq=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10, help="forwards per variant per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=1,
                    help="launches, one after another (fresh processes each): the target is "
                         "the median over them of fxshard / megatron (--runs 5)")
    ap.add_argument("--order", choices=("rotate", "fixed", "alternate"), default="rotate",
                    help="variant order within a round (benchmarks.common.interleaved; "
                         "rotate: every variant takes every position in turn)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="after the timing, profile CALLS calls of fxshard and of megatron on "
                         "rank 0 (cProfile, CPU time) and print the top entries")
    ap.add_argument("--profile-top", type=int, default=25, help="entries printed per profile")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "per_call.json"))
    args = ap.parse_args()
    env = environment(ranks=TP, backend="gloo", dtype="float32")
    print(__doc__.split("\n\n")[0])
    print()
    print(f"{env['date']}; torch {env['torch']}; {env['cpus']} CPUs ({env['processor']}); "
          f"{TP} ranks, gloo, {args.threads} thread(s) per rank, fp32; load average (1 min) "
          f"{env['load_avg_1m']:.2f} before")
    print(f"{args.layers} TransformerBlocks, hidden {args.hidden}, {args.heads} heads; batch "
          f"{args.batch}, seq {args.seq}; {args.runs} run(s) of {args.rounds} rounds x "
          f"{args.iters} forwards per variant ({args.order} order) after {args.warmup} warm-up")
    print("reproduce: " + reproduce("per_call.py"))
    runs, profiles = [], {}
    for i in range(args.runs):
        gathered = launch(worker, TP, args, threads=args.threads)
        runs.append(summarize(gathered, args))
        profiles = gathered[0]["profiles"] or profiles
        print(f"\nrun {i + 1} of {args.runs} (load average {os.getloadavg()[0]:.2f} after):")
        print(table(runs[-1]))
    ratios = [r["fxshard"]["vs_megatron"] for r in runs]
    per_round = [r["fxshard"]["round_ratio_p10_median_p90"][1] for r in runs]
    ratio = statistics.median(ratios)
    print(f"\nfxshard / megatron, median of each run's samples, over {len(runs)} run(s): "
          + ", ".join(f"{x:.3f}" for x in ratios))
    print(f"  median {ratio:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; per-round "
          f"medians: {', '.join(f'{x:.3f}' for x in per_round)} (median "
          f"{statistics.median(per_round):.3f})")
    print(f"target: median fxshard / megatron <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}"
          f" ({ratio:.3f})")
    for name, text in profiles.items():
        print(f"\nprofile of rank 0, {name}:\n{text}")
    bad = sorted({n for r in runs for n, v in r.items() if not v["max_abs_err"] < 1e-4})
    if bad:
        print(f"CORRECTNESS: max abs error >= 1e-4 for: {', '.join(bad)}")
    write_json(args.json, {"env": env, "args": vars(args), "runs": runs,
                           "fxshard_vs_megatron": {"runs": ratios, "median": ratio,
                                                   "per_round_medians": per_round},
                           "correctness_failures": bad})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
