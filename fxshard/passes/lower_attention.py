"""Lower ``aten.scaled_dot_product_attention`` to ``fxshard.attention`` on the rank's heads.

Before::

    sdpa = aten.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25, enable_gqa=True)

After::

    attention = torch.ops.fxshard.attention(q, k, v, None, True, 0.25, 0, 0)
    getitem = attention[0]

``fxshard.attention`` (``fxshard.kernels``) maps GQA inside the kernel and returns the
logsumexp as well, which context parallelism merges with. Sequence-sharded attention on the
``ring_cp`` axis becomes ``fxshard.ring_attention(q, k, v, causal, scale, "ring_cp", n)``
(``fxshard.ops.ring``); an explicit mask (sliding window, ALiBi bias) arrives sharded by
query rows like q and rides along as its ``mask`` argument::

    ring_attention(q, k, v, False, 0.25, 'ring_cp', 2, 1, 0, True, 0, 0.0, zigzag_shard(mask))

With both CP axes (USP, ``ulysses_cp`` before ``ring_cp``) the Ulysses all-to-all hands each
ring rank one piece of every Ulysses part (``segments`` = 2 here, ``stride`` 8); the mask's
query rows follow q's. A mask computed sharded is gathered over ``ulysses_cp`` when it
broadcasts over heads, or traded for its heads like q when it has them (ALiBi); layers sharing
one mask share that exchange::

    mask_u = all_gather(mask, 2, 'ulysses_cp', 2)            # once, before the first layer's
    q_u = all_to_all(q, 1, 2, 'ulysses_cp', 2)               # (k and v alike)
    ring_attention(q_u, k_u, v_u, False, 0.25, 'ring_cp', 2, 2, 8, True, 8, 0.0, mask_u)
    out = all_to_all(getitem, 2, 1, 'ulysses_cp', 2)

A mask that every rank builds whole and only slices (HF's masks) is cut into that layout
instead, part by part, without communication::

    mask = zigzag_shard(local_shard(m, 2, 'ulysses_cp', 2), 2, 'ring_cp', 2)     # before
    mask_u = cat([zigzag_shard(slice(m, 2, 0, 8), 2, 'ring_cp', 2),
                  zigzag_shard(slice(m, 2, 8, 16), 2, 'ring_cp', 2)], 2)         # after

(``ring_cp`` before ``ulysses_cp``: the exchange gives the ring rank its own chunk back whole,
``segments`` = 1, for q and the mask alike.)

An attention ``eager_attention_pass`` found soft-capped (Gemma-2) carries the cap in
``node.meta["fxshard_softcap"]``; it becomes the kernels' ``softcap`` argument. When ``tp``
exceeds the KV heads, the KV heads arrive replicated and each rank keeps the one its query
heads use::

    k_local = local_shard(repeat_interleave(k, tp // Hkv, dim=1), 1, "tp", tp)

"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxshard.ops  # noqa: F401  (registers fxshard::attention and ring_attention)
from ..placement import Shard
from . import PassCtx
from .insert_collectives import collective_target
from .rules.attention import SOFTCAP, sdpa_args
from ..mesh import RING

aten = torch.ops.aten

__all__ = ["lower_attention_pass"]


def lower_attention_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    graph = gm.graph
    lowered = 0
    masks: dict = {}   # (mask node, axis) -> the mask with q's USP row layout, made once
    for node in list(graph.nodes):
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        if any(a[t].meta["val"].dim() != 4 for t in ("query", "key", "value")):
            assert SOFTCAP not in node.meta, node.format_node()  # eager_attention: 4-D only
            continue  # not [B, H, S, D]: the rule kept it whole, aten runs it
        if a["dropout_p"]:
            raise NotImplementedError(
                f"fxshard.parallelize: attention {node.name} has dropout_p={a['dropout_p']}; "
                f"fxshard runs inference graphs (put the model in eval mode)")
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        causal = bool(a["is_causal"])
        softcap = float(node.meta.get(SOFTCAP, 0.0))
        capped = (softcap,) if softcap else ()  # uncapped calls keep the short signature
        with graph.inserting_before(node):
            notes = node.meta.get("fxshard_notes", {})
            for axis in sorted(notes.get("kv_heads_replicated", ()),
                               key=ctx.mesh.axis_names.index):
                size = ctx.mesh.axis_size(axis)
                k, v = (_pick_kv_heads(graph, t, axis, size, ctx.mesh) for t in (k, v))
            ring = (notes.get("ring") or [None])[0]
            ulysses = (notes.get("ulysses") or [None])[0]
            segments, stride, kv_stride = 1, 0, 0
            if ulysses is not None:
                n_u = ctx.mesh.axis_size(ulysses)
                names = ctx.mesh.axis_names
                if ring is not None and names.index(ulysses) < names.index(ring):
                    # ulysses splits the sequence first: after the exchange a ring rank holds
                    # its piece of each of the n_u parts
                    segments = n_u
                    stride = q.meta["val"].shape[2] // n_u
                    kv_stride = k.meta["val"].shape[2] // n_u
                # else ring splits first: the exchange gathers the ring rank's own chunk whole
                q = _heads_for_sequence(graph, q, ulysses, n_u, ctx.mesh)
                if mask is not None:
                    mask = _mask_rows_for_heads(graph, mask, ulysses, n_u, ctx.mesh, masks)
                if notes.get("ulysses_kv_gather"):
                    k, v = (_pick_kv_heads(graph, _gather_sequence(graph, t, ulysses, n_u,
                                                                   ctx.mesh),
                                           ulysses, n_u, ctx.mesh) for t in (k, v))
                else:
                    k, v = (_heads_for_sequence(graph, t, ulysses, n_u, ctx.mesh)
                            for t in (k, v))
            if ring is not None:
                masked = (softcap, mask) if mask is not None else capped
                att = graph.call_function(
                    torch.ops.fxshard.ring_attention.default,
                    (q, k, v, causal, a["scale"], ring, ctx.mesh.axis_size(ring), segments,
                     stride, ring in ctx.zigzag_axes, kv_stride) + masked)
            else:
                att = graph.call_function(torch.ops.fxshard.attention.default,
                                          (q, k, v, mask, causal, a["scale"], 0, 0)
                                          + capped)
            att.meta.update({key: node.meta[key] for key in ("fxshard_stage",)
                             if key in node.meta})
            out = graph.call_function(operator.getitem, (att, 0))
            if ulysses is not None:
                out.meta.update(node.meta)
                out.meta["fxshard_spec"] = q.meta["fxshard_spec"]
                out = graph.call_function(collective_target("all_to_all"),
                                          (out, 2, 1, ulysses, ctx.mesh.axis_size(ulysses)))
        out.meta.update(node.meta)
        att.meta["val"] = (node.meta["val"], None)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        lowered += 1
    ctx.report("lower_attention_pass", lowered_attentions=lowered)
    return gm


def _pick_kv_heads(graph: fx.Graph, t: fx.Node, axis: str, size: int, mesh) -> fx.Node:
    """Rank r of ``axis`` keeps the KV head its query heads use: of the ``n`` KV heads this
    rank holds, head ``r // (size // n)`` (``n`` counts the split by outer axes, e.g. tp)."""
    val, spec = t.meta["val"], list(t.meta["fxshard_spec"])
    n = val.shape[1]
    for m, p in zip(mesh.shape, spec):
        if m > 1 and isinstance(p, Shard) and p.dim == 1:
            n //= m
    factor = size // n
    rep = graph.call_function(aten.repeat_interleave.self_int, (t, factor, 1))
    rep.meta["val"] = val.new_empty((val.shape[0], val.shape[1] * factor, *val.shape[2:]))
    rep.meta["fxshard_spec"] = tuple(spec)
    out = graph.call_function(collective_target("local_shard"), (rep, 1, axis, size))
    spec[mesh.axis_names.index(axis)] = Shard(1)
    out.meta["val"] = rep.meta["val"]
    out.meta["fxshard_spec"] = tuple(spec)
    return out


