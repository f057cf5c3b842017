"""fxshard.kernels: the math of attention, pure: Triton kernels and their torch references.

``attention`` (fused attention returning logsumexp), ``decode_attention`` (a few queries
against a static KV cache, the same ``(out, lse)`` contract; on CUDA a split-K flash-decoding
Triton kernel, :mod:`fxshard.kernels.triton_decode`, on CPU plain torch ops) and
``merge_attention`` (the online-softmax merge); ``attention_block_backward`` (the backward of
one query chunk against one key chunk from the global logsumexp: ring attention's step). The Triton kernels share their online-softmax
step (:mod:`fxshard.kernels.triton_softmax`). Triton is imported only when a Triton backend is
used, so this package works without it.

This package imports nothing else of fxshard. The ops that put these kernels in graphs
(``torch.ops.fxshard.attention``, ``attention_out``, ``decode_attention``, ``ring_attention``:
schemas, fake impls, autograd) are defined in :mod:`fxshard.ops`; ``attention(...,
backend="auto")`` calls ``torch.ops.fxshard.attention``, which ``import fxshard`` registers.
"""
from .attention import attention, merge_attention
from .attention_backward import attention_block_backward
from .decode import decode_attention

__all__ = ["attention", "attention_block_backward", "decode_attention", "merge_attention"]
