"""``fxshard.estimate``: memory and step time of one configuration, from its rank programs.

::

    with fxshard.init_empty_weights():
        model = LlamaForCausalLM(config)                     # meta: no weights
    e = fxshard.estimate(model, mesh={"fsdp": 8, "tp": 8}, hardware="h100", batch=64,
                         seq=8192, mixed_precision="bf16")
    e.memory["peak"], e.step_time["total"], e.tokens_per_second
    print(e)

How (each step is real fxshard output priced by :class:`~fxshard.plan.hardware.Hardware`):

1. :mod:`fxshard.plan.units` builds the forward and backward rank programs of one layer
   (the loss traced with the model: vocab-parallel cross-entropy) and
   :mod:`fxshard.plan.costs` reads their FLOPs, bytes, collectives and live bytes.
2. Compute: each node's time is ``max(flops / achieved flop/s, bytes / achieved bandwidth)``;
   a stage of ``L`` layers costs ``rest + L * layer`` (the rest: embedding, final norm, head,
   loss; counted on the slowest stage).
3. Communication, per collective: ``steps * latency + wire bytes / bandwidth`` of its link
   level: an axis whose group of ranks fits in one node (axes nest as listed, the last
   innermost) uses ``intra_node``, else ``inter_node``. tp / sequence / context-parallel
   collectives sit on the critical path (exposed). A weight's all-gather and a gradient's
   reduction (dp, fsdp) run behind the compute of their program (fxshard prefetches one
   gather ahead and reduces gradients as soon as they are ready): exposed is what exceeds
   that compute, and at least one layer's worth (the last reduction has nothing to hide
   behind).
4. Pipeline: the schedule's own order of forwards and backwards
   (:func:`fxshard.training.schedules.actions`) played out with those stage times and a
   send/recv per microbatch and direction; the bubble is what the timeline adds to the
   busy time, and the most microbatches a rank holds at once scale the saved activations.
5. Memory per device: parameters, gradients (float32, as the parameters), optimizer state
   (AdamW/Adam: 2x parameters; SGD: none), activations (the saved values of the microbatches
   in flight plus the largest live set of the programs' walk), communication buffers
   (gathered fsdp weights alive at the peak).

Mixed precision: ``mixed_precision="bf16"`` (or a policy with ``param_dtype=torch.bfloat16``)
is costed analytically until fxshard builds it as graph nodes: float32 activations and
gathered weights count as bfloat16 (half the bytes; matmul and attention at the bf16 peak),
parameters, gradients, gradient reductions and optimizer state stay float32 (FSDP2 with
``reduce_dtype=float32``). Inference (``training=False``): the prefill is the inference
program's forward; a decode step is priced from it too (each weight and the KV cache read
once, the same collectives on one token), and the KV cache's bytes come from the config's
layers, KV heads and head size (``2 * layers * kv_heads * head_dim * positions``).
"""
from __future__ import annotations

import math

import torch

from ..mesh import AXIS_NAMES, DP, FSDP, PP, RING, TP, ULYSSES, canonical_axis
from ..placement import Shard
from .hardware import Hardware
from .prices import _exposed, _peak_live, _program_times, _saved, _weight_bytes, \
    level_of
from .result import Estimate
from .units import Unit, build_unit, layer_stack

__all__ = ["Estimate", "estimate"]

_WHERE = "fxshard.estimate"
_OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


def _mesh_axes(mesh) -> dict:
    if not isinstance(mesh, dict) or not mesh:
        raise ValueError(f"{_WHERE}: mesh={mesh!r}; give {{axis: size}}, e.g. "
                         f"{{'fsdp': 8, 'tp': 8}} (axes: {', '.join(AXIS_NAMES)})")
    out = {}
    for axis, n in mesh.items():
        name = canonical_axis(axis, where=_WHERE)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{_WHERE}: mesh axis {name!r} has size {n!r}; use an int >= 1")
        out[name] = n
    return out


