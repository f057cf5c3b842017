"""One pipeline stage as a trainer of its own, and the autograd Function of the whole schedule.

:class:`fxshard.training.pipeline.PipelineTrainer` holds one :class:`StageModule` per stage (a
:class:`~fxshard.training.module.TrainModule` on the mesh without ``pp``), installs its
parameters in the weight store as :class:`StageShard` (asked for by rank of the whole mesh),
keeps one :class:`Staged` per input signature, and runs the schedule through :class:`Pipe`::

    pm(x)  ->  Pipe.apply(trainer, staged, n, *params, *x)   # every stage's forward, per microbatch
    loss.backward()  ->  Pipe.backward                       # every stage's backward
"""
from __future__ import annotations

import torch

from ..mesh import PP, SimulatedMesh
from .autograd_step import check_backward_once
from .module import TrainModule
from .shards import TrainedShard

__all__ = ["StageModule", "StageShard", "Staged", "Pipe", "make_stage_modules",
           "check_virtual_stages"]

_WHERE = "fxshard.training.pipeline"


class StageModule(TrainModule):
    """One stage's shards and programs on the mesh without ``pp`` (its ranks: the coordinates
    of the other axes); on a real mesh its collectives run on the whole mesh's axis groups."""

    def __init__(self, model, sub: SimulatedMesh, device_mesh, sub_rank: int, **kw):
        super().__init__(model, sub, **kw)
        self.device_mesh, self.sub_rank = device_mesh, sub_rank
        self._simulated = device_mesh is None

    @property
    def ranks(self) -> list[int]:
        return list(range(self.spec.world_size)) if self._simulated else [self.sub_rank]

    def _world_run(self, fn) -> dict:
        if self._simulated:
            return super()._world_run(fn)
        from ..runtime.context import use_backend
        from ..runtime.distributed import backend_for
        with use_backend(backend_for(self.device_mesh)):
            return {self.sub_rank: fn(self.sub_rank)}

    def _gather_blocks(self, block: torch.Tensor) -> list:
        """This stage's ranks' blocks (over every axis but ``pp``), by rank on its mesh."""
        from ..runtime.distributed import backend_for
        from .world import gather_blocks
        return gather_blocks(backend_for(self.device_mesh), block, skip=(PP,))


class StageShard(TrainedShard):
    """A stage's trained parameter, its blocks asked for by rank of the whole mesh."""

    def __init__(self, trainer, tm, fqn, spec, shape):
        super().__init__(tm, fqn, spec, shape)
        self.trainer = trainer

    def block(self, spec, mesh, rank, shape=None):
        if tuple(spec) == self.spec and (shape is None or tuple(shape) == self.shape):
            sub = self.trainer._sub_rank(rank) if self.tm._simulated else self.tm.sub_rank
            return self.tm._shards[sub][self.fqn].detach()
        return super().block(spec, mesh, rank, shape)


class Staged:
    """The stage programs of one (microbatch) input signature."""

    def __init__(self, forwards, programs, traced, tied, n_flat, seed=None):
        self.forwards, self.programs, self.traced = forwards, programs, traced
        self.n_flat, self.seed = n_flat, seed   # seed: dropout's step seed input, or None
        self.joint = type("JointInfo", (), {"tied": tied})()


class Pipe(torch.autograd.Function):
    """Every stage's forward on every microbatch; its backward: every stage's backward."""

    @staticmethod
    def forward(ctx, runner, staged, n_params, *flat):
        outs, state = runner._forward_all(staged, list(flat[n_params:]))
        ctx.runner, ctx.staged, ctx.state, ctx.n_user = runner, staged, state, len(flat) - n_params
        ctx.save_for_backward(*flat[:n_params])   # an in-place change before backward: error
        ctx.metas = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None
                     for o in outs]
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor)
                                      and not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        check_backward_once(_WHERE, ctx.state)
        ctx.saved_tensors    # noqa: B018  (raises if a parameter changed in place since forward)
        grads = [g if g is not None or m is None else torch.zeros(m[0], dtype=m[1], device=m[2])
                 for g, m in zip(grad_outputs, ctx.metas)]
        run = ctx.runner
        acc = run._backward_all(ctx.staged, ctx.state, grads)
        ctx.state = None
        return (None, None, None, *[acc.get(id(p)) for p in run.parameters()],
                *([None] * ctx.n_user))


def make_stage_modules(trainer, n_stages: int) -> list[StageModule]:
    """One :class:`StageModule` per stage of ``trainer`` (a ``PipelineTrainer``), with its
    options; on a real mesh each holds this process's rank."""
    me = None if trainer._simulated else trainer.ranks[0]
    opt = trainer.options.get
    return [StageModule(
        trainer.model, trainer.sub, None if trainer._simulated else trainer.mesh,
        0 if me is None else trainer._sub_rank(me),
        sequence_parallel=opt("sequence_parallel", False), plan=opt("plan"),
        strict=opt("strict", False), embedding=opt("embedding", "embed_dim"),
        store=trainer.store, compile=opt("compile", False), recompute=opt("recompute"),
        ring_zigzag=opt("ring_zigzag", True),
        fsdp_reshard_after_forward=opt("fsdp_reshard_after_forward", True))
        for _ in range(n_stages)]


def check_virtual_stages(built: int | None, asked: int, where: str) -> None:
    """The stages (and the shards placed on them) were built for ``built`` virtual stages
    per rank by an earlier call; a call asking for another number is a ValueError saying
    how the first call fixes it."""
    if built is None or asked == built:
        return
    raise ValueError(
        f"{where}: the stages were built with virtual_stages={built} by an earlier call "
        f"(parallelize(example_inputs=), pm(x), pm.parameters() or a train_step; their shards "
        f"are placed so), and this call asks for {asked}. The first training call fixes it: "
        f"make it pm.train_step(..., schedule='interleaved_1f1b', virtual_stages={asked}) "
        f"(parallelize without example_inputs=, the optimizer built after that step), or keep "
        f"virtual_stages={built} (schedule "
        f"{'gpipe or 1f1b' if built == 1 else 'interleaved_1f1b or gpipe'})")
