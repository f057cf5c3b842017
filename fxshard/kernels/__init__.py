"""fxshard.kernels: fused attention returning logsumexp, decode attention against a KV cache,
and the online-softmax merge.

Importing this package registers the custom op ``torch.ops.fxshard.attention``, schema
``fxshard::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale,
SymInt q_offset, SymInt kv_offset) -> (Tensor, Tensor)`` (Python ints are accepted for the
offsets; SymInt lets them be symbolic under torch.export). ``decode_attention`` attends a few
new queries to the first ``lengths[b]`` slots of a static KV cache with the same ``(out, lse)``
contract; on CUDA it runs a split-K (flash-decoding) Triton kernel
(:mod:`fxshard.kernels.triton_decode`: all query heads of a KV head per program, keys split
across programs, splits merged by logsumexp), on CPU plain torch ops. Triton is imported only
when a Triton backend is used, so this package works without it.
"""
from .attention import attention, merge_attention
from .decode import decode_attention

__all__ = ["attention", "decode_attention", "merge_attention"]
