"""The end of a greedy decode step on tp=2 real ranks: ``fxshard::sharded_argmax`` (each rank's
first maximum, one ``(value, index)`` pair per sequence exchanged) vs the logits' all-gather +
argmax it replaced (what hand-written Megatron does), alternating, per call.

    python benchmarks/sharded_argmax.py                       # batch 1 and 8, vocab 8000-128256
    python benchmarks/sharded_argmax.py --batches 1 --vocabs 32000 --rounds 100

2 processes (torch.multiprocessing spawn, gloo, CPU, 1 torch thread each). Each rank holds
``[B, 1, V / 2]`` float32 logits; every round runs ``--calls`` calls of each variant after a
barrier, variants alternating which goes first; the table gives the median per call over the
rounds on rank 0: wall and this thread's CPU time, and new / old.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(rank: int, port: int, args) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    import fxshard
    from fxshard.runtime.context import use_backend
    from fxshard.runtime.distributed import backend_for, release
    from fxshard.ops.decode import sharded_argmax
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    backend = backend_for(mesh)
    kernel = sharded_argmax.__wrapped__          # what eager rank programs call
    if rank == 0:
        print(f"{'batch':>5} {'vocab':>7}   new wall us  old wall us  new cpu us  old cpu us"
              f"  new/old wall  new/old cpu")
    for batch in args.batches:
        for vocab in args.vocabs:
            x = torch.randn(batch, 1, vocab // 2, generator=torch.Generator().manual_seed(rank))
            variants = {
                "new": lambda: kernel(x, "tp", 2)[:, -1],
                "old": lambda: backend.all_gather(x, 2, "tp")[:, -1].float().argmax(-1)}
            wall = {k: [] for k in variants}
            cpu = {k: [] for k in variants}
            with use_backend(backend), torch.no_grad():
                assert torch.equal(variants["new"](), variants["old"]())
                for r in range(args.rounds):
                    for k in (("new", "old") if r % 2 else ("old", "new")):
                        dist.barrier()
                        w0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(args.calls):
                            variants[k]()
                        wall[k].append((time.perf_counter() - w0) / args.calls * 1e6)
                        cpu[k].append((time.thread_time() - c0) / args.calls * 1e6)
            if rank == 0:
                m = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}
                print(f"{batch:>5} {vocab:>7}  {m['new'][0]:11.0f}  {m['old'][0]:11.0f}  "
                      f"{m['new'][1]:10.0f}  {m['old'][1]:10.0f}  {m['new'][0] / m['old'][0]:12.2f}"
                      f"  {m['new'][1] / m['old'][1]:11.2f}")
    release(mesh)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[8000, 32000, 128256])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    from tests.launch import free_port
    mp.spawn(worker, args=(free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
