"""Fused attention with the contract context parallelism needs, and the online-softmax merge.

``attention(q, k, v)`` returns ``(out, lse)``: the softmax-attention output and the natural-log
logsumexp of every row of scaled scores. Causal masking compares *absolute* positions
(``q_offset + i`` against ``kv_offset + j``), so a ring step can attend a query chunk to any
key chunk. ``softcap`` (Gemma-2's attention logit soft-cap) replaces every scaled score ``s``
by ``softcap * tanh(s / softcap)`` before the mask: per score, so chunks still merge exactly.
A row that sees no key gives ``out = 0``, ``lse = -inf``, and ``merge_attention``
combines partial results exactly (the rule ring attention uses).

Backends share one contract:

- ``"triton"``: the flash-attention kernel in :mod:`fxshard.kernels.triton_attention` (CUDA, or
  Triton's CPU interpreter when ``TRITON_INTERPRET=1``);
- ``"torch"``: a reference in plain torch ops, computed in float32 (float64 for float64 inputs);
  it is also the CPU implementation of the whole system, so it reshapes q to
  ``[B, Hkv, G, Sq, D]`` for GQA instead of repeating K/V, and it is differentiable;
- ``"auto"``: the op ``torch.ops.fxshard.attention`` (:mod:`fxshard.ops.attention`, registered
  when ``fxshard`` is imported), which FX graphs, ``torch.export`` and ``torch.compile`` see as
  one op; it runs :func:`auto_attention` (Triton on CUDA tensors without a mask when triton is
  installed, torch otherwise: the same contract, so the same result). Its backward is
  :func:`attention_backward` (the torch reference's explicit formulas, no Triton backward).

This module is the math only: the op's schema, fake impl and autograd registration live in
:mod:`fxshard.ops.attention`.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv query heads per KV
head, Sq query length, Skv key/value length, D head dim; in suffixes K is Hkv, T the key axis
(Skv) and M = G * Sq. ``q_BHSD`` is ``[B, Hq, Sq, D]``; ``k_BHSD``/``v_BHSD`` are
``[B, Hkv, Skv, D]`` (v's head size may be Dv != D, as in MLA; out then has Dv); ``q_BKGSD``
is q viewed as ``[B, Hkv, G, Sq, D]`` and ``q_BKMD`` as ``[B, Hkv, G * Sq, D]``; ``s_BKGST`` holds scores ``[B, Hkv, G, Sq, Skv]``; ``lse_BHS`` is
``[B, Hq, Sq]``.
"""
import contextlib
import contextvars
import functools
import math
import numbers
from typing import Optional

import torch

__all__ = ["attention", "merge_attention", "auto_attention", "attention_backward",
           "check_inputs", "cpu_flash", "scale_of", "torch_attention", "triton_module"]

