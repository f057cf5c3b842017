"""Ring attention: the K/V chunks of a sequence-sharded attention travel around a mesh axis.

Every rank of ``axis`` holds one contiguous chunk of the sequence for q, k and v. In step
``i`` rank ``r`` attends its queries to the K/V chunk of rank ``(r - i) % n`` with the absolute
positions of both chunks (so causal masking is exact), passes the chunk it holds to rank
``r + 1`` and merges the partial result by logsumexp (``merge_attention``)::

    step 0: attention(q_r, k_r, v_r)        send k_r, v_r -> r+1   recv k_{r-1}, v_{r-1}
    step 1: attention(q_r, k_{r-1}, v_{r-1})  ...                  merge
    ...
    n - 1 steps of communication, n attention calls; with causal=True a chunk wholly after
    the queries is skipped (its partial result would be out = 0, lse = -inf).

The chunks are contiguous (no zigzag load balancing yet): with causal attention the last rank
does the most work.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..runtime.context import current_backend
from .attention import attention, merge_attention

__all__ = ["ring_attention"]


@torch.library.custom_op("fxshard::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: Optional[float], axis: str, size: int, segments: int = 1,
                   stride: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's query chunk against the whole ring's keys.

    The local sequence is ``segments`` equal contiguous pieces; piece ``t`` of ring rank ``j``
    starts at absolute position ``t * stride + j * piece`` (``segments=1``: one chunk at
    ``j * len``). USP uses ``segments`` > 1: the Ulysses exchange hands each ring rank one
    piece from every coordinate of the Ulysses axis.
    """
    backend = current_backend(f"fxshard.ring_attention on axis {axis!r}")
    if backend.axis_size(axis) != size:
        raise ValueError(f"fxshard.ring_attention: size={size} but mesh axis {axis!r} has "
                         f"{backend.axis_size(axis)} ranks")
    if q.shape[2] % segments or k.shape[2] % segments:
        raise ValueError(f"fxshard.ring_attention: local sequence lengths {q.shape[2]} (q) and "
                         f"{k.shape[2]} (k/v) must divide into segments={segments}")
    r = backend.axis_index(axis)
    sq, skv = q.shape[2] // segments, k.shape[2] // segments
    q_pieces = q.split(sq, dim=2)
    nxt, prv = (r + 1) % size, (r - 1) % size
    outs: list = [None] * segments
    lses: list = [None] * segments
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(size):
        src = (r - step) % size
        last = step == size - 1
        if not last:
            backend.send(k_cur, axis, nxt)
            backend.send(v_cur, axis, nxt)
        for t, q_t in enumerate(q_pieces):
            q_at = t * stride + r * sq
            for u in range(segments):
                kv_at = u * stride + src * skv
                if causal and kv_at > q_at + sq - 1:
                    continue  # this key piece lies wholly after every query of the piece
                o, l = attention(q_t, k_cur[:, :, u * skv:(u + 1) * skv],
                                 v_cur[:, :, u * skv:(u + 1) * skv], causal=causal,
                                 scale=scale, q_offset=q_at, kv_offset=kv_at)
                if outs[t] is None:
                    outs[t], lses[t] = o, l
                else:
                    outs[t], lses[t] = merge_attention(outs[t], lses[t], o, l)
        if not last:
            k_cur = backend.recv(k.shape, k.dtype, k.device, axis, prv)
            v_cur = backend.recv(v.shape, v.dtype, v.device, axis, prv)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@ring_attention.register_fake
def _(q, k, v, causal, scale, axis, size, segments=1, stride=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
