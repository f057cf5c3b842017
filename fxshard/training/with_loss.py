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
callable: the object itself) and per value of what it reads besides its arguments
(:func:`loss_reads`): the numbers, strings and tensors of the globals and closure variables
it names, the attributes it names of a module or object it reads (``cfg.scale``), and a
callable object's own attributes (``nn.CrossEntropyLoss``'s ``label_smoothing``). The traced
program bakes those values in, so when one changes the loss is traced again (the result is
one device's); a loss traced again :data:`RETRACE_WARN` times warns that each change costs a
trace. What a function it calls reads is not seen: pass such a value as ``target``. A loss
that cannot be traced (``.item()`` inside) runs on the output as before, with a
:class:`LossNotTracedWarning` naming why (the same loss, on the output)::

    scale = 1.0
    pm.train_step(ids, loss_fn=lambda o, t: ce(o, t) * scale, target=labels)   # traced
    scale = 3.0
    pm.train_step(ids, loss_fn=lambda o, t: ce(o, t) * scale, target=labels)   # traced again
"""
from __future__ import annotations

import inspect
import types
import warnings

import torch

__all__ = ["WithLoss", "LossNotTracedWarning", "loss_key", "loss_reads"]

RETRACE_WARN = 4     # traces of one loss function (its reads changed) before a warning
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


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


def _value(v):
    """What a read value is compared by: a plain value itself, a tensor its identity,
    version (in-place changes), shape and dtype; None: not guarded (functions, modules...)."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v), v._version, tuple(v.shape), str(v.dtype))
    if isinstance(v, (tuple, list)) and len(v) <= 64 and all(isinstance(x, _PLAIN) for x in v):
        return (type(v).__name__, tuple(v))
    return None


def _attributes(obj, names) -> list:
    """``(name, value)`` of the attributes ``names`` of ``obj`` held in its ``__dict__`` (no
    property or module ``__getattr__`` runs) whose values are guarded."""
    table = getattr(obj, "__dict__", None)
    if not isinstance(table, dict):
        return []
    out = [(n, _value(table[n])) for n in names if n in table]
    return [(n, v) for n, v in out if v is not None]


def loss_reads(loss_fn) -> tuple:
    """What ``loss_fn`` reads besides its arguments and the traced program bakes in, as
    ``(name, value)``: a function's globals and closure variables that are numbers, strings or
    tensors, and the attributes it names of the modules and objects among them; a callable
    object's own attributes and buffers. Empty when they cannot be found."""
    out = []
    if isinstance(loss_fn, types.MethodType):
        out += [(f"self.{n}", v) for n, v in _attributes(loss_fn.__self__,
                                                         loss_fn.__func__.__code__.co_names)]
        loss_fn = loss_fn.__func__
    if not isinstance(loss_fn, types.FunctionType):
        out += [(f"{type(loss_fn).__name__}.{n}", v)
                for n, v in _attributes(loss_fn, sorted(vars(loss_fn)) if
                                        hasattr(loss_fn, "__dict__") else ())]
        buffers = getattr(loss_fn, "_buffers", None) or {}
        out += [(f"{type(loss_fn).__name__}.{n}", _value(b)) for n, b in sorted(buffers.items())
                if b is not None]
        return tuple(out)
    try:
        found = inspect.getclosurevars(loss_fn)
    except (TypeError, ValueError):
        return tuple(out)
    attrs = sorted(set(loss_fn.__code__.co_names))
    for name, v in sorted({**found.globals, **found.nonlocals}.items()):
        guarded = _value(v)
        if guarded is not None:
            out.append((name, guarded))
        elif not callable(v) or isinstance(v, types.ModuleType):   # cfg.scale, module.SCALE
            out += [(f"{name}.{n}", a) for n, a in _attributes(v, attrs)]
        elif not isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType,
                                types.MethodType)):   # a loss object it calls: its settings
            out += [(f"{name}.{n}", a) for n, a in _attributes(v, sorted(vars(v)) if
                                                            hasattr(v, "__dict__") else ())]
            out += [(f"{name}.{n}", _value(b)) for n, b in
                    sorted((getattr(v, "_buffers", None) or {}).items()) if b is not None]
    return tuple(out)


def loss_key(loss_fn, reads: bool = True) -> tuple:
    """What identifies a traced loss: a plain function's code and the identities of what its
    closure and defaults hold (an inline lambda made anew each step is the same loss), any
    other callable's identity; with ``reads``, also the values it reads
    (:func:`loss_reads`: one changed, the loss is traced again). The program cache holds
    ``loss_fn`` and the program its reads' tensors, so none of these objects can be freed
    and its id reused while the entry lives."""
    guard = (loss_reads(loss_fn),) if reads else ()
    if isinstance(loss_fn, types.FunctionType):
        cells = tuple(id(c.cell_contents) for c in (loss_fn.__closure__ or ()))
        defaults = tuple(id(d) for d in (loss_fn.__defaults__ or ()))
        kwdefaults = tuple((k, id(v)) for k, v in sorted((loss_fn.__kwdefaults__ or {}).items()))
        return ("function", loss_fn.__code__, cells, defaults, kwdefaults) + guard
    return ("callable", id(loss_fn)) + guard


def read_tensors(loss_fn) -> list:
    """The tensors :func:`loss_reads` found (kept alive with the program, so their ids in the
    key stay theirs)."""
    found = []
    fn = getattr(loss_fn, "__func__", loss_fn)
    if isinstance(fn, types.FunctionType):
        try:
            cv = inspect.getclosurevars(fn)
        except (TypeError, ValueError):
            cv = None
        for v in {**cv.globals, **cv.nonlocals}.values() if cv is not None else ():
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(getattr(v, "_buffers", None), dict):
                found += [b for b in v._buffers.values() if isinstance(b, torch.Tensor)]
    return found + [b for b in (getattr(loss_fn, "_buffers", None) or {}).values()
                    if isinstance(b, torch.Tensor)]


def describe_loss(loss_fn) -> str:
    """The loss as ranks agree on it (no ids: they differ between processes), with the
    plain values it reads (:func:`loss_reads`)."""
    code = getattr(loss_fn, "__code__", None)
    if code is not None:
        text = f"{getattr(loss_fn, '__qualname__', code.co_name)} ({code.co_filename}:" \
               f"{code.co_firstlineno})"
    else:
        text = type(loss_fn).__qualname__
    plain = [f"{n}={v!r}" for n, v in loss_reads(loss_fn) if isinstance(v, _PLAIN)]
    return text + (f" reading {', '.join(plain)}" if plain else "")


def warn_retraced(where: str, loss_fn, traces: int) -> None:
    """A loss traced ``traces`` times because what it reads keeps changing: each costs a
    trace of the model and the loss (correct, but slow)."""
    names = sorted({n for n, _ in loss_reads(loss_fn)})
    warnings.warn(
        f"{where}: loss_fn={describe_loss(loss_fn)} was traced {traces} times because values "
        f"it reads changed ({', '.join(names[:6])}); every change traces the model and the "
        f"loss again. Pass a value that changes every step as target= (or part of it) "
        f"instead of reading it from outside the function", stacklevel=4)


def warn_not_traced(where: str, loss_fn, error: BaseException) -> None:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"{where}: loss_fn={describe_loss(loss_fn)} could not be traced with the model "
        f"({type(error).__name__}: {first[:300]}); it runs on pm's output instead, which "
        f"gives the same loss but gathers the output (on tp the whole [B, S, V] logits). "
        f"Make the loss traceable (no .item(), no data-dependent Python branches) to keep a "
        f"cross-entropy vocab-parallel.", LossNotTracedWarning, stacklevel=3)