_NAME = "fxshard.kernels.attention"
_BACKENDS = ("auto", "torch", "triton")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: Optional[float] = None, q_offset: int = 0, kv_offset: int = 0,
              mask: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
              backend: str = "auto"):
    """Scaled dot-product attention returning ``(out, lse)``.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Skv, D]``; v: ``[B, Hkv, Skv, Dv]`` (``Dv`` may
            differ from ``D``, as in MLA) with ``Hq % Hkv == 0`` (query head ``h`` uses KV
            head ``h // (Hq // Hkv)``), all of one floating dtype and device.
        causal: query ``i`` sees key ``j`` iff ``kv_offset + j <= q_offset + i``.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        q_offset, kv_offset: absolute positions of the first query and the first key.
        mask: broadcastable to ``[B, Hq, Sq, Skv]``; bool (True = attend, as torch SDPA) or an
            additive float mask; combined with ``causal``. Only the torch backend takes a mask.
        softcap: ``> 0``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
            before the mask and causal masking (Gemma-2); ``None`` or ``0``: off.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` of q's dtype, ``lse`` ``[B, Hq, Sq]`` float32 (natural
        log). Rows that
        see no key give ``out = 0`` and ``lse = -inf``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_NAME}: backend={backend!r}; choose one of {_BACKENDS}.")
    check_inputs(q, k, v, mask, scale, q_offset, kv_offset, softcap)
    softcap = float(softcap or 0.0)
    if backend == "auto":
        out, lse = torch.ops.fxshard.attention(q, k, v, mask, bool(causal), scale, q_offset,
                                               kv_offset, softcap)
        return out, lse
    if backend == "torch":
        return torch_attention(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap)
    if mask is not None:
        raise ValueError(f"{_NAME}: backend='triton' does not take an explicit mask (got a mask "
                         f"of shape {tuple(mask.shape)}); express it with causal/q_offset/"
                         f"kv_offset, or use backend='torch' (or 'auto') for explicit masks.")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{_NAME}: backend='triton' is forward-only and its inputs require "
                         f"grad; use backend='auto' (custom op with a backward) or run under "
                         f"torch.no_grad().")
    return _triton_attention(q, k, v, causal, scale, q_offset, kv_offset, softcap)


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                    lse2: torch.Tensor):
    """Merge two attention results over disjoint key sets (the online-softmax rule).

    ``out*`` are ``[..., S, D]``, ``lse*`` ``[..., S]``. Returns ``(out, lse)`` equal to attention
    over the union of the keys: exact when one side is ``-inf`` (saw no key); ``out = 0``,
    ``lse = -inf`` when both are. Computed in float32 (float64 for float64); ``out`` has
    ``out1``'s dtype, ``lse`` is float32.
    """
    name = "fxshard.kernels.merge_attention"
    if out1.shape != out2.shape:
        raise ValueError(f"{name}: out1 has shape {tuple(out1.shape)}, out2 "
                         f"{tuple(out2.shape)}; merge results of the same queries.")
    for arg, lse in (("lse1", lse1), ("lse2", lse2)):
        if lse.shape != out1.shape[:-1]:
            raise ValueError(f"{name}: {arg} has shape {tuple(lse.shape)}, expected "
                             f"{tuple(out1.shape[:-1])} (out's shape without head_dim).")
    cdtype = torch.float64 if torch.float64 in (out1.dtype, lse1.dtype) else torch.float32
    lse1, lse2 = lse1.to(cdtype), lse2.to(cdtype)
    lse_max = torch.maximum(lse1, lse2)
    lse_max = torch.where(torch.isneginf(lse_max), 0.0, lse_max)
    w1, w2 = torch.exp(lse1 - lse_max), torch.exp(lse2 - lse_max)
    total = w1 + w2
    empty = total == 0
    total_safe = torch.where(empty, 1.0, total)
    out = (out1.to(cdtype) * (w1 / total_safe).unsqueeze(-1)
           + out2.to(cdtype) * (w2 / total_safe).unsqueeze(-1))
    lse = torch.where(empty, -math.inf, lse_max + torch.log(total_safe))
    return out.to(out1.dtype), lse.to(torch.float32)


def check_inputs(q, k, v, mask, scale, q_offset, kv_offset, softcap=0.0) -> None:
    """Shape, dtype and device checks shared by every backend (and the fake impl)."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{_NAME}: {arg} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{_NAME}: {arg} has shape {tuple(t.shape)}; expected 4 dims "
                             f"[batch, heads, seq, head_dim] (transpose a [B, S, H, D] tensor "
                             f"with .transpose(1, 2)).")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{_NAME}: {arg} has dtype {t.dtype}; expected a floating dtype.")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{_NAME}: k has shape {tuple(k.shape)}, v has shape "
                         f"{tuple(v.shape)}; k and v must be [B, Hkv, Skv, D] and "
                         f"[B, Hkv, Skv, Dv] (v's head size may differ, as MLA's).")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{_NAME}: q has batch size {q.shape[0]}, k has {k.shape[0]}; "
                         f"pass q, k and v of the same batch.")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{_NAME}: q has head_dim {q.shape[-1]}, k has {k.shape[-1]}; "
                         f"q and k must share the head dim (v's may differ).")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"{_NAME}: q has {heads_q} heads, k has {heads_kv}; Hq must be a "
                         f"multiple of Hkv (query head h uses KV head h // (Hq // Hkv)); use "
                         f"a number of query heads divisible by {heads_kv}.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"{_NAME}: q is {q.dtype}, k is {k.dtype}, v is {v.dtype}; cast them "
                         f"to one dtype.")
    if not q.device == k.device == v.device:
        raise ValueError(f"{_NAME}: q is on {q.device}, k on {k.device}, v on {v.device}; "
                         f"move them to one device.")
    if mask is not None:
        target = (q.shape[0], heads_q, q.shape[2], k.shape[2])
        if not isinstance(mask, torch.Tensor) or not (
                mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ValueError(f"{_NAME}: mask must be a bool tensor (True = attend) or an "
                             f"additive float tensor, got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)}.")
        try:
            ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{_NAME}: mask has shape {tuple(mask.shape)}, which does not "
                             f"broadcast to [B, Hq, Sq, Skv] = {list(target)}; give it size "
                             f"1 or the full size in each of those dims.")
        if mask.device != q.device:
            raise ValueError(f"{_NAME}: mask is on {mask.device}, q on {q.device}; move the "
                             f"mask to q's device.")
    for arg, off in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if isinstance(off, bool) or not isinstance(off, (numbers.Integral, torch.SymInt)):
            raise ValueError(f"{_NAME}: {arg}={off!r}; expected a Python int (absolute "
                             f"position of the chunk's first token).")
    if scale is not None and (isinstance(scale, bool)
                              or not isinstance(scale, (numbers.Real, torch.SymFloat))):
        raise ValueError(f"{_NAME}: scale={scale!r}; expected a float or None "
                         f"(None means 1/sqrt(head_dim)).")
    if isinstance(scale, numbers.Real) and not math.isfinite(scale):
        raise ValueError(f"{_NAME}: scale={scale!r} is not finite; pass a finite float or None "
                         f"(None means 1/sqrt(head_dim)).")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"{_NAME}: softcap={softcap!r}; expected a finite float >= 0 (the "
                         f"cap of softcap * tanh(score / softcap)) or None / 0 for no cap.")


