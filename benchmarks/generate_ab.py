"""Whole greedy generations, fxshard vs hand-written Megatron, alternated: a tighter A/B than
``generate.py``'s seven-variant table for one question (issue 11: is fxshard's decode within
1.1x of Megatron's?).

    python benchmarks/generate_ab.py                                   # small model, batch 1
    python benchmarks/generate_ab.py --batch 8 --rounds 12
    python benchmarks/generate_ab.py --hidden 1024 --intermediate 2816 --layers 8 --heads 16 \
        --vocab 32000 --rounds 6                                       # generate.py's default

One launch of 2 processes (``benchmarks/common.launch``: gloo, tp=2, fp32, CPU, 1 torch thread
each). Both build ``generate.py``'s random HF Llama (``common.hf_llama``) and its ``megatron``
baseline (``common.MegatronLlama(..., embedding="vocab")``: VocabParallelEmbedding,
column/row-parallel layers, its own KV cache, the last position's logits gathered) on the same
weights, and ``fxshard.parallelize(model, mesh)`` with the defaults. Each round runs one whole
``--new``-token greedy generation of each, alternating, after one warm-up each; rank 0 prints
the median wall and thread-CPU time of a generation (columns ``wall ms``, ``cpu ms``: rank 0's
main thread), per variant, and fxshard / megatron. A
generation is the prefill plus ``--new - 1`` decode steps, so at the default 64 new tokens the
decode steps are ~95 % of it. Tokens are checked equal between the two.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (SMALL_HF, MegatronLlama, add_model_args, environment,  # noqa: E402
                               format_table, hf_llama, interleaved, launch, token_ids)
from benchmarks.generate import TP, fxshard_generate  # noqa: E402


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore")
    import fxshard
    model = hf_llama(args)
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    megatron = MegatronLlama(model, rank, TP, embedding="vocab")
    ids = token_ids(args.vocab, args.batch, args.prompt, seed=args.batch)
    variants = {"megatron": lambda: megatron.generate(ids, args.new, []),
                "fxshard": lambda: fxshard_generate(pm, ids, args.new, [])}
    with torch.no_grad():
        outs = {name: fn() for name, fn in variants.items()}   # warm-up: traces, first calls
        times = interleaved(variants, args.rounds, warmup=0, before=dist.barrier)
    pm.close()
    return {"times": times, "equal": torch.equal(outs["fxshard"], outs["megatron"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, **SMALL_HF, prompt=128, new=64, batch=1)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    env = environment()
    res = launch(worker, TP, args, threads=1)[0]
    med = {name: (statistics.median(t["wall"]) * 1e3, statistics.median(t["cpu"]) * 1e3)
           for name, t in res["times"].items()}
    print(f"{env['date']}, torch {env['torch']}, load average {env['load_avg_1m']:.1f}; "
          f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens, {args.rounds} rounds")
    print(format_table([("variant", "<10"), ("wall ms", ">9.1f"), ("cpu ms", ">9.1f")],
                       [[name, w, c] for name, (w, c) in med.items()])
          .replace("cpu ms", "cpu ms   (median of a whole generation)", 1))
    print(f"fxshard / megatron: wall {med['fxshard'][0] / med['megatron'][0]:.3f}, "
          f"cpu {med['fxshard'][1] / med['megatron'][1]:.3f}; tokens equal: {res['equal']}")


if __name__ == "__main__":
    main()
