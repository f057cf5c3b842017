"""An output of ``pm(x)`` left sharded: the vocab-parallel, batch-split logits.

With grad enabled, a model output whose last dim the forward program holds sharded over ``tp``
(a column-parallel ``lm_head``: the logits) leaves the program as each rank's block (its
``tp`` columns, and its rows where ``dp``/``fsdp`` split the batch:
:mod:`fxshard.training.vocab_blocks`), and ``pm(x)`` returns a :class:`VocabShardedTensor`
over the blocks instead of gathering ``[B, S, V]``. It reads like the whole tensor (shape,
dtype, device, printing, any op), and the ops a loss takes on the way to a cross-entropy run
on the blocks::

    logits = pm(ids).logits                      # blocks [B/dp, S, V/tp], no all-gather
    x = logits[:, :-1].flatten(0, 1).float()     # still blocks, [B/dp*(S-1), V/tp] each
    loss = F.cross_entropy(x, labels[:, 1:].flatten())   # vocab-parallel, on each rank's rows
    loss.backward()                              # each block's gradient, no [B, S, V] either

    cross_entropy = nll_loss(log_softmax(x)):
      log_softmax: m = all_reduce_max(amax(block)), s = all_reduce(sum(exp(block - m)))
                   block - m - log(s)            (over tp; its backward: one all_reduce [N, 1])
      nll_loss:    each rank picks its rows' targets in its vocab range, all_reduce over tp;
                   the rows' sum all-reduced over dp (a scalar), divided by the whole batch's
                   count (or class weight) of valid targets

On blocks: views and reshapes that keep the last dim (``view``, ``reshape``, ``flatten``,
``unflatten``, indexing and ``split``/``chunk`` of the leading dims; of dim 0 only where the
batch axes leave it whole), dtype casts, ``contiguous``/``clone``, products and quotients
with a Python number, ``log_softmax`` / ``softmax`` over the last dim, ``cross_entropy`` /
``nll_loss`` (class dim last; ``weight``, ``ignore_index``, ``reduction`` and
``label_smoothing`` as PyTorch's; ``reduction="none"`` returns the rows gathered), ``gather``
over the last dim. Any other op sees the whole tensor: the blocks are gathered once (a
simulated mesh: joined; a real one: ``all_gather`` over ``tp``, then over the batch axes),
differentiably, and that tensor is kept for later ops (the ops on blocks:
:mod:`fxshard.training.vocab_handlers`). Ops that write in place are an error
(the blocks would go stale): compute on ``x.full()``, the whole tensor.

A vocab ``tp`` does not divide (:mod:`fxshard.passes.pad_vocab`) arrives as blocks of the padded
vocab, ``ceil(V / tp)`` columns each (``Blocks.valid = V``): the tensor's shape says ``V``,
its softmax, log-softmax and cross-entropy read the last block's columns past ``V`` as
``-inf`` (they get no gradient), and :meth:`VocabShardedTensor.full` cuts them off.

On a simulated mesh the tensor holds every block (the other axes hold replicas); under
``torchrun`` this rank's, and the reductions are collectives that every rank of the axis
runs (the same loss on every rank, as with any output).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .vocab_blocks import Blocks

__all__ = ["VocabShardedTensor", "Blocks"]

_WHERE = "fxshard.training.vocab_output"

# a registry: torch function -> its handler on the blocks (fxshard.training.vocab_handlers)
HANDLERS: dict = {}


# -- the tensor ------------------------------------------------------------------------------

_META = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__,
    torch.Tensor.is_nested.__get__, torch.Tensor.itemsize.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.get_device, torch.Tensor.__len__,
    torch.Tensor.is_contiguous, torch.Tensor.stride, torch.Tensor.dim_order,
    torch.numel, torch.is_floating_point, torch.is_complex,
}
_INPLACE_DUNDER = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                   "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                   "__irshift__", "__imatmul__", "__setitem__", "__set__"}


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDER or (name.endswith("_") and not name.startswith("__"))


class VocabShardedTensor(torch.Tensor):
    """The whole output, held as its ``tp`` blocks of the last dim; see the module."""

    @staticmethod
    def __new__(cls, blocks: list[torch.Tensor], where: Blocks):
        b0 = blocks[0]
        width = sum(b.shape[-1] for b in blocks[:where.per_row]) if where.backend is None \
            else b0.shape[-1] * where.n
        if where.valid is not None:     # a vocab padded for tp: the columns past it unread
            width = where.valid
        lead = tuple(b0.shape[:-1])
        if where.rows > 1:      # dim 0 split over the batch axes
            lead = (lead[0] * where.rows, *lead[1:])
        shape = (*lead, width)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=b0.dtype, device=b0.device,
                                                  requires_grad=False)
        out._blocks, out._where, out._full = list(blocks), where, None
        return out

    def __init__(self, blocks, where):
        pass

    # -- the whole tensor --------------------------------------------------------------------
    @property
    def blocks(self) -> list[torch.Tensor]:
        """The blocks held (a simulated mesh: every row group's ``tp`` blocks, row-major)."""
        return list(self._blocks)

    @property
    def gathered(self) -> bool:
        """Whether an op has gathered the blocks into the whole tensor (:meth:`full`)."""
        return self._full is not None

    def full(self) -> torch.Tensor:
        """The whole tensor, gathered once and kept (differentiable)."""
        if self._full is None:
            self._full = self._where.gather(self._blocks)
        return self._full

    def __repr__(self, *, tensor_contents=None):
        return repr(self.full())

    def _like(self, blocks) -> "VocabShardedTensor":
        return VocabShardedTensor(blocks, self._where)

    def _each(self, fn) -> "VocabShardedTensor":
        return self._like([fn(b) for b in self._blocks])

    # -- ops ------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"{_WHERE}: {func} reached a vocab-sharded output of pm(x) below "
            f"__torch_function__ (its blocks were not gathered); call .full() on it first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], VocabShardedTensor) else None
        if func is torch.Tensor.requires_grad.__get__ and me is not None:
            return any(b.requires_grad for b in me._blocks)
        if func is torch.Tensor.is_leaf.__get__ and me is not None:
            return not any(b.requires_grad for b in me._blocks)
        if _in_place(func) or isinstance(kwargs.get("out"), VocabShardedTensor):
            raise NotImplementedError(
                f"{_WHERE}: {getattr(func, '__name__', func)} writes in place into a "
                f"vocab-sharded output of pm(x) (its tp blocks would go stale); compute on a "
                f"new tensor (x = x * s), or on x.full(), the whole tensor")
        handler = HANDLERS.get(func)
        if handler is not None:
            got = handler(*args, **kwargs)
            if got is not NotImplemented:
                return got
        args, kwargs = pytree.tree_map_only(VocabShardedTensor, lambda t: t.full(),
                                            (args, kwargs))
        return func(*args, **kwargs)


from . import vocab_handlers  # noqa: E402,F401 (registers the handlers; it imports the tensor)
