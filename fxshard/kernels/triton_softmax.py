"""The online-softmax step both Triton attention kernels run per key block, and its ending.

:mod:`fxshard.kernels.triton_attention` (prefill / flash attention) and
:mod:`fxshard.kernels.triton_decode` (split-K decode) differ in which rows and keys a program
takes and which keys each row sees; per block of ``BLOCK_N`` keys they run the same step, one
``@triton.jit`` function inlined into both::

    s     = (q @ k^T) * qk_scale            scores in log2 units (qk_scale = scale * log2(e))
    s     = cap * tanh(s / cap)             SOFTCAP: Gemma-2's soft-cap, before the mask
    s     = -inf where not visible          MASKED: key < kv_end, and key <= last[row] if CAUSAL
    m_new = max(m, rowmax(s))               running max (-inf while a row has seen nothing)
    p     = exp2(s - m_new);  alpha = exp2(m - m_new)     (m_new = -inf taken as 0: no NaN)
    l     = l * alpha + rowsum(p);  acc = acc * alpha + p @ v

and end with :func:`online_softmax_finish`: ``out = acc / l`` and the natural-log
``lse = (m + log2 l) * ln 2``; a row that saw no key (``l == 0``) gives ``out = 0``,
``lse = -inf``, so partial results merge exactly by logsumexp.

Mask-free blocks (every row sees every key) pass ``MASKED=False``: no compare, no select.
"""
import triton
import triton.language as tl

__all__ = ["online_softmax_step", "online_softmax_finish"]


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, cap_log2, offs_kv, kv_end, last,
                        MASKED: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr):
    """One key block: ``q`` ``[M, D]``, ``k``/``v`` ``[N, D]`` (rows outside the block's valid
    keys loaded as 0), running ``m_i``/``l_i`` ``[M]`` and ``acc`` ``[M, D]`` (fp32); returns
    the updated ``(m_i, l_i, acc)``. ``offs_kv`` ``[N]``: the block's key indices; with
    ``MASKED`` a key is visible iff ``offs_kv < kv_end`` and, with ``CAUSAL``,
    ``offs_kv <= last[row]`` (``last`` ``[M]``; unused otherwise). ``cap_log2`` is the soft-cap
    times log2(e) (unused without ``SOFTCAP``)."""
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if SOFTCAP:
        # in log2 units (qk = s * log2(e), cap_log2 = cap * log2(e)): qk / cap_log2 is s / cap,
        # so cap_log2 * tanh(qk / cap_log2) is the capped score * log2(e), with
        # tanh(x) = 1 - 2 / (exp(2x) + 1) (finite for every x)
        e2x = tl.math.exp2(qk * (2.0 * 1.4426950408889634 / cap_log2))
        qk = cap_log2 * (1.0 - 2.0 / (e2x + 1.0))
    if MASKED:
        valid = offs_kv[None, :] < kv_end
        if CAUSAL:
            valid = valid & (offs_kv[None, :] <= last[:, None])
        qk = tl.where(valid, qk, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return m_ij, l_i, acc


@triton.jit
def online_softmax_finish(m_i, l_i, acc):
    """``(out, lse)`` of the rows: ``acc / l_i`` and the natural-log logsumexp; a row that saw
    no key gives ``out = 0`` and ``lse = -inf``."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return out, lse