def _hardware(hardware) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return Hardware.preset(hardware)
    raise ValueError(f"{_WHERE}: hardware={hardware!r}; give fxshard.Hardware, a preset name "
                     f"('h100', 'h200', 'a100', 'mi300x') or fxshard.calibrate()'s result")


def _half(mixed_precision) -> bool:
    if mixed_precision is None:
        return False
    if mixed_precision in ("bf16", "bfloat16", torch.bfloat16):
        return True
    dtype = getattr(mixed_precision, "param_dtype", None)
    if dtype in (torch.bfloat16, torch.float16):
        return True
    raise ValueError(f"{_WHERE}: mixed_precision={mixed_precision!r}; use None, 'bf16' or a "
                     f"policy with param_dtype=torch.bfloat16")


def check_divides(unit: Unit, axes: dict) -> None:
    """A ValueError naming the weight, dim and axis when the candidate's dp/fsdp size does
    not divide a dim the unit shards on it (the unit was built with at most 2)."""
    for fqn, (shape, spec, _, _) in unit.weights.items():
        if spec is None:
            continue
        for axis, p in zip(unit.mesh.axis_names, spec):
            n = axes.get(axis, 1)
            if isinstance(p, Shard) and axis in (FSDP, DP) and shape[p.dim] % n:
                raise ValueError(f"{_WHERE}: {fqn} {tuple(shape)} dim {p.dim} ({shape[p.dim]}) "
                                 f"does not divide over {axis}={n}")


def _stages(n_layers: int, pp: int) -> list[dict]:
    """Per pipeline stage ``{region: count}`` (earlier stages take the extra layer, the
    embedding on the first, the head on the last)."""
    out = []
    for k in range(pp):
        layers = n_layers // pp + (1 if k < n_layers % pp else 0)
        out.append({"layer": layers, "pre": int(k == 0), "post": int(k == pp - 1)})
    return out


