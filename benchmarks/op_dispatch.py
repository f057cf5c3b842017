"""Per-call cost of an fxshard op's registration, in one process (no communication).

The same kernel (``x.clone()``, what a size-1 collective does) is called four ways:

  direct Python call        the function itself: the floor
  torch.ops.aten.clone      a built-in op, for scale
  fxshard define_op         ``torch.ops.<ns>.all_reduce`` registered as fxshard registers its
                            ops now (``fxshard.ops.library.define_op``: dispatcher kernels)
  torch.library.custom_op   the same op through ``custom_op`` (how fxshard registered them
                            before): autograd wrapper, redispatch, aliasing check per call

    python benchmarks/op_dispatch.py            # a few seconds
    python benchmarks/op_dispatch.py --calls 50000 --rounds 7

Prints median / min / max over rounds of the mean microseconds per call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, interleaved  # noqa: E402
from fxshard.ops.library import define_op  # noqa: E402


def _kernel(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    return x.clone()


def _thin():
    op = define_op("fxshard_bench::all_reduce", "(Tensor x, str axis, int size) -> Tensor")(
        _kernel)
    op.register_fake(lambda x, axis, size: x.new_empty(x.shape))
    return op.default


def _custom_op():
    @torch.library.custom_op("fxshard_bench_custom::all_reduce", mutates_args=())
    def op(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
        return x.clone()
    return torch.ops.fxshard_bench_custom.all_reduce.default


def _time(fn, calls: int, rounds: int) -> list[float]:
    """Mean wall microseconds per call in each of ``rounds`` blocks of ``calls``."""
    t = interleaved({"": fn}, rounds, calls=calls, warmup=min(calls, 1000), per_call=False)
    return [w * 1e6 for w in t[""]["wall"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.shape)
    thin, custom = _thin(), _custom_op()
    cases = {
        "direct Python call": lambda: _kernel(x, "tp", 2),
        "torch.ops.aten.clone": lambda: torch.ops.aten.clone.default(x),
        "fxshard define_op": lambda: thin(x, "tp", 2),
        "torch.library.custom_op": lambda: custom(x, "tp", 2),
    }
    print(f"torch {torch.__version__}; tensor {list(x.shape)} fp32; {args.rounds} rounds x "
          f"{args.calls} calls; 1 thread")
    columns = [("registration", "<26"), ("median us", ">9.2f"), ("min", ">7.2f"),
               ("max", ">7.2f")]
    print(format_table(columns, []))
    with torch.no_grad():
        for name, fn in cases.items():
            ts = _time(fn, args.calls, args.rounds)
            row = [name, statistics.median(ts), min(ts), max(ts)]
            print(format_table(columns, [row]).splitlines()[1], flush=True)


if __name__ == "__main__":
    main()
