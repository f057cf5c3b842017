"""Insert the collectives that move each value to the placement its consumer needs.

Reads ``fxshard_spec`` / ``fxshard_need`` / ``fxshard_then`` from propagation and adds
``torch.ops.fxshard.*`` nodes from the redistribution table. A value needed in the same
placement by several consumers is redistributed once (q/k/v projections share one all-gather).

Before (tp=2, no sequence parallelism)::

    o = linear(a, w_o)            # spec P
    h = add(res, o)               # needs (R, R)

After::

    o = linear(a, w_o)
    all_reduce = torch.ops.fxshard.all_reduce(o, "tp", 2)
    h = add(res, all_reduce)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..placement import R, Shard, StridedShard, local_shape
from . import PassCtx
from .redistribute import plan_redistribution
from .rules import is_tensor_node

__all__ = ["insert_collectives_pass", "collective_target"]


def collective_target(op: str):
    import fxshard.ops  # noqa: F401  (registers the collectives and the local fxshard ops)
    return getattr(torch.ops.fxshard, op).default


def _chain(graph: fx.Graph, src: fx.Node, spec, need, ctx: PassCtx) -> tuple[fx.Node, int]:
    """Emit the steps from ``spec`` to ``need`` at the graph's insert point; return the end."""
    x = src
    steps = plan_redistribution(spec, need, ctx.mesh, ctx.zigzag_axes)
    for step in steps:
        if step.op == "zigzag_shard":
            n = local_shape(tuple(src.meta["val"].shape), spec, ctx.mesh,
                            what=src.name)[step.args[0]]
            if n % (2 * step.size):
                raise ValueError(
                    f"fxshard.parallelize: {step.axis} shards the sequence zigzag (rank j "
                    f"holds chunks j and {2 * step.size - 1}-j of {2 * step.size}, to balance "
                    f"causal attention), but dim {step.args[0]} of {src.name} has {n} elements "
                    f"here; use a sequence length that divides by {2 * step.size} (times the "
                    f"other axes sharding it) or parallelize(..., ring_zigzag=False)")
        if step.op in _FUSED:
            x = _FUSED[step.op](graph, x, src, spec, step, ctx)
            spec = step.after
            continue
        x = graph.call_function(collective_target(step.op),
                                (x, *step.args, step.axis, step.size))
        x.meta["val"] = src.meta["val"]
        x.meta["fxshard_spec"] = step.after
        x.meta["fxshard_need"] = [spec]
        x.meta["fxshard_stage"] = src.meta.get("fxshard_stage")
        x.meta["fxshard_collective"] = step
        spec = step.after
    return x, len(steps)


