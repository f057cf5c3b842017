"""The benchmarks' one harness: model sizes, a gloo launcher, timing, tables and the baselines.

Every script in ``benchmarks/`` takes what it shares with another from here, so that two
scripts measuring "hand-written Megatron" or "DTensor" measure the same code:

- sizes: :func:`add_model_args` adds the model-size flags (``--hidden --heads --kv-heads
  --intermediate --layers --vocab`` and the input's ``--batch --seq --prompt --new``) with a
  script's defaults (the presets below: ``RUNTIME_TP``, ``SMALL_HF``, ``GENERATE``);
  :func:`bundled_llama`, :func:`hf_llama` and :func:`tutorial_blocks` build the model from the
  parsed flags, :func:`token_ids` the inputs;
- launch: :func:`launch` runs a worker on N gloo ranks on loopback (a free port held by the
  launcher's store, ``torch.set_num_threads`` per rank), returns every rank's result, shuts
  the ranks down cleanly, and names the rank that failed with its traceback;
- timing: :func:`time_calls`, :func:`stats_ms`, :func:`interleaved` (variants alternated round
  by round, so a burst of other load hits all of them alike), :func:`rotated`, and
  :func:`format_table` (fixed-width text tables);
- the hand-written Megatron baseline (:class:`MegatronTP`: the collectives, with Megatron-LM's
  f/g backward as autograd functions when trainable): :class:`MegatronLlama` (the bundled or
  HuggingFace Llama: column/row-parallel linears on weight slices, its own KV cache for
  decoding, a vocab-parallel cross-entropy; :func:`megatron_step` = forward + backward +
  optimizer step, data parallel over a second group) and :class:`MegatronBlocks` (the seed
  lesson's TransformerBlocks);
- the DTensor baseline: :func:`dtensor_tp_plan` (the one ``parallelize_module`` plan),
  :func:`dtensor_tp`, and :func:`dtensor_train` + :func:`dtensor_step` (TP plan +
  ``fully_shard``: torchtitan's 2-D recipe; FSDP2 runs on CPU gloo with torch 2.13).

Benchmarks run as scripts (``python benchmarks/x.py``) and import this as
``benchmarks.common`` with the checkout's root on ``sys.path``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import queue as queue_lib
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's fxshard, wherever the script is run from
    sys.path.insert(0, str(ROOT))

# --- model sizes -----------------------------------------------------------------------------

#: runtime_tp's bundled Llama (also eager_overhead's and collective_overhead's forwards)
RUNTIME_TP = dict(hidden=256, heads=8, kv_heads=4, intermediate=688, layers=2, vocab=512)
#: the small HF Llama of generate_ab / pipeline_decode / generate's smaller runs
SMALL_HF = dict(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=4, vocab=8000)
#: issue 11's generation size (generate.py's default)
GENERATE = dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000)

_SIZE_FLAGS = {  # name -> help
    "hidden": "hidden size", "heads": "attention heads", "kv_heads": "key/value heads",
    "intermediate": "MLP intermediate size", "layers": "decoder layers",
    "vocab": "vocabulary size", "batch": "sequences per batch", "seq": "tokens per sequence",
    "prompt": "prompt tokens", "new": "new tokens to generate",
}
_MODEL_KEYS = ("hidden", "heads", "kv_heads", "intermediate", "layers", "vocab")


def add_model_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add ``--<name>`` (``kv_heads`` -> ``--kv-heads``) for every size named in ``defaults``,
    with that default, e.g. ``add_model_args(ap, **RUNTIME_TP, batch=2, seq=64)``. A name that
    is not a size flag is a ``ValueError`` (a typo must not become a silent default)."""
    unknown = sorted(set(defaults) - set(_SIZE_FLAGS))
    if unknown:
        raise ValueError(f"add_model_args: unknown size flag(s) {unknown}; known: "
                         f"{sorted(_SIZE_FLAGS)}")
    for name in _SIZE_FLAGS:  # a fixed order, so --help reads the same in every script
        if name in defaults:
            parser.add_argument("--" + name.replace("_", "-"), type=int,
                                default=defaults[name], help=f"{_SIZE_FLAGS[name]} "
                                f"(default {defaults[name]})")
    return parser


