"""What a propagation sweep asks to be redone: the refinements ``propagate_pass`` (and the joint
graph's propagation, :mod:`fxshard.training.joint_propagate`) apply before sweeping again.

Each finder reads the placements one sweep left (``fxshard_spec`` / ``fxshard_need``) and
returns ``(node name, mesh axis index)`` keys the next sweep hands over differently::

    reduced_twice                   a Partial value one consumer needs reduced while another
                                    keeps the partial sum: reduced once, for all of them
    gathered_for_routing            a shard an MoE routing region gathers while the router
                                    reads it sharded: gathered once, for all of them
    gathered_beside_whole_weights   a token shard a whole-on-tp matmul reads beside a gather
    untag_moved_regions             routing regions in which a collective would move rows

and, once propagation is done, :func:`warn_sequence_gathers` says where a context-parallel axis
gathers the sequence (an attention fxshard does not recognise, a scan along the sequence).

Before (tp=2, a post-norm block)::   o = mm(a, w_o)          # P
                                     pow(o) needs R; mul(o, .) keeps P   (reduced twice)
After::                              o: handed R to both     (one all-reduce)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..mesh import TP
from ..placement import Partial, R, Replicate, shard_dim
from . import PassCtx
from .moe_routing import TAG
from .rules import held, tensor_inputs
from .weight_views import _WEIGHT_VIEWS

__all__ = ["spec_of", "reduced_twice", "gathered_for_routing", "gathered_beside_whole_weights",
           "untag_moved_regions", "warn_sequence_gathers"]


def spec_of(node: fx.Node, param_spec: dict) -> object:
    """A node's placement as its consumers read it (after its ``fxshard_then`` move)."""
    if node.name in param_spec:
        return param_spec[node.name]
    then = node.meta.get("fxshard_then")
    return then if then is not None else node.meta.get("fxshard_spec")


def reduced_twice(gm: fx.GraphModule) -> dict[tuple[str, int], object]:
    """(node, axis index) -> placement, for Partial values that one consumer needs reduced
    (to that placement) while another keeps using the partial sum (which would then be
    reduced a second time)."""
    out = {}
    for node in gm.graph.nodes:
        spec = node.meta.get("fxshard_spec")
        if not isinstance(spec, tuple) or node.meta.get("fxshard_param") is not None:
            continue
        for i, p in enumerate(spec):
            if not isinstance(p, Partial):
                continue
            needs = [nd[i] for u in node.users if u.op != "output"
                     for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or [])
                     if t is node]
            done = [q for q in needs if not isinstance(q, Partial)]
            if done and any(isinstance(q, Partial) for q in needs):
                out[(node.name, i)] = done[0]
    return out


def gathered_for_routing(gm: fx.GraphModule, tp: int) -> set[tuple[str, int]]:
    """(node, ``tp``) for sharded values that a node of an MoE routing region needs gathered
    while another consumer keeps the shard (the router: its ids and weights would then be
    gathered separately, as each rank of tp needs every token's routing)."""
    out = set()
    for node in gm.graph.nodes:
        spec = node.meta.get("fxshard_spec")
        if not isinstance(spec, tuple) or shard_dim(spec[tp]) is None or \
                node.meta.get("fxshard_param") is not None:
            continue
        needs = [(u, nd[tp]) for u in node.users if u.op != "output"
                 for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or [])
                 if t is node]
        if any(isinstance(q, Replicate) and u.meta.get(TAG) is not None for u, q in needs) and \
                any(not isinstance(q, Replicate) for _, q in needs):
            out.add((node.name, tp))
        elif node.meta.get(TAG) is None and any(
                isinstance(q, Replicate) and u.meta.get(TAG) is not None for u, q in needs):
            out |= _gathered_above(node, tp)
    return out


_CONTRACTIONS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
                 torch.ops.aten.linear.default: (0, 1), torch.ops.aten.matmul.default: (0, 1)}


