"""Argument checks at the public API's edge, so a bad argument is an error that names the
function, the argument, its value and the fix, instead of a failure deep inside a pass.

    parallelize(model, mesh, microbatches=2.0)
    -> TypeError: fxshard.parallelize: microbatches=2.0 (float) must be an int >= 1, e.g. 2
"""
from __future__ import annotations

import dataclasses
import fnmatch
import numbers
import warnings
from collections.abc import Mapping

import torch

__all__ = ["check_parallelize_args", "unmatched_plan_patterns", "check_state_dict_values",
           "token_ids", "EvalModeWarning", "warn_training_in_eval_mode"]


def token_ids(value):
    """A token id (or list of ids) given as a tensor, as HuggingFace accepts ``eos_token_id``
    (``tensor(2)``, ``tensor([2, 7])``), as the int or list it holds; anything else as it is
    (the caller checks it)."""
    if isinstance(value, torch.Tensor) and value.dim() <= 1 and value.device.type != "meta":
        return value.tolist()
    return value


class EvalModeWarning(UserWarning):
    """Training a model that ``parallelize`` put in eval mode, with its dropout off."""


def dropout_sites(model: torch.nn.Module) -> list[str]:
    """The model's dropout with ``p > 0``: ``nn.Dropout`` modules and a config's dropout
    probabilities (HuggingFace's functional ``attention_dropout``, GPT-2's ``attn_pdrop``)."""
    sites = [f"{name} (p={m.p})" for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    for key, value in _config_items(getattr(model, "config", None)):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            sites.append(f"config.{key}={value}")
    return sites


def _config_items(config) -> list:
    """A model config's fields, by name: an object's ``__dict__``, a slots dataclass's fields
    (torchtitan's configs), nothing for anything else."""
    if config is None:
        return []
    if dataclasses.is_dataclass(config):
        return sorted((f.name, getattr(config, f.name, None))
                      for f in dataclasses.fields(config))
    return sorted(getattr(config, "__dict__", {}).items())


def warn_training_in_eval_mode(where: str, model: torch.nn.Module) -> None:
    """An :class:`EvalModeWarning` when a training call finds the model in the eval mode
    ``parallelize`` put it in (it was in train mode before) and the model has dropout: on one
    device the same model would train with dropout."""
    sites = dropout_sites(model)
    if not sites:
        return
    warnings.warn(
        f"{where}: training {type(model).__name__} in eval mode: fxshard.parallelize put it in "
        f"eval mode (it was in train mode), so its dropout ({', '.join(sites[:3])}"
        f"{', ...' if len(sites) > 3 else ''}) is off in this training forward, unlike the "
        f"model trained on one device. Call pm.train() to train with dropout, or pm.eval() "
        f"to train without it and silence this warning", EvalModeWarning, stacklevel=3)


def _int(where: str, name: str, value, *, low: int, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name}={value!r} ({type(value).__name__}) must be an int "
                        f">= {low}, e.g. {name}={example}")
    if value < low:
        raise ValueError(f"{where}: {name}={value} must be >= {low}, e.g. {name}={example}")


def _flag(where: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name}={value!r} ({type(value).__name__}) must be True or "
                        f"False")


def check_reshard_after_forward(where: str, value) -> None:
    """A clear TypeError for an ``fsdp_reshard_after_forward=`` other than True, False or
    ``"layers"``."""
    if not (isinstance(value, bool) or isinstance(value, str) and value == "layers"):
        raise TypeError(f"{where}: fsdp_reshard_after_forward={value!r}; pass True (gather "
                        f"fsdp parameters again in the backward), False (keep the forward's "
                        f"gathered weights for the backward) or 'layers' (gather again only "
                        f"the layer stack's; keep the embedding, final norm and head, as "
                        f"FSDP2 keeps its root's)")


def check_parallelize_args(where: str, *, model, example_inputs, example_kwargs, plan,
                           styles, sequence_parallel, microbatches, strict, embedding,
                           stages, ring_zigzag, recompute=None,
                           fsdp_reshard_after_forward=True) -> None:
    """Types and values of :func:`fxshard.parallelize`'s arguments (not their fit to the
    model, which the passes check with the traced shapes)."""
    from .training.recompute import check_recompute
    check_recompute(where, recompute)
    check_reshard_after_forward(where, fsdp_reshard_after_forward)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        hint = "(x,)" if isinstance(example_inputs, torch.Tensor) else "(x, ...)"
        raise TypeError(f"{where}: example_inputs must be a tuple of the forward's positional "
                        f"arguments, got {type(example_inputs).__name__}; pass "
                        f"example_inputs={hint}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"{where}: example_kwargs must be a dict of the forward's keyword "
                        f"arguments, got {type(example_kwargs).__name__}")
    if plan is not None:
        if not isinstance(plan, Mapping):
            raise TypeError(f"{where}: plan must be a dict {{module-name glob: style}}, got "
                            f"{type(plan).__name__}; e.g. plan={{\"model.layers.*.mlp.*\": "
                            f"\"replicate\"}}")
        for pattern, style in plan.items():
            if not isinstance(pattern, str):
                raise TypeError(f"{where}: plan key {pattern!r} ({type(pattern).__name__}) "
                                f"must be a module-name glob string such as "
                                f"\"model.layers.*.mlp.up_proj\"")
            if not isinstance(style, str) or style not in styles:
                raise (TypeError if not isinstance(style, str) else ValueError)(
                    f"{where}: plan[{pattern!r}] = {style!r} is not a style; use one of "
                    f"{', '.join(styles)} (one string per pattern)")
    for name, value in (("sequence_parallel", sequence_parallel), ("strict", strict),
                        ("ring_zigzag", ring_zigzag)):
        _flag(where, name, value)
    _int(where, "microbatches", microbatches, low=1, example=2)
    if embedding not in ("embed_dim", "vocab", "replicate"):
        raise ValueError(f"{where}: embedding={embedding!r}; use 'embed_dim', 'vocab' or "
                         f"'replicate'")
    if stages is not None and (isinstance(stages, (str, bytes)) or not all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in stages)):
        raise TypeError(f"{where}: stages={stages!r} must be a list of ints, the pipeline "
                        f"stage of each layer, e.g. stages=[0, 0, 1]")


