"""Lower FlexAttention to attention fxshard already parallelises.

``torch.nn.attention.flex_attention`` exports as one higher-order op,
``torch.ops.higher_order.flex_attention(q, k, v, score_graph, block_mask, scale, options,
score_buffers, mask_buffers)``, whose ``mask_mod`` and ``score_mod`` are traced subgraphs on
scalar indices ``(b, h, q_idx, kv_idx)`` and whose ``block_mask`` tuple carries the block
sparsity tensors ``create_block_mask`` computed in the forward. No sharding rule can see into
it, PyTorch has no backward for it on CPU, and its block tensors are computed over the whole
sequence. This pass (run at the end of :func:`fxshard.trace.cleanup_pass`, so inference,
training and pipeline programs all start from the lowered graph) replaces each such op by
ordinary ATen ops, with the semantics of PyTorch's own reference implementation
(``torch._higher_order_ops.flex_attention.math_attention``):

- the indices become broadcast ``arange`` values, ``b [B,1,1,1]``, ``h [1,H,1,1]``,
  ``q_idx [1,1,L,1]``, ``kv_idx [1,1,1,S]``, and the ``mask_mod`` subgraph is inlined on them:
  its result is a boolean mask ``[B or 1, H or 1, L, S]`` (True where a key is seen). These
  are graph values over the global shapes, so the placements slice them like any other
  tensor: a rank that holds heads ``2..3`` on ``tp`` reads ``h == 2, 3``, a rank that holds a
  (zigzag) chunk of the sequence on ``ring_cp`` or ``ulysses_cp`` reads its global positions.
  Captured tensors (document ids of a packed row) are the op's ``mask_buffers`` and become the
  subgraph's inputs as they are;
- without a ``score_mod`` (the subgraph returns the score unchanged) the op becomes
  ``scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=...)``: fold_mask turns
  a mask that is plain causal into ``is_causal=True``; any other mask (documents, sliding
  windows) is SDPA's explicit mask, which tp and Ulysses slice by heads and ring attention
  reads row by row; lower_attention then picks the local, Ulysses or ring kernel (Triton on
  GPU) as for any SDPA;
- with a ``score_mod`` (a bias, a soft-cap, ALiBi) the scores are explicit:
  ``softmax(where(mask, score_mod(q @ k^T * scale), -inf)) @ v`` in float32 (float64 for
  float64 inputs), as PyTorch's reference computes them, through the ordinary rules (heads
  split on tp and Ulysses; on ring_cp K and V are gathered around them: no ring attention);
- the block sparsity tensors (``kv_num_blocks``, ``kv_indices``, ...) and the dense mask
  ``create_block_mask`` computed to find them have no user left and are removed. The blocks
  are an optimisation of the fused kernel; as in PyTorch's reference, the ``mask_mod``
  defines which keys are seen (a ``BlockMask`` made from blocks alone, with no
  ``mask_mod``, is read as all keys, as that reference reads it).

Backward: the lowered graph is ordinary ATen (SDPA or matmul/softmax), so aot_autograd
differentiates it on any device. Before::

    sdpa_mask0 = self.sdpa_mask0        # ge(q_idx, kv_idx) & eq(doc[b, q_idx], doc[b, kv_idx])
    flex = flex_attention(q, k, v, self.sdpa_score0, (8, 8, kv_num, kv_idx, ..., 128, 128,
                          sdpa_mask0), 0.35, {...}, (), (doc,))
    out = getitem(flex, 0)

After::

    b = view(arange(2), [2, 1, 1, 1]); h = view(arange(2), [1, 2, 1, 1])
    qi = view(arange(8), [1, 1, 8, 1]); ki = view(arange(8), [1, 1, 1, 8])
    ge = ge(qi, ki); i = index(doc, [b, qi]); j = index(doc, [b, ki]); eq = eq(i, j)
    mask = __and__(ge, eq)                                    # [2, 1, 8, 8]
    out = scaled_dot_product_attention(q, k, v, mask, scale=0.35)
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["lower_flex_attention_pass", "is_flex_attention"]

_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "fxshard_layer")


def is_flex_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and \
        getattr(node.target, "__name__", None) == "flex_attention" and \
        isinstance(node.target, torch._ops.HigherOrderOperator)


def _fake_mode(vals):
    from torch._guards import detect_fake_mode
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


class _Builder:
    """Inserts nodes before ``at``, each with the flex node's module stack (its layer, for
    the pipeline's stages) and its value computed on the trace's fake tensors."""

    def __init__(self, gm: fx.GraphModule, at: fx.Node):
        self.gm, self.graph, self.at = gm, gm.graph, at
        self.mode = _fake_mode([a.meta.get("val") for a in at.all_input_nodes])

    def op(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(target, tuple(args), kwargs)
        for key in _META_KEYS:
            if key in self.at.meta:
                node.meta[key] = self.at.meta[key]

        def val(a):
            return a.meta["val"] if isinstance(a, fx.Node) else a
        vargs = fx.node.map_arg(node.args, val)
        vkwargs = fx.node.map_arg(node.kwargs, val)
        if target is operator.getitem:
            node.meta["val"] = vargs[0][vargs[1]]
        else:
            with self.mode:
                node.meta["val"] = target(*vargs, **vkwargs)
        return node

    def inline(self, sub: fx.GraphModule, inputs: list, what: str) -> fx.Node:
        """``sub``'s nodes copied in front of the flex node, its placeholders bound to
        ``inputs``; returns the node its output names."""
        env: dict[fx.Node, object] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise NotImplementedError(
                f"fxshard.parallelize: flex_attention {self.at.name}'s {what} takes "
                f"{len(placeholders)} inputs where {len(inputs)} were expected "
                f"(b, h, q_idx, kv_idx and its captured tensors); this torch version's "
                f"flex_attention is not supported by fxshard's lowering")
        for p, x in zip(placeholders, inputs):
            env[p] = x
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = n.args[0]
                out = out[0] if isinstance(out, (tuple, list)) else out
                return env[out] if isinstance(out, fx.Node) else out
            if n.op != "call_function":
                raise NotImplementedError(
                    f"fxshard.parallelize: flex_attention {self.at.name}'s {what} contains "
                    f"{n.op} {n.target} (a tensor made inside the function?); fxshard inlines "
                    f"only functions of b, h, q_idx, kv_idx and captured tensors: capture the "
                    f"tensor from the forward's scope instead")
            env[n] = self.op(n.target, *fx.node.map_arg(n.args, env.__getitem__),
                             **fx.node.map_arg(n.kwargs, env.__getitem__))
        raise AssertionError("subgraph without output")


def _returns_input(sub: fx.GraphModule, index: int) -> bool:
    """Whether ``sub`` returns its ``index``-th placeholder unchanged (no score_mod)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out is placeholders[index]


