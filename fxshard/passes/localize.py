"""Rewrite global shape constants to the local ones of each rank's block.

Every rank of a stage runs the same program, so the local shapes depend only on the specs:

Before (tp=2, 4 heads, hidden 64)::

    view = aten.view(linear, [2, 8, -1, 16])      # global [2, 8, 4, 16], spec S(2)
    expand = aten.expand(unsqueeze, [2, 4, 8, 16])

After::

    view = aten.view(linear, [2, 8, 2, 16])
    expand = aten.expand(unsqueeze, [2, 2, 8, 16])

``view`` becomes ``reshape``: collectives and fused kernels return tensors whose strides differ
from those seen at trace time. Factory ops get the mesh's device (a model traced on ``meta`` bakes ``device=meta`` into
them). Other size arguments (a depthwise conv's ``groups``) are rewritten by the op's entry
in ``rules/local_args.py``. A vocab-sharded embedding becomes ``fxshard.vocab_embedding`` (ids outside the rank's rows
give zeros, summed by the following all-reduce). Every tensor's local shape is checked here:
a dim that does not divide evenly is a ``ValueError`` naming the node, dim, size and axis.
"""
from __future__ import annotations

import sys

import torch
import torch.fx as fx

from ..mesh import TP
from ..placement import Shard, StridedShard, local_shape
from . import PassCtx
from .rules.local_args import localize_args

aten = torch.ops.aten

__all__ = ["localize_pass"]

_SHAPE_ARG = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1,
              aten.expand.default: 1}


def _describe(node: fx.Node) -> str:
    """Name a value for an error: the user's input it was sliced from, if it was one."""
    origin = node
    while origin.op == "call_function" and str(origin.target).startswith("fxshard.") and \
            origin.args and isinstance(origin.args[0], fx.Node):
        origin = origin.args[0]
    index = origin.meta.get("fxshard_input")
    if origin.op == "placeholder" and index is not None:
        # the forward's own name (a training graph's placeholder is primals_<n>)
        name = origin.meta.get("fxshard_input_name", origin.name)
        return f"input {name!r} (argument {index} of the forward)"
    return f"value {node.name} ({node.target})"


def _local(node: fx.Node, ctx: PassCtx) -> tuple[int, ...] | None:
    val, spec = node.meta.get("val"), node.meta.get("fxshard_spec")
    if not isinstance(val, torch.Tensor) or not isinstance(spec, tuple):
        return None
    try:
        return local_shape(tuple(val.shape), spec, ctx.mesh, what=_describe(node))
    except ValueError as e:
        on_tp, n = dict(zip(ctx.mesh.axis_names, spec)).get(TP), ctx.mesh.axis_size(TP)
        if ctx.sequence_parallel and isinstance(on_tp, Shard) and on_tp.dim == 1 and \
                val.dim() == 3 and val.shape[1] % n:
            raise ValueError(
                f"{e} Here the dim is the sequence: sequence_parallel=True splits the "
                f"{val.shape[1]} tokens over {TP}={n}; pad the sequence to a multiple of {n} "
                f"or pass sequence_parallel=False") from None
        raise


def localize_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    changed = 0
    for node in list(gm.graph.nodes):
        local = _local(node, ctx)
        for a in node.all_input_nodes:
            _local(a, ctx)
        if node.op == "call_function" and "device" in node.kwargs:
            # a model traced on meta bakes device="meta" into factory ops
            node.update_kwarg("device", torch.device(ctx.mesh.device_type))
        if node.op == "call_function" and node.target is aten.to.device:
            node.update_arg(1, torch.device(ctx.mesh.device_type))
        if node.op == "call_function" and node.target is aten.view.default:
            # strides differ from the trace once collectives and fused kernels return fresh
            # contiguous tensors (SDPA's output layout made a later .contiguous() a no-op that
            # export dropped): reshape views where it can and copies where it must
            node.target = aten.reshape.default
            changed += 1
        if _fused_split(node, ctx):
            changed += 1
            continue
        if node.op == "call_function" and node.target in (aten.mean.dim, aten.mean.default):
            changed += _partial_mean(gm.graph, node, ctx)
        if localize_args(node, lambda n: _local(n, ctx)):   # sizes in arguments (groups, ..)
            changed += 1
        if node.op != "call_function" or local is None:
            continue
        val = node.meta["val"]
        if node.target in _SHAPE_ARG and tuple(val.shape) != local:
            node.update_arg(_SHAPE_ARG[node.target], list(local))
            changed += 1
        elif node.target is aten.unflatten.int and tuple(val.shape) != local:
            dim = node.args[1] % len(local)
            n_new = len(node.args[2])
            node.update_arg(2, list(local[dim:dim + n_new]))
            changed += 1
        elif node.target is aten.slice.Tensor:
            x = node.args[0]
            dim = (node.args[1] if len(node.args) > 1 else 0) % x.meta["val"].dim()
            spec = x.meta.get("fxshard_spec")
            if any(isinstance(p, Shard) and p.dim == dim for p in spec or ()):
                args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
                args[3] = sys.maxsize  # a whole slice of a sharded dim
                node.args = tuple(args)
                changed += 1
        elif node.target is aten.embedding.default:
            changed += _vocab_embedding(node, ctx)
    ctx.report("localize_pass", rewritten_nodes=changed)
    return gm


