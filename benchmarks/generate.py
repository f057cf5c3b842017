"""Decode latency of text generation, tp=2 on real ranks: fxshard vs hand-written Megatron vs
DTensor vs HuggingFace on one process.

Issue 11's targets: fxshard's per-token decode latency <= 1.1x a hand-written Megatron decode
step, and faster than DTensor ``parallelize_module``.

    python benchmarks/generate.py                      # defaults below, a few minutes on 2 cores
    python benchmarks/generate.py --hidden 512 --layers 4 --vocab 8000 --repeats 5

One launch of 2 processes (``benchmarks/common.launch``: spawn, gloo, fp32, CPU,
``torch.set_num_threads(--threads)`` each, default 1 so 2 processes fit 2 cores). Both build
the same random HuggingFace ``LlamaForCausalLM`` (default: hidden 1024, 8 layers, 16 heads /
4 KV heads, intermediate 2816, vocab 32000) and the same prompts (``--prompt`` 128 tokens,
batch 1 and 8), and generate ``--new`` 32 tokens greedily with:

  megatron   hand-written tp=2 decode in plain torch + torch.distributed on slices of the same
             weights (``common.MegatronLlama(..., embedding="vocab")``, the baseline every
             benchmark shares): Megatron-LM's VocabParallelEmbedding (each rank holds half the rows;
             masked lookup + in-place ``dist.all_reduce``), column-parallel q/k/v/gate/up,
             row-parallel o/down + in-place ``dist.all_reduce``, column-parallel lm_head +
             ``dist.all_gather`` of the last position's logits (10 collectives a step with 4
             layers); its own static KV cache ``[B, kv_heads/2, capacity, head_dim]`` written
             in place with ``index_copy_``, SDPA over the valid prefix. The baseline (1.00).
  megatron repl-emb  the same with the whole embedding table on each rank: no collective
             for the lookup (9 a step), tp times the table's memory.
  fxshard    ``fxshard.parallelize(model, mesh).generate(ids, max_new_tokens=new)`` (default
             ``embedding="embed_dim"``: half the table per rank, the lookup all-gathered).
  fxshard repl-emb  ``parallelize(..., embedding="replicate")``: like megatron repl-emb.
  fxshard gather-logits  fxshard's default with the decode program greedy generation used
             before the sharded argmax (``fxshard.passes.kv_cache.greedy_tokens_pass``): the
             ``[B, 1, V]`` logits all-gathered and the argmax taken on every rank, as the
             megatron baseline does (an A/B of that change, interleaved in one run).
  dtensor    ``parallelize_module`` with the seed's plan (``common.dtensor_tp(...,
             embedding_and_head=False)``: ColwiseParallel q/k/v/gate/up, RowwiseParallel
             o/down) on a copy of the HF model, decoded by HF ``generate`` (its
             DynamicCache).
  hf 1-proc  HF ``generate`` on rank 0 alone, no parallelism (rank 1 waits at a barrier).

A *step* is one decode forward plus the token choice, timed from one step's start to the next
(fxshard: successive calls of the runner from ``pm.generate``, recorded by wrapping
``pm.executor.run``; HF: a StoppingCriteria that stamps the time after each token). The
first token comes from the prefill, timed apart. Each variant runs ``--repeats`` times,
variants interleaved per repeat; the table gives the median step over all repeats, the spread
(min-max of the repeats' medians), the median thread CPU time of a step (rank 0's main
thread: what the step computes and dispatches, without the time it waits for the peer or
gloo's threads), tokens/s (batch / median step) and the prefill, on rank 0; "like-for-like"
divides by the Megatron variant with the same embedding. Every variant's tokens are checked
against HF ``generate`` on one process.
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

from benchmarks.common import (GENERATE, MegatronLlama, add_model_args, dtensor_tp,  # noqa: E402
                               environment, hf_llama, launch, now, token_ids)

TP = 2


def hf_generate(model, ids, new: int, stamps: list):
    import transformers

    class Stamp(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device="cpu")

    stamps.append(now())
    return model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                          attention_mask=torch.ones_like(ids),
                          stopping_criteria=transformers.StoppingCriteriaList([Stamp()]))


def fxshard_generate(pm, ids, new: int, stamps: list):
    inner = pm.executor.run

    def stamped(*a, **k):
        stamps.append(now())
        return inner(*a, **k)

    pm.executor.run = stamped
    try:
        out = pm.generate(ids, max_new_tokens=new)
    finally:
        del pm.executor.run
    stamps.append(now())
    return out


def gathering_logits(pm):
    """``pm`` whose greedy decode program gathers the logits (the program before the sharded
    argmax: its generation key without ``"greedy"``)."""
    get = pm.programs.get

    def _get(args, kwargs, generation=None):
        if generation is not None and generation[0] == "decode":
            generation = generation[:2]
        return get(args, kwargs, generation)

    pm.programs.get = _get
    return pm


def steps_and_prefill(stamps: list) -> tuple[list[float], list[float], float]:
    """(decode step seconds, their thread CPU seconds, prefill seconds) from [start, after
    prefill, after step 1, ...] (each a :func:`now`)."""
    return ([b[0] - a[0] for a, b in zip(stamps[1:], stamps[2:])],
            [b[1] - a[1] for a, b in zip(stamps[1:], stamps[2:])], stamps[1][0] - stamps[0][0])


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    import fxshard
    model = hf_llama(args)
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    pm_rep = fxshard.parallelize(model, mesh, embedding="replicate")
    pm_old = gathering_logits(fxshard.parallelize(model, mesh))
    megatron = MegatronLlama(model, rank, TP, embedding="vocab")
    megatron_rep = MegatronLlama(model, rank, TP, embedding="replicate")
    dt = dtensor_tp(model, init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)),
                    embedding_and_head=False)
    variants = {
        "megatron": lambda ids, s: megatron.generate(ids, args.new, s),
        "fxshard": lambda ids, s: fxshard_generate(pm, ids, args.new, s),
        "megatron repl-emb": lambda ids, s: megatron_rep.generate(ids, args.new, s),
        "fxshard repl-emb": lambda ids, s: fxshard_generate(pm_rep, ids, args.new, s),
        "fxshard gather-logits": lambda ids, s: fxshard_generate(pm_old, ids, args.new, s),
        "dtensor": lambda ids, s: hf_generate(dt, ids, args.new, s),
        "hf 1-proc": lambda ids, s: hf_generate(model, ids, args.new, s) if rank == 0 else None,
    }
    result = {}
    for batch in args.batches:
        ids = token_ids(args.vocab, batch, args.prompt, seed=batch)
        with torch.no_grad():
            want = hf_generate(model, ids, args.new, []) if rank == 0 else None
            for name, fn in variants.items():   # warm-up: traces, first-call costs
                dist.barrier()
                fn(ids, [])
            per = {name: {"steps": [], "cpu": [], "medians": [], "prefill": [], "equal": True}
                   for name in variants}
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    dist.barrier()
                    stamps = []
                    out = fn(ids, stamps)
                    if out is None:
                        continue
                    steps, cpu, prefill = steps_and_prefill(stamps)
                    per[name]["steps"] += steps
                    per[name]["cpu"] += cpu
                    per[name]["medians"].append(statistics.median(steps))
                    per[name]["prefill"].append(prefill)
                    if rank == 0:
                        per[name]["equal"] &= torch.equal(out, want)
        result[batch] = {name: {
            "step_ms": statistics.median(p["steps"]) * 1e3,
            "cpu_ms": statistics.median(p["cpu"]) * 1e3,
            "spread_ms": [min(p["medians"]) * 1e3, max(p["medians"]) * 1e3],
            "tokens_s": batch / statistics.median(p["steps"]),
            "prefill_ms": statistics.median(p["prefill"]) * 1e3,
            "equal_hf": p["equal"]} for name, p in per.items() if p["steps"]}
    for p in (pm, pm_rep, pm_old):
        p.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, **GENERATE, prompt=128, new=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(Path(__file__).with_name("generate.json")))
    args = parser.parse_args()
    start = time.perf_counter()
    env = environment(args=vars(args))
    result = launch(worker, TP, args, threads=args.threads)[0]
    import transformers
    env.update(transformers=transformers.__version__, load_avg=list(os.getloadavg()),
               wall_s=round(time.perf_counter() - start, 1))
    with open(args.json, "w") as f:
        json.dump({"env": env, "result": result}, f, indent=1)
    print(f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}, "
          f"{env['cpus']} CPUs, load average {env['load_avg'][0]:.1f}; tp=2 gloo, "
          f"{args.threads} thread(s) per process; hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}; prompt {args.prompt}, "
          f"{args.new} new tokens, {args.repeats} repeats")
    like = {"fxshard": "megatron", "fxshard repl-emb": "megatron repl-emb",
            "fxshard gather-logits": "megatron"}
    for batch, rows in result.items():
        base = rows["megatron"]["step_ms"]
        print(f"\nbatch {batch:<7}  step ms (median)  spread of repeats  cpu ms  vs megatron  "
              f"like-for-like  tokens/s  prefill ms  tokens == HF")
        for name, r in rows.items():
            same = f"{r['step_ms'] / rows[like[name]]['step_ms']:13.2f}" if name in like \
                else " " * 13
            print(f"  {name:<21} {r['step_ms']:8.2f}  {r['spread_ms'][0]:7.2f}-"
                  f"{r['spread_ms'][1]:<8.2f}  {r['cpu_ms']:6.2f}  {r['step_ms'] / base:11.2f}  "
                  f"{same}  {r['tokens_s']:8.1f}  {r['prefill_ms']:10.1f}  "
                  f"{'yes' if r['equal_hf'] else 'NO'}")
    print(f"\n(wall {env['wall_s']} s; numbers in {args.json})")


if __name__ == "__main__":
    main()
