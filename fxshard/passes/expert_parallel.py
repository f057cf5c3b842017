"""Expert parallelism: route each MoE layer's rows to the ranks that hold their experts.

On an ``ep`` axis of size ``n`` the experts of every MoE layer are split by index (each rank
holds ``E/n`` whole experts: the grouped matmul's weight is ``Shard(0)``) and the tokens by
batch, as on ``dp``. ``passes/moe_routing.py`` has tagged the routing region, where each rank
sorts its own rows by expert; propagation has placed it (rows ``Shard(0)`` on ``ep``, the
offsets ``Partial``: the rank's own counts). This pass, right after propagation, cuts the
region's *expert segment* (the grouped matmuls and the row-wise ops between them, in a joint
graph their backward too) out of the rank's sorted order and into its experts' order::

    before (ep=2, E=4, a rank's N sorted rows)    after
    offs = cumsum(histc(ids_g, 4))  [4]           offs = cumsum(histc(ids_g, 4))  [4]
                                                  counts = fxshard.expert_counts(offs, 'ep', 2)
                                                  local = cumsum(sum(counts, [0]))  [2]
    h = grouped_mm(x_g, W1^T, offs)               x_e = fxshard.expert_dispatch(x_g, offs,
                                                                  counts, 'ep', 2)  [2N, H]
                                                  h = grouped_mm(x_e, W1_local^T, local)
    a = silu(h[:, :I]) * h[:, I:]                 a = silu(h[:, :I]) * h[:, I:]
    y_g = grouped_mm(a, W2^T, offs)  [N, H]       y_e = grouped_mm(a, W2_local^T, local)
                                                  y_g = fxshard.expert_combine(y_e, offs,
                                                                  counts, 'ep', 2)  [N, H]
    out = index(y_g * w_g, [inv]) ...             out = index(y_g * w_g, [inv]) ...

One counts exchange per layer, one dispatch for every value entering the segment and one
combine for every value leaving it (the forward: the tokens in, the experts' output back; the
backward: the output's gradient in, the tokens' gradient back). The segment's rows have the
static bound ``n * N`` (the worst case, every row of the group to this rank's experts): no
capacity factor and no dropped token, so the result is one device's; the counts are read at
run time. The expert weights' gradients come out ``Shard(0)``: every row that reached an
expert is on its rank, so ``ep`` reduces nothing for them.

What is not routed yet is a NotImplementedError naming the layer: grouped matmuls outside a
token-local region (the routing gathered), a segment op that bakes in the row count, and
models with no grouped-matmul experts (per-expert loops). Experts that ``ep`` does not divide
and a batch that leaves the routed rows whole on ``ep`` are ValueErrors.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..mesh import EP
from ..placement import Shard, StridedShard
from . import PassCtx
from .moe_routing import TAG, _grouped_mm_backward
from .rules import lookup, tensor_inputs
from .rules.experts import grouped_mm_rule

__all__ = ["expert_parallel_pass", "expert_layers"]

aten = torch.ops.aten
ops = torch.ops.fxshard
_FIXED_ROWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.expand.default, aten.new_zeros.default, aten.new_empty.default,
               aten.new_full.default, aten.full.default, aten.zeros.default)


def _is_expert_mm(n: fx.Node) -> bool:
    return n.op == "call_function" and (lookup(n.target) is grouped_mm_rule or
                                        _grouped_mm_backward(n))


def _layer(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else node.name


def expert_layers(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The grouped matmuls (forward and backward) of each tagged routing region, by region."""
    out: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if _is_expert_mm(n) and n.meta.get(TAG) is not None:
            out.setdefault(n.meta[TAG], []).append(n)
    return out


def _closure(start: list[fx.Node], region: set, forward: bool) -> set[fx.Node]:
    seen, stack = set(start), list(start)
    while stack:
        cur = stack.pop()
        nxt = cur.users if forward else cur.all_input_nodes
        for u in nxt:
            if u in region and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _row_inputs(node: fx.Node, n: int) -> list[fx.Node]:
    """The inputs of a segment node that carry the routed rows (dim 0 of length ``n``)."""
    if lookup(node.target) is grouped_mm_rule:
        return [node.args[0]]
    if _grouped_mm_backward(node):
        return [node.args[0], node.args[3]]
    return [t for t in node.all_input_nodes if _rows(t) == n]


def _rows(t: fx.Node) -> int | None:
    val = t.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None


