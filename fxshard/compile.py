"""Inductor-compiled rank programs (``parallelize(..., compile=True)``).

Every rank of a pipeline stage runs the same graph; only the weights differ (and the rank's
coordinate, which the ``fxshard::*`` ops read from the runtime backend at run time). So each
stage is compiled **once**, with its weights turned from attributes back into leading inputs,
and every rank calls that one compiled function with its own weight slices::

    before (rank module):  forward(self, input_ids)
                               w = self.model.layers.0.mlp.up_proj.weight
                               ...; all_reduce = torch.ops.fxshard.all_reduce.default(mm, 'tp', 2)
    after (compiled):      forward(model_layers_0_mlp_up_proj_weight, ..., input_ids)
                               -> Inductor kernels; fxshard::* stay extern calls (fake impls)

The compile runs in the calling thread before any rank runs (collectives never execute while
compiling); inputs are static: one compiled function per input signature, like the programs.
Inductor on CPU needs a C++ compiler (``g++``/``clang++``) at run time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .passes.emit import Program

__all__ = ["CompiledStage", "compile_stage"]


def _weights_as_inputs(program: Program) -> tuple[fx.GraphModule, list[str]]:
    """The stage graph with every ``get_attr`` weight as a leading placeholder."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    first = next(iter(graph.nodes))
    names: list[str] = []
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        with graph.inserting_before(first):
            ph = graph.placeholder(node.target.replace(".", "_"))
        ph.meta.update(node.meta)
        node.replace_all_uses_with(ph)
        graph.erase_node(node)
        names.append(node.target)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, class_name=f"Stage{program.stage}"), names


def _weights_of(module: fx.GraphModule, names: list[str]) -> list[torch.Tensor]:
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    return [state[n] for n in names]


@dataclass
class CompiledStage:
    """One stage's Inductor-compiled function and the order of its weight inputs."""

    fn: object
    names: list

    def bind(self, module: fx.GraphModule):
        """A callable running the compiled stage with ``module``'s (one rank's) weights."""
        weights = _weights_of(module, self.names)
        fn = self.fn

        def run(*inputs):
            return fn(*weights, *inputs)
        return run


def compile_stage(program: Program, example_module: fx.GraphModule,
                  example_inputs: list[torch.Tensor]) -> CompiledStage:
    """Compile ``program`` with Inductor, on the weights of one of its ranks
    (``example_module``) and that rank's inputs (no collective runs while compiling)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    gm, names = _weights_as_inputs(program)
    example = [*_weights_of(example_module, names), *example_inputs]
    # a fake mode with a shape env, as dynamo would give: Inductor's FX graph cache needs one
    # (without it every process recompiles the same stage from scratch)
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with torch.no_grad(), tracing(TracingContext(fake)):
        fn = compile_fx(gm, [fake.from_tensor(x, static_shapes=True) for x in example])
    return CompiledStage(fn=fn, names=names)
