"""Where the eager per-call CPU time of a ParallelModule goes, component by component.

    python benchmarks/eager_overhead.py                 # ~1 minute on 2 cores
    python benchmarks/eager_overhead.py --layers 32     # more weights per rank program

One process, one torch thread, no communication: the collectives run on a *loopback*
backend (``all_reduce`` = a copy, ``all_gather`` = ``cat`` of copies of the local piece), so
every number is this thread's CPU time (``time.thread_time``) spent in Python, dispatch and
compute, undisturbed by a peer. The model and shapes are ``benchmarks/runtime_tp.py``'s
(``fxshard.models.llama``, hidden 256, 8/4 heads, 2 layers, batch 2, seq 64), rank 0 of a
``tp=2`` program. Rows (median microseconds per call over ``--rounds`` rounds of ``--iters``):

  megatron (loopback)      the hand-written tp=2 forward (``common.MegatronLlama``), collectives
                           replaced by the same loopback (in place / cat): the baseline
  rank GraphModule         ``pm.rank_module(0)(ids)``: the readable FX module
  rank runner              what ``pm(ids)`` runs per rank (``fxshard.compile.eager_stage``):
                           weights bound once, ops called without ``OpOverload.__call__``,
                           all-reduces into dead inputs in place (a no-op on the loopback)
  attention op / SDPA      ``torch.ops.fxshard.attention`` vs ``F.scaled_dot_product_attention``
                           on one rank's q/k/v; ``attention_out`` (what the runner calls when
                           nothing reads the lse) on q/k/v stored ``[B, S, H, D]``, as in the
                           program
  all_reduce op / direct   ``torch.ops.fxshard.all_reduce`` vs the backend's method (the
                           dispatcher + checks around one collective)
  weight fetch             the rank GraphModule's ``self.model.layers.0....weight`` reads
  weight watch             ``WeightWatch.changed()`` on the model (every ``pm(x)``)
  pm wrapper               the rest of ``pm(x)`` around the rank runs: ``_sync_weights``,
                           ``_get`` (flatten, signature, split), output unflatten
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from benchmarks.common import (RUNTIME_TP, MegatronLlama, add_model_args,  # noqa: E402
                               bundled_llama, format_table, interleaved, token_ids)
from fxshard.mesh import mesh_spec  # noqa: E402
from fxshard.runtime import use_backend  # noqa: E402
from fxshard.runtime.weight_store import WeightWatch  # noqa: E402

TP = 2


class Loopback:
    """A backend that communicates with nobody: rank 0 of ``mesh``, collectives as copies."""

    def __init__(self, mesh):
        self.mesh, self.rank = mesh, 0

    def axis_index(self, axis):
        return 0

    def axis_size(self, axis):
        return self.mesh.axis_size(axis)

    def all_gather(self, x, dim, axis):
        return torch.cat([x] * self.axis_size(axis), dim)

    def all_reduce(self, x, axis):
        return x.contiguous().clone()

    def all_reduce_(self, x, axis):              # DistributedBackend's in-place all_reduce
        return x

    def flush(self):
        pass


class LoopbackMegatron(MegatronLlama):
    def _all_reduce(self, x):
        return x                                    # dist.all_reduce is in place

    def _gather_last(self, x):
        return torch.cat([x.contiguous()] * self.tp, dim=-1)


def _interleaved(fns: dict, iters: int, rounds: int, warmup: int = 3) -> dict:
    """Median, min and max over ``rounds`` of the mean thread-CPU microseconds per call of each
    callable, interleaved round by round (``common.interleaved``: a burst of other load on the
    machine hits all of them alike)."""
    import statistics
    t = interleaved(fns, rounds, calls=iters, warmup=warmup, per_call=False)
    return {name: (statistics.median(v["cpu"]) * 1e6, min(v["cpu"]) * 1e6,
                   max(v["cpu"]) * 1e6) for name, v in t.items()}


def _us(fn, iters: int, rounds: int) -> tuple[float, float, float]:
    """:func:`_interleaved` of one callable."""
    return _interleaved({"": fn}, iters, rounds, warmup=max(3, iters // 4))[""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, **RUNTIME_TP, batch=2, seq=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7,
                    help="rounds per component (3x as many, interleaved, for the forwards)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = bundled_llama(args)
    cfg = model.config
    ids = token_ids(cfg.vocab_size, args.batch, args.seq)
    mesh = fxshard.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    backend = Loopback(mesh_spec(mesh))
    c = pm.programs.last
    gm = pm.rank_module(0)
    runner = pm.executor.runner(c, 0, [ids])
    megatron = LoopbackMegatron(model, 0, TP)

    hq, hkv, d = cfg.num_attention_heads // TP, cfg.num_key_value_heads // TP, cfg.head_dim
    g = torch.Generator().manual_seed(2)
    q = torch.randn(args.batch, hq, args.seq, d, generator=g)
    k = torch.randn(args.batch, hkv, args.seq, d, generator=g)
    v = torch.randn(args.batch, hkv, args.seq, d, generator=g)
    x = torch.randn(args.batch, args.seq, cfg.hidden_size, generator=g)
    # as the rank program's rope and v projection leave them: stored [B, S, H, D]
    qr, kr, vr = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    scale = d ** -0.5
    weights = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    fetch = gm.graph.python_code("self").src   # the generated forward, weight reads only
    reads = "\n".join(line for line in fetch.splitlines() if " = self." in line
                      or "getattr(self." in line)
    read_fn = eval(compile("lambda self: [" + ", ".join(
        line.split(" = ", 1)[1] for line in reads.splitlines()) + "]", "<fetch>", "eval"))
    watch = WeightWatch(model)
    out = [torch.empty(0)]

    def wrapper():
        pm.programs.sync_weights()
        pm.programs.get((ids,), {})
        pytree.tree_unflatten(out, c.traced.out_spec)

    rows = {}
    with torch.no_grad(), use_backend(backend):
        rows.update(_interleaved({
            "megatron (loopback), forward": lambda: megatron(ids),
            "rank GraphModule gm(ids), forward": lambda: gm(ids),
            "rank runner (what pm runs), forward": lambda: runner(ids)},
            max(1, args.iters // 5), args.rounds * 3))
        rows["torch.ops.fxshard.attention, one call"] = _us(
            lambda: torch.ops.fxshard.attention(q, k, v, None, True, scale, 0, 0),
            args.iters * 4, args.rounds)
        rows["torch.ops.fxshard.attention_out (runner's), one call"] = _us(
            lambda: torch.ops.fxshard.attention_out(qr, kr, vr, None, True, scale, 0, 0),
            args.iters * 4, args.rounds)
        rows["F.scaled_dot_product_attention, one call"] = _us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=hq != hkv),
            args.iters * 4, args.rounds)
        rows["torch.ops.fxshard.all_reduce, one call"] = _us(
            lambda: torch.ops.fxshard.all_reduce(x, "tp", TP), args.iters * 4, args.rounds)
        rows["backend.all_reduce direct, one call"] = _us(
            lambda: backend.all_reduce(x, "tp"), args.iters * 4, args.rounds)
        rows[f"weight fetch, {len(weights)} GraphModule attribute reads"] = _us(
            lambda: read_fn(gm), args.iters * 4, args.rounds)
        rows[f"WeightWatch.changed(), {len(watch)} tensors"] = _us(
            watch.changed, args.iters * 4, args.rounds)
        rows["pm wrapper (sync weights, _get, unflatten)"] = _us(wrapper, args.iters * 4,
                                                                  args.rounds)
    print(f"torch {torch.__version__}, 1 thread, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, batch {args.batch}, seq {args.seq}; thread CPU us per call, "
          f"median (min-max) of {args.rounds} rounds")
    print(format_table([("component", "<48"), ("median us", ">10.1f"), ("min", ">9.1f"),
                        ("max", ">9.1f")], [[name, *v] for name, v in rows.items()]))
    base = rows["megatron (loopback), forward"][0]
    low = rows["megatron (loopback), forward"][1]
    for name in ("rank GraphModule gm(ids), forward", "rank runner (what pm runs), forward"):
        print(f"{name} / megatron: median {rows[name][0] / base:.3f}, min "
              f"{rows[name][1] / low:.3f}")


if __name__ == "__main__":
    main()
