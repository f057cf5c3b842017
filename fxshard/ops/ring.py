"""``fxshard::ring_attention``: the K/V chunks of a sequence-sharded attention travel around a
mesh axis (the lowering of attention on ``ring_cp``, ``fxshard.passes.lower_attention``).

Every rank of ``axis`` holds one contiguous chunk of the sequence for q, k and v. In step
``i`` rank ``r`` attends its queries to the K/V chunk of rank ``(r - i) % n`` with the absolute
positions of both chunks (so causal masking is exact), passes the chunk it holds to rank
``r + 1`` and merges the partial result by logsumexp (``merge_attention``)::

    step 0: attention(q_r, k_r, v_r)        send k_r, v_r -> r+1   recv k_{r-1}, v_{r-1}
    step 1: attention(q_r, k_{r-1}, v_{r-1})  ...                  merge
    ...
    n - 1 steps of communication, n attention calls; with causal=True a chunk wholly after
    the queries is skipped (its partial result would be out = 0, lse = -inf).

With causal attention and contiguous chunks the last rank would do the most work; the default
sequence layout on ``ring_cp`` is therefore zigzag (rank j holds chunks j and 2n-1-j of 2n,
``fxshard::zigzag_shard``), which every rank's queries and keys follow, so each rank does the
same work. ``zigzag=True`` tells the op where its two pieces sit. An explicit mask (a sliding
window, an ALiBi bias) comes sharded by rows like q, with all key columns: step ``i`` slices
the columns of the visiting chunk's global positions.

``fxshard::ring_attention_backward`` is its gradient (training on ``ring_cp``): the same
steps, each the block backward (``attention_block_backward``) of the local queries against the
visiting K/V chunk with the *global* logsumexp the forward returned, so no rescaling is needed.
dQ stays local; the visiting chunk's dK/dV (float32) travel with it and, after the last step,
one more hop brings them home::

    step i: dq += bwd(q_r, k_src, v_src).dq    dk_src += .dk, dv_src += .dv
            send k_src, v_src, dk_src, dv_src -> r+1             (n - 1 times)
    then:   send dk, dv -> r+1 (their owner)   recv own dk, dv from r-1
"""
from __future__ import annotations

from typing import Optional

import torch

from fxshard.kernels.attention import attention, merge_attention, single_device_keys
from fxshard.kernels.attention_backward import attention_block_backward
from fxshard.ops.library import define_op
from fxshard.runtime.context import current_backend

__all__ = ["ring_attention", "ring_attention_backward"]