def estimate(model: torch.nn.Module, mesh: dict, *, hardware="h100", batch: int, seq: int,
             training: bool = True, mixed_precision=None, optimizer: str = "adamw",
             sequence_parallel: bool | None = None, microbatches: int = 1,
             schedule: str = "1f1b", recompute=None, fsdp_reshard_after_forward=True,
             new_tokens: int = 128, _units: dict | None = None) -> Estimate:
    """Predict memory per device, step time and tokens/s of training (or serving) ``model``
    on ``mesh`` (``{axis: size}``, axes nested in the order given, the last innermost) with
    ``batch`` sequences of ``seq`` tokens per step (see the module docstring for how).
    ``sequence_parallel`` defaults to on when ``tp > 1``. ``microbatches``/``schedule`` apply
    with ``pp``. ``recompute``, ``fsdp_reshard_after_forward`` as for
    :func:`fxshard.parallelize`. Inference: ``training=False`` (prefill of ``batch x seq``
    and decode steps up to ``seq + new_tokens`` cached positions)."""
    axes = _mesh_axes(mesh)
    hw = _hardware(hardware)
    half = _half(mixed_precision)
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"{_WHERE}: optimizer={optimizer!r}; use one of "
                         f"{', '.join(_OPTIMIZERS)}")
    world = math.prod(axes.values())
    pp = axes.get(PP, 1)
    data = axes.get(DP, 1) * axes.get(FSDP, 1)
    m = microbatches if pp > 1 else 1
    if batch % (data * m):
        raise ValueError(f"{_WHERE}: batch={batch} does not divide over dp x fsdp x "
                         f"microbatches = {data} x {m} on mesh {axes}; use a batch that is a "
                         f"multiple of {data * m}")
    b = batch // (data * m)
    cp = axes.get(RING, 1) * axes.get(ULYSSES, 1)
    unit_seq = 2 * axes.get(RING, 1) * axes.get(ULYSSES, 1) if axes.get(RING, 1) > 1 else cp
    if seq % unit_seq:
        raise ValueError(f"{_WHERE}: seq={seq} does not divide over the context-parallel "
                         f"axes (ring_cp zigzag needs a multiple of 2 x ring_cp x "
                         f"ulysses_cp = {unit_seq}); use a multiple of {unit_seq}")
    _, n_layers = layer_stack(model)
    if pp > n_layers:
        raise ValueError(f"{_WHERE}: pp={pp} is more stages than the model's {n_layers} "
                         f"layers; use pp <= {n_layers}")
    sp = axes.get(TP, 1) > 1 if sequence_parallel is None else sequence_parallel
    key = (tuple((a, n) for a, n in axes.items() if a not in (DP, FSDP, PP)), seq, training,
           sp, recompute, fsdp_reshard_after_forward)
    units = {} if _units is None else _units
    if key not in units:      # a build fxshard refuses is kept too: asked once
        try:
            units[key] = build_unit(model, axes, seq=seq, training=training,
                                    sequence_parallel=sp, recompute=recompute,
                                    reshard_after_forward=fsdp_reshard_after_forward)
        except (ValueError, NotImplementedError) as e:
            units[key] = e
    unit = units[key]
    if isinstance(unit, Exception):
        raise type(unit)(str(unit))
    check_divides(unit, axes)
    stages = _stages(n_layers, pp)
    options = {"sequence_parallel": sp, "microbatches": m, "schedule": schedule if pp > 1
               else None, "recompute": recompute,
               "fsdp_reshard_after_forward": fsdp_reshard_after_forward,
               "mixed_precision": "bf16" if half else None}
    notes = [f"costed from one layer's rank programs: {n_layers} layers"
             + (f" on {pp} stages ({', '.join(str(st['layer']) for st in stages)})"
                if pp > 1 else "")]
    if half:
        notes.append("bf16 mixed precision counted analytically (activations and gathered "
                     "weights at 2 bytes, parameters/gradients/optimizer state float32)")
    capacity = hw.usable_bytes
    if not training:
        from .inference import inference_estimate
        return inference_estimate(model, unit, hw, axes, b, seq, half, stages, capacity,
                                  options, notes, batch, new_tokens, world)
    times = [(_program_times(unit.forward, hw, axes, b, half, st),
              _program_times(unit.backward, hw, axes, b, half, st)) for st in stages]
    t_f = [f["compute"] + _exposed(f) for f, _ in times]
    t_b = [g["compute"] + _exposed(g) for _, g in times]
    p2p = _p2p(model, hw, axes, b, seq, half, sp) if pp > 1 else 0.0
    total, inflight = _timeline(schedule, pp, m, t_f, t_b, p2p)
    slow = max(range(pp), key=lambda k: t_f[k] + t_b[k])
    fwd, bwd = times[slow]
    busy = m * (t_f[slow] + t_b[slow])
    compute = m * (fwd["compute"] + bwd["compute"])
    exposed = m * (_exposed(fwd) + _exposed(bwd))
    comm = m * (fwd["act_comm"] + fwd["weight_comm"] + bwd["act_comm"] + bwd["weight_comm"])
    bubble = max(total - busy, 0.0)
    fsdp_on = axes.get(FSDP, 1) > 1
    memory = max((_memory(unit, axes, st, b, half, fsdp_on, inflight[k], pp, optimizer)
                  for k, st in enumerate(stages)), key=lambda mem: mem["peak"])
    memory["capacity"] = capacity
    tokens = batch * seq
    flops = m * sum(f["flops"] + g["flops"] for f, g in times) / pp
    dtype = torch.bfloat16 if half else torch.float32
    return Estimate(mesh=axes, options=options, memory=memory,
                    step_time={"total": total, "compute": compute, "exposed_comm": exposed,
                               "bubble": bubble, "comm": comm, "p2p": p2p * 2 * m,
                               "peak_inflight_microbatches": max(inflight)},
                    tokens_per_second=tokens / total,
                    tokens_per_second_per_device=tokens / total / world,
                    fits=memory["peak"] <= capacity, hardware=hw.name, training=True,
                    flops_per_step=flops, mfu=flops / (total * hw.peak(dtype)), notes=notes)


