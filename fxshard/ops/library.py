"""A thin ``torch.library`` registration for fxshard's ops.

``torch.library.custom_op`` wraps every call in Python layers (an autograd function, a
redispatch, an aliasing check of the outputs): ~50-80 us per call on CPU, paid by every
collective of every forward. fxshard's ops are inference ops whose implementations already
return fresh tensors, so they are registered directly as dispatcher kernels instead: the
schema with ``Library.define``, the implementation for the ``CPU`` and ``CUDA`` keys (and
``CompositeExplicitAutograd`` for any other device), the fake impl with
``torch.library.register_fake`` (so ``torch.export``, FX tracing and Inductor see them as
opaque ops with known output shapes). A call then costs one boxed dispatch into Python::

    @define_op("fxshard::all_reduce", "(Tensor x, str axis, int size) -> Tensor")
    def _all_reduce(x, axis, size): ...

    @_all_reduce.register_fake
    def _(x, axis, size): return x.new_empty(x.shape)

No autograd formula is registered by default: backward through the collectives is not
supported (fxshard runs inference graphs); an op that has a backward registers its own
``Autograd`` kernel with :meth:`Op.register_kernel` (``fxshard::attention`` does).

Eager rank programs (``fxshard.compile.eager_stage``) call the Python kernel itself, without
the dispatcher's boxing: :func:`direct_kernel` maps each op to it (or to the leaner kernel an
op registers with :meth:`Op.register_direct`, for checks its programs already passed when
they were traced). Those calls run under ``torch.no_grad`` on real tensors only.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["define_op", "direct_kernel", "Op"]

_LIBRARIES: dict[str, torch.library.Library] = {}   # registry: namespace -> fragment
_KEYS = ("CPU", "CUDA", "CompositeExplicitAutograd")
_DIRECT: dict = {}   # registry: OpOverload -> the Python kernel eager programs call


def direct_kernel(op: torch._ops.OpOverload) -> Callable | None:
    """The Python kernel of an op defined here (None for any other op)."""
    return _DIRECT.get(op)


class Op:
    """A defined op: calling it calls ``torch.ops.<ns>.<name>.default``."""

    def __init__(self, qualname: str, lib: torch.library.Library, fn: Callable):
        self.qualname = qualname
        self._lib = lib
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__
        ns, name = qualname.split("::")
        self.default = getattr(getattr(torch.ops, ns), name).default
        _DIRECT[self.default] = fn

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        return fake

    def register_direct(self, fn: Callable) -> Callable:
        """What eager rank programs call instead of the kernel (same results for the inputs
        a traced program gives it; no autograd)."""
        _DIRECT[self.default] = fn
        return fn

    def register_kernel(self, key: str, fn: Callable, *, with_keyset: bool = False) -> None:
        """Register ``fn`` for dispatch key ``key`` (e.g. an ``Autograd`` kernel)."""
        self._lib.impl(self.qualname.split("::")[1], fn, key, with_keyset=with_keyset)


def define_op(qualname: str, schema: str) -> Callable[[Callable], Op]:
    """Decorator: define ``qualname`` (``"ns::name"``) with ``schema`` (``"(args) -> ret"``)
    and register the decorated function as its kernel."""
    ns, name = qualname.split("::")
    lib = _LIBRARIES.get(ns)
    if lib is None:
        lib = _LIBRARIES[ns] = torch.library.Library(ns, "FRAGMENT")

    def register(fn: Callable) -> Op:
        lib.define(name + schema)
        for key in _KEYS:
            lib.impl(name, fn, key)
        return Op(qualname, lib, fn)
    return register
