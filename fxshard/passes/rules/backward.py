"""Rules for the ops of a joint forward+backward graph (``fxshard.training``).

Layout legend: q/out/grad_out ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``, lse ``[B, Hq, S]``.

aot_autograd's joint graph holds the backend op SDPA dispatches to and aten's backward ops;
each gets a rule like any forward op, so the gradient collectives come from the same
redistribution table::

    _scaled_dot_product_flash_attention_for_cpu(q: S(1), k: S(1), v: S(1))
        -> [out S(1), lse S(1)]                       (heads on tp; batch S(0) alike)
    _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse)
        -> [grad_q, grad_k, grad_v] on the same heads / batch shard
    embedding_dense_backward(grad: S(0) [B, S, E], ids: S(0) [B, S]) -> P [V, E]
        (each rank scatters its own tokens' rows; the sum over ranks is the gradient)
    embedding_dense_backward(grad: R, ids: R) -> S(0)   (a vocab-sharded table: the rank's
        rows; on tp a token shard, sequence parallelism, is gathered first where the table
        has more rows than there are tokens: B·S·E bytes, not V·E)
    embedding_dense_backward(grad: S(2), ids: R)      -> S(1)   (the embed_dim table shard;
        a whole grad is sliced to the columns first when the table is S(1): node.meta
        ["fxshard_want"], the gradient's target placement, which the training driver sets)
    slice_backward(grad: S(0) [B, H, S, 8], [B, H, S, 16], dim=3, 8, end) -> S(0)
        (zero-padding along the sliced dim; a shard of that dim is gathered first)
    slice_backward(grad: S(2) [B, S, 48], [B, S, 96], dim=2, 0, 48) -> S(2|48+24+24)
        (q of a fused qkv: padded into the fused layout the forward sliced it from)
    slice_backward(grad: P [12, 48], [72, 48], dim=0, 48, 60) -> S(0|48+R12+R12)
        (a part the fused layout keeps whole, K of a multi-query qkv: reduced first)
    _softmax_backward_data(grad, out, dim=-1): the softmax dim whole, others pass through

    grouped_mm_fallback_backward(x[S, K], w[E, K, N], offs[E], grad[S, N]) -> [grad_x, grad_w]
        column-parallel w S(2) (gate_up S(2|I+I)), grad S(1): grad_x P, grad_w as w;
        row-parallel w S(1), x S(1), grad R: grad_x S(1), grad_w S(1); the rank's own
        routed rows (dp, ``token_local``): grad_x S(0), grad_w P (the experts' partial sums)

Pointwise backward ops (``silu_backward``, ``threshold_backward``, ``gelu_backward``) carry
torch's pointwise tag and use the pointwise rule; ``mm``/``t``/``sum`` are forward rules.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ...mesh import EP
from ...placement import P, R, Partial, Shard, StridedShard, shard_dim
from . import Decision, RuleCtx, rule, tensor_inputs, token_local
from .linear import fused_out
from .attention_cp import sequence_decision

aten = torch.ops.aten

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _attention(node: fx.Node, ins: list, ctx: RuleCtx, q: fx.Node, k: fx.Node,
               mask: fx.Node | None, n_out: int, dropout_p: float) -> Decision:
    """Batch (dim 0) or heads (dim 1) shards pass through attention; every tensor input but
    the mask is ``[B, H, ...]``; a mask follows where it has that dim whole."""
    if dropout_p:
        raise NotImplementedError(
            f"fxshard.training: attention {node.name} has dropout_p={dropout_p} in the joint "
            f"graph; dropout trains where the forward export holds it (aten.dropout, "
            f"aten.scaled_dot_product_attention's dropout_p: fxshard/training/dropout.py "
            f"draws those masks alike on every rank), not a fused attention op's own. "
            f"Call F.scaled_dot_product_attention or use dropout 0")
    cp = sequence_decision(node, ins, ctx, q, k, mask, n_out)   # ring_cp / ulysses_cp
    if cp is not None:
        return cp
    tensors = tensor_inputs(node)
    anchor = next((p.dim for p in ins if isinstance(p, Shard) and p.dim in (0, 1)), None)
    if anchor is None:
        return Decision(ins=[R] * len(ins), out=[R] * n_out)
    if anchor == 1:
        hq, hkv = ctx.shape(q)[1], ctx.shape(k)[1]
        if hq % ctx.size or hkv % ctx.size:
            raise NotImplementedError(
                f"fxshard.training: attention {node.name} has {hq} query and {hkv} key/value "
                f"heads, which mesh axis {ctx.axis!r} of size {ctx.size} (mesh "
                f"{ctx.mesh.describe()}) cannot split evenly (KV heads fewer than the axis are "
                f"repeated first, fxshard/training/gqa.py). Use a {ctx.axis} size that divides "
                f"{hq} and {hkv} or is a multiple of {hkv} dividing {hq}")
    elif any(ctx.shape(t)[0] != ctx.shape(q)[0] for t in tensors if t is not mask):
        return Decision(ins=[R] * len(ins), out=[R] * n_out)
    need = []
    for t in tensors:
        if t is mask:
            md = anchor + ctx.ndim(t) - 4
            whole = ctx.shape(q)[anchor]
            need.append(Shard(md) if md >= 0 and ctx.shape(t)[md] == whole and whole > 1
                        else R)
        else:
            need.append(Shard(anchor))
    return Decision(ins=need, out=[Shard(anchor)] * n_out)


def _kw(node: fx.Node, names: list[str], defaults: dict) -> dict:
    out = dict(defaults)
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


@rule(_FLASH)
def flash_attention_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a = _kw(node, ["query", "key", "value", "dropout_p", "is_causal"],
            dict(dropout_p=0.0, attn_mask=None))
    return _attention(node, ins, ctx, a["query"], a["key"], a["attn_mask"], 2, a["dropout_p"])


@rule(_FLASH_BACKWARD)
def flash_attention_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a = _kw(node, ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p",
                   "is_causal"], dict(dropout_p=0.0, attn_mask=None))
    return _attention(node, ins, ctx, a["query"], a["key"], a["attn_mask"], 3, a["dropout_p"])


@rule(aten.embedding_dense_backward.default)
def embedding_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``embedding_dense_backward(grad[..., E], ids[...], V, padding_idx, scale_by_freq)``."""
    grad, ids = ins
    g, i = tensor_inputs(node)
    last = ctx.ndim(g) - 1
    by_freq = len(node.args) > 4 and node.args[4]
    want = node.meta.get("fxshard_want")   # the table's placement (fxshard.training)
    if isinstance(grad, Shard) and grad.dim == last or \
            want is not None and want[ctx.mesh.axis_names.index(ctx.axis)] == Shard(1):
        # the rank's columns of the table: the grad moved to its hidden shard (an all-to-all
        # of activations, not a reduce-scatter of the whole table's gradient)
        return Decision(ins=[Shard(last), R], out=Shard(1))
    if isinstance(grad, Partial):
        return Decision(ins=[P, R], out=P)
    token = next((p for p in (grad, ids) if isinstance(p, Shard) and p.dim < ctx.ndim(i)), None)
    vocab_table = want is not None and want[ctx.mesh.axis_names.index(ctx.axis)] == Shard(0) \
        or _forward_table(node, i, ctx) == Shard(0)
    if token is not None and not by_freq and \
            not (ctx.is_tp and vocab_table and node.args[2] > math.prod(ctx.shape(i))):
        # every rank scatters its own tokens' rows: a partial sum of the table's gradient
        # (a table vocab-sharded on tp, with more rows than tokens, under sequence
        # parallelism: the tokens' gradient gathered instead, below, moves fewer bytes than
        # reducing the [V, E] partial sum; fsdp's shards are reduce-scattered as any weight's)
        return Decision(ins=[token, token], out=P)
    if vocab_table and not by_freq:
        # a vocab-sharded table: each rank the gradient of its rows (fxshard.training's
        # localize makes it fxshard::vocab_embedding_backward); a tied table's gradient is
        # not the program's output itself (the lm_head's is added to it): the forward
        # lookup's table says where it lives
        return Decision(ins=[R, R], out=Shard(0))
    return Decision(ins=[R, R], out=R)


