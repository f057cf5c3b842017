"""Training step time and memory per rank: fxshard vs hand-written Megatron vs DTensor TP + FSDP2
(issue 19's targets: step time <= 1.05x Megatron and <= 0.7x DTensor, peak memory <= FSDP2's).

    python benchmarks/train_step.py --ranks 2                        # tp=2, the issue's size
    python benchmarks/train_step.py --ranks 4                        # fsdp=2 x tp=2
    python benchmarks/train_step.py --small                          # does it run? (tiny)
    python benchmarks/train_step.py --small --ranks 4
    python benchmarks/train_step.py --ranks 2 --time-meta             # fxshard-meta timed too
    python benchmarks/train_step.py --ranks 4 --variants fxshard,dtensor   # fits 24 GB
    python benchmarks/train_step.py --ranks 4 --variants fxshard-dp,fxshard --no-memory
                                                                     # dp2 x tp2 vs megatron
    python benchmarks/train_step.py --ranks 4 --variants fxshard-layers,fxshard,dtensor \
        --no-memory                                    # FSDP2's reshard policy vs dtensor
    python benchmarks/train_step.py --ranks 4 --mixed bf16     # bf16 mixed precision: fxshard
        # vs FSDP2 with the same MixedPrecisionPolicy vs Megatron's bf16 + fp32 main params
        # (benchmarks/train_step_mixed.py; the CPU's bf16 flags are printed)

The default size is issue 19's (``common.GENERATE``: 8 layers, hidden 1024, 16/4 heads,
intermediate 2816, vocab 32000; batch 4 x seq 128). One launch of ``--ranks`` processes
(``benchmarks/common.launch``: spawn, gloo, fp32, CPU, ``--threads`` torch threads each) on a
``torch`` device mesh ``(fsdp, tp)`` with ``tp = --tp`` (default 2) and ``fsdp = ranks / tp``.
Every rank builds the same bundled ``fxshard.models.llama`` Llama (``common.bundled_llama``) and
the same batch (``--batch`` sequences of ``--seq`` tokens, labels = the ids shifted by one);
the fsdp ranks each take ``batch / fsdp`` of the sequences, the tp ranks of one fsdp index the
same ones. Variants:

  megatron      ``common.MegatronLlama(trainable=True)`` on the tp group: column/row-parallel
                linears on weight slices, Megatron-LM's f/g all-reduces as autograd
                functions, the embedding's all-gather, a vocab-parallel cross-entropy (the
                logits never gathered); over fsdp the gradients are averaged in one
                flattened all-reduce (plain data parallelism: its parameters and AdamW state
                are not sharded over fsdp). ``torch.optim.AdamW`` on the local slices.
                The baseline (1.00).
  fxshard       ``fxshard.parallelize(model, mesh, example_inputs=(ids,))`` on the same
                ``(fsdp, tp)`` DeviceMesh; a step is the README's: ``F.cross_entropy(pm(ids)
                ...)`` on the global batch (every rank passes it; fxshard splits it over fsdp
                and returns the logits as this rank's ``[B/fsdp, S, V/tp]`` block, on which
                the cross-entropy is vocab-parallel and row-local), ``loss.backward()``,
                ``opt.step()`` of
                ``torch.optim.AdamW(pm.parameters())`` (this rank's shards: sharded over fsdp
                and tp). The ParallelModule keeps the model object (its initial weights,
                whole) as its contract says: that is in its memory.
  fxshard-dp    ``fxshard`` on the same ranks named ``(dp, tp)``: the parallelism of the
                megatron baseline (tp + plain data parallelism: parameters and AdamW state
                replicated over dp, the gradients all-reduced), so ``vs megatron`` compares
                like for like; ``fxshard``'s fsdp shards them and gathers each weight
                twice a step (ZeRO-3), as the dtensor baseline does. With ``--ranks`` = ``--tp``
                (dp = 1) it is ``fxshard`` itself: not in the default set. At the default
                size on 4 ranks it does not fit 24 GB beside ``fxshard-meta`` and ``dtensor``
                (each variant's model lives through the run): launch it with
                ``--variants fxshard-dp,fxshard --no-memory``.
  fxshard-layers  ``fxshard`` with ``fsdp_reshard_after_forward="layers"``: FSDP2's own policy
                in the dtensor baseline (``fully_shard`` of each layer and of the root: the
                root's parameters, the embedding, final norm and head, are not resharded
                after the forward), so ``vs dtensor`` compares the same gathers; ``fxshard``
                gathers every parameter again in the backward (fxshard's default). Built as
                ``fxshard-meta`` is (no whole model object per rank: at the default size on 4
                ranks it fits 24 GB beside ``fxshard`` and ``dtensor``, which a third model
                copy does not). Not in the default set: ``--variants
                fxshard-layers,fxshard,dtensor --no-memory``.
  fxshard-keep  ``fxshard-layers`` with ``fsdp_reshard_after_forward=False``: every weight
                gathered once a step, in the forward, and kept for the backward (FSDP2's
                ``reshard_after_forward=False``; gradients and AdamW state stay sharded):
                ZeRO-2's traffic at the cost of the gathered weights' memory, to be read
                against ``dtensor``'s peak memory. Not in the default set.
  fxshard-loss  the same with the cross-entropy inside the parallelized module (``WithLoss``:
                ``pm(ids, labels)`` returns the loss, as HF's ``labels=``): vocab-parallel on
                tp (max and sum-exp all-reduced), the logits never gathered, as Megatron's.
  fxshard-lossfn  the same cross-entropy passed to fxshard: ``pm.train_step(ids,
                loss_fn=ce, target=labels)`` traces it with the model (``fxshard.training.
                with_loss``), so it is vocab-parallel as ``fxshard-loss``'s, without a
                wrapper module written by the user.
  fxshard-recompute  ``fxshard`` with ``recompute="layers"`` (each decoder layer saves only
                its input; the backward recomputes the rest): recompute on/off in time and
                peak memory against the ``fxshard`` row.
  fxshard-compile  ``fxshard-loss`` with ``compile=True``: the forward and backward rank
                programs compiled by Inductor (C++ on CPU) at the first step; not in the
                default set (``--variants``): Inductor's first compile takes minutes here.
  fxshard-meta  ``fxshard`` built the way a model too big for one device is (README): the model
                under ``fxshard.init_empty_weights()`` (parameters on meta), then
                ``fxshard.load_safetensors(pm, dir)`` from a checkpoint the single-device
                model wrote (``--checkpoint``, a temporary directory by default): each rank
                holds only its shards, no whole initial weights. The same programs as
                ``fxshard``, so it is checked for correctness and measured for memory, not
                timed (``--time-meta`` times it too).
  dtensor       torchtitan's recipe (``common.dtensor_train``): ``parallelize_module`` with
                the one DTensor plan on the tp sub-mesh (lm_head output left vocab-sharded,
                ``loss_parallel``), then ``fully_shard`` (FSDP2) of every decoder layer and
                the root on the fsdp sub-mesh (with fsdp = 1: a size-1 mesh), AdamW.

The variants are built in ``benchmarks/train_step_variants.py``. Every variant steps
``torch.optim.AdamW`` in the ``--optimizer`` implementation, the same for
all (default ``fused``, torchtitan's default: one kernel per tensor; torch's CPU default
``for-loop`` allocates temporaries the size of each parameter, whose fresh pages cost 0.5-0.9 s
a step at the default size and vary from run to run: it was the default before 2026-12-02).

Correctness first: the first ``--check-steps`` steps of every variant give losses (averaged
over the fsdp ranks) equal to the single-device model trained by AdamW on the whole batch
(``max |loss err|``), and global gradient norms before each step equal to its (``grad norm
err``, relative: Adam's update hides a gradient's scale, the norm does not; the reference norm
summed in float64). fp32 gradients of a model this size differ from one device by more than
the tests' 1e-5 in any parallel order (hand-written Megatron's too: ~6e-5 at the default
size), so the line is sized for the model: a variant fails when its error exceeds
``max(1e-5, 2 x megatron's)`` (the hand-written baseline's own fp32 reordering error, doubled).
Then each variant
is timed in ``--rounds`` rounds of ``--iters`` steps after ``--warmup``, variants interleaved
round by round (rotated: each round starts one variant later), a barrier before each block. A
sample is the slowest rank's wall time for that step. Columns: ``step ms`` median / ``p10`` /
``p90`` over the samples, ``vs megatron`` (median ratio), ``CPU ms`` (median thread CPU time of
rank 0's main thread per step: compute, Python and dispatch, not the time blocked on peers),
``minflt`` (median
minor page faults of rank 0's process per step, ``getrusage``: fresh pages the step touched,
a count the machine's load does not change; the timed steps'), ``peak MiB`` (the largest over ranks of the process's peak resident memory during
``--memory-steps`` steps, minus its resident memory before the model was built: measured in a
separate launch per variant, so one variant's memory does not hide another's, after one
untimed first step (fxshard builds its training program there); the variant's parameters,
gradients, AdamW state, activations and communication buffers, after the single-device model
it was built from was deleted) and ``vs dtensor`` (peak ratio). ``--no-memory`` skips the
memory launches.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (GENERATE, add_model_args, bundled_llama,  # noqa: E402
                               environment, format_table, interleaved, launch, reproduce,
                               slowest_rank, stats_ms, write_json)
from benchmarks.train_step_variants import build, mesh_of, reference  # noqa: E402

BASELINE = "megatron"
VARIANTS = ("megatron", "fxshard", "fxshard-dp", "fxshard-layers", "fxshard-keep",
            "fxshard-loss", "fxshard-lossfn", "fxshard-recompute", "fxshard-meta",
            "fxshard-compile", "dtensor")
#: run unless ``--variants`` names others (fxshard-compile: Inductor's first compile is minutes;
#: fxshard-lossfn: fxshard-loss's programs, reached through train_step; one model less in memory)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS
                         if v not in ("fxshard-compile", "fxshard-lossfn", "fxshard-dp",
                                      "fxshard-layers", "fxshard-keep"))
#: checked and measured for memory; timed only with ``--time-meta`` (the same programs as fxshard)
UNTIMED = ("fxshard-meta",)
#: ``--small``: the sizes of a check that it runs (seconds, not a measurement)
SMALL = dict(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=128, seq=16,
             rounds=1, iters=1, warmup=1, memory_steps=1)


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    mesh = mesh_of(args)
    model = bundled_llama(args)
    want = reference(model, args) if rank == 0 else None
    variants, errors, grad_norms, notes = {}, {}, {}, {}
    for name in args.variants:
        step, mean = build(name, model, mesh, args)
        norms: list = []
        errors[name] = [mean(step(norms)) for _ in range(args.check_steps)]
        variants[name] = step
        grad_norms[name] = norms
    faults: dict = {n: [] for n in variants}
    timed = {n: _counting_faults(v, faults[n]) for n, v in variants.items()
             if args.time_meta or n not in UNTIMED}
    t = interleaved(timed, args.rounds, calls=args.iters, warmup=args.warmup,
                    order="rotate", before=dist.barrier)
    warm = args.warmup
    return {"samples": {n: t[n]["wall"] if n in t else None for n in variants},
            "cpu": {n: t[n]["cpu"] if n in t else None for n in variants},
            "minflt": {n: f[warm:] or None for n, f in faults.items()}, "losses": errors,
            "grad_norms": grad_norms, "want": want, "notes": notes}


def _counting_faults(step, out: list):
    """``step`` that appends the process's minor page faults during each call to ``out``."""
    def counted(*a, **k):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return step(*a, **k)
        finally:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return counted


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_worker(rank: int, args, name: str) -> float | None:
    """MiB: this process's peak resident memory over ``--memory-steps`` steps of ``name``,
    minus its resident memory before the model was built (None where /proc can't say)."""
    warnings.filterwarnings("ignore")
    mesh = mesh_of(args)
    import fxshard.models.llama  # noqa: F401  (imports are not the variant's memory)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    lin = torch.nn.Linear(2, 2)                  # nor are autograd's, AdamW's and gloo's
    opt = torch.optim.AdamW(lin.parameters())    # first-use costs: one throwaway step
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    dist.barrier()
    del lin, opt
    gc.collect()
    start = _rss_kib("VmRSS")
    model = bundled_llama(args)
    step, _ = build(name, model, mesh, args)
    del model
    step()        # a first step: fxshard builds its training program here (not step memory)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed model back to the OS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                         # reset the peak (VmHWM) to the current RSS
    except OSError:
        return None
    for _ in range(args.memory_steps):
        step()
    peak = _rss_kib("VmHWM")
    return None if start is None or peak is None else (peak - start) / 1024


