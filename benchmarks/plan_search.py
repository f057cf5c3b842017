"""How long ``fxshard.plan`` takes: every factorization of 512 devices for Llama-3.1-405B.

    python benchmarks/plan_search.py [--devices 512] [--batch 2048] [--seq 8192]

Prints the wall time, the one-layer programs built, how many meshes were priced and ruled
out, and the top of the table (H100 preset, bf16 mixed precision).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch
    import fxshard
    from benchmarks.plan_published import CONFIGS
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=512)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hardware", default="h100")
    args = p.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    with fxshard.init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS["llama3-405b"]))
    built = time.perf_counter() - start
    start = time.perf_counter()
    plan = fxshard.plan(model, devices=args.devices, hardware=args.hardware, batch=args.batch,
                        seq=args.seq, mixed_precision="bf16")
    took = time.perf_counter() - start
    print(f"Llama-3.1-405B on {args.devices} x {args.hardware}, batch {args.batch} x "
          f"{args.seq}: search {took:.1f} s (model on meta {built:.1f} s), "
          f"{plan.programs_built} one-layer programs built, {len(plan.candidates)} fit, "
          f"{len(plan.rejected)} ruled out\n")
    print(plan.table(top=10, rejected=10))


if __name__ == "__main__":
    main()
