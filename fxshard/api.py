"""``fxshard.parallelize``: trace once per input signature, run the passes, run every rank.

    pm = fxshard.parallelize(model, mesh)
    out = pm(input_ids)          # same value and structure as model(input_ids)
    pm.rank_module(3)            # the GraphModule rank 3 runs
    print(pm.explain())          # placements, collectives, bytes, parameters per rank

On a simulated mesh ``pm(x)`` runs every rank as a thread of this process and returns the
global output. Under ``torchrun`` (a real ``DeviceMesh``) each process builds and runs only its
own rank; every rank passes the same global input and gets the full output back.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .checks import (check_parallelize_args, check_state_dict_values, inference_only,
                     out_of_vocabulary, unmatched_plan_patterns)
from .mesh import MeshSpec, is_simulated, mesh_spec
from .passes import PLAN_STYLES, PassCtx
from .passes.fold_mask import fold_causal_mask_pass
from .passes.gqa import unrepeat_kv_pass
from .passes.eager_attention import eager_attention_pass
from .passes.emit import Program, build_rank_module, emit_pass
from .passes.insert_collectives import insert_collectives_pass
from .passes.kv_cache import (decode_attention_pass, greedy_tokens_pass,
                                prefill_cache_pass)
from .passes.localize import localize_pass
from .passes.lower_attention import lower_attention_pass
from .passes.propagate import propagate_pass
from .passes.split_stages import assign_layers_to_stages, find_layer_stack, split_stages_pass
from .placement import R
from .runtime.agreement import agree
from .runtime.runner import run
from .trace import Traced, cleanup_pass, trace
from .weights import WeightWatch, materialize_buffers, non_persistent_buffers

__all__ = ["parallelize", "ParallelModule"]

_WHERE = "fxshard.parallelize"


@dataclass
class Compiled:
    """Everything built for one input signature: one program per pipeline stage."""

    traced: Traced
    ctx: PassCtx
    programs: list
    modules: dict = field(default_factory=dict)     # rank -> GraphModule
    compiled: dict = field(default_factory=dict)    # stage -> CompiledStage (compile=True)
    runners: dict = field(default_factory=dict)     # rank -> (GraphModule, bound callable)
    loaded: bool = False                            # every weight slot has a value

    @property
    def program(self) -> Program:
        return self.programs[0]


def _signature(flat) -> tuple:
    return tuple((tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor)
                 else ("const", repr(x)) for x in flat)


def compile_program(model: torch.nn.Module, args: tuple, kwargs: dict, ctx: PassCtx, *,
                    stages: list[int] | None = None, traced: Traced | None = None,
                    buffers: dict | None = None,
                    generation: tuple | None = None) -> Compiled:
    """Trace ``model`` on ``args``/``kwargs`` (unless ``traced`` is given) and run the pass
    pipeline under ``ctx``. ``buffers`` (FQN -> tensor) are the values the mask folds read
    instead of the model's own (what ``load_state_dict`` loaded). ``generation``:
    ``("prefill" | "decode", cache capacity per rank)`` binds a KV cache
    (:mod:`fxshard.passes.kv_cache`); ``("decode", capacity, "greedy")``: the decode program
    returns the argmax token ids instead of the logits (``greedy_tokens_pass``)."""
    n_stages = ctx.mesh.axis_size("pp")
    if n_stages > 1:  # validate before the (slower) trace
        stack, layer_stages = _layer_stages(model, n_stages, stages)
    if traced is None:
        traced = trace(model, args, kwargs, real_inputs=generation is not None
                       and generation[0] == "decode")
    gm = cleanup_pass(traced.gm, ctx=ctx)
    constants = {**traced.constants, **(buffers or {})}
    gm = eager_attention_pass(gm, ctx=ctx, constants=constants)
    gm = fold_causal_mask_pass(gm, ctx=ctx, constants=constants)
    gm = unrepeat_kv_pass(gm, ctx=ctx)
    gm = propagate_pass(gm, ctx=ctx)
    gm = insert_collectives_pass(gm, ctx=ctx)
    mode, capacity, *options = generation or (None, 0)
    if "greedy" in options:
        gm = greedy_tokens_pass(gm, ctx=ctx, out_spec=traced.out_spec)
    if mode == "decode":
        gm = decode_attention_pass(gm, ctx=ctx, capacity=capacity)
    gm = lower_attention_pass(gm, ctx=ctx)
    if mode == "prefill":
        gm = prefill_cache_pass(gm, ctx=ctx, capacity=capacity)
    gm = localize_pass(gm, ctx=ctx)
    if n_stages > 1:
        graphs = split_stages_pass(gm, ctx=ctx, stack=stack, layer_stages=layer_stages)
        programs = [emit_pass(g, ctx=ctx, stage=s) for s, g in enumerate(graphs)]
    else:
        programs = [emit_pass(gm, ctx=ctx)]
    return Compiled(traced=traced, ctx=ctx, programs=programs)


def _layer_stages(model, n_stages: int, stages) -> tuple[str, list[int]]:
    stack, n_layers = find_layer_stack(model)
    if stages is None:
        return stack, assign_layers_to_stages(n_layers, n_stages)
    stages = list(stages)
    if len(stages) != n_layers or any(not 0 <= s < n_stages for s in stages) or \
            stages != sorted(stages) or set(stages) != set(range(n_stages)):
        raise ValueError(
            f"{_WHERE}: stages={stages} must give each of the {n_layers} layers of {stack} a "
            f"stage in 0..{n_stages - 1}, in non-decreasing order, using every stage, e.g. "
            f"{assign_layers_to_stages(n_layers, n_stages) if n_layers >= n_stages else '-'}")
    return stack, stages


class ParallelModule:
    """A model parallelized over a mesh; see :func:`parallelize`."""

    def __init__(self, model: torch.nn.Module, mesh, *, plan: dict, sequence_parallel: bool,
                 microbatches: int, strict: bool, embedding: str, stages=None,
                 ring_zigzag: bool = True, compile: bool = False):
        self.model = model
        self.mesh = mesh
        self.spec: MeshSpec = mesh_spec(mesh, where=_WHERE)
        self.plan = dict(plan)
        self.sequence_parallel = sequence_parallel
        self.microbatches = microbatches
        self.strict = strict
        self.embedding = embedding
        self.stages = stages
        self.ring_zigzag = ring_zigzag
        materialize_buffers(model)
        self.unmatched_plan: list[str] = []
        self.compile = compile
        self._values = {k: v for k, v in model.state_dict(keep_vars=True).items()}
        self._expected = {k: (tuple(v.shape), v.dtype) for k, v in self._values.items()}
        extra = non_persistent_buffers(model)  # in no state dict or checkpoint
        self._buffers_np = {k: (tuple(v.shape), v.dtype) for k, v in extra.items()}
        self._values.update(extra)
        self._buffer_fqns = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self._watch = WeightWatch(model)
        self._compiled: dict[tuple, Compiled] = {}
        self._last: Compiled | None = None
        self._world = None
        self._kv_state = None    # the last generate's caches (fxshard.generate._Caches)
        self._device = torch.device(self.spec.device_type)

    # -- building ----------------------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict, generation: tuple | None = None) -> Compiled:
        decode = generation is not None and generation[0] == "decode"
        ctx = PassCtx(mesh=self.spec, sequence_parallel=self.sequence_parallel and not decode,
                      strict=self.strict, plan=self.plan, embedding_style=self.embedding,
                      ring_zigzag=self.ring_zigzag, split_sequence=not decode)
        c = compile_program(self.model, args, kwargs, ctx, stages=self.stages,
                            buffers=self._buffer_values(), generation=generation)
        for fqn, value in c.traced.constants.items():
            if value is not None:
                self._values.setdefault(fqn, value)
        return c

    def _buffer_values(self) -> dict:
        """The buffers' values as loaded (a checkpoint's read whole: buffers are small)."""
        out = {}
        for fqn in self._buffer_fqns:
            v = self._values.get(fqn)
            if hasattr(v, "block"):
                v = v.block((R,) * len(self.spec.shape), self.spec, 0)
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                out[fqn] = v
        return out

    def _split(self, args: tuple, kwargs: dict) -> list[list]:
        """The flat inputs of each microbatch (the batch is dim 0 of every tensor input)."""
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
            flat = list(args)   # what tree_flatten gives, without its ~15 us per call
        else:
            flat, _ = pytree.tree_flatten((args, kwargs))
        m = self.microbatches
        if m == 1:
            return [flat]
        for x in flat:
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % m):
                raise ValueError(
                    f"{_WHERE}: an input of shape {tuple(x.shape)} cannot be split into "
                    f"microbatches={m} along dim 0 (batch {x.shape[0] if x.dim() else '-'}); "
                    f"use a batch that is a multiple of {m} or change microbatches")
        return [[x.chunk(m)[i] if isinstance(x, torch.Tensor) else x for x in flat]
                for i in range(m)]

    def _get(self, args: tuple, kwargs: dict, generation: tuple | None = None
             ) -> tuple[Compiled, list[list]]:
        micro = self._split(args, kwargs)
        key = (generation, _signature(micro[0]))
        if key not in self._compiled:
            agree(self, _WHERE, {"generation": generation, "inputs": micro[0]})  # real mesh
            _, spec = pytree.tree_flatten((args, kwargs))
            a, k = pytree.tree_unflatten(micro[0], spec)
            try:
                self._compiled[key] = self._build(tuple(a), dict(k), generation)
            except ValueError as e:
                if len(micro) == 1:
                    raise
                raise ValueError(
                    f"{e} [with microbatches={len(micro)} the program is traced on one "
                    f"microbatch, 1/{len(micro)} of the batch: the shapes above are a "
                    f"microbatch's; use fewer microbatches or a larger batch]") from e
            if len(micro) > 1:
                self._check_microbatch_outputs(self._compiled[key], micro[0])
        self._last = self._compiled[key]
        return self._last, micro

    def _check_microbatch_outputs(self, c: Compiled, first: list) -> None:
        """Microbatch outputs are joined along dim 0, so every tensor output must be per-sample
        (batch on dim 0), not a reduction over the batch (a mean loss, a sum)."""
        batch = next(x.shape[0] for x in first if isinstance(x, torch.Tensor) and x.dim())
        out_node = next(n for n in c.programs[-1].graph.nodes if n.op == "output")
        for i, a in enumerate(pytree.tree_leaves(out_node.args[0])):
            v = a.meta.get("val") if isinstance(a, fx.Node) else None
            if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != batch):
                raise ValueError(
                    f"{_WHERE}: with microbatches={self.microbatches} the outputs of the "
                    f"microbatches are joined along dim 0, but output {i} has shape "
                    f"{tuple(v.shape)} per microbatch of {batch} samples (not per-sample). "
                    f"Return per-sample values (e.g. logits, not a loss) or use microbatches=1")

    def stage_of(self, rank: int) -> int:
        return self.spec.axis_index(rank, "pp")

    def _module(self, c: Compiled, rank: int) -> fx.GraphModule:
        if rank not in c.modules:
            c.modules[rank] = build_rank_module(c.programs[self.stage_of(rank)], rank,
                                                self.spec, self._values, self._device)
        return c.modules[rank]

    def _runner(self, c: Compiled, rank: int, flat: list):
        """What rank ``rank`` calls: its stage's program bound to its weights, as a plain
        GraphModule with weights as inputs (``fxshard.compile.eager_stage``) or, with
        ``compile=True``, Inductor-compiled (once per stage, here, in the calling thread: call
        it for every rank before the ranks run)."""
        mod = self._module(c, rank)
        built = c.runners.get(rank)
        if built is None or built[0] is not mod:
            from .compile import compile_stage, eager_stage
            stage = self.stage_of(rank)
            if not self.compile:
                fn = eager_stage(c.programs[stage])
            else:
                if stage not in c.compiled:
                    state = [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype,
                                         device=self._device)
                             for n in c.programs[stage].graph.nodes
                             if n.op == "placeholder" and n.meta.get("fxshard_state") is not None]
                    c.compiled[stage] = compile_stage(
                        c.programs[stage], mod,
                        [x for x in flat if isinstance(x, torch.Tensor)] + state,
                        groups=None if is_simulated(self.mesh) else {
                            axis: self.mesh.get_group(axis).group_name
                            for axis in self.mesh.mesh_dim_names})
                fn = c.compiled[stage]
            built = c.runners[rank] = (mod, fn.bind(mod))
        return built[1]

    # -- running -----------------------------------------------------------------------
    def _sync_weights(self) -> None:
        """Take the model's tensors that changed since the last call (in place, reloaded,
        reassigned, cast) and re-slice every rank's weights from them; a new dtype or shape,
        or a changed buffer (a mask the trace may have folded), also retraces."""
        changed = {k: v for k, v in self._watch.changed().items()
                   if v is not None and v.device.type != "meta"}
        if not changed:
            return
        self._values.update(changed)
        self._invalidate(retrace=self._needs_retrace(changed))

    def _needs_retrace(self, values: dict) -> bool:
        """A changed buffer, dtype or shape needs a new trace; records the new dtypes/shapes."""
        retrace = False
        for k, v in values.items():
            table = self._expected if k in self._expected else self._buffers_np
            now = (tuple(v.shape), v.dtype)
            retrace |= k in self._buffer_fqns or table.get(k) != now
            table[k] = now
        return retrace

    def _invalidate(self, *, retrace: bool = False) -> None:
        if retrace:  # the next call traces again (rank_module shows the old program till then)
            self._compiled.clear()
        for c in self._compiled.values():
            c.modules.clear()
            c.runners.clear()
            c.loaded = False

    def _check_loaded(self, c: Compiled) -> None:
        empty = [fqn for p in c.programs for fqn, slot in p.slots.items()
                 if self._values.get(fqn) is None or self._values[fqn].device.type == "meta"
                 and not hasattr(self._values[fqn], "block")]
        if not empty:
            c.loaded = True
            return
        buffers = [f for f in empty if f in self._buffers_np]
        weights = [f for f in empty if f not in self._buffers_np]
        also = (f"; the weights are not loaded either ({weights[0]!r} and {len(weights) - 1} "
                f"more): call pm.load_state_dict(full_state_dict) or "
                f"fxshard.load_safetensors(pm, path)") if weights else ""
        if buffers:
            raise ValueError(
                f"{_WHERE}: the non-persistent buffers {buffers[:4]}"
                f"{' ...' if len(buffers) > 4 else ''} are on the meta device and no checkpoint "
                f"holds them (state_dict() leaves them out). Build the model under "
                f"fxshard.init_empty_weights() instead of torch.device('meta') so its "
                f"constructor computes them, or pass them by name to pm.load_state_dict{also}")
        raise ValueError(f"{_WHERE}: the model was built on the meta device and has no "
                         f"weights yet ({weights[0]!r} and {len(weights) - 1} more are empty); "
                         f"call pm.load_state_dict(full_state_dict) or "
                         f"fxshard.load_safetensors(pm, path) before running it")

    def __call__(self, *args, **kwargs):
        self._sync_weights()
        c, micro = self._get(args, kwargs)
        if not c.loaded:
            self._check_loaded(c)
        try:
            out = run(self, c, micro)
        except IndexError as e:  # name the token id and the vocabulary, not "out of range"
            raise out_of_vocabulary(self.model, c.traced, args, kwargs, e, where=_WHERE)
        return pytree.tree_unflatten(inference_only(self.model, list(out)), c.traced.out_spec)

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prompt plus up to ``max_new_tokens`` new tokens, ``[B, S + new]``, as HuggingFace's
        ``model.generate`` returns them: greedy (``do_sample=False``) or sampled (temperature,
        top-k, top-p, ``generator``); a sequence that emits ``eos_token_id`` (an id or a list)
        is padded with ``pad_token_id`` (default: the eos id) and generation stops when all
        have. A static KV cache per rank, sharded like the K/V it holds (see
        :mod:`fxshard.generate`); the model's forward must take ``position_ids``."""
        from .generate import generate
        return generate(self, input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        generator=generator)

    # -- inspection --------------------------------------------------------------------
    def _require_compiled(self, what: str) -> Compiled:
        if self._last is None:
            raise ValueError(f"ParallelModule.{what}: nothing is traced yet; call pm(x) once or "
                             f"pass example_inputs= to fxshard.parallelize")
        return self._last

    def rank_module(self, rank: int) -> fx.GraphModule:
        """The GraphModule rank ``rank`` runs for the most recent input signature."""
        c = self._require_compiled("rank_module")
        self.spec.coords(rank)
        self._sync_weights()
        return self._module(c, rank)

    def explain(self):
        from .explain import explain
        return explain(self, self._require_compiled("explain"))

    # -- weights -----------------------------------------------------------------------
    def tied_names(self) -> dict[str, list[str]]:
        """``{name: [other names of the same parameter]}`` for tied weights."""
        groups: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        return {n: [m for m in g if m != n] for g in groups.values() if len(g) > 1 for n in g}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the unsharded model's state dict; each rank keeps only its slices.

        Every key of ``model.state_dict()`` is required; the model's non-persistent buffers
        (in no checkpoint) may be given too, by name."""
        check_state_dict_values("ParallelModule.load_state_dict", state_dict)
        missing = sorted(set(self._expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._expected) - set(self._buffers_np))
        if missing or unexpected:
            raise ValueError(
                f"ParallelModule.load_state_dict: the state dict does not match the model: "
                f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                f"keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}. Pass the "
                f"unsharded model's state_dict() with the same parameter names.")
        for k, (shape, _) in {**self._buffers_np, **self._expected}.items():
            if k not in state_dict:
                continue
            got = tuple(state_dict[k].shape)
            if got != shape:
                raise ValueError(
                    f"ParallelModule.load_state_dict: {k!r} has shape {got} but the model "
                    f"expects {shape}; load a checkpoint of the same configuration")
        self._values.update(state_dict)
        self._watch.changed()  # the model's own tensors as they are now count as seen
        self._invalidate(retrace=any(k in self._buffer_fqns for k in state_dict))

    def close(self) -> None:
        """Release the ranks' threads (simulated mesh) or this process's backend and its
        pending sends (real mesh); the module can still be called afterwards."""
        self._kv_state = None
        if self._world is not None:
            self._world.close()
            self._world = None
        if not is_simulated(self.mesh):
            from .runtime.distributed import release
            release(self.mesh)


def parallelize(model: torch.nn.Module, mesh, *, example_inputs: tuple | None = None,
                example_kwargs: dict | None = None, plan: dict | None = None,
                sequence_parallel: bool = False, microbatches: int = 1, strict: bool = False,
                embedding: str = "embed_dim", stages: list[int] | None = None,
                ring_zigzag: bool = True, compile: bool = False) -> ParallelModule:
    """Parallelize an unmodified ``model`` over ``mesh`` by rewriting its traced ATen graph.

    Args:
        mesh: from :func:`fxshard.init_device_mesh`, or a torch ``DeviceMesh``.
        example_inputs / example_kwargs: trace now; otherwise at the first call (one program
            per input signature).
        plan: tensor-parallel overrides by module-name glob, e.g.
            ``{"model.layers.*.mlp.up_proj": "colwise"}``; styles colwise, rowwise, vocab,
            embed_dim, replicate.
        sequence_parallel: keep activations between blocks sharded on the sequence on ``tp``.
        microbatches: pipeline microbatches (GPipe schedule).
        strict: an op without a sharding rule is an error instead of a replicated fallback.
        embedding: default tp style of embeddings: ``"embed_dim"`` (each rank holds
            ``1/tp`` of the table; the lookup's output is all-gathered), ``"vocab"`` (rows
            split; an all-reduce) or ``"replicate"`` (the whole table on every rank: no
            collective, e.g. one fewer per decode step of ``generate``, for ``tp - 1``
            tables' worth of memory per rank).
        stages: the pipeline stage of each layer of the model's layer stack (default
            :func:`fxshard.passes.split_stages.assign_layers_to_stages`).
        ring_zigzag: shard the sequence zigzag on ``ring_cp`` (rank j holds chunks j and
            2n-1-j of 2n) so causal ring attention gives every rank the same work; needs the
            sequence to divide by 2n. ``False``: contiguous chunks.
        compile: compile each stage's rank program with Inductor (``fxshard.compile``), once
            per stage and input signature; every rank of the stage shares it with its own
            weights. ``rank_module(r)`` still shows the (uncompiled) GraphModule.
    """
    check_parallelize_args(_WHERE, model=model, example_inputs=example_inputs,
                           example_kwargs=example_kwargs, plan=plan, styles=PLAN_STYLES,
                           sequence_parallel=sequence_parallel, microbatches=microbatches,
                           strict=strict, embedding=embedding, stages=stages,
                           ring_zigzag=ring_zigzag)
    spec = mesh_spec(mesh, where=_WHERE)
    if not isinstance(compile, bool):
        raise TypeError(f"{_WHERE}: compile={compile!r}; pass True (Inductor-compiled rank "
                        f"programs) or False")
    unmatched = unmatched_plan_patterns(_WHERE, model, plan)
    if microbatches > 1 and spec.axis_size("pp") == 1:
        warnings.warn(f"{_WHERE}: microbatches={microbatches} has no effect without a pp axis",
                      stacklevel=2)
    model.eval()
    pm = ParallelModule(model, mesh, plan=plan or {}, sequence_parallel=sequence_parallel,
                        microbatches=microbatches, strict=strict, embedding=embedding,
                        stages=stages, ring_zigzag=ring_zigzag, compile=compile)
    pm.unmatched_plan = unmatched    # globs that matched no module (warned; in explain())
    if example_inputs is not None or example_kwargs is not None:
        pm._get(tuple(example_inputs or ()), dict(example_kwargs or {}))
    return pm