def sizes(args, **override) -> dict:
    """The model sizes in ``args`` (a namespace from :func:`add_model_args`), with overrides."""
    return {k: override.get(k, getattr(args, k)) for k in _MODEL_KEYS
            if k in override or hasattr(args, k)}


def llama_config(args, **override):
    """``fxshard.models.llama.LlamaConfig.tiny`` at the sizes in ``args``."""
    from fxshard.models.llama import LlamaConfig
    s = sizes(args, **override)
    return LlamaConfig.tiny(vocab_size=s["vocab"], hidden_size=s["hidden"],
                            intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                            num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"])


def bundled_llama(args, seed: int = 0, **override):
    """The bundled ``LlamaForCausalLM`` (random weights from ``seed``), eval mode."""
    from fxshard.models.llama import LlamaForCausalLM
    cfg = llama_config(args, **override)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def hf_llama(args, seed: int = 0, **override):
    """A random HuggingFace ``LlamaForCausalLM`` (SDPA attention, 4096 positions), eval mode,
    with ``eos_token_id = None`` so generation always makes exactly the tokens asked for."""
    import transformers
    s = sizes(args, **override)
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=4096,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tutorial_blocks(args, seed: int = 0):
    """``--layers`` of the seed tensor-parallel lesson's ``TransformerBlock`` (``tests/models.py``:
    q + k + v then wo, a GELU MLP of 4x ``--hidden``, all with biases; no norms or residuals)
    in an ``nn.Sequential``, eval mode."""
    from tests.models import TransformerBlock
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[TransformerBlock(args.hidden, args.heads)
                                 for _ in range(args.layers)]).eval()


