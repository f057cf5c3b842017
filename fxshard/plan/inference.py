"""The serving side of :func:`fxshard.estimate` (``training=False``).

The prefill is the inference rank program's forward over ``batch x seq`` (priced as a
training forward is); a decode step reads each weight and the KV cache once (memory-bound)
and runs the prefill's activation collectives on one token; the KV cache holds
``2 x layers x KV heads x head size`` values per cached position (from the model's config:
the one quantity here not read from a program).
"""
from __future__ import annotations

from ..mesh import RING, TP, ULYSSES
from .prices import _comm_time, _exposed, _peak_live, _program_times, _weight_bytes
from .result import Estimate

__all__ = ["inference_estimate"]


def inference_estimate(model, unit, hw, axes, b, seq, half, stages, capacity, options, notes,
                       batch, new_tokens, world) -> Estimate:
    progs = [_program_times(unit.forward, hw, axes, b, half, st) for st in stages]
    prefill = sum(p["compute"] + _exposed(p) for p in progs)
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    bytes_el = 2 if half else 4
    split = axes.get(TP, 1) * axes.get(ULYSSES, 1)
    kv_local = kv_heads / split if kv_heads >= split else 1   # (replicated beyond KV heads)
    positions = (seq + new_tokens) / axes.get(RING, 1)
    decode, memory = 0.0, None
    for st in stages:
        weights = _weight_bytes(unit, axes, st) * (0.5 if half else 1.0)
        kv = 2 * st["layer"] * kv_local * head_dim * positions * b * bytes_el
        read = (weights + kv) / (hw.memory_bandwidth * hw.memory_efficiency)
        step_comm = sum(_comm_time(c, hw, axes, b / seq, half) * st.get(c.layer, 0)
                        for c in unit.forward.comms if not c.weight)
        decode += read + step_comm
        mem = {"parameters": weights, "kv_cache": kv,
               "activations": _peak_live(unit.forward, b, False, half, st)}
        mem["peak"] = sum(mem.values())
        if memory is None or mem["peak"] > memory["peak"]:
            memory = mem
    memory["capacity"] = capacity
    notes.append("decode step: weights and KV cache read once per token (memory-bound), the "
                 "prefill's activation collectives on one token; KV cache from the config")
    tokens = batch * new_tokens
    per_seq = prefill + new_tokens * decode
    return Estimate(mesh=axes, options=options, memory=memory,
                    step_time={"prefill": prefill, "decode": decode, "total": per_seq},
                    tokens_per_second=tokens / per_seq, tokens_per_second_per_device=tokens /
                    per_seq / world, fits=memory["peak"] <= capacity, hardware=hw.name,
                    training=False, notes=notes)
