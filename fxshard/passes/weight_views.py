"""Weights reached through views and casts: ``grouped_mm(x, w.bfloat16().transpose(-2, -1))``.

A parameter that only weight-owning rules (linear, embedding, addmm, grouped_mm, matmul) use,
through a chain of transposes / permutes and dtype casts, is placed by that rule as if it took
the parameter directly: propagation keeps the chain's placements UNDECIDED until the rule
decides, then hands the decision back down the chain to the parameter, renaming the sharded
dim at each transpose::

    w1 [E, F, D] UNDECIDED -> _to_copy(bf16) UNDECIDED -> transpose(-2, -1) [E, D, F]
        -> grouped_mm picks S(2) (column-parallel)
    after: transpose S(2), _to_copy S(1), w1 S(1): each rank holds F/tp of every expert

Squeezing or unsqueezing a size-1 dim is such a view too (a depthwise convolution's
``conv1d.weight.squeeze(1)`` handed on as ``w.unsqueeze(1)``)::

    w [C, 1, k] -> squeeze(1) [C, k] -> unsqueeze(1) [C, 1, k] -> conv1d picks S(0): w S(0)
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ..placement import R, Shard, StridedShard
from .rules import UNDECIDED, lookup
from .rules.embedding import embedding_rule
from .rules.experts import grouped_mm_rule
from .rules.conv import conv_rule
from .rules.linear import addmm_rule, linear_rule, matmul_rule
from .rules.views import permutation

_OWNS_WEIGHTS = (linear_rule, embedding_rule, addmm_rule, grouped_mm_rule, matmul_rule,
                 conv_rule)
_SIZE1_VIEWS = (torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default)
_WEIGHT_VIEWS = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
                 torch.ops.aten.t.default, torch.ops.aten.numpy_T.default) + _SIZE1_VIEWS
_WEIGHT_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


def _is_weight_cast(node: fx.Node) -> bool:
    """A dtype cast that keeps shape and device (``w.bfloat16()`` before an expert matmul)."""
    if node.target not in _WEIGHT_CASTS or any(isinstance(a, fx.Node) for a in node.args[1:]):
        return False
    src, val = node.args[0], node.meta.get("val")
    return isinstance(src, fx.Node) and isinstance(val, torch.Tensor) and \
        isinstance(src.meta.get("val"), torch.Tensor) and \
        val.shape == src.meta["val"].shape and val.device == src.meta["val"].device


def _feeds_owners(node: fx.Node) -> bool:
    """Every use of ``node`` is a weight-owning rule, directly or through weight views/casts."""
    return bool(node.users) and all(
        u.op == "call_function" and (lookup(u.target) in _OWNS_WEIGHTS or (
            (u.target in _WEIGHT_VIEWS or _is_weight_cast(u)) and _feeds_owners(u)))
        for u in node.users)


def _root(node: fx.Node, views: dict) -> fx.Node:
    """The parameter under a chain of weight views."""
    while node.name in views:
        node = views[node.name]
    return node


def _weight_view(node: fx.Node, param_spec: dict, views: dict) -> fx.Node | None:
    """The parameter (or weight view) ``node`` transposes/permutes/casts when only
    weight-owning rules use the result (MoE experts: ``grouped_mm(x, w.bfloat16()
    .transpose(-2, -1), offs)``): the parameter is then placed by that rule, through the views,
    like a weight the rule takes directly."""
    if node.target not in _WEIGHT_VIEWS and not _is_weight_cast(node):
        return None
    src = node.args[0]
    if src.name not in param_spec or _root(src, views).meta.get("fxshard_param") is None or \
            len(src.users) != 1 or UNDECIDED not in param_spec[src.name]:
        return None
    return src if _feeds_owners(node) else None


def _moved(p, dim_map):
    """``p`` with its sharded dim renamed by ``dim_map`` (a transpose/permute of the tensor)."""
    if isinstance(p, StridedShard):
        return replace(p, dim=dim_map(p.dim))
    if isinstance(p, Shard):
        return Shard(dim_map(p.dim))
    return p


def _dim_map(node: fx.Node, src: fx.Node):
    """How ``node`` (a weight view or cast of ``src``) renumbers dims: a permutation or none."""
    nd = src.meta["val"].dim()
    if _is_weight_cast(node):
        return list(range(nd))
    if node.target is torch.ops.aten.squeeze.dim:      # out dim -> in dim, the squeezed one gone
        d = node.args[1] % nd
        return [i for i in range(nd) if i != d]
    if node.target is torch.ops.aten.unsqueeze.default:  # the new dim maps to no input dim
        d = node.args[1] % (nd + 1)
        return list(range(d)) + [None] + list(range(d, nd))
    return permutation(node, nd)


def _place_through_views(gm: fx.GraphModule, views: dict, param_spec: dict) -> None:
    """Each weight view's placement, decided by its consumer, back to its parameter (the
    views nearest the consumer first: a chain hands it down one link at a time)."""
    for node in reversed(gm.graph.nodes):
        src = views.get(node.name)
        if src is None:
            continue
        spec = [R if p is UNDECIDED else p for p in param_spec.pop(node.name)]
        perm = _dim_map(node, src)
        have = param_spec[src.name]
        for i, p in enumerate(spec):
            if have[i] is UNDECIDED:
                have[i] = _moved(p, perm.__getitem__)
        node.meta["fxshard_spec"] = tuple(spec)
        node.meta["fxshard_need"] = [tuple(R if p is UNDECIDED else p for p in have)]
