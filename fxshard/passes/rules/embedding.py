"""Embedding lookups on the ``tp`` axis: ``embed_dim`` (the default, as the seed's
``EmbeddingWithReplicateOutput``), ``vocab`` (Megatron's vocab-parallel embedding) or
``replicate`` (every rank holds the whole table: no collective, ``tp`` times the memory)::

    embedding(w: S(1) [V, E], ids: R)  -> S(-1), then all-gathered to R   (embed_dim)
    embedding(w: S(0) [V, E], ids: R)  -> P (rows outside the rank's vocab range give 0),
                                          then all-reduced to R            (vocab)
    embedding(w: R [V, E], ids: R)     -> R                                (replicate)

A table that is also a matmul's weight (an embedding tied to the lm_head: GPT-2's ``wte``,
``tie_word_embeddings=True``) takes ``vocab`` under the default ``embed_dim``: the lm_head is then
column-parallel on the vocab (its ``[B, S, V/tp]`` logits gathered only where the model returns
them) and both uses' gradients are the rank's ``[V/tp, E]`` rows, added locally (a vocab
``tp`` does not divide reaches this rule padded to a multiple of ``tp``:
:mod:`fxshard.passes.pad_vocab`). ``embed_dim`` would make the lm_head row-parallel: an all-reduce of the whole ``[B, S, V]`` logits in the
forward and the ``[V, E]`` gradient computed whole on every rank. Wire bytes per rank and step
(n tp ranks, ring; the forward alone is inference's)::

    vocab:      fwd 2(n-1)/n·BSE (lookup) + (n-1)/n·BSV (logits gathered, only when returned)
                bwd 2(n-1)/n·BSE (the lm_head's input gradient)
    embed_dim:  fwd (n-1)/n·BSE (lookup) + 2(n-1)/n·BSV (row-parallel logits)
                bwd (n-1)/n·BSE (the lm_head's input gradient gathered)

``vocab`` moves less in inference when V > E, in training when V > 2E (every LM: GPT-2 65E),
and with the loss inside the graph (``labels=``) its logits never move.

With ``sequence_parallel`` the output goes to the sequence shard S(1) instead of R (an
all-to-all for ``embed_dim``, a reduce-scatter for ``vocab``). On other axes the weight is
replicated and the ids' shard (batch on ``dp``, sequence on CP axes) passes through.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Shard, shard_dim
from . import UNDECIDED, Decision, RuleCtx, rule

aten = torch.ops.aten

# what a tied table passes through on its way to the lm_head's contraction
_TO_MATMUL = (aten.t.default, aten.transpose.int, aten.permute.default, aten.linear.default,
              aten.mm.default, aten.matmul.default, aten.addmm.default, aten.bmm.default)


def tied_to_matmul(weight: fx.Node) -> bool:
    """``weight`` (a parameter) is also the weight of a matmul (through a transpose): an
    embedding table tied to the output projection."""
    if weight.op != "placeholder" or weight.meta.get("fxshard_param") is None:
        return False
    return any(u.target in _TO_MATMUL for u in weight.users)


@rule(aten.embedding.default)
def embedding_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    w, ids = ins[0], ins[1]
    out_nd = ctx.ndim(node)
    if w is UNDECIDED:
        if not ctx.is_tp:
            w = R
        else:
            style = ctx.embedding_style
            if style == "embed_dim" and tied_to_matmul(node.args[0]) and \
                    ctx.shape(node.args[0])[0] % ctx.size == 0:
                style = "vocab"
            w = {"embed_dim": Shard(1), "vocab": Shard(0)}.get(style, R)
    settle = Shard(1) if (ctx.sequence_parallel and out_nd >= 3) else R
    if isinstance(w, Shard) and w.dim == 1:
        return Decision(ins=[w, R], out=Shard(out_nd - 1), then=settle)
    if isinstance(w, Shard) and w.dim == 0:
        return Decision(ins=[w, R], out=P, then=settle)
    if isinstance(ids, Shard):
        return Decision(ins=[R, ids], out=ids)
    return Decision(ins=[R, R], out=R)

