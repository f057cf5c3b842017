"""Backward ops whose arguments spell a global shape or size: the local one (after
``localize_pass``, which does the same for the forward's ops).

``slice_backward`` / ``select_backward`` take the gradient's local shape (and, into a fused
layout split by ``StridedShard``, the part's local bounds); the gradient of a vocab-sharded
embedding table becomes ``fxshard::vocab_embedding_backward`` over its rank's rows::

    before (tp=2, vocab-sharded [128, 64] table):
        slice_backward(g, [4, 8, 192], 2, 64, 128, 1)
        embedding_dense_backward(g, ids, 128, -1, False)
    after:
        slice_backward(g, [4, 8, 96], 2, 32, 64, 1)
        fxshard.vocab_embedding_backward(g, ids, 64, -1, 'tp', 2)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ops.training import vocab_embedding_backward
from ..passes import PassCtx
from ..placement import Shard, StridedShard, local_shape

__all__ = ["localize_backward_pass"]

_WHERE = "fxshard.training"
aten = torch.ops.aten


def localize_backward_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Backward ops whose arguments spell a global shape or size: the local one."""
    changed = 0
    for node in gm.graph.nodes:
        if node.target in (aten.slice_backward.default, aten.select_backward.default):
            val, spec = node.meta["val"], node.meta["fxshard_spec"]
            local = list(local_shape(tuple(val.shape), spec, ctx.mesh, what=node.name))
            if node.target is aten.slice_backward.default:
                changed += _fused_slice_bounds(node, spec, ctx)
            if list(node.args[1]) != local:
                node.update_arg(1, local)
                changed += 1
        elif node.target is aten.embedding_dense_backward.default:
            changed += _vocab_backward(node, ctx)
    ctx.changed |= bool(changed)   # (arguments only: no count in the pass log)
    return gm


def _fused_slice_bounds(node: fx.Node, spec: tuple, ctx: PassCtx) -> int:
    """A part's gradient padded into a fused layout: its bounds where the rank's local parts
    put them (``StridedShard.local_bound``)."""
    dim = node.args[2] % len(node.args[1])
    strided = [(n, p) for n, p in zip(ctx.mesh.shape, spec)
               if n > 1 and isinstance(p, StridedShard) and p.dim == dim]
    if not strided:
        return 0
    if len(strided) > 1:
        raise NotImplementedError(
            f"{_WHERE}: gradient {node.name} pads into a fused dim split by {len(strided)} "
            f"mesh axes (mesh {ctx.mesh.describe()}); one axis (tp) is supported")
    (n, p), = strided
    size = node.args[1][dim]
    start, end = node.args[3], min(node.args[4], size)
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    node.update_arg(3, p.local_bound(start, n))
    node.update_arg(4, p.local_bound(end, n))
    return 1


def _vocab_backward(node: fx.Node, ctx: PassCtx) -> int:
    """The gradient of a vocab-sharded table's rows: ``fxshard::vocab_embedding_backward``
    (one vocab axis, as the forward's ``vocab_embedding``)."""
    spec = node.meta["fxshard_spec"]
    axes = [(a, n) for a, n, p in zip(ctx.mesh.axis_names, ctx.mesh.shape, spec)
            if n > 1 and p == Shard(0)]
    if not axes:
        return 0
    if len(axes) > 1 or node.args[4]:
        raise NotImplementedError(
            f"{_WHERE}: embedding gradient {node.name} is vocab-sharded over {axes} "
            f"(scale_grad_by_freq={node.args[4]}); one vocab axis without scale_grad_by_freq "
            f"is supported. Use embedding='embed_dim' (the default)")
    (axis, n), = axes
    grad, ids, vocab, padding = node.args[:4]
    node.target = vocab_embedding_backward.default
    node.args = (grad, ids, vocab // n, padding, axis, n)
    return 1
