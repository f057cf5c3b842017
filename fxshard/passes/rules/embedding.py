"""Embedding lookups on the ``tp`` axis: ``embed_dim`` (the default, as the seed's
``EmbeddingWithReplicateOutput``), ``vocab`` (Megatron's vocab-parallel embedding) or
``replicate`` (every rank holds the whole table: no collective, ``tp`` times the memory)::

    embedding(w: S(1) [V, E], ids: R)  -> S(-1), then all-gathered to R   (embed_dim)
    embedding(w: S(0) [V, E], ids: R)  -> P (rows outside the rank's vocab range give 0),
                                          then all-reduced to R            (vocab)
    embedding(w: R [V, E], ids: R)     -> R                                (replicate)

With ``sequence_parallel`` the output goes to the sequence shard S(1) instead of R (an
all-to-all for ``embed_dim``, a reduce-scatter for ``vocab``). On other axes the weight is
replicated and the ids' shard (batch on ``dp``, sequence on CP axes) passes through.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Shard
from . import UNDECIDED, Decision, RuleCtx, rule

aten = torch.ops.aten


@rule(aten.embedding.default)
def embedding_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    w, ids = ins[0], ins[1]
    out_nd = ctx.ndim(node)
    if w is UNDECIDED:
        if not ctx.is_tp:
            w = R
        else:
            w = {"embed_dim": Shard(1), "vocab": Shard(0)}.get(ctx.embedding_style, R)
    settle = Shard(1) if (ctx.sequence_parallel and out_nd >= 3) else R
    if isinstance(w, Shard) and w.dim == 1:
        return Decision(ins=[w, R], out=Shard(out_nd - 1), then=settle)
    if isinstance(w, Shard) and w.dim == 0:
        return Decision(ins=[w, R], out=P, then=settle)
    if isinstance(ids, Shard):
        return Decision(ins=[R, ids], out=ids)
    return Decision(ins=[R, R], out=R)
