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
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op
from fxshard.runtime.context import current_backend

__all__ = ["check_targets", "vocab_nll_loss_forward", "vocab_nll_loss_backward", "vocab_cross_entropy_backward"]


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
           "int[] sizes, int valid=-1) -> (Tensor, Tensor)")
def vocab_nll_loss_forward(logp, target, reduction: int, ignore_index: int, axes, sizes,
                           valid: int = -1):
    """``valid``: the classes of a vocab padded for tp (``passes/pad_vocab``; -1: every
    class of the ``sizes`` shards)."""
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


@vocab_nll_loss_forward.register_fake
def _(logp, target, reduction, ignore_index, axes, sizes, valid=-1):
    shape = (logp.shape[0],) if reduction == 0 else ()
    return logp.new_empty(shape), logp.new_empty(())


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
