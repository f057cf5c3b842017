"""Run a ParallelModule's rank programs: microbatches, pipeline output sharing, state binding.

``run(pm, compiled, micro, state)`` runs every rank of a simulated mesh (each a thread of this
process) or this process's rank of a real one, and returns the last stage's flat outputs, on
every rank. A rank program's inputs are the user's tensors (one microbatch at a time) followed
by its state inputs (``fxshard_state`` placeholders: the KV caches of text generation and their
write/read positions), which ``state(rank)`` gives as a dict; a state tensor with the batch on
dim 0 (a cache, the read lengths) is cut into the same microbatches as the inputs (views: an
in-place cache write lands in the rank's cache).
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from ..mesh import is_simulated

__all__ = ["run", "state_keys"]


_STATE_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> its keys


def state_keys(graph: fx.Graph) -> list[str]:
    """The state inputs a program takes after the user's tensors, in order (read from the
    graph once: a program's graph does not change after it is built)."""
    keys = _STATE_KEYS.get(graph)
    if keys is None:
        keys = _STATE_KEYS[graph] = [
            n.meta["fxshard_state"] for n in graph.nodes
            if n.op == "placeholder" and n.meta.get("fxshard_state") is not None]
    return keys


def _inputs(flat: list, keys: list[str], state: dict, index: int, count: int) -> list:
    args = [x for x in flat if isinstance(x, torch.Tensor)]
    for key in keys:
        t = state[key]
        if count > 1 and t.dim() and key != "cache_write_pos":
            t = t.narrow(0, index * (t.shape[0] // count), t.shape[0] // count)
        args.append(t)
    return args


def run_rank(pm, c, rank: int, micro: list[list], state: dict | None = None):
    """Run rank ``rank``'s stage on every microbatch in turn; sends do not wait for the
    receiver, so stage s works on microbatch i while stage s+1 works on i-1 (GPipe)."""
    mod = pm._runner(c, rank, micro[0])
    program = c.programs[pm.stage_of(rank)]
    keys = state_keys(program.graph)
    with torch.no_grad():  # inference only (per thread: simulated ranks are threads)
        outs = [mod(*_inputs(flat, keys, state or {}, i, len(micro)))
                for i, flat in enumerate(micro)]
    if pm.stage_of(rank) != pm.spec.axis_size("pp") - 1:
        return None
    if len(outs) == 1:
        return list(outs[0])
    return [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
            for parts in zip(*outs)]


def share_output(c, backend, out, microbatches: int):
    """Real mesh: the last stage sends the output to the ranks of every earlier stage that
    share its other coordinates, so every rank returns the full output (as the seed's
    ``redistribute_output``)."""
    n = backend.mesh.axis_size("pp")
    if n == 1:
        return out
    if backend.axis_index("pp") == n - 1:
        for dst in range(n - 1):
            for x in out:
                if isinstance(x, torch.Tensor):
                    backend.send(x.contiguous(), "pp", dst)
        return out
    out_node = next(x for x in c.programs[-1].graph.nodes if x.op == "output")
    result = []
    for a in out_node.args[0]:
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            shape = [v.shape[0] * microbatches, *v.shape[1:]] if v.dim() else []
            result.append(backend.recv(shape, v.dtype, torch.device(backend.mesh.device_type),
                                       "pp", n - 1))
        else:
            result.append(a)
    return result


def run(pm, c, micro: list[list], state=None) -> list:
    """The last stage's flat outputs, on every rank; ``state(rank)`` -> that rank's state."""
    def state_of(rank):
        return state(rank) if state is not None else None

    if is_simulated(pm.mesh):
        from .simulated import SimulatedWorld
        if pm._world is None:
            pm._world = SimulatedWorld(pm.spec)
        for r in range(pm.spec.world_size):
            pm._runner(c, r, micro[0])
        results = pm._world.run(lambda r: run_rank(pm, c, r, micro, state_of(r)))
        return next(r for r in results if r is not None)
    from .context import use_backend
    from .distributed import backend_for
    backend = backend_for(pm.mesh)
    with use_backend(backend):
        out = run_rank(pm, c, backend.rank, micro, state_of(backend.rank))
        out = share_output(c, backend, out, len(micro))
        backend.flush()  # a failed send surfaces in this forward, not a later one
    return out
