"""Mixture-of-experts: grouped expert matmuls, sharded on each expert's intermediate dim.

``grouped_mm(x[S, K], w[E, K, N], offs[E])`` (transformers' ``grouped_mm_fallback`` custom op,
``aten._grouped_mm``) multiplies the rows of ``x`` sorted by expert, rows ``offs[e-1]:offs[e]``
by ``w[e]``. It is a linear layer per expert, so the Megatron plan applies to every expert at
once, on the ``tp`` axis, for a weight no earlier rule placed (the weight arrives through the
model's ``transpose(-2, -1)`` of its ``[E, N, K]`` parameter; propagation places the parameter
through that view)::

    x: R                 -> column-parallel: w S(2), offs R, out S(1)  (gate_up: S(2|I+I))
    x: S(1) (sharded K)  -> row-parallel:    w S(1), offs R, out P

A Mixtral / Qwen-MoE / OLMoE block at tp=2 (router replicated, routing computed on every rank)::

    gate_up_proj [E, 2I, H] S(1|I+I) -> grouped_mm out [S, 2I] S(1|I+I) -> chunk -> silu * up S(1)
    down_proj    [E, H, I]  S(2)     -> grouped_mm out [S, H] P -> * top-k weight, un-permute,
    sum over top-k -> P -> one all-reduce (or reduce-scatter under sequence parallelism)

Why intermediate-dim sharding and not expert parallelism (each rank E/tp whole experts)? Both
end in one reduction of the ``[tokens, H]`` output per layer when tokens are replicated on
``tp`` (every rank computes the same routing), so the bytes are equal: ``2(t-1)/t * T * H``.
Expert parallelism with tokens sharded (dp / sequence) instead sends each token to its k experts
and back: two all-to-alls of ``k * T * H`` (k=2: twice the all-reduce's bytes), with
data-dependent split sizes (per-rank row counts change every step, so rank programs lose their
static shapes) and a load that follows the router (a rank holding a popular expert does all its
work). Intermediate sharding keeps static shapes, splits every expert's work exactly by ``tp``,
asks nothing of ``E`` (only ``I % tp == 0``) and costs what a dense Megatron MLP costs.

The router's ``[E, H]`` weight stays whole: its column-parallel output would be gathered at once
(softmax / top-k over the experts), and it is small (``E * H``); ``explain()`` lists it with
that reason. On a token shard (``dp``, ``fsdp``, a CP axis) each rank sorts and multiplies its
own rows where ``passes/moe_routing.py`` tags the routing region (forward, and in training its
backward): ``offs`` is then the rank's own counts (a partial sum of the global ones); elsewhere
the routing is gathered first and the expert matmuls run on every token.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...mesh import EP
from ...placement import P, R, Partial, Shard, StridedShard, shard_dim
from . import UNDECIDED, Decision, RuleCtx, rule, tensor_inputs, token_local
from .linear import fused_parts

aten = torch.ops.aten

# transformers registers its op when its MoE integration is imported: key the rule by name
GROUPED_MM_OPS = ("transformers::grouped_mm_fallback", aten._grouped_mm.default)


@rule(*GROUPED_MM_OPS)
def grouped_mm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    tensors = tensor_inputs(node)
    if len(tensors) != 3 or ctx.ndim(tensors[0]) != 2 or ctx.ndim(tensors[1]) != 3 or \
            ctx.ndim(tensors[2]) != 1:
        # a 3-D input (batched, no offsets) or a bias: not the grouped expert matmul
        return Decision(ins=[R] * len(ins), out=R)
    x, w = ins[0], ins[1]
    if token_local(node, ctx) and shard_dim(x) == 0:
        # the rank's own rows, sorted by the rank's own sort: its counts are a partial sum;
        # on ep whole experts by index, the rows routed to them (passes/expert_parallel.py)
        return Decision(ins=[x, Shard(0) if ctx.axis == EP else R, P], out=x)
    if w is UNDECIDED:
        if not ctx.is_tp:
            w = R
        elif isinstance(x, Shard) and x.dim == 1:
            w = Shard(1)
        else:
            parts = fused_parts(node, 1, ctx.size)
            w = StridedShard(2, parts) if parts else Shard(2)
    if isinstance(w, StridedShard) and w.dim == 2:          # fused column-parallel (gate|up)
        return Decision(ins=[R, w, R], out=StridedShard(1, w.parts))
    if isinstance(w, Shard) and w.dim == 2:                 # column-parallel
        return Decision(ins=[R, w, R], out=Shard(1))
    if isinstance(w, Shard) and w.dim == 1:                 # row-parallel
        return Decision(ins=[Shard(1), w, R], out=P)
    if isinstance(x, Partial):                              # linear in x, row by row
        return Decision(ins=[P, R, R], out=P)
    return Decision(ins=[R, R, R], out=R)
