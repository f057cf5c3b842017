"""``pm.explain()``: what each rank runs, communicates and holds, as data and as tables.

Bytes are per rank and per forward. ``tensor bytes`` is the size of the local tensor handed to
the collective; ``wire bytes`` is what a ring algorithm sends per rank: ``2(n-1)/n`` of it for
an all-reduce, ``(n-1)/n`` of the gathered/scattered/exchanged size otherwise, the whole
message for send/recv, and ``n-1`` K/V chunks for ring attention. With tensor parallelism over
``t`` ranks that gives the textbook ``4(t-1)/t * b*s*h*B`` per layer, with a ring of ``p`` ranks
``2(p-1)/p * b*s*h_kv*B``.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from .passes.cast_params import working_copy_bytes
from .placement import Shard, local_shape, shard_slices, short_spec
from .mesh import TP

__all__ = ["Explanation", "explain", "explain_training", "COLLECTIVES", "LEGEND"]

# printed under the title of every plan: what the placements and the two byte columns mean
LEGEND = """\
Legend
  placement per mesh axis (pp places whole layers: see the stage column)
    S(d)      split on tensor dim d across the axis's ranks
    S(d|a+b)  a fused weight (qkv_proj, gate_up_proj) split part by part: its a- and b-long
              parts of dim d each split on their own, so the model's later split stays local
    R         replicated: whole on every rank of the axis
    P         partial sum: each rank holds a term; an all-reduce or reduce-scatter adds them
  tensor bytes  the local tensor handed to the collective
  wire bytes    what one rank moves over the links with a ring algorithm: 2(n-1)/n of it for
                an all-reduce, (n-1)/n of the gathered or scattered size otherwise, the whole
                message for send/recv, n-1 K/V chunks for ring attention (n = axis size);
                its backward adds n hops of their float32 gradients;
                local_shard / zigzag_shard take a rank's slice: no communication, 0 bytes"""

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "local_shard",
               "partial_from_replicate", "send", "recv", "ring_attention", "zigzag_shard",
               "zigzag_gather", "sharded_argmax", "ring_attention_backward",
               "all_gather_bucket", "reduce_scatter_bucket", "expert_counts", "expert_dispatch",
               "expert_combine")


_LOCAL = ("local_shard", "partial_from_replicate", "zigzag_shard")  # no communication


@dataclass
class CollectiveInfo:
    node: str
    op: str
    axis: str
    size: int
    shape: tuple            # local input shape
    tensor_bytes: int
    wire_bytes: int
    module: str = ""        # the model module the collective belongs to ("model.layers.3.mlp")
    peer: int = -1          # send/recv: the other end's coordinate on the axis (its stage)


