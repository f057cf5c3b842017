"""Measure what ``fxshard.estimate`` predicts, on this CPU: peak memory and step time.

``measure(config, mesh, batch=, seq=, training=, real=)`` runs a fresh Python process
(``real=True``: one gloo process per rank, :mod:`benchmarks.rank_launch`) that builds the
model on ``meta``, loads random weights from a safetensors file into ``fxshard.parallelize``'s
shards, runs one warm-up step (programs built, AdamW state made), then measures:

- memory: the bytes of the tensors that stay (parameter shards and optimizer state, by their
  storages) plus the rise of the process's peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs``) during one more step above the resident set before it. glibc is
  told to map every allocation of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so
  a freed tensor leaves the resident set at once and the peak is the tensors' peak (plus the
  interpreter's small objects: the noise of this method). On a simulated mesh the process
  holds every rank: the figure is divided by the number of ranks.
- time: the median of ``steps`` more steps (forward, backward, AdamW step).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
       "OMP_NUM_THREADS": "1"}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _model(config: dict):
    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    with fxshard.init_empty_weights():
        return LlamaForCausalLM(LlamaConfig(**config))


def run(rank: int, config: dict, mesh: dict, batch: int, seq: int, training: bool, path: str,
        steps: int, options: dict) -> dict:
    """One process's measurement (every rank of a simulated mesh, or one gloo rank)."""
    import torch
    import torch.nn.functional as F
    import fxshard
    torch.set_num_threads(1)
    model = _model(config)
    dm = fxshard.init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    labels = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    pm = fxshard.parallelize(model, dm, **options)
    fxshard.load_safetensors(pm, path)

    def ce(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    if training:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

        def step():
            pm.train_step(ids, loss_fn=ce, target=labels)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        def step():
            with torch.no_grad():
                pm(ids)
    step()
    gc.collect()
    held = list(pm.parameters()) if training else \
        [t for r in _local_ranks(pm, mesh) for t in pm.rank_module(r).state_dict().values()]
    if training:
        held += [t for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
    resident = _storages(held)
    base = _rss()
    _reset_hwm()
    step()
    peak = _hwm() - base
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    pm.close()
    return {"rank": rank, "resident": resident, "rise": peak, "memory": resident + peak,
            "time": statistics.median(times) if times else None}


def _local_ranks(pm, mesh: dict) -> list:
    import torch.distributed as dist
    if dist.is_initialized():
        return [dist.get_rank()]
    n = 1
    for v in mesh.values():
        n *= v
    return list(range(n))


def _weights(config: dict, path: str) -> None:
    import torch
    from safetensors.torch import save_file
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def measure(config: dict, mesh: dict, *, batch: int, seq: int, training: bool = True,
            real: bool = False, steps: int = 0, options: dict | None = None,
            timeout_s: float = 900) -> dict:
    """Memory per rank (bytes) and step time (s) measured in a fresh process (module doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        args = json.dumps([config, mesh, batch, seq, training, path, steps, options or {}])
        env = {**os.environ, **ENV}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        out = subprocess.run([sys.executable, "-m", "benchmarks.plan_measure",
                              "real" if real else "simulated", args], env=env, cwd=root,
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode:
            raise RuntimeError(f"plan_measure failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def _main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    config, mesh, batch, seq, training, path, steps, options = args
    _weights(config, path)
    world = 1
    for v in mesh.values():
        world *= v
    if mode == "simulated":
        r = run(0, config, mesh, batch, seq, training, path, steps, options)
        result = {"memory": r["memory"] / world, "time": r["time"], "resident":
                  r["resident"] / world, "rise": r["rise"] / world, "world": world}
    else:
        from benchmarks.rank_launch import launch
        rs = launch(run, world, config, mesh, batch, seq, training, path, steps, options)
        result = {"memory": max(r["memory"] for r in rs),
                  "time": max(r["time"] for r in rs) if steps else None,
                  "resident": max(r["resident"] for r in rs),
                  "rise": max(r["rise"] for r in rs), "world": world,
                  "per_rank": [r["memory"] for r in rs]}
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
