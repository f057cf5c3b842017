"""Triton flash-attention backward: ``dq, dk, dv`` from the forward's ``out`` and ``lse``.

FA2's three passes (the kernel names follow Triton's fused-attention tutorial; the code is our
own), with the contract of :mod:`fxshard.kernels.triton_attention`: causal between absolute
positions ``Q_OFFSET + i`` / ``KV_OFFSET + j``, GQA by index arithmetic (query head ``h``
reads KV head ``h // GROUP``), Gemma-2's soft-cap, ``Dv != D`` (MLA), rows that see no key
(``lse = -inf``) giving zero gradients::

    _attn_bwd_preprocess  delta[row] = rowsum(dout * out) - dlse[row]       [B, Hq, Sq] fp32
    _attn_bwd_dkdv        one program per (key block, batch, KV head): for each of the GROUP
                          query heads and each query block that sees the keys
                            p^T  = exp2(s^T - lse)        s = capped(q k^T * scale), log2 units
                            dv  += p^T @ dout
                            ds^T = p^T * (v @ dout^T - delta) * (1 - tanh^2 if SOFTCAP)
                            dk  += ds^T @ q
                          dK/dV summed over the group in registers: no atomics, no repeat
    _attn_bwd_dq          one program per (query block, batch, query head), over its keys:
                            dq  += ds @ k

All accumulators are fp32; ``dk``/``dq`` are scaled by ``scale`` once at the end. Blocks that
need no mask (wholly visible, wholly inside both lengths) run a mask-free loop; the diagonal
and the ragged ends a masked one (three ``tl.static_range`` phases of one body).

Shape legend as the forward's: ``q``/``dq`` ``[B, Hq, Sq, D]``, ``k``/``dk`` ``[B, Hkv, Skv,
D]``, ``v``/``dv`` ``[B, Hkv, Skv, Dv]``, ``out``/``dout`` ``[B, Hq, Sq, Dv]``, ``lse``/``dlse``/
``delta`` ``[B, Hq, Sq]``. On CPU tensors the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported).
"""
import torch
import triton
import triton.language as tl

from .triton_attention import HEAD_DIMS, interpreting

__all__ = ["attention_bwd"]

_NAME = "fxshard.kernels.triton_attention_bwd"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


