"""The model's weights as ``parallelize`` sees them: built empty, watched for changes.

A big model is built without memory for its parameters and loaded slice by slice::

    with fxshard.init_empty_weights():          # parameters on meta, buffers real
        model = AutoModelForCausalLM.from_config(config)
    pm = fxshard.parallelize(model, mesh)
    fxshard.load_safetensors(pm, checkpoint_dir)  # each rank reads only its slices

Non-persistent buffers (HuggingFace's RoPE ``inv_freq``) are in no checkpoint: the model's own
code computes them in ``__init__``. :func:`init_empty_weights` keeps that code running for
real, and for a model built entirely on ``meta`` (``with torch.device("meta")``)
:func:`materialize_buffers` asks the model's own initialiser (a HuggingFace model's
``_init_weights``) to compute them. Nothing is ever guessed: a buffer that neither gives a
value stays missing, and running the model names it and says how to fix it.

What ``parallelize`` keeps of these weights, and how it notices the user changing the model
afterwards, is :mod:`fxshard.runtime.weight_store`; a state dict that names them otherwise (its
hooks), :mod:`fxshard.state_dict_hooks`.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["init_empty_weights", "materialize_buffers", "non_persistent_buffers", "tied_names"]


@contextlib.contextmanager
def init_empty_weights():
    """Build modules with their parameters on ``meta`` (no memory) and their buffers real.

    The model's constructor runs as usual, so buffers it computes (RoPE frequencies, constant
    masks) hold their real values, while every parameter is an empty ``meta`` tensor waiting
    for :meth:`ParallelModule.load_state_dict` or :func:`fxshard.load_safetensors`.
    """
    original = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{fqn: buffer}`` of the buffers ``state_dict()`` leaves out."""
    out = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for bname in module._non_persistent_buffers_set:
            buf = module._buffers.get(bname)
            if buf is not None:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def materialize_buffers(model: torch.nn.Module) -> list[str]:
    """Give the model's non-persistent buffers that are still on ``meta`` their real values,
    computed by the model's own initialiser, on CPU. Returns the FQNs materialised.

    Only a HuggingFace ``PreTrainedModel`` has such an initialiser (``_init_weights``, which
    recomputes RoPE frequencies from the config the way ``from_pretrained`` does). A buffer is
    filled with NaN first and kept only if the initialiser overwrote every element, so a module
    the initialiser does not know stays missing rather than holding garbage.
    """
    init = getattr(model, "_init_weights", None)
    if init is None:
        return []
    done = []
    for mname, module in model.named_modules():
        names = [b for b in module._non_persistent_buffers_set
                 if module._buffers.get(b) is not None and module._buffers[b].device.type == "meta"]
        if not names:
            continue
        old = {b: module._buffers[b] for b in names}
        for b in names:
            module._buffers[b] = torch.full(old[b].shape, float("nan"), dtype=old[b].dtype,
                                            device="cpu") if old[b].is_floating_point() \
                else torch.empty(old[b].shape, dtype=old[b].dtype, device="cpu")
        try:
            with torch.no_grad():
                init(module)
        except Exception:  # the initialiser cannot handle this module: leave it as it was
            module._buffers.update(old)
            continue
        for b in names:
            value = module._buffers[b]
            if value.device.type == "meta" or not value.is_floating_point() or \
                    bool(torch.isnan(value).any()):
                module._buffers[b] = old[b]
            else:
                done.append(f"{mname}.{b}" if mname else b)
    return done


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{name: [other names of the same parameter]}`` for tied weights (GPT-2's
    ``transformer.wte.weight`` and ``lm_head.weight``)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {n: [m for m in g if m != n] for g in groups.values() if len(g) > 1 for n in g}


@contextlib.contextmanager
def parameters_swapped(model: torch.nn.Module, replace):
    """Inside: each parameter ``p`` of ``model`` for which ``replace(p)`` gives a tensor stands
    replaced by it (called once per parameter object, so tied ones stay tied); the originals
    are put back afterwards (a trace with meta parameters made real, or cast copies)."""
    swapped, made = [], {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = replace(p)
            if made[id(p)] is None:
                continue
            swapped.append((module, name, p))
            module._parameters[name] = made[id(p)]
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