def _forward_table(node: fx.Node, ids: fx.Node, ctx: RuleCtx):
    """The placement on ``ctx.axis`` that the forward's lookup with ``ids`` (and as many rows
    as ``node``, an ``embedding_dense_backward``) reads its table in, or None."""
    for u in ids.users:
        if u.target is aten.embedding.default and u.args[1] is ids and \
                isinstance(u.args[0], fx.Node) and \
                tuple(u.args[0].meta["val"].shape)[0] == node.args[2]:
            need = u.meta.get("fxshard_need")   # set: the forward lookup came first
            if need:
                return need[0][ctx.mesh.axis_names.index(ctx.axis)]
    return None


def _padded_dim(node: fx.Node) -> int:
    n = len(node.args[1])
    return node.args[2] % n


def _slice_bounds(node: fx.Node) -> tuple[int, int]:
    """``[start, end)`` of a ``slice_backward``'s slice, normalized to its padded dim."""
    size = node.args[1][_padded_dim(node)]
    start, end = node.args[3], min(node.args[4], size)
    return (start + size if start < 0 else start), (end + size if end < 0 else end)


def _fused_source(node: fx.Node, ctx: RuleCtx):
    """The fused (strided) placement on this axis of the tensor the forward sliced
    (``meta["fxshard_sliced"]``, set by ``fxshard.training.refine``), when it strides the
    padded dim with unit steps."""
    src = node.meta.get("fxshard_sliced")
    # (a weight entering the joint graph as an input: the placement it arrives in)
    spec = (src.meta.get("fxshard_then") or src.meta.get("fxshard_spec")) \
        if src is not None else None
    if not isinstance(spec, tuple) or (len(node.args) > 5 and node.args[5] != 1):
        return None
    q = spec[ctx.mesh.axis_names.index(ctx.axis)]
    return q if isinstance(q, StridedShard) and q.dim == _padded_dim(node) else None


