"""Compile time: fxshard's passes vs torch.export itself, for a Llama-3-70B config on meta.

DESIGN target: the passes for an 80-layer 70B config on a 64-rank mesh take less time than
torch.export, and grow with layers, not with ranks x layers.

    python benchmarks/compile_time.py                  # 70B shape, layers 20/40/80, 64 ranks
    python benchmarks/compile_time.py --layers 8 16    # quicker

Prints one row per (layers, mesh): export seconds, pass seconds, their ratio, and how long
building one rank's GraphModule (meta weights) takes.
"""
from __future__ import annotations

import argparse
import time

import torch

import fxshard
from fxshard.api import compile_program
from fxshard.mesh import mesh_spec
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
from fxshard.passes import PassCtx
from fxshard.passes.emit import build_rank_module
from fxshard.trace import trace


def llama70b(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                       rms_norm_eps=1e-5, rope_theta=500000.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[20, 40, 80])
    ap.add_argument("--mesh", default="dp=2,tp=8,pp=4")
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    names, shape = zip(*[(p.split("=")[0], int(p.split("=")[1])) for p in args.mesh.split(",")])
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    print(f"torch {torch.__version__}; mesh {mesh.describe()} ({mesh.world_size} ranks); "
          f"seq {args.seq}")
    print(f"{'layers':>6} {'export s':>9} {'passes s':>9} {'ratio':>6} {'rank module s':>14}")
    for layers in args.layers:
        with torch.device("meta"):
            model = LlamaForCausalLM(llama70b(layers))
        ids = torch.zeros(2, args.seq, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        traced = trace(model, (ids,))
        t_export = time.perf_counter() - t0
        ctx = PassCtx(mesh=mesh_spec(mesh))
        t0 = time.perf_counter()
        c = compile_program(model, (ids,), {}, ctx, traced=traced)
        t_passes = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_rank_module(c.programs[0], 0, mesh_spec(mesh), {}, torch.device("cpu"))
        t_rank = time.perf_counter() - t0
        print(f"{layers:>6} {t_export:>9.2f} {t_passes:>9.2f} {t_passes / t_export:>6.2f} "
              f"{t_rank:>14.3f}")


if __name__ == "__main__":
    main()