def gathered_beside_whole_weights(gm: fx.GraphModule, tp: int,
                                  depth: int = 16) -> set[tuple[str, int]]:
    """(node, ``tp``) for sharded values (sequence parallelism's token shard) that one
    consumer needs gathered while a matmul with a weight whole on ``tp`` reads the shard, and
    that matmul's result is moved on ``tp`` further down (K/V projections when ``tp`` exceeds
    the KV heads: computed on the rank's tokens, then all-to-all'ed to the heads). Handed
    gathered to all their consumers, the matmul runs on every token from the gather its
    sibling (the q projection) needs anyway, and its result is sliced where it is needed:
    Megatron's replicated KV heads, no collective of their own in the forward, and in the
    backward their weight gradients come from the saved gathered input rather than being
    all-reduced as partial sums over the tokens."""
    out = set()
    for node in gm.graph.nodes:
        spec = node.meta.get("fxshard_spec")
        if not isinstance(spec, tuple) or shard_dim(spec[tp]) is None or \
                node.op == "placeholder" or node.meta.get("fxshard_then") is not None:
            continue
        needs = [(u, nd[tp]) for u in node.users if u.op != "output"
                 for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or [])
                 if t is node]
        if any(q == R for _, q in needs) and any(
                q == spec[tp] and _whole_weight_matmul(u, node, tp) and
                _moved_below(u, tp, depth) for u, q in needs):
            out.add((node.name, tp))
    return out


def _whole_weight_matmul(u: fx.Node, x: fx.Node, tp: int) -> bool:
    """``u`` multiplies ``x`` by a weight (a placeholder, through views) it uses whole on tp."""
    operands = _CONTRACTIONS.get(u.target)
    if operands is None:
        return False
    a, b = (u.args[k] for k in operands)
    if a is not x and b is not x:
        return False
    other = b if a is x else a
    w = other
    # (a slice: a fused weight's part, trained per part, fxshard.training.joint)
    while isinstance(w, fx.Node) and (w.target in _WEIGHT_VIEWS or
                                      w.target is torch.ops.aten.slice.Tensor):
        w = w.args[0]
    if not isinstance(w, fx.Node) or w.op != "placeholder":
        return False
    need = dict(zip(tensor_inputs(u), u.meta.get("fxshard_need") or []))
    return other in need and need[other][tp] == R


def _moved_below(node: fx.Node, tp: int, depth: int) -> bool:
    """A collective moves on tp ``node``'s value or a value computed from it alone (through
    views and ops whose other inputs are whole on tp: RoPE's tables), within ``depth``
    consumers. A consumer that mixes in another sharded value (a residual add) ends the walk:
    what moves past it is not the matmul's result."""
    ours, frontier = {node}, [node]
    for _ in range(depth):
        below = []
        for n in frontier:
            have = held(n)
            if not isinstance(have, tuple) or shard_dim(have[tp]) is None:
                continue
            for u in n.users:
                if u.op == "output" or u in ours:
                    continue
                ins = tensor_inputs(u)
                if any(t is n and nd[tp] != have[tp]
                       for t, nd in zip(ins, u.meta.get("fxshard_need") or [])):
                    return True
                if all(t in ours or _whole_on(t, tp) for t in ins):
                    ours.add(u)
                    below.append(u)
        frontier = below
    return False


def _whole_on(node: fx.Node, tp: int) -> bool:
    have = held(node)
    return isinstance(have, tuple) and have[tp] == R


def _needs_of(node: fx.Node, tp: int) -> list:
    return [nd[tp] for u in node.users if u.op != "output"
            for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or []) if t is node]


def _gathered_above(node: fx.Node, tp: int, depth: int = 12) -> set[tuple[str, int]]:
    """The nearest sharded values above ``node`` (the routing's ids, weights, rows: gathered
    one by one for a region) that another consumer gathers anyway (the MoE input, which the
    shared expert's column-parallel linear reads whole, under sequence parallelism): handed
    gathered to all their consumers, the router runs on every token and the routing needs
    no gather of its own."""
    out, seen, frontier = set(), {node}, [node]
    for _ in range(depth):
        up = []
        for n in frontier:
            for a in n.all_input_nodes:
                spec = a.meta.get("fxshard_spec")
                if a in seen or not isinstance(spec, tuple) or shard_dim(spec[tp]) is None or \
                        a.meta.get("fxshard_param") is not None:
                    continue
                seen.add(a)
                if any(isinstance(q, Replicate) for q in _needs_of(a, tp)):
                    out.add((a.name, tp))
                else:
                    up.append(a)
        frontier = up
    return out