@rule(aten.slice_backward.default)
def slice_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``slice_backward(grad, input_sizes, dim, start, end, step)``: ``grad`` zero-padded back
    to ``input_sizes`` along ``dim``; shards of other dims and partial sums pass through."""
    p = ins[0]
    fused = _fused_source(node, ctx)
    if fused is not None and p == fused_out(fused, *_slice_bounds(node)):
        # the gradient of one part of a fused projection's output (q of qkv): padded to the
        # whole fused dim in its layout, each rank its share of the part (no gather)
        return Decision(ins=[p], out=fused)
    if fused is not None and fused.whole and fused_out(fused, *_slice_bounds(node)) == R:
        # a part every rank holds whole (a multi-query qkv's K/V weight rows trained per
        # part, fxshard.training.joint._Differentiable): its gradient reduced, then padded
        return Decision(ins=[R], out=fused)
    if isinstance(p, Shard) and p.dim != _padded_dim(node):
        return Decision(ins=[p], out=p)
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    return Decision(ins=[R], out=R)


@rule(aten.select_backward.default)
def select_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``select_backward(grad, input_sizes, dim, index)``: ``grad`` placed at ``index`` of a
    new dim ``dim`` (zeros elsewhere)."""
    p = ins[0]
    dim = _padded_dim(node)
    if isinstance(p, Shard):
        return Decision(ins=[p], out=Shard(p.dim + (p.dim >= dim)))
    if isinstance(p, Partial):
        return Decision(ins=[P], out=P)
    return Decision(ins=[R], out=R)


