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

``fxshard::attention_backward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse,
Tensor dout, Tensor? dlse, bool causal, float? scale, SymInt q_offset, SymInt kv_offset,
float softcap=0.0) -> (Tensor, Tensor, Tensor)``
    ``(dq, dk, dv)`` of the forward's contract from its ``out`` and ``lse`` (``dlse``: the
    gradient of the ``lse`` output, or None): on CUDA without a mask, with head sizes and a
    dtype the kernel takes, the Triton backward (:mod:`fxshard.kernels.triton_attention_bwd`),
    otherwise :func:`fxshard.kernels.attention.attention_backward` (torch; same math). Each
    gradient has its input's shape, dtype and memory layout. What CUDA training programs run
    in place of aten's attention backward (``fxshard/training/cuda_attention.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from fxshard.kernels.attention import attention_backward, auto_attention, check_inputs
from fxshard.kernels.attention_out import attention_out_bshd
from fxshard.ops.library import define_op

__all__ = ["attention", "attention_backward_op", "attention_out"]

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


_BWD_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, Tensor dout, "
             "Tensor? dlse, bool causal, float? scale, SymInt q_offset, SymInt kv_offset, "
             "float softcap=0.0)")


def _triton_backward_takes(q, v, mask, out, dout, lse, dlse) -> bool:
    """Whether the Triton backward runs these inputs (else the torch one, same math)."""
    if q.device.type != "cuda" or mask is not None:
        return False
    from fxshard.kernels.attention import triton_module
    if triton_module() is None:
        return False
    from fxshard.kernels.triton_attention import HEAD_DIMS
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.shape[-1] in HEAD_DIMS and v.shape[-1] in HEAD_DIMS
            and out.dtype == dout.dtype == q.dtype
            and lse.dtype == torch.float32 and (dlse is None or dlse.dtype == torch.float32))


def _check_backward(q, k, v, mask, out, lse, dout, dlse, scale, q_offset, kv_offset, softcap):
    """The forward's checks, and out/dout/lse/dlse shaped as the forward gives them."""
    check_inputs(q, k, v, mask, scale, q_offset, kv_offset, softcap)
    want = (*q.shape[:3], v.shape[3])
    for arg, t, shape in (("out", out, want), ("dout", dout, want), ("lse", lse, want[:3]),
                          ("dlse", dlse, want[:3])):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"fxshard::attention_backward: {arg} has shape {tuple(t.shape)}, "
                             f"expected {list(shape)} (the forward's [B, Hq, Sq, Dv] output, "
                             f"[B, Hq, Sq] logsumexp)")


@define_op("fxshard::attention_backward", _BWD_ARGS + " -> (Tensor, Tensor, Tensor)")
def attention_backward_op(q, k, v, mask, out, lse, dout, dlse, causal, scale, q_offset,
                          kv_offset, softcap=0.0):
    """``fxshard::attention_backward``: Triton on CUDA where the kernel takes the inputs,
    torch otherwise."""
    _check_backward(q, k, v, mask, out, lse, dout, dlse, scale, q_offset, kv_offset, softcap)
    if _triton_backward_takes(q, v, mask, out, dout, lse, dlse):
        from fxshard.kernels.attention import scale_of
        from fxshard.kernels.triton_attention_bwd import attention_bwd
        return attention_bwd(q, k, v, out, dout, lse, causal=bool(causal),
                             scale=scale_of(q, scale), q_offset=int(q_offset),
                             kv_offset=int(kv_offset), softcap=float(softcap or 0.0),
                             dlse=dlse, grad_dtype=q.dtype)
    grads = attention_backward(q, k, v, mask, out, lse, dout, dlse, causal, scale, q_offset,
                               kv_offset, softcap)
    # the layout of the inputs, as the Triton path (and aten's backward ops) give
    return tuple(torch.empty_like(x).copy_(g) for x, g in zip((q, k, v), grads))


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, mask, out, lse, dout, dlse, causal, scale, q_offset,
                             kv_offset, softcap=0.0):
    _check_backward(q, k, v, mask, out, lse, dout, dlse, scale, q_offset, kv_offset, softcap)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_backward_autograd(keyset, *args):
    """No double backward: a clear error rather than a gradient silently missing."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in args):
        raise NotImplementedError(
            "fxshard::attention_backward: an input requires grad, but the attention backward "
            "has no backward of its own (double backward); call it under torch.no_grad() or "
            "differentiate fxshard::attention through fxshard.kernels.attention_backward's "
            "torch ops")
    return attention_backward_op.default.redispatch(keyset & torch._C._after_autograd_keyset,
                                                    *args)


attention_backward_op.register_kernel("Autograd", _attention_backward_autograd,
                                      with_keyset=True)