def scale_of(q: torch.Tensor, scale: Optional[float]) -> float:
    """The softmax scale: ``scale``, or ``1 / sqrt(head_dim)`` of ``q`` where it is None."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_scores(q_BHSD, k_BHSD, mask, causal, scale, q_offset, kv_offset, softcap=0.0):
    """Scaled (and soft-capped) scores ``s_BKGST`` in the compute dtype, ``-inf`` where a key
    is masked out."""
    batch, heads_q, seq_q, head_dim = q_BHSD.shape
    heads_kv, seq_kv = k_BHSD.shape[1], k_BHSD.shape[2]
    group = heads_q // heads_kv
    cdtype = _compute_dtype(q_BHSD.dtype)
    q_BKMD = q_BHSD.to(cdtype).reshape(batch, heads_kv, group * seq_q, head_dim)
    s_BKMT = torch.matmul(q_BKMD, k_BHSD.to(cdtype).transpose(-1, -2)) * scale
    s_BKGST = s_BKMT.view(batch, heads_kv, group, seq_q, seq_kv)
    if softcap:
        s_BKGST = torch.tanh(s_BKGST / softcap) * softcap
    if mask is not None:
        mask_BKGST = mask.expand(batch, heads_q, seq_q, seq_kv).reshape(
            batch, heads_kv, group, seq_q, seq_kv)
        if mask.dtype == torch.bool:  # added as 0 / -inf, as torch's SDPA does: a NaN score
            # stays NaN where the mask hides it (filling -inf there would hide the NaN)
            s_BKGST = s_BKGST + torch.zeros((), dtype=s_BKGST.dtype, device=s_BKGST.device
                                            ).masked_fill(~mask_BKGST, -math.inf)
        else:
            s_BKGST = s_BKGST + mask_BKGST.to(cdtype)
    if causal:
        pos_q = torch.arange(seq_q, device=q_BHSD.device) + q_offset
        pos_kv = torch.arange(seq_kv, device=q_BHSD.device) + kv_offset
        s_BKGST = s_BKGST.masked_fill(pos_kv[None, :] > pos_q[:, None], -math.inf)
    return s_BKGST


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element is finite, from one sum per tensor: a NaN or an infinity makes
    the sum non-finite (``inf - inf`` is NaN too), so a False never misses one; a sum that
    overflows a finite input gives a False that only costs the slower exact path. About
    1/10 of the CPU time of ``isfinite(t).all()``, which this runs on every attention call."""
    return math.isfinite(sum(t.sum().item() for t in tensors))