def untag_moved_regions(gm: fx.GraphModule, ctx: PassCtx) -> bool:
    """Untag the routing regions in which a collective would move rows (they then run
    gathered: correct, slower) and report them; whether any was untagged (propagate again)."""
    moved = _moved_inside_region(gm, ctx)
    for node in gm.graph.nodes:
        if node.meta.get(TAG) in moved:
            del node.meta[TAG]
    if moved:
        ctx.report("propagate_pass", changed=False, routing_regions_gathered=len(moved))
    return bool(moved)


def _moved_inside_region(gm: fx.GraphModule, ctx: PassCtx) -> set[str]:
    """Expert-routing regions (``moe_routing_pass``) in which a collective would move a value
    on an axis where it holds the rank's own rows in the rank's own order: the only move
    allowed there is slicing a whole value from outside the region to the rank's rows."""
    bad = set()
    for node in gm.graph.nodes:
        region = node.meta.get(TAG)
        if region is None or node.target is operator.getitem:
            continue
        for t, need in zip(tensor_inputs(node), node.meta.get("fxshard_need") or []):
            have = spec_of(t, {})
            for i, (a, n) in enumerate(zip(ctx.mesh.axis_names, ctx.mesh.shape)):
                if n == 1 or a == TP or have is None or need[i] == have[i]:
                    continue
                if t.meta.get(TAG) != region and isinstance(have[i], Replicate) and \
                        shard_dim(need[i]) is not None:
                    continue
                bad.add(region)
    return bad


def warn_sequence_gathers(gm: fx.GraphModule, ctx: PassCtx) -> None:
    """One warning per context-parallel axis that gathers a sequence-sharded activation to
    compute a node whole (listing each layer pattern with the first such node): correct, but
    that layer runs on the whole sequence on every rank of the axis (gpt-oss's attention with
    sinks, a state-space scan). The model's output, gathered anyway, does not count."""
    import warnings
    from ..mesh import SEQUENCE_AXES
    from .rules import caller_level, lookup
    from .rules.conv import SequenceGatherWarning
    for i, (axis, n) in enumerate(zip(ctx.mesh.axis_names, ctx.mesh.shape)):
        if n == 1 or axis not in SEQUENCE_AXES:
            continue
        found: dict[str, str] = {}
        for u in gm.graph.nodes:
            if u.op != "call_function":
                continue
            for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or []):
                have = held(t)
                if not isinstance(have, tuple) or shard_dim(have[i]) is None or \
                        not isinstance(nd[i], Replicate) or t.meta["val"].dim() < 3:
                    continue
                stack = list((u.meta.get("nn_module_stack") or {}).values())
                layer = ".".join("*" if p.isdigit() else p
                                 for p in (stack[-1][0] if stack else u.name).split("."))
                why = "it has no sharding rule" if lookup(u.target) is None else \
                    "its rule needs the whole sequence"
                found.setdefault(layer, f"{u.name} ({u.target}): {why}")
                break
        if found:
            lines = "\n".join(f"  {layer}: before {what}" for layer, what in found.items())
            warnings.warn(
                f"fxshard: mesh axis {axis!r} of size {n} (mesh {ctx.mesh.describe()}) gathers "
                f"the whole sequence in {len(found)} place(s); each runs on every token on "
                f"every {axis} rank (correct, but not context-parallel there):\n{lines}\n"
                f"Attention that fxshard recognises (SDPA, or matmul -> softmax -> matmul) "
                f"runs as ring or Ulysses attention; other mixing along the sequence does not.",
                SequenceGatherWarning, stacklevel=caller_level())
