"""Triton flash-attention forward kernel and its host-side launcher.

The kernel follows the structure of Triton's fused-attention tutorial (``_attn_fwd``): one
program computes ``BLOCK_M`` query rows of one (batch, query head) pair, streams the key/value
blocks of the matching KV head through an online softmax with fp32 accumulators (the step
:func:`fxshard.kernels.triton_softmax.online_softmax_step`, shared with the decode kernel) and
writes the normalised output plus the natural-log logsumexp of every row. What it adds for
context parallelism:

- causal masking between *absolute* positions: query row ``i`` of this chunk sits at
  ``Q_OFFSET + i``, key ``j`` at ``KV_OFFSET + j``; it sees the key iff
  ``KV_OFFSET + j <= Q_OFFSET + i``. Key blocks wholly above the diagonal are never loaded (the
  loop bound comes from the offsets); blocks wholly below it and inside ``SEQ_KV`` run a
  mask-free loop, the rest a masked one (two loops of one body via ``tl.static_range``).
- a row that sees no key ends with ``l_i == 0``: it stores ``out = 0`` and ``lse = -inf``, so a
  later online-softmax merge stays exact, and no NaN is produced anywhere;
- grouped-query attention by index arithmetic: query head ``h`` reads KV head ``h // GROUP``;
- Gemma-2's soft-cap (``SOFTCAP``): each scaled score ``s`` becomes ``cap * tanh(s / cap)``
  before the causal mask, with ``tanh(x) = 1 - 2 / (exp(2x) + 1)`` (finite for every x).

Scores are scaled by ``scale * log2(e)`` so the softmax uses ``exp2``; the stored ``lse`` is
converted back to natural log.

On CPU tensors the kernel runs in Triton's interpreter. That needs ``TRITON_INTERPRET=1`` in
the environment *before triton is first imported* (Triton makes its jit functions, ``tl.zeros``
and ``tl.max`` included, interpreted or compiled at import time); the launcher checks this and
says so instead of failing inside Triton.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Sq query length, Skv key/value
length, D head dim (Dv v's, which may differ: MLA); ``q_BHSD`` is ``[B, Hq, Sq, D]``,
``k_BHSD`` ``[B, Hkv, Skv, D]``, ``v_BHSD`` ``[B, Hkv, Skv, Dv]``, the output
``[B, Hq, Sq, Dv]``, ``lse_BHS`` ``[B, Hq, Sq]``.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_softmax import online_softmax_finish, online_softmax_step

__all__ = ["HEAD_DIMS", "attention_fwd", "interpreting"]

HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse,
              stride_qz, stride_qh, stride_qm, stride_qk,
              stride_kz, stride_kh, stride_kn, stride_kk,
              stride_vz, stride_vh, stride_vn, stride_vk,
              stride_oz, stride_oh, stride_om, stride_ok,
              stride_lz, stride_lh, stride_lm,
              H, GROUP, SEQ_Q, SEQ_KV, Q_OFFSET, KV_OFFSET, qk_scale, cap_log2,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    off_kvh = off_h // GROUP

    q_base = Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    k_base = K + off_z.to(tl.int64) * stride_kz + off_kvh.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_kvh.to(tl.int64) * stride_vh
    o_base = Out + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    l_base = Lse + off_z.to(tl.int64) * stride_lz + off_h.to(tl.int64) * stride_lh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < SEQ_Q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                mask=row_ok[:, None], other=0.0)
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vk

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    # Key j is visible from query row r iff j <= r + delta (and j < SEQ_KV).
    # hi: end of the keys any row of this block sees; full_end: end of the key blocks that
    # every row of this block sees in full (no mask needed).
    delta = Q_OFFSET - KV_OFFSET
    if CAUSAL:
        hi = tl.minimum(SEQ_KV, tl.minimum((start_m + 1) * BLOCK_M, SEQ_Q) + delta)
        full_end = tl.minimum(SEQ_KV, start_m * BLOCK_M + delta + 1)
    else:
        hi = SEQ_KV
        full_end = SEQ_KV
    hi = tl.maximum(hi, 0)
    full_end = (tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N

    last = offs_m + delta    # causal: the last key row r sees
    for phase in tl.static_range(2):
        if phase == 0:
            lo = 0
            end = full_end
        else:
            lo = full_end
            end = hi
        for start_n in range(lo, end, BLOCK_N):
            offs_kv = start_n + offs_n
            if phase == 0:
                k = tl.load(k_ptrs + start_n * stride_kn)
                v = tl.load(v_ptrs + start_n * stride_vn)
            else:
                kv_ok = offs_kv < SEQ_KV
                k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_ok[:, None], other=0.0)
                v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_ok[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_step(
                q, k, v, m_i, l_i, acc, qk_scale, cap_log2, offs_kv, SEQ_KV, last,
                MASKED=phase == 1, CAUSAL=CAUSAL, SOFTCAP=SOFTCAP,
                INPUT_PRECISION=INPUT_PRECISION)

    out, lse = online_softmax_finish(m_i, l_i, acc)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_ok,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(l_base + offs_m * stride_lm, lse, mask=row_ok)


def interpreting() -> bool:
    """Whether this process runs Triton kernels in the CPU interpreter.

    Triton decides at import time (its own jit functions such as ``tl.zeros`` and ``tl.max``
    become interpreted or compiled ones), so ``TRITON_INTERPRET=1`` must be in the environment
    before triton is first imported.
    """
    return isinstance(_attn_fwd, InterpretedFunction) and isinstance(tl.zeros,
                                                                       InterpretedFunction)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim, for 2-byte and 4-byte inputs. Chosen
# for H100/H200 (sm_90): each compiles without register spills and fits shared memory.
_GPU_CONFIGS = {
    2: {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3),
        256: (64, 32, 4, 2)},
    4: {16: (64, 32, 8, 2), 32: (64, 32, 8, 2), 64: (64, 32, 8, 2), 128: (64, 16, 8, 2),
        256: (64, 16, 8, 2)},
}
_INTERPRETER_CONFIG = (16, 16, 4, 1)


def _check_block(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"fxshard.kernels.attention: {name}={value!r}; block sizes must be "
                         f"powers of two >= 16 (tl.dot needs at least 16 rows and columns).")


def attention_fwd(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                  causal: bool, scale: float, q_offset: int, kv_offset: int,
                  softcap: float = 0.0,
                  block_m: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None):
    """Launch ``_attn_fwd``; returns ``(out_BHSD, lse_BHS)``. ``softcap > 0`` caps the scaled
    scores at ``softcap * tanh(s / softcap)``; 0 is off.

    Generic checks (ranks, GQA divisibility, dtypes and devices agreeing) are done by
    ``fxshard.kernels.attention`` before this; here are the kernel's own host-side checks.
    Launch options default to ``_GPU_CONFIGS`` (``_INTERPRETER_CONFIG`` in the interpreter).
    """
    head_dim_q, head_dim_k, head_dim_v = q_BHSD.shape[-1], k_BHSD.shape[-1], v_BHSD.shape[-1]
    assert head_dim_q == head_dim_k
    for what, d in (("head_dim", head_dim_k), ("v's head_dim", head_dim_v)):
        if d not in HEAD_DIMS:
            raise ValueError(
                f"fxshard.kernels.attention: {what} is {d}, but backend='triton' supports "
                f"head_dim in {{16, 32, 64, 128, 256}}; pad q, k and v to the next supported "
                f"size (and pass scale=1/sqrt({head_dim_k})) or use backend='torch'.")
    if q_BHSD.dtype not in _DTYPES:
        raise ValueError(
            f"fxshard.kernels.attention: q has dtype {q_BHSD.dtype}, but backend='triton' supports "
            f"torch.float16, torch.bfloat16 and torch.float32; cast the inputs or use "
            f"backend='torch'.")
    interpret = interpreting()
    if q_BHSD.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(
            f"fxshard.kernels.attention: backend='triton' got tensors on {q_BHSD.device}, but the "
            f"Triton kernel runs on CUDA only; set the environment variable TRITON_INTERPRET=1 "
            f"(before triton is first imported) to run it in Triton's CPU interpreter (slow, for "
            f"tests), or use backend='torch'.")
    if q_BHSD.device.type != "cuda" and not interpret:
        raise ValueError(
            "fxshard.kernels.attention: TRITON_INTERPRET=1 is set, but triton was imported "
            "before it was, so Triton built its functions for the GPU; set TRITON_INTERPRET=1 "
            "in the environment before the process first imports triton, or use "
            "backend='torch'.")
    config = (_INTERPRETER_CONFIG if interpret
              else _GPU_CONFIGS[q_BHSD.element_size()][max(head_dim_k, head_dim_v)])
    block_m = config[0] if block_m is None else block_m
    block_n = config[1] if block_n is None else block_n
    num_warps = config[2] if num_warps is None else num_warps
    num_stages = config[3] if num_stages is None else num_stages
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)

    batch, heads_q, seq_q, _ = q_BHSD.shape
    heads_kv, seq_kv = k_BHSD.shape[1], k_BHSD.shape[2]
    out_BHSD = torch.empty((batch, heads_q, seq_q, head_dim_v), dtype=q_BHSD.dtype,
                           device=q_BHSD.device)
    lse_BHS = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=q_BHSD.device)
    if out_BHSD.numel() == 0:
        return out_BHSD, lse_BHS
    grid = (triton.cdiv(seq_q, block_m), batch * heads_q, 1)
    precision = "ieee" if q_BHSD.dtype == torch.float32 else "tf32"
    _attn_fwd[grid](
        q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS,
        *q_BHSD.stride(), *k_BHSD.stride(), *v_BHSD.stride(), *out_BHSD.stride(),
        *lse_BHS.stride(),
        heads_q, heads_q // heads_kv, seq_q, seq_kv, int(q_offset), int(kv_offset),
        float(scale) * _LOG2E, float(softcap) * _LOG2E if softcap else 1.0,
        HEAD_DIM=head_dim_k, HEAD_DIM_V=head_dim_v, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal),
        SOFTCAP=bool(softcap),
        INPUT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out_BHSD, lse_BHS
