"""Expert parallelism (issue 44): a training step of a Mixtral-style MoE on 2 gloo ranks (CPU),
``ep=2`` against ``tp=2`` and ``dp=2`` on the same ranks: step time and bytes moved per step.

    python benchmarks/expert_parallel.py                 # hidden 256, 8 experts of 1024, top-2
    python benchmarks/expert_parallel.py --small         # does it run? (tiny)

One launch per mesh (``benchmarks/common.launch``: spawn, gloo, fp32, ``--threads`` torch
threads per rank). Every rank builds the same HF ``MixtralForCausalLM`` (seed 0; ``--layers``
layers, 8 experts, top-2, the experts' intermediate size 4x hidden, so the experts hold most
of the weights) and the same batch; ``fxshard.training.parallelize_for_training`` on the
``(axis=2,)`` DeviceMesh; a step is ``F.cross_entropy(tm(ids).logits, labels).backward()`` and
``AdamW.step()``. Reported per mesh: the median step over ``--steps`` after one warm-up step,
the bytes per step per rank from the rank programs' collectives (``explain``'s wire bytes: the
expert exchanges counted under uniform routing) and the parameter bytes a rank holds.

torchtitan's own expert parallelism is not compared: it needs CUDA (its token dispatch is
written for NCCL all-to-all on GPU) and does not run on CPU gloo.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch  # noqa: E402

MESHES = ("ep", "tp", "dp")


def _config(args):
    import transformers as T
    h = args.hidden
    cfg = T.MixtralConfig(hidden_size=h, intermediate_size=4 * h, num_hidden_layers=args.layers,
                          num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                          num_local_experts=8, num_experts_per_tok=2, use_cache=False,
                          max_position_embeddings=4 * args.seq)
    cfg._attn_implementation = "sdpa"
    return cfg


def _worker(rank: int, axis: str, args) -> dict:
    import warnings

    import torch
    import torch.nn.functional as F
    import transformers as T

    import fxshard
    from fxshard.training import parallelize_for_training
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(_config(args)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, 1024, (args.batch, args.seq), generator=g)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(tm(ids).logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    wire = sum(c.wire_bytes for w in ("forward", "backward") for c in tm.collectives(w))
    held = sum(t.numel() * t.element_size() for t in tm.shards(rank).values())
    return {"step_s": statistics.median(times[1:]), "wire": wire, "held": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--small", action="store_true", help="a tiny size: does it run?")
    args = p.parse_args()
    if args.small:
        args.hidden, args.layers, args.batch, args.seq, args.steps = 64, 1, 2, 16, 2
    print(f"Mixtral-style MoE: hidden {args.hidden}, {args.layers} layers, 8 experts of "
          f"{4 * args.hidden}, top-2; batch {args.batch} x {args.seq}; 2 gloo ranks, "
          f"{args.threads} thread(s) each; median of {args.steps} steps")
    print(f"{'mesh':6} {'step s':>8} {'MB moved/step/rank':>20} {'MB params/rank':>16}")
    for axis in MESHES:
        r = launch(_worker, 2, axis, args, threads=args.threads)[0]
        print(f"{axis + '=2':6} {r['step_s']:8.3f} {r['wire'] / 2**20:20.2f} "
              f"{r['held'] / 2**20:16.2f}")


if __name__ == "__main__":
    main()
