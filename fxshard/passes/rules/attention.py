"""``scaled_dot_product_attention`` (and the lowered ``fxshard.attention``).

Layout legend: q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Skv, D]``, mask ``[B|1, H|1, Sq, Skv]``.

- batch (dim 0): q, k, v and a batched mask follow the same shard;
- heads (dim 1, the ``tp`` axis): q, k, v split by heads. ``Hq`` must divide by the axis size
  (a ``ValueError`` otherwise). With grouped KV heads (``enable_gqa``) ``Hkv`` must divide too,
  or the KV heads are replicated and each rank picks the KV head of its query heads (the
  ``kv_heads_replicated`` note, applied by ``lower_attention``);
- sequence (dim 2, CP axes) and head_dim (dim 3): gathered to Replicate. Context parallelism
  (Ulysses/ring lowering) is not built yet, so a sequence shard is attended whole.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import R, Shard
from . import Decision, RuleCtx, rule, tensor_inputs

aten = torch.ops.aten


def sdpa_args(node: fx.Node) -> dict:
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa"]
    out = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


@rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a = sdpa_args(node)
    tensors = tensor_inputs(node)
    q, k, v = tensors[:3]
    mask = a["attn_mask"]
    hq, hkv = ctx.shape(q)[1], ctx.shape(k)[1]
    batch = ctx.shape(q)[0]
    if ctx.is_tp and hq % ctx.size:
        raise ValueError(
            f"fxshard.parallelize: attention {node.name} has {hq} query heads, which cannot be "
            f"split over mesh axis {ctx.axis!r} of size {ctx.size} (mesh "
            f"{ctx.mesh.describe()}). Use a {ctx.axis} size that divides {hq}.")
    anchor = None
    for p in ins[:3]:
        if isinstance(p, Shard) and p.dim in (0, 1):
            anchor = p.dim
            break
    if anchor is None:
        return Decision(ins=[R] * len(ins), out=R)

    def mask_need(dim):
        if mask is None or not isinstance(mask, fx.Node):
            return []
        mshape = ctx.shape(mask)
        full = 1 if dim == 1 else batch
        off = len(mshape) - 4
        md = dim + off
        return [Shard(md) if md >= 0 and mshape[md] == full and full > 1 else R]

    if anchor == 0:
        kv = [Shard(0) if ctx.shape(t)[0] == batch else R for t in (k, v)]
        return Decision(ins=[Shard(0)] + kv + mask_need(0), out=Shard(0))

    if hq % ctx.size:
        return Decision(ins=[R] * len(ins), out=R)
    if hkv % ctx.size == 0:
        kv = [Shard(1), Shard(1)]
    elif ctx.size % hkv == 0 and hq % hkv == 0:
        node.meta.setdefault("fxshard_notes", {})["kv_heads_replicated"] = ctx.axis
        kv = [R, R]
    else:
        raise ValueError(
            f"fxshard.parallelize: attention {node.name} has {hkv} key/value heads, which can "
            f"be neither split nor replicated over mesh axis {ctx.axis!r} of size {ctx.size} "
            f"(mesh {ctx.mesh.describe()}): {ctx.axis} must divide {hkv} or be a multiple of "
            f"it. Change the {ctx.axis} size.")
    return Decision(ins=[Shard(1)] + kv + mask_need(1), out=Shard(1))