def _relabel(node: fx.Node, src: fx.Node, axis: str, placement, mesh) -> fx.Node:
    spec = list(src.meta["fxshard_spec"])
    spec[mesh.axis_names.index(axis)] = placement
    node.meta["val"] = src.meta["val"]
    node.meta["fxshard_spec"] = tuple(spec)
    return node


def _heads_for_sequence(graph: fx.Graph, t: fx.Node, axis: str, size: int, mesh) -> fx.Node:
    """Ulysses inside USP: trade this axis's sequence shard for a heads shard. The received
    sequence chunks (one per coordinate of ``axis``) become the segments ring attention sees;
    the spec written here only sizes the local block."""
    out = graph.call_function(collective_target("all_to_all"), (t, 1, 2, axis, size))
    return _relabel(out, t, axis, Shard(1), mesh)


def _mask_rows_for_heads(graph: fx.Graph, mask: fx.Node, axis: str, size: int, mesh,
                         memo: dict) -> fx.Node:
    """USP: the mask's query rows take q's layout after ``_heads_for_sequence``. A mask that
    is only a local slice of a whole one (HF builds it whole on every rank) is re-sliced into
    that layout, no communication (``_mask_rows_resliced``); otherwise rows sharded on
    ``axis`` are gathered (heads dim broadcast) or traded for the mask's heads (all-to-all, as
    q; ALiBi's per-head bias). A broadcast row stays. Once per (mask, axis): the layers that
    share a mask share its exchange (``memo``)."""
    if (mask, axis) not in memo:
        val = mask.meta["val"]
        rows, heads = val.dim() - 2, val.dim() - 3
        per_head = heads >= 0 and val.shape[heads] > 1
        here = mask.meta["fxshard_spec"][mesh.axis_names.index(axis)]
        if not isinstance(here, Shard):
            assert val.shape[rows] == 1, mask.format_node()  # one row for every query
            out = mask
        else:
            assert here.dim == rows, mask.format_node()
            heads = heads if per_head else None
            out = _mask_rows_resliced(graph, mask, axis, size, mesh, rows, heads)
            if out is None:
                out = _mask_rows_exchanged(graph, mask, axis, size, mesh, rows, heads)
        memo[(mask, axis)] = out
    return memo[(mask, axis)]


