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

import math

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from ..checks import check_no_autocast
from ..mesh import MeshSpec, is_simulated, mesh_spec
from ..passes import PassCtx
from ..placement import Partial, add_block, cut_to, local_block
from ..runtime.program_cache import structure
from ..trace import _without_cache
from ..weights import tied_names
from .program import TrainProgram, build_train_program, check_training_axes

__all__ = ["TrainModule", "parallelize_for_training", "assemble", "check_trainable"]

_WHERE = "fxshard.training"


def assemble(blocks: list[torch.Tensor], shape: tuple, spec: tuple, mesh: MeshSpec
             ) -> torch.Tensor:
    """The global tensor from every rank's block (``blocks[rank]``): shards placed where they
    belong, Partial axes summed, Replicate axes read from coordinate 0."""
    out = torch.zeros(shape, dtype=blocks[0].dtype, device=blocks[0].device)
    for rank, block in enumerate(blocks):
        coords = mesh.coords(rank)
        if any(n > 1 and c != 0 and not isinstance(p, Partial) and shard_dim_of(p) is None
               for n, c, p in zip(mesh.shape, coords, spec)):
            continue    # a replica of a block another rank gave already
        add_block(out, block, spec, mesh, rank)
    return out


def direct(gm):
    """``gm`` called without its per-node ``OpOverload.__call__`` and ``nn.Module.__call__``
    frames (``fxshard.compile._direct_forward``, as inference's eager stages), made once per
    GraphModule and its code (again after a ``recompile``); ``gm`` itself where it is no
    GraphModule or its code reads attributes of the module. As inference's eager stages, an
    all-reduce of a value nothing else reads (a row-parallel matmul's output, a gradient
    sum) sums in place, without a copy (``fxshard.passes.post_emit.TRAINING`` on a copy of
    the graph: ``gm`` itself, what ``rank_module`` shows, is unchanged); the fsdp axis's
    all-gathers run one ahead and its reduce-scatters in the background
    (``prefetch_fsdp_pass``). Background tp all-reduces (``overlap_collectives_pass``) are
    not in that list: measured, no gain on CPU gloo (``benchmarks/history/train_step.md``)."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    code = gm.code
    made = gm.__dict__.get("_fxshard_direct")
    if made is None or made[0] is not code:
        from ..compile import _direct_forward
        run = None
        if any(n.op == "get_attr" for n in gm.graph.nodes):
            fn = gm
        else:
            from ..passes import post_emit
            from ..passes.pipeline import run_passes
            graph = fx.Graph()
            graph.output(graph.graph_copy(gm.graph, {}))
            run = fx.GraphModule(torch.nn.Module(), graph, class_name=type(gm).__name__)
            fn = _direct_forward(run_passes(run, post_emit.TRAINING, post_emit.PostEmitCtx()))
        made = gm.__dict__["_fxshard_direct"] = (code, fn, run)   # run: the graph fn runs
    return made[1]


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _block(value, spec: tuple, mesh: MeshSpec, rank: int, shape: tuple | None = None
           ) -> torch.Tensor:
    """Rank ``rank``'s block of ``value`` (a tensor, or a checkpoint source), a new tensor.
    ``shape``: the program's global shape, where it pads the model's rows (a vocab padded
    for tp, :mod:`fxshard.passes.pad_vocab`)."""
    if hasattr(value, "block"):   # a checkpoint's block is read into a tensor of its own
        block = value.block(spec, mesh, rank, shape=shape)
        return block if getattr(value, "fresh_blocks", False) else block.clone()
    if shape is not None and tuple(value.shape) != tuple(shape):
        from ..placement import padded_block
        return padded_block(value.detach().__getitem__, tuple(value.shape), tuple(shape),
                            spec, mesh, rank)
    return local_block(value.detach(), spec, mesh, rank)     # a copy


def shard_dim_of(p):
    from ..placement import shard_dim
    return shard_dim(p)


def check_inputs_need_no_grad(where: str, user: list) -> None:
    """A NotImplementedError for a user input that requires grad: the rank programs give
    gradients to the parameters only, so a module upstream of ``pm`` would get none."""
    for i, x in enumerate(user):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise NotImplementedError(
                f"{where}: input {i} (shape {tuple(x.shape)}, {x.dtype}) requires grad, and "
                f"fxshard does not yet compute gradients into its inputs (only into "
                f"pm.parameters()): whatever made it would get no gradient. Parallelize the "
                f"module that makes it together with the model, or pass it .detach()ed")


def check_backward_once(where: str, saved) -> None:
    """A clear error for a second backward through one forward (``retain_graph=True``): the
    rank programs' saved activations are freed by the first."""
    if saved is None:
        raise RuntimeError(
            f"{where}: a second backward through one pm(x) output (retain_graph=True?); "
            f"fxshard frees the ranks' saved activations in the first backward. Call pm(x) "
            f"again for another backward, or add the losses and call backward once")


