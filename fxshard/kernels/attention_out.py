"""The output of ``fxshard::attention`` alone, in the memory layout torch's CPU flash kernel
writes (the layout ``F.scaled_dot_product_attention`` gives on CPU): the math of the op
``fxshard::attention_out`` (:mod:`fxshard.ops.attention`).

Most rank programs read only ``out`` of ``fxshard::attention`` (the ``lse`` is for context
parallelism's merges) and then transpose it back to ``[B, S, H, D]`` for the output
projection. ``fxshard::attention`` returns ``out`` contiguous in ``[B, H, S, D]`` and a
contiguous ``lse``: on CPU that is a copy of each (the flash kernel writes ``out`` in q's
layout, here ``[B, S, H, D]`` memory, and ``lse`` as ``[B, S, H]``), and the transpose +
reshape that follows copies ``out`` once more. :func:`attention_out_bshd` returns ``out`` in
``[B, S, H, D]`` memory (strides ``(S*H*D, D, H*D, 1)``), so that transpose is contiguous and
the reshape a view, as in hand-written code calling SDPA. Same values as
``fxshard::attention``'s ``out`` (the same kernels, finite check and exact fallback); only the
strides differ. The rank runners of CPU programs use it (``fxshard.passes.post_emit``:
``attention_out_only_pass``)::

    before: attention = torch.ops.fxshard.attention.default(q, k, v, None, True, 0.18, 0, 0)
            getitem = attention[0];  transpose = torch.ops.aten.transpose.int(getitem, 1, 2)
    after:  attention = torch.ops.fxshard.attention_out.default(q, k, v, None, True, 0.18, 0, 0)
            transpose = torch.ops.aten.transpose.int(attention, 1, 2)

Inference only (no autograd formula); shapes and dtypes were checked by ``fxshard::attention``
when the program was traced.
"""
from __future__ import annotations

import torch

from .attention import cpu_flash, torch_attention

__all__ = ["attention_out_bshd"]


def _bshd_strides(shape) -> tuple[int, int, int, int]:
    """Strides of a ``[B, H, S, D]`` tensor stored as ``[B, S, H, D]``."""
    _, heads, seq, head_dim = shape
    return (seq * heads * head_dim, head_dim, heads * head_dim, 1)


def attention_out_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, causal: bool,
                       scale, q_offset: int, kv_offset: int, softcap: float = 0.0
                       ) -> torch.Tensor:
    """``fxshard::attention(...)[0]`` for CPU tensors, stored as ``[B, S, H, D]``."""
    flash = cpu_flash(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap)
    out = (flash[0] if flash is not None
           else torch_attention(q, k, v, mask, causal, scale, q_offset, kv_offset,
                                softcap)[0])
    if out.stride() == _bshd_strides(out.shape):
        return out
    out_BSHD = torch.empty((out.shape[0], out.shape[2], out.shape[1], out.shape[3]),
                           dtype=out.dtype, device=out.device)
    out_BSHD.copy_(out.transpose(1, 2))
    return out_BSHD.transpose(1, 2)
