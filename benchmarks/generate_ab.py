"""Whole greedy generations, fxshard vs hand-written Megatron, alternated: a tighter A/B than
``generate.py``'s seven-variant table for one question (issue 11: is fxshard's decode within
1.1x of Megatron's?).

    python benchmarks/generate_ab.py                                   # small model, batch 1
    python benchmarks/generate_ab.py --batch 8 --rounds 12
    python benchmarks/generate_ab.py --hidden 1024 --intermediate 2816 --layers 8 --heads 16 \
        --vocab 32000 --rounds 6                                       # generate.py's default

One launch of 2 processes (gloo, tp=2, fp32, CPU, 1 torch thread each). Both build
``generate.py``'s random HF Llama and its ``megatron`` baseline (VocabParallelEmbedding,
column/row-parallel layers, its own KV cache, the last position's logits gathered) on the same
weights, and ``fxshard.parallelize(model, mesh)`` with the defaults. Each round runs one whole
``--new``-token greedy generation of each, alternating, after one warm-up each; rank 0 prints
the median wall and thread-CPU time of a generation, per variant, and fxshard / megatron. A
generation is the prefill plus ``--new - 1`` decode steps, so at the default 64 new tokens the
decode steps are ~95 % of it. Tokens are checked equal between the two.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import TP, MegatronDecoder, fxshard_generate, make_model  # noqa: E402


def worker(rank: int, port: int, args) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=900)
    store = dist.TCPStore("127.0.0.1", port, TP, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=TP, timeout=timeout)
    try:
        _run(rank, args)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args) -> None:
    import fxshard
    model = make_model(args)
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    megatron = MegatronDecoder(model, rank, replicated_embedding=False)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt), device="cpu",
                        generator=torch.Generator().manual_seed(args.batch))
    variants = {"megatron": lambda: megatron.generate(ids, args.new, []),
                "fxshard": lambda: fxshard_generate(pm, ids, args.new, [])}
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    with torch.no_grad():
        outs = {}
        for name, fn in variants.items():   # warm-up: traces, first-call costs
            dist.barrier()
            outs[name] = fn()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                dist.barrier()
                t, c = time.perf_counter(), time.thread_time()
                fn()
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
    pm.close()
    if rank != 0:
        return
    med = {name: (statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3)
           for name in variants}
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{torch.__version__}, load average {args.load:.1f}; hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}, batch {args.batch}, prompt "
          f"{args.prompt}, {args.new} new tokens, {args.rounds} rounds")
    print(f"{'variant':<10} {'wall ms':>9} {'cpu ms':>9}   (median of a whole generation)")
    for name, (w, c) in med.items():
        print(f"{name:<10} {w:9.1f} {c:9.1f}")
    print(f"fxshard / megatron: wall {med['fxshard'][0] / med['megatron'][0]:.3f}, "
          f"cpu {med['fxshard'][1] / med['megatron'][1]:.3f}; tokens equal: "
          f"{torch.equal(outs['fxshard'], outs['megatron'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    args.load = os.getloadavg()[0]
    # the launcher holds the rendezvous store on a port the OS picks (as runtime_tp.py)
    store = dist.TCPStore("127.0.0.1", 0, TP, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=900))
    mp.spawn(worker, args=(store.port, args), nprocs=TP, join=True)


if __name__ == "__main__":
    main()