# torch's CPU flash kernel takes the keys in blocks of 512; what it does with a row of NaN
# depends on the first block's length only (below), so the probe needs no longer key row.
_SDPA_KV_BLOCK = 512
_single_device_keys: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "fxshard_single_device_keys", default=None)


@contextlib.contextmanager
def single_device_keys(n: int):
    """The attention calls inside see a piece of the keys of one single-device call of ``n``
    keys (a ring step, ``fxshard.ring_attention``): what a row of NaN gives follows the
    single-device call (:func:`sdpa_zeroes_nan_rows`), not the piece."""
    token = _single_device_keys.set(int(n))
    try:
        yield
    finally:
        _single_device_keys.reset(token)


def sdpa_zeroes_nan_rows(dtype: torch.dtype, seq_kv: int, mask: Optional[torch.Tensor]) -> bool:
    """Whether torch's own CPU ``scaled_dot_product_attention`` gives 0, not NaN, for a query
    row of NaN at ``dtype`` against ``seq_kv`` keys (with a mask of ``mask``'s kind): the single
    -device model does whatever it does, so fxshard's plain path must too (a row whose every
    score is NaN or masked is then treated as seeing no key: ``out = 0``, ``lse = -inf``).

    Its flash kernel takes a row's maximum score with vector instructions (NaN propagates)
    over whole vectors and a scalar ``std::max`` (NaN dropped) over the rest, so a row of NaN
    gives NaN when the first key block holds one whole vector and 0 when it is shorter: below
    16 keys in float32 and 8 in float64 on an AVX-512 CPU, 8 and 4 on AVX2; with a mask it gave
    NaN on both. Hence a probe per dtype, key count (up to one block) and mask kind, run once
    each; inside :func:`single_device_keys` the key count is the single-device call's."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    whole = _single_device_keys.get()
    n = min(max(int(whole if whole is not None else seq_kv), 1), _SDPA_KV_BLOCK)
    kind = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return _sdpa_zeroes_nan_rows(dtype, n, kind)


@functools.lru_cache(maxsize=None)
def _sdpa_zeroes_nan_rows(dtype: torch.dtype, seq_kv: int, mask_kind: Optional[str]) -> bool:
    """The probe of :func:`sdpa_zeroes_nan_rows`: one query row of NaN against ``seq_kv``
    keys of ones."""
    q = torch.full((1, 1, 1, 4), math.nan, dtype=dtype, device="cpu")
    kv = torch.ones((1, 1, seq_kv, 4), dtype=dtype, device="cpu")
    mask = None
    if mask_kind == "bool":
        mask = torch.ones((1, 1, 1, seq_kv), dtype=torch.bool, device="cpu")
    elif mask_kind == "float":
        mask = torch.zeros((1, 1, 1, seq_kv), dtype=dtype, device="cpu")
    out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    return not bool(out.isnan().any())


def cpu_flash(q_BHSD, k_BHSD, v_BHSD, mask, causal, scale, q_offset, kv_offset,
              softcap=0.0):
    """torch's fused CPU flash attention's ``(out, lse)`` (in its own layouts) where it has
    this module's contract, else None: no mask, no soft-cap, the causal diagonal at the
    top-left (equal offsets), float32/64, at least one query and key, finite inputs; 3-4x the
    plain ops' speed. Not for zero queries (it dies of SIGFPE) nor non-finite inputs (it gives
    out = 0, lse = 0 for a NaN row where the plain ops give NaN)."""
    if (mask is None and not softcap and q_BHSD.device.type == "cpu"
            and (not causal or q_offset == kv_offset) and v_BHSD.shape[-1] == q_BHSD.shape[-1]
            and q_BHSD.dtype in (torch.float32, torch.float64) and q_BHSD.shape[2] > 0
            and k_BHSD.shape[2] > 0 and _all_finite(q_BHSD, k_BHSD, v_BHSD)):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHSD, k_BHSD, v_BHSD, 0.0, bool(causal), scale=scale_of(q_BHSD, scale))
    return None


def torch_attention(q_BHSD, k_BHSD, v_BHSD, mask, causal, scale, q_offset, kv_offset,
                    softcap=0.0):
    """The torch backend: plain ops, NaN-free (also in autograd) for rows that see no key."""
    batch, heads_q, seq_q, _ = q_BHSD.shape
    heads_kv, seq_kv, head_dim = k_BHSD.shape[1], k_BHSD.shape[2], v_BHSD.shape[3]
    if seq_q == 0 or seq_kv == 0:
        out = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=q_BHSD.dtype,
                          device=q_BHSD.device)
        lse = torch.full(q_BHSD.shape[:3], -math.inf, dtype=torch.float32,
                         device=q_BHSD.device)
        return out, lse
    flash = cpu_flash(q_BHSD, k_BHSD, v_BHSD, mask, causal, scale, q_offset, kv_offset,
                      softcap)
    if flash is not None:
        return flash[0].contiguous(), flash[1].to(torch.float32).contiguous()
    s_BKGST = _masked_scores(q_BHSD, k_BHSD, mask, causal, scale_of(q_BHSD, scale),
                             q_offset, kv_offset, softcap)
    if q_BHSD.device.type == "cpu" and not _all_finite(q_BHSD, k_BHSD) and \
            sdpa_zeroes_nan_rows(q_BHSD.dtype, seq_kv, mask):  # as torch's SDPA here: an all-NaN row sees no key
        s_BKGST = s_BKGST.masked_fill(
            (s_BKGST.isnan() | s_BKGST.isneginf()).all(-1, keepdim=True), -math.inf)
    row_max = s_BKGST.detach().amax(-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    cdtype = s_BKGST.dtype
    e_BKGST = torch.exp(s_BKGST - row_max)
    denom = e_BKGST.sum(-1, keepdim=True)
    empty = denom == 0
    denom_safe = torch.where(empty, 1.0, denom)
    e_BKMT = e_BKGST.view(batch, heads_kv, -1, seq_kv)
    o_BKMD = torch.matmul(e_BKMT, v_BHSD.to(cdtype))
    out_BKGSD = o_BKMD.view(batch, heads_kv, -1, seq_q, head_dim) / denom_safe
    lse_BKGS = torch.where(empty, -math.inf, row_max + torch.log(denom_safe)).squeeze(-1)
    out_BHSD = out_BKGSD.reshape(batch, heads_q, seq_q, head_dim).to(q_BHSD.dtype)
    return out_BHSD, lse_BKGS.reshape(batch, heads_q, seq_q).to(torch.float32)


@functools.cache
def triton_module():
    """The Triton kernel module, or None when triton is not installed."""
    try:
        from . import triton_attention
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "triton":
            raise
        return None
    return triton_attention


def _triton_attention(q, k, v, causal, scale, q_offset, kv_offset, softcap=0.0):
    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing to launch: the torch result is exact
        return torch_attention(q, k, v, None, causal, scale, q_offset, kv_offset, softcap)
    module = triton_module()
    if module is None:
        raise ValueError(f"{_NAME}: the Triton backend needs the triton package, which is not "
                         f"installed; install triton or use backend='torch'.")
    return module.attention_fwd(q, k, v, causal=bool(causal), scale=scale_of(q, scale),
                                q_offset=int(q_offset), kv_offset=int(kv_offset),
                                softcap=float(softcap or 0.0))


def auto_attention(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap=0.0):
    """``backend="auto"`` without the argument checks: Triton on CUDA without a mask (when
    triton is installed), torch otherwise. The kernel of ``fxshard::attention`` after its checks,
    and what eager rank programs call (their inputs passed :func:`check_inputs` in the op's fake
    impl when the program was traced, with the shapes and dtypes every call has)."""
    if q.device.type == "cuda" and mask is None and triton_module() is not None:
        return _triton_attention(q, k, v, causal, scale, q_offset, kv_offset, softcap)
    return torch_attention(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap)


def attention_backward(q_BHSD, k_BHSD, v_BHSD, mask, out_BHSD, lse_BHS, dout_BHSD, dlse_BHS,
                       causal, scale, q_offset, kv_offset, softcap=0.0):
    """Flash-attention backward in torch ops, ``(dq, dk, dv)``: recompute p from the saved lse,
    then ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * out) + dlse)``, ``dq = ds k scale``,
    ``dk = ds^T q scale``, summed over the G query heads of each KV head; with a soft-cap
    ``ds`` is first multiplied by the cap's derivative ``1 - tanh^2``. No mask gradient;
    ``dlse_BHS`` may be None."""
    batch, heads_q, seq_q, head_dim = q_BHSD.shape
    head_dim_v = v_BHSD.shape[3]
    group = heads_q // k_BHSD.shape[1]
    cdtype = _compute_dtype(q_BHSD.dtype)
    scale = scale_of(q_BHSD, scale)
    shape_5d = (batch, k_BHSD.shape[1], group, seq_q)
    s_BKGST = _masked_scores(q_BHSD, k_BHSD, mask, causal, scale, q_offset, kv_offset, softcap)
    lse_BKGS = lse_BHS.to(cdtype).view(shape_5d)
    p_BKGST = torch.exp(s_BKGST - torch.where(torch.isneginf(lse_BKGS), 0.0,
                                              lse_BKGS).unsqueeze(-1))
    do_BKGSD = dout_BHSD.to(cdtype).reshape(*shape_5d, head_dim_v)
    o_BKGSD = out_BHSD.to(cdtype).reshape(*shape_5d, head_dim_v)
    k_c, v_c = k_BHSD.to(cdtype), v_BHSD.to(cdtype)
    q_BKGSD = q_BHSD.to(cdtype).reshape(*shape_5d, head_dim)
    dv_BHSD = torch.einsum("bhgqk,bhgqd->bhkd", p_BKGST, do_BKGSD)
    dp_BKGST = torch.einsum("bhgqd,bhkd->bhgqk", do_BKGSD, v_c)
    row_term = (do_BKGSD * o_BKGSD).sum(-1)
    if dlse_BHS is not None:
        row_term = row_term - dlse_BHS.to(cdtype).view(shape_5d)
    ds_BKGST = p_BKGST * (dp_BKGST - row_term.unsqueeze(-1))
    if softcap:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2, from the unmasked capped scores
        capped_BKGST = _masked_scores(q_BHSD, k_BHSD, None, False, scale, 0, 0, softcap)
        ds_BKGST = ds_BKGST * (1 - (capped_BKGST / softcap) ** 2)
    dq_BHSD = torch.einsum("bhgqk,bhkd->bhgqd", ds_BKGST, k_c).reshape(q_BHSD.shape) * scale
    dk_BHSD = torch.einsum("bhgqk,bhgqd->bhkd", ds_BKGST, q_BKGSD) * scale
    return dq_BHSD.to(q_BHSD.dtype), dk_BHSD.to(k_BHSD.dtype), dv_BHSD.to(v_BHSD.dtype)