def frozen_names(model: torch.nn.Module) -> frozenset:
    """The names of ``model``'s parameters that do not require grad: frozen, they get no
    gradient and an optimizer leaves them, as on one device."""
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad)


class _Step(torch.autograd.Function):
    """Every rank's forward; its backward is every rank's backward. Inputs: the runner, the
    number of shard tensors, every rank's shards (rank-major), then the user's tensors."""

    @staticmethod
    def forward(ctx, runner: "TrainModule", program: TrainProgram, n_shards: int, *flat):
        shards, user = flat[:n_shards], flat[n_shards:]
        outs, saved, extra = runner._run_forward(program, shards, user)
        ctx.runner, ctx.program, ctx.saved_per_rank = runner, program, saved
        ctx.n_user = len(user)
        # the backward reads the shards: autograd's version check makes an in-place change
        # between forward and backward (opt.step() before loss.backward()) its usual error,
        # as on one device, instead of gradients at the changed weights
        ctx.save_for_backward(*shards)
        outs = list(outs) + extra    # a vocab output's other blocks follow the outputs
        ctx.shapes = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None
                      for o in outs]
        ints = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        ctx.mark_non_differentiable(*ints)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        program, runner = ctx.program, ctx.runner
        check_backward_once(_WHERE, ctx.saved_per_rank)
        ctx.saved_tensors    # noqa: B018  (raises if a shard changed in place since forward)

        def grad(i):
            g, meta = grad_outputs[i], ctx.shapes[i]
            return g if g is not None else torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        slots = runner._tangent_slots(program)

        def tangents(rank):
            return [grad(slots[i][runner._block_of(program, rank)] if i in slots else i)
                    for i in program.split.tangents]
        grads = runner._run_backward(program, ctx.saved_per_rank, tangents)
        ctx.saved_per_rank = None
        return (None, None, None, *grads, *([None] * ctx.n_user))


