"""The Python bindings eager rank programs call for common ATen ops.

A traced program calls ``torch.ops.aten.mul.Tensor(a, b)``: through ``OpOverload._op`` that is a
boxed dispatcher call (arguments turned into IValues against the schema, ~2-6 us on CPU).
The generated Python binding of the same op (``torch.mul``) parses its arguments in C++ and
calls the same kernel (~1-4 us). For the overloads below, the binding called with the
overload's schema arguments (positional in schema order, keywords by schema name: how FX
writes a node's call) resolves to exactly that overload, so the eager runner
(``fxshard.compile.eager_stage``) calls the binding instead::

    before:  mul = torch.ops.aten.mul.Tensor(transpose, cos)        # boxed dispatch
    after:   mul = torch.mul(transpose, cos)                        # same kernel, same result

Ops not listed (``aten.slice``, ``aten._to_copy``, ...) keep ``OpOverload._op``. The table
is checked by tests/test_eager_runner.py: under a dispatch mode, each binding reaches the
listed overload, and a runner records the same ATen calls as the readable GraphModule.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["aten_binding"]

_aten, _nn = torch.ops.aten, torch._C._nn

_BINDINGS: dict = {   # registry: ATen overload -> its Python binding
    _aten.add.Tensor: torch.add,
    _aten.sub.Tensor: torch.sub,
    _aten.mul.Tensor: torch.mul,
    _aten.div.Tensor: torch.div,
    _aten.neg.default: torch.neg,
    _aten.pow.Tensor_Scalar: torch.pow,
    _aten.pow.Tensor_Tensor: torch.pow,
    _aten.pow.Scalar: torch.pow,
    _aten.rsqrt.default: torch.rsqrt,
    _aten.reciprocal.default: torch.reciprocal,
    _aten.exp.default: torch.exp,
    _aten.cos.default: torch.cos,
    _aten.sin.default: torch.sin,
    _aten.tanh.default: torch.tanh,
    _aten.mean.dim: torch.mean,
    _aten.sum.dim_IntList: torch.sum,
    _aten.linear.default: _nn.linear,
    _aten.silu.default: _nn.silu,
    _aten.gelu.default: _nn.gelu,
    _aten.embedding.default: torch.embedding,
    _aten.matmul.default: torch.matmul,
    _aten.mm.default: torch.mm,
    _aten.bmm.default: torch.bmm,
    _aten.addmm.default: torch.addmm,
    _aten.cat.default: torch.cat,
    _aten.reshape.default: torch.reshape,
    _aten.view.default: torch.Tensor.view,
    _aten.transpose.int: torch.transpose,
    _aten.permute.default: torch.permute,
    _aten.unsqueeze.default: torch.unsqueeze,
    _aten.expand.default: torch.Tensor.expand,
    _aten.t.default: torch.t,
    _aten.softmax.int: torch.softmax,
    _aten.where.self: torch.where,
    _aten.arange.default: torch.arange,
    _aten.arange.start_step: torch.arange,
    _aten._scaled_dot_product_flash_attention_for_cpu.default:
        torch._scaled_dot_product_flash_attention_for_cpu,
}


def aten_binding(op: torch._ops.OpOverload) -> Callable | None:
    """The Python binding that runs ``op`` for its schema's arguments (None: not listed)."""
    return _BINDINGS.get(op)
