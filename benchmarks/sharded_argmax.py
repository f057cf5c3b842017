"""The end of a greedy decode step on tp=2 real ranks: ``fxshard::sharded_argmax`` (each rank's
first maximum, one ``(value, index)`` pair per sequence exchanged) vs the logits' all-gather +
argmax it replaced (what hand-written Megatron does), alternating, per call.

    python benchmarks/sharded_argmax.py                       # batch 1 and 8, vocab 8000-128256
    python benchmarks/sharded_argmax.py --batches 1 --vocabs 32000 --rounds 100

2 processes (``benchmarks/common.launch``: spawn, gloo, CPU, 1 torch thread each). Each rank holds
``[B, 1, V / 2]`` float32 logits; every round runs ``--calls`` calls of each variant after a
barrier, variants alternating which goes first; the table gives the median per call over the
rounds on rank 0 (``new wall us`` / ``old wall us``: microseconds per call; ``cpu us``: this
thread's CPU time), and new / old.
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

from benchmarks.common import interleaved, launch  # noqa: E402


def worker(rank: int, args) -> list:
    warnings.filterwarnings("ignore")
    import fxshard
    from fxshard.runtime.context import use_backend
    from fxshard.runtime.distributed import backend_for
    from fxshard.ops.decode import sharded_argmax
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    backend = backend_for(mesh)
    kernel = sharded_argmax.__wrapped__          # what eager rank programs call
    rows = []
    for batch in args.batches:
        for vocab in args.vocabs:
            x = torch.randn(batch, 1, vocab // 2, generator=torch.Generator().manual_seed(rank))
            variants = {
                "old": lambda: backend.all_gather(x, 2, "tp")[:, -1].float().argmax(-1),
                "new": lambda: kernel(x, "tp", 2)[:, -1]}
            with use_backend(backend), torch.no_grad():
                assert torch.equal(variants["new"](), variants["old"]())
                t = interleaved(variants, args.rounds, calls=args.calls, warmup=0,
                                order="alternate", before=dist.barrier, per_call=False)
            m = {k: (statistics.median(v["wall"]) * 1e6, statistics.median(v["cpu"]) * 1e6)
                 for k, v in t.items()}
            rows.append((batch, vocab, m))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[8000, 32000, 128256])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    rows = launch(worker, 2, args, threads=1)[0]
    print(f"{'batch':>5} {'vocab':>7}   new wall us  old wall us  new cpu us  old cpu us"
          f"  new/old wall  new/old cpu")
    for batch, vocab, m in rows:
        print(f"{batch:>5} {vocab:>7}  {m['new'][0]:11.0f}  {m['old'][0]:11.0f}  "
              f"{m['new'][1]:10.0f}  {m['old'][1]:10.0f}  {m['new'][0] / m['old'][0]:12.2f}"
              f"  {m['new'][1] / m['old'][1]:11.2f}")


if __name__ == "__main__":
    main()