@triton.jit
def _attn_bwd_preprocess(Out, DOut, DLse, Delta,
                         stride_oz, stride_oh, stride_om, stride_ok,
                         stride_dz, stride_dh, stride_dm, stride_dk,
                         stride_lz, stride_lh, stride_lm,
                         H, SEQ_Q, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                         HAS_DLSE: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < SEQ_Q
    o = tl.load(Out + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_dv[None, :] * stride_ok, mask=row_ok[:, None], other=0.0)
    do = tl.load(DOut + off_z * stride_dz + off_h * stride_dh + offs_m[:, None] * stride_dm
                 + offs_dv[None, :] * stride_dk, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:   # the lse output's own gradient: d lse / d s = p, so it enters as -dlse
        delta -= tl.load(DLse + off_z * stride_lz + off_h * stride_lh + offs_m * stride_lm,
                         mask=row_ok, other=0.0)
    tl.store(Delta + off_hz.to(tl.int64) * SEQ_Q + offs_m, delta, mask=row_ok)


@triton.jit
def _capped(qk, cap_log2, SOFTCAP: tl.constexpr):
    """``(scores, 1 - tanh^2)``: soft-capped scores in log2 units and the cap's derivative
    (1.0 without SOFTCAP); tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x."""
    if SOFTCAP:
        tanh = 1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * 1.4426950408889634 / cap_log2)) + 1.0)
        return cap_log2 * tanh, 1.0 - tanh * tanh
    else:
        return qk, 1.0


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DOut, Lse, Delta, DK, DV,
                   stride_qz, stride_qh, stride_qm, stride_qk,
                   stride_kz, stride_kh, stride_kn, stride_kk,
                   stride_vz, stride_vh, stride_vn, stride_vk,
                   stride_dz, stride_dh, stride_dm, stride_dk,
                   stride_lz, stride_lh, stride_lm,
                   stride_dkz, stride_dkh, stride_dkn, stride_dkk,
                   stride_dvz, stride_dvh, stride_dvn, stride_dvk,
                   H, GROUP, SEQ_Q, SEQ_KV, Q_OFFSET, KV_OFFSET, qk_scale, sm_scale, cap_log2,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    off_hkz = tl.program_id(1)
    H_KV = H // GROUP
    off_z = (off_hkz // H_KV).to(tl.int64)
    off_kvh = (off_hkz % H_KV).to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    kv_ok = offs_n < SEQ_KV
    k = tl.load(K + off_z * stride_kz + off_kvh * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kk, mask=kv_ok[:, None], other=0.0)
    v = tl.load(V + off_z * stride_vz + off_kvh * stride_vh + offs_n[:, None] * stride_vn
                + offs_dv[None, :] * stride_vk, mask=kv_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)

    # Query row r (of this chunk) sees key j iff j <= r + delta: the first row that sees any
    # key of this block is start_n - delta, every row from start_n + BLOCK_N - 1 - delta on
    # sees all of them. m_lo/m_full: those rows rounded to query blocks.
    delta = Q_OFFSET - KV_OFFSET
    m_end = tl.cdiv(SEQ_Q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        m_lo = tl.minimum((tl.maximum(start_n - delta, 0) // BLOCK_M) * BLOCK_M, m_end)
        m_full = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - delta, 0), BLOCK_M)
                            * BLOCK_M, m_end)
    else:
        m_lo = 0
        m_full = 0
    # mask-free query blocks: from m_full to the last whole block, when the key block is whole
    m_whole = tl.maximum((SEQ_Q // BLOCK_M) * BLOCK_M, m_full)
    if start_n + BLOCK_N > SEQ_KV:
        m_whole = m_full
    offs_mb = tl.arange(0, BLOCK_M)
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        q_base = Q + off_z * stride_qz + off_h * stride_qh
        do_base = DOut + off_z * stride_dz + off_h * stride_dh
        l_base = Lse + off_z * stride_lz + off_h * stride_lh
        d_base = Delta + (off_z * H + off_h) * SEQ_Q
        for phase in tl.static_range(3):
            if phase == 0:     # the diagonal's blocks
                lo = m_lo
                hi = m_full
            elif phase == 1:   # wholly visible and whole
                lo = m_full
                hi = m_whole
            else:              # the ragged end (rows past SEQ_Q or keys past SEQ_KV)
                lo = m_whole
                hi = m_end
            for start_m in range(lo, hi, BLOCK_M):
                offs_m = start_m + offs_mb
                if phase == 1:
                    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk)
                    do = tl.load(do_base + offs_m[:, None] * stride_dm
                                 + offs_dv[None, :] * stride_dk)
                    lse = tl.load(l_base + offs_m * stride_lm)
                    dlt = tl.load(d_base + offs_m)
                else:
                    row_ok = offs_m < SEQ_Q
                    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                                mask=row_ok[:, None], other=0.0)
                    do = tl.load(do_base + offs_m[:, None] * stride_dm
                                 + offs_dv[None, :] * stride_dk, mask=row_ok[:, None], other=0.0)
                    lse = tl.load(l_base + offs_m * stride_lm, mask=row_ok, other=float("inf"))
                    dlt = tl.load(d_base + offs_m, mask=row_ok, other=0.0)
                # a row that sees no key (lse = -inf) gets p = 0
                lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
                qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
                sT, dcap = _capped(qkT, cap_log2, SOFTCAP)
                pT = tl.math.exp2(sT - lse2[None, :])
                if phase != 1:
                    ok = kv_ok[:, None] & (offs_m[None, :] < SEQ_Q)
                    if CAUSAL:
                        ok = ok & (offs_n[:, None] <= offs_m[None, :] + delta)
                    pT = tl.where(ok, pT, 0.0)
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
                dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
                dsT = pT * (dpT - dlt[None, :]) * dcap
                dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)

    dk_ptrs = (DK + off_z * stride_dkz + off_kvh * stride_dkh + offs_n[:, None] * stride_dkn
               + offs_d[None, :] * stride_dkk)
    dv_ptrs = (DV + off_z * stride_dvz + off_kvh * stride_dvh + offs_n[:, None] * stride_dvn
               + offs_dv[None, :] * stride_dvk)
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok[:, None])


