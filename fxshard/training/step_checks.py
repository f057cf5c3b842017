"""The checks a training step makes before it runs, each standing in for what one device
would do or what every rank must agree on: the ranks freeze the same parameters
(:func:`agree_frozen`), and a loss depends on some trainable parameter
(:func:`check_loss_differentiable`, torch's "does not require grad")."""
from __future__ import annotations

import torch

from .program import TrainProgram

__all__ = ["frozen_names", "agree_frozen", "check_loss_differentiable"]

_WHERE = "fxshard.training"


def frozen_names(model: torch.nn.Module) -> frozenset:
    """The names of ``model``'s parameters that do not require grad: frozen, they get no
    gradient and an optimizer leaves them, as on one device."""
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad)


def agree_frozen(mesh, seen: set, frozen: frozenset) -> None:
    """Under torchrun every rank must freeze the same parameters (``requires_grad_(False)``):
    a parameter frozen on one rank only would train on the others, half of its shards
    stepped. Exchanged once per new frozen set (:func:`fxshard.runtime.agreement.agree`); a
    ValueError on every rank naming each rank's set."""
    from ..runtime.agreement import agree
    agree(mesh, seen, f"{_WHERE} (pm(x) / train_step with grad enabled)",
          {"frozen_parameters": sorted(frozen)},
          fix="Every rank must freeze the same parameters (requires_grad_(False) on every "
              "rank, before the same step), or a parameter trains on some ranks only; "
              "freeze outside any `if rank == ...:`")


def check_loss_differentiable(program: TrainProgram, loss_fn) -> None:
    """The RuntimeError ``loss.backward()`` raises on one device for a loss that depends on
    no trainable parameter (a ``.detach()`` inside ``loss_fn``): the traced program's loss
    has no gradient to give, which would otherwise leave every ``.grad`` None silently."""
    if program.split.tangents:
        return
    from .with_loss import describe_loss
    raise RuntimeError(
        f"{_WHERE}.train_step: element 0 of tensors does not require grad and does not have "
        f"a grad_fn: the loss of loss_fn={describe_loss(loss_fn)} depends on no parameter "
        f"that requires grad (a .detach(), .data or torch.no_grad() inside it, or every "
        f"parameter frozen), so loss.backward() has nothing to fill, as on one device. "
        f"Compute the loss from the model's output without detaching it")
