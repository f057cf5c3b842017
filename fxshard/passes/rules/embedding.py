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
them) and both uses' gradients are the rank's ``[V/tp, E]`` rows, added locally. A vocab that
``tp`` does not divide keeps ``embed_dim`` (shards are even; :func:`warn_vocab_not_split`
says so, with the fixes). ``embed_dim``
would make the lm_head row-parallel: an all-reduce of the whole ``[B, S, V]`` logits in the
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

import warnings

import torch
import torch.fx as fx

from ...placement import P, R, Shard, shard_dim
from . import UNDECIDED, Decision, RuleCtx, VocabNotSplitWarning, _caller_level, rule

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


def warn_vocab_not_split(gm: fx.GraphModule, ctx, tp: int) -> None:
    """A warning per tied table (an embedding that is also the lm_head's weight) whose vocab
    ``tp`` does not divide and that no ``plan=`` places: split on its hidden dim, the head is
    row-parallel, so every forward all-reduces the whole ``[B, S, V]`` logits over tp and a
    loss on them is computed over the whole vocab on every rank (GPT-2's 50257 rows on any
    even tp). The fixes: a vocab padded to a multiple of tp, a tp that divides it, or
    ``plan=`` (which silences this)."""
    n = ctx.mesh.shape[tp]
    seen = set()
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default:
            continue
        w = node.args[0]
        fqn = w.meta.get("fxshard_param")
        spec = w.meta.get("fxshard_spec")
        if fqn is None or fqn in seen or not isinstance(spec, tuple) or \
                shard_dim(spec[tp]) != 1 or not tied_to_matmul(w) or \
                ctx.plan_for(fqn) is not None:
            continue
        seen.add(fqn)
        vocab, hidden = w.meta["val"].shape[:2]
        if vocab % n == 0:
            continue
        names = sorted({fqn, *ctx.aliases.get(fqn, ())})
        module = names[-1].rpartition(".")[0]
        padded = -(-vocab // (64 * n)) * 64 * n
        warnings.warn(
            f"fxshard: the embedding table {' = '.join(names)} [{vocab}, {hidden}] is also "
            f"the lm_head's weight, and its {vocab} rows do not divide by mesh axis 'tp' of size "
            f"{n} (mesh {ctx.mesh.describe()}): it is split on its hidden dim instead, so "
            f"every forward all-reduces the whole [B, S, {vocab}] logits over tp, and a loss "
            f"on them is computed over the whole vocab on every rank (not vocab-parallel). "
            f"Correct, but slower. Pad the vocab to a multiple of {n} (with transformers: "
            f"model.resize_token_embeddings({vocab}, pad_to_multiple_of={64 * n}) gives "
            f"{padded} rows; the new rows are classes of the softmax, so this changes the "
            f"model: trained, they learn to stay unlikely, as in nanoGPT's 50304-row GPT-2; "
            f"read the logits as [..., :{vocab}]), use a tp size that divides {vocab}, or "
            f"accept it with plan={{{module!r}: 'embed_dim'}} (silences this).",
            VocabNotSplitWarning, stacklevel=_caller_level())
