"""The backward of one attention block given the *global* logsumexp (ring attention's step).

``attention_block_backward(q, k, v, out, dout, lse)`` is the gradient of attention of the
queries ``q`` against one chunk of keys ``k``/``v``, where ``out`` and ``lse`` are the results
of those queries against *all* keys (every chunk merged, :func:`merge_attention`). With the
global ``lse`` the softmax probabilities of this chunk are exactly ``p = exp(s - lse)`` (no
renormalisation), so the chunks' gradients add up to the whole attention's::

    p   = exp(s - lse)                      s = scale * q k^T (soft-capped, masked)
    dv  = p^T dout
    ds  = p * (dout v^T - rowsum(dout * out) + dlse)      (* (1 - tanh^2) with a soft-cap)
    dq  = scale * ds k          dk = scale * ds^T q      (summed over the G query heads of
                                                           each KV head: GQA, K/V not repeated)

Causal masking compares absolute positions (``kv_offset + j <= q_offset + i``) as the
forward's ``attention`` does, so a query chunk can be differentiated against any key chunk.

The contract (shared by the Triton kernel, :mod:`fxshard.kernels.triton_attention_bwd`):

- ``q`` ``[B, Hq, Sq, D]``, ``k`` ``[B, Hkv, Skv, D]``, ``v`` ``[B, Hkv, Skv, Dv]`` (``Dv`` may
  differ from ``D``), ``out``/``dout`` ``[B, Hq, Sq, Dv]``, ``lse`` ``[B, Hq, Sq]`` (natural
  log; ``-inf`` for a row that sees no key at all), ``dlse`` ``[B, Hq, Sq]`` or None;
- returns ``(dq, dk, dv)`` of q's, k's and v's shapes in the *accumulation* dtype: float32
  (float64 for float64 inputs), so the ring sums the chunks' dK/dV without rounding; the caller
  casts once at the end.

This module is pure math (it imports nothing of fxshard outside ``fxshard.kernels``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .attention import _compute_dtype, _masked_scores, scale_of

__all__ = ["attention_block_backward"]


def attention_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, *,
                             causal: bool = False, scale: Optional[float] = None,
                             q_offset: int = 0, kv_offset: int = 0, softcap: float = 0.0,
                             mask: Optional[torch.Tensor] = None,
                             dlse: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one query chunk against one key chunk, from the global ``lse``.

    Args:
        q, k, v: ``[B, Hq, Sq, D]``, ``[B, Hkv, Skv, D]``, ``[B, Hkv, Skv, Dv]``, one dtype.
        out, dout: the global attention output of these queries and its gradient,
            ``[B, Hq, Sq, Dv]``.
        lse: the global (merged over every key chunk) logsumexp ``[B, Hq, Sq]``.
        causal: query ``i`` sees key ``j`` iff ``kv_offset + j <= q_offset + i``.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        q_offset, kv_offset: absolute positions of the first query and the first key.
        softcap: ``> 0``: scores are ``softcap * tanh(s / softcap)`` (Gemma-2); 0: off.
        mask: broadcastable to ``[B, Hq, Sq, Skv]`` (this chunk's columns); bool (True =
            attend) or additive float. No mask gradient.
        dlse: the gradient of ``lse`` when it is an output used downstream, or None.

    Returns:
        ``dq`` ``[B, Hq, Sq, D]``, ``dk`` ``[B, Hkv, Skv, D]``, ``dv`` ``[B, Hkv, Skv, Dv]``
        in float32 (float64 for float64 inputs).
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    name = "fxshard.kernels.attention_block_backward"
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{name}: q has {heads_q} heads, k has {heads_kv}; Hq must be a "
                         f"multiple of Hkv")
    if out.shape != (batch, heads_q, seq_q, head_dim_v) or dout.shape != out.shape:
        raise ValueError(f"{name}: out {tuple(out.shape)} and dout {tuple(dout.shape)} must be "
                         f"[B, Hq, Sq, Dv] = {[batch, heads_q, seq_q, head_dim_v]}")
    if lse.shape != (batch, heads_q, seq_q):
        raise ValueError(f"{name}: lse has shape {tuple(lse.shape)}, expected "
                         f"{[batch, heads_q, seq_q]}")
    cdtype = _compute_dtype(q.dtype)
    if seq_q == 0 or seq_kv == 0:
        return (torch.zeros(q.shape, dtype=cdtype, device=q.device),
                torch.zeros(k.shape, dtype=cdtype, device=q.device),
                torch.zeros(v.shape, dtype=cdtype, device=q.device))
    group = heads_q // heads_kv
    scale = scale_of(q, scale)
    softcap = float(softcap or 0.0)
    shape_5d = (batch, heads_kv, group, seq_q)
    s = _masked_scores(q, k, mask, causal, scale, q_offset, kv_offset, softcap)
    lse_c = lse.to(cdtype).view(shape_5d)
    p = torch.exp(s - torch.where(torch.isneginf(lse_c), math.inf, lse_c).unsqueeze(-1))
    do = dout.to(cdtype).reshape(*shape_5d, head_dim_v)
    row = (do * out.to(cdtype).reshape(*shape_5d, head_dim_v)).sum(-1)
    if dlse is not None:
        row = row - dlse.to(cdtype).view(shape_5d)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(cdtype))
    ds = p * (dp - row.unsqueeze(-1))
    if softcap:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, from the unmasked capped scores
        capped = _masked_scores(q, k, None, False, scale, 0, 0, softcap)
        ds = ds * (1 - (capped / softcap) ** 2)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(cdtype)).reshape(q.shape) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds,
                      q.to(cdtype).reshape(*shape_5d, head_dim)) * scale
    return dq, dk, dv
