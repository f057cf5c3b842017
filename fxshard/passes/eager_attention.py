"""Recognise eager attention and turn it into ``scaled_dot_product_attention``.

HuggingFace's ``eager`` attention (and hand-written attention) computes
``softmax(q @ k^T * scale + mask) @ v`` with plain matmuls. As SDPA it gets the attention rule
and ``lower_attention``: local fused attention, Ulysses or ring attention on the CP axes, instead
of K and V gathered along the sequence. A constant additive causal mask (0 on and below the
diagonal, a huge negative number above; evaluated from ``ctx.constants``) becomes
``is_causal=True``; any other mask is passed
on as SDPA's additive ``attn_mask`` (same arithmetic). Gemma-2's tanh soft-cap of the scaled
scores (``tanh(s / cap) * cap`` before the mask) is recognised by what the numbers compute, in
any order (``cap * tanh(s * (1 / cap))``, the scale before or after): SDPA has no argument for
it, so the cap rides in ``node.meta["fxshard_softcap"]`` and ``lower_attention`` hands it to
the kernels (local, Ulysses and ring attention all apply it per score). BLOOM's form, heads
merged into the batch of ``bmm``/``baddbmm`` (``[B*H, S, D]``) with an ALiBi bias
``[B*H, 1, Skv]`` as ``baddbmm``'s input, becomes SDPA on the ``[B, H, S, D]`` tensors before
the merge, the bias viewed as ``[B, H, 1, Skv]`` and added to the mask (an explicit mask:
tp and Ulysses slice it by heads, ring_cp gathers around it). Scores changed in any other way
are left as they are, and the rules shard them: on a CP axis K and V are then all-gathered,
which ``explain()`` lists and ``strict=True`` refuses.

Before::

    kt = transpose(k, 2, 3); s = matmul(q, kt); s = mul(s, 0.25); s = div(s, 50.0)
    s = tanh(s); s = mul(s, 50.0); s = add(s, mask)
    p = softmax(s, -1, torch.float32); p = dropout(p, 0.0, False); o = matmul(p, v)

After::

    o = scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.25)
    (o.meta["fxshard_softcap"] = 50.0)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassCtx
from .fold_mask import MetaBuffer, _constant_value, is_additive_causal
from .rules.attention import SOFTCAP
from ..mesh import SEQUENCE_AXES

aten = torch.ops.aten

__all__ = ["eager_attention_pass"]

# copies and casts of the probabilities (``type_as(p, q)``: back to the queries' dtype)
_PASS_THROUGH = (aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default,
                 aten.contiguous.default, aten.detach.default, aten.type_as.default)


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_tensor(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _key_of(kt: fx.Node) -> fx.Node | None:
    """``k`` when ``kt`` is ``k`` with its last two dims swapped."""
    if kt.op != "call_function":
        return None
    nd = kt.meta["val"].dim()
    if kt.target is aten.transpose.int:
        dims = {kt.args[1] % nd, kt.args[2] % nd}
        return kt.args[0] if dims == {nd - 2, nd - 1} else None
    if kt.target is aten.permute.default:
        perm = [d % nd for d in kt.args[1]]
        want = list(range(nd - 2)) + [nd - 1, nd - 2]
        return kt.args[0] if perm == want else None
    return None


def _scalar_factor(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(x, c)`` when ``node`` multiplies one tensor ``x`` (used only here) by a Python number:
    ``x * c``, ``c * x`` or ``x / c`` (``c`` the factor, ``1 / c`` for a division)."""
    if node.op != "call_function" or node.target not in (aten.mul.Tensor, aten.div.Tensor) \
            or len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if node.target is aten.mul.Tensor and not _is_tensor(x):
        x, c = c, x
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not _is_tensor(x) or \
            _only_user(x) is not node or c == 0:
        return None
    return x, float(c) if node.target is aten.mul.Tensor else 1.0 / float(c)


def _factors(node: fx.Node) -> tuple[fx.Node, float]:
    """Walk back a chain of multiplications/divisions by numbers: ``(start, product)``."""
    prod = 1.0
    while (f := _scalar_factor(node)) is not None:
        node, prod = f[0], prod * f[1]
    return node, prod


