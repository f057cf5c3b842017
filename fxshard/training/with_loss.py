"""The user's loss traced with the model: ``pm.train_step(ids, loss_fn=fn, target=labels)``.

``loss_fn(pm(ids), labels)`` runs the loss on the output ``pm`` returns: on ``tp`` the
logits' blocks (``fxshard.training.vocab_output``: a cross-entropy on them is vocab-parallel
outside the programs, a loss of other ops gathers them), gathered over ``dp``/``fsdp``, so
each ``dp`` rank computes the whole batch's loss. ``train_step`` instead traces ``fn`` after
the model, as one program, so the loss is in the graph the passes see and a cross-entropy
there is vocab-parallel (``fxshard.passes.vocab_loss``), as HF's ``labels=`` is, on the
rank's own rows::

    before (loss on the output):  forward: ... mm(x, lm_head) -> all_gather(0, 'dp')  [B, S, V/tp]
                                  loss_fn(logits, labels) on the blocks, outside the programs
    after (loss traced):          forward: ... mm(x, lm_head) -> amax, all_gather [N, tp],
                                  sum(exp), all_reduce [N, 1], vocab_nll_loss_forward -> loss
                                  backward: vocab_cross_entropy_backward, no collective

``WithLoss`` is the module traced: it shares the model's children, parameters and buffers
(the same dicts), so every name in the trace is the model's own and the shards are the ones
``pm(x)`` trains. Its inputs are ``(args, kwargs, target)``.

A loss is traced once per function (a plain function: its code and the objects its closure
and defaults hold, so an inline ``lambda`` in a training loop is traced once; another
callable: the object itself), and the traced program is what later steps run: a loss whose
behaviour depends on a value it reads from elsewhere (a global that changes) should take it
as ``target``. A loss that cannot be traced (``.item()`` inside) runs on the output as
before, with a :class:`LossNotTracedWarning` naming why (the same loss, on the output).
"""
from __future__ import annotations

import types
import warnings

import torch

__all__ = ["WithLoss", "LossNotTracedWarning", "loss_key"]


class LossNotTracedWarning(UserWarning):
    """``train_step``'s ``loss_fn`` could not be traced with the model: it runs on the
    output pm(x) returns (the same loss, outside the programs)."""


class WithLoss(torch.nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` (``loss_fn(model(...))`` when ``target`` is
    None) as one module whose parameters and buffers carry the model's own names."""

    def __init__(self, model: torch.nn.Module, loss_fn, with_target: bool):
        super().__init__()
        # the model's own dicts: named_parameters() here is the model's, name for name
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self.training = model.training
        object.__setattr__(self, "_inner", model)        # not a submodule: no "model." prefix
        object.__setattr__(self, "_loss_fn", loss_fn)
        self._with_target = with_target

    @property
    def inner(self) -> torch.nn.Module:
        """The model whose output the loss takes."""
        return self._inner

    def forward(self, args: tuple, kwargs: dict, target=None):
        out = self._inner(*args, **kwargs)
        return self._loss_fn(out, target) if self._with_target else self._loss_fn(out)


def loss_key(loss_fn) -> tuple:
    """What identifies a traced loss: a plain function's code and the identities of what its
    closure and defaults hold (an inline lambda made anew each step is the same loss), any
    other callable's identity. The program cache holds ``loss_fn``, so none of these objects
    can be freed and its id reused while the entry lives."""
    if isinstance(loss_fn, types.FunctionType):
        cells = tuple(id(c.cell_contents) for c in (loss_fn.__closure__ or ()))
        defaults = tuple(id(d) for d in (loss_fn.__defaults__ or ()))
        kwdefaults = tuple((k, id(v)) for k, v in sorted((loss_fn.__kwdefaults__ or {}).items()))
        return ("function", loss_fn.__code__, cells, defaults, kwdefaults)
    return ("callable", id(loss_fn))


def describe_loss(loss_fn) -> str:
    """The loss as ranks agree on it (no ids: they differ between processes)."""
    code = getattr(loss_fn, "__code__", None)
    if code is not None:
        return f"{getattr(loss_fn, '__qualname__', code.co_name)} ({code.co_filename}:" \
               f"{code.co_firstlineno})"
    return type(loss_fn).__qualname__


def warn_not_traced(where: str, loss_fn, error: BaseException) -> None:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"{where}: loss_fn={describe_loss(loss_fn)} could not be traced with the model "
        f"({type(error).__name__}: {first[:300]}); it runs on pm's output instead, which "
        f"gives the same loss but gathers the output (on tp the whole [B, S, V] logits). "
        f"Make the loss traceable (no .item(), no data-dependent Python branches) to keep a "
        f"cross-entropy vocab-parallel.", LossNotTracedWarning, stacklevel=3)