class TrainModule:
    """A model's training programs over a mesh; see :func:`parallelize_for_training`."""

    _distinct_axes: tuple = ()   # mesh axes whose coordinates hold other parameters (pp's)

    def __init__(self, model: torch.nn.Module, mesh, *, sequence_parallel: bool = False,
                 plan: dict | None = None, embedding: str = "embed_dim", strict: bool = False,
                 fsdp_reshard_after_forward: bool | str = True, recompute: str | None = None,
                 store=None, executor=None, cache=None, ring_zigzag: bool = True,
                 compile: bool = False):
        from ..checks import check_reshard_after_forward
        from .recompute import check_recompute
        check_recompute(_WHERE, recompute)
        check_reshard_after_forward(_WHERE, fsdp_reshard_after_forward)
        self.model = model
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
        self._frozen: frozenset = frozenset()   # the shards' requires_grad follows the model's

    # -- building ------------------------------------------------------------------------
    def _program(self, args: tuple, kwargs: dict, loss=None) -> TrainProgram:
        """The program of this call signature (``loss``: a traced loss, see
        :meth:`loss_step`), built on first use."""
        check_no_autocast(_WHERE)
        mode = self.model.training    # train mode traces dropout's sites, eval mode none
        frozen = frozen_names(self.model)   # (traced into the joint graph: no gradient made)
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
        key = (mode, extra, frozen, structure(args, kwargs)) + tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
        if key not in self._programs:
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
            module = WithLoss(self.model, loss, with_target=len(args) == 3)
        program = build_train_program(module, args, kwargs, ctx,
                                      reshard_after_forward=self.fsdp_reshard_after_forward,
                                      recompute=self.recompute, vocab_outputs=True)
        program.loss_fn = loss   # held: loss_key's ids stay this loss's while the entry lives
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
                    block = _block(values[fqn], spec, self.spec, rank,
                                   program.shapes.get(fqn))
                    mine[fqn] = torch.nn.Parameter(block) if fqn in params else block
                self._shards[rank] = mine
            if self.store is not None:
                from .shards import install
                install(self.store, self, program)
            return
        for fqn, spec in program.specs.items():
            if self._specs.get(fqn, spec) != spec:
                raise NotImplementedError(
                    f"{_WHERE}: a new input signature places {fqn} as {spec}, the trained "
                    f"shards are {self._specs[fqn]}; use one input shape for training")

    # -- running -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def loss_step(self, loss_fn, target, args: tuple, kwargs: dict) -> torch.Tensor:
        """``loss_fn(model(*args, **kwargs), target)`` traced with the model as one program
        (:mod:`fxshard.training.with_loss`: a cross-entropy there is vocab-parallel on tp,
        the logits never gathered); returns the loss, which backpropagates like ``tm(x)``'s
        output. A loss that cannot be traced runs on ``tm(x)``'s output, with a warning."""
        from .with_loss import loss_key, warn_not_traced
        inner = (tuple(args), _without_cache(self.model, dict(kwargs)))
        wrapped = inner + ((target,) if target is not None else ())
        key = loss_key(loss_fn)
        failed = self._untraced_losses
        if key not in failed:
            try:
                return self._call(wrapped, {}, loss=loss_fn)
            except Exception as e:   # noqa: BLE001 (the loss on the output is the same loss)
                failed[key] = loss_fn   # held, so the key's ids stay this loss's
                warn_not_traced(f"{_WHERE}.train_step", loss_fn, e)
        out = self._call(args, kwargs)
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
        outs = _Step.apply(self, program, len(differentiable), *differentiable, *user)
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

    # -- outputs kept as blocks (fxshard.training.vocab_output) -------------------------------
    def _block_axes(self, program: TrainProgram) -> tuple:
        """The batch axes (``((axis, size), ...)``, mesh order) that split the kept outputs'
        dim 0 (every kept output is placed alike: the logits)."""
        from ..mesh import BATCH_AXES
        from ..placement import Shard
        spec = next(iter(program.vocab_outputs.values()))
        return tuple((a, n) for a, n, p in zip(self.spec.axis_names, self.spec.shape, spec)
                     if n > 1 and a in BATCH_AXES and p == Shard(0))

    def _block_ranks(self, program: TrainProgram) -> list[int]:
        """The ranks whose blocks a kept output holds: each row group's (batch axes'
        coordinates, the outer axis first) ``tp`` blocks in order, coordinate 0 on every other
        axis (a simulated mesh); this process's rank (a real one)."""
        if not self._simulated:
            return list(self.ranks)
        from ..mesh import TP
        names = self.spec.axis_names
        axes = [names.index(a) for a, _ in self._block_axes(program)]
        sizes = [self.spec.shape[i] for i in axes]
        tp = names.index(TP)
        out = []
        for row in range(math.prod(sizes)):
            coords = [0] * len(names)
            rest = row
            for i, n in reversed(list(zip(axes, sizes))):
                coords[i], rest = rest % n, rest // n
            for c in range(self.spec.shape[tp]):
                coords[tp] = c
                out.append(self.spec.rank_of(coords))
        return out

    def _block_of(self, program: TrainProgram, rank: int) -> int:
        """Which of the held blocks is ``rank``'s (its row group's, then its ``tp``
        coordinate; a real mesh: 0)."""
        if not self._simulated:
            return 0
        from ..mesh import TP
        names, coords = self.spec.axis_names, self.spec.coords(rank)
        row = 0
        for a, n in self._block_axes(program):
            row = row * n + coords[names.index(a)]
        return row * self.spec.axis_size(TP) + coords[names.index(TP)]

    def _tangent_slots(self, program: TrainProgram) -> dict:
        """Output index -> the positions of its blocks among ``_Step``'s outputs (the
        output's own position, then the extra blocks after the model's outputs)."""
        slots, nxt = {}, program.split.n_outputs
        if not program.vocab_outputs:
            return slots
        extra = len(self._block_ranks(program)) - 1
        for i in sorted(program.vocab_outputs):
            slots[i] = [i] + list(range(nxt, nxt + extra))
            nxt += extra
        return slots

    def _vocab_blocks(self, program: TrainProgram, valid: int | None = None):
        """The blocks' grid; ``valid``: the vocab where the blocks hold it padded (the
        columns past it are never read)."""
        from ..mesh import TP
        from .vocab_blocks import Blocks
        n = self.spec.axis_size(TP)
        data = self._block_axes(program)
        rows = math.prod(size for _, size in data)
        if self._simulated:
            return Blocks(n, list(range(n)), rows=rows, data_axes=data, valid=valid)
        from ..runtime.distributed import backend_for
        backend = backend_for(self.mesh)
        row = 0
        for a, size in data:
            row = row * size + backend.axis_index(a)
        return Blocks(n, [backend.axis_index(TP)], backend, rows=rows, row_coords=[row],
                      data_axes=data, valid=valid)

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
            program.compiled[which] = compile_graph(getattr(program.split, which), example())
        return program.compiled[which]

    def _run_forward(self, program: TrainProgram, shards, user) -> tuple[list, list]:
        split = program.split
        forward = self._fn(program, "forward",
                           lambda: [*self._rank_weights(program, self.ranks[0]), *user])

        def run(rank):
            with torch.no_grad():
                return forward(*self._rank_weights(program, rank), *user)
        results = self._world_run(run)
        outs = list(results[self.ranks[0]][:split.n_outputs])
        saved = {r: list(out[split.n_outputs:]) for r, out in results.items()}
        self._saved_bytes = {r: _bytes(s) for r, s in saved.items()}
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
            with torch.no_grad():
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
        return self._assembled(lambda p: p.grad)

    def state_dict(self) -> dict:
        """The trained parameters, whole, by the model's names (a real mesh: gathered to
        every rank; every rank must call it)."""
        return self._assembled(lambda p: p.detach())

    def memory(self, rank: int) -> dict:
        """Bytes rank ``rank`` holds: its parameter shards, their gradients, and the
        activations the last forward saved for the backward (distinct storages)."""
        mine = self.shards(rank)
        return {"parameters": _bytes(mine.values()),
                "gradients": _bytes(p.grad for p in mine.values() if p.grad is not None),
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
