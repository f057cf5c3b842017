"""Compile time: ``fxshard.parallelize`` and its passes vs torch.export itself, models on meta.

DESIGN targets: the passes for an 80-layer 70B config on a 64-rank mesh take less time than
torch.export and grow with layers, not with ranks x layers; the whole ``parallelize`` of a
HuggingFace Llama-3-8B built on meta over dp2*tp8*pp4 costs at most 1.5x ``torch.export`` of
the same model.

    python benchmarks/compile_time.py                          # HF 8B (32 layers) + ours 70B
    python benchmarks/compile_time.py --model hf --config 8b --layers 32
    python benchmarks/compile_time.py --model ours --config 70b --layers 20 40 80

Each row: ``torch.export.export`` of the model alone (the baseline), fxshard's passes on that
export, the whole ``fxshard.parallelize(model, mesh, example_inputs=...)`` (its own trace,
buffers, passes) and its ratio to the export, how long one rank's GraphModule takes to build
(meta weights: what one torchrun process pays), how long every rank's GraphModules take (what a
simulated mesh pays: ranks of a stage share one generated code) and the whole with every rank
built against the export (issue target: at most 1.5x). Medians of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxshard  # noqa: E402
from benchmarks.common import format_table, time_calls  # noqa: E402
from fxshard.runtime.program_cache import compile_program  # noqa: E402
from fxshard.mesh import PP, mesh_spec  # noqa: E402
from fxshard.passes import PassCtx  # noqa: E402
from fxshard.passes.emit import build_rank_module  # noqa: E402
from fxshard.trace import trace  # noqa: E402

CONFIGS = {  # Llama-3 shapes
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_attention_heads=64, num_key_value_heads=8),
}


def build(model_kind: str, config: str, layers: int) -> torch.nn.Module:
    shape = dict(CONFIGS[config], num_hidden_layers=layers, rms_norm_eps=1e-5,
                 rope_theta=500000.0)
    with torch.device("meta"):
        if model_kind == "hf":
            import transformers
            cfg = transformers.LlamaConfig(**shape, attn_implementation="sdpa")
            return transformers.LlamaForCausalLM(cfg).eval()
        from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` calls, and the last call's result."""
    out = []
    times = time_calls(lambda: out.append(fn()), repeat)
    return statistics.median(times), out[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["hf", "ours", "both"], default="both")
    ap.add_argument("--config", choices=sorted(CONFIGS), default=None,
                    help="default: 8b for hf, 70b for ours")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="default: 32 for 8b, 80 for 70b")
    ap.add_argument("--mesh", default="dp=2,tp=8,pp=4")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    names, shape = zip(*[(p.split("=")[0], int(p.split("=")[1])) for p in args.mesh.split(",")])
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    print(f"torch {torch.__version__}; mesh {mesh.describe()} ({mesh.world_size} ranks); "
          f"batch 2, seq {args.seq}; medians of {args.repeat}")
    columns = [("model", ">5"), ("config", ">6"), ("layers", ">6"), ("export s", ">9.2f"),
               ("passes s", ">9.2f"), ("parallelize s", ">14.2f"), ("par/export", ">10.2f"),
               ("rank module s", ">14.3f"), ("all ranks s", ">12.3f"),
               ("(par+all)/export", ">17.2f")]
    print(format_table(columns, []))
    kinds = ["hf", "ours"] if args.model == "both" else [args.model]
    for kind in kinds:
        config = args.config or ("8b" if kind == "hf" else "70b")
        for layers in args.layers or ([32] if config == "8b" else [80]):
            model = build(kind, config, layers)
            ids = torch.zeros(2, args.seq, dtype=torch.long)
            kwargs = {"use_cache": False} if kind == "hf" else {}
            t_export, _ = timed(lambda: torch.export.export(
                model, (ids.to("meta"),), kwargs, strict=False), args.repeat)
            traced = trace(model, (ids,))
            t_passes, c = timed(lambda: compile_program(
                model, (ids,), {}, PassCtx(mesh=mesh_spec(mesh)), traced=traced), args.repeat)
            t_par, _ = timed(lambda: fxshard.parallelize(model, mesh, example_inputs=(ids,)),
                             args.repeat)
            c2 = compile_program(model, (ids,), {}, PassCtx(mesh=mesh_spec(mesh)),
                                 traced=traced)
            t0 = time.perf_counter()
            build_rank_module(c.programs[0], 0, mesh_spec(mesh), {}, torch.device("cpu"))
            t_rank = time.perf_counter() - t0
            spec = mesh_spec(mesh)
            t0 = time.perf_counter()
            for r in range(spec.world_size):   # a fresh program: nothing shared from above
                build_rank_module(c2.programs[spec.axis_index(r, PP)], r, spec, {},
                                  torch.device("cpu"))
            t_all = time.perf_counter() - t0
            row = [kind, config, layers, t_export, t_passes, t_par, t_par / t_export, t_rank,
                   t_all, (t_par + t_all) / t_export]
            print(format_table(columns, [row]).splitlines()[1], flush=True)


if __name__ == "__main__":
    main()