def _partial_mean(graph: fx.Graph, node: fx.Node, ctx: PassCtx) -> int:
    """A mean over a dim sharded ``n`` ways is a partial sum of the local means divided by
    ``n`` (every rank holds the same count): divide right after the local mean."""
    x = node.args[0]
    nd = x.meta["val"].dim()
    if node.target is aten.mean.default:
        dims = set(range(nd))
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = set(range(nd)) if not dims else {d % nd for d in dims}
    ways = 1
    for n, p_in, p_out in zip(ctx.mesh.shape, x.meta.get("fxshard_spec") or (),
                              node.meta.get("fxshard_spec") or ()):
        if n > 1 and isinstance(p_in, Shard) and p_in.dim in dims:
            assert type(p_out).__name__ == "Partial", node.format_node()
            ways *= n
    if ways == 1:
        return 0
    with graph.inserting_after(node):
        div = graph.call_function(aten.div.Tensor, (node, ways))
    div.meta.update(node.meta)
    node.replace_all_uses_with(div, delete_user_cb=lambda u: u is not div)
    return 1


def _strided_ways(x: fx.Node, dim: int, ctx: PassCtx) -> int:
    """How many ways the fused (``StridedShard``) dim ``dim`` of ``x`` is split, else 1."""
    spec = x.meta.get("fxshard_spec") or ()
    ways = 1
    for n, p in zip(ctx.mesh.shape, spec):
        if n > 1 and isinstance(p, StridedShard) and p.dim == dim:
            ways *= n
    return ways


def _partly_whole(x: fx.Node, dim: int, ctx: PassCtx):
    """``(placement, axis size)`` when ``x``'s fused dim ``dim`` keeps some parts whole."""
    for n, p in zip(ctx.mesh.shape, x.meta.get("fxshard_spec") or ()):
        if n > 1 and isinstance(p, StridedShard) and p.dim == dim and p.whole:
            return p, n
    return None


def _split_partly_whole(node: fx.Node, dim: int, size: int, p: StridedShard, n: int) -> bool:
    """The local bounds of a split of a fused dim whose parts are split or whole: each part
    boundary moves to where the rank's local parts put it."""
    if node.target is aten.slice.Tensor:
        args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
        start = args[2] or 0
        end = size if args[3] is None else min(args[3], size)
        start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
        args[2], args[3] = p.local_bound(start, n), p.local_bound(end, n)
        node.args = tuple(args)
        return True
    sizes = list(node.args[1]) if node.target is aten.split_with_sizes.default else \
        [node.args[1]] * (size // node.args[1])
    bounds = [0]
    for k in sizes:
        bounds.append(bounds[-1] + k)
    local = [p.local_bound(b, n) for b in bounds]
    node.target = aten.split_with_sizes.default
    node.args = (node.args[0], [b - a for a, b in zip(local[:-1], local[1:])], dim)
    node.kwargs = {}
    return True


def _fused_split(node: fx.Node, ctx: PassCtx) -> bool:
    """A slice/split of a fused projection's output into its parts: every bound is a part
    boundary, so the local bounds are the global ones divided by the axis size."""
    if node.op != "call_function" or node.target not in (
            aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default):
        return False
    x = node.args[0]
    nd = x.meta["val"].dim()
    if node.target is aten.slice.Tensor:
        dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    else:
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    ways = _strided_ways(x, dim, ctx)
    if ways == 1:
        return False
    size = x.meta["val"].shape[dim]
    whole = _partly_whole(x, dim, ctx)
    if whole is not None:
        return _split_partly_whole(node, dim, size, *whole)
    if node.target is aten.slice.Tensor:
        args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
        start = args[2] or 0
        end = size if args[3] is None else min(args[3], size)
        start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
        assert start % ways == 0 and end % ways == 0, node.format_node()
        args[2], args[3] = start // ways, end // ways
        node.args = tuple(args)
    elif node.target is aten.split.Tensor:
        assert node.args[1] % ways == 0, node.format_node()
        node.update_arg(1, node.args[1] // ways)
    else:
        assert all(k % ways == 0 for k in node.args[1]), node.format_node()
        node.update_arg(1, [k // ways for k in node.args[1]])
    return True


def _vocab_embedding(node: fx.Node, ctx: PassCtx) -> int:
    weight = node.args[0]
    spec = weight.meta.get("fxshard_spec") or ()
    axes = [a for a, n, p in zip(ctx.mesh.axis_names, ctx.mesh.shape, spec)
            if n > 1 and isinstance(p, Shard) and p.dim == 0]
    if not axes:
        return 0
    # padding_idx shapes only the gradient (a training program's embedding_dense_backward
    # carries it: fxshard::vocab_embedding_backward); the lookup itself ignores it
    extra = [a for a in node.args[3:] if a is not False]
    if len(axes) > 1 or extra:
        raise NotImplementedError(
            f"fxshard.parallelize: embedding {node.name} is vocab-sharded over {axes} with "
            f"extra arguments {node.args[2:]}; only one vocab axis without "
            f"scale_grad_by_freq or sparse is supported. Use plan={{...: 'embed_dim'}} for "
            f"this embedding.")
    import fxshard.ops  # noqa: F401  (registers fxshard::vocab_embedding)
    axis = axes[0]
    node.target = torch.ops.fxshard.vocab_embedding.default
    node.args = (weight, node.args[1], axis, ctx.mesh.axis_size(axis))
    return 1