@triton.jit
def _attn_bwd_dq(Q, K, V, DOut, Lse, Delta, DQ,
                 stride_qz, stride_qh, stride_qm, stride_qk,
                 stride_kz, stride_kh, stride_kn, stride_kk,
                 stride_vz, stride_vh, stride_vn, stride_vk,
                 stride_dz, stride_dh, stride_dm, stride_dk,
                 stride_lz, stride_lh, stride_lm,
                 stride_dqz, stride_dqh, stride_dqm, stride_dqk,
                 H, GROUP, SEQ_Q, SEQ_KV, Q_OFFSET, KV_OFFSET, qk_scale, sm_scale, cap_log2,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_kvh = off_h // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < SEQ_Q
    q = tl.load(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qk, mask=row_ok[:, None], other=0.0)
    do = tl.load(DOut + off_z * stride_dz + off_h * stride_dh + offs_m[:, None] * stride_dm
                 + offs_dv[None, :] * stride_dk, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + off_z * stride_lz + off_h * stride_lh + offs_m * stride_lm,
                  mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dlt = tl.load(Delta + off_hz.to(tl.int64) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    k_base = K + off_z * stride_kz + off_kvh * stride_kh
    v_base = V + off_z * stride_vz + off_kvh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # as the forward: keys [0, full_end) are seen by every row of the block (mask-free),
    # [full_end, hi) by some
    delta = Q_OFFSET - KV_OFFSET
    if CAUSAL:
        hi = tl.minimum(SEQ_KV, tl.minimum(start_m + BLOCK_M, SEQ_Q) + delta)
        full_end = tl.minimum(SEQ_KV, start_m + delta + 1)
    else:
        hi = SEQ_KV
        full_end = SEQ_KV
    hi = tl.maximum(hi, 0)
    full_end = (tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N
    offs_nb = tl.arange(0, BLOCK_N)
    for phase in tl.static_range(2):
        if phase == 0:
            lo = 0
            end = full_end
        else:
            lo = full_end
            end = hi
        for start_n in range(lo, end, BLOCK_N):
            offs_n = start_n + offs_nb
            if phase == 0:
                k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk)
                v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vk)
            else:
                kv_ok = offs_n < SEQ_KV
                k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kk,
                            mask=kv_ok[:, None], other=0.0)
                v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vk,
                            mask=kv_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
            s, dcap = _capped(qk, cap_log2, SOFTCAP)
            p = tl.math.exp2(s - lse2[:, None])
            if phase == 1:
                ok = (offs_n[None, :] < SEQ_KV) & row_ok[:, None]
                if CAUSAL:
                    ok = ok & (offs_n[None, :] <= offs_m[:, None] + delta)
                p = tl.where(ok, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            ds = p * (dp - dlt[:, None]) * dcap
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)

    tl.store(DQ + off_z * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqk, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages) by the larger head dim, for
# 2-byte and 4-byte inputs: the dK/dV kernel holds a key block (N1 rows) and streams query
# blocks (M1), the dQ kernel the other way round (the tutorial's block shapes for sm_90; 8
# warps at D=128 keep dK/dV's fp32 accumulators at 128 registers a thread). Each compiles for
# sm_90 within its shared memory (tests/test_attention_backward_kernel.py); not yet timed on
# a GPU (benchmarks/gpu_check.py --backward-only).
_GPU_CONFIGS = {
    2: {16: (32, 128, 128, 32, 4, 3), 32: (32, 128, 128, 32, 4, 3),
        64: (32, 128, 128, 32, 4, 3), 128: (32, 128, 128, 32, 8, 3),
        256: (16, 64, 64, 16, 8, 1)},
    4: {16: (32, 64, 64, 32, 4, 2), 32: (32, 64, 64, 32, 4, 2), 64: (32, 64, 64, 32, 4, 2),
        128: (16, 64, 64, 16, 8, 1), 256: (16, 32, 32, 16, 8, 1)},
}
_INTERPRETER_CONFIG = (16, 16, 16, 16, 4, 1)
_PRE_BLOCK = 64


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"{_NAME}.attention_bwd: {message}")


