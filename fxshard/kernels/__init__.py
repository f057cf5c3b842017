"""fxshard.kernels: fused attention returning logsumexp, and the online-softmax merge.

Importing this package registers the custom op ``torch.ops.fxshard.attention`` (schema
``fxshard::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale,
int q_offset, int kv_offset) -> (Tensor, Tensor)``). Triton is imported only when the Triton
backend is used.
"""
from .attention import attention, merge_attention

__all__ = ["attention", "merge_attention"]
