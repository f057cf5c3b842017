"""Decode attention: a few new queries against a static KV cache, with the ``(out, lse)`` contract.

``decode_attention(q, k_cache, v_cache, lengths)`` attends each sequence's queries to the first
``lengths[b]`` slots of its cache (the slots after it are unwritten capacity). With
``causal=True`` the ``Sq`` queries are the last ``Sq`` of those keys (query ``i`` sees keys
``j <= lengths[b] - Sq + i``: a decode step whose own keys were written into the cache first);
with ``causal=False`` every query sees every valid key (a cache piece of another rank, all in
the past). A row that sees no key gives ``out = 0``, ``lse = -inf``, so pieces of the cache held
by different ranks merge exactly with :func:`fxshard.kernels.merge_attention`
(flash-decoding across ranks).

Backends (one contract):

- ``"torch"``: plain torch ops in float32 (float64 for float64), on the keys up to the longest
  valid length; the CPU implementation (torch's fused CPU flash attention when every sequence
  has the same length, as in ``pm.generate``);
- ``"triton"``: a split-K kernel (CUDA, or Triton's interpreter with ``TRITON_INTERPRET=1``),
  :mod:`fxshard.kernels.triton_decode`: the keys are cut into splits, each program reduces one
  split for all query heads of one KV head, and a second kernel merges the splits by
  logsumexp; forward-only (inputs that require grad are refused);
- ``"auto"``: Triton on CUDA when triton is installed and the kernel takes the inputs (fp16,
  bf16 or fp32, head dim <= 256, no gradient wanted), torch otherwise.

Shape legend: B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, Sq new queries, L cache
capacity, D head dim. ``q_BHSD`` ``[B, Hq, Sq, D]``; ``k_BKLD``/``v_BKLD`` ``[B, Hkv, L, D]``;
``lengths_B`` ``[B]`` int; ``lse_BHS`` ``[B, Hq, Sq]`` float32.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch

__all__ = ["decode_attention"]

_NAME = "fxshard.kernels.decode_attention"
_BACKENDS = ("auto", "torch", "triton")
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, scale: Optional[float] = None,
                     causal: bool = True, softcap: float = 0.0, backend: str = "auto"):
    """Attention of ``q`` to the valid part of a KV cache, returning ``(out, lse)``.

    Args:
        q: ``[B, Hq, Sq, D]``; k_cache ``[B, Hkv, L, D]``, v_cache ``[B, Hkv, L, Dv]`` (``Dv``
            may differ, as in MLA), ``Hq % Hkv == 0`` (query head ``h`` uses KV head
            ``h // (Hq // Hkv)``), one floating dtype and device.
        lengths: ``[B]`` integer tensor on q's device, ``0 <= lengths[b] <= L``: how many cache
            slots of sequence ``b`` hold keys.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        causal: the queries are the last ``Sq`` valid keys' positions (see the module doc);
            ``False``: every query sees all ``lengths[b]`` keys.
        softcap: ``> 0``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
            before the mask (Gemma-2), as in :func:`fxshard.kernels.attention`; 0: off.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` of q's dtype, ``lse`` ``[B, Hq, Sq]`` float32; a row with
        no key: 0 and ``-inf``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_NAME}: backend={backend!r}; choose one of {_BACKENDS}.")
    check_decode_inputs(q, k_cache, v_cache, lengths, scale, softcap)
    softcap = float(softcap or 0.0)
    if backend == "auto":
        fits = q.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
            max(q.shape[-1], v_cache.shape[-1]) <= 256 and not (torch.is_grad_enabled() and any(
                t.requires_grad for t in (q, k_cache, v_cache)))
        backend = "triton" if q.device.type == "cuda" and fits and \
            _triton_module() is not None else "torch"
    if backend == "torch":
        return _torch_decode(q, k_cache, v_cache, lengths, scale, causal, softcap)
    module = _triton_module()
    if module is None:
        raise ValueError(f"{_NAME}: backend='triton' needs the triton package, which is not "
                         f"installed; install triton or use backend='torch'.")
    return module.decode_fwd(q, k_cache, v_cache, lengths, scale=_scale_of(q, scale),
                             causal=bool(causal), softcap=softcap)


def decode_attention_unchecked(q, k_cache, v_cache, lengths, scale, causal, softcap=0.0):
    """:func:`decode_attention` with ``backend="auto"`` minus the argument checks, for callers
    whose inputs are right by construction (the decode programs of ``pm.generate``: their
    caches are allocated from the shapes the program declares, ``lengths`` by the runner)."""
    if q.device.type == "cuda" and _triton_module() is not None and \
            q.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
            max(q.shape[-1], v_cache.shape[-1]) <= 256:
        return _triton_module().decode_fwd(q, k_cache, v_cache, lengths,
                                           scale=_scale_of(q, scale), causal=bool(causal),
                                           softcap=float(softcap))
    return _torch_decode(q, k_cache, v_cache, lengths, scale, causal, float(softcap))


def check_decode_inputs(q, k_cache, v_cache, lengths, scale, softcap=0.0) -> None:
    """Shape, dtype and device checks shared by the backends."""
    for arg, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.dtype.is_floating_point:
            raise ValueError(
                f"{_NAME}: {arg} must be a 4-dim floating tensor [batch, heads, seq, head_dim], "
                f"got {getattr(t, 'dtype', type(t).__name__)} of shape "
                f"{tuple(getattr(t, 'shape', ()))}.")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{_NAME}: k_cache has shape {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}; they must be [B, Hkv, L, D] and "
                         f"[B, Hkv, L, Dv] (v's head size may differ, as MLA's).")
    if q.shape[0] != k_cache.shape[0] or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"{_NAME}: q has shape {tuple(q.shape)} and the cache "
                         f"{tuple(k_cache.shape)}; batch (dim 0) and head_dim (dim 3) must "
                         f"match.")
    if k_cache.shape[1] == 0 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{_NAME}: q has {q.shape[1]} heads, the cache {k_cache.shape[1]}; "
                         f"Hq must be a multiple of Hkv.")
    if not q.dtype == k_cache.dtype == v_cache.dtype or \
            not q.device == k_cache.device == v_cache.device:
        raise ValueError(f"{_NAME}: q ({q.dtype}, {q.device}) and the cache "
                         f"({k_cache.dtype}, {k_cache.device}) must share dtype and device.")
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or \
            lengths.dtype == torch.bool or tuple(lengths.shape) != (q.shape[0],) or \
            lengths.device != q.device:
        raise ValueError(f"{_NAME}: lengths must be an integer tensor of shape "
                         f"[{q.shape[0]}] on {q.device}, got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} of shape "
                         f"{tuple(getattr(lengths, 'shape', ()))}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"{_NAME}: scale={scale!r}; expected a finite float or None.")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"{_NAME}: softcap={softcap!r}; expected a finite float >= 0 (the "
                         f"cap of softcap * tanh(score / softcap)) or None / 0 for no cap.")


def _scale_of(q: torch.Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _torch_decode(q_BHSD, k_BKLD, v_BKLD, lengths_B, scale, causal, softcap=0.0):
    batch, heads_q, seq_q, head_dim = q_BHSD.shape
    heads_kv, head_dim_v = k_BKLD.shape[1], v_BKLD.shape[3]
    group = heads_q // heads_kv
    cdtype = torch.float64 if q_BHSD.dtype == torch.float64 else torch.float32
    lens = lengths_B.tolist()                 # one read of the lengths (not max + min)
    n_keys = min(max(lens), k_BKLD.shape[2]) if batch else 0
    if n_keys <= 0 or seq_q == 0:
        return (torch.zeros((batch, heads_q, seq_q, head_dim_v), dtype=q_BHSD.dtype,
                            device=q_BHSD.device),
                torch.full(q_BHSD.shape[:3], -math.inf, dtype=torch.float32,
                           device=q_BHSD.device))
    if q_BHSD.device.type == "cpu" and q_BHSD.dtype in (torch.float32, torch.float64) and \
            (seq_q == 1 or not causal) and min(lens) == n_keys and head_dim_v == head_dim and \
            not softcap:
        # every sequence sees the same n_keys keys: torch's fused CPU flash attention on the
        # valid prefix, the G query heads of each KV head (times Sq) as its query rows
        q_BKMD = q_BHSD.reshape(batch, heads_kv, group * seq_q, head_dim)
        out, lse = _FLASH_CPU(q_BKMD, k_BKLD.narrow(2, 0, n_keys), v_BKLD.narrow(2, 0, n_keys),
                              0.0, False, scale=_scale_of(q_BHSD, scale))
        return (out.reshape(batch, heads_q, seq_q, head_dim),
                lse.to(torch.float32).reshape(batch, heads_q, seq_q))
    k_c = k_BKLD[:, :, :n_keys].to(cdtype)
    v_c = v_BKLD[:, :, :n_keys].to(cdtype)
    q_BKMD = q_BHSD.to(cdtype).reshape(batch, heads_kv, group * seq_q, head_dim)
    s_BKGST = (torch.matmul(q_BKMD, k_c.transpose(-1, -2)) * _scale_of(q_BHSD, scale)).view(
        batch, heads_kv, group, seq_q, n_keys)
    if softcap:
        s_BKGST = torch.tanh(s_BKGST / softcap) * softcap
    pos_T = torch.arange(n_keys, device=q_BHSD.device)
    # the last key each query sees: causal, query i of Sq is at position lengths - Sq + i
    len_B1 = lengths_B.to(torch.int64).view(batch, 1)
    if causal:
        last_BS = len_B1 - seq_q + torch.arange(seq_q, device=q_BHSD.device).view(1, seq_q)
    else:
        last_BS = (len_B1 - 1).expand(batch, seq_q)
    visible_BST = pos_T.view(1, 1, n_keys) <= last_BS.view(batch, seq_q, 1)
    s_BKGST = s_BKGST.masked_fill(~visible_BST.view(batch, 1, 1, seq_q, n_keys), -math.inf)
    row_max = s_BKGST.amax(-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    e_BKGST = torch.exp(s_BKGST - row_max)
    denom = e_BKGST.sum(-1, keepdim=True)
    empty = denom == 0
    denom = torch.where(empty, 1.0, denom)
    o_BKMD = torch.matmul(e_BKGST.view(batch, heads_kv, group * seq_q, n_keys), v_c)
    out = (o_BKMD.view(batch, heads_kv, group, seq_q, head_dim_v) / denom).reshape(
        batch, heads_q, seq_q, head_dim_v)
    lse = torch.where(empty, -math.inf, row_max + torch.log(denom)).reshape(
        batch, heads_q, seq_q)
    return out.to(q_BHSD.dtype), lse.to(torch.float32)


@functools.cache
def _triton_module():
    """The Triton decode kernel module, or None when triton is not installed (or not yet
    written)."""
    try:
        from . import triton_decode
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] not in ("triton", "fxshard"):
            raise
        return None
    return triton_decode
