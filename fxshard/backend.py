"""``torch.compile(model, backend=fxshard.backend(mesh))``: the same passes behind compile.

Dynamo hands the backend an FX graph of the model and example inputs; the backend runs
``fxshard.parallelize`` on that graph (as a module) and returns a callable that runs every
rank and gives back the global result, like ``ParallelModule``.
"""
from __future__ import annotations

import torch

__all__ = ["backend"]


def backend(mesh, **options):
    """A ``torch.compile`` backend that parallelizes the captured graph over ``mesh``.

    ``options`` are those of :func:`fxshard.parallelize` (``plan``, ``sequence_parallel`` ...).
    """
    from .api import parallelize
    from .mesh import mesh_spec
    mesh_spec(mesh, where="fxshard.backend")

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        pm = parallelize(gm, mesh, example_inputs=tuple(example_inputs), **options)

        def run(*args):
            out = pm(*args)
            return out if isinstance(out, (tuple, list)) else (out,)
        run.parallel_module = pm
        return run

    return compile_fn
