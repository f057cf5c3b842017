"""Rank programs as ranks run them: Inductor-compiled (``parallelize(..., compile=True)``)
or the eager runner.

Every rank of a pipeline stage runs the same graph; only the weights differ (and the rank's
coordinate, which the ``fxshard::*`` ops read from the runtime backend at run time). So each
stage is compiled **once**, with its weights turned from attributes back into leading inputs,
and every rank calls that one compiled function with its own weight slices::

    before (rank module):  forward(self, input_ids)
                               w = self.model.layers.0.mlp.up_proj.weight
                               ...; all_reduce = torch.ops.fxshard.all_reduce.default(mm, 'tp', 2)
    after (compiled):      forward(model_layers_0_mlp_up_proj_weight, ..., input_ids)
                               -> Inductor kernels; fxshard::* stay extern calls (fake impls),
                                  except what the post-emit passes rewrite
                                  (:mod:`fxshard.passes.post_emit`, ``INDUCTOR``): collectives
                                  on a torch DeviceMesh become torch's functional collectives,
                                  CPU attention with aten's contract aten's flash attention

The compile runs in the calling thread before any rank runs (collectives never execute while
compiling); inputs are static: one compiled function per input signature, like the programs.
Inductor on CPU needs a C++ compiler (``g++``/``clang++``) at run time.

Eager programs (``compile=False``) run the same way without Inductor (:func:`eager_stage`):
one plain GraphModule per stage with the weights as leading inputs, bound to each rank's
slices once, after the post-emit passes' ``EAGER`` list. The rank module's ``forward`` reads
every weight through ``nn.Module`` attributes on every call
(``getattr(self.model.layers, "0").self_attn.q_proj.weight``: 5-10 us each on a small CPU:
1.5-3 ms per forward for an 8B's ~290 weights); the bound stage reads none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .ops.library import direct_kernel
from .passes import post_emit
from .passes.emit import Program
from .passes.pipeline import run_passes
from .runtime.aten_bindings import aten_binding

__all__ = ["CompiledStage", "compile_stage", "compile_graph", "direct_forward", "eager_stage",
           "inductor_graph"]


def _weights_as_inputs(program: Program) -> tuple[fx.GraphModule, list[str]]:
    """The stage graph with every ``get_attr`` weight as a leading placeholder."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    first = next(iter(graph.nodes))
    names: list[str] = []
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        name = node.target.replace(".", "_")   # "0_weight" (nn.Sequential) is no identifier
        with graph.inserting_before(first):
            ph = graph.placeholder(name if name.isidentifier() else "w_" + name)
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
    module: fx.GraphModule | None = None   # the graph its fn runs (or compiles): its .code

    def bind(self, module: fx.GraphModule):
        """A callable running the compiled stage with ``module``'s (one rank's) weights."""
        weights = _weights_of(module, self.names)
        fn = self.fn

        def run(*inputs):
            return fn(*weights, *inputs)
        return run


def _stand_in(i: int, op: torch._ops.OpOverload):
    """A function FX's code generator names ``fxshard_op_<i>`` (a global of the generated
    code, where ``op`` itself would be spelled ``torch.ops.<ns>.<op>.<overload>``)."""
    def stand_in(*args, **kwargs):
        raise AssertionError(f"fxshard.compile: the stand-in for {op} was called")
    stand_in.__name__ = stand_in.__qualname__ = f"fxshard_op_{i}"
    return stand_in