@dataclass
class Explanation:
    mesh: str
    ranks: int
    collectives: dict = field(default_factory=dict)     # rank -> [CollectiveInfo]
    param_bytes: dict = field(default_factory=dict)     # rank -> bytes
    total_param_bytes: int = 0
    placements: list = field(default_factory=list)      # (fqn, spec, local shape, stage)
    fallbacks: list = field(default_factory=list)
    replicated: list = field(default_factory=list)      # (weight FQN, why it stays whole on tp)
    partly_whole: dict = field(default_factory=dict)    # fused weight FQN -> parts kept whole
    padded: dict = field(default_factory=dict)          # vocab-padded FQN -> the model's shape
    fsdp_whole: list = field(default_factory=list)      # (FQN, shape, bytes per rank, why) of
    #                                                     the parameters stored whole on fsdp
    gathered: list = field(default_factory=list)        # (node, why a CP axis gathers there)
    passes: dict = field(default_factory=dict)          # pass -> {what: count} it changed
    microbatches: int = 1                               # runs of each program per forward
    unmatched_plan: list = field(default_factory=list)  # plan globs that matched no module
    stages: dict = field(default_factory=dict)          # rank -> pipeline stage
    slices: dict = field(default_factory=dict)          # rank -> [(fqn, global index)] of
    #                                                     the first sharded weights it holds
    sliced: dict = field(default_factory=dict)          # rank -> how many weights it holds a
    #                                                     slice of (``slices`` shows 3)
    mesh_shape: tuple = ()
    axis_names: tuple = ()
    kv_cache_bytes: dict = field(default_factory=dict)  # rank -> KV-cache bytes per cached
    #                                                     position (a generate program only)
    backward: dict = field(default_factory=dict)        # rank -> [CollectiveInfo] of the
    #                                                     backward program (a training program)
    train_memory: dict = field(default_factory=dict)    # rank -> {"parameters", "gradients",
    #                                                     "adamw_state", "saved": bytes}

    def save(self, path: str) -> str:
        """Draw the plan to ``path`` (``.svg``, ``.png`` or ``.pdf``; needs matplotlib,
        ``pip install 'fxshard[plot]'``): the mesh with each rank's weight slices, the
        collectives per layer with their bytes, and the pipeline schedule. Returns ``path``."""
        from .plot import draw_plan
        return draw_plan(self, path)

    def counts(self, rank: int = 0) -> Counter:
        """``{(op, axis): count}`` of rank ``rank``'s collectives per forward (local slices
        excluded; a program that runs once per microbatch counts that many times)."""
        return Counter({k: n * self.microbatches for k, n in Counter(
            (c.op, c.axis) for c in self.collectives[rank] if c.op not in _LOCAL).items()})

    def stage_layers(self) -> dict[int, tuple[int, int]]:
        """``{stage: (first layer, last layer)}`` of the layer stack's weights on each pipeline
        stage (from the placements; a stage without layers is absent)."""
        out: dict[int, tuple[int, int]] = {}
        for fqn, _spec, _shape, stage in self.placements:
            m = re.search(r"\.(\d+)\.", fqn)
            if m:
                n = int(m.group(1))
                lo, hi = out.get(stage, (n, n))
                out[stage] = (min(lo, n), max(hi, n))
        return out

    def _group_label(self, ranks: list[int]) -> str:
        """``ranks 0,2`` and, with pipeline stages, ``(stage 0: layers 0-1)``."""
        label = f"ranks {_ranges(ranks)}"
        stages = sorted({self.stages.get(r, 0) for r in ranks})
        if max(self.stages.values(), default=0) == 0:
            return label
        layers = self.stage_layers()
        parts = []
        for s in stages:
            lo, hi = layers.get(s, (None, None))
            span = "" if lo is None else f": layer {lo}" if lo == hi else f": layers {lo}-{hi}"
            parts.append(f"stage {s}{span}")
        return f"{label} ({'; '.join(parts)})"

    def __str__(self) -> str:
        lines = [f"fxshard plan on mesh {self.mesh} ({self.ranks} ranks)", "", LEGEND, ""]
        per = f"; {self.microbatches} microbatches" if self.microbatches > 1 else ""
        lines.append(f"Collectives per rank per forward (op, axis: count, tensor bytes, wire "
                     f"bytes){per}")
        ops = [c.op for cs in [*self.collectives.values(), *self.backward.values()] for c in cs]
        w = max([15] + [len(op) for op in ops])   # the op column (bucket ops are long)
        shown: dict[tuple, list] = {}
        for r, cs in self.collectives.items():
            key = tuple((c.op, c.axis, c.tensor_bytes) for c in cs)
            shown.setdefault(key, []).append(r)
        for key, ranks in shown.items():
            cs = self.collectives[ranks[0]]
            agg: dict[tuple, list] = {}
            for c in cs:
                a = agg.setdefault((c.op, c.axis), [0, 0, 0])
                a[0] += self.microbatches
                a[1] += c.tensor_bytes * self.microbatches
                a[2] += c.wire_bytes * self.microbatches
            lines.append(f"  {self._group_label(ranks)}:")
            if not agg:
                lines.append("    (none)")
            for (op, axis), (n, tb, wb) in sorted(agg.items()):
                lines.append(f"    {op:{w}s} {axis:11s} {n:5d}  {tb:>14,d}  {wb:>14,d}")
        dyn = sorted({f"{c.op} {c.axis} {tuple(c.shape)}" for cs in self.collectives.values()
                      for c in cs if data_dependent(c.shape)})
        if dyn:
            lines.append(f"  data-dependent sizes (counted as 0 bytes above): {', '.join(dyn)}")
        if self.backward:
            lines += ["", "Backward collectives per rank per step (op, axis: count, tensor "
                          "bytes, wire bytes)"]
            for r, cs in self.backward.items():
                if r and cs == self.backward[0]:
                    continue
                lines.append(f"  {'every rank' if r == 0 else f'rank {r}'}:")
                agg: dict[tuple, list] = {}
                for c in cs:
                    a = agg.setdefault((c.op, c.axis), [0, 0, 0])
                    a[0], a[1], a[2] = a[0] + 1, a[1] + c.tensor_bytes, a[2] + c.wire_bytes
                lines += [f"    {op:{w}s} {axis:11s} {n:5d}  {tb:>14,d}  {wb:>14,d}"
                          for (op, axis), (n, tb, wb) in sorted(agg.items())] or ["    (none)"]
        if self.train_memory:
            lines += ["", "Training memory per rank (bytes: parameters, gradients, AdamW state "
                          "= 2x parameters, activations saved for the backward in their dtypes;"
                          " param_dtype_copies: a mixed-precision policy's at the peak)"]
            same: dict[tuple, list] = {}
            for r, m in self.train_memory.items():
                same.setdefault(tuple(m.items()), []).append(r)
            for m, ranks in same.items():
                lines.append(f"  {self._group_label(ranks)}: " +
                             ", ".join(f"{k} {v:,d}" for k, v in m))
        lines += ["", f"Parameter bytes per rank (total unsharded {self.total_param_bytes:,d})"]
        by_bytes: dict[int, list] = {}
        for r, b in self.param_bytes.items():
            by_bytes.setdefault(b, []).append(r)
        for b, ranks in by_bytes.items():
            lines.append(f"  {self._group_label(ranks)}: {b:,d}")
        if self.kv_cache_bytes:
            lines += ["", "KV cache bytes per rank per cached position (all sequences of the "
                          "batch; ring_cp ranks hold every n-th position)"]
            by_bytes = {}
            for r, b in self.kv_cache_bytes.items():
                by_bytes.setdefault(b, []).append(r)
            for b, ranks in by_bytes.items():
                lines.append(f"  {self._group_label(ranks)}: {b:,d}")
        lines += ["", "Placements of weights (stage, placement per axis, local shape)"]
        for fqn, spec, shape, stage in self.placements:
            lines.append(f"  {fqn:50s} {stage:>5d}  {spec:20s} {shape}")
        lines += ["", f"Weights kept whole on tp: {len(self.replicated)}"]
        lines += [f"  {fqn}: {why}" for fqn, why in self.replicated]
        if self.partly_whole:
            lines += ["", f"Fused weights with parts kept whole on tp: {len(self.partly_whole)}"]
            lines += [f"  {fqn}: {why}" for fqn, why in self.partly_whole.items()]
        if self.padded:
            lines += ["", f"Vocab padded for tp (rows past the model's are zeros no result "
                          f"reads; the model, its outputs and checkpoints keep its own): "
                          f"{len(self.padded)}"]
            lines += [f"  {fqn}: {shape[0]} -> {shape[0] + pad} rows"
                      for fqn, (shape, pad) in sorted(self.padded.items())]
        if self.fsdp_whole:
            lines += ["", f"Parameters kept whole on fsdp (no dim takes a shard; gradient "
                          f"all-reduced): {len(self.fsdp_whole)}, "
                          f"{sum(b for _, _, b, _ in self.fsdp_whole):,d} bytes per rank"]
            lines += [f"  {fqn} {shape}: {b:,d} bytes per rank; {why}"
                      for fqn, shape, b, why in self.fsdp_whole]
        if self.gathered:
            lines += ["", f"Attention not lowered on the CP axes (sequence gathered): "
                          f"{len(self.gathered)}"]
            lines += [f"  {node}: {why}" for node, why in self.gathered]
        lines += ["", f"Ops without a sharding rule (run replicated): {len(self.fallbacks)}"]
        lines += [f"  {f}" for f in self.fallbacks]
        if self.unmatched_plan:
            lines += ["", f"Plan patterns that match no module (ignored): "
                          f"{', '.join(map(repr, self.unmatched_plan))}"]
        lines += ["", "Passes"] + [f"  {p}: " + ", ".join(f"{n} {what.replace('_', ' ')}"
                                                          for what, n in counts.items())
                                   for p, counts in self.passes.items()]
        return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _wire(op: str, n: int, in_bytes: int) -> int:
    if op == "all_reduce":
        return 2 * (n - 1) * in_bytes // n
    if op in ("all_gather", "zigzag_gather", "all_gather_bucket"):
        return (n - 1) * in_bytes
    if op in ("reduce_scatter", "all_to_all", "reduce_scatter_bucket", "expert_counts",
              "expert_dispatch", "expert_combine"):   # the experts': under uniform routing
        return (n - 1) * in_bytes // n
    if op in ("send", "recv"):
        return in_bytes
    return 0