def write_checkpoint(args) -> None:
    """The single-device model's weights (``common.bundled_llama``, the seed every variant
    builds) as ``model.safetensors`` in ``args.checkpoint``, for ``fxshard-meta``."""
    from safetensors.torch import save_file
    os.makedirs(args.checkpoint, exist_ok=True)
    model = bundled_llama(args)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(args.checkpoint, "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, **GENERATE, batch=4, seq=128)
    ap.add_argument("--ranks", type=int, default=2, help="processes (fsdp x tp)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--optimizer", choices=("fused", "foreach", "for-loop"), default="fused",
                    help="every variant's AdamW implementation (default: fused, torchtitan's "
                         "default; for-loop is torch's CPU default)")
    ap.add_argument("--check-steps", type=int, default=2,
                    help="steps checked against the single-device model")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--memory-steps", type=int, default=2)
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--time-meta", action="store_true",
                    help="time fxshard-meta too (the same programs as fxshard)")
    ap.add_argument("--checkpoint", default=None,
                    help="where the single-device model's safetensors go for fxshard-meta "
                         "(default: a temporary directory, removed afterwards)")
    ap.add_argument("--mixed", choices=("bf16",), default=None,
                    help="bf16 mixed precision (float32 masters and AdamW state) for the "
                         "variants of benchmarks/train_step_mixed.py")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "train_step.json"))
    ap.add_argument("--small", action="store_true",
                    help="a check that it runs: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                             for k, v in SMALL.items()))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated variants to run (megatron, the baseline, always "
                         "runs): every variant lives in each rank's process during the timing, "
                         "so 4 ranks at the issue's size need fewer on a 24 GB machine")
    args = ap.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"train_step.py: --variants: unknown {', '.join(unknown)}; "
                         f"choose from {', '.join(VARIANTS)}")
    if args.mixed:
        from benchmarks.train_step_mixed import MIXED_VARIANTS
        if args.variants == ",".join(DEFAULT_VARIANTS):
            chosen = list(MIXED_VARIANTS)
        bad = sorted(set(chosen) - set(MIXED_VARIANTS))
        if bad:
            raise SystemExit(f"train_step.py --mixed: no mixed-precision form of "
                             f"{', '.join(bad)}; choose from {', '.join(MIXED_VARIANTS)}")
    args.variants = [v for v in VARIANTS if v == BASELINE or v in chosen]
    if args.small:
        for k, v in SMALL.items():
            setattr(args, k, v)
    fsdp = args.ranks // args.tp
    if fsdp * args.tp != args.ranks or args.batch % fsdp:
        raise SystemExit(f"train_step.py: --ranks {args.ranks} must be a multiple of --tp "
                         f"{args.tp}, and --batch {args.batch} of fsdp = {fsdp}")
    dtype = "bf16 mixed (float32 masters)" if args.mixed else "float32"
    env = environment(ranks=args.ranks, mesh=f"fsdp={fsdp} x tp={args.tp}", dtype=dtype)
    if args.mixed:
        from benchmarks.train_step_mixed import cpu_bf16_flags
        env["cpu_bf16"] = cpu_bf16_flags()
    with tempfile.TemporaryDirectory(prefix="train_step_ckpt_") as tmp:
        if args.checkpoint is None:
            args.checkpoint = tmp
        write_checkpoint(args)
        gathered = launch(worker, args.ranks, args, threads=args.threads)
        want, want_norms = gathered[0]["want"]
        memory = {}
        if args.memory:
            for name in gathered[0]["samples"]:
                per_rank = launch(memory_worker, args.ranks, args, name, threads=args.threads)
                memory[name] = None if None in per_rank else max(per_rank)
    results = {}
    for name in gathered[0]["samples"]:
        timed = gathered[0]["samples"][name] is not None
        r = results[name] = stats_ms(slowest_rank([g["samples"][name] for g in gathered])
                                     if timed else [])
        r["cpu_ms_rank0"] = statistics.median(gathered[0]["cpu"][name]) * 1e3 if timed else None
        faults = gathered[0]["minflt"][name]
        r["minflt_rank0"] = statistics.median(faults) if faults else None
        r["losses"] = gathered[0]["losses"][name]
        r["max_loss_err"] = max(abs(a - b) for a, b in zip(r["losses"], want))
        r["grad_norms"] = gathered[0]["grad_norms"][name]
        r["grad_norm_rel_err"] = max(abs(a - b) / b for a, b in zip(r["grad_norms"], want_norms))
        r["peak_mib"] = memory.get(name)
    # fp32 gradients differ from one device's in any parallel order: the line is the
    # hand-written baseline's own error (doubled), never below the tests' 1e-5
    norm_line = max(1e-5, 2 * results[BASELINE]["grad_norm_rel_err"])
    # bf16: no variant is bitwise one device's autocast run; the line is the hand-written
    # baseline's own distance (doubled), as for the norms
    loss_line = max(1e-4, 2 * results[BASELINE]["max_loss_err"]) if args.mixed else 1e-4
    base = results[BASELINE]["median_ms"]
    mem_base = results["dtensor"]["peak_mib"] if "dtensor" in results else None
    rows = []
    for name, r in results.items():
        if r["n"] == 0:      # checked and measured for memory, not timed
            r["median_ms"] = r["p10_ms"] = r["p90_ms"] = None
        rows.append([name, r["median_ms"], r["p10_ms"], r["p90_ms"],
                     r["median_ms"] / base if r["median_ms"] is not None else None,
                     r["cpu_ms_rank0"], r["minflt_rank0"], r["peak_mib"],
                     r["peak_mib"] / mem_base if r["peak_mib"] and mem_base else None,
                     r["max_loss_err"], r["grad_norm_rel_err"]])
    print(__doc__.split("\n\n")[0])
    print()
    print(f"{env['date']}; torch {env['torch']}; {env['cpus']} CPUs ({env['processor']}); "
          f"{args.ranks} ranks, gloo, {env['mesh']}, {args.threads} thread(s) per rank, "
          f"{dtype}; " + (f"CPU bf16 support: {env['cpu_bf16']}; " if args.mixed else "") +
          f"load average (1 min) {env['load_avg_1m']:.2f} before, {os.getloadavg()[0]:.2f} "
          f"after")
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} "
          f"heads, intermediate {args.intermediate}, vocab {args.vocab}; batch {args.batch} x "
          f"seq {args.seq}; AdamW ({args.optimizer}) lr {args.lr}; {args.rounds} rounds x {args.iters} steps per "
          f"variant after {args.warmup} warm-up")
    print("reproduce: " + reproduce("train_step.py"))
    print()
    print(format_table([("variant", "<17"), ("step ms", ">9.2f"), ("p10", ">9.2f"),
                        ("p90", ">9.2f"), ("vs megatron", ">11.3f"), ("CPU ms", ">9.2f"),
                        ("minflt", ">8.0f"),
                        ("peak MiB", ">9.1f"), ("vs dtensor", ">10.3f"),
                        ("max |loss err|", ">14.2e"), ("grad norm err", ">13.2e")], rows))
    print(f"\nsingle-device losses of the checked steps: {', '.join(f'{x:.6f}' for x in want)}")
    print(f"gradient-norm line (relative): {norm_line:.2e} = max(1e-5, 2 x megatron's "
          f"{results[BASELINE]['grad_norm_rel_err']:.2e}); the single-device norm in float64")
    bad = [n for n, r in results.items()
           if not (r["max_loss_err"] <= loss_line and r["grad_norm_rel_err"] <= norm_line)]
    if bad:
        print(f"CORRECTNESS: loss (> {loss_line:.2e}) or gradient norm (relative > {norm_line:.2e}) "
              f"differs from the single-device model for: {', '.join(bad)}")
    out = {"env": env, "args": vars(args), "results": results, "single_device_losses": want,
           "single_device_grad_norms": want_norms, "grad_norm_line": norm_line,
           "correctness_failures": bad}
    write_json(args.json, out)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
