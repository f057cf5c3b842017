"""How a pipeline's per-microbatch losses add up to the whole batch's loss.

On ``pp`` the last stage computes the loss of each microbatch as its output arrives (1F1B runs
microbatch 0's backward before microbatch 1's forward), so the step's loss is a weighted sum
``sum_i w_i * loss_fn(out_i, t_i)``. Which weights equal one device's loss on the whole batch
depends on the loss:

    a mean whose microbatches count alike          w_i = 1 / m
    a sum (reduction="sum", or a sum / a constant)  w_i = 1
    a mean over the targets it counts               w_i = c_i / sum(c)   (c_i: targets != -100)
    (HF's labels= loss shifts: c_i counts labels[:, 1:])

Dividing by ``m`` always (as before) was off by 0.024 on a scale of 4.9 when the microbatches
held different numbers of ignored tokens, and by a factor ``m`` for a sum. ``microbatch_weights``
finds the weights before the step runs: it evaluates the loss on random outputs of the step's
shapes (one per microbatch, and their concatenation as the whole batch) with the step's
targets, and keeps the candidate whose weighted sum equals the whole batch's loss. A loss that
none fits (one coupling rows of different microbatches) is a ``ValueError``, never a silently
different gradient. The probe draws from its own generator (the step's random numbers, e.g.
dropout's, are untouched) and costs two evaluations of the loss on the batch's outputs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["microbatch_weights", "pipeline_loss_weights"]

IGNORE_INDEX = -100   # torch's cross_entropy / nll_loss default and HF's


def _counts(targets: list, shift: bool) -> list[float] | None:
    """Each microbatch's targets that a mean over tokens counts (``!= -100``)."""
    if not all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in targets):
        return None
    return [float(((t[:, 1:] if shift and t.dim() > 1 else t) != IGNORE_INDEX).sum())
            for t in targets]


def _candidates(targets: list, m: int, shifted: bool) -> dict[str, list[float]]:
    out = {"the microbatches' mean": [1.0 / m] * m, "their sum": [1.0] * m}
    for shift in ((True, False) if shifted else (False,)):
        counts = _counts(targets, shift)
        if counts is not None and sum(counts) > 0:
            name = "their mean weighted by counted targets" + (" (shifted)" if shift else "")
            out[name] = [c / sum(counts) for c in counts]
    return out


def microbatch_weights(loss_of: Callable, probe_out: Callable[[torch.Generator], object],
                       targets: list, whole_target, *, where: str,
                       shifted: bool = False, device=None) -> list[float]:
    """Weights ``w_i`` with ``sum_i w_i * loss_of(out_i, targets[i])`` equal to
    ``loss_of(whole_out, whole_target)`` for this batch (see the module). ``probe_out(g)``
    makes one microbatch's output (a pytree) with random floating leaves drawn from ``g`` (a
    generator on ``device``); ``shifted``: a causal LM's own loss, which may count
    ``labels[:, 1:]``."""
    m = len(targets)
    if m == 1:
        return [1.0]
    g = torch.Generator(device=device or "cpu").manual_seed(0)
    outs = [probe_out(g) for _ in range(m)]
    whole = pytree.tree_map(lambda *xs: torch.cat(xs, 0) if isinstance(xs[0], torch.Tensor)
                            and xs[0].dim() > 0 else xs[0], outs[0], *outs[1:])
    with torch.no_grad():
        want = float(loss_of(whole, whole_target))
        parts = [float(loss_of(o, t)) for o, t in zip(outs, targets)]
    tried = {}
    for name, w in _candidates(targets, m, shifted).items():
        got = sum(wi * p for wi, p in zip(w, parts))
        tried[name] = got
        if abs(got - want) <= 1e-5 * max(1.0, abs(want)):
            return w
    listed = ", ".join(f"{k} {v:.6g}" for k, v in tried.items())
    raise ValueError(
        f"{where}: the loss is not a sum or a mean of its {m} microbatches' losses for this "
        f"batch: on random outputs of the step's shapes the whole batch's loss is {want:.6g}, "
        f"and none of {listed} equals it. A pipeline computes each microbatch's loss as its "
        f"output arrives, so this loss cannot equal one device's. Write it as a per-row sum "
        f"or mean (e.g. F.cross_entropy(..., reduction='sum') / n with n counted over the whole "
        f"batch), or train without microbatches (microbatches=1)")


def pipeline_loss_weights(trainer, run, target, labels, *, where: str) -> list[float]:
    """Each microbatch's weight in the whole batch's loss for a pipeline step ``run`` of
    ``trainer`` (a ``PipelineTrainer``): ``run.loss_fn`` on ``target``, or HF's ``labels=``
    through the model's own ``loss_function``."""
    from .run import _MODEL_LOSS
    where = (f"{where}.train_step (mesh {trainer.spec.describe()}, "
             f"microbatches={trainer.microbatches})")
    if run.loss_fn is _MODEL_LOSS:
        model_loss = getattr(trainer.model, "loss_function", None)
        if not callable(model_loss):
            raise ValueError(
                f"{where}: labels= without loss_fn= needs the model's own loss function "
                f"(HF's model.loss_function) to weigh the microbatches' losses; pass loss_fn= "
                f"and target= instead")

        def loss_of(out, t):
            return model_loss(logits=out["logits"], labels=t, vocab_size=out["logits"].shape[-1])
        whole = labels
        parts = [t[0][0] for t in trainer._split_inputs((labels,), {})]
    else:
        def loss_of(out, t):
            return run.loss_fn(out, t) if t is not None else run.loss_fn(out)
        whole, parts = target, run.targets or [None] * trainer.microbatches
    device = whole.device if isinstance(whole, torch.Tensor) else torch.device("cpu")
    return microbatch_weights(loss_of, lambda g: run.probe_output(g, device), parts, whole,
                              where=where, shifted=run.loss_fn is _MODEL_LOSS, device=device)
