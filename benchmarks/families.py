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
    python benchmarks/families.py --external              # litgpt / torchtune / torchtitan
    python benchmarks/families.py --external litgpt_falcon # only this one

``--external`` runs the models of other libraries' own model code (``tests/external_models.py``;
a library that is not installed is left out and said) on tp2, dp2·tp2, tp2+SP, pp2, ring2 and
ulysses2: max error, layer params per rank at tp=2, tp collectives per layer (1 vs 2 layers),
fallbacks and how attention was lowered on the CP axes.

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


def attention_lowering(code: str, gathered: int) -> str:
    """How rank 0's program attends: ring / Ulysses (all-to-all around a local attention) /
    attentions whose sequence a CP axis gathered."""
    ring = code.count("fxshard.ring_attention")
    calls = sum("attention.default(" in line for line in code.splitlines()) - ring
    a2a = code.count("fxshard.all_to_all")
    parts = [f"ring {ring}"] * bool(ring) + [f"attention {calls}"] * bool(calls) + \
        [f"all_to_all {a2a}"] * bool(a2a)
    if gathered:
        parts.append(f"gathered {gathered}")
    return ", ".join(parts) or "none"


def external(args: list) -> None:
    from tests.external_models import EXTERNAL, MESHES as EXT_MESHES, installed, measure
    names = [n for n in EXTERNAL if not args or n in args or EXTERNAL[n][0] in args]
    missing = sorted({EXTERNAL[n][0] for n in names if not installed(EXTERNAL[n][0])})
    rows = []
    for name in names:
        if not installed(EXTERNAL[name][0]):
            continue
        for mesh_name, (axes, sp) in EXT_MESHES.items():
            try:
                r = measure(name, axes, sp)
            except Exception as e:  # noqa: BLE001 - a row says what failed
                rows.append((name, mesh_name, f"error: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120]}", "", "", "", ""))
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
                continue
            frac = per_layer = "-"
            if mesh_name in ("tp2", "tp2_sp"):
                frac = f"{r['frac']:.3f}" if mesh_name == "tp2" else "-"
                try:
                    one = measure(name, axes, sp, layers=1)["collectives"]
                    two = r["collectives"]
                    grown = {k: two[k] - one[k] for k in two | one}
                    per_layer = ", ".join(
                        f"{op}{'' if kind == 'full' else '(stat)'} {n}"
                        for (op, kind), n in sorted(grown.items()) if n) or "none"
                except Exception as e:  # noqa: BLE001
                    per_layer = f"1 layer: {type(e).__name__}"
            lowering = attention_lowering(r["code"], len(r["explain"].gathered)) \
                if mesh_name in ("ring2", "ulysses2") else "-"
            rows.append((name, mesh_name, f"{r['err']:.1e}", frac, per_layer,
                         f"{len(r['explain'].fallbacks)} ({len(r['fallbacks'])} warned)", lowering))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    head = ("model", "mesh", "max abs err", "layer params/rank", "tp collectives per layer",
            "ops run replicated", "attention (rank 0)")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for name in names:
        lib, pattern, _ = EXTERNAL[name]
        if installed(lib):
            print(f"- {name}: {pattern}")
    if missing:
        print(f"\nNot installed (left out): {', '.join(missing)}")


def main() -> None:
    if "--external" in sys.argv[1:]:
        return external([a for a in sys.argv[1:] if a != "--external"])
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
