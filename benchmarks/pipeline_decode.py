"""Greedy generation on pp=2 real ranks: decode pipelined across steps vs one step at a time.

    python benchmarks/pipeline_decode.py                  # defaults below, a few minutes on 2 cores
    python benchmarks/pipeline_decode.py --rounds 12 --new 48 --microbatches 2 4

One launch of 2 processes (``benchmarks/common.launch``: spawn, gloo, fp32, CPU,
``torch.set_num_threads(--threads)`` each, default 1). Both build the same random HuggingFace
``LlamaForCausalLM`` (``common.hf_llama``; default: hidden 512, 8 layers, 8/4 heads, vocab 8000:
4 layers a stage), ``fxshard.parallelize(model, mesh pp=2, microbatches=m)`` and generate
``--new`` tokens greedily for a batch of ``--batch`` prompts of ``--prompt`` tokens with:

  pipelined  ``pm.generate``: the m groups of sequences flow through the stages across steps
             (``fxshard.generation.pipelined``): stage 0 runs group j's next step as soon as stage 1
             has sent group j's tokens (``[b]`` ints).
  steps      the step-synchronous loop (``fxshard.generation.loop.generate(..., _step_synchronous=
             True)``): each step pipelines the m groups GPipe-style, stage 1 sends the whole
             batch's last-position logits (``[B, vocab]`` floats) back, every rank picks the
             tokens, then the next step starts: a (p-1)/(m+p-1) bubble per step.

Each round runs both variants, alternating which goes first, after a barrier; the table gives
the median over ``--rounds`` of the whole ``generate`` (prefill + decode), its tokens/s
(batch x new / wall), the median of rank 0's and rank 1's *thread CPU time* (``time.
thread_time`` of the rank's main thread: its own compute, not gloo's threads or time spent
waiting) and the ratio of the steps' wall to the pipelined wall (> 1: pipelined is faster).
The ideal ratio with m >= p groups on p stages is about (m + p - 1) / m (1.5 for m = p = 2;
the table prints it from ``fxshard.generation.pipelined.schedule``, one tick per stage run, equal
stages, no communication cost), when the two ranks really compute at the same time, i.e. have
a core each. On a machine
where other processes take the cores, the ranks take turns and the overlap buys less: compare
the CPU columns (the work done, which pipelining does not change much) with the wall. Tokens
are checked equal between the variants and to HF ``generate`` on one process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (SMALL_HF, add_model_args, environment, hf_llama,  # noqa: E402
                               launch, token_ids)

PP = 2


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore")
    import fxshard
    import fxshard.generation.loop as g
    model = hf_llama(args)
    mesh = fxshard.init_device_mesh("cpu", (PP,), mesh_dim_names=("pp",))
    ids = token_ids(args.vocab, args.batch, args.prompt, seed=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.new)
    result = {}
    for m in args.microbatches:
        pm = fxshard.parallelize(model, mesh, microbatches=m)
        variants = {
            "pipelined": lambda: pm.generate(ids, max_new_tokens=args.new),
            "steps": lambda: g.generate(pm, ids, max_new_tokens=args.new,
                                        _step_synchronous=True),
        }
        per = {name: {"wall": [], "cpu": [], "equal": True} for name in variants}
        for fn in variants.values():    # warm-up: traces, first-call costs
            dist.barrier()
            fn()
        names = list(variants)
        for i in range(args.rounds):    # whole generations; each checked, so timed here
            for name in (names if i % 2 == 0 else names[::-1]):
                dist.barrier()
                wall, cpu = time.perf_counter(), time.thread_time()
                out = variants[name]()
                per[name]["cpu"].append(time.thread_time() - cpu)
                per[name]["wall"].append(time.perf_counter() - wall)
                per[name]["equal"] &= torch.equal(out, want)
        pm.close()
        result[str(m)] = {name: {"wall_s": statistics.median(p["wall"]),
                                 "spread_s": [min(p["wall"]), max(p["wall"])],
                                 "cpu_s": statistics.median(p["cpu"]), "equal_hf": p["equal"]}
                          for name, p in per.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, **dict(SMALL_HF, layers=8), batch=8, prompt=32, new=32)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(Path(__file__).with_name("pipeline_decode.json")))
    args = parser.parse_args()
    start = time.perf_counter()
    env = environment(args=vars(args))
    ranks = launch(worker, PP, args, threads=args.threads)
    import transformers
    load = env["load_avg_1m"]
    env.update(transformers=transformers.__version__, load_avg_before=load,
               load_avg_after=os.getloadavg(), wall_s=round(time.perf_counter() - start, 1))
    with open(args.json, "w") as f:
        json.dump({"env": env, "ranks": ranks}, f, indent=1)
    print(f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}, "
          f"{env['cpus']} CPUs, load average {load:.1f} before / "
          f"{env['load_avg_after'][0]:.1f} after; pp=2 gloo, {args.threads} thread(s) per "
          f"process; hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} "
          f"heads, vocab {args.vocab}; batch {args.batch}, prompt {args.prompt}, {args.new} new "
          f"tokens, {args.rounds} interleaved rounds")
    from fxshard.generation.pipelined import schedule
    for m in ranks[0]:
        rows = ranks[0][m]
        ideal = args.new * (int(m) + PP - 1) / len(schedule(PP, int(m), args.new))
        print(f"\nmicrobatches {m} (ideal steps / pipelined with one tick per stage run: "
              f"{ideal:.2f})")
        print(f"             generate s (median)  spread (min-max)  tokens/s  "
              f"CPU s rank 0 / rank 1  steps / this  tokens == HF")
        for name, r in rows.items():
            cpu1 = ranks[1][m][name]["cpu_s"]
            ratio = rows["steps"]["wall_s"] / r["wall_s"]
            equal = r["equal_hf"] and ranks[1][m][name]["equal_hf"]
            print(f"  {name:<10} {r['wall_s']:18.3f}  {r['spread_s'][0]:7.3f}-"
                  f"{r['spread_s'][1]:<8.3f}  {args.batch * args.new / r['wall_s']:8.1f}  "
                  f"{r['cpu_s']:9.3f} / {cpu1:<9.3f}  {ratio:12.2f}  {'yes' if equal else 'NO'}")
    print(f"\n(wall {env['wall_s']} s; numbers in {args.json})")


if __name__ == "__main__":
    main()