def _relative_parts(val, spec, step, ctx: PassCtx) -> tuple[list[int], int]:
    """The parts of a fused dim as this axis sees them, and how many ways the other axes split
    the dim: an outer axis that cut the dim first leaves runs of the (equal) part size."""
    dim, parts = step.args
    whole = tuple(R if a == step.axis else p for a, p in zip(ctx.mesh.axis_names, spec))
    here = local_shape(tuple(val.shape), whole, ctx.mesh)[dim]
    rel = list(parts) if sum(parts) == here else [parts[0]] * (here // parts[0])
    assert sum(rel) == here, (parts, here)
    outer = 1
    for a, m, p in zip(ctx.mesh.axis_names, ctx.mesh.shape, spec):
        if m > 1 and a != step.axis and isinstance(p, Shard) and p.dim == dim:
            outer *= m
    return rel, outer


def _fused_gather(graph: fx.Graph, x: fx.Node, src: fx.Node, spec, step, ctx: PassCtx
                  ) -> fx.Node:
    """All-gather a ``StridedShard`` and re-order it: the gather lays the ranks' blocks side by
    side (each holding a piece of every part); split into those pieces and concatenate them
    part by part. On a zigzag axis each part's share is zigzag-gathered on its own. (Piece
    values get the global sizes that give their local sizes under the spec.)"""
    dim, _ = step.args
    n = step.size
    val = src.meta["val"]
    stage = src.meta.get("fxshard_stage")
    rel, outer = _relative_parts(val, spec, step, ctx)
    if step.axis in ctx.zigzag_axes:
        return _fused_zigzag_gather(graph, x, src, spec, step, rel, outer)
    gathered = graph.call_function(collective_target("all_gather"), (x, dim, step.axis, n))
    gathered.meta.update({"val": val, "fxshard_spec": step.after, "fxshard_need": [spec],
                          "fxshard_stage": stage, "fxshard_collective": step})
    local = [k // n for k in rel]
    split = graph.call_function(torch.ops.aten.split_with_sizes.default,
                                (gathered, local * n, dim))
    pieces = []
    for r in range(n):
        for j, k in enumerate(local):
            g = graph.call_function(operator.getitem, (split, r * len(local) + j))
            g.meta.update({"val": _resized(val, dim, k * outer), "fxshard_spec": step.after,
                           "fxshard_stage": stage})
            pieces.append(g)
    split.meta.update({"val": [p.meta["val"] for p in pieces], "fxshard_spec": None,
                       "fxshard_stage": stage})
    order = [pieces[r * len(local) + j] for j in range(len(local)) for r in range(n)]
    out = graph.call_function(torch.ops.aten.cat.default, (order, dim))
    out.meta.update({"val": val, "fxshard_spec": step.after, "fxshard_stage": stage})
    return out


def _resized(val, dim: int, size: int):
    shape = list(val.shape)
    shape[dim] = size
    return val.new_empty(shape)


def _fused_zigzag_gather(graph: fx.Graph, x: fx.Node, src: fx.Node, spec, step, rel: list,
                         outer: int) -> fx.Node:
    dim, _ = step.args
    n = step.size
    val = src.meta["val"]
    stage = src.meta.get("fxshard_stage")
    # sizes before this axis's split: localize divides the split of a fused value by n
    split = graph.call_function(torch.ops.aten.split_with_sizes.default, (x, rel, dim))
    whole = []
    for j, k in enumerate(rel):
        g = graph.call_function(operator.getitem, (split, j))
        g.meta.update({"val": _resized(val, dim, k * outer), "fxshard_stage": stage,
                       "fxshard_spec": _part_spec(spec)})
        z = graph.call_function(collective_target("zigzag_gather"), (g, dim, step.axis, n))
        z.meta.update({"val": _resized(val, dim, k * outer), "fxshard_spec": step.after,
                       "fxshard_need": [g.meta["fxshard_spec"]], "fxshard_stage": stage,
                       "fxshard_collective": step})
        whole.append(z)
    split.meta.update({"val": [w.meta["val"] for w in whole], "fxshard_spec": None,
                       "fxshard_stage": stage})
    out = graph.call_function(torch.ops.aten.cat.default, (whole, dim))
    out.meta.update({"val": val, "fxshard_spec": step.after, "fxshard_stage": stage})
    return out


def _part_spec(spec: tuple) -> tuple:
    """The spec of one part of a fused value: a plain shard of its dim on the step's axis."""
    return tuple(Shard(p.dim) if isinstance(p, StridedShard) else p for p in spec)


def _fused_shard(graph: fx.Graph, x: fx.Node, src: fx.Node, spec, step, ctx: PassCtx
                 ) -> fx.Node:
    """Slice a value this axis replicates into a ``StridedShard``: split it into its parts,
    take this rank's share of each (``local_shard``, on a zigzag axis ``zigzag_shard``; a part
    kept whole stays whole) and concatenate them. No communication."""
    dim, _ = step.args
    n = step.size
    val = src.meta["val"]
    stage = src.meta.get("fxshard_stage")
    rel, outer = _relative_parts(val, spec, step, ctx)
    target = step.after[ctx.mesh.axis_names.index(step.axis)]
    whole = target.whole if tuple(rel) == tuple(target.parts) else frozenset()
    op = "zigzag_shard" if step.axis in ctx.zigzag_axes else "local_shard"
    sliced = tuple(Shard(dim) if a == step.axis else p
                   for a, p in zip(ctx.mesh.axis_names, spec))
    split = graph.call_function(torch.ops.aten.split_with_sizes.default, (x, rel, dim))
    pieces = []
    for j, k in enumerate(rel):
        g = graph.call_function(operator.getitem, (split, j))
        g.meta.update({"val": _resized(val, dim, k * outer), "fxshard_spec": spec,
                       "fxshard_stage": stage})
        if j not in whole:
            g = graph.call_function(collective_target(op), (g, dim, step.axis, n))
            g.meta.update({"val": _resized(val, dim, k * outer), "fxshard_spec": sliced,
                           "fxshard_need": [spec], "fxshard_stage": stage,
                           "fxshard_collective": step})
        pieces.append(g)
    split.meta.update({"val": [_resized(val, dim, k * outer) for k in rel],
                       "fxshard_spec": None, "fxshard_stage": stage})
    out = graph.call_function(torch.ops.aten.cat.default, (pieces, dim))
    out.meta.update({"val": val, "fxshard_spec": step.after, "fxshard_stage": stage})
    return out


def _fused_reduce_scatter(graph: fx.Graph, x: fx.Node, src: fx.Node, spec, step,
                          ctx: PassCtx) -> fx.Node:
    """Reduce a Partial value into a ``StridedShard`` with one reduce-scatter: re-order it
    locally so that block r holds chunk r of every part, in part order (what rank r keeps),
    then reduce-scatter on the fused dim."""
    dim, _ = step.args
    n = step.size
    val = src.meta["val"]
    stage = src.meta.get("fxshard_stage")
    rel, outer = _relative_parts(val, spec, step, ctx)
    local = [k // n for k in rel]
    split = graph.call_function(torch.ops.aten.split_with_sizes.default,
                                (x, [k for k in local for _ in range(n)], dim))
    chunks = []
    for j, k in enumerate(local):
        for r in range(n):
            g = graph.call_function(operator.getitem, (split, j * n + r))
            g.meta.update({"val": _resized(val, dim, k * outer), "fxshard_spec": spec,
                           "fxshard_stage": stage})
            chunks.append(g)
    split.meta.update({"val": [c.meta["val"] for c in chunks], "fxshard_spec": None,
                       "fxshard_stage": stage})
    order = [chunks[j * n + r] for r in range(n) for j in range(len(local))]
    ranked = graph.call_function(torch.ops.aten.cat.default, (order, dim))
    ranked.meta.update({"val": val, "fxshard_spec": spec, "fxshard_stage": stage})
    out = graph.call_function(collective_target("reduce_scatter"),
                              (ranked, dim, step.axis, n))
    out.meta.update({"val": val, "fxshard_spec": step.after, "fxshard_need": [spec],
                     "fxshard_stage": stage, "fxshard_collective": step})
    return out


_FUSED = {"fused_gather": _fused_gather, "fused_shard": _fused_shard,
          "fused_reduce_scatter": _fused_reduce_scatter}


def _current(node: fx.Node):
    return node.meta.get("fxshard_spec")


def insert_collectives_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    graph = gm.graph
    added = 0
    # 1. values that move right after they are made (user inputs, embedding outputs, fsdp
    #    parameters)
    for node in list(graph.nodes):
        then = node.meta.pop("fxshard_then", None)
        if then is None or then == node.meta.get("fxshard_spec"):
            continue
        users = list(node.users)
        if node.op == "placeholder" and node.meta.get("fxshard_param") is not None and users:
            # an fsdp-sharded parameter: gathered right before its first use, not all at once
            where = graph.inserting_before(next(n for n in graph.nodes if n in node.users))
        elif node.op == "placeholder":  # keep the placeholders together at the top
            where = graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder"))
        else:
            where = graph.inserting_before(node.next)
        with where:
            end, k = _chain(graph, node, node.meta["fxshard_spec"], then, ctx)
        added += k
        for u in users:
            u.replace_input_with(node, end)
    # 2. values their consumers need elsewhere
    cache: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        needs = node.meta.get("fxshard_need")
        if not needs:
            continue
        flat, spec_tree = pytree.tree_flatten((node.args, node.kwargs))
        k = 0
        changed = False
        for j, a in enumerate(flat):
            if not is_tensor_node(a):
                continue
            need = needs[k]
            k += 1
            have = _current(a)
            if need is None or have is None or tuple(have) == tuple(need):
                continue
            key = (a, tuple(need))
            if key not in cache:
                with graph.inserting_before(node):
                    cache[key], n = _chain(graph, a, tuple(have), tuple(need), ctx)
                added += n
            flat[j] = cache[key]
            changed = True
        if changed:
            args, kwargs = pytree.tree_unflatten(flat, spec_tree)
            node.args, node.kwargs = args, kwargs
    ctx.report("insert_collectives_pass", inserted_nodes=added)
    return gm