def _scores_of(scores: fx.Node) -> tuple[fx.Node, float, float]:
    """``(m, scale, softcap)`` with ``scores == cap * tanh(scale * m / cap)`` (``softcap``
    0.0: ``scores == scale * m``), recognised by what the ops compute, in any order: numbers
    multiplying or dividing before and after one ``tanh`` (``tanh(s / c) * c``,
    ``c * tanh(s * (1 / c))``, the scale before or after either) fold into ``post * tanh(pre *
    m)``, which is the soft-cap ``post`` of the scores scaled by ``pre * post``."""
    inner, post = _factors(scores)
    if inner.target is aten.tanh.default and _is_tensor(inner.args[0]) and \
            _only_user(inner.args[0]) is inner and post > 0:
        m, pre = _factors(inner.args[0])
        return m, pre * post, post
    return inner, post, 0.0


def _match(softmax: fx.Node):
    """(q, k, v, mask, scale, softcap, final matmul) of an eager attention ending at
    ``softmax``; softcap 0.0 when the scores are not soft-capped."""
    nd = softmax.meta["val"].dim()
    if nd != 4 or softmax.args[1] % nd != nd - 1:
        return None
    scores, mask = softmax.args[0], None
    if scores.target is aten.add.Tensor and all(_is_tensor(a) for a in scores.args[:2]) and \
            _only_user(scores) is softmax:
        scores, mask = scores.args[0], scores.args[1]
    if _only_user(scores) is None:
        return None
    scores, scale, softcap = _scores_of(scores)
    if scores.target is not aten.matmul.default or _only_user(scores) is None:
        return None
    q, kt = scores.args[0], scores.args[1]
    k = _key_of(kt) if _is_tensor(kt) else None
    if k is None or q.meta["val"].dim() != 4 or k.meta["val"].dim() != 4:
        return None
    probs, out = softmax, _only_user(softmax)
    while out is not None and (out.target in _PASS_THROUGH or (
            out.target is aten.dropout.default and (not out.args[2] or out.args[1] == 0))):
        probs, out = out, _only_user(out)
    # (dropout counts as impure for dead-code elimination: the pass erases the chain itself)
    # the probabilities must be the left operand: x @ softmax(...) is no attention
    if out is None or out.target is not aten.matmul.default or out.args[0] is not probs or \
            out.args[1] is probs:
        return None
    v = out.args[1]
    if not _is_tensor(v) or v.meta["val"].dim() != 4 or \
            v.meta["val"].shape[2] != k.meta["val"].shape[2]:
        return None
    if mask is not None and mask.meta["val"].dtype != q.meta["val"].dtype:
        return None
    return q, k, v, mask, float(scale), softcap, out


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _unmerged_heads(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` views a 4-D ``x`` ``[B, H, S, D]`` as ``[B*H, S, D]``."""
    if not _is_tensor(node) or node.target not in _VIEWS or not _is_tensor(node.args[0]):
        return None
    x = node.args[0]
    b, h, sq, d = (tuple(x.meta["val"].shape) + (None,) * 4)[:4]
    if x.meta["val"].dim() != 4 or tuple(node.meta["val"].shape) != (b * h, sq, d):
        return None
    return x


def _match_batched(softmax: fx.Node):
    """(q, k, v, mask, scale, bias, final view) of BLOOM's attention ending at ``softmax``:
    ``view(baddbmm(bias, q3, k3^T, alpha=scale) | bmm(q3, k3^T), [B, H, Sq, Skv])`` (+ mask),
    softmax, ``bmm(view(p, [B*H, Sq, Skv]), v3)`` viewed back to ``[B, H, Sq, D]``, where
    ``q3``/``k3``/``v3`` view ``[B, H, S, D]`` tensors as ``[B*H, S, D]``."""
    if softmax.meta["val"].dim() != 4 or softmax.args[1] % 4 != 3:
        return None
    scores, mask = softmax.args[0], None
    if scores.target is aten.add.Tensor and all(_is_tensor(a) for a in scores.args[:2]) and \
            _only_user(scores) is softmax:
        scores, mask = scores.args[0], scores.args[1]
    if scores.target not in _VIEWS or _only_user(scores) is None:
        return None
    s3 = scores.args[0]
    if not _is_tensor(s3) or _only_user(s3) is not scores:
        return None
    bias, scale = None, 1.0
    if s3.target is aten.baddbmm.default:
        opts = dict(zip(("beta", "alpha"), s3.args[3:])) | dict(s3.kwargs)
        if opts.get("beta", 1) != 1 or not _is_tensor(s3.args[0]):
            return None
        bias, q3, kt3, scale = s3.args[0], s3.args[1], s3.args[2], opts.get("alpha", 1)
    elif s3.target is aten.bmm.default:
        q3, kt3 = s3.args
    else:
        return None
    q = _unmerged_heads(q3)
    k3 = _key_of(kt3) if _is_tensor(kt3) else None
    k = _unmerged_heads(k3) if k3 is not None else None
    if q is None or k is None or not isinstance(scale, (int, float)):
        return None
    probs, nxt = softmax, _only_user(softmax)
    while nxt is not None and (nxt.target in _PASS_THROUGH or (
            nxt.target is aten.dropout.default and (not nxt.args[2] or nxt.args[1] == 0))):
        probs, nxt = nxt, _only_user(nxt)
    if nxt is None or nxt.target not in _VIEWS:
        return None
    p3, bmm = nxt, _only_user(nxt)
    if bmm is None or bmm.target is not aten.bmm.default or bmm.args[0] is not p3:
        return None
    v = _unmerged_heads(bmm.args[1])
    out = _only_user(bmm)
    if v is None or out is None or out.target not in _VIEWS or \
            tuple(out.meta["val"].shape) != tuple(q.meta["val"].shape[:3]) + (
                v.meta["val"].shape[3],):
        return None
    b, h, sq, _ = q.meta["val"].shape
    skv = k.meta["val"].shape[2]
    if tuple(k.meta["val"].shape[:2]) != (b, h) or tuple(v.meta["val"].shape[:3]) != (b, h, skv):
        return None
    if bias is not None:
        shape = tuple(bias.meta["val"].shape)
        if len(shape) != 3 or shape[0] != b * h or shape[1] not in (1, sq) or shape[2] != skv:
            return None
    if mask is not None and mask.meta["val"].dtype != q.meta["val"].dtype:
        return None
    return q, k, v, mask, float(scale), bias, out


def _bias_into_mask(graph: fx.Graph, bias: fx.Node, mask: fx.Node | None, q: fx.Node,
                    like: fx.Node) -> fx.Node:
    """``bias`` ``[B*H, 1|Sq, Skv]`` viewed as ``[B, H, 1|Sq, Skv]`` (+ ``mask``): the additive
    mask SDPA takes (inserted before ``like``, whose meta it copies but for the value)."""
    b, h = q.meta["val"].shape[:2]
    shape = [b, h, *bias.meta["val"].shape[1:]]
    meta = {k: v for k, v in like.meta.items() if k != "val"}
    with graph.inserting_before(like):
        bias4 = graph.call_function(aten.reshape.default, (bias, shape))
        bias4.meta.update(meta)
        bias4.meta["val"] = bias.meta["val"].reshape(shape)
        if mask is None:
            return bias4
        added = graph.call_function(aten.add.Tensor, (bias4, mask))
        added.meta.update(meta)
        added.meta["val"] = bias4.meta["val"] + mask.meta["val"]
    return added


def _changed_scores(softmax: fx.Node) -> list[str] | None:
    """The ops between ``q @ k^T`` and ``softmax`` of an attention :func:`_match` refused
    because its scores change beyond scale + soft-cap + mask (a ``baddbmm`` bias), or None
    when ``softmax`` does not take ``q @ k^T`` through elementwise ops at all."""
    from .rules import lookup
    from .rules.pointwise import identity_rule, pointwise_rule
    nd = softmax.meta["val"].dim()
    if nd != 4 or softmax.args[1] % nd != nd - 1:
        return None
    ops, cur = [], softmax.args[0]
    while _is_tensor(cur) and cur.op == "call_function" and len(ops) < 16:
        if cur.target in (aten.matmul.default, aten.bmm.default, aten.baddbmm.default):
            kt = cur.args[2 if cur.target is aten.baddbmm.default else 1]
            if cur.target is aten.baddbmm.default:
                ops.append("baddbmm (a bias added to q @ k^T, e.g. ALiBi)")
            return ops[::-1] if _is_tensor(kt) and _key_of(kt) is not None and ops else None
        if cur.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            cur = cur.args[0]
            continue
        if lookup(cur.target) not in (pointwise_rule, identity_rule):
            return None
        ops.append(str(cur.target).split(".")[1] if "." in str(cur.target) else str(cur.target))
        cur = next((a for a in cur.args if _is_tensor(a) and
                    a.meta["val"].shape == cur.meta["val"].shape), None)
    return None


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, recursively, the inputs it leaves without users."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


def _refuse_on_cp(softmax: fx.Node, ctx: PassCtx) -> None:
    """An attention whose scores change beyond scale + mask stays matmuls: on a CP axis its
    queries keep the sequence shard and K/V are all-gathered (correct, not ring/Ulysses).
    Listed in ``explain()``; ``strict=True`` refuses it."""
    ops = _changed_scores(softmax)
    axes = [a for a, n in zip(ctx.mesh.axis_names, ctx.mesh.shape)
            if n > 1 and a in SEQUENCE_AXES]
    if ops is None or not axes:
        return
    why = (f"scores change beyond scale + soft-cap + mask ({' -> '.join(ops)} between "
           f"q @ k^T and softmax): K and V are all-gathered along the sequence on "
           f"{', '.join(axes)} instead of ring/Ulysses attention")
    if ctx.strict:
        raise NotImplementedError(
            f"fxshard.parallelize(strict=True): attention at {softmax.name} on mesh "
            f"{ctx.mesh.describe()}: {why}. Use SDPA (or eager attention with only a scale, a "
            f"tanh soft-cap and a mask), a mesh without {' / '.join(axes)}, or drop "
            f"strict=True.")
    ctx.gathered.append((softmax.name, why))


def eager_attention_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    graph = gm.graph
    found = causal_n = capped_n = biased_n = 0
    ctx.gathered.clear()
    additive: dict[tuple, bool] = {}  # (mask node, sq, skv) -> a constant causal mask?
    for node in list(graph.nodes):
        if node.target not in (aten.softmax.int, aten._softmax.default) or not node.users:
            continue
        m, bias = _match(node), None
        if m is None:
            batched = _match_batched(node)
            if batched is not None:
                q, k, v, mask, scale, bias, out = batched
                m = q, k, v, mask, scale, 0.0, out
        if m is None:
            _refuse_on_cp(node, ctx)
            continue
        q, k, v, mask, scale, softcap, out = m
        causal = False
        if bias is not None:
            mask = _bias_into_mask(graph, bias, mask, q, out)
            biased_n += 1
        elif mask is not None:
            sq, skv = q.meta["val"].shape[2], k.meta["val"].shape[2]
            if (mask, sq, skv) not in additive:  # layers share one mask: evaluate it once
                try:
                    with torch.no_grad():
                        value = _constant_value(mask, ctx.constants)
                except MetaBuffer:  # fold_causal_mask_pass warns about it on the SDPA node
                    value = None
                additive[mask, sq, skv] = value is not None and \
                    is_additive_causal(value, sq, skv)
            if additive[mask, sq, skv]:
                mask, causal = None, True
                causal_n += 1
        with graph.inserting_before(out):
            sdpa = graph.call_function(aten.scaled_dot_product_attention.default,
                                       (q, k, v, mask, 0.0, causal), {"scale": scale})
        sdpa.meta.update(out.meta)
        if softcap:
            sdpa.meta[SOFTCAP] = softcap
            capped_n += 1
        out.replace_all_uses_with(sdpa)
        _erase_unused(graph, out)
        found += 1
    ctx.report("eager_attention_pass", attentions=found, causal_masks=causal_n,
               soft_capped=capped_n, biases_in_mask=biased_n)
    return gm