def unmatched_plan_patterns(where: str, model: torch.nn.Module, plan: dict | None) -> list:
    """Plan globs that match no module of ``model``: a ``UserWarning`` each (a typo would
    otherwise leave the automatic plan in place silently); ``explain()`` lists them too."""
    names = [n for n, _ in model.named_modules()]
    unmatched = [p for p in (plan or {}) if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    for pattern in unmatched:
        close = [n for n in names if n.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]][:2]
        warnings.warn(f"{where}: plan pattern {pattern!r} matches no module of "
                      f"{type(model).__name__} and is ignored"
                      f"{'; modules with that leaf name: ' + ', '.join(close) if close else ''}"
                      f" (patterns are globs over module names, e.g. 'model.layers.*.mlp')",
                      UserWarning, stacklevel=3)
    return unmatched


def check_state_dict_values(where: str, state_dict) -> None:
    """Every value a tensor (or a lazy checkpoint source); a mapping of names to them."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where}: expected a dict of parameter name -> tensor (the unsharded "
                        f"model's state_dict()), got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor) and not hasattr(value, "block"):
            hint = (" (torch.from_numpy(value) converts it)"
                    if type(value).__module__ == "numpy" else "")
            raise TypeError(f"{where}: {key!r} is {type(value).__name__}, not a torch.Tensor"
                            f"{hint}; pass the unsharded model's state_dict() values")


class _NoBackward(torch.autograd.Function):
    """Identity forward; a backward that says fxshard's rank programs are inference only."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "fxshard.ParallelModule: backward through a parallelized model is not supported; "
            "fxshard's rank programs are inference only (their collectives have no gradient). "
            "Run pm(x) under torch.no_grad() or torch.inference_mode(), and train the "
            "unparallelized model (or with torch.distributed's FSDP/DTensor)")


def inference_only(model: torch.nn.Module, outputs: list) -> list:
    """``outputs`` unchanged when grad mode is off or nothing requires grad; otherwise each
    floating tensor output gets a backward that raises the clear error above (instead of torch's
    "no autograd formula for fxshard.all_reduce" or "does not require grad")."""
    if not torch.is_grad_enabled():
        return outputs
    anchor = next((p for p in model.parameters() if p.requires_grad), None)
    if anchor is None:
        return outputs
    return [_NoBackward.apply(x, anchor) if isinstance(x, torch.Tensor) and
            x.dtype.is_floating_point else x for x in outputs]


def out_of_vocabulary(model: torch.nn.Module, traced, args: tuple, kwargs: dict,
                      error: IndexError, *, where: str) -> IndexError:
    """What to raise for ``error``, a rank's IndexError ("index out of range in self"): an
    IndexError (caused by it) naming the token id, where it sits and the vocabulary size, for
    an embedding of the traced graph whose ids come straight from an input of the forward;
    ``error`` itself when no input holds an id outside its embedding."""
    import inspect
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return error
    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight, ids = node.args[0], node.args[1]
        while isinstance(ids, torch.fx.Node) and ids.op == "call_function" and ids.args:
            ids = ids.args[0]   # through a view or a shard of the ids
        value = bound.get(getattr(ids, "name", None))
        rows = getattr(weight.meta.get("val"), "shape", (None,))[0]
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or rows is None:
            continue
        bad = ((value < 0) | (value >= rows)).nonzero()
        if len(bad):
            at = tuple(bad[0].tolist())
            name = traced.param_names.get(weight.name, weight.name)
            better = IndexError(
                f"{where}: token id {int(value[at])} at {ids.name}{list(at)} is outside the "
                f"vocabulary [0, {rows}) of the embedding {name!r} (the single-device model "
                f"raises IndexError too); check that the input ids come from a tokenizer with "
                f"at most {rows} tokens")
            better.__cause__ = error
            return better
    return error
