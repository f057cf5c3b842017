"""The prices of a unit's costs on a :class:`~fxshard.plan.hardware.Hardware`: a node's time
(compute- or memory-bound), a collective's time on the link level its axis group sits on, a
program's compute and exposed communication, its peak live and saved bytes. Shared by the
training estimate (:mod:`fxshard.plan.estimate`) and the serving one
(:mod:`fxshard.plan.inference`).
"""
from __future__ import annotations

import math

import torch

from ..mesh import DP, FSDP, PP
from ..placement import local_shape
from .hardware import INTER, INTRA, Hardware
from .units import Unit

__all__ = ["level_of"]


def level_of(axes: dict, axis: str, devices_per_node: int) -> str:
    """``intra_node`` when a group of ``axis`` fits in one node (axes nest in the order
    given, the last innermost: a group's ranks are ``stride`` apart)."""
    names = list(axes)
    stride = math.prod(axes[a] for a in names[names.index(axis) + 1:])
    return INTRA if stride * axes[axis] <= devices_per_node else INTER


def _weight_bytes(unit: Unit, axes: dict, stage: dict) -> float:
    """Parameter bytes per device of ``stage`` (``{region: count}``: the layers it holds,
    and whether it holds the embedding ``pre`` and the head ``post``)."""
    from ..mesh import MeshSpec
    target = MeshSpec(tuple(axes.get(a, 1) if a != PP else 1 for a in unit.mesh.axis_names),
                      unit.mesh.axis_names)
    total = 0.0
    for _fqn, (shape, spec, dtype, region) in unit.weights.items():
        local = shape if spec is None else local_shape(tuple(shape), spec, target)
        total += math.prod(local) * dtype.itemsize * stage.get(region, 0)
    return total


def _node_time(item, hw: Hardware, b: float, half: bool) -> float:
    scale = b if item.batch else 1.0
    dtype = torch.bfloat16 if half and item.dtype == torch.float32 else item.dtype
    nbytes = item.bytes * scale * (0.5 if half and item.dtype == torch.float32 else 1.0)
    eff = {"matmul": hw.matmul_efficiency, "attention": hw.attention_efficiency}.get(
        item.kind, hw.matmul_efficiency)
    flops = item.flops * scale
    peak = hw.peak(dtype)
    return hw.op_latency + max(flops / (peak * eff),
                               nbytes / (hw.memory_bandwidth * hw.memory_efficiency))


def _comm_time(c, hw: Hardware, axes: dict, b: float, half: bool) -> float:
    n = axes.get(c.axis, 1)
    if n <= 1:
        return 0.0
    link = hw.link(level_of(axes, c.axis, hw.devices_per_node))
    scale = b if c.batch else 1.0
    if c.weight and c.axis == DP:   # HSDP: the dp reduction of an fsdp shard (built at 2)
        scale = 2 / axes.get(FSDP, 1)
    full = c.full * scale * (0.5 if half and not c.op.startswith("reduce") and
                             c.op != "all_reduce" else 1.0)
    op = c.op
    if op.startswith("all_gather") or op.startswith("reduce_scatter") or op == "all_to_all":
        wire, steps = (n - 1) / n * full, n - 1
    elif op == "all_reduce":
        wire, steps = 2 * (n - 1) / n * full, 2 * (n - 1)
    elif op in ("send", "recv"):
        wire, steps = full, 1
    else:
        wire, steps = c.wire * scale, n - 1
    return steps * link.latency + wire / (link.bandwidth * hw.link_efficiency)


def _program_times(costs, hw, axes, b, half, stage: dict) -> dict:
    out = {"compute": 0.0, "act_comm": 0.0, "weight_comm": 0.0, "weight_comm_layer": 0.0,
           "flops": 0.0}
    for it in costs.items:
        k = stage.get(it.layer, 0)
        if k:
            out["compute"] += k * _node_time(it, hw, b, half)
            out["flops"] += k * it.flops * (b if it.batch else 1)
    for c in costs.comms:
        k = stage.get(c.layer, 0)
        if not k:
            continue
        t = _comm_time(c, hw, axes, b, half)
        if c.weight:
            out["weight_comm"] += k * t
            if c.layer == "layer":
                out["weight_comm_layer"] += t
        else:
            out["act_comm"] += k * t
    return out


def _exposed(p: dict) -> float:
    hidden = max(p["weight_comm"] - p["compute"], p["weight_comm_layer"], 0.0)
    return p["act_comm"] + min(hidden, p["weight_comm"])


def _peak_live(costs, b: float, fsdp_on: bool, half: bool, stage: dict) -> float:
    """The largest live set of the unit's walk over the nodes of the regions ``stage``
    runs."""
    h = 0.5 if half else 1.0
    return max((lb * b * h + lf + (lg * h if fsdp_on else 0.0)
                for lb, lf, lg, region in costs.live if stage.get(region, 0)), default=0.0)


def _saved(costs, b: float, stage: dict, half: bool) -> float:
    h = 0.5 if half else 1.0
    return sum(v * (b * h if batch else 1.0) * stage.get(region, 0)
               for (region, batch), v in costs.saved.items())
