"""``TrainModule``: the model's forward and backward rank programs behind ``loss.backward()``.

::

    tm = fxshard.training.parallelize_for_training(model, mesh)
    out = tm(ids)                          # the global output, as model(ids); backpropagates
                                           # (logits on tp: their tp blocks, vocab_output.py)
    loss = F.cross_entropy(out.flatten(0, 1), labels.flatten())
    loss.backward()                        # every rank's backward; .grad of tm.parameters()
    opt = torch.optim.AdamW(tm.parameters()); opt.step()
    tm.gradients()                         # full gradients by the model's names
    tm.rank_module(r, "backward")          # the backward program rank r runs

Each rank holds its own shard of every parameter as an ``nn.Parameter`` (a replicated one is
a copy per rank; they stay equal, as their gradients are all-reduced). On a simulated mesh the
call runs every rank's forward (threads), keeps each rank's saved activations, and the
backward of the returned outputs runs every rank's backward program with the output's
gradient (every rank is given the global one, as every rank was given the global input) and
fills each rank's shard gradients. Under ``torchrun`` (a torch ``DeviceMesh``) each process
holds and runs its own rank only (same programs; collectives on the mesh's process groups).
The model itself keeps its initial weights: :meth:`TrainModule.state_dict` assembles the
trained ones (on a real mesh gathered to every rank).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from ..mixed_precision import (autocast_off, autocast_state, cast_inputs, cast_outputs,
                               output_cast_loss, policy_scope)
from ..mesh import MeshSpec, is_simulated, mesh_spec
from ..passes import PassCtx
from ..placement import cut_to
from ..runtime.agreement import together
from ..runtime.program_cache import structure
from ..trace import without_cache as _without_cache
from ..weights import tied_names
from .autograd_step import Step, check_inputs_need_no_grad
from .direct import direct
from .output_blocks import OutputBlocks
from .program import TrainProgram, build_train_program, check_training_axes
from .rank_blocks import assemble, rank_block, storage_bytes
from .step_checks import agree_frozen, check_loss_differentiable, frozen_names

__all__ = ["TrainModule", "parallelize_for_training", "assemble", "check_trainable"]

_WHERE = "fxshard.training"


class TrainModule(OutputBlocks):
    """A model's training programs over a mesh; see :func:`parallelize_for_training`."""

    _distinct_axes: tuple = ()   # mesh axes whose coordinates hold other parameters (pp's)

    def __init__(self, model: torch.nn.Module, mesh, *, sequence_parallel: bool = False,
                 plan: dict | None = None, embedding: str = "embed_dim", strict: bool = False,
                 fsdp_reshard_after_forward: bool | str = True, recompute: str | None = None,
                 store=None, executor=None, cache=None, ring_zigzag: bool = True,
                 compile: bool = False, mixed_precision=None):
        from ..checks import check_reshard_after_forward
        from .recompute import check_recompute
        check_recompute(_WHERE, recompute)
        check_reshard_after_forward(_WHERE, fsdp_reshard_after_forward)
        self.model = model
        self.mixed_precision = mixed_precision   # (parallelize's: the cache builds with it)
        self.recompute = recompute
        self.ring_zigzag = ring_zigzag
        self.compile = compile       # both rank programs Inductor-compiled (once each)
        self.fsdp_reshard_after_forward = fsdp_reshard_after_forward
        # fxshard.parallelize's weight store (the shards are cut from its values, then become
        # them: see fxshard.training.shards) and executor (its ranks run both programs)
        self.store, self.executor, self.cache = store, executor, cache
        self.mesh = mesh
        self.spec: MeshSpec = mesh_spec(mesh, where=_WHERE)
        self._simulated = is_simulated(mesh)
        self.sequence_parallel = sequence_parallel
        self.plan = dict(plan or {})
        self.embedding = embedding
        self.strict = strict
        self._programs: dict[tuple, TrainProgram] = {}
        self._last: TrainProgram | None = None
        self._shards: dict | None = None     # held rank -> FQN -> nn.Parameter (or buffer)
        self._specs: dict | None = None
        self._world = None
        self._untraced_losses: dict = {}   # loss_key -> a loss export could not trace
        self._loss_traces: dict = {}       # loss_key (without its reads) -> traces built
        self._frozen: frozenset = frozenset()   # the shards' requires_grad follows the model's
        self._agreed: set = set()     # frozen sets the ranks agreed on (a real mesh)

    # -- building ------------------------------------------------------------------------
    def _program(self, args: tuple, kwargs: dict, loss=None) -> TrainProgram:
        """The program of this call signature (``loss``: a traced loss, see
        :meth:`loss_step`), built on first use."""
        mode = self.model.training    # train mode traces dropout's sites, eval mode none
        frozen = frozen_names(self.model)   # (traced into the joint graph: no gradient made)
        agree_frozen(self.mesh, self._agreed, frozen)
        extra = None
        if loss is not None:
            from .with_loss import describe_loss, loss_key
            extra = (loss_key(loss), describe_loss(loss))
        build = self._build if loss is None else \
            (lambda a, k: self._build(a, k, loss=loss))
        if self.cache is not None:    # fxshard.parallelize's program cache
            program = self.cache.train_program(args, kwargs, build, extra=extra)
            if program.training == mode and program.frozen == frozen:
                self._last = program
                return program
        flat, _ = pytree.tree_flatten((args, kwargs))
        key = (mode, extra, frozen, structure(args, kwargs), autocast_state()) + tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
        if key not in self._programs:
            with policy_scope(self.mixed_precision, self.model):
                self._programs[key] = build(args, kwargs)
        self._last = self._programs[key]
        return self._last

    def _build(self, args: tuple, kwargs: dict, loss=None) -> TrainProgram:
        ctx = PassCtx(mesh=self.spec, sequence_parallel=self.sequence_parallel,
                      strict=self.strict, plan=self.plan, embedding_style=self.embedding,
                      ring_zigzag=self.ring_zigzag, aliases=tied_names(self.model))
        module = self.model
        if loss is not None:
            from .with_loss import WithLoss
            module = WithLoss(self.model, output_cast_loss(self.mixed_precision, loss),
                              with_target=len(args) == 3)
        program = build_train_program(module, args, kwargs, ctx,
                                      reshard_after_forward=self.fsdp_reshard_after_forward,
                                      recompute=self.recompute, vocab_outputs=True)
        program.loss_fn = loss   # held: loss_key's ids stay this loss's while the entry lives
        if loss is not None:     # (and the tensors it reads: their ids are in the key too)
            from .with_loss import RETRACE_WARN, loss_key, read_tensors, warn_retraced
            program.loss_reads = read_tensors(loss)
            base = loss_key(loss, reads=False)
            self._loss_traces[base] = self._loss_traces.get(base, 0) + 1
            if self._loss_traces[base] == RETRACE_WARN:
                warn_retraced(f"{_WHERE}.train_step", loss, RETRACE_WARN)
        program.frozen = frozen_names(self.model)
        self._place(program)
        return program

    def _place(self, program: TrainProgram) -> None:
        """Each rank's shards, cut from the model once (the first program); a later program
        must place every weight the same way (it trains the same shards)."""
        if self._shards is None:
            values = dict(self.model.named_parameters(remove_duplicate=False))
            values.update(program.joint.traced.constants)
            if self.store is not None:    # what pm.load_state_dict loaded, or the model's
                values.update(self.store.values)
            params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
            self._specs = dict(program.specs)
            self._shards = {}
            for rank in self.ranks:
                mine = {}
                for fqn, spec in program.specs.items():
                    block = rank_block(values[fqn], spec, self.spec, rank,
                                   program.shapes.get(fqn))
                    mine[fqn] = torch.nn.Parameter(block) if fqn in params else block
                self._shards[rank] = mine
            if self.store is not None:
                from .shards import install
                install(self.store, self, program)
            from .optim import watch_model_parameters   # an optimizer over model.parameters()
            watch_model_parameters(self.model, self.spec.describe())
            return
        for fqn, spec in program.specs.items():
            if self._specs.get(fqn, spec) != spec:
                raise NotImplementedError(
                    f"{_WHERE}: a new input signature places {fqn} as {spec}, the trained "
                    f"shards are {self._specs[fqn]}; use one input shape for training")

    # -- running -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        # a mixed-precision policy casts the floating inputs and outputs (FSDP2's hooks)
        args, kwargs = cast_inputs(self.mixed_precision, args, kwargs)
        return cast_outputs(self.mixed_precision, self._call(args, kwargs))

    def loss_step(self, loss_fn, target, args: tuple, kwargs: dict) -> torch.Tensor:
        """``loss_fn(model(*args, **kwargs), target)`` traced with the model as one program
        (:mod:`fxshard.training.with_loss`: a cross-entropy there is vocab-parallel on tp,
        the logits never gathered); returns the loss, which backpropagates like ``tm(x)``'s
        output. A loss that cannot be traced runs on ``tm(x)``'s output, with a warning."""
        from .with_loss import loss_key, warn_not_traced
        args, kwargs = cast_inputs(self.mixed_precision, args, kwargs)
        inner = (tuple(args), _without_cache(self.model, dict(kwargs)))
        wrapped = inner + ((target,) if target is not None else ())
        key = loss_key(loss_fn, reads=False)
        failed = self._untraced_losses
        if key not in failed:
            try:
                loss = self._call(wrapped, {}, loss=loss_fn)
            except Exception as e:   # noqa: BLE001 (the loss on the output is the same loss)
                failed[key] = loss_fn   # held, so the key's ids stay this loss's
                warn_not_traced(f"{_WHERE}.train_step", loss_fn, e)
            else:
                check_loss_differentiable(self._last, loss_fn)
                return loss
        out = cast_outputs(self.mixed_precision, self._call(args, kwargs))
        return loss_fn(out, target) if target is not None else loss_fn(out)

    def _sync_frozen(self, frozen: frozenset) -> None:
        """Each parameter shard requires grad as the model's parameter does (``frozen``:
        :func:`frozen_names`), so ``loss.backward()`` leaves a frozen one's ``.grad`` None."""
        if frozen == self._frozen or self._shards is None:
            return
        for mine in self._shards.values():
            for fqn, shard in mine.items():
                if isinstance(shard, torch.nn.Parameter):
                    shard.requires_grad_(fqn not in frozen)
        self._frozen = frozen

    def _call(self, args: tuple, kwargs: dict, loss=None):
        program = self._program(args, kwargs, loss)
        self._sync_frozen(program.frozen)
        split = program.split
        # the export's order of the user's inputs (HF's use_cache=False added, as traced)
        if loss is None:
            kwargs = _without_cache(self.model, dict(kwargs))
        flat = list(fx_pytree.tree_flatten_spec((args, kwargs), program.joint.traced.in_spec))
        if program.joint.seed is not None:   # dropout: this step's seed, fxshard.training.dropout
            from .dropout import pack_seed, step_seed
            flat.append(pack_seed(step_seed(None if self._simulated else self.mesh)))
        user = [flat[i] for i in split.inputs]
        check_inputs_need_no_grad(_WHERE, user)
        shards = [self._shards[r][fqn] for r in self.ranks for fqn in split.weights]
        # buffers (no gradient) ride along as inputs too; only parameters are autograd leaves
        differentiable = [s for s in shards if isinstance(s, torch.nn.Parameter)]
        outs = Step.apply(self, program, len(differentiable), *differentiable, *user)
        n = split.n_outputs
        outs = list(outs)
        if program.vocab_outputs:    # those outputs: their tp blocks, fxshard.training.vocab_output
            from .vocab_output import VocabShardedTensor
            for i, slots in self._tangent_slots(program).items():
                where = self._vocab_blocks(program, program.padded_outputs.get(i))
                outs[i] = VocabShardedTensor([outs[j] for j in slots], where)
        for i, vocab in program.padded_outputs.items():   # a padded vocab, gathered: cut
            if i not in program.vocab_outputs and isinstance(outs[i], torch.Tensor):
                outs[i] = outs[i].narrow(-1, 0, vocab)
        return pytree.tree_unflatten(outs[:n], program.joint.traced.out_spec)

    @property
    def ranks(self) -> list[int]:
        """The ranks this process runs: all of a simulated mesh, its own of a real one."""
        if self._simulated:
            return list(range(self.spec.world_size))
        from ..runtime.distributed import backend_for
        return [backend_for(self.mesh).rank]

    def _world_run(self, fn) -> dict:
        """``{rank: fn(rank)}`` for the ranks this process runs."""
        if self.executor is not None:
            return dict(zip(self.ranks, self.executor.on_ranks(fn)))
        if not self._simulated:
            from ..runtime.context import use_backend
            from ..runtime.distributed import backend_for
            backend = backend_for(self.mesh)
            with use_backend(backend):
                out = {backend.rank: fn(backend.rank)}
                backend.flush()
            return out
        if self._world is None:
            from ..runtime.simulated import SimulatedWorld
            self._world = SimulatedWorld(self.spec)
        return dict(enumerate(self._world.run(fn)))

    def _rank_weights(self, program: TrainProgram, rank: int) -> list:
        return [self._shards[rank][fqn].detach() for fqn in program.split.weights]

    def _fn(self, program: TrainProgram, which: str, example) -> object:
        """The ``which`` rank program as ranks call it: the GraphModule, or with
        ``compile=True`` Inductor's function, compiled once on rank ``ranks[0]``'s
        ``example`` inputs in this thread (before any rank runs) and shared by the ranks."""
        if not self.compile:
            return direct(getattr(program.split, which))
        if which not in program.compiled:
            from ..compile import check_static_inputs, compile_graph
            for gm in (program.split.forward, program.split.backward):   # before either runs
                check_static_inputs(gm, "fxshard.parallelize")
            with autocast_off():
                program.compiled[which] = compile_graph(getattr(program.split, which),
                                                        example())
        return program.compiled[which]

    def _run_forward(self, program: TrainProgram, shards, user) -> tuple[list, list]:
        split = program.split
        forward = self._fn(program, "forward",
                           lambda: [*self._rank_weights(program, self.ranks[0]), *user])

        def run(rank):   # (autocast's casts are in the program)
            with torch.no_grad(), autocast_off():
                return forward(*self._rank_weights(program, rank), *user)
        results = self._world_run(run)
        outs = list(results[self.ranks[0]][:split.n_outputs])
        saved = {r: list(out[split.n_outputs:]) for r, out in results.items()}
        self._saved_bytes = {r: storage_bytes(s) for r, s in saved.items()}
        extra = [results[r][i] for i in sorted(program.vocab_outputs)
                 for r in self._block_ranks(program)[1:]] if program.vocab_outputs else []
        return outs, saved, extra

    def _run_backward(self, program: TrainProgram, saved: list, tangents) -> list:
        """``tangents(rank)``: the output gradients rank ``rank``'s backward takes (the whole
        gradient of a gathered output, the rank's block of a vocab output's)."""
        split = program.split
        first = self.ranks[0]
        backward = self._fn(program, "backward", lambda: [
            *self._rank_weights(program, first), *saved[first], *tangents(first)])

        def run(rank):
            with torch.no_grad(), autocast_off():
                return backward(*self._rank_weights(program, rank), *saved[rank],
                                *tangents(rank))
        results = self._world_run(run)
        by_fqn = {r: dict(zip(split.grads, out)) for r, out in results.items()}
        grads = []
        for rank in self.ranks:
            for fqn in split.weights:
                shard = self._shards[rank][fqn]
                if isinstance(shard, torch.nn.Parameter):   # None: frozen or unused, as
                    grads.append(by_fqn[rank].get(fqn))      # on one device
        return grads

    # -- the optimizer's view and looking inside -------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every rank's parameter shards (rank-major), the leaves ``loss.backward()`` fills."""
        self._require("parameters")
        return [p for mine in self._shards.values() for p in mine.values()
                if isinstance(p, torch.nn.Parameter)]

    def shards(self, rank: int) -> dict:
        """Rank ``rank``'s parameter shards by the model's names (a real mesh: this
        process's rank only)."""
        self._require("shards")
        if rank not in self._shards:
            raise ValueError(f"{_WHERE}.TrainModule.shards: rank {rank} runs in another "
                             f"process; this one holds rank {self.ranks}")
        return {k: v for k, v in self._shards[rank].items() if isinstance(v, torch.nn.Parameter)}

    def _assembled(self, what) -> dict:
        """Whole tensors by name from every rank's blocks; on a real mesh the blocks are
        gathered to every process (``fxshard/training/world.py``), so every rank holds the
        whole model's tensors."""
        program = self._require("gradients")
        out = {}
        for fqn in self.shards(self.ranks[0]):
            if self._simulated:
                blocks = [what(self._shards[r][fqn]) for r in range(self.spec.world_size)]
            else:
                mine = what(self._shards[self.ranks[0]][fqn])
                blocks = [None] if mine is None else self._gather_blocks(mine)
            if any(b is None for b in blocks):
                out[fqn] = None
                continue
            out[fqn] = assemble(blocks, program.shapes[fqn], self._specs[fqn], self.spec)
            if fqn in program.padded:       # a vocab padded for tp: the model's rows
                out[fqn] = cut_to(out[fqn], program.padded[fqn])
        for other, kept in program.joint.tied.items():   # one tensor, several names
            out[other] = out[kept]
        return out

    def _gather_blocks(self, block: torch.Tensor) -> list:
        """A real mesh: every rank's ``block``, by rank, on every rank."""
        from ..runtime.distributed import backend_for
        from .world import gather_blocks
        return gather_blocks(backend_for(self.mesh), block)

    def gradients(self) -> dict:
        """Full gradients by the model's parameter names, assembled from the shards (a real
        mesh: gathered to every rank; every rank must call it)."""
        together(self.mesh, f"{_WHERE}.TrainModule.gradients", "gradients()")
        return self._assembled(lambda p: p.grad)

    def state_dict(self) -> dict:
        """The trained parameters, whole, by the model's names (a real mesh: gathered to
        every rank; every rank must call it)."""
        together(self.mesh, f"{_WHERE}.TrainModule.state_dict", "state_dict()")
        return self._assembled(lambda p: p.detach())

    def memory(self, rank: int) -> dict:
        """Bytes rank ``rank`` holds: its parameter shards, their gradients, and the
        activations the last forward saved for the backward (distinct storages)."""
        mine = self.shards(rank)
        return {"parameters": storage_bytes(mine.values()),
                "gradients": storage_bytes(p.grad for p in mine.values() if p.grad is not None),
                "saved": (getattr(self, "_saved_bytes", None) or {}).get(rank, 0)}

    def collectives(self, which: str = "backward") -> list:
        """The collectives of the ``"forward"`` or ``"backward"`` program (every rank runs
        the same ones), with the local shape and bytes each moves
        (``fxshard.explain.CollectiveInfo``)."""
        from ..explain import collectives_of
        return collectives_of(self.rank_module(0, which).graph, self.spec)

    def rank_module(self, rank: int, which: str = "forward") -> fx.GraphModule:
        """The ``"forward"`` or ``"backward"`` program rank ``rank`` runs (ranks share the
        graphs; collectives name mesh axes)."""
        self.spec.coords(rank)
        if which not in ("forward", "backward"):
            raise ValueError(f"{_WHERE}.rank_module: which={which!r}; use 'forward' or "
                             f"'backward'")
        return getattr(self._require("rank_module").split, which)

    def _require(self, what: str) -> TrainProgram:
        if self._last is None:
            raise ValueError(f"{_WHERE}.TrainModule.{what}: nothing is traced yet; call the "
                             f"module once (tm(x)) first")
        return self._last


