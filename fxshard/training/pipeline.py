"""Pipeline training: per-stage forward and backward programs under a schedule.

::

    pm = fxshard.parallelize(model, mesh_with_pp, microbatches=4)
    loss_fn(pm(ids), labels).backward()           # GPipe: every forward, then every backward
    loss = pm.train_step(ids, target=labels, loss_fn=loss_fn, schedule="1f1b")

The forward export is cut into stages (:mod:`fxshard.training.stages`); each stage is trained
as a model of its own on the mesh without ``pp`` (its ``dp``/``fsdp``/``tp`` placements,
collectives and gradients built by :func:`fxshard.training.program.build_train_program`), its
joint graph also returning the gradients of the activations it received. A stage's forward
takes the user's inputs and the activations of earlier stages and returns the ones later
stages need (whole); its backward takes their gradients and returns the received
activations' gradients and its parameters'. Between stages they travel as point-to-point
messages along ``pp`` (under torchrun: gloo/NCCL ``isend``/``irecv``; simulated: handed over).

Gradients: ``pm(x)``'s backward receives the gradient of the whole (assembled) output, cut
into the microbatches: each microbatch's backward is exact and their parameter gradients add
up to the single-device gradient, whatever the user's loss. ``train_step`` computes the loss
inside the schedule, per microbatch: ``loss_fn(output_i, target_i) / m`` (the mean of the
microbatches' losses, the whole batch's loss for a mean over equal microbatches).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
import torch.fx._pytree as fx_pytree

from ..mixed_precision import (autocast_off, autocast_state, cast_inputs, cast_outputs,
                               output_cast_loss, policy_scope)
from ..mesh import PP, SimulatedMesh, is_simulated
from ..passes import PassCtx, PassReports
from ..passes.pad_vocab import pad_vocab_pass
from ..passes.pipeline import run_passes
from ..runtime.program_cache import structure
from ..trace import cleanup_pass, trace
from ..trace import without_cache as _without_cache
from ..weights import tied_names
from .dropout import add_dropout_sites, pack_seed, seeded
from .joint import (_placeholders_for_meta, _untie, factories_on_device, input_grad_name,
                    joint_of)
from .autograd_step import check_inputs_need_no_grad
from .step_checks import frozen_names
from .program import build_train_program
from .rank_blocks import storage_bytes
from .schedules import actions, global_order
from .shards import TrainedShard, load_into
from .pipeline_stage import (Pipe, StageModule, StageShard, Staged, check_virtual_stages,
                             make_stage_modules)
from .stages import example_received, split_forward

__all__ = ["PipelineTrainer"]

_WHERE = "fxshard.training.pipeline"


class PipelineTrainer:
    """Training over a mesh with a ``pp`` axis: one :class:`TrainModule` per stage."""

    def __init__(self, model, mesh, spec, *, microbatches: int, stages=None, store=None,
                 **options):
        self.model, self.mesh, self.spec = model, mesh, spec
        self.microbatches, self.layer_stages, self.store = microbatches, stages, store
        self.options = options
        self.pp = spec.axis_size(PP)
        self._simulated = is_simulated(mesh)
        self.sub = SimulatedMesh(tuple(1 if a == PP else n for a, n in
                                       zip(spec.axis_names, spec.shape)),
                                 spec.axis_names, spec.device_type)
        self.virtual = None          # virtual stages per rank, fixed by the first build
        self.stage_modules: list[StageModule] = []
        self._programs: dict = {}
        self._last: Staged | None = None
        self.schedule = None         # what the last step ran: name, time steps, peak bytes
        self.peak_saved: dict = {}
        self._agreed: set = set()    # frozen sets the ranks agreed on (a real mesh)

    # -- coordinates ---------------------------------------------------------------------
    def _sub_rank(self, rank: int) -> int:
        c = list(self.spec.coords(rank))
        c[self.spec.axis_names.index(PP)] = 0
        return self.sub.rank_of(c)

    def _stage_rank(self, rank: int) -> int:
        return self.spec.axis_index(rank, PP)

    @property
    def ranks(self) -> list[int]:
        if self._simulated:
            return list(range(self.spec.world_size))
        from ..runtime.distributed import backend_for
        return [backend_for(self.mesh).rank]

    def _mine(self, k: int) -> bool:
        """Stage ``k`` runs in this process (always on a simulated mesh)."""
        return self._simulated or k % self.pp == self._stage_rank(self.ranks[0])

    # -- building ------------------------------------------------------------------------
    def _split_inputs(self, args, kwargs):
        m = self.microbatches
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if not tensors:
            raise ValueError(f"{_WHERE}: no tensor input to cut into microbatches")
        b = tensors[0].shape[0] if tensors[0].dim() else 1
        if b % m:
            raise ValueError(f"{_WHERE}: batch {b} does not divide into microbatches={m} "
                             f"(mesh {self.spec.describe()}); use a batch that is a multiple "
                             f"of {m}")

        def cut(x, i):
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == b:
                return x[i * (b // m):(i + 1) * (b // m)]
            return x
        return [pytree.tree_unflatten([cut(x, i) for x in flat], spec) for i in range(m)]

    def _program(self, args: tuple, kwargs: dict) -> Staged:
        """The stage programs for the whole inputs ``args``/``kwargs`` (their microbatch's)."""
        return self._staged(*self._split_inputs(args, kwargs)[0], virtual=self.virtual or 1)

    def _staged(self, args: tuple, kwargs: dict, virtual: int = 1) -> Staged:
        check_virtual_stages(self.virtual, virtual, _WHERE)
        frozen = frozen_names(self.model)
        from .step_checks import agree_frozen    # every rank freezes the same parameters
        agree_frozen(self.mesh, self._agreed, frozen)
        key = (self.model.training, frozen, structure(args, kwargs), autocast_state()) + tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
            for x in pytree.tree_leaves((args, kwargs)))
        if key not in self._programs:
            with policy_scope(self.options.get("mixed_precision"), self.model):
                self._programs[key] = self._build(args, kwargs, virtual)
            self.virtual = virtual
        for tm in self.stage_modules or ():
            tm._sync_frozen(frozen)
        self._last = self._programs[key]
        return self._last

    def _build(self, args, kwargs, virtual: int) -> Staged:
        from ..passes.split_stages import assign_layers_to_stages, find_layer_stack
        from .program import check_training_axes
        check_training_axes(self.sub, _WHERE, "pipeline training")
        n_stages = self.pp * virtual
        stack, names = find_layer_stack(self.model)
        layer_stages = list(self.layer_stages) if self.layer_stages is not None and \
            virtual == 1 else assign_layers_to_stages(len(names), n_stages)
        with _placeholders_for_meta(self.model, args, kwargs):   # a model built on meta
            traced = trace(self.model, args, kwargs)
        cleanup_pass(traced.gm, ctx=PassReports())
        tied = _untie(traced, self.model)
        # a vocab tp does not divide: padded as the inference programs pad it (the outputs
        # read back cut to the model's vocab)
        padding = PassCtx(mesh=self.sub, plan=self.options.get("plan") or {},
                          embedding_style=self.options.get("embedding", "embed_dim"),
                          aliases=tied_names(self.model))
        run_passes(traced.gm, [pad_vocab_pass], padding)
        flat = list(fx_pytree.tree_flatten_spec(
            (tuple(args), _without_cache(self.model, dict(kwargs))), traced.in_spec))
        factories_on_device(traced.gm, next((t.device for t in flat if isinstance(
            t, torch.Tensor) and t.device.type != "meta"), torch.device("cpu")))
        # dropout: the whole model's sites (their indices survive the split) and a seed input
        seed = add_dropout_sites(traced.gm, len(flat), _WHERE)
        if seed is not None:
            flat.append(pack_seed(0))
        forwards = split_forward(traced, stack, names, layer_stages, n_stages)
        device = torch.device(self.spec.device_type)
        if not self.stage_modules:
            self.stage_modules = make_stage_modules(self, n_stages)
        programs = []
        for k, (sf, tm) in enumerate(zip(forwards, self.stage_modules)):
            if not self._mine(k):
                programs.append(None)
                continue
            n_flat = len(flat)
            stage_flat = list(flat) + example_received(sf, device)
            grad_in = frozenset(n_flat + j for j, (_, dt) in enumerate(sf.received)
                                if dt.is_floating_point)
            kept = {o: t for o, t in tied.items()
                    if any(n.meta.get("fxshard_param") == t for n in sf.traced.gm.graph.nodes)}
            with _placeholders_for_meta(self.model, args, kwargs):
                joint = joint_of(sf.traced, self.model, stage_flat, kept, grad_in)
            ctx = PassCtx(mesh=self.sub, sequence_parallel=tm.sequence_parallel,
                          strict=tm.strict, plan=tm.plan, embedding_style=tm.embedding,
                          ring_zigzag=tm.ring_zigzag, aliases=tied_names(self.model))
            ctx.padded = dict(padding.padded)
            program = build_train_program(
                self.model, (), {}, ctx, joint=joint, recompute=tm.recompute,
                reshard_after_forward=tm.fsdp_reshard_after_forward)
            tm._place(program)
            tm._last = program
            programs.append(program)
        if self.store is not None:
            self._install()
        return Staged(forwards, programs, traced, tied, len(flat), seed)

    def _install(self) -> None:
        """The stages' shards as the weight store's values, read by global rank (an
        inference program after training reads its stage's shard of the rank's coordinates)."""
        store = self.store
        fresh = store.trained is not self
        for fqn, v in list(store.values.items()):
            if isinstance(v, TrainedShard) and not isinstance(v, StageShard):
                store.values[fqn] = StageShard(self, v.tm, v.fqn, v.spec, v.shape)
                fresh = True
        store.trained, store.load_trained = self, load_into
        store.trained_sources = list({id(v): v for v in store.values.values()
                                      if isinstance(v, TrainedShard)}.values())
        store.rebind |= fresh   # (a new input signature of the same shards: nothing to do)

    # -- one stage, one microbatch -------------------------------------------------------
    def _flat(self, staged: Staged, args, kwargs) -> list:
        return fx_pytree.tree_flatten_spec(
            (tuple(args), _without_cache(self.model, dict(kwargs))), staged.traced.in_spec)

    def _micro(self, staged: Staged, micro: list) -> list:
        """Each microbatch's flat inputs (+ dropout's seed, fxshard.training.dropout)."""
        flats = [list(self._flat(staged, a, k)) for a, k in micro]
        return flats if staged.seed is None else \
            seeded(flats, None if self._simulated else self.mesh)

    def _stage_forward(self, k, staged, flat, values):
        tm, program = self.stage_modules[k], staged.programs[k]
        stage_flat = list(flat) + [values[name] for name in staged.forwards[k].receives]
        user = [stage_flat[i] for i in program.split.inputs]
        outs, saved, _ = tm._run_forward(program, None, user)
        return outs, saved

    def _stage_backward(self, k, staged, saved, tangents) -> dict:
        """Accumulate stage ``k``'s parameter gradients; return the received values'."""
        tm, program = self.stage_modules[k], staged.programs[k]
        split = program.split
        lead = tm.ranks[0]
        # as TrainModule's own backward: the eager runner's program (in-place all-reduces,
        # fsdp prefetch) or, with compile=True, Inductor's
        backward = tm._fn(program, "backward", lambda: [
            *tm._rank_weights(program, lead), *saved[lead], *tangents])

        def run(rank):
            with torch.no_grad():
                return backward(*tm._rank_weights(program, rank), *saved[rank], *tangents)
        results = tm._world_run(run)
        for rank, out in results.items():
            for fqn, g in zip(split.grads, out):
                shard = tm._shards[rank].get(fqn)
                if isinstance(shard, torch.nn.Parameter) and g is not None:
                    self._acc[id(shard)] = g if id(shard) not in self._acc else \
                        self._acc[id(shard)] + g
        first = dict(zip(split.grads, results[tm.ranks[0]]))
        n = staged.n_flat
        return {name: first.get(input_grad_name(n + j))
                for j, name in enumerate(staged.forwards[k].receives)}

    # -- running a schedule ----------------------------------------------------------------
    def _execute(self, staged, micro, per_rank, run, done=None) -> None:
        """Run ``per_rank``'s actions: a simulated mesh in one order that honours every
        rank's (recorded in ``self.schedule``), a real one this rank's own in order."""
        n_stages = len(staged.forwards)
        if self._simulated:
            steps = global_order(per_rank, n_stages, done)
            for step in steps:
                for _, act in step:
                    run.do(act)
            return steps
        for act in per_rank[self._stage_rank(self.ranks[0])]:
            run.do(act)
        run.flush()
        return None

    def _forward_all(self, staged, user):
        """``pm(x)``: every stage's forward on every microbatch (GPipe's first half)."""
        from .run import StepRun
        run = StepRun(self, staged, self._micro_flats)
        per_rank = [[a for a in acts if a[0] == "F"]
                    for acts in actions("gpipe", self.pp, self.microbatches, self.virtual)]
        with autocast_off():
            steps = self._execute(staged, None, per_rank, run)
        self._record("gpipe", steps, run)
        return run.assembled_outputs(), run

    def _backward_all(self, staged, run, grads) -> dict:
        """``loss.backward()``: every stage's backward on every microbatch, the gradient of
        the whole output cut into the microbatches; returns {id(shard): gradient}."""
        self._acc = {}
        run.out_grads = run.cut_outputs(grads)
        per_rank = [[a for a in acts if a[0] == "B"]
                    for acts in actions("gpipe", self.pp, self.microbatches, self.virtual)]
        done = {(a[0], a[1], a[2]) for acts in actions("gpipe", self.pp, self.microbatches,
                                                       self.virtual) for a in acts if a[0] == "F"}
        steps = self._execute(staged, None, per_rank, run, done)
        if steps is not None and self.schedule is not None:
            self.schedule["steps"] = self.schedule["steps"] + steps
        self._record_peak(run)
        acc, self._acc = self._acc, {}
        return acc

    def __call__(self, *args, **kwargs):
        policy = self.options.get("mixed_precision")   # FSDP2's casts of inputs and outputs
        args, kwargs = cast_inputs(policy, args, kwargs)
        micro = self._split_inputs(args, kwargs)
        staged = self._staged(*micro[0], virtual=self.virtual or 1)
        self._micro_flats = self._micro(staged, micro)
        params = self.parameters()
        user = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        check_inputs_need_no_grad(_WHERE, user)
        with autocast_off():   # (autocast's casts are in the stage programs)
            outs = Pipe.apply(self, staged, len(params), *params, *user)
        return cast_outputs(policy, pytree.tree_unflatten(list(outs), staged.traced.out_spec))

    def train_step(self, *args, loss_fn=None, target=None, schedule: str = "1f1b",
                   virtual_stages: int | None = None, **kwargs) -> torch.Tensor:
        """One forward and backward of every microbatch under ``schedule``; the loss is
        ``loss_fn(output_i, target_i)`` per microbatch (``target`` cut as the inputs), each
        weighted so that their sum is the whole batch's loss on one device (1/m for a mean
        whose microbatches count alike, 1 for a sum, each microbatch's share of the counted
        targets for a mean over tokens: :mod:`fxshard.training.microbatch_loss`); the
        gradients are added to the shards' ``.grad`` as ``loss.backward()`` would. Returns
        the loss. Without ``loss_fn``, HF's ``labels=``: the model's loss per microbatch,
        weighted alike through the model's own ``loss_function``."""
        from .run import _MODEL_LOSS
        labels = None
        if loss_fn is None:
            labels = kwargs.get("labels")
            if not isinstance(labels, torch.Tensor):
                raise ValueError(f"{_WHERE}.train_step: pass loss_fn= (a loss of the output and "
                                 f"target=) or HF's labels= (mesh {self.spec.describe()})")
            loss_fn = _MODEL_LOSS
        policy = self.options.get("mixed_precision")
        args, kwargs = cast_inputs(policy, args, kwargs)
        loss_fn = output_cast_loss(policy, loss_fn)
        if virtual_stages is not None and (isinstance(virtual_stages, bool) or not isinstance(
                virtual_stages, int) or virtual_stages < 1):
            raise ValueError(
                f"{_WHERE}.train_step: virtual_stages={virtual_stages!r} (mesh "
                f"{self.spec.describe()}); pass a positive int, the stages each pp rank holds "
                f"(2 or more for schedule='interleaved_1f1b', 1 otherwise)")
        v = virtual_stages or (2 if schedule == "interleaved_1f1b" and self.virtual in (None, 1)
                               else self.virtual or 1)   # (stages built with 1: _staged says so)
        if self.virtual is None and v > 1:
            from ..passes.split_stages import find_layer_stack
            layers = len(find_layer_stack(self.model)[1])
            if layers < self.pp * v:
                raise ValueError(
                    f"{_WHERE}.train_step: virtual_stages={v} on pp={self.pp} cuts the model "
                    f"into {self.pp * v} stages of at least one layer each, but it has "
                    f"{layers} layers (mesh {self.spec.describe()}); use virtual_stages <= "
                    f"{max(1, layers // self.pp)}")
        micro = self._split_inputs(args, kwargs)
        targets = self._split_inputs((target,), {}) if target is not None else None
        staged = self._staged(*micro[0], virtual=v)
        from .microbatch_loss import pipeline_loss_weights
        from .run import StepRun
        run = StepRun(self, staged, self._micro(staged, micro))
        run.loss_fn = loss_fn
        run.targets = [t[0][0] for t in targets] if targets is not None else None
        run.weights = pipeline_loss_weights(self, run, target, labels, where=_WHERE)
        per_rank = actions(schedule, self.pp, self.microbatches, v)
        self._acc = {}
        with autocast_off():
            steps = self._execute(staged, None, per_rank, run)
        self._record(schedule, steps, run)
        self._record_peak(run)
        with torch.no_grad():
            for p in self.parameters():
                g = self._acc.get(id(p))
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        self._acc = {}
        return run.total_loss()

    def _record(self, name, steps, run) -> None:
        self.schedule = {"name": name, "microbatches": self.microbatches,
                         "stages_per_axis": self.pp,
                         "virtual_stages": self.virtual, "steps": steps or []}

    def _record_peak(self, run) -> None:
        self.peak_saved = dict(run.peak)
        if self.schedule is not None:
            self.schedule["peak_saved"] = dict(run.peak)

    # -- the optimizer's view and looking inside -------------------------------------------
    def _where(self, rank: int):
        """(stage modules of ``rank``, its rank among them)."""
        s = self._stage_rank(rank)
        return [tm for k, tm in enumerate(self.stage_modules) if k % self.pp == s], \
            self._sub_rank(rank)

    def parameters(self) -> list[torch.nn.Parameter]:
        self._require("parameters")
        out = []
        for rank in self.ranks:
            tms, sub = self._where(rank)
            out += [p for tm in tms for p in tm.shards(sub).values()]
        return out

    def shards(self, rank: int) -> dict:
        self._require("shards")
        if rank not in self.ranks:
            raise ValueError(f"{_WHERE}.shards: rank {rank} runs in another process; this "
                             f"one holds rank {self.ranks}")
        tms, sub = self._where(rank)
        return {k: v for tm in tms for k, v in tm.shards(sub).items()}

    def _whole(self, what: str) -> dict:
        """Every stage's whole tensors by name (``what``: ``"gradients"`` or
        ``"state_dict"``). On a real mesh each process assembles its own stages' (with the
        ranks of its stage) and the stages share them along ``pp``: every rank must call it,
        and every rank gets the whole model."""
        self._require(what)
        mine = {k: v for tm in self.stage_modules if tm._last is not None
                for k, v in getattr(tm, what)().items()}
        if self._simulated:
            return mine
        from ..runtime.distributed import backend_for
        from .world import share_along
        every = share_along(backend_for(self.mesh), PP, mine)
        order = list(self.model.state_dict())      # the model's order, as a simulated mesh
        return {**{n: every[n] for n in order if n in every}, **every}

    def gradients(self) -> dict:
        return self._whole("gradients")

    def state_dict(self) -> dict:
        return self._whole("state_dict")

    # clip_grad_norm_ on a real mesh: this process's shards' placements; each pp coordinate
    # holds other parameters (fxshard.training.world.owned_norm's ``distinct``)
    _distinct_axes = (PP,)

    @property
    def _specs(self) -> dict:
        return {k: v for tm in self.stage_modules if tm._specs is not None
                for k, v in tm._specs.items()}

    def memory(self, rank: int) -> dict:
        """Bytes rank ``rank`` holds: its stages' parameter shards and gradients, and the
        most bytes of saved activations alive at once during the last step."""
        mine = self.shards(rank)
        return {"parameters": storage_bytes(mine.values()),
                "gradients": storage_bytes(p.grad for p in mine.values() if p.grad is not None),
                "saved": self.peak_saved.get(rank, 0)}

    def rank_module(self, rank: int, which: str = "forward", stage: int | None = None):
        """Rank ``rank``'s ``"forward"`` or ``"backward"`` program (of its virtual
        ``stage``-th chunk if it holds several)."""
        tms, sub = self._where(rank)
        return tms[stage or 0].rank_module(sub, which)

    def collectives(self, which: str = "backward") -> list:
        from ..explain import collectives_of
        return [c for tm in self.stage_modules if tm._last is not None
                for c in collectives_of(tm.rank_module(0, which).graph, self.sub)]

    def _require(self, what: str):
        if self._last is None:
            raise ValueError(f"{_WHERE}.{what}: nothing is traced yet; call the module once "
                             f"(pm(x)) first")
        return self._last
