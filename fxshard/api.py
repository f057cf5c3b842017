"""``fxshard.parallelize``: trace once per input signature, run the passes, run every rank.

    pm = fxshard.parallelize(model, mesh)
    out = pm(input_ids)          # same value and structure as model(input_ids)
    pm.rank_module(3)            # the GraphModule rank 3 runs
    print(pm.explain())          # placements, collectives, bytes, parameters per rank

Training is the PyTorch contract: with grad enabled (and the model's parameters requiring
grad) ``pm(x)`` runs the training forward (:mod:`fxshard.training`) and its output
backpropagates into ``pm.parameters()``, each rank's parameter shards; under
``torch.no_grad()`` it is the inference program. Both are cached per input signature::

    opt = torch.optim.AdamW(pm.parameters())     # right away for a language model (inputs
                                                 # from its config), else example_inputs=
    loss_fn(pm(ids), labels).backward(); fxshard.clip_grad_norm_(pm, 1.0); opt.step()
    pm.gradients(); pm.state_dict()              # whole, by the model's names
    pm.rank_module(r, "backward")                # rank r's backward program

Once the shards exist they are the weights: the inference program reads them (the same
storages), the model object keeps its initial weights (``pm.write_back()`` copies the trained
ones into it), a change to the model is an error, and ``pm.load_state_dict`` copies into the
shards in place.

On a simulated mesh ``pm(x)`` runs every rank as a thread of this process and returns the
global output. Under ``torchrun`` (a real ``DeviceMesh``) each process builds and runs only its
own rank; every rank passes the same global input and gets the full output back.

:class:`ParallelModule` is the front door: the options, and three parts in
:mod:`fxshard.runtime` it delegates to, each usable on its own by generation, the backend and
tests: ``pm.weights`` (:class:`~fxshard.runtime.weight_store.WeightStore`: the global values
the ranks' weights are sliced from, and the watch on the model), ``pm.programs``
(:class:`~fxshard.runtime.program_cache.ProgramCache`: the programs per input signature;
``pm.programs.last`` the most recent) and ``pm.executor``
(:class:`~fxshard.runtime.executor.Executor`: binds and runs them on the ranks).
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .checks import (check_parallelize_args, inference_only, out_of_vocabulary,
                     unmatched_plan_patterns, warn_training_in_eval_mode)
from .mesh import MeshSpec, PP, is_simulated, mesh_spec
from .mixed_precision import (autocast_off, autocast_state, caller_autocast, cast_inputs,
                              cast_outputs, check_policy)
from .passes import PLAN_STYLES
from .runtime.agreement import together
from .runtime.executor import Executor
from .runtime.program_cache import Options, ProgramCache
from .runtime.weight_store import WeightStore
from .weights import materialize_buffers

__all__ = ["parallelize", "ParallelModule"]

_WHERE = "fxshard.parallelize"


def _option(name: str) -> property:
    """``pm.<name>``: the option as ``parallelize`` got it (read and written on ``pm.options``,
    which the program cache and the executor read)."""
    return property(lambda self: getattr(self.options, name),
                    lambda self, value: setattr(self.options, name, value))


class ParallelModule:
    """A model parallelized over a mesh; see :func:`parallelize`."""

    plan = _option("plan")
    sequence_parallel = _option("sequence_parallel")
    microbatches = _option("microbatches")
    strict = _option("strict")
    embedding = _option("embedding")
    stages = _option("stages")
    ring_zigzag = _option("ring_zigzag")
    compile = _option("compile")
    recompute = _option("recompute")
    fsdp_reshard_after_forward = _option("fsdp_reshard_after_forward")

    def __init__(self, model: torch.nn.Module, mesh, *, plan: dict, sequence_parallel: bool,
                 microbatches: int, strict: bool, embedding: str, stages=None,
                 ring_zigzag: bool = True, compile: bool = False, recompute=None,
                 fsdp_reshard_after_forward: bool | str = True, mixed_precision=None):
        self.model = model
        self.mesh = mesh
        self.spec: MeshSpec = mesh_spec(mesh, where=_WHERE)
        self.options = Options(plan=dict(plan), sequence_parallel=sequence_parallel,
                               microbatches=microbatches, strict=strict, embedding=embedding,
                               stages=stages, ring_zigzag=ring_zigzag, compile=compile,
                               recompute=recompute,
                               fsdp_reshard_after_forward=fsdp_reshard_after_forward,
                               mixed_precision=mixed_precision)
        materialize_buffers(model)
        self.unmatched_plan: list[str] = []
        self.weights = WeightStore(model, self.spec)
        self.programs = ProgramCache(model, mesh, self.spec, self.options, self.weights)
        self.executor = Executor(mesh, self.spec, self.options, self.weights)
        self._trainer = None
        self._example = None     # (args, kwargs) of parallelize(example_inputs=...)
        self._eval_by_parallelize = False   # parallelize switched the model to eval mode

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled() and self._requires_grad():
            self._check_mode()
            self.programs.sync_weights()    # a model change after training started: error
            if self.spec.axis_size(PP) > 1:
                self.programs.last_mode = "train"
            return self.trainer(*args, **kwargs)
        return self.infer(*args, **kwargs)

    def infer(self, *args, **kwargs):
        """The inference program whatever the grad mode (``pm(x)`` under ``torch.no_grad()``);
        with grad enabled a backward through its output is a clear error."""
        policy = self.options.mixed_precision    # FSDP2's casts of inputs and outputs
        if policy is not None:
            args, kwargs = cast_inputs(policy, args, kwargs)
        state = autocast_state()
        c, micro = self.programs.prepare(args, kwargs, autocast=state)
        try:
            if state:
                with autocast_off(state):   # autocast's casts are in the program
                    out = inference_only(self.model, self.executor.run(c, micro))
            else:
                out = inference_only(self.model, self.executor.run(c, micro))  # fresh list
        except IndexError as e:  # name the token id and the vocabulary, not "out of range"
            raise out_of_vocabulary(self.model, c.traced, args, kwargs, e, where=_WHERE)
        out = out[0] if c.out_leaf else pytree.tree_unflatten(out, c.traced.out_spec)
        return out if policy is None else cast_outputs(policy, out)

    def _requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.model.parameters())

    def _check_mode(self) -> None:
        """Once, before training: warn if the model is still in the eval mode ``parallelize``
        switched it to and has dropout (see :func:`~fxshard.checks.warn_training_in_eval_mode`)."""
        if self._eval_by_parallelize and not self.model.training:
            warn_training_in_eval_mode(_WHERE, self.model)
        self._eval_by_parallelize = False

    # -- train / eval mode, as on an nn.Module -----------------------------------------------
    @property
    def training(self) -> bool:
        """The model's mode (``parallelize`` leaves it in eval mode)."""
        return self.model.training

    def train(self, mode: bool = True) -> "ParallelModule":
        """``model.train(mode)``, returning ``pm`` as ``nn.Module.train`` returns the module:
        dropout (and any other train-mode behaviour) in the following calls, training and
        inference alike; each mode has its own programs, traced on first use."""
        if not isinstance(mode, bool):
            raise ValueError(f"ParallelModule.train: mode={mode!r}; pass True or False")
        self.model.train(mode)
        self._eval_by_parallelize = False    # the mode is the user's choice now
        return self

    def eval(self) -> "ParallelModule":
        """``model.eval()``, returning ``pm``; ``pm.train(False)``."""
        return self.train(False)

    # -- training ----------------------------------------------------------------------
    @property
    def trainer(self):
        """The :class:`fxshard.training.TrainModule` behind ``pm(x)`` with grad enabled: its
        programs live in ``pm.programs`` (keyed ``("train", signature)``), its ranks run on
        ``pm.executor``, and its shards become ``pm.weights``' values once placed."""
        if self._trainer is None:
            from .training.module import TrainModule, check_trainable
            from .training.shards import check_on_device
            check_trainable(_WHERE, self.spec, self.options)
            check_on_device(self.weights, self.model)
            o = self.options
            if self.spec.axis_size(PP) > 1:
                from .training.pipeline import PipelineTrainer
                self._trainer = PipelineTrainer(
                    self.model, self.mesh, self.spec, microbatches=o.microbatches,
                    stages=o.stages, store=self.weights, sequence_parallel=o.sequence_parallel,
                    plan=o.plan, embedding=o.embedding, strict=o.strict,
                    recompute=o.recompute, compile=o.compile, ring_zigzag=o.ring_zigzag,
                    fsdp_reshard_after_forward=o.fsdp_reshard_after_forward,
                    mixed_precision=o.mixed_precision)
                return self._trainer
            self._trainer = TrainModule(self.model, self.mesh,
                                        sequence_parallel=o.sequence_parallel, plan=o.plan,
                                        embedding=o.embedding, strict=o.strict,
                                        recompute=o.recompute, store=self.weights,
                                        executor=self.executor, cache=self.programs,
                                        ring_zigzag=o.ring_zigzag, compile=o.compile,
                                        fsdp_reshard_after_forward=o.fsdp_reshard_after_forward,
                                        mixed_precision=o.mixed_precision)
        return self._trainer

    def train_step(self, *args, loss_fn=None, target=None, schedule: str = "1f1b",
                   virtual_stages: int | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of ``args``/``kwargs`` with the loss inside:
        ``loss_fn(pm(x_i), target_i)`` per microbatch ``i`` (``target`` cut with the batch;
        no ``loss_fn``: HF's ``labels=`` and the model's loss), the gradients added to
        ``.grad`` of ``pm.parameters()``; returns the loss. Off ``pp`` the loss is traced
        with the model into one program (:mod:`fxshard.training.with_loss`), so a
        cross-entropy in it is vocab-parallel on ``tp`` (the logits never gathered). On a
        ``pp`` mesh ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``
        (``virtual_stages`` per rank, default 2): see :mod:`fxshard.training.pipeline`."""
        if self.spec.axis_size(PP) > 1:
            self._check_mode()
            self.programs.sync_weights()
            self.programs.last_mode = "train"
            return self.trainer.train_step(*args, loss_fn=loss_fn, target=target,
                                           schedule=schedule, virtual_stages=virtual_stages,
                                           **kwargs)
        if loss_fn is not None and torch.is_grad_enabled() and self._requires_grad():
            self._check_mode()
            # the loss traced with the model: a cross-entropy is vocab-parallel on tp
            self.programs.sync_weights()
            loss = self.trainer.loss_step(loss_fn, target, args, kwargs)
        else:
            out = self(*args, **kwargs)
            if loss_fn is None and not (hasattr(out, "keys") and "loss" in out.keys()):
                raise ValueError(
                    f"ParallelModule.train_step: no loss_fn= and the model's output "
                    f"({type(out).__name__}) holds no 'loss' (mesh {self.spec.describe()}); "
                    f"pass the loss and its target: pm.train_step(ids, loss_fn=loss_fn, "
                    f"target=labels), or HF's labels= to a model that computes its loss")
            loss = out["loss"] if loss_fn is None else \
                loss_fn(out, target) if target is not None else loss_fn(out)
        loss.backward()
        return loss.detach()

    def _trained(self, what: str):
        """The trainer, its shards placed (on ``example_inputs`` if no call placed them, or
        on inputs inferred from the model's config: :meth:`_inferred_example`)."""
        tm = self.trainer
        if tm._last is None:
            example = self._example or self._inferred_example(what)
            self.programs.sync_weights()
            tm._program(*example)
        return tm

    def _inferred_example(self, what: str) -> tuple:
        """Example inputs for the first training program: :func:`fxshard.example_inputs.
        language_model_example`."""
        from .example_inputs import language_model_example
        return language_model_example(self.model, self.spec, self.options.microbatches,
                                      f"ParallelModule.{what}")

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameter shards ``loss.backward()`` fills and an optimizer steps: every rank's
        (simulated mesh, rank-major) or this process's rank's (real mesh)."""
        from .training.optim import remember_owner
        shards = self._trained("parameters").parameters()
        remember_owner(self.trainer, shards)    # clip_grad_norm_(pm.parameters(), ...)
        return shards

    def named_parameters(self):
        """``(name, shard)`` of this process's rank on a real mesh (one shard per name, as
        ``model.named_parameters()``); on a simulated mesh of several ranks every name has a
        shard per rank: an AttributeError saying what to use."""
        tm = self._trained("named_parameters")
        if len(tm.ranks) != 1:
            raise AttributeError(
                f"ParallelModule.named_parameters: on a simulated mesh "
                f"({self.spec.describe()}) each parameter name has one shard per rank "
                f"({len(tm.ranks)} ranks), so a name does not pick one tensor. Use "
                f"pm.parameters() for an optimizer (every rank's shards), pm.shards(rank) for "
                f"rank's shards by name, pm.state_dict() / pm.gradients() for whole tensors")
        return iter(tm.shards(tm.ranks[0]).items())

    def shards(self, rank: int) -> dict:
        """Rank ``rank``'s parameter shards by the model's names."""
        return self._trained("shards").shards(rank)

    def gradients(self) -> dict:
        """Full gradients by the model's parameter names, assembled from the shards (a real
        mesh: gathered to every rank; every rank must call it)."""
        trained = self._trained("gradients")
        together(self.mesh, "ParallelModule.gradients", "gradients()")
        return trained.gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        """The full state dict by the model's names: the trained parameters once training
        started (assembled from the shards; a real mesh: gathered to every rank, so every
        rank must call it), the model's (or loaded) weights before."""
        from .runtime.weight_store import full_state_dict
        if self.weights.trained is not None:
            together(self.mesh, "ParallelModule.state_dict", "state_dict()")
        return full_state_dict(self.weights)   # by the state dict's names (its hooks)

    def write_back(self) -> None:
        """Copy the trained weights into the model object (which otherwise keeps its initial
        ones): ``model.load_state_dict(pm.state_dict())``, seen as fxshard's own change."""
        with torch.no_grad():
            self.model.load_state_dict(self.state_dict())
        self.weights.seen()

    def stage_of(self, rank: int) -> int:
        return self.spec.axis_index(rank, PP)

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prompt plus up to ``max_new_tokens`` new tokens, ``[B, S + new]``, as HuggingFace's
        ``model.generate`` returns them: greedy (``do_sample=False``) or sampled (temperature,
        top-k, top-p, ``generator``); a sequence that emits ``eos_token_id`` (an id or a list)
        is padded with ``pad_token_id`` (default: the eos id) and generation stops when all
        have. A static KV cache per rank, sharded like the K/V it holds (see
        :mod:`fxshard.generation`); the decode step's positions go to the forward's positions
        argument (any name) or, derived inside it, start at the cache position
        (:mod:`fxshard.generation.positions`)."""
        from .generation import generate
        with caller_autocast():   # its programs keyed and traced by it, run with it off
            return generate(self, input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                            temperature=temperature, top_k=top_k, top_p=top_p,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            generator=generator)

    # -- inspection --------------------------------------------------------------------
    def rank_module(self, rank: int, which: str | None = None) -> fx.GraphModule:
        """The GraphModule rank ``rank`` runs for the most recent input signature; ``which``
        ``"forward"`` or ``"backward"``: the training programs (``pm(x)`` with grad)."""
        if which is not None or self.programs.last_mode == "train":
            return self._trained("rank_module").rank_module(rank, which or "forward")
        c = self.programs.require_last("rank_module")
        self.spec.coords(rank)
        self.programs.sync_weights()
        return self.executor.module(c, rank)

    def explain(self):
        from .explain import explain
        if self.programs.last_mode == "train":
            if self.spec.axis_size(PP) > 1:
                from .training.pipeline_explain import explain_pipeline
                return explain_pipeline(self, self._trained("explain"))
            from .explain import explain_training
            return explain_training(self, self._trained("explain"))
        return explain(self, self.programs.require_last("explain"))

    # -- weights -----------------------------------------------------------------------
    def tied_names(self) -> dict[str, list[str]]:
        """``{name: [other names of the same parameter]}`` for tied weights."""
        from .weights import tied_names
        return tied_names(self.model)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load the unsharded model's state dict; each rank keeps only its slices. Returns
        torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``.

        With ``strict`` every key of ``model.state_dict()`` is required (else a ValueError);
        ``strict=False`` loads the keys it has and keeps the current values of the others.
        The model's non-persistent buffers (in no checkpoint) may be given too, by name. Once
        training started it copies into the trained shards in place (an optimizer over
        ``pm.parameters()`` keeps working). ``assign=True`` is not supported (the ranks hold
        slices, never the given tensors)."""
        from torch.nn.modules.module import _IncompatibleKeys
        from .checks import check_state_dict_values
        check_state_dict_values("ParallelModule.load_state_dict", state_dict)  # (a dict first)
        if assign:
            raise ValueError(
                f"ParallelModule.load_state_dict: assign=True (mesh {self.spec.describe()}); "
                f"each rank holds its slices of the values, copied, never the given tensors. "
                f"Call pm.load_state_dict(state_dict) (assign=False)")
        known = set(self.weights.expected) | set(self.weights.non_persistent)
        missing = sorted(set(self.weights.expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - known)
        if not strict and (missing or unexpected):
            current = self.state_dict() if missing else {}
            state_dict = {**{k: current[k] for k in missing},
                          **{k: v for k, v in state_dict.items() if k in known}}
        retrace = self.weights.load(state_dict)
        self.programs.invalidate(retrace=retrace)
        return _IncompatibleKeys([] if strict else missing, [] if strict else unexpected)

    def close(self) -> None:
        """Release the ranks' threads (simulated mesh) or this process's backend and its
        pending sends (real mesh); the module can still be called afterwards."""
        self.executor.close()
        if not is_simulated(self.mesh):
            from .runtime.distributed import release
            release(self.mesh)


def parallelize(model: torch.nn.Module, mesh, *, example_inputs: tuple | None = None,
                example_kwargs: dict | None = None, plan: dict | None = None,
                sequence_parallel: bool = False, microbatches: int = 1, strict: bool = False,
                embedding: str = "embed_dim", stages: list[int] | None = None,
                ring_zigzag: bool = True, compile: bool = False,
                recompute: str | None = None,
                fsdp_reshard_after_forward: bool | str = True,
                mixed_precision=None) -> ParallelModule:
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
            tables' worth of memory per rank). Under ``"embed_dim"`` a table tied to the
            lm_head is split on the vocab (``"vocab"``, the lm_head column-parallel) when
            ``tp`` divides it; ``plan=`` places it otherwise.
        stages: the pipeline stage of each layer of the model's layer stack (default
            :func:`fxshard.passes.split_stages.assign_layers_to_stages`).
        ring_zigzag: shard the sequence zigzag on ``ring_cp`` (rank j holds chunks j and
            2n-1-j of 2n) so causal ring attention gives every rank the same work; needs the
            sequence to divide by 2n. ``False``: contiguous chunks.
        compile: compile each stage's rank program with Inductor (``fxshard.compile``), once
            per stage and input signature; every rank of the stage shares it with its own
            weights. ``rank_module(r)`` still shows the (uncompiled) GraphModule.
        recompute: training: ``"layers"`` saves only each repeated layer's output for the
            backward, which recomputes the rest (:mod:`fxshard.training.recompute`); ``None``
            saves every activation the backward reads.
        fsdp_reshard_after_forward: training on ``fsdp``: each parameter is all-gathered
            again in the backward (``True``: only the shard is kept) or its gathered value is
            saved by the forward for the backward (``False``: one all-gather less per
            parameter and step, the whole weights held in between). ``"layers"``: only the
            layer stack's parameters are gathered again; those outside it (the embedding,
            final norm and head) are kept, as FSDP2 keeps its root's when ``fully_shard``
            wraps each layer and the model (a model without a layer stack keeps all).
        mixed_precision: torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``, as FSDP2
            reads it: the masters stay in the model's dtype (``pm.parameters()``, optimizer
            state, checkpoints), every program computes with ``param_dtype`` copies cast in
            its graph (fsdp gathers them), gradients are reduced in ``reduce_dtype``
            (:mod:`fxshard.mixed_precision`). ``torch.autocast`` around calls needs no option.
    """
    check_parallelize_args(_WHERE, model=model, example_inputs=example_inputs,
                           example_kwargs=example_kwargs, plan=plan, styles=PLAN_STYLES,
                           sequence_parallel=sequence_parallel, microbatches=microbatches,
                           strict=strict, embedding=embedding, stages=stages,
                           ring_zigzag=ring_zigzag, recompute=recompute,
                           fsdp_reshard_after_forward=fsdp_reshard_after_forward)
    spec = mesh_spec(mesh, where=_WHERE)
    mixed_precision = check_policy(_WHERE, mixed_precision)
    if not isinstance(compile, bool):
        raise TypeError(f"{_WHERE}: compile={compile!r}; pass True (Inductor-compiled rank "
                        f"programs) or False")
    unmatched = unmatched_plan_patterns(_WHERE, model, plan)
    if microbatches > 1 and spec.axis_size(PP) == 1:
        warnings.warn(f"{_WHERE}: microbatches={microbatches} has no effect without a pp axis",
                      stacklevel=2)
    was_training = model.training
    model.eval()
    pm = ParallelModule(model, mesh, plan=plan or {}, sequence_parallel=sequence_parallel,
                        microbatches=microbatches, strict=strict, embedding=embedding,
                        stages=stages, ring_zigzag=ring_zigzag, compile=compile,
                        recompute=recompute,
                        fsdp_reshard_after_forward=fsdp_reshard_after_forward,
                        mixed_precision=mixed_precision)
    pm.unmatched_plan = unmatched    # globs that matched no module (warned; in explain())
    pm._eval_by_parallelize = was_training
    if example_inputs is not None or example_kwargs is not None:
        pm._example = (tuple(example_inputs or ()), dict(example_kwargs or {}))
        pm.programs.get(tuple(example_inputs or ()), dict(example_kwargs or {}))
    return pm