@rule(aten._softmax_backward_data.default)   # _log_softmax_backward_data: rules/loss.py
def softmax_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``_softmax_backward_data(grad, out, dim, dtype)``: the softmax dim whole."""
    nd = ctx.ndim(node)
    dim = node.args[2] % nd
    if isinstance(ins[0], Partial) and not isinstance(ins[1], Partial):
        return Decision(ins=[P, R], out=P)    # linear in the incoming gradient
    shard = next((p for p in ins if isinstance(p, Shard) and p.dim != dim), None)
    if shard is not None:
        return Decision(ins=[shard, shard], out=shard)
    return Decision(ins=[R, R], out=R)


def _norm_leading(node: fx.Node, ins: list, ctx: RuleCtx, x: fx.Node, normalized: list):
    """A shard of a dim before the normalized ones (tokens), or None."""
    lead = ctx.ndim(x) - len(normalized)
    return next((p for p in ins if isinstance(p, Shard) and p.dim < lead), None)


@rule(aten.native_layer_norm.default)
def native_layer_norm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``native_layer_norm(x, normalized_shape, w, b, eps)`` -> (out, mean, rstd): token
    shards pass through (mean/rstd keep the leading dims); the normalized dims whole."""
    x = node.args[0]
    shard = _norm_leading(node, ins[:1], ctx, x, list(node.args[1]))
    if shard is None:
        return Decision(ins=[R] * len(ins), out=[R] * 3)
    return Decision(ins=[shard] + [R] * (len(ins) - 1), out=[shard] * 3)


@rule(aten.native_layer_norm_backward.default)
def native_layer_norm_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, mask)`` -> (grad_x,
    grad_w, grad_b): on token shards grad_x keeps the shard and the weight's gradients are
    partial sums; linear in ``grad`` (a Partial grad gives Partial gradients)."""
    tensors = tensor_inputs(node)
    x = node.args[1]
    n_w = len(tensors) - 4          # weight and bias, when given
    if isinstance(ins[0], Partial) and ctx.is_tp:
        # the input gradient of a column-parallel block (or lm_head): reduced before, once
        # (Megatron's), not after as three partial sums (grad_x and two [E] gradients); to
        # the tokens' shard where x holds one (sequence parallelism: a reduce-scatter, and
        # the norm's backward on the rank's tokens, as Megatron-SP; reduced whole, x, mean
        # and rstd were gathered for it)
        shard = _norm_leading(node, ins[1:2], ctx, x, list(node.args[2]))
        if shard is not None:
            return Decision(ins=[shard] * 4 + [R] * n_w, out=[shard, P, P])
        return Decision(ins=[R] * len(ins), out=[R] * 3)
    if isinstance(ins[0], Partial) and not any(isinstance(p, Partial) for p in ins[1:]):
        return Decision(ins=[P] + [R] * (len(ins) - 1), out=[P] * 3)
    shard = _norm_leading(node, ins[:2], ctx, x, list(node.args[2]))
    if shard is None:
        return Decision(ins=[R] * len(ins), out=[R] * 3)
    return Decision(ins=[shard] * 4 + [R] * n_w, out=[shard, P, P])


@rule("transformers::grouped_mm_fallback_backward")
def grouped_mm_backward_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """The experts' grouped matmul's backward, placed as its forward (``rules/experts.py``)."""
    tensors = tensor_inputs(node)
    whole = Decision(ins=[R] * len(ins), out=[R, R])
    if len(tensors) != 4 or [ctx.ndim(t) for t in tensors] != [2, 3, 1, 2]:
        return whole
    x, w, _, g = ins
    if token_local(node, ctx) and 0 in (shard_dim(x), shard_dim(g)):
        # the rows as the region holds them: Shard(0) on a batch axis, the flattened tokens'
        # fused layout (each sequence's zigzag share) on ring_cp
        rows = x if shard_dim(x) == 0 else g
        if ctx.axis == EP:   # whole experts by index: each holds every row routed to it
            return Decision(ins=[rows, Shard(0), P, rows], out=[rows, Shard(0)])
        return Decision(ins=[rows, R, P, rows], out=[rows, P])
    if isinstance(w, StridedShard) and w.dim == 2 and not w.whole:     # fused column-parallel
        return Decision(ins=[R, w, R, StridedShard(1, w.parts)], out=[P, w])
    if isinstance(w, Shard) and w.dim == 2:                            # column-parallel
        return Decision(ins=[R, w, R, Shard(1)], out=[P, w])
    if isinstance(w, Shard) and w.dim == 1:                            # row-parallel
        return Decision(ins=[Shard(1), w, R, R], out=[Shard(1), w])
    if isinstance(g, Partial) and not any(isinstance(p, Partial) for p in (x, w)):
        return Decision(ins=[R, R, R, P], out=[P, P])                  # linear in grad
    return whole