def _weight_grad(node: fx.Node) -> bool:
    return node.target is operator.getitem and _grouped_mm_backward(node.args[0]) and \
        node.args[1] == 1


def _plain(spec):
    """A rows spec in the experts' order: a fused layout of the rows (``ring_cp``'s zigzag
    share, ``StridedShard`` on dim 0) is only the count there, ``Shard(0)``."""
    if isinstance(spec, list):
        return [_plain(s) for s in spec]
    if not isinstance(spec, tuple):
        return spec
    return tuple(Shard(0) if isinstance(p, StridedShard) and p.dim == 0 else p for p in spec)


def _bound(val, n: int, n_ep: int):
    """``val`` with its ``n`` routed rows widened to the segment's bound ``n_ep * n``."""
    if isinstance(val, torch.Tensor) and val.dim() and val.shape[0] == n:
        return val.new_empty((n_ep * n, *val.shape[1:]))
    return val


def _new(graph: fx.Graph, target, args: tuple, val, spec, need, like: fx.Node) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta.update({"val": val, "fxshard_spec": spec, "fxshard_need": need,
                      "fxshard_stage": like.meta.get("fxshard_stage"),
                      "nn_module_stack": like.meta.get("nn_module_stack", {})})
    return node


def _route(gm: fx.GraphModule, name: str, mms: list[fx.Node], ctx: PassCtx) -> tuple[int, int]:
    """Rewrite one region: returns (dispatches, combines)."""
    graph, n_ep = gm.graph, ctx.mesh.axis_size(EP)
    region = {n for n in graph.nodes if n.meta.get(TAG) == name}
    offs = mms[0].args[2]
    layer = _layer(mms[0])
    if any(m.args[2] is not offs for m in mms):
        raise NotImplementedError(
            f"fxshard.parallelize: the experts of {layer!r} use two sets of offsets; ep="
            f"{n_ep} routes layers whose grouped matmuls share one. Use dp instead of ep")
    n_experts = offs.meta["val"].shape[0]
    rows_on_ep = dict(zip(ctx.mesh.axis_names, mms[0].args[0].meta["fxshard_spec"])).get(EP)
    if rows_on_ep != Shard(0):
        raise ValueError(
            f"fxshard.parallelize: the {_rows(mms[0].args[0])} routed rows of {layer!r} are not "
            f"split on ep={n_ep} (placed {rows_on_ep} there: the batch does not divide among "
            f"the token axes {ctx.mesh.describe()}); give a batch that is a multiple of the "
            f"product of dp, fsdp and ep, or use dp instead of ep")
    for m in mms:
        w = m.args[1]
        need = m.meta["fxshard_need"][1]
        if dict(zip(ctx.mesh.axis_names, need)).get(EP) != Shard(0):
            raise NotImplementedError(
                f"fxshard.parallelize: the expert weight {w.name} of {layer!r} is not split by "
                f"expert on ep={n_ep}; use dp instead of ep for this model")
    n = _rows(mms[0].args[0])
    segment = _closure(mms, region, True) & _closure(mms, region, False)
    segment |= {u for s in segment if _grouped_mm_backward(s) for u in s.users}
    for s in segment:
        if s.target in _FIXED_ROWS:
            raise NotImplementedError(
                f"fxshard.parallelize: {s.name} ({s.target}) between the experts of {layer!r} "
                f"has the routed row count {n} in its arguments; ep={n_ep} cannot route this "
                f"layer's rows yet. Use dp instead of ep")
    first = min(segment, key=lambda s: list(graph.nodes).index(s))
    offs_spec = offs.meta["fxshard_spec"]
    local = n_experts // n_ep
    with graph.inserting_before(first):
        counts = _new(graph, ops.expert_counts.default, (offs, EP, n_ep),
                      offs.meta["val"].new_empty((n_ep, local), dtype=torch.int64),
                      offs_spec, [offs_spec], offs)
        total = _new(graph, aten.sum.dim_IntList, (counts, [0]),
                     offs.meta["val"].new_empty((local,), dtype=torch.int64),
                     offs_spec, [offs_spec], offs)
        local_offs = _new(graph, aten.cumsum.default, (total, 0),
                          offs.meta["val"].new_empty((local,)), offs_spec, [offs_spec], offs)
        local_offs.kwargs = {"dtype": offs.meta["val"].dtype}
    for m in mms:
        m.replace_input_with(offs, local_offs)
    order = {node: i for i, node in enumerate(graph.nodes)}
    dispatched: dict[fx.Node, fx.Node] = {}
    for s in sorted(segment, key=order.get):
        for t in _row_inputs(s, n):
            if t in segment:
                continue
            if t not in dispatched:
                spec = t.meta["fxshard_spec"]
                val = t.meta["val"]
                with graph.inserting_before(min((u for u in t.users if u in segment),
                                                key=order.get)):
                    dispatched[t] = _new(graph, ops.expert_dispatch.default,
                                         (t, offs, counts, EP, n_ep),
                                         val.new_empty((n_ep * n, *val.shape[1:])),
                                         _plain(spec), [spec, offs_spec, offs_spec], t)
            s.replace_input_with(t, dispatched[t])
    combines = 0
    for s in sorted(segment, key=order.get):
        if _weight_grad(s) or _grouped_mm_backward(s):
            continue
        outside = [u for u in s.users if u not in segment and u not in dispatched.values()]
        if not outside:
            continue
        spec, val = s.meta["fxshard_spec"], s.meta["val"]
        with graph.inserting_after(s):
            back = _new(graph, ops.expert_combine.default, (s, offs, counts, EP, n_ep), val,
                        spec, [_plain(spec), offs_spec, offs_spec], s)
        for u in outside:
            u.replace_input_with(s, back)
        combines += 1
    inside = segment | set(dispatched.values())
    for s in segment:   # the segment's rows: the bound n_ep * n, in the experts' order
        val = s.meta["val"]
        if _weight_grad(s):
            continue
        s.meta["fxshard_need"] = [_plain(q) if t in inside else q for t, q in
                                  zip(tensor_inputs(s), s.meta["fxshard_need"])]
        if _grouped_mm_backward(s):
            spec = s.meta["fxshard_spec"]
            s.meta["fxshard_spec"] = [_plain(spec[0]), *spec[1:]]
            s.meta["val"] = (_bound(val[0], n, n_ep), val[1])
            continue
        s.meta["fxshard_spec"] = _plain(s.meta["fxshard_spec"])
        if isinstance(val, (list, tuple)):
            s.meta["val"] = type(val)(_bound(v, n, n_ep) for v in val)
        else:
            s.meta["val"] = _bound(val, n, n_ep)
    return len(dispatched), combines


