"""Helpers for tests: run a function sharded on a simulated mesh and read every rank's block.

``run_sharded(fn, inputs, mesh, in_specs)`` traces ``fn``, gives its inputs the placements
``in_specs`` (one spec per input), runs the pass pipeline with outputs left where the rules
put them, runs every rank, and returns each rank's local outputs with the output specs. The
property the rule tests check with it: on every rank, the local result is that rank's block
of the global result (for a ``Partial`` output: the blocks sum to it over the axis).
"""
from __future__ import annotations

import torch

from .runtime.program_cache import compile_program
from .mesh import MeshSpec
from .passes import PassCtx
from .passes.emit import build_rank_module
from .placement import Partial, local_block

__all__ = ["run_sharded", "assemble_check"]


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def run_sharded(fn, inputs: tuple, mesh: MeshSpec, in_specs: list, **options):
    """Per-rank local outputs (a list over ranks of lists of tensors) and the output specs."""
    from .runtime.simulated import SimulatedWorld
    ctx = PassCtx(mesh=mesh, input_specs=dict(enumerate(in_specs)), keep_output_placement=True,
                  **options)
    module = fn if isinstance(fn, torch.nn.Module) else _Fn(fn)
    c = compile_program(module, tuple(inputs), {}, ctx)
    out_node = next(n for n in c.program.graph.nodes if n.op == "output")
    flat_out = torch.utils._pytree.tree_leaves(out_node.args[0])
    specs = [n.meta.get("fxshard_spec") for n in flat_out]
    values = {k: v for k, v in module.state_dict().items()}
    values.update({k: v for k, v in c.traced.constants.items() if v is not None})
    mods = [build_rank_module(c.program, r, mesh, values, torch.device("cpu"))
            for r in range(mesh.world_size)]
    with SimulatedWorld(mesh) as world:
        results = world.run(lambda r: mods[r](*inputs))
    return [list(torch.utils._pytree.tree_leaves(r)) for r in results], specs, c


def assemble_check(global_out: torch.Tensor, locals_: list, spec: tuple, mesh: MeshSpec, *,
                   rtol=1e-5, atol=1e-5) -> None:
    """Assert every rank holds its block of ``global_out`` under ``spec`` (partials summed)."""
    partial_axes = [a for a, n, p in zip(mesh.axis_names, mesh.shape, spec)
                    if n > 1 and isinstance(p, Partial)]
    for r in range(mesh.world_size):
        nonpartial = tuple(p if not isinstance(p, Partial) else torch.distributed.tensor.Replicate()
                           for p in spec)
        want = local_block(global_out, nonpartial, mesh, r)
        got = locals_[r]
        if partial_axes:
            group = {r}
            for a in partial_axes:
                group = {g for x in group for g in mesh.axis_group(x, a)}
            got = sum(locals_[g] for g in sorted(group))
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"rank {r}, spec {spec}: {m}")