def _memory(unit: Unit, axes: dict, stage: dict, b: float, half: bool, fsdp_on: bool,
            inflight: int, pp: int, optimizer: str) -> dict:
    """Peak bytes of one device of ``stage`` and its parts (module docstring, step 5)."""
    params = _weight_bytes(unit, axes, stage)
    grads = params
    opt = _OPTIMIZERS[optimizer] * params
    saved_mb = _saved(unit.forward, b, stage, half)
    saved_layer = _saved(unit.forward, b, {"layer": 1}, half)
    extra = max(stage.get("layer", 0) - 1, 0) * saved_layer + (inflight - 1) * saved_mb
    fwd_peak = _peak_live(unit.forward, b, fsdp_on, half, stage) + extra
    # the backward's walk holds one layer's saved values, freed as it reads them
    bwd_peak = _peak_live(unit.backward, b, fsdp_on, half, stage) + extra
    acts = max(fwd_peak + (grads if pp > 1 else 0.0), bwd_peak + grads) - grads
    comm_buf = max((lg for _, _, lg, _ in unit.forward.live + unit.backward.live),
                   default=0.0) * (0.5 if half else 1.0) * fsdp_on
    memory = {"parameters": params, "gradients": grads, "optimizer": opt,
              "activations": max(acts - comm_buf, 0.0), "communication": comm_buf}
    memory["peak"] = sum(memory.values())
    return memory


def _p2p(model, hw: Hardware, axes: dict, b: float, seq: int, half: bool, sp: bool) -> float:
    """One send of a layer's output between stages: ``[b, seq / cp (/ tp with sequence
    parallelism), hidden]`` (the hidden size from the model's config)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0)
    tokens = b * seq / (axes.get(RING, 1) * axes.get(ULYSSES, 1)) / (axes.get(TP, 1) if sp
                                                                     else 1)
    nbytes = tokens * hidden * (2 if half else 4)
    link = hw.link(level_of(axes, PP, hw.devices_per_node))
    return link.latency + nbytes / (link.bandwidth * hw.link_efficiency)


def _timeline(schedule: str, pp: int, m: int, t_f: list, t_b: list, p2p: float
              ) -> tuple[float, list]:
    """(step time, per rank the most microbatches it holds at once) of ``schedule``'s order,
    stage ``k`` taking ``t_f[k]`` per forward and ``t_b[k]`` per backward."""
    if pp <= 1:
        return t_f[0] + t_b[0], [1]
    from ..training.schedules import actions
    per_rank = actions(schedule, pp, m)
    done: dict = {}
    clock = [0.0] * pp
    pos = [0] * pp
    inflight = [0] * pp
    peak = [1] * pp
    remaining = sum(len(a) for a in per_rank)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] >= len(per_rank[r]):
                continue
            kind, stage, i = per_rank[r][pos[r]]
            if kind == "F":
                dep = done.get(("F", stage - 1, i), 0.0 if stage == 0 else None)
            else:
                dep = done.get(("B", stage + 1, i), None if stage < pp - 1 else
                               done.get(("F", stage, i)))
            if dep is None:
                continue
            start = max(clock[r], dep + (p2p if (kind == "F" and stage) or
                                         (kind == "B" and stage < pp - 1) else 0.0))
            clock[r] = start + (t_f[stage] if kind == "F" else t_b[stage])
            done[(kind, stage, i)] = clock[r]
            inflight[r] += 1 if kind == "F" else -1
            peak[r] = max(peak[r], inflight[r])
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise ValueError(f"{_WHERE}: schedule {schedule!r} with pp={pp}, microbatches={m} "
                             f"does not progress")
    return max(clock), peak
