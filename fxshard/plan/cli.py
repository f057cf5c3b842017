"""``python -m fxshard plan``: the planner from a HuggingFace ``config.json``.

::

    python -m fxshard plan --config config.json --devices 256 --hardware h100 \\
        --seq 8192 --batch 512 [--bf16] [--inference] [--top 10] [--svg best.svg]

builds the model on ``meta`` (``transformers``' ``AutoModelForCausalLM.from_config`` under
``fxshard.init_empty_weights()``; no weights, no download) and prints :func:`fxshard.plan`'s
table: the best configurations and those ruled out, with why.
"""
from __future__ import annotations

import json

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank meshes for a config.json by predicted tokens/s per "
                                    "device (fxshard.plan)",
                       description="Build the model of a HuggingFace config.json on meta (no "
                                   "weights) and print fxshard.plan's table: the best "
                                   "configurations, then those ruled out and why.")
    p.add_argument("--config", required=True, help="a HuggingFace config.json")
    p.add_argument("--devices", type=int, required=True, help="devices to plan for")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100 or mi300x")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, required=True, help="sequences per step")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    p.add_argument("--inference", action="store_true", help="serving: prefill and decode")
    p.add_argument("--top", type=int, default=10, help="configurations shown (default 10)")
    p.add_argument("--max-tp", type=int, default=None,
                   help="largest tp (default: a node's devices)")
    p.add_argument("--max-pp", type=int, default=None, help="largest pp (default: the layers)")
    p.add_argument("--svg", default=None, help="draw the best configuration's plan (needs "
                                               "matplotlib)")


def _model(path: str):
    import fxshard
    with open(path) as f:
        raw = json.load(f)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
        keys = LlamaConfig.__dataclass_fields__
        with fxshard.init_empty_weights():
            return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in raw.items() if k in keys}))
    config = AutoConfig.for_model(**raw)
    with fxshard.init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def run(args) -> int:
    import fxshard
    model = _model(args.config)
    p = fxshard.plan(model, devices=args.devices, hardware=args.hardware, batch=args.batch,
                     seq=args.seq, training=not args.inference,
                     mixed_precision="bf16" if args.bf16 else None, max_tp=args.max_tp,
                     max_pp=args.max_pp)
    print(p.table(top=args.top))
    if p.candidates:
        print()
        print(p[0])
    if args.svg:
        if not p.candidates:
            print("no configuration fits: nothing to draw")
            return 1
        best = p[0]
        mesh = fxshard.init_device_mesh("cpu", tuple(best.mesh.values()),
                                        mesh_dim_names=tuple(best.mesh))
        import torch

        from fxshard.mesh import DP, FSDP
        from fxshard.plan.units import one_layer_model
        ids = torch.zeros((max(best.mesh.get(DP, 1) * best.mesh.get(FSDP, 1), 1),
                           args.seq), dtype=torch.long, device="cpu")
        pm = fxshard.parallelize(one_layer_model(model), mesh, example_inputs=(ids,))
        pm.explain().save(args.svg)
        print(f"\nbest configuration's plan (one layer) drawn to {args.svg}")
    return 0 if p.candidates else 1