def token_ids(vocab: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """``[batch, seq]`` random token ids (same on every rank for the same seed)."""
    return torch.randint(0, vocab, (batch, seq), device="cpu",
                         generator=torch.Generator().manual_seed(seed))


# --- launch ----------------------------------------------------------------------------------

class RankFailed(RuntimeError):
    """A rank of a :func:`launch` raised, died or outlived the timeout."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for launchers that cannot take a held store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release_fxshard() -> None:
    mod = sys.modules.get("fxshard.runtime.distributed")
    if mod is not None:  # fxshard's backends hold process groups: drop them before destroy
        mod.release_all()


def _rank_main(rank, world, port, threads, timeout_s, results, worker, args) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        try:
            out = worker(rank, *args)
        finally:
            _release_fxshard()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the launcher, which names this rank
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, out))


def launch(worker, world: int, *args, threads: int = 1, timeout_s: float = 900.0) -> list:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes joined in one gloo process
    group on 127.0.0.1 (the launcher holds the rendezvous store on a port the OS picks, so no
    other process can take it), each with ``torch.set_num_threads(threads)``. Returns the
    workers' return values (picklable), by rank. The group is destroyed (fxshard's backends
    released first) when the worker returns or raises.

    A rank that raises, exits without a result, or is still running after ``timeout_s``
    seconds: the other ranks are stopped (they may wait on it in a collective) and
    :class:`RankFailed` names the first failing rank, with its traceback."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, store.port, threads, timeout_s, results, worker, args))
             for r in range(world)]
    for p in procs:
        p.start()
    done, failed = {}, {}
    deadline = time.monotonic() + timeout_s
    exited: dict[int, float] = {}   # rank -> when its process was first seen gone
    first_failure = None
    clean = False                   # every rank returned: give them time to exit by themselves
    try:
        while len(done) + len(failed) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
                (done if ok else failed)[rank] = value
            except queue_lib.Empty:
                pass
            t = time.monotonic()
            for r, p in enumerate(procs):  # gone without a report (a signal, os._exit)
                if r not in done and r not in failed and p.exitcode is not None:
                    if t - exited.setdefault(r, t) > 2.0:  # its report may still be queued
                        failed[r] = f"exited with code {p.exitcode} without a result"
            if failed and first_failure is None:
                first_failure = t
            if first_failure is not None and t - first_failure > 5.0:
                break   # the others had time to report their own error; stop them
            if t > deadline:
                missing = [r for r in range(world) if r not in done and r not in failed]
                raise RankFailed(f"launch: rank(s) {missing} of {world} still running after "
                                 f"{timeout_s} s; finished: {sorted(done)}; failed: "
                                 f"{sorted(failed)}")
        clean = not failed
    finally:  # also on a timeout or Ctrl-C: no rank outlives the launcher
        stuck = []
        for r, p in enumerate(procs):
            p.join(60.0 if clean else 0.5)
            if p.is_alive():
                stuck.append(r)
                p.kill()
                p.join()
        del store  # the rendezvous store lives until every rank has gone
    if failed:
        # the root cause, not a peer's "connection closed" that followed it
        def secondary(r):
            return any(w in failed[r] for w in ("Connection closed", "Connection reset",
                                                "ConnectionReset", "Broken pipe"))
        first = min(failed, key=lambda r: (secondary(r), r))
        others = ", ".join(f"rank {r}: {str(v).strip().splitlines()[-1]}"
                           for r, v in sorted(failed.items()) if r != first)
        raise RankFailed(f"launch: rank {first} of {world} failed:\n{failed[first]}"
                         + (f"\n(also: {others})" if others else ""))
    for r, p in enumerate(procs):
        if r in stuck:  # a hang at exit after a correct run: say so, keep the results
            print(f"warning: rank {r} had not exited 60 s after returning its result; killed",
                  file=sys.stderr)
        elif p.exitcode != 0:
            print(f"warning: rank {r} exited with code {p.exitcode} after returning its "
                  f"result", file=sys.stderr)
    return [done[r] for r in range(world)]


# --- timing ----------------------------------------------------------------------------------

def now() -> tuple[float, float]:
    """(wall, this thread's CPU time) in seconds."""
    return time.perf_counter(), time.thread_time()


def time_calls(fn, n: int, cpu: list | None = None,
               proc: list | None = None) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``fn``; with a list ``cpu``, also appends each
    call's CPU seconds on this thread (compute + Python + dispatch; not the time spent blocked
    on a peer, nor gloo's own threads); with a list ``proc``, each call's CPU seconds of the
    whole process (every thread: gloo's spinning waits included)."""
    out = []
    for _ in range(n):
        p0 = time.process_time()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
        if proc is not None:
            proc.append(time.process_time() - p0)
    return out


def percentile(xs, q: float) -> float:
    """Linear-interpolated ``q``-quantile (0..1) of ``xs``; NaN when empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(samples_s) -> dict:
    """``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``max_ms`` and ``n`` of samples in
    seconds."""
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms) if ms else float("nan"),
            "p10_ms": percentile(ms, 0.1), "p90_ms": percentile(ms, 0.9),
            "min_ms": min(ms, default=float("nan")), "max_ms": max(ms, default=float("nan")),
            "n": len(ms)}


def slowest_rank(per_rank: list) -> list[float]:
    """Lockstep samples: ``per_rank[r][i]`` is rank r's time for call i (the ranks run the calls
    together); call i's sample is the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def write_json(path, obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder made if missing)."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def rotated(names: list, k: int) -> list:
    """``names`` starting at ``k mod len``: every variant takes every position in turn, so none
    always runs right after the same neighbour (cache and scheduler effects even out)."""
    k %= len(names)
    return names[k:] + names[:k]


def interleaved(variants: dict, rounds: int, *, calls: int = 1, warmup: int = 1,
                order: str = "fixed", before=None, per_call: bool = True) -> dict:
    """Time ``variants`` (name -> callable) interleaved: each round runs a block of ``calls``
    calls of every variant, after ``warmup`` untimed calls each. ``order``: ``"fixed"``,
    ``"alternate"`` (reversed every other round) or ``"rotate"`` (:func:`rotated`).
    ``before()`` runs before each block (e.g. ``dist.barrier``). Returns name ->
    ``{"wall": [...], "cpu": [...], "proc": [...]}`` in seconds (``cpu``: this thread's,
    ``proc``: the whole process's, see :func:`time_calls`): every call's (``per_call``) or
    each block's mean per call."""
    for fn in variants.values():
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    out = {name: {"wall": [], "cpu": [], "proc": []} for name in variants}
    names = list(variants)
    for rnd in range(rounds):
        seq = {"fixed": names, "alternate": names if rnd % 2 == 0 else names[::-1],
               "rotate": rotated(names, rnd)}[order]
        for name in seq:
            if before is not None:
                before()
            cpu: list = []
            proc: list = []
            wall = time_calls(variants[name], calls, cpu, proc)
            for key, xs in (("wall", wall), ("cpu", cpu), ("proc", proc)):
                if per_call:
                    out[name][key] += xs
                else:
                    out[name][key].append(sum(xs) / calls)
    return out


def format_table(columns, rows) -> str:
    """A fixed-width text table. ``columns``: ``(title, spec)`` pairs, ``spec`` a format spec
    with a width (``"<31"``, ``">9.3f"``); ``rows``: sequences of values, one per column (None
    prints as a right-aligned ``-``, a str as is, aligned like the column). Columns are joined
    by one space; titles are aligned like their column."""
    def width(spec):
        digits = "".join(c if c.isdigit() else " " for c in spec.split(".")[0]).split()
        return int(digits[0]) if digits else 0

    def align(spec):
        return "<" if spec.startswith("<") else ">"

    def cell(value, spec):
        if value is None:
            return "-".rjust(width(spec))
        if isinstance(value, str):
            return format(value, f"{align(spec)}{width(spec)}")
        return format(value, spec)

    lines = [" ".join(format(t, f"{align(s)}{width(s)}") for t, s in columns)]
    lines += [" ".join(cell(v, s) for v, (_, s) in zip(row, columns)).rstrip() for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(**extra) -> dict:
    """Date (UTC), versions, CPUs and the 1-minute load average, for a report's header."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": cpu_model(),
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], **extra}


def reproduce(script: str) -> str:
    """The command line that reran this script with these flags."""
    return " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])


# --- the hand-written Megatron baseline ------------------------------------------------------

def _wait(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _even(w: torch.Tensor, dim: int, tp: int) -> int:
    if w.shape[dim] % tp:
        raise ValueError(f"hand-written baseline: a weight of shape {list(w.shape)} does not "
                         f"split evenly on dim {dim} over tp={tp}; pick sizes divisible by tp")
    return w.shape[dim] // tp


def shard_rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Column-parallel Linear (output features) or vocab-parallel Embedding: weight dim 0."""
    n = _even(w, 0, tp)
    return w[rank * n:(rank + 1) * n].clone()  # a copy: a dim-0 slice is a view otherwise


def shard_cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Row-parallel Linear (input features) or embedding-dim-sharded Embedding: weight dim 1."""
    n = _even(w, 1, tp)
    return w[:, rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, gradient all-reduced backward (before column-parallel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (after row-parallel), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLast(torch.autograd.Function):
    """All-gather on the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.rank, ctx.n = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits [N, V/tp]`` (this rank's vocab slice, first id ``first``)
    against ``labels [N]`` without gathering the logits: the max, the sum of exponentials and
    the target's logit are all-reduced (Megatron-LM's vocab-parallel loss)."""

    @staticmethod
    def forward(ctx, logits, labels, first, group):
        logits = logits.float()
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        local = labels - first
        mine = (local >= 0) & (local < logits.shape[-1])
        idx = local.clamp(0, logits.shape[-1] - 1)
        target = shifted.gather(1, idx[:, None])[:, 0].masked_fill(~mine, 0.0)
        exp = shifted.exp()
        total = exp.sum(-1)
        both = torch.stack([total, target])
        dist.all_reduce(both, group=group)
        total, target = both[0], both[1]
        ctx.save_for_backward(exp.div_(total[:, None]), idx, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0]), idx] -= mine.to(grad.dtype)
        return grad.mul_(g / grad.shape[0]), None, None, None


class MegatronTP:
    """What every hand-written tensor-parallel baseline shares: this process is ``rank`` of
    ``tp`` in ``group``; the collectives, forward semantics (in-place ``dist.*``; torch's
    functional collectives with ``funcol``, a diagnostic), and with ``trainable`` Megatron-LM's
    backward as autograd functions: ``_f`` (identity forward, all-reduce backward) before a
    column-parallel block, ``_all_reduce`` (g: identity backward) after a row-parallel one,
    ``_gather_last`` (this rank's slice backward)."""

    def __init__(self, rank: int, tp: int, group=None, *, funcol: bool = False,
                 trainable: bool = False):
        self.rank, self.tp, self.group = rank, tp, group
        self.use_funcol, self.trainable = funcol, trainable

    def _f(self, x):
        return _CopyToTP.apply(x, self.group) if self.trainable else x

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            return _ReduceFromTP.apply(x, self.group)
        if self.use_funcol:
            import torch.distributed._functional_collectives as funcol
            return _wait(funcol.all_reduce(x, "sum", group=self.group or dist.group.WORLD))
        dist.all_reduce(x, group=self.group)
        return x

    def _gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            return _GatherLast.apply(x, self.group, self.rank, self.tp)
        if self.use_funcol:
            import torch.distributed._functional_collectives as funcol
            return _wait(funcol.all_gather_tensor(x.contiguous(), gather_dim=x.dim() - 1,
                                                  group=self.group or dist.group.WORLD))
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _params(self, tensors: list) -> list:
        return [torch.nn.Parameter(t) for t in tensors] if self.trainable else tensors


class MegatronLlama(MegatronTP):
    """A Llama (``fxshard.models.llama`` or HuggingFace's: the same state-dict names) written
    by hand for tensor parallelism over ``group`` (this process = ``rank`` of ``tp``), on
    contiguous copies of slices of ``model``'s weights (training them leaves ``model`` as it
    was): column-parallel q/k/v/gate/up (weight dim 0),
    row-parallel o/down (weight dim 1) followed by an all-reduce, ``F.scaled_dot_product_
    attention`` on the local heads, norms whole, lm_head column-parallel.

    ``embedding``: ``"embed_dim"`` (each rank holds ``hidden/tp`` columns; lookup, then an
    all-gather: what fxshard does by default), ``"vocab"`` (Megatron-LM's
    VocabParallelEmbedding: ``vocab/tp`` rows, masked lookup, all-reduce) or ``"replicate"``
    (the whole table, no collective). ``funcol``: torch's functional collectives instead of
    in-place ``dist.*`` (a diagnostic; forward only).

    - ``m(ids)``: logits ``[B, S, V]`` (all-gathered on the last dim);
    - ``m.generate(ids, new, stamps)``: greedy decoding with a static KV cache
      ``[B, kv_heads/tp, capacity, head_dim]`` per layer (written in place with
      ``index_copy_``), the last position's logits gathered; appends :func:`now` at the start,
      after the prefill and after each step to ``stamps``;
    - ``trainable=True``: the slices are ``nn.Parameter``\\s (``m.parameters()``) and the
      collectives autograd functions: Megatron-LM's f (identity forward, all-reduce backward)
      before each column-parallel block, g (all-reduce forward, identity backward) after each
      row-parallel one, the embedding's gather (slice backward); ``m.loss(ids, labels)`` is
      the vocab-parallel cross-entropy on the local logits (they are never gathered).
    """

    def __init__(self, model, rank: int, tp: int, group=None, *, embedding: str = "embed_dim",
                 funcol: bool = False, trainable: bool = False):
        if embedding not in ("embed_dim", "vocab", "replicate"):
            raise ValueError(f"MegatronLlama: embedding={embedding!r}; use 'embed_dim', "
                             f"'vocab' or 'replicate'")
        super().__init__(rank, tp, group, funcol=funcol, trainable=trainable)
        cfg = model.config
        self.cfg, self.embedding = cfg, embedding
        self.eps = cfg.rms_norm_eps
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // \
            cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.gqa = cfg.num_key_value_heads != cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads // tp
        self.hf = hasattr(model.model, "rotary_emb")  # HF's rope module; ours is a function
        if self.hf:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
            self._rotary = model.model.rotary_emb
        else:
            from fxshard.models.llama import apply_rotary_pos_emb
        self._apply_rope = apply_rotary_pos_emb
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        biases = [k for k in sd if k.endswith(".bias")]
        if biases:
            raise ValueError(f"MegatronLlama: the model has biases ({biases[0]}, ...), which "
                             f"this baseline does not apply; use a config without biases")
        if trainable and getattr(cfg, "tie_word_embeddings", False):
            raise NotImplementedError("MegatronLlama(trainable=True): tied embeddings would "
                                      "train as two parameters; use tie_word_embeddings=False")
        if cfg.num_key_value_heads % tp:
            raise ValueError(f"MegatronLlama: {cfg.num_key_value_heads} key/value heads do not "
                             f"split over tp={tp}")

        table = sd["model.embed_tokens.weight"]
        self.vocab = table.shape[0] // tp           # this rank's rows of the vocabulary
        self.first = rank * self.vocab
        self.embed = {"embed_dim": shard_cols, "vocab": shard_rows,
                      "replicate": lambda w, r, t: w.clone()}[embedding](table, rank, tp)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                wq=shard_rows(sd[p + "self_attn.q_proj.weight"], rank, tp),
                wk=shard_rows(sd[p + "self_attn.k_proj.weight"], rank, tp),
                wv=shard_rows(sd[p + "self_attn.v_proj.weight"], rank, tp),
                wo=shard_cols(sd[p + "self_attn.o_proj.weight"], rank, tp),
                wg=shard_rows(sd[p + "mlp.gate_proj.weight"], rank, tp),
                wu=shard_rows(sd[p + "mlp.up_proj.weight"], rank, tp),
                wd=shard_cols(sd[p + "mlp.down_proj.weight"], rank, tp),
                ln1=sd[p + "input_layernorm.weight"].clone(),
                ln2=sd[p + "post_attention_layernorm.weight"].clone()))
        self.norm = sd["model.norm.weight"].clone()
        self.lm_head = shard_rows(sd["lm_head.weight"], rank, tp)
        if trainable:
            P = torch.nn.Parameter
            self.embed, self.norm, self.lm_head = P(self.embed), P(self.norm), P(self.lm_head)
            self.layers = [{k: P(v) for k, v in L.items()} for L in self.layers]

    def parameters(self) -> list:
        return [self.embed, *(w for L in self.layers for w in L.values()), self.norm,
                self.lm_head]

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients over the tp group: sharded ones summed over
        ranks, replicated ones (norms; a replicated table) counted once."""
        whole = {id(self.norm), *(id(L[k]) for L in self.layers for k in ("ln1", "ln2"))}
        if self.embedding == "replicate":
            whole.add(id(self.embed))
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.parameters():
            if p.grad is not None and (id(p) not in whole or self.rank == 0):
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt().item()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _embed(self, ids):
        if self.embedding == "embed_dim":
            return self._gather_last(F.embedding(ids, self.embed))
        if self.embedding == "replicate":
            return F.embedding(ids, self.embed)
        local = ids - self.first                     # Megatron-LM's VocabParallelEmbedding
        outside = (local < 0) | (local >= self.vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        x = x.masked_fill(outside[..., None], 0.0) if self.trainable else \
            x.masked_fill_(outside[..., None], 0.0)
        return self._all_reduce(x)

    def _rope(self, x, pos: int, seq: int):
        if self.hf:
            return self._rotary(x, torch.arange(pos, pos + seq, device="cpu")[None])
        from fxshard.models.llama import rope_cos_sin
        positions = None if pos == 0 else torch.arange(pos, pos + seq, device="cpu")[None]
        return rope_cos_sin(seq, self.head_dim, self.cfg.rope_theta, device=x.device,
                            dtype=x.dtype, position_ids=positions)

    def hidden(self, ids, pos: int = 0, caches=None) -> torch.Tensor:
        """The last norm's input ``[B, S, hidden]`` (replicated); ``caches``: per layer a
        ``(k, v)`` pair written at positions ``pos ..`` and attended to up to there."""
        bsz, seq = ids.shape
        d = self.head_dim
        x = self._embed(ids)
        cos, sin = self._rope(x, pos, seq)
        where = torch.arange(pos, pos + seq, device="cpu") if caches is not None else None
        for i, L in enumerate(self.layers):
            h = self._f(self._rms(x, L["ln1"]))
            q = F.linear(h, L["wq"]).view(bsz, seq, -1, d).transpose(1, 2)
            k = F.linear(h, L["wk"]).view(bsz, seq, -1, d).transpose(1, 2)
            v = F.linear(h, L["wv"]).view(bsz, seq, -1, d).transpose(1, 2)
            q, k = self._apply_rope(q, k, cos, sin)
            if caches is not None:
                kc, vc = caches[i]
                kc.index_copy_(2, where, k)
                vc.index_copy_(2, where, v)
                k, v = kc[:, :, :pos + seq], vc[:, :, :pos + seq]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, scale=self.scale,
                                               enable_gqa=self.gqa)
            o = F.linear(a.transpose(1, 2).reshape(bsz, seq, -1), L["wo"])
            x = x + self._all_reduce(o)
            h = self._f(self._rms(x, L["ln2"]))
            m = F.linear(F.silu(F.linear(h, L["wg"])) * F.linear(h, L["wu"]), L["wd"])
            x = x + self._all_reduce(m)
        return x

    def local_logits(self, x) -> torch.Tensor:
        """This rank's vocab slice of the logits of hidden states ``x``."""
        return F.linear(self._f(self._rms(x, self.norm)), self.lm_head)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self._gather_last(self.local_logits(self.hidden(ids)))

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, vocab-parallel (``labels [B, S]`` already shifted)."""
        logits = self.local_logits(self.hidden(ids))
        return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                                labels.reshape(-1), self.first, self.group)

    def _next(self, ids, pos, caches):
        x = self.hidden(ids, pos, caches)
        return self._gather_last(self.local_logits(x[:, -1])).argmax(-1)

    def generate(self, ids, new: int, stamps: list):
        bsz, prompt = ids.shape
        caches = [(torch.zeros(bsz, self.kv_heads, prompt + new, self.head_dim, device="cpu"),
                   torch.zeros(bsz, self.kv_heads, prompt + new, self.head_dim, device="cpu"))
                  for _ in self.layers]
        stamps.append(now())
        tokens = [ids]
        nxt = self._next(ids, 0, caches)
        for t in range(new - 1):
            tokens.append(nxt[:, None])
            stamps.append(now())
            nxt = self._next(nxt[:, None], prompt + t, caches)
        tokens.append(nxt[:, None])
        stamps.append(now())
        return torch.cat(tokens, 1)


class MegatronBlocks(MegatronTP):
    """:func:`tutorial_blocks` written by hand for tensor parallelism: per block, wq/wk/wv
    column-parallel (this rank's rows of each weight and bias), their sum local, wo row-parallel
    then an all-reduce and wo's whole bias; w1 column-parallel, GELU, w2 row-parallel, an
    all-reduce, w2's bias (Megatron-LM's RowParallelLinear adds the bias after the reduce): two
    all-reduces a block. ``m(x)``: ``[B, S, hidden]``, replicated."""

    def __init__(self, model, rank: int, tp: int, group=None, *, trainable: bool = False):
        super().__init__(rank, tp, group, trainable=trainable)
        self.blocks = []
        for blk in model:
            att, mlp = blk.attention, blk.mlp
            w = [shard_rows(att.wq.weight.detach(), rank, tp),
                 shard_rows(att.wk.weight.detach(), rank, tp),
                 shard_rows(att.wv.weight.detach(), rank, tp),
                 shard_rows(att.wq.bias.detach(), rank, tp),
                 shard_rows(att.wk.bias.detach(), rank, tp),
                 shard_rows(att.wv.bias.detach(), rank, tp),
                 shard_cols(att.wo.weight.detach(), rank, tp), att.wo.bias.detach().clone(),
                 shard_rows(mlp.w1.weight.detach(), rank, tp),
                 shard_rows(mlp.w1.bias.detach(), rank, tp),
                 shard_cols(mlp.w2.weight.detach(), rank, tp), mlp.w2.bias.detach().clone()]
            self.blocks.append(self._params(w))

    def parameters(self) -> list:
        return [t for b in self.blocks for t in b]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for wq, wk, wv, bq, bk, bv, wo, bo, w1, b1, w2, b2 in self.blocks:
            h = self._f(x)
            a = F.linear(h, wq, bq) + F.linear(h, wk, bk) + F.linear(h, wv, bv)
            x = self._all_reduce(F.linear(a, wo)) + bo
            h = self._f(x)
            x = self._all_reduce(F.linear(F.gelu(F.linear(h, w1, b1)), w2)) + b2
        return x


# --- the DTensor baseline --------------------------------------------------------------------

def dtensor_tp_plan(model, *, embedding_and_head: bool = True, loss_parallel: bool = False):
    """The one ``parallelize_module`` plan. For :func:`tutorial_blocks`: ColwiseParallel
    wq/wk/wv/w1, RowwiseParallel wo/w2. For a Llama: ColwiseParallel q/k/v/gate/up,
    RowwiseParallel o/down; with ``embedding_and_head``, the embedding and lm_head
    ColwiseParallel with Replicate output (what fxshard shards too). ``loss_parallel``
    (training, torchtitan's recipe): the embedding RowwiseParallel (vocab-sharded), the lm_head's
    output left sharded on the vocab as a DTensor for ``torch.distributed.tensor.parallel.
    loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not hasattr(model, "config"):  # tutorial_blocks: the lesson's own plan
        plan = {}
        for i in range(len(model)):
            for name in ("attention.wq", "attention.wk", "attention.wv", "mlp.w1"):
                plan[f"{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "mlp.w2"):
                plan[f"{i}.{name}"] = RowwiseParallel()
        return plan
    plan = {}
    if loss_parallel:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    elif embedding_and_head:
        plan["model.embed_tokens"] = ColwiseParallel(output_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = RowwiseParallel()
    return plan


def dtensor_tp(model, device_mesh, *, embedding_and_head: bool = True):
    """A copy of ``model`` tensor-parallel by ``parallelize_module`` with
    :func:`dtensor_tp_plan`, on a 1-D ``torch.distributed`` device mesh."""
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(copy.deepcopy(model), device_mesh,
                              dtensor_tp_plan(model, embedding_and_head=embedding_and_head))


def dtensor_train(model, device_mesh, *, tp_axis: str | None = "tp",
                  fsdp_axis: str | None = "fsdp"):
    """A trainable copy of ``model`` by torchtitan's 2-D recipe: ``parallelize_module`` on the
    ``tp_axis`` sub-mesh (:func:`dtensor_tp_plan` with ``loss_parallel``), then
    ``fully_shard`` (FSDP2) of every decoder layer and of the root on the ``fsdp_axis`` sub-mesh
    (parameters sharded on dim 0, all-gathered before use and again in backward, gradients
    reduce-scattered). Either axis may be None. Train mode, fp32. Use :func:`dtensor_loss` for
    the loss."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    m = copy.deepcopy(model).train()
    if tp_axis is not None:
        parallelize_module(m, device_mesh[tp_axis], dtensor_tp_plan(model, loss_parallel=True))
    if fsdp_axis is not None:
        mesh = device_mesh[fsdp_axis]
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    m._fxshard_bench_loss_parallel = tp_axis is not None
    return m


def dtensor_loss(m, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of :func:`dtensor_train`'s model; under tp the logits stay
    vocab-sharded (``loss_parallel``). Call ``.backward()`` inside :func:`dtensor_backward`."""
    out = m(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def dtensor_step(m, opt, ids, labels, norms: list | None = None) -> float:
    """One forward + backward + optimizer step of :func:`dtensor_train`'s model; with a list
    ``norms``, appends the global gradient norm (before the step) to it."""
    from contextlib import nullcontext
    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel() if m._fxshard_bench_loss_parallel else nullcontext():
        loss = dtensor_loss(m, ids, labels)
        loss.backward()
    if norms is not None:  # each gradient gathered whole (its meshes differ under TP + FSDP)
        sq = sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 .double().pow(2).sum() for p in m.parameters())
        norms.append(float(sq) ** 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()


def megatron_step(m: MegatronLlama, opt, ids, labels, dp_group=None,
                  norms: list | None = None) -> float:
    """One forward + backward + optimizer step of a trainable :class:`MegatronLlama` on this
    rank's batch. With ``dp_group`` (data parallel: each dp rank holds a slice of the batch),
    the gradients are averaged over it in one flattened all-reduce (DDP's single bucket)
    before the step. With a list ``norms``, appends the global gradient norm (before the
    step). Returns this rank's loss."""
    loss = m.loss(ids, labels)
    loss.backward()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        grads = [p.grad for p in m.parameters()]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat /= dist.get_world_size(dp_group)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)
    if norms is not None:
        norms.append(m.grad_norm())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
