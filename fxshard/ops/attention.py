"""The attention ops of rank programs: ``fxshard::attention`` and ``fxshard::attention_out``.

``fxshard::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale,
SymInt q_offset, SymInt kv_offset, float softcap=0.0) -> (Tensor, Tensor)``
    ``(out, lse)`` of :func:`fxshard.kernels.attention` with ``backend="auto"`` (``out``
    ``[B, Hq, Sq, Dv]``: v's head size, which may differ from q/k's as in MLA): the inputs
    checked (:func:`fxshard.kernels.attention.check_inputs`, in the fake impl too), then
    :func:`fxshard.kernels.attention.auto_attention` (Triton on CUDA without a mask, torch
    otherwise). SymInt offsets let them be symbolic under ``torch.export`` (Python ints are
    accepted). An ``Autograd`` kernel records :func:`fxshard.kernels.attention.attention_backward`
    for calls that need a gradient; inference calls go straight to the device kernel. Eager rank
    programs call ``auto_attention`` directly (``direct_kernel``).

``fxshard::attention_out(...same arguments...) -> Tensor``
    its ``out`` alone, stored ``[B, S, H, D]`` (:mod:`fxshard.kernels.attention_out`); what CPU
    rank runners call where nothing reads the ``lse``. Inference only.
"""
from __future__ import annotations

from typing import Optional

import torch

from fxshard.kernels.attention import attention_backward, auto_attention, check_inputs
from fxshard.kernels.attention_out import attention_out_bshd
from fxshard.ops.library import define_op

__all__ = ["attention", "attention_out"]

_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale, "
         "SymInt q_offset, SymInt kv_offset, float softcap=0.0)")


@define_op("fxshard::attention", _ARGS + " -> (Tensor, Tensor)")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              causal: bool, scale: Optional[float], q_offset: int, kv_offset: int,
              softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``fxshard::attention``: backend="auto" dispatch (Triton on CUDA without mask, else torch)."""
    check_inputs(q, k, v, mask, scale, q_offset, kv_offset, softcap)
    return auto_attention(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap)


attention.register_direct(auto_attention)


@attention.register_fake
def _attention_fake(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap=0.0):
    check_inputs(q, k, v, mask, scale, q_offset, kv_offset, softcap)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)


class _AttentionFunction(torch.autograd.Function):
    """``fxshard::attention`` with its backward (used only when an input needs grad)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, q_offset, kv_offset, softcap=0.0):
        out, lse = attention.default(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.options = (causal, scale, q_offset, kv_offset, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout_BHSD, dlse_BHS):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grads = attention_backward(q, k, v, mask, out, lse, dout_BHSD, dlse_BHS, *ctx.options)
        return (*grads, None, None, None, None, None, None)


def _attention_autograd(keyset, q, k, v, mask, causal, scale, q_offset, kv_offset,
                        softcap=0.0):
    """The Autograd kernel: inference calls go straight to the device kernel (no
    ``autograd.Function`` on the hot path); calls that need a gradient record the backward."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, mask, causal, scale, q_offset, kv_offset,
                                        softcap)
    return attention.default.redispatch(keyset & torch._C._after_autograd_keyset, q, k, v,
                                        mask, causal, scale, q_offset, kv_offset, softcap)


attention.register_kernel("Autograd", _attention_autograd, with_keyset=True)


attention_out = define_op("fxshard::attention_out", _ARGS + " -> Tensor")(attention_out_bshd)


@attention_out.register_fake
def _(q, k, v, mask, causal, scale, q_offset, kv_offset, softcap=0.0):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[3])).transpose(1, 2)
