"""What runs on a :class:`~fxshard.training.vocab_output.VocabShardedTensor`'s blocks: the
handlers its ``__torch_function__`` looks up in ``HANDLERS`` (views and reshapes that keep the
last dim, indexing, ``split``/``chunk``, casts, ``contiguous``/``clone``, products and quotients
with a number, ``softmax``/``log_softmax`` over the last dim, ``gather``, ``nll_loss`` and
``cross_entropy``). A handler returns ``NotImplemented`` where the op needs the whole tensor,
which the tensor then gathers; the math on the blocks is :mod:`fxshard.training.vocab_blocks`'.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from .vocab_blocks import CrossEntropyRows, Normalized, Pick, Sum
from .vocab_output import HANDLERS, VocabShardedTensor

_WHERE = "fxshard.training.vocab_output"   # what users call the tensor's module
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
          torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}


# -- handlers: what runs on the blocks (NotImplemented: the whole tensor instead) -------------

def _same_last(me: VocabShardedTensor, shape) -> bool:
    return len(shape) >= 1 and shape[-1] == me.shape[-1] and \
        math.prod(shape[:-1]) == math.prod(me.shape[:-1])


def _reshaped(me, new_shape):
    """Blocks reshaped to ``new_shape`` (the whole tensor's), its last dim the vocab's. Row
    groups hold consecutive runs of the leading elements, so a shape whose dim 0 the row
    groups divide keeps each its own rows."""
    if not _same_last(me, new_shape):
        return NotImplemented
    rows = me._where.rows
    if rows > 1 and (len(new_shape) < 2 or new_shape[0] % rows):
        return NotImplemented
    lead = tuple(new_shape[:-1])
    if rows > 1:
        lead = (lead[0] // rows, *lead[1:])
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
    if me._where.rows > 1 and not _keeps_dim0(me, key):
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


def _keeps_dim0(me, key: tuple) -> bool:
    """``key`` leaves dim 0 (split over the batch axes) whole and in place: its first entry
    is ``:`` or an ``...`` that covers it, and every other entry an int or a slice."""
    if not key or any(isinstance(k, torch.Tensor) for k in key):
        return not key
    first = key[0]
    if first == slice(None):
        return True
    if first is Ellipsis:
        return me.dim() - sum(k is not None for k in key[1:]) >= 1
    return False


def _h_getitem(me, key):
    if not isinstance(me, VocabShardedTensor) or not _leading_key(me, key):
        return NotImplemented
    new = _shape_of(me, lambda t: t[key])
    if new is None or not new or new[-1] != me.shape[-1]:
        return NotImplemented
    return me._each(lambda b: b[key])


def _h_split(me, size, dim=0):
    if not isinstance(me, VocabShardedTensor) or dim % me.dim() == me.dim() - 1 or \
            dim % me.dim() == 0 and me._where.rows > 1:
        return NotImplemented
    parts = [b.split(size, dim) for b in me._blocks]
    return tuple(me._like(list(ps)) for ps in zip(*parts))


def _h_chunk(me, chunks, dim=0):
    if not isinstance(me, VocabShardedTensor) or dim % me.dim() == me.dim() - 1 or \
            dim % me.dim() == 0 and me._where.rows > 1:
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
    return me._like(list(Normalized.apply(me._where, True, *x._blocks)))


def _h_softmax(me, dim=None, _stacklevel=3, dtype=None):
    if not isinstance(me, VocabShardedTensor) or not _last(me, dim):
        return NotImplemented
    x = me if dtype is None else me._each(lambda b: b.to(dtype))
    return me._like(list(Normalized.apply(me._where, False, *x._blocks)))


def _pick(me, index) -> list[torch.Tensor]:
    """``me.gather(-1, index)`` (``index`` of the whole tensor's leading shape): one result
    per held row group, its rows."""
    where = me._where
    widths = [b.shape[-1] for b in me._blocks]
    indices = [where.row_slice(index, i // where.per_row) for i in range(len(me._blocks))]
    return list(Pick.apply(where, indices, where.starts(widths), *me._blocks))


def _h_gather(me, dim, index, *, sparse_grad=False, out=None):
    if not isinstance(me, VocabShardedTensor) or not _last(me, dim) or sparse_grad or \
            isinstance(index, VocabShardedTensor) or index.shape[:-1] != me.shape[:-1]:
        return NotImplemented
    return me._where.row_cat(_pick(me, index))


def _class_weights(me, weight):
    """Each block's slice of a class ``weight`` (``[V]``) over its vocab range."""
    widths = [b.shape[-1] for b in me._blocks]
    starts = me._where.starts(widths)
    end = max(lo + w for lo, w in zip(starts, widths))
    if end > weight.shape[0]:    # a padded vocab: no weight past it (its columns unread)
        weight = torch.nn.functional.pad(weight, (0, end - weight.shape[0]))
    return [weight.narrow(0, lo, w) for lo, w in zip(starts, widths)]


def _nll_loss(logp, target, weight, ignore_index, reduction, label_smoothing=0.0,
              logits=None):
    """PyTorch's ``nll_loss`` (and cross-entropy's smoothing term) on the blocks of
    ``logp``: per row group ``-w[t] * logp[t]`` (0 where ``t == ignore_index``), summed over
    the batch axes; the mean divides by the whole batch's weight of its valid targets (a
    count without ``weight``), read from the whole ``target`` every rank has. ``logits``
    (a cross-entropy without smoothing; ``logp`` None): ``-logp[t]`` is computed from them
    in one piece (``CrossEntropyRows``), the log-probabilities never made."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{_WHERE}: reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    if logits is not None:
        where = logits._where
        widths = [b.shape[-1] for b in logits._blocks]
        indices = [where.row_slice(safe.unsqueeze(-1), i // where.per_row)
                   for i in range(len(logits._blocks))]
        picked = [-r.unsqueeze(-1) for r in CrossEntropyRows.apply(
            where, indices, where.starts(widths), *logits._blocks)]
        logp = logits     # (its dtype and shape below)
    else:
        where = logp._where
        picked = _pick(logp, safe.unsqueeze(-1))
    rows, smooth = [], None
    if label_smoothing:
        parts = logp._blocks if weight is None else \
            [b * w.to(b.dtype) for b, w in zip(logp._blocks, _class_weights(logp, weight))]
        smooth = Sum.apply(where, *parts)
    scale = None if weight is None else weight.to(logp.dtype)[safe]
    for g, p in enumerate(picked):
        keep = where.row_slice(valid, g)
        nll = -p.squeeze(-1)
        if scale is not None:
            nll = nll * where.row_slice(scale, g)
        row = torch.where(keep, nll, torch.zeros_like(nll))
        if smooth is not None:
            sm = torch.where(keep, -smooth[g], torch.zeros_like(smooth[g])) / logp.shape[-1]
            row = (1 - label_smoothing) * row + label_smoothing * sm
        rows.append(row)
    if reduction == "none":
        return where.row_cat(rows)
    total = where.row_sum([r.sum() for r in rows])
    if reduction == "sum":
        return total
    denom = valid.sum() if scale is None else \
        torch.where(valid, scale, torch.zeros_like(scale)).sum()
    return total / denom.to(total.dtype)


def _class_last(me, target) -> bool:
    """The layout cross_entropy/nll_loss take on the blocks: ``[N, C]`` (or ``[C]``) with
    class indices ``[N]``."""
    return isinstance(me, VocabShardedTensor) and me.dim() in (1, 2) and \
        isinstance(target, torch.Tensor) and not target.is_floating_point() and \
        not isinstance(target, VocabShardedTensor) and \
        tuple(target.shape) == tuple(me.shape[:-1])


def _plain_weight(me, weight) -> bool:
    return weight is None or isinstance(weight, torch.Tensor) and \
        not isinstance(weight, VocabShardedTensor) and tuple(weight.shape) == (me.shape[-1],)


def _h_nll_loss(input, target, weight=None, size_average=None, ignore_index=-100,
                reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None or not _class_last(input, target) or \
            not _plain_weight(input, weight):
        return NotImplemented
    return _nll_loss(input, target, weight, ignore_index, reduction)


def _h_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                     reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None or not _class_last(input, target) or \
            not _plain_weight(input, weight):
        return NotImplemented
    if not label_smoothing:
        return _nll_loss(None, target, weight, ignore_index, reduction, logits=input)
    return _nll_loss(_h_log_softmax(input, -1), target, weight, ignore_index, reduction,
                     label_smoothing)


HANDLERS.update({
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
})