def expert_parallel_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    n_ep = ctx.mesh.axis_size(EP)
    if n_ep == 1:
        ctx.report("expert_parallel_pass", moe_layers=0, dispatches=0, combines=0,
                   experts_per_rank=0)
        return gm
    for mm in (n for n in gm.graph.nodes if _is_expert_mm(n)):
        n_experts = mm.args[1].meta["val"].shape[0]
        if n_experts % n_ep:
            raise ValueError(
                f"fxshard.parallelize: {_layer(mm)!r} has {n_experts} experts, which ep={n_ep} "
                f"(mesh {ctx.mesh.describe()}) cannot split into whole experts per rank; give "
                f"ep a size that divides {n_experts}")
    loose = [n for n in gm.graph.nodes if _is_expert_mm(n) and n.meta.get(TAG) is None]
    if loose:
        raise NotImplementedError(
            f"fxshard.parallelize: on mesh {ctx.mesh.describe()} the experts of "
            f"{_layer(loose[0])!r} ({loose[0].name}) run outside a routing region that each "
            f"rank can sort alone (the routing is gathered), so ep={n_ep} cannot route its "
            f"tokens; use dp instead of ep for this model")
    layers = expert_layers(gm)
    if not layers:
        raise NotImplementedError(
            f"fxshard.parallelize: mesh {ctx.mesh.describe()} has ep={n_ep} but the model has "
            f"no grouped-matmul MoE experts that fxshard routes (models whose experts are a "
            f"loop of per-expert Linear layers are not routed yet); use dp instead of ep")
    dispatches = combines = 0
    per_rank = set()
    for name, mms in layers.items():
        d, c = _route(gm, name, mms, ctx)
        dispatches, combines = dispatches + d, combines + c
        per_rank.add(mms[0].args[1].meta["val"].shape[0] // n_ep)
    ctx.report("expert_parallel_pass", moe_layers=len(layers), dispatches=dispatches,
               combines=combines, experts_per_rank=min(per_rank))
    return gm
