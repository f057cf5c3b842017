"""``python -m fxshard demo | explain``: a tiny bundled Llama on a simulated (or real) mesh.

    python -m fxshard demo                       # dp=2, tp=2 on a simulated mesh
    python -m fxshard demo --mesh tp=4 --sp      # tensor + sequence parallel
    python -m fxshard explain --mesh dp=2,tp=2,pp=2
    torchrun --nproc_per_node=4 -m fxshard demo --mesh dp=2,tp=2   # real collectives (gloo)

Prints the collectives per rank, parameter bytes per rank, an excerpt of rank 0's code and
the largest difference from the single-device model.
"""
from __future__ import annotations

import argparse
import sys

import torch


def _parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    names, shape = [], []
    for part in text.split(","):
        if "=" not in part:
            raise SystemExit(f"--mesh: expected NAME=SIZE pairs like dp=2,tp=2, got {part!r}")
        name, size = part.split("=", 1)
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "explain"])
    parser.add_argument("--mesh", default="dp=2,tp=2", help="axis sizes, e.g. dp=2,tp=2")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on tp")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lines", type=int, default=40, help="lines of rank 0's code to show")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM

    if "RANK" in __import__("os").environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    shape, names = _parse_mesh(args.mesh)
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cpu",
                        generator=torch.Generator().manual_seed(1))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,), sequence_parallel=args.sp,
                             microbatches=args.microbatches)
    try:
        return _show(args, pm, model, ids, rank)
    finally:
        # release fxshard's backend, then the process groups, before the interpreter exits:
        # gloo groups torn down at interpreter shutdown can abort a finished run
        pm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _show(args, pm, model, ids, rank: int) -> int:
    say = print if rank == 0 else (lambda *a, **k: None)
    say(pm.explain())
    if args.command == "explain":
        return 0
    code = pm.rank_module(rank).code.strip().splitlines()
    say(f"\nRank {rank}'s program ({len(code)} lines), first {args.lines}:")
    say("\n".join(code[:args.lines]))
    with torch.no_grad():
        want = model(ids)
        got = pm(ids)
    err = (got - want).abs().max().item()
    say(f"\nmax |parallel - single device| = {err:.3g} on mesh {pm.spec.describe()}")
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
