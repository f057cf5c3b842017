"""Loss scaling over shards: a step skipped on every rank or on none.

``torch.amp.GradScaler`` unscales the gradients an optimizer holds and looks for an inf or a
NaN among them (``_amp_foreach_non_finite_check_and_unscale_``, one ``found_inf`` per
device); ``step`` skips ``optimizer.step()`` where it found one and ``update`` halves the scale
(else grows it every ``growth_interval`` clean steps). Over ``pm.parameters()``:

- on a simulated mesh every rank's shards live in this process and sit in the one optimizer,
  so the check already sees all of them: torch's scaler is right as it is;
- under ``torchrun`` each process holds only its own shards. An overflow in one rank's
  gradient (its vocab block, its layers on ``pp``) would skip the step there and not on the
  others, and their scales would part for good. The check is made global: after torch's own
  check each rank all-reduces its ``found_inf`` over every axis of the mesh (one scalar
  all-reduce per axis, in torch's ``_unscale_grads_``, which ``unscale_`` and ``step`` both
  call), so every rank skips, or steps, as one device would::

      rank 0: found_inf = 0  ->  all_reduce(sum) over dp, tp, ...  ->  1: skip, scale / 2
      rank 1: found_inf = 1  ->                                    ->  1: skip, scale / 2

From the first ``pm.parameters()`` on, torch's ``GradScaler._unscale_grads_`` does this for an
optimizer that holds shards of a ``torchrun`` module (:func:`route_torch_scaler`; any other
optimizer: unchanged), so ``torch.amp.GradScaler`` is right on every mesh;
:class:`GradScaler` is the same class under fxshard's name (and installs the routing itself).
An optimizer mixing shards of two modules, or shards and other tensors on a real mesh, is a
``TypeError`` (the ranks could not agree which group to check over).
"""
from __future__ import annotations

import torch

from .shard_owners import OWNERS as _OWNERS

__all__ = ["GradScaler", "route_torch_scaler"]

_ROUTED: list = []      # torch's GradScaler._unscale_grads_ as it was, once routed


def _real_owner(optimizer):
    """The ``torchrun`` trainer whose shards ``optimizer`` holds (None: a simulated mesh's,
    or no fxshard shards at all)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owners = {id(_OWNERS[p]): _OWNERS[p] for p in params if p in _OWNERS}
    real = [tm for tm in owners.values() if not getattr(tm, "_simulated", True)]
    if not real:
        return None
    if len(owners) > 1 or sum(p in _OWNERS for p in params) != len(params):
        raise TypeError(
            f"GradScaler.unscale_: the optimizer ({type(optimizer).__name__}) holds "
            f"{len(params)} tensors, {sum(p in _OWNERS for p in params)} of them shards of "
            f"{len(owners)} fxshard module(s) on a real mesh ({real[0].mesh}); the inf/nan "
            f"check must run over one mesh. Give each parallelized module its own optimizer "
            f"over pm.parameters() and one GradScaler per optimizer")
    return real[0]


def _global_found_inf(scaler, optimizer, found: dict) -> dict:
    """``found`` (device -> found_inf, this rank's) made the mesh's: summed over every axis,
    written back into each per-device tensor (an empty dict gets the scale's device)."""
    tm = _real_owner(optimizer)
    if tm is None:
        return found
    import torch.distributed as dist
    from ..runtime.distributed import backend_for
    backend = backend_for(tm.mesh)
    device = scaler._scale.device if scaler._scale is not None else \
        torch.device(backend.mesh.device_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for value in found.values():
        total += value.to(device)
    for axis, n in zip(backend.mesh.axis_names, backend.mesh.shape):
        if n > 1:
            dist.all_reduce(total, group=backend.device_mesh.get_group(axis))
    if not found:
        found[device] = total
    for value in found.values():
        value.copy_(total)
    return found


def route_torch_scaler() -> None:
    """Make ``torch.amp.GradScaler``'s inf/nan check global for optimizers over the shards
    of a ``torchrun`` module (see the module); idempotent."""
    if _ROUTED:
        return
    import functools
    original = torch.amp.GradScaler._unscale_grads_
    _ROUTED.append(original)

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        return _global_found_inf(self, optimizer, found)
    torch.amp.GradScaler._unscale_grads_ = _unscale_grads_


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments: ``device``, ``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``; same ``scale``,
    ``unscale_``, ``step``, ``update``, ``state_dict``/``load_state_dict``) whose inf/nan check
    over ``pm.parameters()`` is the whole mesh's: a step is skipped on every rank or none."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        route_torch_scaler()
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
