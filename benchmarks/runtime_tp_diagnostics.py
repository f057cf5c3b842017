"""runtime_tp.py's diagnostics: :func:`with_sdpa` (a rank program with SDPA in place of
``fxshard::attention``, to tell the attention's share of a gap from the rest) and the
micro-benchmarks of one collective (:func:`micro_collectives`: plain torch.distributed,
functional collectives, ``torch.ops.fxshard.*``) and one attention (:func:`micro_attention`:
``fxshard.attention`` vs SDPA) on a rank. ``tp``: the tensor-parallel size of the run.
"""
from __future__ import annotations

import copy
import operator
import statistics

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from benchmarks.common import stats_ms, time_calls, wait_collective

__all__ = ["with_sdpa", "micro_collectives", "micro_attention"]


# --- fxshard GraphModule with SDPA instead of fxshard.attention (diagnostic) --------------

def _sdpa_as_fxshard_attention(q, k, v, mask, causal, scale, q_offset, kv_offset):
    """Same contract as ``fxshard::attention`` for the cases in this benchmark (no mask, zero
    offsets); returns ``(out, None)`` - the programs here only read ``[0]``."""
    assert mask is None and q_offset == 0 and kv_offset == 0
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out, None


def with_sdpa(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """A copy of ``gm`` whose ``fxshard::attention`` calls run SDPA, and how many there were."""
    graph = copy.deepcopy(gm.graph)
    n = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.fxshard.attention.default:
            for user in node.users:  # only out[0] may be used
                assert user.target is operator.getitem and user.args[1] == 0
            node.target = _sdpa_as_fxshard_attention
            n += 1
    out = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "Sdpa")
    return out, n


# --- micro-benchmarks ----------------------------------------------------------------------

def _micro(fns: dict, iters: int, before=None) -> dict:
    res = {}
    for name, fn in fns.items():
        time_calls(fn, 10)
        if before is not None:
            before()
        cpu = []
        res[name] = stats_ms(time_calls(fn, iters, cpu))
        res[name]["cpu_median_ms"] = statistics.median(cpu) * 1e3
    return res


def micro_collectives(backend, hidden_shape, logits_shape, iters, *, tp: int):
    """One all_reduce / all_gather: plain torch.distributed, torch's functional collectives,
    torch.ops.fxshard.* (DistributedBackend -> funcol); same tensors, both ranks in lockstep.
    Wall time and this thread's CPU time per call."""
    from fxshard.runtime import use_backend
    x = torch.randn(hidden_shape)
    y = torch.randn(logits_shape)
    group = dist.group.WORLD

    def plain_ar():
        t = x.clone()
        dist.all_reduce(t)
        return t

    def plain_ag():
        parts = [torch.empty_like(y) for _ in range(tp)]
        dist.all_gather(parts, y)
        return torch.cat(parts, -1)

    h, lg = list(hidden_shape), list(logits_shape)
    cases = {
        f"all_reduce {h} dist.all_reduce(clone)": plain_ar,
        f"all_reduce {h} funcol.all_reduce":
            lambda: wait_collective(funcol.all_reduce(x, "sum", group=group)),
        f"all_reduce {h} torch.ops.fxshard.all_reduce":
            lambda: torch.ops.fxshard.all_reduce(x, "tp", tp),
        f"all_gather {lg} dist.all_gather+cat": plain_ag,
        f"all_gather {lg} funcol.all_gather_tensor":
            lambda: wait_collective(funcol.all_gather_tensor(y, gather_dim=2, group=group)),
        f"all_gather {lg} torch.ops.fxshard.all_gather":
            lambda: torch.ops.fxshard.all_gather(y, 2, "tp", tp),
    }
    with use_backend(backend):
        return _micro(cases, iters, before=dist.barrier)


def micro_attention(cfg, batch, seq, iters, *, tp: int):
    """fxshard.attention (torch reference impl on CPU) vs SDPA, one rank's local heads."""
    hq, hkv, d = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, cfg.head_dim
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, hq, seq, d, generator=g)
    k = torch.randn(batch, hkv, seq, d, generator=g)
    v = torch.randn(batch, hkv, seq, d, generator=g)
    scale = d ** -0.5
    return _micro({
        f"fxshard.attention [{batch},{hq}|{hkv},{seq},{d}]":
            lambda: torch.ops.fxshard.attention(q, k, v, None, True, scale, 0, 0),
        f"F.scaled_dot_product_attention [{batch},{hq}|{hkv},{seq},{d}]":
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=hq != hkv),
    }, iters)
