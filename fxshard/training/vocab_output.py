"""An output of ``pm(x)`` left sharded on its last dim over ``tp``: the vocab-parallel logits.

With grad enabled, a model output whose last dim the forward program holds sharded over ``tp``
(a column-parallel ``lm_head``: the logits) leaves the program as each rank's block, and
``pm(x)`` returns a :class:`VocabShardedTensor` over the blocks instead of gathering
``[B, S, V]``. It reads like the whole tensor (shape, dtype, device, printing, any op), and
the ops a loss takes on the way to a cross-entropy run on the blocks::

    logits = pm(ids).logits                      # blocks [B, S, V/tp], no all-gather
    x = logits[:, :-1].flatten(0, 1).float()     # still blocks, [B*(S-1), V/tp] each
    loss = F.cross_entropy(x, labels[:, 1:].flatten())   # vocab-parallel
    loss.backward()                              # each block's gradient, no [B, S, V] either

    cross_entropy = nll_loss(log_softmax(x)):
      log_softmax: m = all_reduce_max(amax(block)), s = all_reduce(sum(exp(block - m)))
                   block - m - log(s)            (its backward: one all_reduce of [N, 1])
      nll_loss:    each rank picks the targets in its vocab range, all_reduce of [N]

On blocks: views and reshapes that keep the last dim (``view``, ``reshape``, ``flatten``,
``unflatten``, indexing and ``split``/``chunk`` of the leading dims), dtype casts,
``contiguous``/``clone``, products and quotients with a Python number, ``log_softmax`` /
``softmax`` over the last dim, and ``cross_entropy`` / ``nll_loss`` (class dim last,
``weight=None``; ``ignore_index``, ``reduction`` and ``label_smoothing`` as PyTorch's),
``gather`` over the last dim. Any other op sees the whole tensor: the blocks are gathered once
(a simulated mesh: joined; a real one: ``all_gather`` over ``tp``), differentiably, and that
tensor is kept for later ops. Ops that write in place are an error (the blocks would go
stale): compute on ``x.full()``, the whole tensor.

On a simulated mesh the tensor holds every ``tp`` coordinate's block (the other axes hold
replicas); under ``torchrun`` this rank's, and the reductions are collectives over ``tp``
that every rank of the axis runs (the same loss on every rank, as with any output).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..mesh import TP

__all__ = ["VocabShardedTensor", "Blocks"]

_WHERE = "fxshard.training.vocab_output"


class Blocks:
    """Where a sharded output's blocks live and how they are reduced over ``tp``.

    ``coords``: the ``tp`` coordinates of the blocks held (a simulated mesh: all; a real
    mesh: this rank's), ``n`` the axis size, ``backend`` the real mesh's (else None)."""

    def __init__(self, n: int, coords: list[int], backend=None, axis: str = TP):
        self.n, self.coords, self.backend, self.axis = n, list(coords), backend, axis

    def sum(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every block's share summed over the axis (each block gets the total)."""
        if self.backend is None:
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            return [total] * len(parts)
        return [self.backend.all_reduce(parts[0], self.axis)]

    def max(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.backend is None:
            top = parts[0]
            for p in parts[1:]:
                top = torch.maximum(top, p)
            return [top] * len(parts)
        import torch.distributed as dist
        top = parts[0].contiguous().clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX,
                        group=self.backend.device_mesh.get_group(self.axis))
        return [top]

    def gather(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor (differentiable: its gradient is sliced back to the blocks)."""
        if self.backend is None:
            return torch.cat(blocks, -1)
        return _Gather.apply(self, blocks[0])

    def starts(self, widths: list[int]) -> list[int]:
        """Each held block's first vocab index (blocks of one real mesh have equal widths)."""
        if self.backend is None:
            return [sum(widths[:i]) for i in range(len(widths))]
        return [self.coords[0] * widths[0]]


class _Gather(torch.autograd.Function):
    """A real mesh's all-gather over ``tp``; its backward: this rank's slice of the
    gradient (every rank's loss is the same function of the whole tensor)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, block):
        ctx.width, ctx.start = block.shape[-1], blocks.coords[0] * block.shape[-1]
        return blocks.backend.all_gather(block.contiguous(), block.dim() - 1, blocks.axis)

    @staticmethod
    def backward(ctx, g):
        return None, g.narrow(-1, ctx.start, ctx.width).contiguous()


def _log_softmax(blocks: Blocks, xs) -> list[torch.Tensor]:
    """``log_softmax`` over the whole last dim, per block (fp32 inside, as PyTorch's kernels
    accumulate; a row of ``-inf`` gives NaN, as theirs)."""
    xf = [x.float() for x in xs]
    top = blocks.max([x.amax(-1, keepdim=True) for x in xf])
    top = [torch.where(torch.isfinite(t), t, torch.zeros_like(t)) for t in top]
    sums = blocks.sum([(x - t).exp().sum(-1, keepdim=True) for x, t in zip(xf, top)])
    return [(x - t - s.log()).to(xs[0].dtype) for x, t, s in zip(xf, top, sums)]


class _Normalized(torch.autograd.Function):
    """``log_softmax`` (``log=True``) or ``softmax`` from the blocks; the backward sums one
    value per row over the axis (the gradient's row sum, or its dot with the softmax)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, log: bool, *xs):
        outs = _log_softmax(blocks, xs)
        if not log:
            outs = [lp.float().exp().to(lp.dtype) for lp in outs]
        ctx.blocks, ctx.log = blocks, log
        ctx.save_for_backward(*outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        outs = ctx.saved_tensors
        gs = [torch.zeros_like(o) if g is None else g.float() for g, o in zip(gs, outs)]
        if ctx.log:     # d log_softmax: g - softmax * sum(g)
            rows = ctx.blocks.sum([g.sum(-1, keepdim=True) for g in gs])
            grads = [g - o.float().exp() * r for g, o, r in zip(gs, outs, rows)]
        else:           # d softmax: softmax * (g - sum(g * softmax))
            rows = ctx.blocks.sum([(g * o.float()).sum(-1, keepdim=True)
                                   for g, o in zip(gs, outs)])
            grads = [o.float() * (g - r) for g, o, r in zip(gs, outs, rows)]
        return (None, None, *[g.to(o.dtype) for g, o in zip(grads, outs)])


class _Pick(torch.autograd.Function):
    """``x.gather(-1, index)`` from the blocks: each picks the indices in its vocab range
    (zeros elsewhere), summed over the axis; the backward scatters into each block."""

    @staticmethod
    def forward(ctx, blocks: Blocks, index, starts, *xs):
        parts = []
        for x, lo in zip(xs, starts):
            local = index - lo
            inside = (local >= 0) & (local < x.shape[-1])
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1))
            parts.append(torch.where(inside, picked, torch.zeros_like(picked)))
        ctx.index, ctx.starts = index, starts
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return blocks.sum(parts)[0]

    @staticmethod
    def backward(ctx, g):
        grads = []
        for (shape, dtype, device), lo in zip(ctx.shapes, ctx.starts):
            local = ctx.index - lo
            inside = (local >= 0) & (local < shape[-1])
            out = torch.zeros(shape, dtype=dtype, device=device)
            out.scatter_add_(-1, local.clamp(0, shape[-1] - 1),
                             torch.where(inside, g, torch.zeros_like(g)).to(dtype))
            grads.append(out)
        return (None, None, None, *grads)


class _Sum(torch.autograd.Function):
    """The sum over the whole last dim (each rank's share, then summed over the axis)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, *xs):
        ctx.shapes = [x.shape for x in xs]
        return blocks.sum([x.sum(-1) for x in xs])[0]

    @staticmethod
    def backward(ctx, g):
        return (None, *[g.unsqueeze(-1).expand(s) for s in ctx.shapes])


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
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
          torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDER or (name.endswith("_") and not name.startswith("__"))


class VocabShardedTensor(torch.Tensor):
    """The whole output, held as its ``tp`` blocks of the last dim; see the module."""

    @staticmethod
    def __new__(cls, blocks: list[torch.Tensor], where: Blocks):
        b0 = blocks[0]
        width = sum(b.shape[-1] for b in blocks) if where.backend is None else \
            b0.shape[-1] * where.n
        shape = (*b0.shape[:-1], width)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=b0.dtype, device=b0.device,
                                                  requires_grad=False)
        out._blocks, out._where, out._full = list(blocks), where, None
        return out

    def __init__(self, blocks, where):
        pass

    # -- the whole tensor --------------------------------------------------------------------
    @property
    def blocks(self) -> list[torch.Tensor]:
        """The blocks held (a simulated mesh: one per ``tp`` coordinate, in order)."""
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
        handler = _HANDLERS.get(func)
        if handler is not None:
            got = handler(*args, **kwargs)
            if got is not NotImplemented:
                return got
        args, kwargs = pytree.tree_map_only(VocabShardedTensor, lambda t: t.full(),
                                            (args, kwargs))
        return func(*args, **kwargs)


# -- handlers: what runs on the blocks (NotImplemented: the whole tensor instead) -------------

def _same_last(me: VocabShardedTensor, shape) -> bool:
    return len(shape) >= 1 and shape[-1] == me.shape[-1] and \
        math.prod(shape[:-1]) == math.prod(me.shape[:-1])


def _reshaped(me, new_shape):
    """Blocks reshaped to ``new_shape`` (the whole tensor's), its last dim the vocab's."""
    if not _same_last(me, new_shape):
        return NotImplemented
    lead = tuple(new_shape[:-1])
    return me._each(lambda b: b.reshape(*lead, b.shape[-1]))


def _shape_of(me, fn):
    """The whole tensor's shape after ``fn`` (run on a meta tensor of its shape)."""
    try:
        return tuple(fn(torch.empty(me.shape, dtype=me.dtype, device="meta")).shape)
    except Exception:   # noqa: BLE001 (the whole tensor's op will raise it)
        return None


def _h_view(me, *shape, **kw):
    if not isinstance(me, VocabShardedTensor) or kw:
        return NotImplemented
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if any(isinstance(s, torch.dtype) for s in shape):
        return NotImplemented           # view(dtype)
    new = _shape_of(me, lambda t: t.reshape(*shape))
    return NotImplemented if new is None else _reshaped(me, new)


def _h_flatten(me, start_dim=0, end_dim=-1):
    if not isinstance(me, VocabShardedTensor):
        return NotImplemented
    new = _shape_of(me, lambda t: t.flatten(start_dim, end_dim))
    return NotImplemented if new is None else _reshaped(me, new)


def _h_unflatten(me, dim, sizes):
    if not isinstance(me, VocabShardedTensor):
        return NotImplemented
    new = _shape_of(me, lambda t: t.unflatten(dim, sizes))
    return NotImplemented if new is None else _reshaped(me, new)


def _leading_key(me, key) -> bool:
    """``key`` indexes only the leading dims (the last one untouched): ints, slices and
    integer tensors, with ``None`` and one ``...``."""
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        return False
    for k in key:
        if k is None or k is Ellipsis:
            continue
        if isinstance(k, torch.Tensor) and k.dtype == torch.bool or \
                not isinstance(k, (int, slice, torch.Tensor)):
            return False
    dims = [k for k in key if k is not None]
    at = [i for i, k in enumerate(dims) if k is Ellipsis]
    if at:
        after = dims[at[0] + 1:]
    elif len(dims) < me.dim():
        return True
    else:
        after = dims
    last = after[-1] if after else None
    return last is None or (isinstance(last, slice) and last == slice(None))


def _h_getitem(me, key):
    if not isinstance(me, VocabShardedTensor) or not _leading_key(me, key):
        return NotImplemented
    new = _shape_of(me, lambda t: t[key])
    if new is None or not new or new[-1] != me.shape[-1]:
        return NotImplemented
    return me._each(lambda b: b[key])


def _h_split(me, size, dim=0):
    if not isinstance(me, VocabShardedTensor) or dim % me.dim() == me.dim() - 1:
        return NotImplemented
    parts = [b.split(size, dim) for b in me._blocks]
    return tuple(me._like(list(ps)) for ps in zip(*parts))


def _h_chunk(me, chunks, dim=0):
    if not isinstance(me, VocabShardedTensor) or dim % me.dim() == me.dim() - 1:
        return NotImplemented
    parts = [b.chunk(chunks, dim) for b in me._blocks]
    return tuple(me._like(list(ps)) for ps in zip(*parts))


def _h_cast(dtype):
    def handler(me, *a, **kw):
        if not isinstance(me, VocabShardedTensor) or a or kw:
            return NotImplemented
        return me._each(lambda b: b.to(dtype))
    return handler


def _h_to(me, *a, **kw):
    if not isinstance(me, VocabShardedTensor):
        return NotImplemented
    dtype = kw.pop("dtype", None)
    if len(a) == 1 and isinstance(a[0], torch.dtype) and dtype is None:
        dtype = a[0]
    elif a:
        return NotImplemented
    if dtype is None or set(kw) - {"copy", "non_blocking"}:
        return NotImplemented
    return me._each(lambda b: b.to(dtype))


def _h_unary(fn):
    def handler(me, *a, **kw):
        if not isinstance(me, VocabShardedTensor) or a or kw:
            return NotImplemented
        return me._each(fn)
    return handler


def _h_scalar(op, swap=False):
    def handler(a, b, *rest, **kw):
        me, other = (b, a) if swap else (a, b)
        if rest or kw or not isinstance(me, VocabShardedTensor) or \
                isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented
        return me._each(lambda x: op(other, x) if swap else op(x, other))
    return handler


def _last(me, dim) -> bool:
    return dim is not None and dim % me.dim() == me.dim() - 1


def _h_log_softmax(me, dim=None, _stacklevel=3, dtype=None):
    if not isinstance(me, VocabShardedTensor) or not _last(me, dim):
        return NotImplemented
    x = me if dtype is None else me._each(lambda b: b.to(dtype))
    return me._like(list(_Normalized.apply(me._where, True, *x._blocks)))


def _h_softmax(me, dim=None, _stacklevel=3, dtype=None):
    if not isinstance(me, VocabShardedTensor) or not _last(me, dim):
        return NotImplemented
    x = me if dtype is None else me._each(lambda b: b.to(dtype))
    return me._like(list(_Normalized.apply(me._where, False, *x._blocks)))


def _pick(me, index):
    widths = [b.shape[-1] for b in me._blocks]
    return _Pick.apply(me._where, index, me._where.starts(widths), *me._blocks)


def _h_gather(me, dim, index, *, sparse_grad=False, out=None):
    if not isinstance(me, VocabShardedTensor) or not _last(me, dim) or sparse_grad or \
            isinstance(index, VocabShardedTensor) or index.shape[:-1] != me.shape[:-1]:
        return NotImplemented
    return _pick(me, index)


def _reduce(rows, valid, reduction):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        return rows.sum() / valid.sum().to(rows.dtype)
    raise ValueError(f"{_WHERE}: reduction={reduction!r}; use 'mean', 'sum' or 'none'")


def _nll_rows(logp, target, ignore_index):
    """``-logp[target]`` per row (0 where ``target == ignore_index``) and the valid mask."""
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = _pick(logp, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, torch.zeros_like(picked)), valid


def _class_last(me, target) -> bool:
    """The layout cross_entropy/nll_loss take on the blocks: ``[N, C]`` (or ``[C]``) with
    class indices ``[N]``."""
    return isinstance(me, VocabShardedTensor) and me.dim() in (1, 2) and \
        isinstance(target, torch.Tensor) and not target.is_floating_point() and \
        not isinstance(target, VocabShardedTensor) and \
        tuple(target.shape) == tuple(me.shape[:-1])


def _h_nll_loss(input, target, weight=None, size_average=None, ignore_index=-100,
                reduce=None, reduction="mean"):
    if weight is not None or size_average is not None or reduce is not None or \
            not _class_last(input, target):
        return NotImplemented
    rows, valid = _nll_rows(input, target, ignore_index)
    return _reduce(rows, valid, reduction)


def _h_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                     reduce=None, reduction="mean", label_smoothing=0.0):
    if weight is not None or size_average is not None or reduce is not None or \
            not _class_last(input, target):
        return NotImplemented
    logp = _h_log_softmax(input, -1)
    rows, valid = _nll_rows(logp, target, ignore_index)
    if label_smoothing:
        smooth = -_Sum.apply(logp._where, *logp._blocks) / input.shape[-1]
        smooth = torch.where(valid, smooth, torch.zeros_like(smooth))
        rows = (1 - label_smoothing) * rows + label_smoothing * smooth
    return _reduce(rows, valid, reduction)


_HANDLERS = {
    torch.Tensor.view: _h_view, torch.Tensor.reshape: _h_view, torch.reshape: _h_view,
    torch.Tensor.flatten: _h_flatten, torch.flatten: _h_flatten,
    torch.Tensor.unflatten: _h_unflatten, torch.unflatten: _h_unflatten,
    torch.Tensor.__getitem__: _h_getitem,
    torch.Tensor.split: _h_split, torch.split: _h_split,
    torch.Tensor.chunk: _h_chunk, torch.chunk: _h_chunk,
    torch.Tensor.to: _h_to,
    torch.Tensor.contiguous: _h_unary(lambda b: b.contiguous()),
    torch.Tensor.clone: _h_unary(lambda b: b.clone()),
    torch.Tensor.__mul__: _h_scalar(operator.mul), torch.Tensor.mul: _h_scalar(operator.mul),
    torch.mul: _h_scalar(operator.mul), torch.Tensor.__rmul__: _h_scalar(operator.mul),
    torch.Tensor.__truediv__: _h_scalar(operator.truediv),
    torch.Tensor.div: _h_scalar(operator.truediv), torch.div: _h_scalar(operator.truediv),
    F.log_softmax: _h_log_softmax, torch.log_softmax: _h_log_softmax,
    torch.Tensor.log_softmax: _h_log_softmax,
    F.softmax: _h_softmax, torch.softmax: _h_softmax, torch.Tensor.softmax: _h_softmax,
    torch.gather: _h_gather, torch.Tensor.gather: _h_gather,
    F.nll_loss: _h_nll_loss, F.cross_entropy: _h_cross_entropy,
    **{cast: _h_cast(dtype) for cast, dtype in _CASTS.items()},
}
