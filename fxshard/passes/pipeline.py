"""The pass pipelines as data, and the one driver that runs them.

A pipeline is a list of passes, each ``def name_pass(gm, *, ctx) -> GraphModule``. What a pass
needs beyond the graph is on ``ctx`` (:class:`fxshard.passes.PassCtx`: ``constants`` for the
mask folds, ``cache_capacity`` for the KV-cache passes, ``out_spec`` for greedy decoding,
``layer_stack`` / ``layer_stages`` for the pipeline split, ``stage`` for emit), and what it
changed goes to ``ctx.report(pass_name, **counts)``. :func:`run_passes` owns the rest::

    for each pass:  gm = pass(gm, ctx=ctx)
                    if it changed the graph: eliminate dead code, lint, recompile

The last two passes produce more than a graph (stage graphs, programs) and keep the one
signature all the same: they leave what they make on ``ctx`` and return their input unchanged. ``split_stages_pass`` (pp > 1)
leaves one GraphModule per stage on ``ctx.stage_graphs``; :func:`run_passes` then runs the
passes after it on each stage graph in turn (``ctx.stage`` = its index; each new graph gets the
same ending first). ``emit_pass`` appends the stage's :class:`fxshard.passes.emit.Program` to
``ctx.programs``, which :func:`build_programs` returns (one program per stage). The lists::

    FORWARD  = [cleanup, eager_attention, fold_causal_mask, unrepeat_kv, moe_routing, split_loss,
                propagate, reassociate_partials, vocab_parallel_loss, expert_parallel,
                insert_collectives, lower_attention, localize, split_stages, fsdp_buckets, emit]
    PREFILL  = FORWARD + prefill_cache after lower_attention
    DECODE   = FORWARD + decode_positions after moe_routing, decode_attention before
               lower_attention
    DECODE_GREEDY = DECODE + greedy_tokens after insert_collectives (the program returns ids)

The rewrites applied after emit for the runners are :mod:`fxshard.passes.post_emit`'s lists,
run by the same driver.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..trace import Traced, cleanup_pass, trace
from . import PassCtx, PassReports
from .decode_positions import decode_positions_pass
from .eager_attention import eager_attention_pass
from .expert_parallel import expert_parallel_pass
from .emit import Program, emit_pass
from .fold_mask import fold_causal_mask_pass
from .fsdp_buckets import fsdp_buckets_pass, layer_stack_for_buckets
from .gqa import unrepeat_kv_pass
from .insert_collectives import insert_collectives_pass
from .kv_cache import decode_attention_pass, greedy_tokens_pass, prefill_cache_pass
from .localize import localize_pass
from .lower_attention import lower_attention_pass
from .moe_routing import moe_routing_pass
from .pad_vocab import pad_vocab_pass
from .propagate import propagate_pass
from .reassociate import reassociate_partials_pass
from .split_stages import assign_layers_to_stages, find_layer_stack, split_stages_pass
from .vocab_loss import split_loss_pass, vocab_parallel_loss_pass
from ..mesh import FSDP, PP

__all__ = ["FORWARD", "PREFILL", "DECODE", "DECODE_GREEDY", "passes_for", "run_passes",
           "build_programs"]

GraphPass = Callable[..., fx.GraphModule]


def _with(passes: list, new: GraphPass, *, before: GraphPass | None = None,
          after: GraphPass | None = None) -> list:
    i = passes.index(before) if before is not None else passes.index(after) + 1
    return [*passes[:i], new, *passes[i:]]


FORWARD: list[GraphPass] = [
    cleanup_pass, eager_attention_pass, fold_causal_mask_pass, unrepeat_kv_pass,
    moe_routing_pass, split_loss_pass, pad_vocab_pass, propagate_pass,
    reassociate_partials_pass,
    vocab_parallel_loss_pass, expert_parallel_pass, insert_collectives_pass, lower_attention_pass,
    localize_pass, split_stages_pass, fsdp_buckets_pass, emit_pass]
PREFILL = _with(FORWARD, prefill_cache_pass, after=lower_attention_pass)
DECODE = _with(_with(FORWARD, decode_attention_pass, before=lower_attention_pass),
               decode_positions_pass, after=moe_routing_pass)
DECODE_GREEDY = _with(DECODE, greedy_tokens_pass, after=insert_collectives_pass)


def passes_for(generation: tuple | None) -> list[GraphPass]:
    """The pipeline of a program kind: ``None`` (the forward), ``("prefill", capacity)``,
    ``("decode", capacity)`` or ``("decode", capacity, "greedy")``."""
    if generation is None:
        return FORWARD
    mode, _, *options = generation
    if mode == "prefill" and not options:
        return PREFILL
    if mode == "decode" and options in ([], ["greedy"]):
        return DECODE_GREEDY if options else DECODE
    raise ValueError(f"fxshard.passes.pipeline: generation={generation!r}; expected "
                     f"('prefill', capacity), ('decode', capacity) or "
                     f"('decode', capacity, 'greedy')")


def _finish(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def run_passes(gm: fx.GraphModule, passes: list[GraphPass], ctx: PassReports
               ) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``; after each that changed the graph (it reported a
    nonzero count, or ``changed=True``), eliminate dead code, lint and recompile. A pass that
    leaves ``ctx.stage_graphs`` (``split_stages_pass``) hands the rest of the list to each
    stage graph in turn. Returns the graph after the last pass (after a split: the last
    stage's)."""
    for i, graph_pass in enumerate(passes):
        ctx.changed = False
        gm = graph_pass(gm, ctx=ctx)
        if ctx.changed:
            _finish(gm)
        stages = getattr(ctx, "stage_graphs", None)
        if stages is not None:
            ctx.stage_graphs = None
            for s, stage_gm in enumerate(stages):
                ctx.stage = s
                _finish(stage_gm)
                gm = run_passes(stage_gm, passes[i + 1:], ctx)
            return gm
    return gm