def _mask_rows_exchanged(graph: fx.Graph, mask: fx.Node, axis: str, size: int, mesh,
                         rows: int, heads) -> fx.Node:
    """Rows sharded on ``axis`` gathered (``heads`` None: broadcast) or traded for heads."""
    if heads is None:
        out = graph.call_function(collective_target("all_gather"), (mask, rows, axis, size))
        return _relabel(out, mask, axis, torch.distributed.tensor.Replicate(), mesh)
    out = graph.call_function(collective_target("all_to_all"), (mask, heads, rows, axis, size))
    return _relabel(out, mask, axis, Shard(heads), mesh)


_SLICES = ("local_shard", "zigzag_shard")


def _mask_rows_resliced(graph: fx.Graph, mask: fx.Node, axis: str, size: int, mesh, rows: int,
                        heads) -> fx.Node | None:
    """The USP mask layout cut from the whole mask when ``mask`` is ``x`` sliced locally (rows
    on ``axis`` and on the ring axis; batch on dp, heads on tp kept as they are), else None.
    The Ulysses exchange concatenates every ``axis`` coordinate's rows: ring after ``axis``
    leaves each part's ring piece(s) side by side (cut part by part), ring before it the ring
    rank's own rows (the ``axis`` slice dropped). A per-head mask keeps this rank's share of
    its local heads, as the all-to-all leaves q::

        zigzag_shard(local_shard(x, 2, 'ulysses_cp', 2), 2, 'ring_cp', 2)   ->
        cat([zigzag_shard(x[:, :, :8], 2, 'ring_cp', 2), zigzag_shard(x[:, :, 8:], ...)], 2)
    """
    steps, x = [], mask
    while x.op == "call_function" and x.target in [collective_target(o) for o in _SLICES]:
        steps.append(x)
        x, = x.all_input_nodes
    steps.reverse()
    row_steps = [n for n in steps if n.args[1] == rows]
    if [n.args[2] for n in row_steps] not in ([axis, RING], [RING, axis]) or \
            any(n.args[2] in (axis, RING) for n in steps if n not in row_steps) or \
            any(isinstance(p, Shard) and p.dim == rows for p in x.meta["fxshard_spec"]):
        return None
    stage = {k: mask.meta[k] for k in ("fxshard_stage",) if k in mask.meta}

    def apply(t: fx.Node, target, args, val, axis_placement) -> fx.Node:
        out = graph.call_function(target, (t, *args))
        spec = list(t.meta["fxshard_spec"])
        if axis_placement is not None:
            spec[mesh.axis_names.index(axis_placement[0])] = axis_placement[1]
        out.meta.update(stage, val=val, fxshard_spec=tuple(spec))
        return out

    ring = row_steps[1] if row_steps[0].args[2] == axis else row_steps[0]
    t = x
    for n in steps:   # the other slices (batch on dp, heads on tp) as they were
        if n not in row_steps:
            t = apply(t, n.target, n.args[1:], x.meta["val"], (n.args[2], Shard(n.args[1])))
    whole = x.meta["val"]
    if ring is row_steps[1]:   # ring inside each of the axis's parts
        part = whole.shape[rows] // size
        pieces = []
        for u in range(size):
            val = _resized(whole, rows, part)
            cut = apply(t, aten.slice.Tensor, (rows, u * part, (u + 1) * part), val, None)
            pieces.append(apply(cut, ring.target, ring.args[1:], val,
                                (RING, Shard(rows))))
        t = graph.call_function(aten.cat.default, (pieces, rows))
        spec = list(pieces[0].meta["fxshard_spec"])
        t.meta.update(stage, val=whole, fxshard_spec=tuple(spec))
    else:
        t = apply(t, ring.target, ring.args[1:], whole, (RING, Shard(rows)))
    if heads is not None:
        t = apply(t, collective_target("local_shard"), (heads, axis, size), whole,
                  (axis, Shard(heads)))
    return t


def _resized(val, dim: int, n: int):
    shape = list(val.shape)
    shape[dim] = n
    return val.new_empty(shape)


def _gather_sequence(graph: fx.Graph, t: fx.Node, axis: str, size: int, mesh) -> fx.Node:
    """K/V with too few heads to split over ``axis``: gather its sequence segments instead."""
    out = graph.call_function(collective_target("all_gather"), (t, 2, axis, size))
    return _relabel(out, t, axis, torch.distributed.tensor.Replicate(), mesh)
