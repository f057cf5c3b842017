"""The joint graph's placements: the propagation sweep with every weight's placement fixed,
then what the output asks for (each gradient in its parameter's placement).

``joint_propagate_pass`` runs :func:`fxshard.passes.propagate.propagate_once` on the joint
forward+backward graph: weights enter with the forward's placement (``ctx.specs``; on
``fsdp`` as used, whole on the axis), each tangent with the placement its output has before
the forward gathers it, and the sweeps repeat until the tangents and the refinements
(:mod:`fxshard.passes.propagate_refine`, :mod:`fxshard.training.refine`) settle.
``gradient_targets_pass`` sets the output node's needs, from which ``insert_collectives``
makes the gradient collectives. Before and after (``dp=2``, one linear)::

    before:  mm_8 = mm(t_8, view_11)            # (no placements)
             output((mm, ..., mm_8))
    after:   mm_8 = mm(t_8, view_11)            # fxshard_spec (P,): S(1) x S(0)
             output(...)                        # fxshard_need [..., (R,)]: w's placement

``tag_fused_slices_pass`` comes first: each ``slice_backward`` is tagged with the forward
slice's input, which a fused projection's gradient is placed from.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..mesh import BATCH_AXES, TP, MeshSpec
from ..passes.fsdp import used_spec
from ..passes.moe_routing import moe_routing_pass
from ..passes.propagate import input_spec, propagate_once
from ..passes.propagate_refine import gathered_beside_whole_weights, untag_moved_regions
from ..passes.rules import FallbackWarning, held
from ..placement import Partial, R, Shard
from .train_ctx import TrainCtx
from .refine import gathered_many_times, mirrored_inputs, reduced_many_times, tag_sliced

__all__ = ["tag_fused_slices_pass", "joint_propagate_pass", "gradient_targets_pass"]

_MAX_ROUNDS = 8


def tag_fused_slices_pass(gm: fx.GraphModule, *, ctx: TrainCtx) -> fx.GraphModule:
    """Tag each ``slice_backward`` with its forward slice's input (``refine.tag_sliced``);
    counted as the propagation's ``fused_slice_gradients``."""
    ctx.report("propagate_pass", changed=False, fused_slice_gradients=tag_sliced(gm))
    return gm