def _layer_stages(model: torch.nn.Module, n_stages: int, stages
                  ) -> tuple[str, tuple[str, ...], list[int]]:
    stack, names = find_layer_stack(model)
    n_layers = len(names)
    if stages is None:
        return stack, names, assign_layers_to_stages(n_layers, n_stages)
    stages = list(stages)
    if len(stages) != n_layers or any(not 0 <= s < n_stages for s in stages) or \
            stages != sorted(stages) or set(stages) != set(range(n_stages)):
        raise ValueError(
            f"fxshard.parallelize: stages={stages} must give each of the {n_layers} layers of "
            f"{stack} a stage in 0..{n_stages - 1}, in non-decreasing order, using every stage, "
            f"e.g. {assign_layers_to_stages(n_layers, n_stages) if n_layers >= n_stages else '-'}")
    return stack, names, stages


def build_programs(model: torch.nn.Module, args: tuple, kwargs: dict, ctx: PassCtx, *,
                   stages: list[int] | None = None, traced: Traced | None = None,
                   buffers: dict | None = None, generation: tuple | None = None
                   ) -> tuple[Traced, list[Program]]:
    """Trace ``model`` on ``args``/``kwargs`` (unless ``traced`` is given) and run the
    pipeline of ``generation`` (:func:`passes_for`) under ``ctx``: the trace and one program
    per pipeline stage. ``buffers`` (FQN -> tensor) are the values the mask folds read instead
    of the model's own (what ``load_state_dict`` loaded). ``generation``: ``("prefill" |
    "decode", cache capacity per rank)`` binds a KV cache (:mod:`fxshard.passes.kv_cache`);
    ``("decode", capacity, "greedy")``: the decode program returns the argmax token ids
    instead of the logits."""
    passes = passes_for(generation)
    n_stages = ctx.mesh.axis_size(PP)
    if n_stages > 1:  # validate before the (slower) trace
        ctx.layer_stack, ctx.layer_names, ctx.layer_stages = _layer_stages(model, n_stages, stages)
    elif ctx.mesh.axis_size(FSDP) > 1:   # fsdp's buckets follow the layers
        ctx.layer_stack, ctx.layer_names = layer_stack_for_buckets(model)
    if traced is None:
        traced = trace(model, args, kwargs, real_inputs=generation is not None
                       and generation[0] == "decode")
    ctx.constants = {**traced.constants, **(buffers or {})}
    ctx.out_spec = traced.out_spec
    ctx.cache_capacity = generation[1] if generation is not None else 0
    ctx.stage, ctx.stage_graphs, ctx.programs = 0, None, []
    run_passes(traced.gm, passes, ctx)
    return traced, list(ctx.programs)