def check_bwd_inputs(q, k, v, out, dout, lse, dlse) -> None:
    """The kernel's host-side checks: shapes, dtypes, head sizes, device."""
    tensors = (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse))
    for arg, t in tensors + ((("dlse", dlse),) if dlse is not None else ()):
        _check(isinstance(t, torch.Tensor), f"{arg} must be a torch.Tensor, got "
                                            f"{type(t).__name__}")
    for arg, t in tensors[:5]:
        _check(t.dim() == 4, f"{arg} has shape {tuple(t.shape)}; expected 4 dims "
                             f"[batch, heads, seq, head_dim]")
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, head_dim_v = k.shape[1], v.shape[3]
    _check(k.shape[0] == batch and k.shape[3] == head_dim and v.shape[:3] == k.shape[:3],
           f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
           f"[B, Hq, Sq, D], [B, Hkv, Skv, D], [B, Hkv, Skv, Dv]")
    _check(heads_kv > 0 and heads_q % heads_kv == 0,
           f"q has {heads_q} heads, k has {heads_kv}; Hq must be a multiple of Hkv")
    want = (batch, heads_q, seq_q, head_dim_v)
    for arg, t in (("out", out), ("dout", dout)):
        _check(tuple(t.shape) == want, f"{arg} has shape {tuple(t.shape)}, expected "
                                       f"{list(want)} ([B, Hq, Sq, Dv], the forward's output)")
    for arg, t in (("lse", lse), ("dlse", dlse)):
        if t is None:
            continue
        _check(tuple(t.shape) == want[:3], f"{arg} has shape {tuple(t.shape)}, expected "
                                           f"{list(want[:3])} ([B, Hq, Sq])")
        _check(t.dtype == torch.float32, f"{arg} has dtype {t.dtype}; expected torch.float32 "
                                         f"(the forward's natural-log logsumexp)")
    _check(q.dtype in _DTYPES, f"q has dtype {q.dtype}; the Triton backward supports "
                               f"torch.float16, torch.bfloat16 and torch.float32 (use "
                               f"fxshard.kernels.attention.attention_backward for others)")
    for arg, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        _check(t.dtype == q.dtype, f"{arg} has dtype {t.dtype}, q {q.dtype}; cast them to "
                                   f"one dtype")
    for what, d in (("head_dim", head_dim), ("v's head_dim", head_dim_v)):
        _check(d in HEAD_DIMS, f"{what} is {d}; the Triton backward supports head_dim in "
                               f"{{16, 32, 64, 128, 256}}; pad q, k and v to the next "
                               f"supported size or use the torch backward")
    devices = {t.device for _, t in tensors} | ({dlse.device} if dlse is not None else set())
    _check(len(devices) == 1, f"the tensors are on {sorted(map(str, devices))}; move them to "
                              f"one device")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{_NAME}.attention_bwd: got tensors on {q.device}, but the Triton kernels run on "
            f"CUDA only; set TRITON_INTERPRET=1 in the environment before triton is first "
            f"imported to run them in Triton's CPU interpreter (slow, for tests), or use "
            f"fxshard.kernels.attention.attention_backward (torch)")


