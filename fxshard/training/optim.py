"""What an optimizer step needs beyond ``torch.optim``: gradient clipping over shards.

``torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)`` would count every replica of a
replicated parameter (one per rank) and miss nothing else, a norm too large by the replicas;
:func:`clip_grad_norm_` computes the norm of the *model's* gradient (each parameter once,
assembled from its shards, Partial gradients summed) and scales every rank's shard gradients
by the same factor, as torch's clipping scales the single-device model's::

    total = ||(g_embed, g_q, ..., g_lm_head)||           (one device's gradient)
    every shard grad *= min(1, max_norm / (total + 1e-6))

On a real mesh nothing is gathered: each rank's owned blocks' sums, all-reduced
(``fxshard/training/world.py``).

An optimizer built over ``model.parameters()`` instead of ``pm.parameters()`` would step
tensors fxshard never reads once training started (``loss.backward()`` fills the shards, so
their ``.grad`` stays None and the step changes nothing): :func:`watch_model_parameters`
remembers a trained model's parameters and a global optimizer step pre-hook raises at
``opt.step()`` when every one of them it holds has no gradient::

    opt = torch.optim.AdamW(model.parameters())     # the model's, not the shards
    loss_fn(pm(ids), labels).backward()             # fills pm.parameters()' .grad
    opt.step()                                      # ValueError: use AdamW(pm.parameters())
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .shard_owners import OWNERS

__all__ = ["clip_grad_norm_", "watch_model_parameters", "remember_owner"]

# registry: a trained model's parameter -> (its name, the mesh), while the parameter lives
_WATCHED = WeakIdKeyDictionary()
_HOOK: list = []     # the optimizer step pre-hook's handle, registered once


def watch_model_parameters(model: torch.nn.Module, mesh_text: str) -> None:
    """Remember ``model``'s parameters (training's shards replace them as the weights) so an
    optimizer step over them, with no gradient on any, raises (:func:`_check_optimizer`)."""
    for name, p in model.named_parameters():
        _WATCHED[p] = (name, mesh_text)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer, args, kwargs) -> None:
    """Raise if ``optimizer`` steps a parallelized, trained model's own parameters and none
    of them has a gradient: the step would silently do nothing."""
    if not len(_WATCHED):
        return
    held = [p for group in optimizer.param_groups for p in group["params"] if p in _WATCHED]
    if not held or any(p.grad is not None for p in held):
        return
    name, mesh_text = _WATCHED[held[0]]
    kind = type(optimizer).__name__
    raise ValueError(
        f"torch.optim.{kind}.step: this optimizer holds the original model's parameters "
        f"({name!r} and {len(held) - 1} more), which fxshard.parallelize (mesh {mesh_text}) "
        f"no longer reads once training started: loss.backward() fills the parameter shards "
        f"in pm.parameters(), so these have no gradient and the step would change nothing. "
        f"Build the optimizer over the shards: opt = torch.optim.{kind}(pm.parameters(), ...)")


_OWNERS = OWNERS    # registry (training/shard_owners.py): a shard pm.parameters() gave -> its trainer


def remember_owner(trainer, shards) -> None:
    """``shards`` (what ``pm.parameters()`` returns) belong to ``trainer``, so
    ``clip_grad_norm_(pm.parameters(), ...)`` finds whose gradients to clip, torch's included
    (:func:`_route_torch_clip`), and a ``GradScaler`` over them checks for inf/nan over the
    whole mesh (:mod:`fxshard.training.grad_scaler`)."""
    for p in shards:
        _OWNERS[p] = trainer
    if not _ROUTED:
        _route_torch_clip()
    from .grad_scaler import route_torch_scaler
    route_torch_scaler()    # torch.amp.GradScaler: one inf/nan check over the whole mesh


_ROUTED: list = []   # torch's clip_grad_norm_ as it was, once routed


def _route_torch_clip() -> None:
    """``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)``, the call every training
    script makes, would count every rank's copy of a replicated shard (a norm of 1.550 where
    one device's is 1.092) and clip by it. From the first ``pm.parameters()`` on, torch's
    function hands shards of one fxshard module to :func:`clip_grad_norm_` (the model's
    norm, as on one device) and anything else to itself, unchanged; a mix of shards and
    other tensors is the TypeError of :func:`_owner`."""
    import functools
    import torch.nn.utils
    import torch.nn.utils.clip_grad as clip_grad
    original = clip_grad.clip_grad_norm_
    _ROUTED.append(original)

    @functools.wraps(original)
    def routed(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(p in _OWNERS for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    clip_grad.clip_grad_norm_ = routed
    if torch.nn.utils.clip_grad_norm_ is original:
        torch.nn.utils.clip_grad_norm_ = routed


def _owner(parameters, where: str):
    """The trainer whose every shard ``parameters`` (an iterable of shards) is."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(_OWNERS[p]): _OWNERS[p] for p in params if p in _OWNERS}
    if len(owners) == 1 and len(params) == sum(p in _OWNERS for p in params):
        tm = next(iter(owners.values()))
        if len(params) == len(tm.parameters()):
            return tm
    raise TypeError(
        f"{where}: parameters must be a ParallelModule (pm), a TrainModule, or all of "
        f"pm.parameters(); got {len(params)} tensors of which {sum(p in _OWNERS for p in params)} "
        f"are shards of one fxshard module. The norm is the whole model's, so pass the module: "
        f"fxshard.clip_grad_norm_(pm, max_norm); for a model that is not parallelized use "
        f"torch.nn.utils.clip_grad_norm_")


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (a :class:`fxshard.ParallelModule`, a
    :class:`~fxshard.training.TrainModule`, or all of ``pm.parameters()``) to the global norm
    ``max_norm``; returns the norm before clipping; torch's signature
    (``error_if_nonfinite``: a RuntimeError for a nan or inf norm; ``foreach`` accepted)."""
    if hasattr(parameters, "trainer") or hasattr(parameters, "_require"):
        tm = getattr(parameters, "trainer", parameters)
    else:
        tm = _owner(parameters, "fxshard.clip_grad_norm_")
    tied = tm._require("clip_grad_norm_").joint.tied    # other names of one tensor: once
    norm_type = float(norm_type)
    if not tm._simulated:     # each rank its owned blocks, the sums all-reduced
        from ..runtime.distributed import backend_for
        from .world import owned_norm
        mine, specs = tm.shards(tm.ranks[0]), tm._specs
        total = owned_norm(backend_for(tm.mesh), [p.grad for p in mine.values()],
                           [specs[k] for k in mine], norm_type,
                           distinct=tm._distinct_axes)
    else:
        grads = [g for k, g in tm.gradients().items() if g is not None and k not in tied]
        if not grads:
            return torch.zeros((), device=torch.device(tm.spec.device_type))
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"fxshard.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"non-finite ({total.item()}), so it cannot be clipped. To disable this error and "
            f"scale the gradients by the non-finite norm anyway, set error_if_nonfinite=False")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in tm.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total
