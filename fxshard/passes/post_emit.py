"""Rewrites of an emitted stage graph for the runners: passes run after emit.

Each is ``def name_pass(gm, *, ctx: PostEmitCtx) -> GraphModule``, run by
:func:`fxshard.passes.pipeline.run_passes` on the stage graph with its weights as leading
inputs (``fxshard.compile``), counting what it rewrote in ``ctx.report``. The runners' lists::

    EAGER    = [attention_out_only, aten_attention, consume_dead_inputs]  # eager_stage
    INDUCTOR = [attention_out_only, aten_attention, native_collectives]   # compile_stage
    TRAINING = [consume_dead_inputs, prefetch_fsdp]   # training's eager programs
                                       # (overlap_collectives: not yet)

``attention_out_only`` and ``aten_attention`` change only strides and which CPU kernel runs
(the same values); ``consume_dead_inputs`` lets an all-reduce sum into a buffer nothing else
reads; ``native_collectives`` (real meshes: ``ctx.groups``) hands Inductor torch's functional
collectives, which it lowers natively; ``overlap_collectives`` runs an all-reduce in the
background behind the matmuls that do not need it; ``prefetch_fsdp`` issues the ``fsdp``
axis's all-gathers one ahead and its reduce-scatters in the background (those two:
:mod:`fxshard.passes.overlap`). Each docstring shows its before and after.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops.attention import attention_out
from ..ops.collectives import all_reduce_consuming
from . import PassReports
from .overlap import overlap_collectives_pass, prefetch_fsdp_pass

__all__ = ["PostEmitCtx", "EAGER", "INDUCTOR", "TRAINING", "attention_out_only_pass",
           "aten_attention_pass",
           "consume_dead_inputs_pass", "native_collectives_pass", "overlap_collectives_pass",
           "prefetch_fsdp_pass"]


class PostEmitCtx(PassReports):
    """What the post-emit passes read: ``groups`` (mesh axis -> torch.distributed group name)
    on a real mesh, for ``native_collectives_pass``; None on the simulated mesh."""

    def __init__(self, *, groups: dict[str, str] | None = None):
        super().__init__()
        self.groups = groups


# ops whose result may share its input's memory: followed to the base, which must be fresh
# and read by the view alone (``_unsafe_view``'s schema declares no alias, but it is a view)
_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default,
          torch.ops.aten._unsafe_view.default)


def _fresh_and_dead(node: fx.Node, user: fx.Node) -> bool:
    """Whether ``node``'s value is a tensor of its own (made by an op whose schema returns no
    alias of an input) that ``user`` is the only reader of, so ``user`` may overwrite it; or
    a reshape/view whose base is such a tensor read by nothing but that view (a backward's
    ``view = reshape(mm); all_reduce(view)``: the storage is reachable through the view
    only)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if list(node.users) != [user]:
        return False
    if node.target in _VIEWS:
        return isinstance(node.args[0], fx.Node) and _fresh_and_dead(node.args[0], node)
    returns = node.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None


def consume_dead_inputs_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
    """Point every ``fxshard::all_reduce`` whose input is fresh and read by nothing else (a
    row-parallel linear's output) at :func:`all_reduce_consuming`: no copy of the input::

        before: all_reduce = torch.ops.fxshard.all_reduce.default(mm, 'tp', 2)
        after:  all_reduce = all_reduce_consuming(mm, 'tp', 2)
    """
    n = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.fxshard.all_reduce.default
                and _fresh_and_dead(node.args[0], node)):
            node.target = all_reduce_consuming
            n += 1
    ctx.report("consume_dead_inputs_pass", consuming_all_reduces=n)
    return gm


def attention_out_only_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
    """Point every CPU ``fxshard::attention`` whose ``lse`` nobody reads and whose ``out`` is
    only transposed back to ``[B, S, H, D]`` at ``fxshard::attention_out``
    (:mod:`fxshard.ops.attention`: the same values, no ``lse``, ``out`` stored as
    ``[B, S, H, D]``: the transpose becomes contiguous, the reshape after it a view). Only
    strides change; a graph with ``as_strided`` (which reads strides) is left alone::

        before: attention = torch.ops.fxshard.attention.default(q, k, v, None, True, 0.18, 0, 0)
                getitem = attention[0];  transpose = torch.ops.aten.transpose.int(getitem, 1, 2)
        after:  attention = torch.ops.fxshard.attention_out.default(q, k, v, None, True, ...)
                transpose = torch.ops.aten.transpose.int(attention, 1, 2)
    """
    graph = gm.graph
    n = 0
    if any(node.target is torch.ops.aten.as_strided.default for node in graph.nodes):
        ctx.report("attention_out_only_pass", attentions_without_lse=0)
        return gm
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
    ctx.report("attention_out_only_pass", attentions_without_lse=n)
    return gm


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


def native_collectives_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
    """Lower every ``fxshard::all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
    ``all_to_all`` on an axis of ``ctx.groups`` (mesh axis -> torch.distributed group name;
    none: the simulated mesh, nothing to do) to
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
    graph, n, groups = gm.graph, 0, ctx.groups or {}
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
    ctx.report("native_collectives_pass", native_collectives=n)
    return gm


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _flash_call(node: fx.Node) -> tuple[tuple, dict] | None:
    """The args and kwargs of aten's CPU flash attention that compute exactly what the
    ``fxshard::attention`` / ``attention_out`` at ``node`` computes, or None where the op's
    contract goes beyond aten's: a soft-cap, a causal mask with unequal (or run-time)
    ``q_offset``/``kv_offset`` (aten's causal diagonal is the top-left one, i.e. equal
    offsets), a bool mask or one of another dtype (aten's CPU kernel takes an additive mask of
    q's dtype), dtypes other than float32/64 (fxshard computes those in float32), an empty
    query or key length (aten's kernel dies of SIGFPE), non-CPU tensors, a value head size
    other than the query's (MLA; aten's kernel wants one head size)."""
    from torch.fx.operator_schemas import normalize_function
    args = normalize_function(node.target, node.args, node.kwargs,
                              normalize_to_only_use_kwargs=True)
    if args is None:
        return None
    a = args.kwargs
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        return None
    q_val, k_val, v_val = q.meta.get("val"), k.meta.get("val"), v.meta.get("val")
    if not (isinstance(q_val, torch.Tensor) and isinstance(k_val, torch.Tensor)
            and isinstance(v_val, torch.Tensor) and v_val.shape[-1] == q_val.shape[-1]
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


def aten_attention_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
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
    (``fxshard.compile.eager_stage``) both lower. Ring steps with offsets, soft-caps and
    bool masks keep the ``fxshard::*`` op."""
    graph = gm.graph
    if any(n.target is torch.ops.aten.as_strided.default for n in graph.nodes):
        ctx.report("aten_attention_pass", flash_attentions=0)
        return gm
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
    ctx.report("aten_attention_pass", flash_attentions=n)
    return gm


EAGER = [attention_out_only_pass, aten_attention_pass, consume_dead_inputs_pass]
#: training's eager forward and backward programs (``fxshard.training.module.direct``);
#: ``overlap_collectives_pass`` is not in it yet: it turns the in-place all-reduces that
#: ``tests/test_train_runner_copies.py`` checks into background ones; reconcile the two first
TRAINING = [consume_dead_inputs_pass, prefetch_fsdp_pass]
INDUCTOR = [attention_out_only_pass, aten_attention_pass, native_collectives_pass]