def _submodule(gm: fx.GraphModule, node) -> fx.GraphModule:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(gm, node.target)
    if isinstance(node, fx.GraphModule):
        return node
    raise NotImplementedError(
        f"fxshard.parallelize: flex_attention's mask or score function is {node!r}, not a "
        f"traced subgraph; fxshard lowers flex_attention only as torch.export traces it")


def _indices(b: _Builder, q: torch.Tensor, s_kv: int) -> list[fx.Node]:
    """``b, h, q_idx, kv_idx`` as int64 ``arange`` values broadcast over ``[B, H, L, S]``."""
    n_b, n_h, n_q = q.shape[0], q.shape[1], q.shape[2]
    out = []
    for dim, n in enumerate((n_b, n_h, n_q, s_kv)):
        r = b.op(aten.arange.start, 0, n, device=q.device, pin_memory=False)
        shape = [1, 1, 1, 1]
        shape[dim] = n
        out.append(b.op(aten.view.default, r, shape))
    return out


def _mask(b: _Builder, mask_gm: fx.GraphModule, idx: list, buffers, q, s_kv) -> fx.Node:
    mask = b.inline(mask_gm, [*idx, *buffers], "mask_mod")
    val = mask.meta["val"] if isinstance(mask, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        raise NotImplementedError(
            f"fxshard.parallelize: flex_attention {b.at.name}'s mask_mod returns "
            f"{type(val).__name__ if val is None else val.dtype}, not a boolean tensor; "
            f"a mask_mod must return a torch.bool value of (b, h, q_idx, kv_idx)")
    full = list(torch.broadcast_shapes(val.shape, (1, 1, q.shape[2], s_kv)))
    if list(val.shape) != full:
        mask = b.op(aten.expand.default, mask, full)
    return mask


def _explicit(b: _Builder, q, k, v, score_gm, idx, mask, scale, buffers, gqa: int):
    """``softmax(where(mask, score_mod(q @ k^T * scale), -inf)) @ v`` and the log-sum-exp
    in base 2 (the op's second output), as PyTorch's reference computes them."""
    qv = q.meta["val"]
    wp = torch.float64 if qv.dtype == torch.float64 else torch.float32
    if gqa > 1:   # each KV head serves ``gqa`` consecutive query heads
        def repeat(t):
            tv = t.meta["val"]
            e = b.op(aten.unsqueeze.default, t, 2)
            e = b.op(aten.expand.default, e, [tv.shape[0], tv.shape[1], gqa, *tv.shape[2:]])
            return b.op(aten.reshape.default, e,
                        [tv.shape[0], tv.shape[1] * gqa, *tv.shape[2:]])
        k, v = repeat(k), repeat(v)

    def cast(t, dtype):
        return t if t.meta["val"].dtype == dtype else \
            b.op(aten._to_copy.default, t, dtype=dtype)
    kt = b.op(aten.transpose.int, cast(k, wp), -2, -1)
    scores = b.op(aten.mul.Tensor, b.op(aten.matmul.default, cast(q, wp), kt), scale)
    scores = b.inline(score_gm, [scores, *idx, *buffers], "score_mod")
    masked = b.op(aten.masked_fill.Scalar, scores, b.op(aten.logical_not.default, mask),
                  float("-inf"))
    probs = b.op(aten._safe_softmax.default, masked, -1)
    out = b.op(aten.matmul.default, cast(probs, qv.dtype), cast(v, qv.dtype))
    return _strided_like(b, out, qv), masked


def _strided_like(b: _Builder, out: fx.Node, qv: torch.Tensor) -> fx.Node:
    """``out`` laid out in memory as the query is (flex_attention's output is: a caller's
    ``out.transpose(1, 2).view(B, S, -1)`` relies on it)."""
    order = sorted(range(qv.dim()), key=lambda d: -qv.stride(d))
    if order == list(range(qv.dim())):
        return out
    inverse = [order.index(d) for d in range(qv.dim())]
    dense = b.op(aten.clone.default, b.op(aten.permute.default, out, order),
                 memory_format=torch.contiguous_format)
    return b.op(aten.permute.default, dense, inverse)


def _lse(b: _Builder, masked: fx.Node) -> fx.Node:
    lse = b.op(aten.logsumexp.default, masked, [-1])
    return b.op(aten.mul.Tensor, lse, 1.0 / math.log(2.0))


def _lower_one(gm: fx.GraphModule, node: fx.Node) -> None:
    args = list(node.args) + [()] * (9 - len(node.args))
    q, k, v, score_ref, block, scale, _options, score_bufs, mask_bufs = args[:9]
    score_bufs = list(node.kwargs.get("score_mod_other_buffers", score_bufs) or ())
    mask_bufs = list(node.kwargs.get("mask_mod_other_buffers", mask_bufs) or ())
    uses = {}
    for user in node.users:
        if user.target is not operator.getitem:
            raise NotImplementedError(
                f"fxshard.parallelize: flex_attention {node.name} is used by {user.name} "
                f"({user.target}) other than through its outputs; not supported")
        uses.setdefault(user.args[1], []).append(user)
    if 2 in uses:
        raise NotImplementedError(
            f"fxshard.parallelize: flex_attention {node.name}'s max scores "
            f"(return_aux=AuxRequest(max_scores=True)) are read; fxshard lowers the output "
            f"and the log-sum-exp only: drop max_scores")
    mask_gm = _submodule(gm, block[-1])
    score_gm = _submodule(gm, score_ref)
    qv, kv = q.meta["val"], k.meta["val"]
    if qv.shape[1] % kv.shape[1]:
        raise ValueError(
            f"fxshard.parallelize: flex_attention {node.name} has {qv.shape[1]} query heads "
            f"and {kv.shape[1]} key/value heads, which do not divide")
    gqa = qv.shape[1] // kv.shape[1]
    b = _Builder(gm, node)
    idx = _indices(b, qv, kv.shape[2])
    mask = _mask(b, mask_gm, idx, mask_bufs, qv, kv.shape[2])
    lse = None
    if _returns_input(score_gm, 0) and 1 not in uses:
        out = b.op(aten.scaled_dot_product_attention.default, q, k, v, mask, 0.0, False,
                   scale=scale, enable_gqa=gqa > 1)
    else:
        out, masked = _explicit(b, q, k, v, score_gm, idx, mask, scale, score_bufs, gqa)
        if 1 in uses:
            lse = _lse(b, masked)
    for i, users in uses.items():
        for user in users:
            user.replace_all_uses_with(out if i == 0 else lse)
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def lower_flex_attention_pass(gm: fx.GraphModule, *, ctx) -> fx.GraphModule:
    """Replace every ``flex_attention`` op of ``gm`` (see the module docstring); the block
    mask's tensors left without users and the subgraphs are removed."""
    nodes = [n for n in gm.graph.nodes if is_flex_attention(n)]
    for node in nodes:
        _lower_one(gm, node)
    if nodes:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
        ctx.report("lower_flex_attention_pass", lowered=len(nodes))
    return gm
