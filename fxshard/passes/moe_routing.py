"""MoE routing regions: the sort of tokens by expert runs on each rank's own tokens.

HF's grouped-matmul experts (Mixtral, Qwen-MoE, OLMoE) sort the ``(token, k)`` pairs by expert,
run the grouped matmuls on the sorted rows and put the rows back in token order::

    ids_g, perm = sort(ids [N])                  # N = tokens * top_k
    x_g = index(x [T, H], [perm // k]);  w_g = index(w [N], [perm])
    offs = cumsum(histc(ids_g, E))               # rows per expert
    y_g = grouped_mm(.. x_g .., W, offs) * w_g   # rows stay rows: pointwise, split, grouped_mm
    inv = index_put(empty_like(perm), [perm], arange(N))
    y = index(y_g, [inv])                        # token order again

Any permutation that groups the rows by expert gives the same ``y``: sorting by (rank, expert)
is as good as sorting by expert. So on a mesh axis that shards the tokens (``dp``, a CP axis;
not ``tp``, whose ranks need every token for their slice of every expert) each rank sorts,
multiplies and un-sorts its own rows: inside the region values are in the rank's local order,
``offs`` is that rank's counts (a ``Partial`` of the global counts) and ``arange(N)`` becomes
``cumsum(ones_like(perm)) - 1`` (the rank's own positions). No collective may touch a value
inside the region on such an axis; propagation checks that and otherwise propagates the region
again without the tag (the routing is then gathered: correct, slower).

In a joint forward+backward graph (``fxshard.training``) the region takes its backward along,
or the region is not tagged: ``index_put(zeros, [inv], g, True)`` brings the gradient into the
rank's sorted order, the experts' backward (``grouped_mm_fallback_backward``: the weights'
gradients are partial sums, reduced over the token axis outside the region) and row-wise ops
keep it there, and ``index_put(zeros, [perm // k], gx, True)`` / ``[perm]`` (or a ``gather``
of the add-back's token index) bring it back to the rank's own tokens. The joint
propagation checks those regions like ``propagate_pass``.

On ``ep`` (whole experts by index per rank) the tagged region is where
``passes/expert_parallel.py`` cuts the experts out of the rank's sorted order: the rows go to
their experts' ranks and back by all-to-all, forward and backward alike.

This pass tags the region's nodes with ``node.meta["fxshard_token_local"]`` (the sort's name)
after checking that everything between the sort and the un-permuting index is row-wise; the
rules of ``sort``, ``index``, ``index_put``, ``cumsum`` and ``grouped_mm`` read the tag (it
runs right before ``propagate_pass``; it reports ``routing_sorts``, the regions tagged).
Before::  arange = aten.arange(64)            After::  ones = aten.ones_like(perm)
          index_put(e, [perm], arange)                 cs = aten.cumsum(ones, 0); pos = cs - 1
                                                       index_put(e, [perm], pos)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import PassCtx
from .rules import lookup
from .rules.experts import grouped_mm_rule
from .rules.pointwise import identity_rule, pointwise_rule, untagged_pointwise_rule

__all__ = ["moe_routing_pass", "TAG"]

aten = torch.ops.aten
TAG = "fxshard_token_local"
_ROWWISE_VIEWS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                  aten.unsqueeze.default)


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def _fwd(node: fx.Node, bwd: set) -> list[fx.Node]:
    """``node``'s users in the forward (a joint graph's backward users are checked apart)."""
    return [u for u in node.users if u not in bwd]


def _rows(n: fx.Node) -> int | None:
    val = n.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None


def _rowwise(u: fx.Node, src: fx.Node) -> bool:
    """``u`` maps row i of ``src`` to row i of its output (dim 0 untouched)."""
    if u.op != "call_function":
        return False
    if u.target is operator.getitem:
        return True
    rule_fn = lookup(u.target)
    if rule_fn in (pointwise_rule, identity_rule, untagged_pointwise_rule):
        return True
    if rule_fn is grouped_mm_rule:
        return u.args[0] is src
    nd = src.meta["val"].dim()
    if u.target is aten.unsqueeze.default:
        return u.args[1] % (nd + 1) != 0
    if u.target in _ROWWISE_VIEWS:
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
        return dim % nd != 0
    if u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        # the first dim kept: row i is the same block of the row-major data
        return nd > 0 and u.meta["val"].dim() > 0 and \
            u.meta["val"].shape[0] == src.meta["val"].shape[0]
    return False


_INDEX_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.unsqueeze.default, aten.expand.default)
_ADD_BACK = (aten.scatter_add.default, aten.index_add.default)


def _add_back(g: fx.Node, region: set, chain: list, bwd: set) -> fx.Node | None:
    """The ``scatter_add`` / ``index_add`` along dim 0 whose index is ``g`` (the token of each
    sorted row, through views and an expand over the hidden dim): it adds the rows back to
    their tokens. ``chain`` collects the views."""
    while g.target in _INDEX_VIEWS and len(_fwd(g, bwd)) == 1 and \
            g.args[0] in region | set(chain):
        chain.append(g)
        g = _fwd(g, bwd)[0]
    if g.target in _ADD_BACK and chain and g.args[2] is chain[-1] and g.args[1] == 0 and \
            not g.kwargs and len(g.args) == 4:
        return g
    return None


def _derives_from(node: fx.Node, base: fx.Node, depth: int = 8) -> bool:
    """``base`` is among ``node``'s inputs within ``depth`` ops (the expert counts come from the
    ids that are sorted)."""
    frontier = {node}
    for _ in range(depth):
        if base in frontier:
            return True
        frontier = {t for n in frontier for t in n.all_input_nodes}
    return base in frontier


def _ids_source(n: fx.Node) -> fx.Node:
    while n.target in _INDEX_VIEWS:
        n = n.args[0]
    return n


def _region(sort: fx.Node, bwd: set) -> tuple[set[fx.Node], fx.Node | None] | None:
    """The nodes of the routing region of ``sort`` (``sort`` or ``argsort`` of the flat expert
    ids) and the arange to rewrite (None when the rows are added back by ``scatter_add``)."""
    if sort.target in (aten.argsort.default, aten.argsort.stable):
        if sort.meta["val"].dim() != 1:
            return None
        ids_g, perm = None, sort
        region = {sort}
    else:
        if sort.meta["val"][0].dim() != 1:
            return None
        outs = _getitems(sort)
        if set(outs) == {1}:   # only the order (an argsort, decomposed in a joint graph)
            ids_g, perm = None, outs[1]
            region = {sort, perm}
        elif set(outs) != {0, 1}:
            return None
        else:
            ids_g, perm = outs[0], outs[1]
            region = {sort, ids_g, perm}
    n = _rows(perm)
    gathered: list[fx.Node] = []   # index(x, [perm-derived]) -> sorted rows
    add_backs: set[fx.Node] = set()   # scatter_add(out, 0, token of each row, rows)
    inverse = None
    for u in _fwd(perm, bwd):
        if u.target is aten.floor_divide.default and not isinstance(u.args[1], fx.Node):
            region.add(u)
            for g in _fwd(u, bwd):
                if g.target is aten.index.Tensor and list(g.args[1]) == [u]:
                    gathered.append(g)
                    continue
                chain: list[fx.Node] = []
                back = _add_back(g, region | {u}, chain, bwd)
                if back is None:
                    return None
                region.update(chain)
                add_backs.add(back)
        elif u.target is aten.index.Tensor and list(u.args[1]) == [perm]:
            gathered.append(u)
        elif u.target is aten.empty_like.default and ids_g is not None:
            region.add(u)
        elif u.target is aten.index_put.default and list(u.args[1]) == [perm] and \
                u.args[0].target is aten.empty_like.default and u.args[0].args[0] is perm and \
                u.args[2].target in (aten.arange.default, aten.arange.start) and \
                _rows(u.args[2]) == n and len(u.args[2].users) == 1 and \
                list(u.args[3:4]) in ([], [False]):
            inverse = u
        else:
            return None
    if inverse is None and not add_backs or not gathered:
        return None
    if inverse is not None:
        region.add(inverse)
    # the sorted ids feed only the expert counts: histc -> cumsum -> grouped_mm offsets
    counts = []
    stack = [ids_g] if ids_g is not None else []
    while stack:
        cur = stack.pop()
        for u in _fwd(cur, bwd):
            if lookup(u.target) is identity_rule or u.target in (aten.histc.default,
                                                                  aten.cumsum.default):
                region.add(u)
                stack.append(u)
            elif lookup(u.target) is grouped_mm_rule and u.args[2] is cur:
                counts.append(u)
            else:
                return None
    # rows from the gathers to the un-permuting index / add-back: row-wise ops only
    unpermute: set[fx.Node] = set()
    rows: set[fx.Node] = set(gathered)
    stack = list(gathered)
    while stack:
        cur = stack.pop()
        for u in _fwd(cur, bwd):
            if u in rows or u in unpermute:
                continue
            if inverse is not None and u.target is aten.index.Tensor and \
                    list(u.args[1]) == [inverse] and u.args[0] is cur:
                unpermute.add(u)
                continue
            if u in add_backs and u.args[3] is cur:
                unpermute.add(u)
                continue
            vals = u.meta.get("val")
            vals = vals if isinstance(vals, (list, tuple)) else [vals]
            if not _rowwise(u, cur) or any(not isinstance(v, torch.Tensor) or v.dim() == 0 or
                                           v.shape[0] != n for v in vals):
                return None
            rows.add(u)
            stack.append(u)
    for u in rows | unpermute:   # every other per-row input comes from the region as well
        ins = [u.args[0]] if lookup(u.target) is grouped_mm_rule or \
            u.target is aten.type_as.default else \
            [u.args[2], u.args[3]] if u in add_backs else u.all_input_nodes
        if any(t not in rows and t not in region for t in ins if t not in gathered and
               t.op != "get_attr" and t.meta.get("fxshard_param") is None) and \
                u not in gathered:
            return None
    region |= rows | unpermute
    if not unpermute or add_backs - unpermute:
        return None
    if ids_g is None:
        # the counts come from the routing (a one-hot sum), not the sorted ids: they must
        # derive from the ids sorted, so that each rank's own counts are its rows'
        counts = [u for u in rows if lookup(u.target) is grouped_mm_rule]
        source = _ids_source(sort.args[0])
        if not all(_derives_from(u.args[2], source) for u in counts):
            return None
        return region, None
    if not set(counts) <= region:
        return None
    return region, inverse.args[2]


_ROW_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)
_ROW_VIEWS = (aten.squeeze.dim, aten.squeeze.dims, aten.cat.default)


def _grouped_mm_backward(node: fx.Node) -> bool:
    """transformers' grouped matmul's backward op (registered by name, as its forward)."""
    return str(node.target) == "transformers.grouped_mm_fallback_backward.default"


_FACTORIES = (aten.new_zeros.default, aten.new_empty.default, aten.zeros_like.default)


def _backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of a joint graph's backward: those that read a tangent (none in a forward)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("fxshard_tangent") is not None or \
                any(t in out for t in node.all_input_nodes):
            out.add(node)
    return out


def _keeps_rows(u: fx.Node, inside: set, n: int) -> bool:
    """``u`` maps row i of its routed inputs to row i of its ``n``-row output and reads no other
    ``n``-row value (a value in another order); other inputs broadcast or are weights."""
    src = next(t for t in u.all_input_nodes if t in inside)
    dims = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    nd = src.meta["val"].dim()
    if u.target in _ROW_REDUCTIONS + _ROW_VIEWS:
        ok = all(d % nd != 0 for d in dims)
    else:
        ok = _rowwise(u, src) or lookup(u.target) is grouped_mm_rule and \
            _rows(u.args[0]) == n and u.args[0] in inside
    if not ok or _rows(u) != n:
        return False
    return all(t in inside or _rows(t) != n or t.meta["val"].dim() < u.meta["val"].dim()
               for t in u.all_input_nodes)


def _backward(region: set, bwd: set, n: int, gm: fx.GraphModule) -> set | None:
    """The backward ops of a routing region (a joint graph): from the gradients of its
    outputs back to the gradients of its inputs, in the rank's own order too::

        g_s  = index_put(zeros [N, H], [inv], g [N, H], True)   # token order -> sorted
        gx_s, gW = grouped_mm_fallback_backward(x_s, W, offs, g_s * w_s)   # gW: a partial sum
        gx   = index_put(zeros [T, H], [perm // k], gx_s, True)  # sorted -> token order
        gw   = index_put(zeros [N], [perm], sum(g_s * y_s, -1), True)

    (or ``gather(g, 0, token_of_row)`` where the forward added rows back by ``scatter_add``).
    Every op between is row-wise; None when one is not (the region then runs gathered)."""
    inverse = {u for u in region if u.target is aten.index_put.default and
               list(u.args[3:4]) in ([], [False])}
    inside = set(region)   # the values in the region's (sorted) order
    counts = {u.args[2] for u in region if lookup(u.target) is grouped_mm_rule}   # offsets
    back: set[fx.Node] = set()
    multi: set[fx.Node] = set()   # the experts' backward: rows, and the weights' gradient
    for u in gm.graph.nodes:
        if u not in bwd or u.op != "call_function" or \
                not any(t in inside or t in multi for t in u.all_input_nodes):
            continue
        args = u.args
        if u.target in _FACTORIES:
            continue                     # (a routed value lends its dtype to the zeros)
        if u.target is aten.index_put.default and len(args) == 4 and args[3] is True and \
                len(args[1]) == 1 and args[1][0] in region and args[0] not in inside:
            if args[1][0] in inverse and args[2] not in inside and _rows(args[2]) == n:
                inside.add(u)            # the gradient of the un-permute: sorted again
            elif args[1][0] not in inverse and args[2] in inside:
                pass                     # the gradient of a gather: back in token order
            else:
                return None
        elif u.target is aten.gather.default and args[1] == 0 and args[2] in region and \
                args[0] not in inside and not u.kwargs and len(args) == 3:
            inside.add(u)                # the gradient of the add-back: the rows taken out
        elif u.target is operator.getitem:
            if _rows(u) == n:
                inside.add(u)
            elif not _grouped_mm_backward(args[0]) and \
                    lookup(args[0].target) is not grouped_mm_rule:
                return None              # (an expert weight's gradient: a partial sum)
        elif _grouped_mm_backward(u):
            x, _, offs, g = args
            if x not in inside or g not in inside or offs not in counts:
                return None
            multi.add(u)
        elif _keeps_rows(u, inside, n):
            inside.add(u)
        else:
            return None
        back.add(u)
    return back


def moe_routing_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    tagged = 0
    sorts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)]
    bwd = _backward_nodes(gm)
    for sort in sorts:
        found = _region(sort, bwd)
        if found is None:
            continue
        region, arange = found
        if bwd:   # a joint graph: the region's backward is token-local too, or none of it
            back = _backward(region, bwd, _rows(sort.args[0]), gm)
            if back is None:
                continue
            region |= back
        if arange is None:   # rows added back by scatter_add: no positions to rewrite
            for node in region:
                node.meta[TAG] = sort.name
            tagged += 1
            continue
        perm = _getitems(sort)[1]
        with gm.graph.inserting_before(arange):
            ones = gm.graph.call_function(aten.ones_like.default, (perm,))
            cs = gm.graph.call_function(aten.cumsum.default, (ones, 0))
            pos = gm.graph.call_function(aten.sub.Tensor, (cs, 1))
        for new in (ones, cs, pos):
            new.meta["val"] = arange.meta["val"]
            new.meta["nn_module_stack"] = sort.meta.get("nn_module_stack", {})
            region.add(new)
        arange.replace_all_uses_with(pos)
        gm.graph.erase_node(arange)
        for node in region:
            node.meta[TAG] = sort.name
        tagged += 1
    ctx.report("moe_routing_pass", routing_sorts=tagged)
    return gm
