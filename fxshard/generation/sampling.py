"""Token choice, as HuggingFace ``generate`` makes it, from a program's flat outputs.

Greedy is ``argmax``; sampling applies temperature, then top-k, then top-p (nucleus), then
``torch.multinomial`` with ``generator`` (the global RNG when ``None``). A greedy decode program
returns the argmax ids itself (``Program.token_ids``, from
``fxshard.passes.kv_cache.greedy_tokens_pass``: on ``tp`` a sharded argmax, one ``(max, index)``
pair per sequence exchanged instead of the ``[B, V]`` logits), the same on every rank; a token
sampled on mesh rank 0 of a real mesh is broadcast (:func:`broadcast`), so every rank feeds the
same ids whatever its RNG state.
"""
from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree

from ..checks import inference_only

__all__ = ["last_logits", "greedy_ids", "choose", "broadcast"]

_WHERE = "ParallelModule.generate"


def last_logits(model, c, out, index: int | None = None) -> tuple[torch.Tensor, int | None]:
    """The last position's logits as float, and where they sit in ``out`` (the flat outputs
    of ``c``, a :class:`~fxshard.runtime.program_cache.Compiled`): pass that ``index`` back for
    the next output of the same program to skip rebuilding the model's output object (a
    ``CausalLMOutputWithPast`` per token)."""
    if index is not None:
        return out[index][:, -1].float(), index
    result = pytree.tree_unflatten(inference_only(model, list(out)), c.traced.out_spec)
    logits = getattr(result, "logits", None)
    if logits is None:
        logits = result if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"{_WHERE}: the model returns {type(result).__name__}, whose logits "
                         f"are not a [batch, seq, vocab] tensor; generate needs a causal LM")
    index = next((i for i, x in enumerate(out) if x is logits), None)
    return logits[:, -1].float(), index


def greedy_ids(model, c, out, pick: tuple | None = None) -> tuple[torch.Tensor, tuple]:
    """The argmax ids ``[b]`` of a program's last position, and ``pick`` (pass it back for the
    next output of the same program): a greedy decode program returns the ids, any other
    program the logits."""
    if pick is None:
        index = c.programs[-1].token_ids
        pick = ("ids", index) if index is not None else ("logits", None)
    kind, index = pick
    if kind == "ids":
        return out[index][:, -1], pick
    scores, index = last_logits(model, c, out, index)
    return scores.argmax(-1), ("logits", index)


def choose(scores: torch.Tensor, do_sample, temperature, top_k, top_p, generator):
    """The next token ids ``[b]`` from last-position ``scores`` ``[b, vocab]``."""
    if not do_sample:
        return scores.argmax(-1)
    scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1:
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(-1, index, drop), -math.inf)
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def broadcast(spec, tokens: torch.Tensor, src: int | None) -> torch.Tensor:
    """``tokens`` as mesh rank ``src`` holds them (``None``: a simulated mesh, no-op)."""
    if src is None:
        return tokens
    import torch.distributed as dist
    on_mesh = tokens.to(torch.device(spec.device_type))   # NCCL sends device tensors
    dist.broadcast(on_mesh, src=src)
    return on_mesh.to(tokens.device)