def direct_forward(gm: fx.GraphModule):
    """``gm``'s generated forward with every ``torch.ops.<ns>.<op>.<overload>(...)`` call
    made through the op's Python binding where one reaches exactly that overload
    (``fxshard.runtime.aten_bindings``: ``torch.mul`` for ``aten.mul.Tensor``), else through
    the overload's dispatcher entry (``OpOverload._op``: all that ``OpOverload.__call__`` does,
    minus one Python frame per node), and fxshard's own ops straight to their Python kernels
    (``fxshard.ops.library.direct_kernel``). The code is generated from a copy of the graph
    whose op nodes call stand-ins, each one global name, and the generated code's globals then
    bind those names to the callables: every call is one global lookup, as in FX's own code."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    callee: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            op = node.target
            if op not in callee:
                callee[op] = (_stand_in(len(callee), op),
                              direct_kernel(op) or aten_binding(op) or op._op)
            node.target = callee[op][0]
    bound = {id(stand_in): fn for stand_in, fn in callee.values()}
    code = graph.python_code(root_module="self")
    scope = {name: bound.get(id(obj), obj) for name, obj in code.globals.items()}
    assert len(bound) == sum(id(obj) in bound for obj in code.globals.values()), gm
    exec(compile(code.src, f"<fxshard eager {type(gm).__name__}>", "exec"), scope)
    forward = scope["forward"]
    return lambda *args: forward(None, *args)


def eager_stage(program: Program) -> CompiledStage:
    """``program`` as an uncompiled function with its weights as leading inputs (built once
    per program and shared by the ranks of its stage; :meth:`CompiledStage.bind` gives each
    rank its callable): the rank GraphModule's code, without its per-call weight reads,
    ``nn.Module.__call__`` and ``OpOverload.__call__`` frames, after the post-emit passes'
    ``EAGER`` list (:mod:`fxshard.passes.post_emit`: CPU attention without ``lse`` where
    nothing reads it, CPU attention with aten's contract as aten's flash kernel, all-reduces
    that sum into their dead inputs)."""
    if program.eager is None:
        gm, names = _weights_as_inputs(program)
        gm = run_passes(gm, post_emit.EAGER, post_emit.PostEmitCtx())
        program.eager = CompiledStage(fn=direct_forward(gm), names=names, module=gm)
    return program.eager


def inductor_graph(program: Program, *, groups: dict[str, str] | None = None
                   ) -> tuple[fx.GraphModule, list[str]]:
    """The graph :func:`compile_stage` hands Inductor (runnable eagerly too): ``program``
    with its weights as leading inputs (their names second), after the post-emit passes'
    ``INDUCTOR`` list (:mod:`fxshard.passes.post_emit`: CPU attention without ``lse`` and,
    where aten's contract holds, as aten's flash attention; with ``groups``, collectives on
    those axes as torch's functional collectives)."""
    gm, names = _weights_as_inputs(program)
    gm = run_passes(gm, post_emit.INDUCTOR, post_emit.PostEmitCtx(groups=groups))
    return gm, names


def compile_stage(program: Program, example_module: fx.GraphModule,
                  example_inputs: list[torch.Tensor], *,
                  groups: dict[str, str] | None = None) -> CompiledStage:
    """Compile ``program`` with Inductor, on the weights of one of its ranks
    (``example_module``) and that rank's inputs (no collective runs while compiling).
    ``groups`` (mesh axis -> torch.distributed group name, real meshes only): lower the
    stage's collectives on those axes to torch's functional collectives
    (:func:`fxshard.passes.post_emit.native_collectives_pass`); without it every collective
    stays an ``fxshard::*`` op (the simulated mesh). The graph: :func:`inductor_graph`."""
    gm, names = inductor_graph(program, groups=groups)
    example = [*_weights_of(example_module, names), *example_inputs]
    return CompiledStage(fn=compile_graph(gm, example), names=names, module=gm)


def _unbacked_mode(gm: fx.GraphModule):
    """The fake mode whose shape environment holds ``gm``'s sizes known only at run time
    (``nonzero``'s ``u0``), or None when it has none."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            return val.fake_mode
    return None


def check_static_inputs(gm: fx.GraphModule, where: str) -> None:
    """A NotImplementedError for a program whose inputs have a size known only at run time
    (a training backward's saved rows of one MoE expert picked by ``torch.where(mask)``):
    :func:`compile_graph` compiles for its example inputs' sizes, which the next step's
    routing changes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and \
                free_unbacked_symbols(val):
            raise NotImplementedError(
                f"{where}: compile=True: this program's input {node.name} {tuple(val.shape)} "
                f"has a size known only when it runs (torch.where(mask) / nonzero, e.g. the "
                f"tokens of one MoE expert saved for the backward), which Inductor would fix "
                f"to the first step's. Use compile=False for this model (the eager programs "
                f"handle it)")


def compile_graph(gm: fx.GraphModule, example: list[torch.Tensor]):
    """Inductor's function for ``gm`` (tensor inputs only, static shapes as ``example``'s;
    nothing runs, so no collective executes): a stage with its weights as inputs, or a
    training rank program (``fxshard.training``: forward and backward, each compiled once
    and called by every rank with its own weights, saved values and gradients)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    # a fake mode with a shape env, as dynamo would give: Inductor's FX graph cache needs one
    # (without it every process recompiles the same stage from scratch)
    fake = _unbacked_mode(gm) or FakeTensorMode(shape_env=ShapeEnv())
    with torch.no_grad(), tracing(TracingContext(fake)):
        return compile_fx(gm, [fake.from_tensor(x, static_shapes=True) for x in example])
