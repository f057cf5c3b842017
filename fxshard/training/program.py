"""The training pipeline: the forward passes' placements, then the same passes on the joint.

::

    model ─joint_graph─▶ joint forward+backward ATen graph (global shapes)
    forward export ─TRAIN_FORWARD (eager_attention, fold_mask, unrepeat_kv, moe_routing,
          split_loss, propagate)─▶ every parameter's placement (the inference program's: the
          shards are the same)
    joint ─TRAIN_JOINT (repeat_kv (tp > KV heads), dedupe_views, ..., joint_propagate
          (parameters fixed; tangents as their outputs), insert_collectives, localize, ...,
          partition)─▶ forward and backward rank programs ─TRAIN_RANK (fsdp_buckets)─▶

The lists are data (:mod:`fxshard.training.pass_lists`), run by
:func:`fxshard.passes.pipeline.run_passes` with a :class:`~fxshard.training.train_ctx.TrainCtx`.
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

import fxshard.passes.rules.backward  # noqa: F401  (registers the backward ops' rules)
from ..mesh import PP, MeshSpec, TRAINING_AXES
from ..passes import PassCtx
from ..passes.fsdp_buckets import layer_stack_for_buckets
from ..passes.pipeline import run_passes
from ..passes.rules import FallbackWarning
from ..placement import R
from .dropout import check_dropout_mesh
from .dynamic_sizes import check_no_stand_ins, quiet
from .joint import Joint, joint_graph
from .partition import Split
from . import pass_lists
from .train_ctx import TrainCtx

__all__ = ["TrainProgram", "build_train_program"]

_WHERE = "fxshard.training"


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
        gm = run_passes(joint.traced.gm, pass_lists.TRAIN_FORWARD, ctx)
    out = {}
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param") or node.meta.get("fxshard_buffer")
        if node.op == "placeholder" and fqn is not None:
            out[fqn] = tuple(node.meta["fxshard_spec"])
    return out


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
    jctx = TrainCtx(mesh=ctx.mesh, sequence_parallel=ctx.sequence_parallel, strict=ctx.strict,
                    plan=ctx.plan, embedding_style=ctx.embedding_style,
                    ring_zigzag=ctx.ring_zigzag, aliases=ctx.aliases, joint=joint, specs=specs,
                    vocab_outputs=vocab_outputs, reshard_after_forward=reshard_after_forward,
                    recompute=recompute, model_name=_model_name(model))
    # the forward's placements decided these lists: explain() shows them
    jctx.fsdp_whole, jctx.replicated = list(ctx.fsdp_whole), list(ctx.replicated)
    jctx.padded = dict(ctx.padded)
    # fsdp: one all-gather per layer in each program, one reduce-scatter per layer
    jctx.layer_stack, jctx.layer_names = layer_stack_for_buckets(model)
    try:
        run_passes(joint.gm, pass_lists.TRAIN_JOINT, jctx)
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
    split = jctx.split
    for gm in (split.forward, split.backward):
        run_passes(gm, pass_lists.TRAIN_RANK, jctx)
    return TrainProgram(split=split, specs={f: specs.get(f, tuple(R for _ in ctx.mesh.shape))
                                            for f in split.weights},
                        shapes=shapes, joint=joint, ctx=jctx,
                        reports={**ctx.reports, **jctx.reports}, training=model.training,
                        vocab_outputs=jctx.block_outputs, padded=dict(ctx.padded),
                        padded_outputs=dict(ctx.padded_outputs or {}))
