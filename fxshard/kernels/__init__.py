"""fxshard.kernels: fused attention returning logsumexp, and the online-softmax merge.

Importing this package registers the custom op ``torch.ops.fxshard.attention``, schema
``fxshard::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale,
SymInt q_offset, SymInt kv_offset) -> (Tensor, Tensor)`` (Python ints are accepted for the
offsets; SymInt lets them be symbolic under torch.export). Triton is imported only when the
Triton backend is used, so this package works without it.
"""
from .attention import attention, merge_attention

__all__ = ["attention", "merge_attention"]
