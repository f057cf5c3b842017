"""The programs of a ParallelModule: built once per input signature, kept until weights change.

    c, micro = cache.prepare(args, kwargs)     # sync weights, build if new, check loaded
    c.programs                                 # one fxshard.passes.emit.Program per pp stage

A signature is the flat inputs' shapes, dtypes and devices (the first microbatch's), the
``torch.autocast`` state (:func:`fxshard.mixed_precision.autocast_state`) and the
generation key (``None`` for the forward; ``("prefill" | "decode", capacity[, "greedy"])`` for
:mod:`fxshard.generation`). :func:`compile_program` traces the model and runs the passes;
:class:`Compiled` holds what is built from it (the programs, and per rank the bound modules the
:mod:`~fxshard.runtime.executor` makes). A changed weight drops the per-rank modules (they are
re-sliced at the next call); a changed buffer, shape or dtype drops the programs (retraced).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..mesh import MeshSpec
from ..passes import PassCtx
from ..passes.emit import Program
from ..passes.pipeline import build_programs
from ..trace import Traced
from ..mixed_precision import autocast_state, policy_scope
from ..passes.cast_params import cast_inference_program
from ..weights import tied_names
from .agreement import agree
from .weight_store import WeightStore

__all__ = ["Options", "Compiled", "ProgramCache", "compile_program", "signature"]

_WHERE = "fxshard.parallelize"


@dataclass
class Options:
    """The options of ``fxshard.parallelize`` the programs are built and run with."""

    plan: dict
    sequence_parallel: bool
    microbatches: int
    strict: bool
    embedding: str
    stages: list | None = None
    ring_zigzag: bool = True
    compile: bool = False
    recompute: str | None = None    # training: fxshard.training.recompute
    fsdp_reshard_after_forward: bool | str = True   # training: fsdp's gathers redone in bwd
    mixed_precision: object = None  # torch's MixedPrecisionPolicy (fxshard.mixed_precision)


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
    # read on every call, set when the signature is built (defaults: the general path)
    tensor_inputs: bool = False                     # every flat input is a tensor
    out_leaf: bool = False                          # the output is one tensor, not a tree

    @property
    def program(self) -> Program:
        return self.programs[0]


def signature(flat) -> tuple:
    """The cache key of flat inputs: each tensor's shape, dtype and device; other values' repr."""
    return tuple([(tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor)
                  else ("const", repr(x)) for x in flat])


def structure(args: tuple, kwargs: dict):
    """The call's structure, part of the cache key beside :func:`signature`: which argument
    each leaf is. ``pm(ids, attention_mask=m)`` and ``pm(ids, position_ids=p)`` have the same
    leaves' shapes; keyed by leaves alone the second ran the first's program with ``p`` as the
    mask. Keyword order counts too (the leaves are flattened in the call's order)."""
    if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
        return len(args)    # the common call, without tree_structure's cost
    return str(pytree.tree_structure((args, kwargs)))


def compile_program(model: torch.nn.Module, args: tuple, kwargs: dict, ctx: PassCtx,
                    **options) -> Compiled:
    """:func:`fxshard.passes.pipeline.build_programs`' trace and programs, as a ``Compiled``
    (options: ``stages``, ``traced``, ``buffers``, ``generation``)."""
    traced, programs = build_programs(model, args, kwargs, ctx, **options)
    return Compiled(traced=traced, ctx=ctx, programs=programs)


class ProgramCache:
    """``(generation, signature) -> Compiled`` for one model, mesh and options; ``last`` is the
    entry of the most recent :meth:`get` (what ``rank_module`` and ``explain`` show)."""

    def __init__(self, model: torch.nn.Module, mesh, spec: MeshSpec, options: Options,
                 weights: WeightStore):
        self.model, self.spec, self.options, self.weights = model, spec, options, weights
        self.mesh = mesh
        self.agreed: set = set()   # call signatures the ranks agreed on (real mesh)
        self._entries: dict[tuple, Compiled] = {}
        self.last: Compiled | None = None
        # ("train", signature) -> fxshard.training.program.TrainProgram (grad enabled)
        self.training: dict[tuple, object] = {}
        self.last_mode = None      # "train" | "infer": what the latest call ran

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        """``((generation, signature), Compiled)`` of every signature built."""
        return self._entries.items()

    # -- the per-call path ------------------------------------------------------------
    def prepare(self, args: tuple, kwargs: dict, generation: tuple | None = None,
                autocast: tuple | None = None) -> tuple[Compiled, list[list]]:
        """What ``pm(*args, **kwargs)`` runs: weights synced, the signature's programs (built
        if new) with every weight loaded, and the flat inputs of each microbatch.
        ``autocast``: the caller's :func:`autocast_state`, where it has it already."""
        retrace = self.weights.sync()
        if retrace is not None:
            self.invalidate(retrace=retrace)
        c, micro = self.get(args, kwargs, generation, autocast=autocast)
        if not c.loaded:
            self.check_loaded(c)
        return c, micro

    def sync_weights(self) -> None:
        """Re-slice (or retrace) after the model's tensors changed (see
        :meth:`WeightStore.sync`)."""
        retrace = self.weights.sync()
        if retrace is not None:
            self.invalidate(retrace=retrace)

    def get(self, args: tuple, kwargs: dict, generation: tuple | None = None,
            pinned: tuple = (), autocast: tuple | None = None) -> tuple[Compiled, list[list]]:
        """The programs of this signature (built on first use) and the microbatches' flat
        inputs; no weight sync, no load check. ``pinned``: ``((fqn, tp placement), ...)`` the
        build must give those parameters (a decode step adopting its prefill's layout)."""
        micro, tree = self.split(args, kwargs)
        # the call's structure (see structure()) and the model's train mode too: dropout's
        # sites are traced in train mode, none in eval; and the autocast state (its casts)
        key = (generation, (tree,) + signature(micro[0]) + (self.model.training,) +
               ((pinned,) if pinned else ()) +
               (autocast_state() if autocast is None else autocast))
        c = self._entries.get(key)
        if c is not None:
            self.last, self.last_mode = c, "infer"
            return c, micro
        agree(self.mesh, self.agreed, _WHERE, {"generation": generation, "inputs": micro[0]})
        _, spec = pytree.tree_flatten((args, kwargs))
        a, k = pytree.tree_unflatten(micro[0], spec)
        try:
            with policy_scope(self.options.mixed_precision, self.model):
                self._entries[key] = self._build(tuple(a), dict(k), generation, dict(pinned))
        except ValueError as e:
            if len(micro) == 1:
                raise
            raise ValueError(
                f"{e} [with microbatches={len(micro)} the program is traced on one "
                f"microbatch, 1/{len(micro)} of the batch: the shapes above are a "
                f"microbatch's; use fewer microbatches or a larger batch]") from e
        c = self.last = self._entries[key]
        self.last_mode = "infer"
        if len(micro) > 1:
            self._check_microbatch_outputs(c, micro[0])
        c.tensor_inputs = all(isinstance(x, torch.Tensor) for x in micro[0])
        c.out_leaf = c.traced.out_spec.is_leaf()
        return c, micro

    def train_program(self, args: tuple, kwargs: dict, build, extra=None):
        """The training program of this signature (``build(args, kwargs)`` on first use):
        forward and backward rank programs (:mod:`fxshard.training`). ``extra``: ``(key,
        description)`` of a loss traced with the model (``train_step(loss_fn=)``): the key
        tells programs apart in this process, the description is what ranks agree on."""
        flat = pytree.tree_flatten((args, kwargs))[0]
        key = ("train", structure(args, kwargs), signature(flat),
               None if extra is None else extra[0], autocast_state())
        if key not in self.training:
            agreed = {"generation": "train", "inputs": flat}
            if extra is not None:
                agreed["loss_fn"] = extra[1]
            agree(self.mesh, self.agreed, _WHERE, agreed)
            with policy_scope(self.options.mixed_precision, self.model):
                self.training[key] = build(args, kwargs)
        self.last_mode = "train"
        return self.training[key]

    def check_loaded(self, c: Compiled) -> None:
        """Raise unless every weight ``c`` reads has a value; remembered once true."""
        self.weights.check_loaded(c.programs)
        c.loaded = True

    def split(self, args: tuple, kwargs: dict) -> tuple[list[list], object]:
        """The flat inputs of each microbatch (the batch is dim 0 of every tensor input), and
        the call's :func:`structure` (from the same flattening)."""
        if not kwargs and (len(args) == 1 and isinstance(args[0], torch.Tensor)
                           or all(isinstance(x, torch.Tensor) for x in args)):
            flat = list(args)   # what tree_flatten gives, without its ~15 us per call
            tree = len(flat)
        else:
            flat, spec = pytree.tree_flatten((args, kwargs))
            tree = str(spec)
        m = self.options.microbatches
        if m == 1:
            return [flat], tree
        for x in flat:
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % m):
                raise ValueError(
                    f"{_WHERE}: an input of shape {tuple(x.shape)} cannot be split into "
                    f"microbatches={m} along dim 0 (batch {x.shape[0] if x.dim() else '-'}); "
                    f"use a batch that is a multiple of {m} or change microbatches")
        return [[x.chunk(m)[i] if isinstance(x, torch.Tensor) else x for x in flat]
                for i in range(m)], tree

    # -- building and dropping ---------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict, generation: tuple | None,
               pinned: dict | None = None) -> Compiled:
        o = self.options
        decode = generation is not None and generation[0] == "decode"
        ctx = PassCtx(mesh=self.spec, sequence_parallel=o.sequence_parallel and not decode,
                      strict=o.strict, plan=o.plan, pinned=pinned or {},
                      embedding_style=o.embedding,
                      ring_zigzag=o.ring_zigzag, split_sequence=not decode,
                      aliases=tied_names(self.model))
        c = compile_program(self.model, args, kwargs, ctx, stages=o.stages,
                            buffers=self.weights.buffer_values(), generation=generation)
        self.weights.record_constants(c.traced.constants)
        for program in c.programs:   # the policy's fp32 masters, cast in the graph
            cast_inference_program(program)
        return c

    def _check_microbatch_outputs(self, c: Compiled, first: list) -> None:
        """Microbatch outputs are joined along dim 0, so every tensor output must be per-sample
        (batch on dim 0), not a reduction over the batch (a mean loss, a sum)."""
        batch = next(x.shape[0] for x in first if isinstance(x, torch.Tensor) and x.dim())
        out_node = next(n for n in c.programs[-1].graph.nodes if n.op == "output")
        for i, a in enumerate(pytree.tree_leaves(out_node.args[0])):
            v = a.meta.get("val") if isinstance(a, fx.Node) else None
            if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != batch):
                raise ValueError(
                    f"{_WHERE}: with microbatches={self.options.microbatches} the outputs of "
                    f"the microbatches are joined along dim 0, but output {i} has shape "
                    f"{tuple(v.shape)} per microbatch of {batch} samples (not per-sample). "
                    f"Return per-sample values (e.g. logits, not a loss) or use microbatches=1")

    def invalidate(self, *, retrace: bool = False) -> None:
        """Drop every rank's modules (re-sliced at the next call) or, with ``retrace``, every
        program (traced again at the next call; ``last`` shows the old one till then)."""
        if retrace:
            self._entries.clear()
            self.training.clear()
        for c in self._entries.values():
            c.modules.clear()
            c.runners.clear()
            c.loaded = False

    def require_last(self, what: str) -> Compiled:
        """``last``, or a clear error naming ``ParallelModule.<what>`` when nothing is traced."""
        if self.last is None:
            raise ValueError(f"ParallelModule.{what}: nothing is traced yet; call pm(x) once or "
                             f"pass example_inputs= to fxshard.parallelize")
        return self.last
