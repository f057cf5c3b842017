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
                                  except collectives on a torch DeviceMesh, lowered to torch's
                                  functional collectives (:func:`_native_collectives`), and
                                  CPU attention with aten's contract, lowered to aten's flash
                                  attention (:func:`_aten_attention`)

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

from .ops.attention import attention_out
from .ops.collectives import all_reduce_consuming
from .ops.library import direct_kernel
from .passes.emit import Program
from .runtime.aten_bindings import aten_binding

__all__ = ["CompiledStage", "compile_stage", "eager_stage", "inductor_graph"]


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
    into their dead inputs (:func:`fxshard.runtime.ops.all_reduce_consuming`), CPU
    attention without ``lse`` where nothing reads it (:func:`_attention_out_only`), and CPU
    attention with aten's contract as aten's flash kernel (:func:`_aten_attention`: what the
    single-device model's SDPA runs, without fxshard's per-call checks)."""
    if program.eager is None:
        gm, names = _weights_as_inputs(program)
        _attention_out_only(gm)
        _aten_attention(gm)
        _consume_dead_inputs(gm)
        program.eager = CompiledStage(fn=_direct_forward(gm), names=names, module=gm)
    return program.eager


def _dim0_first(graph: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    """``x`` with ``dim`` moved to the front, contiguous (c10d's collectives split and
    concatenate along dim 0 of contiguous memory): ``x`` itself for dim 0."""
    if dim == 0:
        return x
    moved = graph.call_function(torch.ops.aten.movedim.int, (x, dim, 0))
    return graph.call_function(torch.ops.aten.clone.default, (moved,),
                               {"memory_format": torch.contiguous_format})


def _lower_collective(graph: fx.Graph, node: fx.Node, group: str) -> fx.Node:
    """The functional-collective subgraph (inserted before ``node``) computing ``node``'s
    ``fxshard::*`` collective over the torch.distributed group ``group``."""
    c10d, aten, op, x = torch.ops._c10d_functional, torch.ops.aten, node.target, node.args[0]

    def wait(n: fx.Node) -> fx.Node:
        return graph.call_function(c10d.wait_tensor.default, (n,))

    def blocks(n: fx.Node, rows: int, size: int) -> list[fx.Node]:
        split = graph.call_function(aten.split.Tensor, (n, rows))
        return [graph.call_function(operator.getitem, (split, i)) for i in range(size)]

    if op is torch.ops.fxshard.all_reduce.default:
        return wait(graph.call_function(c10d.all_reduce.default, (x, "sum", group)))
    ndim = x.meta["val"].dim()
    if op is torch.ops.fxshard.all_gather.default:
        _, dim, _, size = node.args
        out = wait(graph.call_function(c10d.all_gather_into_tensor.default, (x, size, group)))
        if dim % ndim == 0:
            return out
        return graph.call_function(aten.cat.default,
                                   (blocks(out, x.meta["val"].shape[0], size), dim))
    if op is torch.ops.fxshard.reduce_scatter.default:
        _, dim, _, size = node.args
        dim %= ndim
        out = wait(graph.call_function(c10d.reduce_scatter_tensor.default,
                                       (_dim0_first(graph, x, dim), "sum", size, group)))
        return out if dim == 0 else graph.call_function(aten.movedim.int, (out, 0, dim))
    _, split_dim, concat_dim, _, size = node.args
    split_dim, concat_dim = split_dim % ndim, concat_dim % ndim
    rows = x.meta["val"].shape[split_dim] // size
    out = wait(graph.call_function(c10d.all_to_all_single.default, (
        _dim0_first(graph, x, split_dim), [rows] * size, [rows] * size, group)))
    if split_dim == 0 and concat_dim == 0:
        return out
    parts = blocks(out, rows, size)
    if split_dim:
        parts = [graph.call_function(aten.movedim.int, (b, 0, split_dim)) for b in parts]
    return graph.call_function(aten.cat.default, (parts, concat_dim))


_LOWERED_COLLECTIVES = (torch.ops.fxshard.all_reduce.default, torch.ops.fxshard.all_gather.default,
                        torch.ops.fxshard.reduce_scatter.default,
                        torch.ops.fxshard.all_to_all.default)


def _native_collectives(gm: fx.GraphModule, groups: dict[str, str]) -> int:
    """Lower every ``fxshard::all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
    ``all_to_all`` on an axis of ``groups`` (mesh axis -> torch.distributed group name) to
    torch's functional collectives + ``wait_tensor``, which Inductor lowers natively (an
    all-reduce of a dead buffer in place, no Python frame). c10d's collectives work on dim 0
    of contiguous memory; another dim is moved there and back (as ``DistributedBackend``
    does)::

        before: all_reduce = torch.ops.fxshard.all_reduce.default(mm, 'tp', 2)
        after:  all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', '1')
                wait = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
        before: all_gather = torch.ops.fxshard.all_gather.default(emb, 2, 'tp', 2)
        after:  gathered = ..._c10d_functional.all_gather_into_tensor.default(emb, 2, '1')
                wait = ...wait_tensor.default(gathered);  split = aten.split.Tensor(wait, 2)
                all_gather = aten.cat.default([split[0], split[1]], 2)
        before: reduce_scatter = torch.ops.fxshard.reduce_scatter.default(mm, 1, 'tp', 2)
        after:  movedim = aten.movedim.int(mm, 1, 0);  clone = aten.clone.default(movedim, ...)
                rs = ..._c10d_functional.reduce_scatter_tensor.default(clone, 'sum', 2, '1')
                wait = ...wait_tensor.default(rs);  reduce_scatter = aten.movedim.int(wait, 0, 1)
        before: all_to_all = torch.ops.fxshard.all_to_all.default(x, 2, 1, 'ulysses_cp', 2)
        after:  (x's dim 2 moved to the front) a2a = ..._c10d_functional.all_to_all_single
                    .default(clone, [4, 4], [4, 4], '2');  wait = ...wait_tensor.default(a2a)
                split = aten.split.Tensor(wait, 4); each block's dim 0 moved back to 2;
                all_to_all = aten.cat.default([movedim_1, movedim_2], 1)

    The same sums and concatenations in group-rank order, which ``DistributedBackend``
    checked is coordinate order."""
    graph, n = gm.graph, 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target not in _LOWERED_COLLECTIVES
                or node.kwargs or len(node.args) != len(node.target._schema.arguments)
                or not isinstance(node.args[0], fx.Node)
                or (node.target is not torch.ops.fxshard.all_reduce.default
                    and not isinstance(node.args[0].meta.get("val"), torch.Tensor))):
            continue
        axis = node.args[1] if node.target is torch.ops.fxshard.all_reduce.default else \
            node.args[-2]
        if axis not in groups:
            continue
        with graph.inserting_before(node):
            out = _lower_collective(graph, node, groups[axis])
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _flash_call(node: fx.Node) -> tuple[tuple, dict] | None:
    """The args and kwargs of aten's CPU flash attention that compute exactly what the
    ``fxshard::attention`` / ``attention_out`` at ``node`` computes, or None where the op's
    contract goes beyond aten's: a soft-cap, a causal mask with unequal (or run-time)
    ``q_offset``/``kv_offset`` (aten's causal diagonal is the top-left one, i.e. equal
    offsets), a bool mask or one of another dtype (aten's CPU kernel takes an additive mask of
    q's dtype), dtypes other than float32/64 (fxshard computes those in float32), an empty
    query or key length (aten's kernel dies of SIGFPE), non-CPU tensors."""
    from torch.fx.operator_schemas import normalize_function
    args = normalize_function(node.target, node.args, node.kwargs,
                              normalize_to_only_use_kwargs=True)
    if args is None:
        return None
    a = args.kwargs
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        return None
    q_val, k_val = q.meta.get("val"), k.meta.get("val")
    if not (isinstance(q_val, torch.Tensor) and isinstance(k_val, torch.Tensor)
            and q_val.device.type == "cpu" and q_val.dtype in (torch.float32, torch.float64)
            and isinstance(q_val.shape[2], int) and isinstance(k_val.shape[2], int)
            and q_val.shape[2] > 0 and k_val.shape[2] > 0):
        return None
    if a.get("softcap", 0.0) or not isinstance(a["causal"], bool):
        return None
    offsets = (a["q_offset"], a["kv_offset"])
    if a["causal"] and not (all(type(o) is int for o in offsets) and offsets[0] == offsets[1]):
        return None
    if mask is not None:
        m = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if not (isinstance(m, torch.Tensor) and m.dtype == q_val.dtype and m.dim() == 4):
            return None
    return (q, k, v, 0.0, a["causal"]), {"attn_mask": mask, "scale": a["scale"]}


def _aten_attention(gm: fx.GraphModule) -> int:
    """Lower every CPU ``fxshard::attention_out`` and ``fxshard::attention`` whose contract is
    aten's (:func:`_flash_call`: no soft-cap, no offset causal diagonal, no mask or an
    additive one) to aten's CPU flash attention, the op that ``F.scaled_dot_product_attention``
    becomes on CPU and that Inductor calls directly (as in compiled hand-written code)::

        before: attention = torch.ops.fxshard.attention_out.default(q, k, v, None, True, 0.18, 0, 0)
                transpose = torch.ops.aten.transpose.int(attention, 1, 2)
        after:  flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                    q, k, v, 0.0, True, attn_mask=None, scale=0.18)
                getitem = flash[0];  transpose = torch.ops.aten.transpose.int(getitem, 1, 2)

    The same kernel as fxshard's CPU fast path, so the same values; ``out`` comes in q's
    layout (``[B, S, H, D]`` memory here, as ``attention_out`` stores it; ``attention``'s
    contiguous ``out`` only differs in strides, so graphs with ``as_strided`` are left alone),
    ``lse`` is cast to float32 (fxshard's contract) for float64 inputs. Non-finite inputs
    follow aten (a row of NaN queries gives 0, as the single-device model calling SDPA on
    CPU gives), not the exact path of fxshard's kernel (NaN). Compiled and eager stages
    (:func:`eager_stage`) both lower. Ring steps with offsets, soft-caps and
    bool masks keep the ``fxshard::*`` op."""
    graph = gm.graph
    if any(n.target is torch.ops.aten.as_strided.default for n in graph.nodes):
        return 0
    targets = (attention_out.default, torch.ops.fxshard.attention.default)
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        call = _flash_call(node)
        tuple_out = node.target is torch.ops.fxshard.attention.default
        if call is None or (tuple_out and not all(u.target is operator.getitem
                                                  for u in node.users)):
            continue
        with graph.inserting_before(node):
            flash = graph.call_function(_FLASH_CPU, *call)
        if not tuple_out:
            with graph.inserting_after(flash):
                out = graph.call_function(operator.getitem, (flash, 0))
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
        for user in list(node.users):
            with graph.inserting_before(user):
                new = graph.call_function(operator.getitem, (flash, user.args[1]))
                if user.args[1] == 1 and call[0][0].meta["val"].dtype != torch.float32:
                    new = graph.call_function(torch.ops.aten._to_copy.default, (new,),
                                              {"dtype": torch.float32})
            new.meta.update(user.meta)
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(node)
        n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


def inductor_graph(program: Program, *, groups: dict[str, str] | None = None
                   ) -> tuple[fx.GraphModule, list[str]]:
    """The graph :func:`compile_stage` hands Inductor (runnable eagerly too): ``program``
    with its weights as leading inputs (their names second), CPU attention without ``lse``
    (:func:`_attention_out_only`) and, where aten's contract holds, as aten's flash attention
    (:func:`_aten_attention`), and with ``groups``, collectives on those axes as torch's
    functional collectives (:func:`_native_collectives`)."""
    gm, names = _weights_as_inputs(program)
    _attention_out_only(gm)
    _aten_attention(gm)
    if groups:
        _native_collectives(gm, groups)
    return gm, names


def compile_stage(program: Program, example_module: fx.GraphModule,
                  example_inputs: list[torch.Tensor], *,
                  groups: dict[str, str] | None = None) -> CompiledStage:
    """Compile ``program`` with Inductor, on the weights of one of its ranks
    (``example_module``) and that rank's inputs (no collective runs while compiling).
    ``groups`` (mesh axis -> torch.distributed group name, real meshes only): lower the
    stage's collectives on those axes to torch's functional collectives
    (:func:`_native_collectives`); without it every collective stays an ``fxshard::*`` op
    (the simulated mesh). The graph: :func:`inductor_graph`."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    gm, names = inductor_graph(program, groups=groups)
    example = [*_weights_of(example_module, names), *example_inputs]
    # a fake mode with a shape env, as dynamo would give: Inductor's FX graph cache needs one
    # (without it every process recompiles the same stage from scratch)
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with torch.no_grad(), tracing(TracingContext(fake)):
        fn = compile_fx(gm, [fake.from_tensor(x, static_shapes=True) for x in example])
    return CompiledStage(fn=fn, names=names, module=gm)
