"""Local ops of the vocab-parallel loss (they read the rank's coordinate, move no data).

The rank holds classes ``[start, start + C)`` of log-probabilities ``[N, C]`` (its vocab shard:
``start`` from its coordinates on the sharding ``axes``, nested in mesh order). A target it
holds is picked here; the others add zero, so the ranks' results are partial sums that the
following all-reduce adds (Megatron's vocab-parallel cross-entropy)::

    before: nll_loss_forward(logp, target, None, 2, -100)        # logp S(1) [N, V]
    after:  vocab_nll_loss_forward(logp, target, 2, -100, ['tp'], [2])   # -> (P, total R)

``total_weight`` counts every non-ignored target (all ranks agree: the targets are
replicated over the vocab axes). ``vocab_nll_loss_backward`` writes ``-grad`` (``/ total``
for ``reduction=mean``) at the rank's own targets and zero elsewhere: its shard of
``nll_loss_backward``.

``vocab_cross_entropy_backward`` is both backward ops in one, when the log-softmax feeds only
the NLL: the NLL's gradient has one entry per row (``-w``, ``w`` the row's weight: ``grad``,
``/ total`` for a mean, 0 if ignored), so the log-softmax's ``sum(g)`` is ``-w`` on every rank
and needs no all-reduce, and the gradient of the logits is ``softmax * w`` minus ``w`` at the
rank's own target (Megatron's)::

    before: g = vocab_nll_loss_backward(grad, logp, target, ..)     # zeros + scatter  [N, C]
            s = all_reduce(sum(g, [1], True)); dx = g - exp(logp) * s  # 4 more over [N, C]
    after:  dx = vocab_cross_entropy_backward(grad, e, lse, target, ..)
            # e * (w / exp(lse)), scatter_add -w at the own targets: one pass over [N, C]

``e = exp(logits - max)`` and ``lse = log(sum(e))`` (all-reduced) are the forward's, saved
instead of ``logp``.

bf16 / fp16 logits (HF's ``logits.float()`` before its loss, or a cross-entropy of them): the
loss upcasts per block, as Megatron's does, and never makes a float32 copy of the rank's
``[N, C]`` logits. ``vocab_sum_exp`` reads the low-precision block and sums ``exp(x - max)`` in
float32 a slice of rows at a time; ``vocab_nll_loss_forward`` given ``lse`` (``max +
log(sum)``, float32 ``[N, 1]``) picks the target's logit and returns ``lse - x[t]``;
``vocab_cross_entropy_grad`` recomputes ``softmax = exp(x - lse)`` in float32 per slice and
writes the gradient in the logits' dtype (the cast the one-device backward does last)::

    before: x32 = _to_copy(x, float32); e = exp(x32 - m); s = sum(e)    # [N, C] float32 x3
            dx32 = vocab_cross_entropy_backward(g, e, log(s), ..); dx = _to_copy(dx32, bf16)
    after:  s = vocab_sum_exp(x, m); lse = log(s) + m                    # float32 [N, 1]
            dx = vocab_cross_entropy_grad(g, x, lse, ..)                 # bf16 [N, C]

The slices hold ``_SLICE_ELEMENTS`` float32 values at most (a temporary, never saved): the
saved state for the backward is the bf16 logits and ``lse``.
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op
from fxshard.runtime.context import current_backend

__all__ = ["check_targets", "vocab_nll_loss_forward", "vocab_nll_loss_backward",
           "vocab_cross_entropy_backward", "vocab_sum_exp", "vocab_cross_entropy_grad"]

_SLICE_ELEMENTS = 1 << 22    # float32 values per row slice of an upcast block (16 MiB)


def _product(sizes) -> int:
    out = 1
    for n in sizes:
        out *= n
    return out


def _start(axes, sizes, classes: int) -> int:
    backend, flat = current_backend(), 0
    for axis, n in zip(axes, sizes):
        flat = flat * n + backend.axis_index(axis)
    return flat * classes


def check_targets(target, ignore_index: int | None, classes: int, where: str) -> None:
    """Raise one device's ``IndexError`` for a target outside ``[0, classes)`` that is not
    ``ignore_index`` (None: none is ignored): a vocab-parallel pick finds no rank holding it
    and would add 0 silently. One reduction and one host read per call."""
    bad = (target < 0) | (target >= classes)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bool(bad.any()):
        value = int(target[bad].flatten()[0])
        raise IndexError(
            f"{where}: target {value} is out of bounds for {classes} classes (one device "
            f"raises 'Target {value} is out of bounds.' too). Fix the labels: every target "
            f"in [0, {classes})" + ("" if ignore_index is None else
                                    f" or equal to ignore_index={ignore_index}") + ".")


def _local_targets(target, ignore_index: int, start: int, classes: int):
    local = target - start
    mine = (local >= 0) & (local < classes) & (target != ignore_index)
    return local.clamp(0, classes - 1), mine


@define_op("fxshard::vocab_nll_loss_forward",
           "(Tensor logp, Tensor target, int reduction, int ignore_index, str[] axes, "
           "int[] sizes, int valid=-1, Tensor? lse=None, ScalarType? dtype=None) "
           "-> (Tensor, Tensor)")
def vocab_nll_loss_forward(logp, target, reduction: int, ignore_index: int, axes, sizes,
                           valid: int = -1, lse=None, dtype=None):
    """``valid``: the classes of a vocab padded for tp (``passes/pad_vocab``; -1: every
    class of the ``sizes`` shards). ``lse`` (float32 ``[N, 1]``): ``logp`` holds the
    logits (bf16 / fp16) and the log-probability of a target is ``x[t] - lse``, computed in
    float32; the results are ``dtype``'s (None: ``logp``'s)."""
    if lse is not None:
        return _nll_of_logits(logp, target, reduction, ignore_index, axes, sizes, valid, lse,
                              dtype or logp.dtype)
    classes = logp.shape[1]
    whole = valid if valid >= 0 else classes * _product(sizes)
    split = ", ".join(f"{a}={n}" for a, n in zip(axes, sizes))
    check_targets(target, ignore_index, whole,
                  f"fxshard::vocab_nll_loss_forward (the vocab split over {split})")
    local, mine = _local_targets(target, ignore_index, _start(axes, sizes, classes), classes)
    picked = logp.gather(1, local.unsqueeze(1)).squeeze(1)
    losses = torch.where(mine, -picked, torch.zeros_like(picked))
    valid = (target != ignore_index).to(logp.dtype)
    if reduction == 0:
        return losses, logp.new_zeros(())
    total = valid.sum()
    out = losses.sum()
    return (out / total if reduction == 1 else out), total


def _nll_of_logits(x, target, reduction, ignore_index, axes, sizes, valid, lse, dtype):
    classes = x.shape[1]
    whole = valid if valid >= 0 else classes * _product(sizes)
    split = ", ".join(f"{a}={n}" for a, n in zip(axes, sizes))
    check_targets(target, ignore_index, whole,
                  f"fxshard::vocab_nll_loss_forward (the vocab split over {split})")
    local, mine = _local_targets(target, ignore_index, _start(axes, sizes, classes), classes)
    picked = x.gather(1, local.unsqueeze(1)).squeeze(1).float()
    # every rank adds its own targets' x[t] - lse (the others 0): the sum over tp is one
    # lse - x[t] per row
    losses = torch.where(mine, lse.squeeze(1) - picked, torch.zeros_like(picked))
    if reduction == 0:
        return losses.to(dtype), x.new_zeros((), dtype=dtype)
    total = (target != ignore_index).to(torch.float32).sum()
    out = losses.sum()
    return (out / total if reduction == 1 else out).to(dtype), total.to(dtype)


@vocab_nll_loss_forward.register_fake
def _(logp, target, reduction, ignore_index, axes, sizes, valid=-1, lse=None, dtype=None):
    shape = (logp.shape[0],) if reduction == 0 else ()
    dtype = dtype or logp.dtype
    return logp.new_empty(shape, dtype=dtype), logp.new_empty((), dtype=dtype)


@define_op("fxshard::vocab_nll_loss_backward",
           "(Tensor grad, Tensor logp, Tensor target, int reduction, int ignore_index, "
           "Tensor total_weight, str[] axes, int[] sizes) -> Tensor")
def vocab_nll_loss_backward(grad, logp, target, reduction: int, ignore_index: int,
                            total_weight, axes, sizes):
    classes = logp.shape[1]
    local, mine = _local_targets(target, ignore_index, _start(axes, sizes, classes), classes)
    g = grad if reduction == 0 else grad.expand(target.shape)
    if reduction == 1:
        g = g / total_weight
    value = torch.where(mine, -g, torch.zeros_like(g)).to(logp.dtype)
    out = torch.zeros_like(logp)
    return out.scatter_(1, local.unsqueeze(1), value.unsqueeze(1))


@vocab_nll_loss_backward.register_fake
def _(grad, logp, target, reduction, ignore_index, total_weight, axes, sizes):
    return torch.empty_like(logp)


def _row_weight(grad, target, reduction: int, ignore_index: int, total_weight):
    g = grad if reduction == 0 else grad.expand(target.shape)
    if reduction == 1:
        g = g / total_weight
    return torch.where(target != ignore_index, g, torch.zeros_like(g))


@define_op("fxshard::vocab_cross_entropy_backward",
           "(Tensor grad, Tensor e, Tensor lse, Tensor target, int reduction, int ignore_index, "
           "Tensor total_weight, str[] axes, int[] sizes) -> Tensor")
def vocab_cross_entropy_backward(grad, e, lse, target, reduction: int, ignore_index: int,
                                 total_weight, axes, sizes):
    classes = e.shape[1]
    local, mine = _local_targets(target, ignore_index, _start(axes, sizes, classes), classes)
    w = _row_weight(grad, target, reduction, ignore_index, total_weight).to(e.dtype)
    out = e * (w.unsqueeze(1) / lse.exp())
    at_target = torch.where(mine, -w, torch.zeros_like(w))
    return out.scatter_add_(1, local.unsqueeze(1), at_target.unsqueeze(1))


@vocab_cross_entropy_backward.register_fake
def _(grad, e, lse, target, reduction, ignore_index, total_weight, axes, sizes):
    return torch.empty_like(e)


def _row_slices(x):
    """Row ranges of ``x`` ``[N, C]`` whose float32 copy holds ``_SLICE_ELEMENTS`` at most."""
    step = max(1, _SLICE_ELEMENTS // max(1, x.shape[1]))
    return [(i, min(i + step, x.shape[0])) for i in range(0, x.shape[0], step)]


@define_op("fxshard::vocab_sum_exp", "(Tensor x, Tensor m) -> Tensor")
def vocab_sum_exp(x, m):
    """``sum(exp(x - m), 1, keepdim=True)`` in float32 for bf16 / fp16 ``x`` ``[N, C]`` and
    the rows' maxima ``m`` ``[N, 1]``, a slice of rows at a time (no float32 ``[N, C]``)."""
    out = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    for lo, hi in _row_slices(x):
        z = torch.sub(x[lo:hi], m[lo:hi].float()).exp_()     # float32 (promoted)
        torch.sum(z, 1, keepdim=True, out=out[lo:hi])
    return out