@define_op("fxshard::ring_attention",
           "(Tensor q, Tensor k, Tensor v, bool causal, float? scale, str axis, int size, "
           "int segments=1, int stride=0, bool zigzag=False, int kv_stride=-1, "
           "float softcap=0.0, Tensor? mask=None) "
           "-> (Tensor, Tensor)")
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: Optional[float], axis: str, size: int, segments: int = 1,
                   stride: int = 0, zigzag: bool = False, kv_stride: int = -1,
                   softcap: float = 0.0, mask: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's query chunk against the whole ring's keys.

    The local sequence is ``segments`` equal parts; part ``t`` of ring rank ``j`` starts at
    absolute position ``t * stride`` and holds piece ``j`` of that part's ``size`` pieces
    (``segments=1``: one chunk at ``j * len``). With ``zigzag`` each part holds two pieces of
    ``2 * size``: ``j`` and ``2*size-1-j``. USP uses ``segments`` > 1: the Ulysses exchange
    hands each ring rank one part from every coordinate of the Ulysses axis. ``kv_stride``
    (default ``stride``) is the keys' part stride when their length differs from the queries'.
    ``softcap`` (Gemma-2's ``cap * tanh(s / cap)`` on each score) is passed to every step:
    it acts per score, so the logsumexp merge stays exact.

    ``mask`` (bool, True = attend, or additive float; broadcastable to ``[B, H, Sq, Skv]`` of
    the *whole* sequence in its last dim): this rank's rows, laid out like ``q`` (same
    segments, pieces and zigzag order: query piece ``t`` reads rows ``t*sq:(t+1)*sq``), or one
    row broadcast to all; every key column, indexed by global key position. Each step slices
    the columns of the key piece visiting. Rows hold all ``Skv`` columns, so a sharded
    ``[B, H, Sq/n, Skv]`` mask costs ``1/n`` of the whole mask per rank (what HF's eager
    attention materialises anyway). Masked steps run the torch kernel (the Triton path takes
    no mask).
    """
    backend = current_backend(f"fxshard.ring_attention on axis {axis!r}")
    if backend.axis_size(axis) != size:
        raise ValueError(f"fxshard.ring_attention: size={size} but mesh axis {axis!r} has "
                         f"{backend.axis_size(axis)} ranks")
    if q.shape[2] % segments or k.shape[2] % segments:
        raise ValueError(f"fxshard.ring_attention: local sequence lengths {q.shape[2]} (q) and "
                         f"{k.shape[2]} (k/v) must divide into segments={segments}")
    r = backend.axis_index(axis)
    n_pieces, sq, skv = _pieces(q, k, segments, zigzag)

    if mask is not None:
        mask = _check_mask(mask, q, k, segments, size, axis)
    start = _starts(size, zigzag, stride, kv_stride)
    q_pieces = q.split(sq, dim=2)
    nxt, prv = (r + 1) % size, (r - 1) % size
    outs: list = [None] * n_pieces
    lses: list = [None] * n_pieces
    k_cur, v_cur = k.contiguous(), v.contiguous()
    with single_device_keys(k.shape[2] * size):  # a NaN query row gives what one device's does
        for step in range(size):
            src = (r - step) % size
            last = step == size - 1
            if not last:
                backend.send(k_cur, axis, nxt)
                backend.send(v_cur, axis, nxt)
            for t, q_t in enumerate(q_pieces):
                q_at = start(t, r, sq, False)
                for u in range(n_pieces):
                    kv_at = start(u, src, skv, True)
                    if causal and kv_at > q_at + sq - 1:
                        continue  # this key piece lies wholly after every query of the piece
                    m = _mask_block(mask, t, sq, kv_at, skv)
                    o, l = attention(q_t, k_cur[:, :, u * skv:(u + 1) * skv],
                                     v_cur[:, :, u * skv:(u + 1) * skv], causal=causal,
                                     scale=scale, q_offset=q_at, kv_offset=kv_at,
                                     softcap=softcap, mask=m)
                    if outs[t] is None:
                        outs[t], lses[t] = o, l
                    else:
                        outs[t], lses[t] = merge_attention(outs[t], lses[t], o, l)
            if not last:
                k_cur = backend.recv(k.shape, k.dtype, k.device, axis, prv)
                v_cur = backend.recv(v.shape, v.dtype, v.device, axis, prv)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _pieces(q: torch.Tensor, k: torch.Tensor, segments: int, zigzag: bool):
    """``(pieces, query piece length, key piece length)`` of the local sequence."""
    n_pieces = segments * (2 if zigzag else 1)
    if q.shape[2] % n_pieces or k.shape[2] % n_pieces:
        raise ValueError(f"fxshard.ring_attention: local sequence lengths {q.shape[2]} (q) and "
                         f"{k.shape[2]} (k/v) must divide into {n_pieces} pieces "
                         f"(segments={segments}, zigzag={zigzag})")
    return n_pieces, q.shape[2] // n_pieces, k.shape[2] // n_pieces


def _starts(size: int, zigzag: bool, stride: int, kv_stride: int):
    """``start(piece, rank, length, keys)``: the absolute position of a local piece."""
    per_part = 2 if zigzag else 1
    kv_stride = stride if kv_stride < 0 else kv_stride

    def start(piece: int, rank: int, length: int, keys: bool) -> int:
        t, z = divmod(piece, per_part)
        slot = rank if z == 0 else 2 * size - 1 - rank
        return t * (kv_stride if keys else stride) + slot * length
    return start


def _mask_block(mask, t: int, sq: int, kv_at: int, skv: int):
    """The mask's rows of query piece ``t`` and columns of the key piece at ``kv_at``."""
    if mask is None:
        return None
    m = mask if mask.shape[2] == 1 else mask[:, :, t * sq:(t + 1) * sq]
    return m if m.shape[3] == 1 else m[:, :, :, kv_at:kv_at + skv]


@define_op("fxshard::ring_attention_backward",
           "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
           "float? scale, str axis, int size, int segments=1, int stride=0, bool zigzag=False, "
           "int kv_stride=-1, float softcap=0.0, Tensor? mask=None) -> (Tensor, Tensor, Tensor)")
