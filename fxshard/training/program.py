"""The training pipeline: the forward passes' placements, then the same passes on the joint.

::

    model ─joint_graph─▶ joint forward+backward ATen graph (global shapes)
    model ─trace─▶ forward graph ─eager_attention, fold_mask, unrepeat_kv, propagate─▶
          every parameter's placement (the inference program's: the shards are the same)
    joint ─repeat_kv (tp > KV heads)─▶ ─dedupe_views─▶ ─propagate (parameters fixed;
          tangents as their outputs)─▶ placements on every node
          ─insert_collectives─▶ gradient collectives from the redistribution table
          ─localize─▶ local shapes ─partition─▶ forward and backward rank programs

Parameters enter the joint propagation with their forward placement fixed; each tangent (every
rank is given the whole gradient of an output, as ``pm(x)`` returns the whole output) is sliced
to the placement its output has before the forward gathers it; each parameter's gradient must
leave the backward in its parameter's placement, so a Partial gradient (a weight used with batch- or
sequence-sharded data) is all-reduced, or reduce-scattered where the parameter is sharded::

    mm_8 = mm(t_8, view_11)            # dp: S(1) x S(0) -> P
    all_reduce = fxshard.all_reduce(mm_8, 'dp', 2)       # P -> R, the parameter's placement

On ``fsdp`` a parameter enters the joint propagation as it is used (whole on the axis) and
leaves it stored sharded (``passes/fsdp.py``): one all-gather before its first use, which the
partition redoes in the backward (a weight-only value), and its gradient reduce-scattered (a
parameter no dim of which takes a shard is stored whole, as on ``dp``: its gradient is
all-reduced)::

    all_gather = fxshard.all_gather(w_q, 1, 'fsdp', 2); t = t(all_gather); mm = mm(x, t)
    mm_8 = mm(t_8, view_11)                                  # fsdp: P
    reduce_scatter = fxshard.reduce_scatter(mm_8, 1, 'fsdp', 2)   # P -> S(1), w_q's shard

After the partition, both rank programs group a layer's gathers (reduce-scatters) into one
``fxshard::all_gather_bucket`` (``reduce_scatter_bucket``): :mod:`fxshard.passes.fsdp_buckets`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

import fxshard.passes.rules.backward  # noqa: F401  (registers the backward ops' rules)
from ..mesh import PP, TP, MeshSpec, TRAINING_AXES
from ..passes import PassCtx
from ..passes.eager_attention import eager_attention_pass
from ..passes.fold_mask import fold_causal_mask_pass
from ..passes.fsdp import AXIS as FSDP, used_spec
from ..passes.fsdp_buckets import fsdp_buckets_pass, layer_of, layer_stack_for_buckets
from ..passes.gqa import unrepeat_kv_pass
from ..passes.insert_collectives import insert_collectives_pass
from ..passes.localize import localize_pass
from ..passes.moe_routing import moe_routing_pass
from ..passes.pipeline import run_passes
from ..passes.propagate import (_run_once, gathered_beside_whole_weights, input_spec,
                                propagate_pass, untag_moved_regions)
from ..passes.rules import FallbackWarning, held
from ..placement import Partial, R
from ..passes.vocab_loss import split_loss_pass, vocab_parallel_loss_pass
from .gqa import repeat_kv_pass
from .cuda_attention import cuda_attention_backward_pass
from .dropout import check_dropout_mesh
from .dynamic_sizes import check_no_stand_ins, quiet
from .context_parallel import drop_marks_pass, lower_ring_pass, mark_ulysses_pass
from .joint import Joint, joint_graph
from .refine import (dedupe_views_pass, gathered_many_times, mirrored_inputs,
                     reduced_many_times, tag_sliced)
from .partition import Split, partition

aten = torch.ops.aten

__all__ = ["TrainProgram", "build_train_program"]

_WHERE = "fxshard.training"
_MAX_ROUNDS = 8


@dataclass
class TrainProgram:
    """The rank programs of one input signature and the placements of their weights."""

    split: Split
    specs: dict                 # weight FQN -> spec (one placement per mesh axis)
    shapes: dict                # weight FQN -> global shape
    joint: Joint
    ctx: PassCtx
    reports: dict = field(default_factory=dict)   # pass -> counts (forward, then joint)
    compiled: dict = field(default_factory=dict)  # "forward"/"backward" -> Inductor's fn
    training: bool = False      # the model's train mode when traced (dropout's sites)
    loss_fn: object = None      # train_step's loss traced with the model (with_loss.py)
    frozen: frozenset = frozenset()   # the parameters traced not requiring grad
    padded: dict = field(default_factory=dict)   # vocab-padded FQN -> the model's shape
    padded_outputs: dict = field(default_factory=dict)   # output index -> vocab (unpadded)
    vocab_outputs: dict = field(default_factory=dict)  # output index -> its blocks' spec


def check_training_axes(mesh: MeshSpec, where: str = _WHERE,
                        what: str = "training") -> None:
    """A NotImplementedError for an active axis without training (``AXIS_ROLES``' ``trains``):
    never a wrong gradient."""
    for axis, n in zip(mesh.axis_names, mesh.shape):
        if n > 1 and axis not in TRAINING_AXES:
            trains = ", ".join(TRAINING_AXES)
            raise NotImplementedError(
                f"{where}: {what} on mesh axis {axis!r} of size {n} (mesh {mesh.describe()}) "
                f"is not built yet ({trains} are); run the forward under torch.no_grad() for "
                f"inference on this mesh, or train on a mesh of {trains}")


def forward_placements(joint: Joint, ctx: PassCtx) -> dict:
    """Every weight's placement as the inference program places it: the forward passes up to
    ``propagate`` on the forward export (which the joint graph was built from)."""
    ctx.constants = {**joint.traced.constants, **ctx.constants}
    with warnings.catch_warnings():   # the joint graph's propagation warns about its own ops
        warnings.simplefilter("ignore", FallbackWarning)
        gm = run_passes(joint.traced.gm, [eager_attention_pass, fold_causal_mask_pass,
                                          unrepeat_kv_pass, moe_routing_pass, split_loss_pass,
                                          propagate_pass],
                        ctx)
    out = {}
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param") or node.meta.get("fxshard_buffer")
        if node.op == "placeholder" and fqn is not None:
            out[fqn] = tuple(node.meta["fxshard_spec"])
    return out


def _vocab_block_spec(value, have, mesh: MeshSpec) -> tuple | None:
    """The spec a model output leaves the forward in when it is kept as blocks
    (:mod:`fxshard.training.vocab_output`): an output sharded on its last dim over ``tp``
    (the logits of a column-parallel ``lm_head``) keeps that, and its dim 0 split over the
    batch axes (``dp``, ``fsdp``) where the forward has it so; whole on every other axis.
    None for an output held otherwise."""
    from ..mesh import BATCH_AXES, TP
    from ..placement import Shard
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


def _joint_propagate(gm: fx.GraphModule, ctx: PassCtx, specs: dict, joint: Joint,
                     vocab_outputs: bool = False) -> dict:
    """The propagation pass's sweep on the joint graph with every weight's placement fixed:
    weights and tangents enter as inputs given their placement (``ctx.input_specs``), which
    the sweep hands their consumers; afterwards the weights are weights again, placed.

    A tangent takes the placement its output has before the forward gathers it (the
    backward of an all-gather is a local slice; a Partial output's tangent is the whole
    gradient, Replicate); with ``vocab_outputs`` an output kept as ``tp`` blocks
    (``_vocab_block_spec``) has its tangent arrive as the block's gradient. Returns those
    outputs' indices and block specs. Sweeps repeat until that and one more refinement settle: a partial
    sum that flows through linear ops (the norm's backward) into several reductions is
    reduced once, at the latest value they all pass through (the input gradient of a
    column-parallel block, summed over q, k, v: Megatron's one all-reduce)."""
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
            _run_once(gm, ctx, set(), reduced, gathered)
            while untag_moved_regions(gm, ctx):   # those routing regions run gathered
                _run_once(gm, ctx, set(), reduced, gathered)
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
    for k in (tangents.values() if vocab_outputs else ()):
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
    return kept


def _gradient_targets(gm: fx.GraphModule, joint: Joint, specs: dict, ctx: PassCtx,
                      kept: dict) -> None:
    """The output node's needs: the model's outputs gathered (Replicate; one in ``kept``:
    its ``tp`` blocks), each parameter's gradient in its parameter's placement."""
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


def _localize_backward(gm: fx.GraphModule, ctx: PassCtx) -> int:
    """Backward ops whose arguments spell a global shape or size: the local one."""
    from ..placement import local_shape
    changed = 0
    for node in gm.graph.nodes:
        if node.target in (aten.slice_backward.default, aten.select_backward.default):
            val, spec = node.meta["val"], node.meta["fxshard_spec"]
            local = list(local_shape(tuple(val.shape), spec, ctx.mesh, what=node.name))
            if node.target is aten.slice_backward.default:
                changed += _fused_slice_bounds(node, spec, ctx)
            if list(node.args[1]) != local:
                node.update_arg(1, local)
                changed += 1
        elif node.target is aten.embedding_dense_backward.default:
            changed += _vocab_backward(node, ctx)
    if changed:
        gm.recompile()
    return changed


def _fused_slice_bounds(node: fx.Node, spec: tuple, ctx: PassCtx) -> int:
    """A part's gradient padded into a fused layout: its bounds where the rank's local parts
    put them (``StridedShard.local_bound``)."""
    from ..placement import StridedShard
    dim = node.args[2] % len(node.args[1])
    strided = [(n, p) for n, p in zip(ctx.mesh.shape, spec)
               if n > 1 and isinstance(p, StridedShard) and p.dim == dim]
    if not strided:
        return 0
    if len(strided) > 1:
        raise NotImplementedError(
            f"{_WHERE}: gradient {node.name} pads into a fused dim split by {len(strided)} "
            f"mesh axes (mesh {ctx.mesh.describe()}); one axis (tp) is supported")
    (n, p), = strided
    size = node.args[1][dim]
    start, end = node.args[3], min(node.args[4], size)
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    node.update_arg(3, p.local_bound(start, n))
    node.update_arg(4, p.local_bound(end, n))
    return 1


def _vocab_backward(node: fx.Node, ctx: PassCtx) -> int:
    """The gradient of a vocab-sharded table's rows: ``fxshard::vocab_embedding_backward``
    (one vocab axis, as the forward's ``vocab_embedding``)."""
    from ..placement import Shard
    from ..ops.training import vocab_embedding_backward
    spec = node.meta["fxshard_spec"]
    axes = [(a, n) for a, n, p in zip(ctx.mesh.axis_names, ctx.mesh.shape, spec)
            if n > 1 and p == Shard(0)]
    if not axes:
        return 0
    if len(axes) > 1 or node.args[4]:
        raise NotImplementedError(
            f"{_WHERE}: embedding gradient {node.name} is vocab-sharded over {axes} "
            f"(scale_grad_by_freq={node.args[4]}); one vocab axis without scale_grad_by_freq "
            f"is supported. Use embedding='embed_dim' (the default)")
    (axis, n), = axes
    grad, ids, vocab, padding = node.args[:4]
    node.target = vocab_embedding_backward.default
    node.args = (grad, ids, vocab // n, padding, axis, n)
    return 1


def _split_partly_whole(model: torch.nn.Module, joint: Joint, specs: dict,
                        ctx: PassCtx) -> Joint:
    """The joint graph again, with every fused projection whose parts tp keeps partly whole
    (``ctx.partly_whole``: a multi-query ``qkv`` on more tp ranks than KV heads) run as one
    ``linear`` per part (``fxshard.training.joint._Differentiable``): the backward then holds
    each part's gradient apart, the query part's a shard, the K/V parts' partial sums over tp
    reduced as any replicated weight's, where one fused gradient would be partly a shard and
    partly a partial sum, a layout no collective reduces. The forward still reads the one
    weight (its slices), so the rank's shard and checkpoint layout are the inference ones."""
    if not ctx.partly_whole:
        return joint
    from ..placement import StridedShard
    split = {}
    for fqn in ctx.partly_whole:
        fused = [p for p in specs.get(fqn, ()) if isinstance(p, StridedShard) and p.dim == 0]
        if fused:
            split[fqn] = tuple(fused[0].parts)
    if not split:
        return joint
    from .joint import _placeholders_for_meta, joint_of
    with _placeholders_for_meta(model, tuple(joint.flat), {}):
        return joint_of(joint.traced, model, joint.flat, joint.tied, joint.grad_inputs,
                        split=split)


def _fsdp_gathers(gm: fx.GraphModule, reshard_after_forward, ctx: PassCtx) -> set:
    """The all-gathers of fsdp-sharded parameters the forward saves rather than the backward
    redoes: none (``reshard_after_forward=True``), all (``False``) or those of the parameters
    outside the layer stack (``"layers"``: the embedding, the final norm, the head; what
    FSDP2's root keeps when ``fully_shard`` wraps each layer and the model)."""
    if reshard_after_forward is True:
        return set()
    out = set()
    for node in gm.graph.nodes:
        step = node.meta.get("fxshard_collective")
        src = node.args[0] if node.args else None
        fqn = src.meta.get("fxshard_param") if isinstance(src, fx.Node) else None
        if step is not None and step.axis == FSDP and step.op == "all_gather" and \
                fqn is not None and (reshard_after_forward is False or
                                     layer_of(fqn, ctx) is None):
            out.add(node)
    return out


def _local_bytes(node: fx.Node, mesh: MeshSpec) -> int:
    """Bytes of a node's value on one rank (its global value and placement)."""
    from ..placement import local_shape
    from ..explain import data_dependent
    val, spec = node.meta.get("val"), node.meta.get("fxshard_spec")
    if not isinstance(val, torch.Tensor) or not isinstance(spec, tuple) or \
            data_dependent(val.shape):    # (a size known only at run time: not counted)
        return 0
    return int(torch.Size(local_shape(tuple(val.shape), spec, mesh)).numel()) * \
        val.element_size()


def _model_name(model: torch.nn.Module) -> str:
    """The model's class name for messages (a loss traced with it: the model's own)."""
    from .with_loss import WithLoss
    return type(model.inner if isinstance(model, WithLoss) else model).__name__


def build_train_program(model: torch.nn.Module, args: tuple, kwargs: dict, ctx: PassCtx,
                        *, reshard_after_forward: bool | str = True,
                        recompute=None, joint: Joint | None = None,
                        vocab_outputs: bool = False) -> TrainProgram:
    """The forward and backward rank programs of ``model`` on ``args``/``kwargs`` under
    ``ctx`` (its mesh, plan, sequence parallelism). ``reshard_after_forward``: an fsdp
    parameter's all-gather is done again in the backward (True) or its result saved by the
    forward (False: more memory, one all-gather less per parameter); ``"layers"``: only the
    layer stack's are done again, the rest saved (FSDP2's default for its root).
    ``recompute``: ``"layers"`` or a budget of saved bytes per rank, see
    :mod:`fxshard.training.recompute`. ``joint``: a joint graph built already (a pipeline
    stage's, :mod:`fxshard.training.pipeline`). ``vocab_outputs``: an output the forward
    holds sharded on its last dim over ``tp`` (the logits) leaves it as each rank's block
    (:mod:`fxshard.training.vocab_output`), not gathered."""
    with quiet():    # torch's log of the stand-ins of sizes known only at run time
        program = _build_train_program(model, args, kwargs, ctx,
                                       reshard_after_forward=reshard_after_forward,
                                       recompute=recompute, joint=joint,
                                       vocab_outputs=vocab_outputs)
    for gm in (program.split.forward, program.split.backward):
        check_no_stand_ins(gm, _WHERE)
    return program


def _build_train_program(model: torch.nn.Module, args: tuple, kwargs: dict, ctx: PassCtx,
                         *, reshard_after_forward, recompute, joint, vocab_outputs
                         ) -> TrainProgram:
    check_training_axes(ctx.mesh)
    if ctx.mesh.axis_size(PP) > 1:
        raise NotImplementedError(
            f"{_WHERE}: one training program over mesh axis {PP!r} of size "
            f"{ctx.mesh.axis_size(PP)} (mesh {ctx.mesh.describe()}); pipeline training runs "
            f"one program per stage: use fxshard.parallelize(model, mesh) and pm(x) or "
            f"pm.train_step (fxshard.training.pipeline)")
    if joint is None:
        joint = joint_graph(model, args, kwargs, ctx=ctx)
    check_dropout_mesh(joint.traced.gm, ctx.mesh)
    shapes = {n.meta.get("fxshard_param") or n.meta.get("fxshard_buffer"):
              tuple(n.meta["val"].shape) for n in joint.gm.graph.nodes
              if n.op == "placeholder" and (n.meta.get("fxshard_param") or
                                            n.meta.get("fxshard_buffer"))}
    specs = forward_placements(joint, ctx)
    joint = _split_partly_whole(model, joint, specs, ctx)
    jctx = PassCtx(mesh=ctx.mesh, sequence_parallel=ctx.sequence_parallel, strict=ctx.strict,
                   plan=ctx.plan, embedding_style=ctx.embedding_style,
                   ring_zigzag=ctx.ring_zigzag, aliases=ctx.aliases)
    # the forward's placements decided these lists: explain() shows them
    jctx.fsdp_whole, jctx.replicated = list(ctx.fsdp_whole), list(ctx.replicated)
    jctx.padded = dict(ctx.padded)
    gm = repeat_kv_pass(joint.gm, ctx=jctx)
    gm = dedupe_views_pass(gm, ctx=jctx)
    gm = run_passes(gm, [split_loss_pass, mark_ulysses_pass], jctx)
    jctx.report("propagate_pass", changed=False, fused_slice_gradients=tag_sliced(gm))
    kept = _joint_propagate(gm, jctx, specs, joint, vocab_outputs)
    _gradient_targets(gm, joint, specs, jctx, kept)
    try:
        gm = run_passes(gm, [vocab_parallel_loss_pass, insert_collectives_pass,
                             drop_marks_pass, localize_pass], jctx)
    except NotImplementedError as e:
        if "parts kept whole" not in str(e) or not ctx.partly_whole:
            raise
        fqn, why = next(iter(ctx.partly_whole.items()))
        raise NotImplementedError(
            f"{_WHERE}: {_model_name(model)}'s fused projection {fqn} has {why}; training "
            f"it on mesh {ctx.mesh.describe()} runs it part by part, which needs it used by "
            f"a linear (x @ w.T) whose output is read part by part (a split or slices at "
            f"the parts' bounds); this forward uses it otherwise (the whole parts' gradients "
            f"would be partial sums over tp beside the split part's shard). Use a tp size that divides every part (for grouped-query attention: "
            f"at most the number of KV heads), or run it under torch.no_grad() (inference "
            f"places it)") from None
    _localize_backward(gm, jctx)
    gm = run_passes(gm, [lower_ring_pass], jctx)
    gm = cuda_attention_backward_pass(gm, ctx=jctx)   # on CUDA: fxshard's Triton backward
    # fsdp: one all-gather per layer in each program, one reduce-scatter per layer
    jctx.layer_stack, jctx.layer_names = layer_stack_for_buckets(model)
    split = partition(gm, joint.n_outputs, joint.grads,
                      keep=_fsdp_gathers(gm, reshard_after_forward, jctx),
                      recompute=recompute, model_name=_model_name(model),
                      nbytes=lambda n: _local_bytes(n, jctx.mesh))
    for gm in (split.forward, split.backward):
        run_passes(gm, [fsdp_buckets_pass], jctx)
    return TrainProgram(split=split, specs={f: specs.get(f, tuple(R for _ in ctx.mesh.shape))
                                            for f in split.weights},
                        shapes=shapes, joint=joint, ctx=jctx,
                        reports={**ctx.reports, **jctx.reports}, training=model.training,
                        vocab_outputs=kept, padded=dict(ctx.padded),
                        padded_outputs=dict(ctx.padded_outputs or {}))