def _vocab_block_spec(value, have, mesh: MeshSpec) -> tuple | None:
    """The spec a model output leaves the forward in when it is kept as blocks
    (:mod:`fxshard.training.vocab_output`): an output sharded on its last dim over ``tp``
    (the logits of a column-parallel ``lm_head``) keeps that, and its dim 0 split over the
    batch axes (``dp``, ``fsdp``) where the forward has it so; whole on every other axis.
    None for an output held otherwise."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dim() < 2 or \
            not isinstance(have, tuple) or mesh.axis_size(TP) < 2:
        return None
    p = have[mesh.axis_names.index(TP)]
    if type(p) is not Shard or p.dim % val.dim() != val.dim() - 1:
        return None
    return tuple(Shard(val.dim() - 1) if a == TP else
                 Shard(0) if a in BATCH_AXES and type(q) is Shard and q.dim % val.dim() == 0
                 else R for a, q in zip(mesh.axis_names, have))


def joint_propagate_pass(gm: fx.GraphModule, *, ctx: TrainCtx) -> fx.GraphModule:
    """The propagation pass's sweep on the joint graph with every weight's placement fixed
    (``ctx.specs``, the forward's):
    weights and tangents enter as inputs given their placement (``ctx.input_specs``), which
    the sweep hands their consumers; afterwards the weights are weights again, placed.

    A tangent takes the placement its output has before the forward gathers it (the
    backward of an all-gather is a local slice; a Partial output's tangent is the whole
    gradient, Replicate); with ``ctx.vocab_outputs`` an output kept as ``tp`` blocks
    (``_vocab_block_spec``) has its tangent arrive as the block's gradient: those outputs'
    indices and block specs are left on ``ctx.block_outputs``. Sweeps repeat until that and
    one more refinement settle: a partial sum that flows through linear ops (the norm's backward) into several reductions is
    reduced once, at the latest value they all pass through (the input gradient of a
    column-parallel block, summed over q, k, v: Megatron's one all-reduce)."""
    specs, joint = ctx.specs, ctx.joint
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    users = [n for n in placeholders if n.meta.get("fxshard_input") is not None
             and isinstance(n.meta.get("val"), torch.Tensor)]
    main = users[0].meta["val"] if users else None
    whole = tuple(R for _ in ctx.mesh.shape)
    given, tags, tangents, tangent_nodes = {}, {}, {}, []
    fresh = 1 + max([n.meta["fxshard_input"] for n in users] or [0])
    moe_routing_pass(gm, ctx=ctx)   # (the tangents still tagged: it tells the backward apart)
    for node in placeholders:
        fqn = node.meta.get("fxshard_param") or node.meta.get("fxshard_buffer")
        if node in users:
            given[node.meta["fxshard_input"]] = input_spec(node.meta["val"], ctx, main)
            continue
        if fqn is None and node.meta.get("fxshard_tangent") is None:
            continue
        key = "fxshard_param" if node.meta.get("fxshard_param") is not None else \
            "fxshard_buffer" if fqn is not None else "fxshard_tangent"
        tags[node] = (key, node.meta.pop(key))
        if key == "fxshard_tangent":
            tangents[fresh] = tags[node][1]
            tangent_nodes.append(node)
        node.meta["fxshard_input"] = fresh
        # a parameter enters as it is used (fsdp: whole on that axis, gathered from its shard)
        given[fresh] = used_spec(specs.get(fqn, whole), ctx.mesh) if fqn is not None else whole
        fresh += 1
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for fqn, g in zip(joint.grads, out.args[0][joint.n_outputs:]):
        if fqn is not None and isinstance(g, fx.Node):
            g.meta["fxshard_want"] = specs.get(fqn, whole)   # rules may aim for it
    ctx.input_specs = given
    reduced: dict = {}
    gathered: dict = {}
    for round_ in range(_MAX_ROUNDS):
        with warnings.catch_warnings():   # an op without a rule is warned about once
            if round_:
                warnings.simplefilter("ignore", FallbackWarning)
            propagate_once(gm, ctx, set(), reduced, gathered)
            while untag_moved_regions(gm, ctx):   # those routing regions run gathered
                propagate_once(gm, ctx, set(), reduced, gathered)
        changed = False
        for index, k in tangents.items():
            value = out.args[0][k]
            have = held(value)
            want = tuple(R if isinstance(p, Partial) else p for p in have) \
                if isinstance(have, tuple) else whole
            changed |= given[index] != want
            given[index] = want
        more = {k: v for k, v in reduced_many_times(gm, ctx).items() if k not in reduced}
        ctx.report("propagate_pass", changed=False, reduced_once=len(more))
        reduced.update(more)
        once = {k: v for k, v in gathered_many_times(gm, ctx).items() if k not in gathered}
        ctx.report("propagate_pass", changed=False, gathered_once=len(once))
        if TP in ctx.mesh.axis_names and ctx.mesh.axis_size(TP) > 1:
            beside = {k: R for k in gathered_beside_whole_weights(
                gm, ctx.mesh.axis_names.index(TP)) if k not in gathered and k not in once}
            ctx.report("propagate_pass", changed=False, gathered_for_whole_weights=len(beside))
            once.update(beside)
        # (once the tangents have settled: before, the backward's placements are provisional)
        mirrored = {} if changed else {
            k: v for k, v in mirrored_inputs(gm, ctx, tangent_nodes).items()
            if k not in gathered and k not in once}
        ctx.report("propagate_pass", changed=False, gathered_as_forward=len(mirrored))
        once.update(mirrored)
        gathered.update(once)
        if not changed and not more and not once:
            break
    ctx.report("propagate_pass", changed=False, joint_nodes=len(gm.graph.nodes),
               joint_fallbacks=len(ctx.fallbacks))
    kept = {}
    for k in (tangents.values() if ctx.vocab_outputs else ()):
        value = out.args[0][k]
        block = _vocab_block_spec(value, held(value), ctx.mesh)
        if block is not None:
            kept[k] = block
    ctx.report("propagate_pass", changed=False, vocab_block_outputs=len(kept))
    for node, (key, value) in tags.items():
        del node.meta["fxshard_input"]
        node.meta[key] = value
        if key == "fxshard_tangent" and value in kept:   # arrives as the block's gradient
            node.meta["fxshard_spec"] = kept[value]
        if key != "fxshard_tangent":   # a tangent arrives whole and is sliced (then)
            node.meta["fxshard_spec"] = node.meta.pop("fxshard_then", node.meta["fxshard_spec"])
            stored = specs.get(value, whole)
            if stored != node.meta["fxshard_spec"]:   # fsdp: stored sharded, gathered for use
                node.meta["fxshard_then"] = node.meta["fxshard_spec"]
                node.meta["fxshard_spec"] = stored
    ctx.block_outputs = kept
    return gm


def gradient_targets_pass(gm: fx.GraphModule, *, ctx: TrainCtx) -> fx.GraphModule:
    """The output node's needs: the model's outputs gathered (Replicate; one in
    ``ctx.block_outputs``: its ``tp`` blocks), each parameter's gradient in its parameter's
    placement (``ctx.specs``)."""
    joint, specs, kept = ctx.joint, ctx.specs, ctx.block_outputs
    out = next(n for n in gm.graph.nodes if n.op == "output")
    whole = tuple(R for _ in ctx.mesh.shape)
    need = []
    for i, a in enumerate(out.args[0]):
        if not (isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)):
            continue
        fqn = joint.grads[i - joint.n_outputs] if i >= joint.n_outputs else None
        if fqn is None and i in kept:
            need.append(kept[i])
            continue
        need.append(specs.get(fqn, whole) if fqn is not None else whole)   # input grads whole
    out.meta["fxshard_need"] = need
    return gm
