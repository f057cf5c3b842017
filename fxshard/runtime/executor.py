"""Run one signature's rank programs: microbatches, pipeline output sharing, state binding.

``Executor.run(compiled, micro, state)`` runs every rank of a simulated mesh (each a thread of
this process) or this process's rank of a real one, and returns the last stage's flat outputs,
on every rank. A rank program's inputs are the user's tensors (one microbatch at a time)
followed by its state inputs (``Program.state_inputs``: the KV caches of text generation and
their write/read positions), which ``state(rank)`` gives as a dict; a state tensor with the
batch on dim 0 (a cache, the read lengths) is cut into the same microbatches as the inputs
(views: an in-place cache write lands in the rank's cache), the write position is not.

What a rank calls is its stage's program bound to its weights (:meth:`Executor.runner`): a
plain GraphModule with the weights as inputs (``fxshard.compile.eager_stage``) or, with
``compile=True``, Inductor-compiled once per stage (``fxshard.compile.compile_stage``) and
shared by the stage's ranks. ``Executor.module(c, rank)`` is the readable GraphModule
(``pm.rank_module``) holding the rank's weight blocks.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..mesh import MeshSpec, PP, is_simulated
from ..passes.emit import Program, build_rank_module
from .context import CURRENT_BACKEND, use_backend
from .weight_store import WeightStore

__all__ = ["Executor", "bind_inputs"]


def bind_inputs(flat: list, program: Program, state: dict, index: int, count: int) -> list:
    """The inputs of ``program`` for microbatch ``index`` of ``count``: the user's tensors of
    ``flat``, then its state inputs from ``state`` (the batched ones cut to the microbatch)."""
    args = [x for x in flat if isinstance(x, torch.Tensor)]
    for key in program.state_inputs:
        t = state[key]
        if count > 1 and t.dim() and key != program.write_pos:
            t = t.narrow(0, index * (t.shape[0] // count), t.shape[0] // count)
        args.append(t)
    return args


class Executor:
    """Runs ``Compiled`` programs (:mod:`fxshard.runtime.program_cache`) on ``mesh``, with the
    weights of ``weights``; ``options.compile`` picks Inductor stages."""

    def __init__(self, mesh, spec: MeshSpec, options, weights: WeightStore):
        self.mesh, self.spec, self.options, self.weights = mesh, spec, options, weights
        self.device = torch.device(spec.device_type)
        self.world = None        # the simulated mesh's threads, started at the first run
        self.kv_caches = None    # the last generate's caches (fxshard.generation.cache.Caches)
        # fixed by the mesh, read on every call: worked out once
        self.simulated = is_simulated(mesh)
        self.last_stage = spec.axis_size(PP) - 1
        self._stages: dict[int, int] = {}
        self._backend_for = None  # fxshard.runtime.distributed.backend_for, on a real mesh

    def stage_of(self, rank: int) -> int:
        stage = self._stages.get(rank)
        if stage is None:
            stage = self._stages[rank] = self.spec.axis_index(rank, PP)
        return stage

    def backend(self):
        """This process's :class:`~fxshard.runtime.distributed.DistributedBackend` (real mesh;
        made again after ``close`` released it)."""
        if self._backend_for is None:
            from .distributed import backend_for   # torch.distributed only where it is used
            self._backend_for = backend_for
        return self._backend_for(self.mesh)

    def ranks(self) -> list[int]:
        """The ranks this process runs: every rank of a simulated mesh, else its own."""
        if self.simulated:
            return list(range(self.spec.world_size))
        return [self.backend().rank]

    # -- binding ---------------------------------------------------------------------
    def module(self, c, rank: int) -> fx.GraphModule:
        """Rank ``rank``'s GraphModule of ``c``, holding its blocks of the weights."""
        if rank not in c.modules:
            c.modules[rank] = build_rank_module(c.programs[self.stage_of(rank)], rank,
                                                self.spec, self.weights.values, self.device)
        return c.modules[rank]

    def runner(self, c, rank: int, flat: list):
        """What rank ``rank`` calls for ``c``: its stage's program bound to its weights (with
        ``compile=True`` compiled once per stage, here, in the calling thread, on the example
        inputs ``flat``: call it for every rank before the ranks run)."""
        built = c.runners.get(rank)
        if built is not None and c.modules.get(rank) is built[0]:
            return built[1]    # every call after the first
        mod = self.module(c, rank)
        built = c.runners.get(rank)
        if built is None or built[0] is not mod:
            from ..compile import compile_stage, eager_stage
            stage = self.stage_of(rank)
            if not self.options.compile:
                fn = eager_stage(c.programs[stage])
            else:
                if stage not in c.compiled:
                    state = [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype,
                                         device=self.device)
                             for n in c.programs[stage].graph.nodes
                             if n.op == "placeholder" and n.meta.get("fxshard_state") is not None]
                    c.compiled[stage] = compile_stage(
                        c.programs[stage], mod,
                        [x for x in flat if isinstance(x, torch.Tensor)] + state,
                        groups=None if self.simulated else {
                            axis: self.mesh.get_group(axis).group_name
                            for axis in self.mesh.mesh_dim_names})
                fn = c.compiled[stage]
            built = c.runners[rank] = (mod, fn.bind(mod))
        return built[1]

    # -- running ---------------------------------------------------------------------
    def run_rank(self, c, rank: int, micro: list[list], state: dict | None = None):
        """Run rank ``rank``'s stage on every microbatch in turn; sends do not wait for the
        receiver, so stage s works on microbatch i while stage s+1 works on i-1 (GPipe).
        The last stage returns its flat outputs (microbatches joined on dim 0), others None."""
        mod = self.runner(c, rank, micro[0])
        stage = self.stage_of(rank)
        program = c.programs[stage]
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # inference only (per thread: simulated ranks are
        try:                               # threads); torch.no_grad() minus its frames
            if len(micro) == 1 and c.tensor_inputs and not program.state_inputs:
                outs = [mod(*micro[0])]   # what bind_inputs gives here
            else:
                outs = [mod(*bind_inputs(flat, program, state or {}, i, len(micro)))
                        for i, flat in enumerate(micro)]
        finally:
            torch._C._set_grad_enabled(grad)
        if stage != self.last_stage:
            return None
        if len(outs) == 1:
            return outs[0] if isinstance(outs[0], list) else list(outs[0])
        return [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
                for parts in zip(*outs)]

    @staticmethod
    def share_output(c, backend, out, microbatches: int):
        """Real mesh: the last stage sends the output to the ranks of every earlier stage that
        share its other coordinates, so every rank returns the full output."""
        n = backend.mesh.axis_size(PP)
        if n == 1:
            return out
        if backend.axis_index(PP) == n - 1:
            for dst in range(n - 1):
                for x in out:
                    if isinstance(x, torch.Tensor):
                        backend.send(x.contiguous(), PP, dst)
            return out
        out_node = next(x for x in c.programs[-1].graph.nodes if x.op == "output")
        result = []
        for a in out_node.args[0]:
            if isinstance(a, fx.Node):
                v = a.meta["val"]
                shape = [v.shape[0] * microbatches, *v.shape[1:]] if v.dim() else []
                result.append(backend.recv(shape, v.dtype,
                                           torch.device(backend.mesh.device_type), PP, n - 1))
            else:
                result.append(a)
        return result

    def run(self, c, micro: list[list], state=None) -> list:
        """The last stage's flat outputs, on every rank; ``state(rank)`` -> that rank's state."""
        if self.simulated:
            world = self.world if self.world is not None else self._world()
            for r in range(self.spec.world_size):
                self.runner(c, r, micro[0])
            results = world.run(lambda r: self.run_rank(
                c, r, micro, state(r) if state is not None else None))
            return next(r for r in results if r is not None)
        backend = self.backend()
        token = CURRENT_BACKEND.set(backend)   # use_backend(backend), minus its generator's frames
        try:
            out = self.run_rank(c, backend.rank, micro,
                                state(backend.rank) if state is not None else None)
            if self.last_stage:
                out = self.share_output(c, backend, out, len(micro))
            backend.flush()  # a failed send surfaces in this forward, not a later one
        finally:
            CURRENT_BACKEND.reset(token)
        return out

    def on_ranks(self, driver, bind: list[tuple] = ()) -> list:
        """``driver(rank)`` on every rank this process runs, each with its backend current;
        returns their results in rank order. ``bind``: ``(Compiled, example flat inputs)``
        whose runners are built (or compiled) first, here, not in the ranks' threads."""
        ranks = self.ranks()
        for c, flat in bind:
            for r in ranks:
                self.runner(c, r, flat)
        if self.simulated:
            return self._world().run(driver)
        backend = self.backend()
        with use_backend(backend):
            out = driver(backend.rank)
            backend.flush()   # a failed send surfaces here, not in a later forward
        return [out]

    def _world(self):
        if self.world is None:
            from .simulated import SimulatedWorld
            self.world = SimulatedWorld(self.spec)
        return self.world

    def close(self) -> None:
        """Drop the generation state and stop the simulated mesh's threads."""
        self.kv_caches = None
        if self.world is not None:
            self.world.close()
            self.world = None
