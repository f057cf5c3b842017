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
                                  except all-reduce / all-gather on a torch DeviceMesh, lowered
                                  to torch's functional collectives (:func:`_native_collectives`)

The compile runs in the calling thread before any rank runs (collectives never execute while
compiling); inputs are static: one compiled function per input signature, like the programs.
Inductor on CPU needs a C++ compiler (``g++``/``clang++``) at run time.

Eager programs (``compile=False``) run the same way without Inductor (:func:`eager_stage`):
one plain GraphModule per stage with the weights as leading inputs, bound to each rank's
slices once. The rank module's ``forward`` reads every weight through ``nn.Module``
attributes on every call (``getattr(self.model.layers, "0").self_attn.q_proj.weight``: 5-10 us
each on a small CPU: 1.5-3 ms per forward for an 8B's ~290 weights); the bound stage reads
none.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .kernels.attention_out import attention_out
from .passes.emit import Program
from .runtime.aten_bindings import aten_binding
from .runtime.library import direct_kernel
from .runtime.ops import all_reduce_consuming

__all__ = ["CompiledStage", "compile_stage", "eager_stage"]


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


def _direct_forward(gm: fx.GraphModule):
    """``gm``'s generated forward with every ``torch.ops.<ns>.<op>.<overload>(...)`` call
    made through the op's Python binding where one reaches exactly that overload
    (``fxshard.runtime.aten_bindings``: ``torch.mul`` for ``aten.mul.Tensor``), else through
    the overload's dispatcher entry (``OpOverload._op``: all that ``OpOverload.__call__`` does,
    minus one Python frame per node), and fxshard's own ops straight to their Python kernels
    (``fxshard.runtime.library.direct_kernel``)."""
    code = gm.graph.python_code(root_module="self")
    src, scope = code.src, dict(code.globals)
    targets = {n.target for n in gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    for i, op in enumerate(sorted(targets, key=lambda t: -len(fx.node._get_qualified_name(t)))):
        name = f"_fxshard_op_{i}"
        src = src.replace(fx.node._get_qualified_name(op) + "(", name + "(")
        scope[name] = direct_kernel(op) or aten_binding(op) or op._op
    exec(compile(src, f"<fxshard eager {type(gm).__name__}>", "exec"), scope)
    forward = scope["forward"]
    return lambda *args: forward(None, *args)


def _fresh_and_dead(node: fx.Node, user: fx.Node) -> bool:
    """Whether ``node``'s value is a tensor of its own (made by an op whose schema returns no
    alias of an input) that ``user`` is the only reader of, so ``user`` may overwrite it."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return (len(returns) == 1 and returns[0].alias_info is None
            and list(node.users) == [user])


def _consume_dead_inputs(gm: fx.GraphModule) -> int:
    """Point every ``fxshard::all_reduce`` whose input is fresh and read by nothing else (a
    row-parallel linear's output) at :func:`all_reduce_consuming`: no copy of the input."""
    n = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.fxshard.all_reduce.default
                and _fresh_and_dead(node.args[0], node)):
            node.target = all_reduce_consuming
            n += 1
    gm.recompile()
    return n


def _attention_out_only(gm: fx.GraphModule) -> int:
    """Point every CPU ``fxshard::attention`` whose ``lse`` nobody reads and whose ``out`` is
    only transposed back to ``[B, S, H, D]`` at ``fxshard::attention_out``
    (:mod:`fxshard.kernels.attention_out`: the same values, no ``lse``, ``out`` stored as
    ``[B, S, H, D]``: the transpose becomes contiguous, the reshape after it a view). Only
    strides change; a graph with ``as_strided`` (which reads strides) is left alone."""
    graph = gm.graph
    if any(n.target is torch.ops.aten.as_strided.default for n in graph.nodes):
        return 0
    n = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.fxshard.attention.default or node.kwargs:
            continue
        q = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if (q is None or q.device.type != "cpu" or len(node.args) not in (8, 9)
                or not node.users or any(u.target is not operator.getitem or u.args[1] != 0
                                         for u in node.users)):
            continue
        readers = [r for u in node.users for r in u.users]
        if not all(r.target is torch.ops.aten.transpose.int and len(r.args) == 3
                   and sorted(d % 4 for d in r.args[1:]) == [1, 2] for r in readers):
            continue
        node.target = attention_out.default
        for u in list(node.users):
            u.replace_all_uses_with(node)
            graph.erase_node(u)
        n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


def eager_stage(program: Program) -> CompiledStage:
    """``program`` as an uncompiled function with its weights as leading inputs (built once
    per program and shared by the ranks of its stage; :meth:`CompiledStage.bind` gives each
    rank its callable): the rank GraphModule's code, without its per-call weight reads,
    ``nn.Module.__call__`` and ``OpOverload.__call__`` frames, with all-reduces that sum
    into their dead inputs (:func:`fxshard.runtime.ops.all_reduce_consuming`) and CPU
    attention without ``lse`` where nothing reads it (:func:`_attention_out_only`)."""
    if program.eager is None:
        gm, names = _weights_as_inputs(program)
        _attention_out_only(gm)
        _consume_dead_inputs(gm)
        program.eager = CompiledStage(fn=_direct_forward(gm), names=names, module=gm)
    return program.eager


def _native_collectives(gm: fx.GraphModule, groups: dict[str, str]) -> int:
    """Lower every ``fxshard::all_reduce`` / ``fxshard::all_gather`` on an axis of ``groups``
    (mesh axis -> torch.distributed group name) to torch's functional collectives, which
    Inductor lowers natively (an all-reduce of a dead buffer in place, no Python frame)::

        before: all_reduce = torch.ops.fxshard.all_reduce.default(mm, 'tp', 2)
        after:  all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', '1')
                wait = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
        before: all_gather = torch.ops.fxshard.all_gather.default(emb, 2, 'tp', 2)
        after:  gathered = ..._c10d_functional.all_gather_into_tensor.default(emb, 2, '1')
                wait = ...wait_tensor.default(gathered);  split = aten.split.Tensor(wait, 2)
                all_gather = aten.cat.default([split[0], split[1]], 2)

    The same sums and concatenations in group-rank order, which ``DistributedBackend``
    checked is coordinate order."""
    c10d, graph, n = torch.ops._c10d_functional, gm.graph, 0
    for node in list(graph.nodes):
        if node.target is torch.ops.fxshard.all_reduce.default and node.args[1] in groups:
            x, axis, _ = node.args
            with graph.inserting_before(node):
                out = graph.call_function(c10d.wait_tensor.default, (graph.call_function(
                    c10d.all_reduce.default, (x, "sum", groups[axis])),))
        elif (node.target is torch.ops.fxshard.all_gather.default and node.args[2] in groups
              and isinstance(node.args[0].meta.get("val"), torch.Tensor)):
            x, dim, axis, size = node.args
            rows = x.meta["val"].shape[0]
            with graph.inserting_before(node):
                out = graph.call_function(c10d.wait_tensor.default, (graph.call_function(
                    c10d.all_gather_into_tensor.default, (x, size, groups[axis])),))
                if dim % x.meta["val"].dim() != 0:
                    split = graph.call_function(torch.ops.aten.split.Tensor, (out, rows))
                    out = graph.call_function(torch.ops.aten.cat.default, (
                        [graph.call_function(operator.getitem, (split, i))
                         for i in range(size)], dim))
        else:
            continue
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


def compile_stage(program: Program, example_module: fx.GraphModule,
                  example_inputs: list[torch.Tensor], *,
                  groups: dict[str, str] | None = None) -> CompiledStage:
    """Compile ``program`` with Inductor, on the weights of one of its ranks
    (``example_module``) and that rank's inputs (no collective runs while compiling).
    ``groups`` (mesh axis -> torch.distributed group name, real meshes only): lower the
    stage's all-reduces and all-gathers on those axes to torch's functional collectives
    (:func:`_native_collectives`); without it every collective stays an ``fxshard::*`` op
    (the simulated mesh)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    gm, names = _weights_as_inputs(program)
    _attention_out_only(gm)
    if groups:
        _native_collectives(gm, groups)
    example = [*_weights_of(example_module, names), *example_inputs]
    # a fake mode with a shape env, as dynamo would give: Inductor's FX graph cache needs one
    # (without it every process recompiles the same stage from scratch)
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with torch.no_grad(), tracing(TracingContext(fake)):
        fn = compile_fx(gm, [fake.from_tensor(x, static_shapes=True) for x in example])
    return CompiledStage(fn=fn, names=names, module=gm)
