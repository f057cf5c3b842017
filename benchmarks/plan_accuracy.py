"""How close ``fxshard.estimate`` comes to measurements (issue 45).

    python benchmarks/plan_accuracy.py memory     # CPU: predicted vs measured peak per rank
    python benchmarks/plan_accuracy.py time       # CPU gloo: calibrate()'d prediction vs step
    python benchmarks/plan_accuracy.py published  # published GPU training results (table)

memory: two Llama-shaped models, six or more meshes each, training (AdamW) on the simulated
mesh and on gloo ranks, and inference; the measurement is benchmarks/plan_measure.py's (a
fresh process: the peak resident set's rise during a step plus the resident shards and
optimizer state). time: ``fxshard.calibrate()`` (one thread per rank) prices four
configurations at 2 and 4 gloo ranks, each measured as the median of a few steps. Each
table prints the error of every row; nothing here adjusts the model to the measurements.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_measure import _model, measure  # noqa: E402
from benchmarks.plan_published import published_table  # noqa: E402

MODELS = {
    "A (gqa, 2 layers)": dict(vocab_size=4096, hidden_size=256, intermediate_size=688,
                              num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=512),
    "B (mha, 4 layers)": dict(vocab_size=2048, hidden_size=192, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=6,
                              num_key_value_heads=6, max_position_embeddings=512),
}
MESHES = [({"dp": 2}, {}), ({"fsdp": 2}, {}), ({"tp": 2}, {"sequence_parallel": False}),
          ({"tp": 2}, {"sequence_parallel": True}), ({"dp": 2, "tp": 2}, {}),
          ({"fsdp": 2, "tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})]
BATCH, SEQ = 4, 256


def _row(name, mesh, opts, mode, training, hw):
    import fxshard
    model = _model(MODELS[name])
    e = fxshard.estimate(model, mesh, hardware=hw, batch=BATCH, seq=SEQ, training=training,
                         sequence_parallel=opts.get("sequence_parallel", False),
                         microbatches=opts.get("microbatches", 1))
    m = measure(MODELS[name], mesh, batch=BATCH, seq=SEQ, training=training,
                real=mode == "gloo", options=opts)
    err = (e.memory["peak"] - m["memory"]) / m["memory"]
    return e.memory["peak"], m["memory"], err


def memory(modes=("simulated", "gloo")) -> list:
    """The memory table (module docstring)."""
    import fxshard
    hw = fxshard.Hardware.preset("h100").with_(memory_bytes=10 ** 12)
    rows = []
    print(f"{'model':20s} {'mesh':24s} {'mode':10s} {'what':9s} {'pred MiB':>9s} "
          f"{'meas MiB':>9s} {'error':>7s}")
    first = next(iter(MODELS))
    for name in MODELS:
        for mesh, opts in MESHES:
            for mode in modes:
                for training in (True, False):
                    if not training and "pp" in mesh:
                        continue
                    # the second model and gloo ranks: training only (the machine's time)
                    if (name != first or mode == "gloo") and not training:
                        continue
                    if name != first and mode == "gloo":
                        continue
                    o = {k: v for k, v in opts.items() if training or k != "microbatches"}
                    pred, got, err = _row(name, mesh, o, mode, training, hw)
                    label = ",".join(f"{a}={n}" for a, n in mesh.items()) + \
                        (" sp" if o.get("sequence_parallel") else "")
                    rows.append((name, label, mode, "train" if training else "infer", pred,
                                 got, err))
                    print(f"{name:20s} {label:24s} {mode:10s} {rows[-1][3]:9s} "
                          f"{pred / 2**20:9.1f} {got / 2**20:9.1f} {err:+7.1%}", flush=True)
    within = sum(abs(r[-1]) <= 0.10 for r in rows)
    print(f"\nwithin 10%: {within} of {len(rows)}; largest error "
          f"{max(rows, key=lambda r: abs(r[-1]))[-1]:+.1%}")
    return rows


TIME_CONFIGS = [({"dp": 2}, {}), ({"tp": 2}, {}), ({"fsdp": 2}, {}),
                ({"dp": 2, "tp": 2}, {}), ({"fsdp": 4}, {}), ({"tp": 4}, {})]


def time_table(steps: int = 3) -> list:
    import fxshard
    hw = fxshard.calibrate(ranks=4)
    print(f"calibrated: {hw.measured}")
    cfg = MODELS["A (gqa, 2 layers)"]
    model = _model(cfg)
    rows = []
    for mesh, opts in TIME_CONFIGS:
        e = fxshard.estimate(model, mesh, hardware=hw, batch=BATCH, seq=SEQ,
                             sequence_parallel=False)
        m = measure(cfg, mesh, batch=BATCH, seq=SEQ, real=True, steps=steps,
                    options={"sequence_parallel": False, **opts})
        err = (e.step_time["total"] - m["time"]) / m["time"]
        label = ",".join(f"{a}={n}" for a, n in mesh.items())
        rows.append((label, e.step_time["total"], m["time"], err))
        print(f"{label:16s} predicted {e.step_time['total'] * 1e3:8.1f} ms  measured "
              f"{m['time'] * 1e3:8.1f} ms  {err:+.1%}", flush=True)
    pred_rank = sorted(rows, key=lambda r: r[1])
    meas_rank = sorted(rows, key=lambda r: r[2])
    print("ranking (fastest first) predicted:", [r[0] for r in pred_rank])
    print("ranking (fastest first) measured: ", [r[0] for r in meas_rank])
    return rows


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "memory"
    if what == "memory":
        memory()
    elif what == "time":
        time_table()
    elif what == "published":
        print(published_table())
    else:
        raise SystemExit(f"unknown table {what!r}; use memory, time or published")
