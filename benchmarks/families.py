"""HuggingFace families x meshes: does every pattern shard, and at what cost?

For each family of ``tests/families.py`` (tiny random configs, no downloads) plus eager
attention (Llama; Gemma-2's soft-capped scores; BLOOM's ALiBi through ``baddbmm``) and the MoE
families (Mixtral; Qwen2-MoE with its shared expert), on tp=2,
dp=2*tp=2, tp=2 with sequence parallelism and tp=2*ring_cp=2, print:

- the largest difference from the single-device logits;
- the largest per-rank share of the layer-stack matrices (embeddings, lm_head, norms aside);
- the tp collectives each added layer costs (counted in rank 0's program at 1 and 2 layers;
  ``stat`` = a [b, s, 1] norm statistic) and ring attention calls per layer;
- ops that fell back (FallbackWarning) and weight matrices kept whole on tp.

    python benchmarks/families.py            # ~5 minutes on 2 CPU cores
    python benchmarks/families.py gpt2 olmo2 # only these families
    python benchmarks/families.py --usp mistral gemma2 bloom   # USP meshes instead

``--usp`` runs the meshes with both context-parallel axes (ulysses2·ring2, tp2·ulysses2·ring2)
instead; for those the collectives column also counts the distinct masks ring attention takes
and how many of them a collective moved (0: each rank cuts its rows from the whole mask).
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxshard  # noqa: E402
from fxshard.passes.rules import FallbackWarning  # noqa: E402
from tests.families import FAMILIES, bloom, collectives_by_kind, gemma2, \
    layer_param_fraction, llama_eager, mistral, mixtral, qwen2_moe  # noqa: E402

MESHES = {"tp2": (dict(tp=2), False), "dp2·tp2": (dict(dp=2, tp=2), False),
          "tp2+SP": (dict(tp=2), True), "tp2·ring2": (dict(tp=2, ring_cp=2), False)}
USP_MESHES = {"ulysses2·ring2": (dict(ulysses_cp=2, ring_cp=2), False),
              "tp2·ulysses2·ring2": (dict(tp=2, ulysses_cp=2, ring_cp=2), False)}


EXTRA = {"llama (eager attention)": ("matmul -> softmax -> matmul attention, recognised as "
                                     "SDPA", llama_eager),
         "gemma2": ("eager attention with tanh soft-capped scores, lowered with the cap "
                    "(sliding window 4096 > the 16 tokens here)", gemma2),
         "gemma2 (window 5)": ("Gemma-2 with a sliding window of 5 < 16 tokens: layer 0 "
                               "attends with an explicit banded mask, layer 1 causal",
                               lambda layers: gemma2(layers, sliding_window=5)),
         "mistral": ("SDPA with a sliding window of 5 < 16 tokens: one explicit banded mask "
                     "that every layer shares", mistral),
         "bloom": ("ALiBi via baddbmm on heads merged into the batch [B*H, S, D], fused "
                   "query_key_value: SDPA with the bias in the mask (on ring_cp the mask rides "
                   "the ring by query rows)", bloom),
         "mixtral": ("MoE: router, top-k, grouped expert matmuls (each expert's intermediate "
                     "dim sharded on tp; routing on each rank's tokens under dp/CP)", mixtral),
         "qwen2_moe": ("MoE with a shared expert and its sigmoid gate", qwen2_moe)}


def run(build, layers: int, axes: dict, sp: bool, ids):
    model = build(layers)
    with torch.no_grad():
        want = model(ids).logits
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp)
        with torch.no_grad():
            got = pm(ids).logits
    fallbacks = sum(issubclass(w.category, FallbackWarning) for w in caught)
    return model, pm, (got - want).abs().max().item(), fallbacks


def mask_exchanges(pm) -> tuple[int, int]:
    """Distinct masks rank 0's ring attentions take, and how many a collective made."""
    masks = {n.args[12] for n in pm.rank_module(0).graph.nodes
             if n.target is torch.ops.fxshard.ring_attention.default and len(n.args) > 12}
    moved = sum(str(m.target).split(".")[1] in ("all_gather", "all_to_all") for m in masks)
    return len(masks), moved


def main() -> None:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    rows = []
    families = {k: v[:2] for k, v in FAMILIES.items()} | EXTRA
    args = sys.argv[1:]
    meshes = USP_MESHES if "--usp" in args else MESHES
    args = [a for a in args if a != "--usp"]
    if args:
        families = {k: v for k, v in families.items() if k.split()[0] in args}
    for name, (pattern, build) in families.items():
        for mesh_name, (axes, sp) in meshes.items():
            model, pm, err, fb = run(build, 2, axes, sp, ids)
            frac = layer_param_fraction(pm, model)
            replicated = len(pm.explain().replicated)
            ring = pm.rank_module(0).code.count("fxshard.ring_attention") / 2
            masks, moved = mask_exchanges(pm)
            gathered = len(pm.explain().gathered)
            pm.close()
            per_layer = "-"
            if "ring_cp" not in axes and "dp" not in axes:
                counts = []
                for layers in (1, 2):
                    _, pm1, _, _ = run(build, layers, axes, sp, ids)
                    counts.append(collectives_by_kind(pm1))
                    pm1.close()
                grown = {k: counts[1][k] - counts[0][k] for k in counts[1] | counts[0]}
                per_layer = ", ".join(f"{op}{'' if kind == 'full' else '(stat)'} {n}"
                                      for (op, kind), n in sorted(grown.items()) if n) or "none"
            elif "ring_cp" in axes:
                per_layer = f"ring attention {ring:g}" + (
                    f", gathered (explicit mask) {gathered / 2:g}" if gathered else "") + (
                    f"; masks {masks} ({moved} moved)" if "ulysses_cp" in axes else "")
            rows.append((name, mesh_name, f"{err:.1e}", f"{frac:.3f}", per_layer, str(fb),
                         str(replicated)))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    head = ("family", "mesh", "max abs err", "layer params/rank", "collectives per layer",
            "fallbacks", "weights whole on tp")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for name, (pattern, _) in families.items():
        print(f"- {name}: {pattern}")


if __name__ == "__main__":
    main()
