"""Training's pipeline as data: the pass lists of each phase and the context they share.

``build_train_program`` (:mod:`fxshard.training.program`) runs them with the one driver,
:func:`fxshard.passes.pipeline.run_passes`::

    forward export ─TRAIN_FORWARD─▶ every weight's placement (the inference program's)
    joint graph    ─TRAIN_JOINT──▶ placed, collectives, local shapes ─partition─▶
                   forward and backward rank programs (``ctx.split``)
    each program   ─TRAIN_RANK───▶ fsdp's collectives grouped per layer, a mixed-precision
                                   policy's casts of the fp32 masters and gradients
                                   (fxshard.mixed_precision)

What the joint passes need beyond the graph is on a :class:`TrainCtx`
(:mod:`fxshard.training.train_ctx`: a
:class:`~fxshard.passes.PassCtx` with the joint graph, the forward's placements and the
partition's options); what they make that is not a graph (the outputs kept as vocab blocks,
the two rank programs) they leave on it. The lists live here, not in
``fxshard/passes/pipeline.py`` beside FORWARD: the joint passes are training's modules, which
import ``fxshard.passes`` (the other way round would be a circle). A new step (mixed precision's
casts, expert parallelism's dispatch) is a new pass in a list, not a branch in the trainer.
"""
from __future__ import annotations

from ..passes.cast_params import cast_weights_pass
from ..passes.eager_attention import eager_attention_pass
from ..passes.expert_parallel import expert_parallel_pass
from ..passes.fold_mask import fold_causal_mask_pass
from ..passes.fsdp_buckets import fsdp_buckets_pass
from ..passes.gqa import unrepeat_kv_pass
from ..passes.insert_collectives import insert_collectives_pass
from ..passes.localize import localize_pass
from ..passes.moe_routing import moe_routing_pass
from ..passes.propagate import propagate_pass
from ..passes.vocab_loss import split_loss_pass, vocab_parallel_loss_pass
from .context_parallel import drop_marks_pass, lower_ring_pass, mark_ulysses_pass
from .cuda_attention import cuda_attention_backward_pass
from .gqa import repeat_kv_pass
from .joint_propagate import (gradient_targets_pass, joint_propagate_pass,
                              tag_fused_slices_pass)
from .localize_backward import localize_backward_pass
from .partition import partition_pass
from .refine import dedupe_views_pass
from .train_ctx import TrainCtx

__all__ = ["TrainCtx", "TRAIN_FORWARD", "TRAIN_JOINT", "TRAIN_RANK"]

# the inference passes up to propagate, on the forward export: the weights' placements
TRAIN_FORWARD = [eager_attention_pass, fold_causal_mask_pass, unrepeat_kv_pass, moe_routing_pass,
                 split_loss_pass, propagate_pass]
TRAIN_JOINT = [repeat_kv_pass, dedupe_views_pass, split_loss_pass, mark_ulysses_pass,
               tag_fused_slices_pass, joint_propagate_pass, gradient_targets_pass,
               vocab_parallel_loss_pass, expert_parallel_pass, insert_collectives_pass,
               drop_marks_pass,
               localize_pass, localize_backward_pass, lower_ring_pass,
               cuda_attention_backward_pass, partition_pass]
TRAIN_RANK = [fsdp_buckets_pass, cast_weights_pass]
