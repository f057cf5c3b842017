"""Training step time with a vocab ``tp`` does not divide: fxshard's padded vocab against the
same model with a vocab ``tp`` divides, and against the head kept whole (what fxshard did
before ``fxshard/passes/pad_vocab.py``).

    python benchmarks/padded_vocab.py                   # tp=2, 2 ranks, issue 19's size
    python benchmarks/padded_vocab.py --variants even-loss,padded-loss
    python benchmarks/padded_vocab.py --small           # does it run? (tiny)

Each variant's model, shards and AdamW state live through the run (~2 GB a rank at the
default size): the two launches above fit 24 GB.

One launch of 2 gloo processes (``benchmarks/common.launch``, one torch thread each), the
bundled Llama at issue 19's size (``common.GENERATE``: 8 layers, hidden 1024, untied lm_head)
with vocab ``--vocab`` (default 32001: no tp > 1 divides it). Variants, each a step of
``F.cross_entropy(pm(ids) ...)`` on ``pm(ids)``'s logits, ``backward``, fused AdamW:

  even        the same model with ``--vocab - 1`` rows (32000: tp divides it), the baseline
  padded      ``--vocab`` rows, padded to a multiple of tp inside fxshard (the default):
              the head column-parallel, the logits ``tp`` blocks, the loss vocab-parallel
  whole-head  ``--vocab`` rows with ``plan={"lm_head": "replicate"}``: every rank computes
              the whole ``[B, S, V]`` logits and the head's whole gradient (the placement
              fxshard chose before it padded)
  even-loss, padded-loss  ``even`` and ``padded`` with the cross-entropy inside the traced
              module (as HF's ``labels=``): the padded classes masked to -inf in the graph;
              ``vs even`` of these is against ``even-loss``

Timed interleaved (``common.interleaved``, rotating order), medians of the slower rank.
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (GENERATE, add_model_args, bundled_llama, environment,  # noqa: E402
                               format_table, interleaved, launch, reproduce, slowest_rank,
                               stats_ms, token_ids)

VARIANTS = ("even", "padded", "whole-head", "even-loss", "padded-loss")
SMALL = dict(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=129, seq=16,
             rounds=1, iters=1, warmup=1)


def worker(rank: int, args) -> dict:
    warnings.filterwarnings("ignore")
    import fxshard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    steps, errors = {}, {}
    for name in args.variants:
        vocab = args.vocab - 1 if name == "even" else args.vocab
        model = bundled_llama(args, vocab=vocab)
        ids = token_ids(vocab, args.batch, args.seq + 1, seed=1)
        ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        ref = copy.deepcopy(model).train()
        plan = {"lm_head": "replicate"} if name == "whole-head" else None
        inside = name.endswith("-loss")
        pm = fxshard.parallelize(WithLoss(model.train()) if inside else model.train(), mesh,
                                 example_inputs=(ids, labels) if inside else (ids,), plan=plan)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, fused=True)

        def step(pm=pm, opt=opt, ids=ids, labels=labels, inside=inside):
            loss = pm(ids, labels) if inside else \
                F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        got = step()
        want = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten()).item()
        errors[name] = abs(got - want)
        steps[name] = step
    t = interleaved(steps, args.rounds, calls=args.iters, warmup=args.warmup, order="rotate",
                    before=dist.barrier)
    return {"wall": {n: t[n]["wall"] for n in steps}, "errors": errors}


class WithLoss(torch.nn.Module):
    """The model and its cross-entropy in one traced module (the loss in fxshard's graph)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return F.cross_entropy(self.model(ids).flatten(0, 1), labels.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, **{**GENERATE, "vocab": 32001}, batch=4, seq=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="tiny sizes: a check that it runs")
    ap.add_argument("--variants", default="even,padded,whole-head",
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"padded_vocab.py: unknown variants {unknown}; known: {VARIANTS}")
    base = {"even" if not v.endswith("-loss") else "even-loss" for v in args.variants}
    args.variants = list(dict.fromkeys([*sorted(base), *args.variants]))
    if args.small:
        for k, v in SMALL.items():
            setattr(args, k, v)
    results = launch(worker, 2, args, threads=1)
    env = environment()
    print(f"# {env['date']}, torch {env['torch']}, {env['processor']}, load {env['load_avg_1m']:.2f}")
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} (even: "
          f"{args.vocab - 1}); batch {args.batch} x seq {args.seq}; tp=2, 2 gloo ranks; "
          f"{args.rounds} rounds x {args.iters} steps")
    print(f"reproduce: {reproduce('padded_vocab.py')}\n")
    rows = []
    for name in args.variants:
        base = stats_ms(slowest_rank([r["wall"]["even-loss" if name.endswith("-loss") else
                                                 "even"] for r in results]))["median_ms"]
        s = stats_ms(slowest_rank([r["wall"][name] for r in results]))
        rows.append((name, s["median_ms"], s["p10_ms"], s["p90_ms"], s["median_ms"] / base,
                     max(r["errors"][name] for r in results)))
    print(format_table([("variant", "<12"), ("step ms", ">9.1f"), ("p10", ">9.1f"),
                        ("p90", ">9.1f"), ("vs even", ">8.3f"), ("|loss err|", ">11.2e")],
                       rows))


if __name__ == "__main__":
    main()
