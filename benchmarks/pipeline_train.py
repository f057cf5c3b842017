"""Pipeline training: 1F1B vs GPipe (and interleaved 1F1B) step time and peak saved memory.

    python benchmarks/pipeline_train.py                        # pp=2, 4 microbatches
    python benchmarks/pipeline_train.py --layers 2 --hidden 48 --seq 8 --steps 1   # runs?
    python benchmarks/pipeline_train.py --gloo                 # pp ranks as gloo processes

One process, a simulated mesh ``(pp,)`` (every stage in turn: the step time is the sum of the
stages' work, not a pipelined wall time); ``--gloo``: ``pp`` processes (``common.launch``,
gloo, 1 thread each), each rank running its own stage's actions with isend/irecv between
stages, a barrier before each step, the step time the slowest rank's. The bundled Llama, the same
batch for every schedule; per schedule: the median step time (``pm.train_step``, forward,
backward and the gradients' accumulation; no optimizer) and the peak bytes of saved
activations alive at once per ``pp`` rank (``pm.trainer.peak_saved``, counted as the schedule
runs). The issue's target: 1F1B <= GPipe in step time, lower in peak memory.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fxshard
from fxshard.mesh import PP
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM


def pipeline_rows(*, pp: int = 2, microbatches: int = 4, layers: int = 4, hidden: int = 128,
                  heads: int = 4, vocab: int = 256, batch: int = 8, seq: int = 32,
                  steps: int = 3, schedules=("gpipe", "1f1b", "interleaved_1f1b"),
                  barrier=None) -> list:
    """One row per schedule: ``{"schedule", "step_ms", "peak_saved": {pp rank: bytes}}``."""
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(num_hidden_layers=layers, vocab_size=vocab, hidden_size=hidden,
                           intermediate_size=hidden * 2 + 16, num_attention_heads=heads,
                           num_key_value_heads=heads // 2)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)

    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    rows = []
    for schedule in schedules:
        mesh = fxshard.init_device_mesh("cpu", (pp,), mesh_dim_names=(PP,))
        pm = fxshard.parallelize(model, mesh, microbatches=microbatches)
        pm.train_step(ids, target=labels, loss_fn=loss_fn, schedule=schedule)  # build
        times = []
        for _ in range(steps):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            pm.train_step(ids, target=labels, loss_fn=loss_fn, schedule=schedule)
            times.append((time.perf_counter() - t0) * 1e3)
        peak = pm.trainer.peak_saved
        per_stage = {s: max(b for r, b in peak.items() if pm.stage_of(r) == s)
                     for s in range(pp) if any(pm.stage_of(r) == s for r in peak)}
        rows.append({"schedule": schedule, "step_ms": statistics.median(times),
                     "peak_saved": per_stage})
        pm.close()
    return rows


def _gloo_worker(rank: int, kwargs: dict) -> list:
    import torch.distributed as dist
    return pipeline_rows(**kwargs, barrier=dist.barrier)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("pp", 2), ("microbatches", 4), ("layers", 4), ("hidden", 128),
                          ("heads", 4), ("vocab", 256), ("batch", 8), ("seq", 32), ("steps", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--gloo", action="store_true", help="pp gloo processes, not simulated")
    a = ap.parse_args()
    kwargs = dict(pp=a.pp, microbatches=a.microbatches, layers=a.layers, hidden=a.hidden,
                  heads=a.heads, vocab=a.vocab, batch=a.batch, seq=a.seq, steps=a.steps)
    if a.gloo:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.common import launch
        per_rank = launch(_gloo_worker, a.pp, kwargs)
        rows = [{"schedule": r0["schedule"],
                 "step_ms": max(r[i]["step_ms"] for r in per_rank),
                 "peak_saved": {s: b for r in per_rank for s, b in r[i]["peak_saved"].items()}}
                for i, r0 in enumerate(per_rank[0])]
    else:
        rows = pipeline_rows(**kwargs)
    print(f"pp={a.pp}, {a.microbatches} microbatches, {a.layers} layers, hidden {a.hidden}, "
          f"batch {a.batch} x {a.seq} ({'gloo, one process per stage' if a.gloo else 'simulated mesh'})")
    print(f"{'schedule':<18}{'step ms':>10}  peak saved bytes per pp rank")
    for r in rows:
        print(f"{r['schedule']:<18}{r['step_ms']:>10.1f}  " +
              ", ".join(f"{s}: {b}" for s, b in r["peak_saved"].items()))


if __name__ == "__main__":
    main()
