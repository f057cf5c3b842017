"""``scaled_dot_product_attention``: how each mesh axis splits attention.

Layout legend: q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Skv, D]``, mask ``[B|1, H|1, Sq, Skv]``.

- batch (dim 0, ``dp``): q, k, v and a batched mask follow the same shard;
- heads (dim 1, ``tp``): q, k, v split by heads. ``Hq`` must divide by the axis size (a
  ``ValueError`` otherwise). With grouped KV heads ``Hkv`` must divide too, or the KV heads are
  replicated and each rank picks the KV head of its query heads (the ``kv_heads_replicated``
  note, applied by ``lower_attention``);
- ``ulysses_cp``: q, k, v arrive sharded on the sequence (dim 2); they are moved to a heads
  shard (all-to-all), attended whole, and the output moves back to the sequence shard::

      sdpa(q: S(2), k: S(2), v: S(2))  ->  needs (S(1), S(1), S(1)), out S(1), then S(2)

- ``ring_cp``: q, k, v stay sequence-sharded; ``lower_attention`` replaces the call with ring
  attention (K/V passed around the axis, partial results merged by logsumexp): the ``ring``
  note. An explicit mask is sharded by its query rows like q (zigzag on ``ring_cp``, the
  same positions), its key columns whole; the ring kernel slices the columns of each visiting
  K/V chunk;
- both CP axes (USP): the ``ulysses`` note keeps the sequence shard on ``ulysses_cp`` too, and
  ``lower_attention`` does the Ulysses all-to-all around the ring attention itself, so each
  ring rank attends ``ulysses_cp``-many sequence segments of its heads. A mask stays sharded
  by query rows on both axes, like q; ``lower_attention`` moves its rows with q's::

      sdpa(q: S(2)S(2), k, v, mask: S(2)S(2))  ->  needs the same, out S(2)S(2)  (ulysses, ring)
- any other shard of the sequence or head_dim is gathered to Replicate.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import R, Shard
from . import Decision, RuleCtx, rule, tensor_inputs
from ...mesh import RING, TP, ULYSSES

aten = torch.ops.aten

# node.meta key: the tanh soft-cap of an attention's scores (eager_attention_pass sets it;
# SDPA has no such argument, lower_attention passes it to the kernels)
SOFTCAP = "fxshard_softcap"


def sdpa_args(node: fx.Node) -> dict:
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa"]
    out = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


def _heads_error(node, what: str, n: int, ctx: RuleCtx, fix: str) -> ValueError:
    return ValueError(
        f"fxshard.parallelize: attention {node.name} has {n} {what}, which cannot be split "
        f"over mesh axis {ctx.axis!r} of size {ctx.size} (mesh {ctx.mesh.describe()}). {fix}")


def _note(node: fx.Node, key: str, axis: str) -> None:
    """Record that the lowering must do something on ``axis`` (a list, in mesh order)."""
    axes = node.meta.setdefault("fxshard_notes", {}).setdefault(key, [])
    if axis not in axes:
        axes.append(axis)


_HEADS_AXES = (TP, ULYSSES)


def _outer_heads_axes(ctx: RuleCtx) -> list[str]:
    """The axes that split heads before ``ctx.axis`` (earlier in mesh order)."""
    names = ctx.mesh.axis_names
    here = names.index(ctx.axis)
    return [a for a in names[:here] if a in _HEADS_AXES and ctx.mesh.axis_size(a) > 1]


def _kv_heads(node, hq: int, hkv: int, ctx: RuleCtx, per_rank: int) -> list:
    """KV placement when q is split by heads on ``ctx.axis``; ``per_rank``: the KV heads each
    rank of the outer heads axes holds (``hkv`` unless an earlier axis split them)."""
    if per_rank % ctx.size == 0:
        return [Shard(1), Shard(1)]
    if ctx.size % per_rank == 0 and hq % hkv == 0:
        _note(node, "kv_heads_replicated", ctx.axis)
        return [R, R]
    raise ValueError(
        f"fxshard.parallelize: attention {node.name} has {hkv} key/value heads, which can be "
        f"neither split nor replicated over mesh axis {ctx.axis!r} of size {ctx.size} (mesh "
        f"{ctx.mesh.describe()}): {ctx.axis} must divide {per_rank} or be a multiple of it. "
        f"Change the {ctx.axis} size.")


@rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a = sdpa_args(node)
    tensors = tensor_inputs(node)
    q, k, v = tensors[:3]
    mask = a["attn_mask"]
    if any(ctx.ndim(t) != 4 for t in (q, k, v)):
        return Decision(ins=[R] * len(ins), out=R)  # not [B, H, S, D]: attended whole
    hq, hkv = ctx.shape(q)[1], ctx.shape(k)[1]
    batch = ctx.shape(q)[0]
    anchor = None
    for p in ins[:3]:
        if isinstance(p, Shard) and p.dim in (0, 1, 2):
            anchor = p.dim
            break
    if ctx.is_tp and hq % ctx.size and (anchor == 1 or not ctx.user_plan):
        # heads a projection arrived split by, or the automatic plan would split
        raise _heads_error(node, "query heads", hq, ctx,
                           f"Use a {ctx.axis} size that divides {hq}, or keep attention whole "
                           f"with plan={{'<attention projections>': 'replicate'}}.")
    if anchor is None:
        return Decision(ins=[R] * len(ins), out=R)

    def mask_need(dim):
        if mask is None or not isinstance(mask, fx.Node):
            return []
        mshape = ctx.shape(mask)
        full = {0: batch, 1: hq, 2: ctx.shape(q)[2]}[dim]
        md = dim + len(mshape) - 4
        return [Shard(md) if md >= 0 and mshape[md] == full and full > 1 else R]

    if anchor == 0:
        kv = [Shard(0) if ctx.shape(t)[0] == batch else R for t in (k, v)]
        return Decision(ins=[Shard(0)] + kv + mask_need(0), out=Shard(0))

    if ctx.axis == RING and anchor == 2:
        _note(node, "ring", ctx.axis)
        return Decision(ins=[Shard(2)] * 3 + mask_need(2), out=Shard(2))

    if anchor == 2 and ctx.axis != ULYSSES:
        return Decision(ins=[R] * len(ins), out=R)

    usp = ctx.axis == ULYSSES and anchor == 2 and ctx.mesh.axis_size(RING) > 1
    # heads nest in mesh order: the heads axes before this one have split them already. USP
    # exchanges heads on the rank's local data, which tp has split first whatever the order.
    outer = [TP] if usp and ctx.mesh.axis_size(TP) > 1 else \
        [] if usp else _outer_heads_axes(ctx)
    hq_here = hq
    for a in outer:
        hq_here //= ctx.mesh.axis_size(a)
    if ctx.axis == ULYSSES and hq_here % ctx.size:
        raise _heads_error(node, f"query heads ({hq_here} per rank of {outer or 'the mesh'})",
                           hq_here, ctx, f"Ulysses splits heads: use a {ctx.axis} size that "
                           f"divides {hq_here}, or ring_cp.")
    if hq % ctx.size:
        return Decision(ins=[R] * len(ins), out=R)
    per_rank = hkv
    for a in outer:
        n = ctx.mesh.axis_size(a)
        per_rank = per_rank // n if per_rank % n == 0 else 1
    if usp:
        # USP: the sequence stays sharded here; lower_attention exchanges heads for sequence
        # on this axis around the ring attention of ring_cp (Ulysses inside, ring outside)
        if per_rank % ctx.size and ctx.size % per_rank:
            raise ValueError(
                f"fxshard.parallelize: attention {node.name} has {per_rank} key/value heads per "
                f"rank, which can be neither split nor replicated over mesh axis {ctx.axis!r} "
                f"of size {ctx.size} (mesh {ctx.mesh.describe()}); change the {ctx.axis} size")
        _note(node, "ulysses", ctx.axis)
        if per_rank % ctx.size:
            _note(node, "ulysses_kv_gather", ctx.axis)
        return Decision(ins=[Shard(2)] * 3 + mask_need(2), out=Shard(2))
    kv = _kv_heads(node, hq, hkv, ctx, per_rank)
    # back to the sequence shard the rest of the layer runs on, when the queries' split
    then = Shard(2) if anchor == 2 and ctx.shape(q)[2] % ctx.size == 0 else None
    return Decision(ins=[Shard(1)] + kv + mask_need(1), out=Shard(1), then=then)