def attention_bwd(q, k, v, out, dout, lse, *, causal: bool = False, scale: float | None = None,
                  q_offset: int = 0, kv_offset: int = 0, softcap: float = 0.0, mask=None,
                  dlse=None, grad_dtype: torch.dtype = torch.float32,
                  config: tuple | None = None):
    """``(dq, dk, dv)`` of ``attention(q, k, v)`` from the forward's ``out`` and natural-log
    ``lse`` (for a ring step: the *global* merged ones) for the output gradient ``dout`` and,
    optionally, ``dlse`` (the gradient of the ``lse`` output). The signature of
    :func:`fxshard.kernels.attention_backward.attention_block_backward` (the torch block
    backward), which also returns ``grad_dtype``, float32 by default (the accumulation dtype:
    a ring sums its chunks' dK/dV unrounded); pass the inputs' dtype for gradients to use as
    they are. Each gradient has its input's memory layout. ``mask`` must be None (the kernels
    take none). ``config``: ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps,
    num_stages)``, by default ``_GPU_CONFIGS`` (``_INTERPRETER_CONFIG`` in the interpreter)."""
    if mask is not None:
        raise ValueError(f"{_NAME}.attention_bwd: got a mask of shape {tuple(mask.shape)}, but "
                         f"the Triton backward takes none; express it with causal/q_offset/"
                         f"kv_offset, or use the torch backward (attention_block_backward)")
    _check(grad_dtype in _DTYPES, f"grad_dtype={grad_dtype!r}; expected one of torch.float16, "
                                  f"torch.bfloat16, torch.float32")
    check_bwd_inputs(q, k, v, out, dout, lse, dlse)
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    dq, dk, dv = (torch.empty_like(x, dtype=grad_dtype) for x in (q, k, v))
    if dk.numel() and seq_q == 0:
        dk.zero_()
        dv.zero_()
    if dq.numel() and seq_kv == 0:
        dq.zero_()
    if seq_q == 0 or seq_kv == 0 or batch * heads_q == 0:
        return dq, dk, dv
    if config is None:
        config = (_INTERPRETER_CONFIG if q.device.type != "cuda"
                  else _GPU_CONFIGS[q.element_size()][max(head_dim, head_dim_v)])
    block_m1, block_n1, block_m2, block_n2, num_warps, num_stages = config
    for name, b in zip(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), config[:4]):
        _check(isinstance(b, int) and b >= 16 and not b & (b - 1),
               f"{name}={b!r}; block sizes must be powers of two >= 16")
    delta = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=q.device)
    _attn_bwd_preprocess[(triton.cdiv(seq_q, _PRE_BLOCK), batch * heads_q)](
        out, dout, dlse if dlse is not None else lse, delta, *out.stride(), *dout.stride(),
        *(dlse if dlse is not None else lse).stride(), heads_q, seq_q,
        HEAD_DIM_V=head_dim_v, BLOCK_M=_PRE_BLOCK, HAS_DLSE=dlse is not None)
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, CAUSAL=bool(causal),
                  SOFTCAP=bool(softcap),
                  INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  num_warps=num_warps, num_stages=num_stages)
    scalars = (heads_q, heads_q // heads_kv, seq_q, seq_kv, int(q_offset), int(kv_offset),
               float(scale) * _LOG2E, float(scale), float(softcap) * _LOG2E if softcap else 1.0)
    inputs = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride())
    _attn_bwd_dkdv[(triton.cdiv(seq_kv, block_n1), batch * heads_kv)](
        q, k, v, dout, lse, delta, dk, dv, *inputs, *dk.stride(), *dv.stride(), *scalars,
        BLOCK_M=block_m1, BLOCK_N=block_n1, **common)
    _attn_bwd_dq[(triton.cdiv(seq_q, block_m2), batch * heads_q)](
        q, k, v, dout, lse, delta, dq, *inputs, *dq.stride(), *scalars,
        BLOCK_M=block_m2, BLOCK_N=block_n2, **common)
    return dq, dk, dv
