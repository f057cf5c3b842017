"""Runtime of fxshard's per-rank programs vs hand-written Megatron and DTensor, on real ranks.

DESIGN target (section 4): "the per-rank GraphModules add nothing over hand-written Megatron
code (ratio <= 1.05 on the same machine, same run) and beat DTensor parallelize_module eager".

    python benchmarks/runtime_tp.py                          # defaults, ~1-2 minutes on 2 cores
    python benchmarks/runtime_tp.py --iters 200 --rounds 5 --json /tmp/runtime_tp.json
    python benchmarks/runtime_tp.py --layers 4 --seq 128     # a bigger model
    python benchmarks/runtime_tp.py --no-compile --profile "megatron,fxshard pm(ids)"  # cProfile

One launch of 2 processes (``benchmarks/common.launch``: spawn, gloo, rendezvous on a free
127.0.0.1 port held by the launcher's TCPStore), tp=2, fp32 on CPU,
``torch.set_num_threads(--threads)`` per process, default 1 so that 2 processes fit 2 cores)
runs every variant, so all of them share the machine state of one run. Both processes build the
same ``fxshard.models.llama.LlamaForCausalLM`` (same seed) and the same input ids. Variants:

  single-device      the unmodified model in one process (rank 0 alone; rank 1 waits at a
                     barrier). Context only: what tp=2 buys at this size.
  megatron           the same Llama hand-written for tp=2 (``common.MegatronLlama``, the
                     baseline every benchmark shares): column-parallel q/k/v/gate/up on
                     local weight slices, row-parallel o/down followed by an in-place
                     ``dist.all_reduce``, embedding sharded on the embedding dim +
                     ``dist.all_gather``, lm_head column-parallel + ``dist.all_gather`` of the
                     logits (the collectives fxshard emits), ``F.scaled_dot_product_attention``.
                     The baseline (ratio 1.00).
  megatron+funcol    diagnostic: the same code with torch's functional collectives
                     (``funcol.all_reduce(...).wait()``, ``funcol.all_gather_tensor``), which
                     fxshard's DistributedBackend uses, instead of in-place ``dist.*`` calls.
  fxshard pm(ids)    ``fxshard.parallelize(model, mesh, example_inputs=(ids,))`` called as
                     ``pm(ids)`` (ParallelModule wrapper included; each rank runs its stage's
                     eager runner, ``fxshard.compile.eager_stage``). The target's row.
  fxshard gm(ids)    diagnostic: the readable GraphModule ``pm.rank_module(rank)`` called
                     directly inside ``use_backend(backend_for(mesh))`` (weights read through
                     module attributes every call, copying all-reduces).
  fxshard gm+sdpa    diagnostic: a copy of that GraphModule whose ``fxshard.attention`` nodes
                     call ``F.scaled_dot_product_attention`` instead (patched here, in the
                     benchmark) - separates the attention kernel from the rest of the program.
  fxshard compiled   ``fxshard.parallelize(model, mesh, example_inputs=(ids,), compile=True)``:
                     the rank program compiled by Inductor (``fxshard.compile``), called as
                     ``pm(ids)``.
  fxshard compiled fxattn (diag.)
                     the same without ``fxshard.passes.post_emit.aten_attention_pass`` (patched
                     out here): attention stays the ``fxshard::attention_out`` custom op inside
                     Inductor instead of aten's CPU flash attention (the code before issue 9's
                     attention lowering; an A/B of that lowering in one run).
  megatron compiled  the hand-written Megatron forward under ``torch.compile`` (Inductor;
                     dynamo traces its ``dist.*`` collectives).
  dtensor            ``torch.distributed.tensor.parallel.parallelize_module`` on a copy of the
                     model (``common.dtensor_tp``: ColwiseParallel q/k/v/gate/up,
                     RowwiseParallel o/down, embedding and lm_head ColwiseParallel with
                     Replicate output), eager.

Every variant's logits are checked against the single-device model (max abs error < 1e-4).
Each variant is timed in ``--rounds`` rounds of ``--iters`` forward passes (after
``--warmup``), variants interleaved round by round, a barrier before each variant block, under
``torch.no_grad()``. A sample is the slower of the two ranks' wall times for that forward. The
table gives median / p10 / p90 in ms, the median's ratio to megatron (the target's number),
the p10's ratio (less sensitive to other load on the machine), and the median CPU time of rank
0's thread per forward (``time.thread_time``: compute, Python and dispatch, not the time
blocked on the peer; gloo's own threads are not counted) with its ratio. Micro-benchmarks
explain the gaps: one collective through ``dist.*``, ``funcol`` and ``torch.ops.fxshard.*``
(wall and thread CPU time), and ``fxshard.attention`` (the op fxshard lowers SDPA to) vs SDPA
on one rank's shapes (both in ``benchmarks/runtime_tp_diagnostics.py``).
Compile cost: seconds from the call to the first output (tracing, passes, Inductor, both ranks
waiting for each other) for fxshard eager and compiled, Megatron under ``torch.compile`` and
``torch.compile`` of the unsharded model (rank 0 alone). ``--no-compile`` skips the compiled
variants; ``--only "fxshard compiled,megatron compiled"`` times only those variants (and the
baseline), e.g. to run the compiled rows for more rounds on a shared machine.
Numbers and environment go to ``--json`` (default ``benchmarks/runtime_tp.json``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (RUNTIME_TP, MegatronLlama, add_model_args,  # noqa: E402
                               bundled_llama, dtensor_tp, environment, format_table as table,
                               launch, reproduce, slowest_rank, stats_ms, time_calls,
                               token_ids, write_json)
from benchmarks.runtime_tp_diagnostics import (micro_attention, micro_collectives,  # noqa: E402
                                               with_sdpa)

TOL = 1e-4
TP = 2
BASELINE = "megatron"
DIAG_ATTENTION = "fxshard compiled fxattn (diag.)"


# --- the worker ----------------------------------------------------------------------------

def _max_err(a, b) -> float:
    if isinstance(a, (tuple, list)):
        a = a[0]
    return (a.float() - b.float()).abs().max().item()


def _agreed(present: bool) -> bool:
    """True on every rank iff ``present`` is True on every rank."""
    flags = [None] * TP
    dist.all_gather_object(flags, present)
    return all(flags)


def _compiled_variants(model, mesh, megatron, ids, rank, variants, compile_s, wanted):
    import fxshard
    from fxshard.passes import post_emit  # the diagnostic variant drops a post-emit pass
    dist.barrier()
    t0 = time.perf_counter()
    pm_c = fxshard.parallelize(model, mesh, example_inputs=(ids,), compile=True)
    pm_c(ids)
    compile_s["fxshard compiled (parallelize + Inductor + first forward)"] = \
        time.perf_counter() - t0
    if wanted(DIAG_ATTENTION):
        without = [p for p in post_emit.INDUCTOR if p is not post_emit.aten_attention_pass]
        with mock.patch.object(post_emit, "INDUCTOR", without):
            pm_c_attn = fxshard.parallelize(model, mesh, example_inputs=(ids,), compile=True)
            pm_c_attn(ids)
        variants[DIAG_ATTENTION] = lambda: pm_c_attn(ids)
    dist.barrier()
    t0 = time.perf_counter()
    megatron_c = torch.compile(megatron.__call__)
    megatron_c(ids)
    compile_s["megatron under torch.compile (first forward)"] = time.perf_counter() - t0
    if rank == 0:
        t0 = time.perf_counter()
        single_c = torch.compile(model)
        single_c(ids)
        compile_s["torch.compile of the unsharded model (first forward)"] = \
            time.perf_counter() - t0
    dist.barrier()
    variants["fxshard compiled"] = lambda: pm_c(ids)
    variants["megatron compiled"] = lambda: megatron_c(ids)


def worker(rank: int, args) -> dict:
    # fxshard's backend calls funcol.all_gather_tensor too; its deprecation note is noise here
    warnings.filterwarnings("ignore", message=".*all_gather_tensor", category=FutureWarning)
    import fxshard
    from fxshard.runtime import backend_for, use_backend

    model = bundled_llama(args)
    cfg = model.config
    ids = token_ids(cfg.vocab_size, args.batch, args.seq)
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))

    t0 = time.perf_counter()
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    gm = pm.rank_module(rank)
    parallelize_s = time.perf_counter() - t0
    backend = backend_for(mesh)
    gm_sdpa, n_patched = with_sdpa(gm)
    megatron = MegatronLlama(model, rank, TP)
    megatron_funcol = MegatronLlama(model, rank, TP, funcol=True)
    notes = {}

    def gm_call(module):
        def call():
            with use_backend(backend):
                return module(ids)
        return call

    def wanted(name: str) -> bool:
        return args.only is None or name == BASELINE or name in args.only

    compile_s = {}
    with torch.no_grad():
        dist.barrier()
        t0 = time.perf_counter()
        pm(ids)
        compile_s["fxshard eager (parallelize + first forward)"] = \
            parallelize_s + time.perf_counter() - t0
    variants = {
        BASELINE: lambda: megatron(ids),
        "megatron+funcol (diag.)": lambda: megatron_funcol(ids),
        "fxshard pm(ids)": lambda: pm(ids),
        "fxshard gm(ids)": gm_call(gm),
        "fxshard gm+sdpa (diag.)": gm_call(gm_sdpa),
    }
    if args.compile:
        with torch.no_grad():
            _compiled_variants(model, mesh, megatron, ids, rank, variants, compile_s, wanted)
    try:
        dmodel = dtensor_tp(model, mesh)
        variants["dtensor"] = lambda: dmodel(ids)
    except Exception as exc:  # noqa: BLE001 - reported, the other variants still run
        notes["dtensor"] = f"parallelize_module failed: {type(exc).__name__}: {exc}"
    if not _agreed("dtensor" in variants):
        variants.pop("dtensor", None)
        notes.setdefault("dtensor", "failed to build on another rank")
    for name in [n for n in variants if not wanted(n)]:
        variants.pop(name)

    with torch.no_grad():
        ref = model(ids)
        errors = {"single-device": 0.0}
        for name, fn in list(variants.items()):
            try:
                errors[name] = _max_err(fn(), ref)
            except Exception as exc:  # noqa: BLE001
                errors[name] = float("nan")
                notes[name] = f"forward failed: {type(exc).__name__}: {exc}"
        # a variant that failed on any rank is dropped on all (its collectives would hang)
        for name in list(variants):
            if not _agreed(errors[name] == errors[name]):
                variants.pop(name)

        for fn in variants.values():
            time_calls(fn, args.warmup)
        if rank == 0:
            time_calls(lambda: model(ids), args.warmup)

        samples = {name: [] for name in ["single-device", *variants]}
        cpu = {name: [] for name in samples}
        for _ in range(args.rounds):
            dist.barrier()
            if rank == 0:  # rank 1 waits at the next barrier
                samples["single-device"] += time_calls(lambda: model(ids), args.iters,
                                                       cpu["single-device"])
            for name, fn in variants.items():
                dist.barrier()
                samples[name] += time_calls(fn, args.iters, cpu[name])
        if args.profile:
            _profile(variants, rank, args.profile)
        dist.barrier()
        micro_c = micro_collectives(backend, (args.batch, args.seq, cfg.hidden_size),
                                    (args.batch, args.seq, cfg.vocab_size // TP),
                                    args.micro_iters, tp=TP)
        micro_a = micro_attention(cfg, args.batch, args.seq, args.micro_iters, tp=TP) \
            if rank == 0 else {}
    model_sizes = {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim")}
    return {"samples": samples, "cpu": cpu, "errors": errors, "notes": notes,
            "micro_c": micro_c, "micro_a": micro_a, "compile_s": compile_s,
            "parallelize_s": parallelize_s, "n_patched": n_patched,
            "threads": torch.get_num_threads(), "model": model_sizes,
            "collectives": "\n".join(line for line in str(pm.explain()).splitlines()
                                     if line.strip().startswith(("all_", "reduce_")))}


def _profile(variants: dict, rank: int, names: list) -> None:
    """cProfile of rank 0 over 100 forwards of each variant in ``names`` (rank 1 runs them
    unprofiled: the collectives need it), top functions by own time."""
    import cProfile
    import pstats
    for name in names:
        dist.barrier()
        prof = cProfile.Profile() if rank == 0 else None
        if prof:
            prof.enable()
        for _ in range(100):
            variants[name]()
        if prof:
            prof.disable()
            print(f"--- cProfile, rank 0, 100 forwards of {name!r}, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


# --- the report ----------------------------------------------------------------------------

def summarize(gathered: list) -> dict:
    """Per variant: a sample = the slower rank's time for that forward (they are in lockstep
    anyway); medians, ratios to the baseline, max error over ranks."""
    results = {}
    for name in gathered[0]["samples"]:
        per_rank = [g["samples"][name] for g in gathered]
        step = per_rank[0] if name == "single-device" else slowest_rank(per_rank)
        r = results[name] = stats_ms(step)
        r["rank_medians_ms"] = [statistics.median(ts) * 1e3 if ts else None for ts in per_rank]
        r["cpu_median_ms_per_rank"] = [statistics.median(g["cpu"][name]) * 1e3
                                       if g["cpu"][name] else None for g in gathered]
        r["max_abs_err"] = max(g["errors"].get(name, float("nan")) for g in gathered)
    base = results[BASELINE]
    for r in results.values():
        r["ratio_to_megatron"] = r["median_ms"] / base["median_ms"]
        r["p10_ratio_to_megatron"] = r["p10_ms"] / base["p10_ms"]
        r["cpu_ms_rank0"] = r["cpu_median_ms_per_rank"][0]
        r["cpu_ratio_to_megatron"] = r["cpu_ms_rank0"] / base["cpu_median_ms_per_rank"][0]
    for name, e in gathered[0]["errors"].items():
        if name not in results:
            results[name] = {"max_abs_err": e, "skipped": True}
    return results


COLUMNS = [("variant", "<31"), ("median ms", ">9.3f"), ("p10", ">7.3f"), ("p90", ">7.3f"),
           ("vs megatron", ">11.3f"), ("p10 vs meg.", ">11.3f"), ("CPU ms", ">7.3f"),
           ("CPU vs meg.", ">11.3f"), ("max |err|", ">9.2e")]


def format_results(results) -> str:
    rows = []
    for name, r in results.items():
        if r.get("skipped"):
            rows.append([name, "skipped", "", "", "", "", "", "", r["max_abs_err"]])
            continue
        rows.append([name, r["median_ms"], r["p10_ms"], r["p90_ms"], r["ratio_to_megatron"],
                     r["p10_ratio_to_megatron"], r["cpu_ms_rank0"], r["cpu_ratio_to_megatron"],
                     r["max_abs_err"]])
    return table(COLUMNS, rows)


def report(args, gathered: list, env: dict) -> dict:
    g0 = gathered[0]
    results = summarize(gathered)
    notes = dict(g0["notes"])
    for g in gathered[1:]:
        for k, v in g["notes"].items():
            notes.setdefault(k, v)
    config = {"model": g0["model"], "batch": args.batch, "seq": args.seq,
              "warmup": args.warmup, "iters": args.iters, "rounds": args.rounds,
              "micro_iters": args.micro_iters}
    compile_max = {k: max(g["compile_s"][k] for g in gathered if g["compile_s"].get(k))
                   for k in g0["compile_s"]}
    out = {"env": env, "config": config, "parallelize_s": g0["parallelize_s"],
           "seconds_to_first_output": compile_max,
           "attention_nodes_patched_in_diag": g0["n_patched"], "results": results,
           "micro_collectives_rank0": g0["micro_c"],
           "micro_collectives_rank1": gathered[1]["micro_c"],
           "micro_attention_rank0": g0["micro_a"], "notes": notes,
           "target": "fxshard pm(ids) / megatron <= 1.05 and fxshard < dtensor"}

    print(__doc__.split("\n\n")[0])
    print()
    print(f"date {env['date']}; torch {env['torch']}; python {env['python']}; "
          f"{env['cpus']} CPUs ({env['processor']}); {TP} ranks, gloo, {g0['threads']} "
          f"thread(s) per rank, fp32; load average (1 min) {env['load_avg_1m']:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"model: {config['model']}; batch {args.batch}, seq {args.seq}; {args.rounds} rounds "
          f"x {args.iters} forwards per variant after {args.warmup} warm-up; "
          f"fxshard.parallelize took {g0['parallelize_s']:.2f} s")
    print("reproduce: " + reproduce("runtime_tp.py"))
    print()
    print(format_results(results))
    print()
    print("micro-benchmarks on rank 0 (collectives: both ranks in step)")
    print(textwrap.indent(table(
        [("", "<64"), ("median", ">7.3f"), ("p10", ">7.3f"), ("p90", ">7.3f"), ("CPU ms", ">7.3f")],
        [[name, s["median_ms"], s["p10_ms"], s["p90_ms"], s["cpu_median_ms"]]
         for name, s in {**g0["micro_c"], **g0["micro_a"]}.items()]), "  "))
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    print()
    print("collectives per rank (fxshard explain):")
    print(g0["collectives"])
    print()
    print("seconds to first output (slower rank; torch.compile of the unsharded model: rank 0)")
    for k, v in compile_max.items():
        print(f"  {k:<64} {v:7.1f}")
    g = results.get("fxshard pm(ids)", {}).get("ratio_to_megatron")
    d = results.get("dtensor", {}).get("median_ms")
    met_a = g is not None and g <= 1.05
    met_b = d is not None and results["fxshard pm(ids)"]["median_ms"] < d
    if g is not None:
        print(f"target: fxshard pm / megatron = {g:.3f} (<= 1.05: "
              f"{'met' if met_a else 'NOT met'}); "
              f"fxshard < dtensor: {'met' if met_b else 'NOT met' if d else 'n/a'}")
    out["target_met"] = {"ratio_le_1.05": met_a, "beats_dtensor": met_b}
    fc = results.get("fxshard compiled", {}).get("median_ms")
    mc = results.get("megatron compiled", {}).get("median_ms")
    if fc and mc:
        r_eager, r_comp = fc / results[BASELINE]["median_ms"], fc / mc
        print(f"target: fxshard compiled / megatron eager = {r_eager:.3f} (<= 0.9: "
              f"{'met' if r_eager <= 0.9 else 'NOT met'}); fxshard compiled / megatron "
              f"compiled = {r_comp:.3f} (<= 1.05: {'met' if r_comp <= 1.05 else 'NOT met'})")
        out["target_met"].update({"compiled_le_0.9_eager_megatron": r_eager <= 0.9,
                                  "compiled_le_1.05_compiled_megatron": r_comp <= 1.05})
    bad = [n for n, r in results.items() if not r.get("max_abs_err", 0.0) < TOL]
    if bad:
        print(f"CORRECTNESS: max abs error >= {TOL} (or failed) for: {', '.join(bad)}")
    out["correctness_failures"] = bad
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, **RUNTIME_TP, batch=2, seq=64)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=12, help="forwards per variant per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--micro-iters", type=int, default=200,
                    help="calls per micro-benchmark case")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the Inductor variants (fxshard compiled, megatron compiled)")
    ap.add_argument("--only", type=lambda v: [x.strip() for x in v.split(",")], default=None,
                    help="comma-separated variants to time (megatron is always timed)")
    ap.add_argument("--profile", type=lambda v: [x.strip() for x in v.split(",")],
                    default=None, help="comma-separated variants to cProfile on rank 0")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "runtime_tp.json"))
    args = ap.parse_args()
    env = environment(backend="gloo", ranks=TP, dtype="float32")  # load before the run
    gathered = launch(worker, TP, args, threads=args.threads, timeout_s=600)
    env["threads_per_rank"] = gathered[0]["threads"]
    out = report(args, gathered, env)
    write_json(args.json, out)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