def check_trainable(where: str, mesh: MeshSpec, options) -> None:
    """Raise for what ``pm(x)`` with grad enabled cannot train yet (never a wrong gradient):
    pipeline and context-parallel axes."""
    check_training_axes(mesh, where, "pm(x) with grad enabled trains, and training")


def parallelize_for_training(model: torch.nn.Module, mesh, *, example_inputs: tuple | None = None,
                             example_kwargs: dict | None = None,
                             sequence_parallel: bool = False, plan: dict | None = None,
                             embedding: str = "embed_dim", strict: bool = False,
                             fsdp_reshard_after_forward: bool | str = True,
                             recompute: str | None = None,
                             ring_zigzag: bool = True, compile: bool = False) -> TrainModule:
    """Training programs for ``model`` over ``mesh`` (``dp``, ``fsdp``, ``tp``, ``ring_cp``,
    ``ulysses_cp`` axes; ``fxshard.training.context_parallel`` says which CP meshes), built
    at the first call (one per input signature) or now on ``example_inputs``/``example_kwargs``
    (then :meth:`TrainModule.parameters` is there for an optimizer before the first step);
    options as for :func:`fxshard.parallelize`. ``fsdp_reshard_after_forward=False`` keeps
    each fsdp parameter's gathered value from the forward for the backward (FSDP2's
    ``reshard_after_forward``): one all-gather less per parameter, the whole of it held;
    ``"layers"`` keeps only those of the parameters outside the layer stack (the embedding,
    final norm and head: what FSDP2 keeps for its root when each layer is wrapped).
    ``recompute="layers"``: each repeated layer saves only its output for the backward, which
    recomputes the rest (:mod:`fxshard.training.recompute`). ``ring_zigzag`` as for
    :func:`fxshard.parallelize` (the zigzag sequence layout on ``ring_cp``).
    ``compile=True``: the forward and backward rank programs Inductor-compiled (simulated
    mesh: collectives stay ``fxshard::*`` extern calls)."""
    tm = TrainModule(model, mesh, sequence_parallel=sequence_parallel, plan=plan,
                     embedding=embedding, strict=strict,
                     fsdp_reshard_after_forward=fsdp_reshard_after_forward,
                     recompute=recompute, ring_zigzag=ring_zigzag, compile=compile)
    if example_inputs is not None or example_kwargs is not None:
        tm._program(tuple(example_inputs or ()), dict(example_kwargs or {}))
    return tm