@vocab_sum_exp.register_fake
def _(x, m):
    return x.new_empty((x.shape[0], 1), dtype=torch.float32)


@define_op("fxshard::vocab_cross_entropy_grad",
           "(Tensor grad, Tensor x, Tensor lse, Tensor target, int reduction, int ignore_index, "
           "Tensor total_weight, str[] axes, int[] sizes) -> Tensor")
def vocab_cross_entropy_grad(grad, x, lse, target, reduction: int, ignore_index: int,
                             total_weight, axes, sizes):
    """``vocab_cross_entropy_backward`` from the bf16 / fp16 logits ``x`` and the float32
    ``lse = max + log(sum(exp))``: ``softmax * w`` minus ``w`` at the rank's own targets,
    in float32 a slice of rows at a time, written in ``x``'s dtype."""
    classes = x.shape[1]
    local, mine = _local_targets(target, ignore_index, _start(axes, sizes, classes), classes)
    w = _row_weight(grad, target, reduction, ignore_index, total_weight).float()
    at_target = torch.where(mine, -w, torch.zeros_like(w))
    out = torch.empty_like(x)
    for lo, hi in _row_slices(x):
        d = torch.sub(x[lo:hi], lse[lo:hi]).exp_().mul_(w[lo:hi].unsqueeze(1))   # float32
        d.scatter_add_(1, local[lo:hi].unsqueeze(1), at_target[lo:hi].unsqueeze(1))
        out[lo:hi].copy_(d)
    return out


@vocab_cross_entropy_grad.register_fake
def _(grad, x, lse, target, reduction, ignore_index, total_weight, axes, sizes):
    return torch.empty_like(x)