def data_dependent(shape) -> bool:
    """``shape`` has a size known only when the program runs (``torch.where(mask)``, ``nonzero``:
    an unbacked symbol such as ``u0``)."""
    return any(not isinstance(n, int) and getattr(n, "node", None) is not None and
               not n.node.has_hint() for n in shape)


def _numel(shape) -> int:
    """Elements of ``shape``; 0 for a data-dependent shape (``explain()`` says so, see
    :func:`data_dependent`), never a guard on an unbacked size."""
    if data_dependent(shape):
        return 0
    return int(torch.Size([int(n) for n in shape]).numel())


def collectives_of(graph, mesh) -> list[CollectiveInfo]:
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith("fxshard."):
            continue
        op = str(node.target).split(".")[1]
        if op not in COLLECTIVES:
            continue
        x = node.args[0]
        if op == "ring_attention":  # K and V chunks travel n - 1 steps around the ring
            k = node.args[1]
            axis = node.args[5]
            size = mesh.axis_size(axis)
            shape = local_shape(tuple(k.meta["val"].shape), k.meta["fxshard_spec"], mesh)
            nbytes = 2 * _numel(shape) * k.meta["val"].element_size()
            out.append(CollectiveInfo(node.name, op, axis, size, shape, nbytes,
                                      (size - 1) * nbytes, _module_of(node)))
            continue
        if op == "ring_attention_backward":   # K, V and their float32 gradients travel
            k, v = node.args[2], node.args[3]     # n - 1 steps; the gradients one more home
            axis = node.args[8]
            size = mesh.axis_size(axis)
            kv = [local_shape(tuple(t.meta["val"].shape), t.meta["fxshard_spec"], mesh)
                  for t in (k, v)]
            chunk = sum(_numel(s) for s in kv) * k.meta["val"].element_size()
            grads = sum(_numel(s) for s in kv) * (8 if k.meta["val"].dtype == torch.float64
                                                  else 4)
            out.append(CollectiveInfo(node.name, op, axis, size, kv[0], chunk + grads,
                                      (size - 1) * chunk + size * grads, _module_of(node)))
            continue
        if op == "sharded_argmax":  # one (value, index) float64 pair per row, all-gathered
            axis = node.args[1]
            size = mesh.axis_size(axis)
            rows = local_shape(tuple(x.meta["val"].shape), x.meta["fxshard_spec"], mesh)[:-1]
            shape = (2, *rows)
            nbytes = _numel(shape) * torch.float64.itemsize
            out.append(CollectiveInfo(node.name, op, axis, size, shape, nbytes,
                                      (size - 1) * nbytes, _module_of(node)))
            continue
        if op in ("all_gather_bucket", "reduce_scatter_bucket"):   # one flat buffer of them
            axis = node.args[2]
            size = mesh.axis_size(axis)
            numel = sum(_numel(local_shape(tuple(t.meta["val"].shape), t.meta["fxshard_spec"],
                                           mesh)) for t in x)
            nbytes = numel * x[0].meta["val"].dtype.itemsize
            out.append(CollectiveInfo(node.name, op, axis, size, (numel,), nbytes,
                                      _wire(op, size, nbytes), node.meta.get("fxshard_bucket", "")))
            continue
        peer = -1
        if op == "recv":
            shape, dtype = tuple(node.args[0]), node.args[1]
            axis, size, peer = node.args[3], mesh.axis_size(node.args[3]), node.args[4]
        else:
            val, spec = x.meta["val"], x.meta["fxshard_spec"]
            shape, dtype = local_shape(tuple(val.shape), spec, mesh), val.dtype
            axis = node.args[-2] if op != "send" else node.args[1]
            size = mesh.axis_size(axis)
            peer = node.args[2] if op == "send" else -1
        if op == "expert_combine":   # the rows sent back: those dispatched, not the bound
            shape = (shape[0] // size, *shape[1:])
        nbytes = _numel(shape) * dtype.itemsize
        # the gather of the model's output on dp or a CP axis belongs to no module ("")
        output_gather = (op in ("all_gather", "zigzag_gather") and axis != TP
                         and any(u.op == "output" for u in node.users))
        out.append(CollectiveInfo(node.name, op, axis, size, shape, nbytes,
                                  _wire(op, size, nbytes),
                                  "" if output_gather else _module_of(node), peer))
    return out


def _module_of(node) -> str:
    """The deepest model module of ``node`` or of the value it moves (inserted collectives
    have no module of their own; their input does, possibly through other inserted ones)."""
    for n in [node, *[a for a in node.args if hasattr(a, "meta")]]:
        stack = n.meta.get("nn_module_stack")
        if stack:
            return list(stack.values())[-1][0]
    todo, seen = [a for a in node.args if hasattr(a, "meta")], set()
    while todo:
        n = todo.pop(0)
        if n in seen or not str(n.target).startswith("fxshard."):
            continue
        seen.add(n)
        for a in (a for a in n.args if hasattr(a, "meta")):
            stack = a.meta.get("nn_module_stack")
            if stack:
                return list(stack.values())[-1][0]
            todo.append(a)
    return ""


def explain(pm, compiled) -> Explanation:
    mesh = pm.spec
    programs = getattr(compiled, "programs", None) or [compiled.program]
    alive = {n.name for p in programs for n in p.graph.nodes}
    ex = Explanation(mesh=mesh.describe(), ranks=mesh.world_size, mesh_shape=tuple(mesh.shape),
                     axis_names=tuple(mesh.axis_names),
                     fallbacks=[f for f in compiled.ctx.fallbacks if f.split(":")[0] in alive],
                     passes={p: dict(c) for p, c in compiled.ctx.reports.items()},
                     replicated=list(getattr(compiled.ctx, "replicated", [])),
                     partly_whole=dict(getattr(compiled.ctx, "partly_whole", {})),
                     padded=_padded(compiled.programs, getattr(compiled.ctx, "padded", {})),
                     fsdp_whole=list(getattr(compiled.ctx, "fsdp_whole", [])),
                     gathered=list(getattr(compiled.ctx, "gathered", [])),
                     microbatches=getattr(pm, "microbatches", 1),
                     unmatched_plan=list(getattr(pm, "unmatched_plan", [])))
    stage_of = pm.stage_of if hasattr(pm, "stage_of") else (lambda r: 0)
    per_stage = {p.stage: collectives_of(p.graph, mesh) for p in programs}
    seen = set()
    for r in range(mesh.world_size):
        prog = programs[stage_of(r)] if len(programs) > 1 else programs[0]
        ex.collectives[r] = per_stage[prog.stage]
        ex.stages[r] = prog.stage
        sharded = [s for s in prog.slots.values()
                   if s.kind == "param" and any(isinstance(p, Shard) and n > 1 for n, p
                                                in zip(mesh.shape, s.spec))]
        ex.slices[r] = [(s.fqn, shard_slices(s.shape, s.spec, mesh, r)) for s in sharded[:3]]
        ex.sliced[r] = len(sharded)
        total = 0
        for s in prog.slots.values():
            if s.kind != "param":
                continue
            numel = int(torch.Size(local_shape(s.shape, s.spec, mesh)).numel())
            total += numel * s.dtype.itemsize
        ex.param_bytes[r] = total
        if prog.kv_caches:
            ex.kv_cache_bytes[r] = ex.microbatches * sum(
                shape[0] * shape[1] * shape[3] * dtype.itemsize
                for _, shape, dtype in prog.kv_caches)
    for prog in programs:
        for s in prog.slots.values():
            if s.kind != "param":
                continue
            if s.fqn not in seen:
                seen.add(s.fqn)
                ex.total_param_bytes += int(torch.Size(s.shape).numel()) * s.dtype.itemsize
            ex.placements.append((s.fqn, short_spec(s.spec, mesh),
                                  local_shape(s.shape, s.spec, mesh), prog.stage))
    return ex


def _padded(programs, padded: dict) -> dict:
    """FQN -> (the model's shape, rows added) of each weight a program holds padded."""
    out = {}
    for program in programs:
        for fqn, slot in program.slots.items():
            if fqn in padded and tuple(slot.shape) != tuple(padded[fqn]):
                out[fqn] = (tuple(padded[fqn]), slot.shape[0] - padded[fqn][0])
    return out


def explain_training(pm, tm) -> Explanation:
    """:func:`explain` of the training program ``pm(x)`` with grad runs (the forward rank
    program's collectives and placements), plus the backward's collectives with their bytes
    and the memory per rank a step holds: parameters, gradients, AdamW's two moments and
    the saved activations (measured by the last forward, else from the program's shapes)."""
    from types import SimpleNamespace
    from .passes.emit import Program, Slot
    program = tm._last
    mesh = pm.spec
    params = {n for n, _ in pm.model.named_parameters(remove_duplicate=False)}
    dtypes = {n: t.dtype for n, t in tm._shards[tm.ranks[0]].items()}
    slots = {f: Slot(f, "param" if f in params else "buffer", tuple(spec),
                     program.shapes[f], dtypes[f]) for f, spec in program.specs.items()}
    forward = Program(graph=program.split.forward.graph, slots=slots)
    ctx = SimpleNamespace(fallbacks=list(program.ctx.fallbacks), reports=program.reports,
                          replicated=list(getattr(program.ctx, "replicated", [])), gathered=[],
                          fsdp_whole=list(getattr(program.ctx, "fsdp_whole", [])),
                          padded=dict(program.padded))
    ex = explain(SimpleNamespace(spec=mesh, microbatches=1,
                                 unmatched_plan=getattr(pm, "unmatched_plan", [])),
                 SimpleNamespace(programs=[forward], ctx=ctx))
    backward = collectives_of(program.split.backward.graph, mesh)
    saved = 0
    for n in program.split.backward.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and n.name.startswith("saved") and \
                isinstance(v, torch.Tensor):
            shape = local_shape(tuple(v.shape), n.meta["fxshard_spec"], mesh)
            saved += int(torch.Size(shape).numel()) * v.element_size()
    measured = getattr(tm, "_saved_bytes", None) or {}
    copies = working_copy_bytes(program.split.forward, mesh)   # a mixed-precision policy's
    for r in range(mesh.world_size):
        ex.backward[r] = backward
        p = ex.param_bytes[r]
        ex.train_memory[r] = {"parameters": p, "gradients": p, "adamw_state": 2 * p,
                              "saved": measured.get(r, saved),
                              **({"param_dtype_copies": copies} if copies else {})}
    return ex