def ring_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                            scale: Optional[float], axis: str, size: int, segments: int = 1,
                            stride: int = 0, zigzag: bool = False, kv_stride: int = -1,
                            softcap: float = 0.0, mask: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`ring_attention` (same layout arguments) for this rank's
    chunk, from the forward's ``out`` and global ``lse`` and the output gradient ``grad_out``.
    dK/dV are accumulated in float32 (float64 for float64) on the ring and cast at the end."""
    backend = current_backend(f"fxshard.ring_attention_backward on axis {axis!r}")
    if backend.axis_size(axis) != size:
        raise ValueError(f"fxshard.ring_attention_backward: size={size} but mesh axis "
                         f"{axis!r} has {backend.axis_size(axis)} ranks")
    r = backend.axis_index(axis)
    n_pieces, sq, skv = _pieces(q, k, segments, zigzag)
    if mask is not None:
        mask = _check_mask(mask, q, k, segments, size, axis)
    start = _starts(size, zigzag, stride, kv_stride)
    nxt, prv = (r + 1) % size, (r - 1) % size
    q_p, o_p, g_p, l_p = (t.split(sq, dim=2) for t in (q, out, grad_out, lse))
    dq = [None] * n_pieces
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_cur = dv_cur = None
    for step in range(size):
        src = (r - step) % size
        if step:
            k_cur = backend.recv(k.shape, k.dtype, k.device, axis, prv)
            v_cur = backend.recv(v.shape, v.dtype, v.device, axis, prv)
            dk_cur = backend.recv(k.shape, _acc(k), k.device, axis, prv)
            dv_cur = backend.recv(v.shape, _acc(v), v.device, axis, prv)
        else:
            dk_cur = torch.zeros(k.shape, dtype=_acc(k), device=k.device)
            dv_cur = torch.zeros(v.shape, dtype=_acc(v), device=v.device)
        if step < size - 1:   # the next rank computes on this chunk while ours runs
            backend.send(k_cur, axis, nxt)
            backend.send(v_cur, axis, nxt)
        for t in range(n_pieces):
            q_at = start(t, r, sq, False)
            for u in range(n_pieces):
                kv_at = start(u, src, skv, True)
                if causal and kv_at > q_at + sq - 1:
                    continue  # this key piece lies wholly after every query of the piece
                keys = slice(u * skv, (u + 1) * skv)
                a, b, c = attention_block_backward(
                    q_p[t], k_cur[:, :, keys], v_cur[:, :, keys], o_p[t], g_p[t], l_p[t],
                    causal=causal, scale=scale, q_offset=q_at, kv_offset=kv_at,
                    softcap=softcap, mask=_mask_block(mask, t, sq, kv_at, skv))
                dq[t] = a if dq[t] is None else dq[t] + a
                dk_cur[:, :, keys] += b
                dv_cur[:, :, keys] += c
        if step < size - 1:
            backend.send(dk_cur, axis, nxt)
            backend.send(dv_cur, axis, nxt)
    if size > 1:   # the chunk now here belongs to the next rank: one hop home
        backend.send(dk_cur, axis, nxt)
        backend.send(dv_cur, axis, nxt)
        dk_cur = backend.recv(k.shape, _acc(k), k.device, axis, prv)
        dv_cur = backend.recv(v.shape, _acc(v), v.device, axis, prv)
    dq = [torch.zeros(q_p[t].shape, dtype=_acc(q), device=q.device) if d is None else d
          for t, d in enumerate(dq)]
    return torch.cat(dq, dim=2).to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale, axis, size, segments=1, stride=0,
      zigzag=False, kv_stride=-1, softcap=0.0, mask=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _check_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, segments: int, size: int,
                axis: str) -> torch.Tensor:
    """The mask as 4-D ``[B|1, H|1, Sq_local|1, Skv_whole|1]``, or a ValueError saying why not."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    whole_kv = k.shape[2] * size
    if (m.dim() != 4 or m.shape[2] not in (1, q.shape[2])
            or m.shape[3] not in (1, whole_kv) or m.shape[0] not in (1, q.shape[0])
            or m.shape[1] not in (1, q.shape[1])):
        raise ValueError(
            f"fxshard.ring_attention on axis {axis!r} (size {size}): mask of shape "
            f"{tuple(mask.shape)} must be [B|1, H|1, Sq|1, Skv|1] with this rank's "
            f"{q.shape[2]} query rows and all {whole_kv} key columns (q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, segments={segments}); shard the mask's query dim like q's "
            f"and keep its key dim whole")
    return m


@ring_attention.register_fake
def _(q, k, v, causal, scale, axis, size, segments=1, stride=0, zigzag=False, kv_stride=-1,
      softcap=0.0, mask=None):
    # out has v's head size (MLA: it may differ from q/k's)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)
