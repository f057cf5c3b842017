"""``fxshard.parallelize``: trace once per input signature, run the passes, run every rank.

    pm = fxshard.parallelize(model, mesh)
    out = pm(input_ids)          # same value and structure as model(input_ids)
    pm.rank_module(3)            # the GraphModule rank 3 runs
    print(pm.explain())          # placements, collectives, bytes, parameters per rank

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

from .checks import check_parallelize_args, inference_only, unmatched_plan_patterns
from .mesh import MeshSpec, is_simulated, mesh_spec
from .passes import PLAN_STYLES
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

    def __init__(self, model: torch.nn.Module, mesh, *, plan: dict, sequence_parallel: bool,
                 microbatches: int, strict: bool, embedding: str, stages=None,
                 ring_zigzag: bool = True, compile: bool = False):
        self.model = model
        self.mesh = mesh
        self.spec: MeshSpec = mesh_spec(mesh, where=_WHERE)
        self.options = Options(plan=dict(plan), sequence_parallel=sequence_parallel,
                               microbatches=microbatches, strict=strict, embedding=embedding,
                               stages=stages, ring_zigzag=ring_zigzag, compile=compile)
        materialize_buffers(model)
        self.unmatched_plan: list[str] = []
        self.weights = WeightStore(model, self.spec)
        self.programs = ProgramCache(model, self.spec, self.options, self.weights)
        self.executor = Executor(mesh, self.spec, self.options, self.weights)

    def __call__(self, *args, **kwargs):
        c, micro = self.programs.prepare(args, kwargs)
        out = self.executor.run(c, micro)
        return pytree.tree_unflatten(inference_only(self.model, list(out)), c.traced.out_spec)

    def stage_of(self, rank: int) -> int:
        return self.spec.axis_index(rank, "pp")

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
        return generate(self, input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        generator=generator)

    # -- inspection --------------------------------------------------------------------
    def rank_module(self, rank: int) -> fx.GraphModule:
        """The GraphModule rank ``rank`` runs for the most recent input signature."""
        c = self.programs.require_last("rank_module")
        self.spec.coords(rank)
        self.programs.sync_weights()
        return self.executor.module(c, rank)

    def explain(self):
        from .explain import explain
        return explain(self, self.programs.require_last("explain"))

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
        retrace = self.weights.load(state_dict)
        self.programs.invalidate(retrace=retrace)

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
        pm.programs.get(tuple(example_inputs or ()), dict(example_kwargs or {}))
    return pm
