"""Placement propagation: annotate every node with its spec (one placement per mesh axis).

Walks the graph once, in order, running each node's rule once per active mesh axis. Results go
to ``node.meta``::

    fxshard_spec   placement(s) of the node's output            (S(0), S(2))
    fxshard_need   placements its tensor inputs must arrive in  [(S(0), R), (R, S(0))]
    fxshard_then   placement the output moves to right after it (embedding's all-gather)

User inputs arrive whole (every rank is given the global input) and are sharded right away:
``dp`` takes the batch (dim 0), the context-parallel axes the sequence (dim 1). Outputs are
gathered back to Replicate. Parameters get the placement their first consumer asks for
(a plan override wins); the rest stay Replicate. On ``fsdp`` a parameter is used Replicate
and stored sharded (``passes/fsdp.py``: its placeholder's ``fxshard_then``).

Two refinements run until nothing changes, each propagating the graph again: a column-parallel
weight whose output is gathered back before any row-parallel contraction uses the shard (e.g.
K/V projections when ``tp`` exceeds the KV heads) is replicated instead, or, in a fused
projection, only the parts gathered are held whole (``whole_weights.py``); and a Partial value
that one consumer needs reduced is handed reduced to all its consumers, so it is all-reduced
once (a post-norm block: ``o = o_proj(a)`` feeds both the norm's ``pow`` and its ``mul``).
A third does the same for a shard that an MoE routing region gathers while another consumer
keeps using it sharded (the router, under sequence parallelism): it is handed gathered to all
its consumers, so the router runs on every token and its ids and weights need no gather of
their own (one all-gather of the tokens instead of three); where the routing's inputs are
each gathered alone, the nearest value above them that another consumer gathers anyway (the
MoE input, read whole by a shared expert) is (torchtitan's MoE: four gathers to one).
A fourth hands a token shard gathered to a matmul with a weight whole on tp that read the
shard beside the gather while its result is moved further down (the K/V projections of a
model with fewer KV heads than tp ranks, under sequence parallelism: each all-to-all'ed its
``[B, S/tp, D]`` result to the heads; now both read the gather q_proj needs, as Megatron's
replicated KV heads do, and their weight gradients need no all-reduce over the tokens).

The refinements' finders are :mod:`fxshard.passes.propagate_refine`; ``propagate_once`` is
one sweep (the joint graph's propagation, :mod:`fxshard.training.joint_propagate`, runs it too).

Before (tp=2)::  linear(x, w_q) -> view [B,S,H,D] -> sdpa ... -> linear(a, w_o) -> add(res, .)
After::          w_q: S(0) out S(2) -> S(2) -> S(1) ... w_o: S(1) out P -> add needs (R, R)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..placement import Partial, R, Replicate, Shard, StridedShard, shard_dim, short
from . import PassCtx
from .fsdp import fsdp_storage_pass
from .propagate_refine import (gathered_beside_whole_weights, gathered_for_routing, reduced_twice,
                               spec_of, untag_moved_regions, warn_sequence_gathers)
from .rules import (UNDECIDED, Decision, RuleCtx, fallback, lookup, tensor_inputs,
                    warn_fallback)
from .rules.experts import grouped_mm_rule
from .rules.linear import addmm_rule, linear_rule, matmul_rule
from .weight_views import (_OWNS_WEIGHTS, _WEIGHT_VIEWS, _dim_map, _is_weight_cast, _moved,
                           _place_through_views, _root, _weight_view)
from .whole_weights import (_gathered_before_use, _list_replicated, _parts_to_keep_whole,
                            _why_gathered)
from ..mesh import BATCH_AXES, FSDP, SEQUENCE_AXES, TP

__all__ = ["propagate_pass", "propagate_once", "input_spec"]

_MAX_REFINEMENTS = 8


def input_spec(val: torch.Tensor, ctx: PassCtx, main: torch.Tensor | None = None) -> tuple:
    """Where a user input goes: batch (dim 0) on ``dp`` and ``fsdp``, sequence (dim 1) on the
    CP axes (unless ``ctx.split_sequence`` is off: a decode step's one token), whole elsewhere.
    ``main`` is the first tensor input (the ids): another input is split only
    on the dims it shares with it, so a ``[1]`` temperature or a ``[B, 5]`` feature input
    stays whole where it has no batch or no sequence."""
    main = val if main is None else main

    def shares(d: int) -> bool:
        return val.dim() > d and main.dim() > d and val.shape[d] == main.shape[d]

    out = []
    for axis, n in zip(ctx.mesh.axis_names, ctx.mesh.shape):
        if n > 1 and axis in BATCH_AXES and shares(0):
            out.append(Shard(0))
        elif n > 1 and axis in SEQUENCE_AXES and ctx.split_sequence and shares(1):
            out.append(Shard(1))
        else:
            out.append(R)
    return tuple(out)


def propagate_once(gm: fx.GraphModule, ctx: PassCtx, replicate: set[str],
                   reduced: dict | None = None, gathered: dict | None = None,
                   whole_parts: dict | None = None) -> dict:
    """One sweep of the rules over ``gm`` in order, every node's placements in ``node.meta``;
    ``replicate`` / ``reduced`` / ``gathered`` / ``whole_parts`` are the refinements so far
    (:mod:`fxshard.passes.propagate_refine` finds them). Returns the weights tp made
    column-parallel by default (FQN -> their linear), for the whole-weight refinement."""
    mesh = ctx.mesh
    axes = [(i, a, n) for i, (a, n) in enumerate(zip(mesh.axis_names, mesh.shape)) if n > 1]
    rctx = {a: RuleCtx(axis=a, size=n, mesh=mesh, sequence_parallel=ctx.sequence_parallel,
                       embedding_style=ctx.embedding_style, user_plan=bool(ctx.plan),
                       zigzag=a in ctx.zigzag_axes,
                       whole_parts=(whole_parts or {}) if a == TP else {})
            for _, a, n in axes}
    param_spec: dict[str, list] = {}
    views: dict[str, fx.Node] = {}   # weight view -> its parameter (see _weight_view)
    auto_colwise: dict[str, fx.Node] = {}
    ctx.fallbacks.clear()
    main = None  # the first tensor input: its dim 0 is the batch, its dim 1 the sequence
    for node in gm.graph.nodes:
        node.meta.pop("fxshard_then", None)
        node.meta.pop("fxshard_notes", None)
        if node.op == "placeholder":
            fqn = node.meta.get("fxshard_param")
            val = node.meta.get("val")
            if fqn is not None:
                spec = []
                for a, n in zip(mesh.axis_names, mesh.shape):
                    planned = ctx.plan_for(fqn) if a == TP else None
                    if n == 1 or a in ctx.zigzag_axes:
                        # weights are sliced contiguously when loaded: on a zigzag axis they
                        # stay whole and the graph slices them (zigzag_shard) where needed
                        spec.append(R)
                    elif fqn in replicate or a == FSDP:
                        # fsdp: used whole, stored sharded (fsdp_storage_pass, passes/fsdp.py)
                        spec.append(R)
                    elif planned is not None:
                        spec.append(planned)
                    else:
                        spec.append(UNDECIDED)
                param_spec[node.name] = spec
                node.meta["fxshard_spec"] = None
            elif node.meta.get("fxshard_input") is not None and isinstance(val, torch.Tensor):
                node.meta["fxshard_spec"] = tuple(R for _ in mesh.shape)
                given = (ctx.input_specs or {}).get(node.meta["fxshard_input"])
                if main is None:
                    main = val
                node.meta["fxshard_then"] = tuple(given) if given else input_spec(val, ctx,
                                                                                  main)
            else:
                node.meta["fxshard_spec"] = tuple(R for _ in mesh.shape) \
                    if isinstance(val, torch.Tensor) else None
            continue
        if node.op == "output":
            ins = tensor_inputs(node)
            node.meta["fxshard_need"] = [
                spec_of(t, param_spec) if ctx.keep_output_placement
                else tuple(R for _ in mesh.shape) for t in ins]
            continue
        if node.op != "call_function":
            node.meta["fxshard_spec"] = None
            continue
        if node.target is operator.getitem:
            src = spec_of(node.args[0], param_spec)
            node.meta["fxshard_spec"] = src[node.args[1]] if isinstance(src, list) else None
            node.meta["fxshard_need"] = []
            continue
        val = node.meta.get("val")
        ins_nodes = tensor_inputs(node)
        src = _weight_view(node, param_spec, views)
        if src is not None:
            views[node.name] = src
            perm = _dim_map(node, src)
            param_spec[node.name] = [_moved(p, perm.index) for p in param_spec[src.name]]
            continue
        if not isinstance(val, (torch.Tensor, list, tuple)):
            node.meta["fxshard_spec"] = None
            node.meta["fxshard_need"] = [spec_of(t, param_spec) for t in ins_nodes]
            continue
        rule_fn = lookup(node.target)
        n_out = len(val) if isinstance(val, (list, tuple)) else None
        out = [[R] * len(mesh.shape) for _ in range(n_out)] if n_out is not None \
            else [R] * len(mesh.shape)
        need = [[R] * len(mesh.shape) for _ in ins_nodes]
        then_axes: dict[int, object] = {}
        fell_back = False
        decisions: dict[int, Decision] = {}
        for i, a, n in axes:
            cur = [spec_of(t, param_spec)[i] for t in ins_nodes]
            cur = [(reduced or {}).get((t.name, i), p) if isinstance(p, Partial) else
                   (gathered or {}).get((t.name, i), p) if shard_dim(p) is not None else p
                   for t, p in zip(ins_nodes, cur)]
            if rule_fn is None:
                if ctx.strict:
                    raise NotImplementedError(
                        f"fxshard.parallelize(strict=True): no sharding rule for {node.target} "
                        f"(node {node.name}); register one with "
                        f"@fxshard.passes.rules.rule({node.target}) or drop strict=True")
                decisions[i] = fallback(node, cur, rctx[a])
                fell_back = fell_back or any(c is not UNDECIDED and c != R for c in cur)
            else:
                if rule_fn not in _OWNS_WEIGHTS:
                    cur = [R if p is UNDECIDED else p for p in cur]
                decisions[i] = rule_fn(node, cur, rctx[a])
                assert len(decisions[i].ins) == len(ins_nodes), (node.format_node(), decisions[i])
        _fit_nested(node, ins_nodes, decisions, axes, rctx, ctx)
        for i, a, n in axes:
            d = decisions[i]
            for k, t in enumerate(ins_nodes):
                need[k][i] = d.ins[k]
                if t.name in param_spec:
                    ps = param_spec[t.name]
                    if ps[i] is UNDECIDED:
                        ps[i] = d.ins[k]
                        if a == TP and _column_weight(rule_fn, k, d.ins[k], t):
                            fqn = _root(t, views).meta["fxshard_param"]
                            auto_colwise[fqn] = node
            if n_out is not None:
                for k in range(n_out):
                    out[k][i] = d.out[k]
            else:
                out[i] = d.out
            if d.then is not None and n_out is None:
                then_axes[i] = d.then
        if rule_fn is None:
            ctx.fallbacks.append(f"{node.name}: {node.target}")
            if fell_back:
                warn_fallback(node, "has no sharding rule")
        node.meta["fxshard_spec"] = [tuple(o) for o in out] if n_out is not None else tuple(out)
        node.meta["fxshard_need"] = [tuple(x) for x in need]
        if then_axes:
            node.meta["fxshard_then"] = tuple(then_axes.get(i, p) for i, p in enumerate(out))
    _place_through_views(gm, views, param_spec)
    for name, spec in param_spec.items():
        for i, p in enumerate(spec):
            if p is UNDECIDED:
                spec[i] = R
    for node in gm.graph.nodes:
        if node.meta.get("fxshard_param") is not None:
            node.meta["fxshard_spec"] = tuple(param_spec[node.name])
    return auto_colwise


def _column_weight(rule_fn, k: int, p, t: fx.Node) -> bool:
    """Input ``k`` (node ``t``) of a linear/addmm placed ``p`` is a column-parallel weight."""
    if rule_fn is linear_rule and k == 1:
        return shard_dim(p) == 0
    if rule_fn is grouped_mm_rule and k == 1:
        return shard_dim(p) == 2
    if rule_fn is matmul_rule and k == 1:   # w[K, N] or experts' w[E, K, N]
        return shard_dim(p) == t.meta["val"].dim() - 1
    return rule_fn is addmm_rule and k == 2 and shard_dim(p) == 1


def _fit_nested(node: fx.Node, ins_nodes: list, decisions: dict, axes: list, rctx: dict,
                ctx: PassCtx) -> None:
    """Rules decide one axis at a time; two axes may then shard one dim of an input or the
    output further than its size divides (``[2, ...]`` over dp=2 and tp=2). Such an axis,
    innermost first, computes the node replicated instead: slower, never wrong."""
    def ok() -> bool:
        specs = [[R] * len(ctx.mesh.shape) for _ in ins_nodes]
        outs = None
        for i, d in decisions.items():
            for k in range(len(ins_nodes)):
                specs[k][i] = d.ins[k]
        for k, t in enumerate(ins_nodes):
            if not _divides(t.meta["val"].shape, specs[k], ctx):
                return False
        val = node.meta["val"]
        if isinstance(val, torch.Tensor):
            outs = [R] * len(ctx.mesh.shape)
            for i, d in decisions.items():
                outs[i] = d.out
            return _divides(val.shape, outs, ctx)
        return True

    for i, a, n in reversed(axes):
        if ok():
            return
        if any(isinstance(p, Shard) for p in decisions[i].ins) or \
                isinstance(decisions[i].out, Shard):
            decisions[i] = fallback(node, decisions[i].ins, rctx[a])


def _divides(shape, spec, ctx: PassCtx) -> bool:
    sizes = list(shape)
    for a, n, p in zip(ctx.mesh.axis_names, ctx.mesh.shape, spec):
        if n > 1 and isinstance(p, StridedShard):
            if p.dim >= len(sizes) or shape[p.dim] != sum(p.parts) or \
                    any(k % n for j, k in enumerate(p.parts) if j not in p.whole):
                return False
            sizes[p.dim] = sum(p.local_parts(n)) if p.whole else sizes[p.dim] // n
        elif n > 1 and isinstance(p, Shard):
            chunks = 2 * n if a in ctx.zigzag_axes else n
            if p.dim >= len(sizes) or sizes[p.dim] % chunks:
                return False
            sizes[p.dim] //= n
    return True


def _report_experts(gm: fx.GraphModule, ctx: PassCtx, tp: int) -> None:
    """Count, in ``explain()``'s pass log, the MoE expert weights split on ``tp``."""
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param")
        if fqn is None or node.meta["val"].dim() != 3:
            continue
        users, stack = [], list(node.users)
        while stack:   # through the weight's views and casts
            u = stack.pop()
            if u.target in _WEIGHT_VIEWS or _is_weight_cast(u):
                stack.extend(u.users)
            else:
                users.append(u)
        p = node.meta["fxshard_spec"][tp]
        if users and all(lookup(u.target) is grouped_mm_rule for u in users) and \
                shard_dim(p) is not None:
            # every expert's intermediate dim split on tp, not expert-parallel
            # (fxshard/passes/rules/experts.py says why)
            ctx.report("propagate_pass", changed=False, experts_split_on_tp=1)


def propagate_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    replicate: set[str] = set()
    reduced: dict[tuple[str, int], object] = {}
    gathered: dict[tuple[str, int], object] = {}
    why: dict[str, str] = {}
    whole_parts: dict[str, frozenset] = {}   # fused weight -> its parts kept whole on tp
    mesh = ctx.mesh
    tp = mesh.axis_names.index(TP) if TP in mesh.axis_names else None
    ctx.report("propagate_pass", changed=False, routing_regions_gathered=0, reduced_once=0,
               gathered_for_routing=0, gathered_for_whole_weights=0, replicated_on_tp=0,
               experts_split_on_tp=0)
    for _ in range(_MAX_REFINEMENTS):
        auto_colwise = propagate_once(gm, ctx, replicate, reduced, gathered, whole_parts)
        if untag_moved_regions(gm, ctx):
            continue
        twice = {k: v for k, v in reduced_twice(gm).items() if k not in reduced}
        # several consumers use these partial sums: reduced once, not by each
        ctx.report("propagate_pass", changed=False, reduced_once=len(twice))
        reduced.update(twice)
        if tp is None or mesh.shape[tp] == 1:
            if twice:
                continue
            break
        once = gathered_for_routing(gm, tp) - gathered.keys()
        # an expert-routing region and the router both read these: gathered once on tp
        ctx.report("propagate_pass", changed=False, gathered_for_routing=len(once))
        beside = gathered_beside_whole_weights(gm, tp) - gathered.keys() - once
        # a matmul with a whole weight reads these shards beside a gather: it reads the gather
        ctx.report("propagate_pass", changed=False, gathered_for_whole_weights=len(beside))
        once |= beside
        for name, i in sorted(once):
            gathered[name, i] = R
        users = {fqn: _gathered_before_use(lin, tp) for fqn, lin in auto_colwise.items()}
        wasted = {fqn for fqn, u in users.items() if u is not None}
        grew = False
        for fqn in sorted(wasted - replicate):
            kept = _parts_to_keep_whole(auto_colwise[fqn], tp, mesh.shape[tp],
                                        whole_parts.get(fqn, frozenset()))
            if kept is not None:
                whole_parts[fqn], reason = kept
                wasted.discard(fqn)
                grew = True
                ctx.report("propagate_pass", changed=False, fused_parts_kept_whole=len(kept[0]))
                ctx.partly_whole[fqn] = (
                    f"parts {sorted(kept[0])} of "
                    f"{short(auto_colwise[fqn].meta['fxshard_spec'][tp])} kept whole on tp, "
                    f"the others split ({reason})")
        if not wasted - replicate and not twice and not once and not grew:
            break
        for fqn in sorted(wasted - replicate):
            why[fqn] = _why_gathered(users[fqn], tp, mesh.shape[tp], auto_colwise[fqn])
            ctx.report("propagate_pass", changed=False, replicated_on_tp=1)
        replicate |= wasted
    if tp is not None and mesh.shape[tp] > 1:
        _list_replicated(gm, ctx, tp, why)
        _report_experts(gm, ctx, tp)
    warn_sequence_gathers(gm, ctx)
    fsdp_storage_pass(gm, ctx=ctx)
    sharded = sum(1 for n in gm.graph.nodes
                  if isinstance(n.meta.get("fxshard_spec"), tuple)
                  and any(not isinstance(p, Replicate) for p in n.meta["fxshard_spec"]))
    ctx.report("propagate_pass", changed=False, nodes=len(gm.graph.nodes), sharded_nodes=sharded,
               fallbacks=len(ctx.fallbacks))
    return gm
