"""Triton split-K decode attention (flash-decoding) and its host-side launcher.

Decode reads a long KV cache for very few queries, so the kernel is bound by memory bandwidth:
every byte of K and V should be read once, by many programs in parallel. Two kernels:

1. ``_decode_split``: grid ``(B * Hkv, n_splits, m_blocks)``. A program takes one (sequence,
   KV head) pair and one split of the cache's keys, and loads the ``M = G * Sq`` query rows of
   *all* G query heads of that KV head at once (row ``r`` is query head ``kvh * G + r // Sq``,
   query ``r % Sq``), padded to ``BLOCK_M``, a power of two >= 16 for ``tl.dot``; so a K/V block
   is read once for the whole group; the head dim is padded (masked) to a power of two >= 16
   as well, so any ``D <= 256`` runs. It reads ``lengths[b]`` itself (no host sync), streams its
   keys below that length through an online softmax (fp32, ``exp2``) and writes a partial
   ``out`` (normalised, fp32) and ``lse`` for its split; a split that sees no key writes
   ``out = 0``, ``lse = -inf``. Causal: query ``i`` sees key ``j`` iff
   ``j <= lengths[b] - Sq + i``. Key blocks that every row sees in full run a mask-free loop,
   the rest (the tail of the valid keys, the causal corner) a masked one; both run the
   prefill kernel's online-softmax step (:mod:`fxshard.kernels.triton_softmax`).
2. ``_decode_merge``: one program per (sequence, query head, query) row merges the ``n_splits``
   partial results by logsumexp: ``lse = logsumexp_s(lse_s)``,
   ``out = sum_s exp(lse_s - lse) * out_s``; a row whose splits all saw nothing gets 0, -inf.

The number of splits depends only on the cache capacity ``L`` (the lengths stay on the device)
and the SM count: enough splits that ``B * Hkv * n_splits`` programs fill about ``_WAVES`` waves
of the GPU's SMs, but no split shorter than ``_MIN_SPLIT_BLOCKS`` key blocks (a program must
stream enough bytes to amortise its start and its partial result). See ``num_splits``.

On CPU tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton
is first imported), as :mod:`fxshard.kernels.triton_attention` explains.

Shape legend: B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, Sq queries, L cache
capacity, D head dim (Dv v's, which may differ: MLA), P number of key splits. ``q_BHSD``
``[B, Hq, Sq, D]``; ``k_BKLD`` ``[B, Hkv, L, D]``, ``v_BKLD`` ``[B, Hkv, L, Dv]``; ``lengths_B``
``[B]``; partials ``o_BHSPD`` ``[B, Hq, Sq, P, Dv]``
and ``lse_BHSP`` ``[B, Hq, Sq, P]`` (float32); ``lse_BHS`` ``[B, Hq, Sq]``.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_softmax import online_softmax_finish, online_softmax_step

__all__ = ["MAX_HEAD_DIM", "decode_fwd", "interpreting", "num_splits"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NAME = "fxshard.kernels.decode_attention"
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split(Q, K, V, Lengths, OutPart, LsePart,
                  stride_qz, stride_qh, stride_qm, stride_qk,
                  stride_kz, stride_kh, stride_kn, stride_kk,
                  stride_vz, stride_vh, stride_vn, stride_vk,
                  stride_pz, stride_ph, stride_pm, stride_ps, stride_pk,
                  stride_lz, stride_lh, stride_lm, stride_ls,
                  H_KV, GROUP, SEQ_Q, CAPACITY, SPLIT_KEYS, qk_scale, cap_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    off_zk = tl.program_id(0)
    split = tl.program_id(1)
    block_m = tl.program_id(2)
    off_z = off_zk // H_KV
    off_kvh = off_zk % H_KV

    # row r of this block: query head off_kvh * GROUP + r // SEQ_Q, query r % SEQ_Q
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * SEQ_Q
    head = off_kvh * GROUP + offs_m // SEQ_Q
    query = offs_m % SEQ_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)      # head dim padded to a power of two >= 16
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)    # v's head dim (MLA: may differ), padded likewise
    dv_ok = offs_dv < HEAD_DIM_V

    q_rows = off_z.to(tl.int64) * stride_qz + head.to(tl.int64) * stride_qh + query * stride_qm
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * stride_qk,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + off_z.to(tl.int64) * stride_kz + off_kvh.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_kvh.to(tl.int64) * stride_vh
    k_cols = k_base + offs_d[None, :] * stride_kk
    v_cols = v_base + offs_dv[None, :] * stride_vk

    # keys of sequence off_z: [0, hi); row r sees key j iff j <= last[r]
    length = tl.load(Lengths + off_z).to(tl.int32)
    hi = tl.maximum(tl.minimum(length, CAPACITY), 0)
    if CAUSAL:
        last = length - SEQ_Q + query
        seen_by_all = length - SEQ_Q + 1
    else:
        last = tl.zeros([BLOCK_M], dtype=tl.int32) + (length - 1)
        seen_by_all = length
    lo = split * SPLIT_KEYS
    end = tl.minimum(lo + SPLIT_KEYS, hi)
    # blocks in [lo, full_end) lie below hi and are seen by every row: no mask
    full_end = lo + (tl.maximum(tl.minimum(end, seen_by_all) - lo, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for phase in tl.static_range(2):
        if phase == 0:
            start = lo
            stop = full_end
        else:
            start = full_end
            stop = end
        for start_n in range(start, stop, BLOCK_N):
            offs_kv = start_n + offs_n
            k_ptrs = k_cols + offs_kv.to(tl.int64)[:, None] * stride_kn
            v_ptrs = v_cols + offs_kv.to(tl.int64)[:, None] * stride_vn
            if phase == 0 and BLOCK_D == HEAD_DIM and BLOCK_DV == HEAD_DIM_V:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            elif phase == 0:
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
            else:
                key_ok = (offs_kv < stop)[:, None]
                k = tl.load(k_ptrs, mask=key_ok & d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok & dv_ok[None, :], other=0.0)
            # non-causal rows need no "<= last" check: key < stop <= length already says it
            m_i, l_i, acc = online_softmax_step(
                q, k, v, m_i, l_i, acc, qk_scale, cap_log2, offs_kv, stop, last,
                MASKED=phase == 1, CAUSAL=CAUSAL, SOFTCAP=SOFTCAP,
                INPUT_PRECISION=INPUT_PRECISION)

    out, lse = online_softmax_finish(m_i, l_i, acc)
    p_rows = (off_z.to(tl.int64) * stride_pz + head.to(tl.int64) * stride_ph
              + query * stride_pm + split * stride_ps)
    tl.store(OutPart + p_rows[:, None] + offs_dv[None, :] * stride_pk, out,
             mask=row_ok[:, None] & dv_ok[None, :])
    l_rows = (off_z.to(tl.int64) * stride_lz + head.to(tl.int64) * stride_lh
              + query * stride_lm + split * stride_ls)
    tl.store(LsePart + l_rows, lse, mask=row_ok)


@triton.jit
def _decode_merge(OutPart, LsePart, Out, Lse,
                  stride_pr, stride_ps, stride_pk, stride_lr, stride_ls,
                  stride_oz, stride_oh, stride_om, stride_ok,
                  H_Q, SEQ_Q, N_SPLITS,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  CHUNK_S: tl.constexpr):
    row = tl.program_id(0)
    off_z = row // (H_Q * SEQ_Q)
    off_h = (row // SEQ_Q) % H_Q
    off_m = row % SEQ_Q
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(LsePart + row.to(tl.int64) * stride_lr + offs_s * stride_ls,
                    mask=offs_s < N_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp(lse_s - lse_max), 0)
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)

    offs_c = tl.arange(0, CHUNK_S)
    offs_d = tl.arange(0, BLOCK_D)      # here HEAD_DIM / BLOCK_D are v's (the output's)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, N_SPLITS, CHUNK_S):
        split_ok = start + offs_c < N_SPLITS
        lse_c = tl.load(LsePart + row.to(tl.int64) * stride_lr + (start + offs_c) * stride_ls,
                        mask=split_ok, other=float("-inf"))
        weight = tl.exp(lse_c - lse_max) / total_safe
        # a split that saw no key has weight 0: its partial out (0) need not be read
        part = tl.load(OutPart + row.to(tl.int64) * stride_pr
                       + (start + offs_c)[:, None] * stride_ps + offs_d[None, :] * stride_pk,
                       mask=(split_ok & (weight > 0.0))[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(part * weight[:, None], 0)

    lse = tl.where(empty, float("-inf"), lse_max + tl.log(total_safe))
    o_ptrs = (Out + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
              + off_m * stride_om + offs_d * stride_ok)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + row, lse)


def interpreting() -> bool:
    """Whether this process runs Triton kernels in the CPU interpreter (decided when triton is
    first imported; see :func:`fxshard.kernels.triton_attention.interpreting`)."""
    return isinstance(_decode_split, InterpretedFunction) and isinstance(tl.zeros,
                                                                         InterpretedFunction)


# (BLOCK_N, num_warps, num_stages) by element size and head dim, for H100/H200 (sm_90): the
# rows are few, so blocks are wide in keys and deep in stages to keep loads in flight.
_GPU_CONFIGS = {
    2: {16: (128, 4, 4), 32: (128, 4, 4), 64: (128, 4, 4), 128: (64, 4, 4), 256: (32, 4, 3)},
    4: {16: (64, 4, 3), 32: (64, 4, 3), 64: (64, 4, 3), 128: (32, 4, 3), 256: (16, 4, 3)},
}
_INTERPRETER_CONFIG = (16, 1, 1)
_INTERPRETER_SMS = 4     # in the interpreter: a small "GPU", so several splits are exercised
_MAX_BLOCK_M = 64        # rows per program; more query rows (G * Sq) take more row blocks
_WAVES = 2               # target programs: about this many per SM
_MIN_SPLIT_BLOCKS = 4    # no split shorter than this many key blocks
_MERGE_CHUNK = 16        # splits merged per step (bounds the merge kernel's registers)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(capacity: int, programs: int, sm_count: int, block_n: int) -> int:
    """How many key splits to launch: ``programs = B * Hkv * m_blocks`` programs per split.

    Enough splits for about ``_WAVES`` programs per SM, each split at least
    ``_MIN_SPLIT_BLOCKS * block_n`` keys; at least 1, at most one per key block. Depends on the
    capacity, not the lengths (those stay on the device).
    """
    blocks = max(1, triton.cdiv(capacity, block_n))
    want = triton.cdiv(_WAVES * sm_count, max(programs, 1))
    return max(1, min(want, triton.cdiv(blocks, _MIN_SPLIT_BLOCKS)))


def _check_block(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1):
        raise ValueError(f"{_NAME}: {name}={value!r}; block sizes must be powers of two >= 16 "
                         f"(tl.dot needs at least 16 rows and columns).")


def decode_fwd(q_BHSD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor,
               lengths_B: torch.Tensor, *, scale: float, causal: bool, softcap: float = 0.0,
               n_splits: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None):
    """Launch ``_decode_split`` then ``_decode_merge``; returns ``(out_BHSD, lse_BHS)``.

    The generic checks (shapes, GQA, dtypes, devices, lengths) are done by
    :func:`fxshard.kernels.decode.decode_attention` first; here are the kernel's own.
    ``n_splits`` and the launch options default to :func:`num_splits` and ``_GPU_CONFIGS``
    (``_INTERPRETER_CONFIG`` in the interpreter); they are exposed for tests and benchmarks.
    ``softcap > 0`` caps the scaled scores at ``softcap * tanh(s / softcap)``; 0 is off.
    """
    head_dim, head_dim_v = q_BHSD.shape[-1], v_BKLD.shape[-1]
    for what, d in (("head_dim", head_dim), ("v's head_dim", head_dim_v)):
        if d > MAX_HEAD_DIM:
            raise ValueError(
                f"{_NAME}: {what} is {d}, but backend='triton' supports head_dim up to "
                f"{MAX_HEAD_DIM} (one program holds a row's whole output); use "
                f"backend='torch'.")
    if q_BHSD.dtype not in _DTYPES:
        raise ValueError(
            f"{_NAME}: q has dtype {q_BHSD.dtype}, but backend='triton' supports torch.float16, "
            f"torch.bfloat16 and torch.float32; cast the inputs or use backend='torch'.")
    if n_splits is not None and (isinstance(n_splits, bool) or not isinstance(n_splits, int)
                                 or n_splits < 1):
        raise ValueError(f"{_NAME}: n_splits={n_splits!r}; expected an int >= 1.")
    if block_n is not None:
        _check_block("block_n", block_n)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BKLD, v_BKLD)):
        raise ValueError(
            f"{_NAME}: backend='triton' (what 'auto' picks on CUDA) is forward-only and its "
            f"inputs require grad; run decoding under torch.no_grad() or use backend='torch'.")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    interpret = interpreting()
    if q_BHSD.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(
            f"{_NAME}: backend='triton' got tensors on {q_BHSD.device}, but the Triton kernel "
            f"runs on CUDA only; set the environment variable TRITON_INTERPRET=1 (before triton "
            f"is first imported) to run it in Triton's CPU interpreter (slow, for tests), or use "
            f"backend='torch'.")
    if q_BHSD.device.type != "cuda" and not interpret:
        raise ValueError(
            f"{_NAME}: TRITON_INTERPRET=1 is set, but triton was imported before it was, so "
            f"Triton built its functions for the GPU; set TRITON_INTERPRET=1 in the environment "
            f"before the process first imports triton, or use backend='torch'.")
    config = (_INTERPRETER_CONFIG if interpret
              else _GPU_CONFIGS[q_BHSD.element_size()][max(block_d, block_dv)])
    block_n = config[0] if block_n is None else block_n
    num_warps = config[1] if num_warps is None else num_warps
    num_stages = config[2] if num_stages is None else num_stages

    batch, heads_q, seq_q, _ = q_BHSD.shape
    heads_kv, capacity = k_BKLD.shape[1], k_BKLD.shape[2]
    rows = heads_q // heads_kv * seq_q
    out_BHSD = torch.empty((batch, heads_q, seq_q, head_dim_v), dtype=q_BHSD.dtype,
                           device=q_BHSD.device)
    lse_BHS = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=q_BHSD.device)
    if out_BHSD.numel() == 0:
        return out_BHSD, lse_BHS
    if capacity == 0:
        return out_BHSD.zero_(), lse_BHS.fill_(float("-inf"))
    block_m = min(max(16, triton.next_power_of_2(rows)), _MAX_BLOCK_M)
    m_blocks = triton.cdiv(rows, block_m)
    if n_splits is None:
        sms = _INTERPRETER_SMS if interpret else _sm_count(q_BHSD.device.index or 0)
        n_splits = num_splits(capacity, batch * heads_kv * m_blocks, sms, block_n)
    split_keys = triton.cdiv(triton.cdiv(capacity, n_splits), block_n) * block_n
    n_splits = triton.cdiv(capacity, split_keys)   # no split left without keys of the cache

    o_BHSPD = torch.empty((batch, heads_q, seq_q, n_splits, head_dim_v), dtype=torch.float32,
                          device=q_BHSD.device)
    lse_BHSP = torch.empty((batch, heads_q, seq_q, n_splits), dtype=torch.float32,
                           device=q_BHSD.device)
    precision = "ieee" if q_BHSD.dtype == torch.float32 else "tf32"
    _decode_split[(batch * heads_kv, n_splits, m_blocks)](
        q_BHSD, k_BKLD, v_BKLD, lengths_B, o_BHSPD, lse_BHSP,
        *q_BHSD.stride(), *k_BKLD.stride(), *v_BKLD.stride(), *o_BHSPD.stride(),
        *lse_BHSP.stride(),
        heads_kv, heads_q // heads_kv, seq_q, capacity, split_keys, float(scale) * _LOG2E,
        float(softcap) * _LOG2E if softcap else 1.0,
        HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), SOFTCAP=bool(softcap),
        INPUT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    o_RPD = o_BHSPD.view(-1, n_splits, head_dim_v)
    lse_RP = lse_BHSP.view(-1, n_splits)
    _decode_merge[(batch * heads_q * seq_q,)](
        o_RPD, lse_RP, out_BHSD, lse_BHS, *o_RPD.stride(), *lse_RP.stride(),
        *out_BHSD.stride(), heads_q, seq_q, n_splits,
        HEAD_DIM=head_dim_v, BLOCK_D=block_dv, BLOCK_S=max(16, triton.next_power_of_2(n_splits)),
        CHUNK_S=min(_MERGE_CHUNK, max(16, triton.next_power_of_2(n_splits))),
        num_warps=1 if interpret else 4)
    return out_BHSD, lse_BHS
