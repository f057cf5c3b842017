"""Which parallelized module each shard in ``pm.parameters()`` belongs to.

``pm.parameters()`` records its shards here; an optimizer built over them is then traced back
to its module by :mod:`fxshard.training.optim` (``clip_grad_norm_``, the optimizer checks) and
:mod:`fxshard.training.grad_scaler` (the mesh-wide inf/nan check). Weak keys: a shard that is
no longer used leaves the registry.
"""
from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["OWNERS"]

OWNERS = WeakIdKeyDictionary()    # a shard pm.parameters() gave -> its trainer
