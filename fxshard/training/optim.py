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
"""
from __future__ import annotations

import torch

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(tm, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``tm`` (a :class:`fxshard.ParallelModule` or a
    :class:`~fxshard.training.TrainModule`) to the global norm ``max_norm``; returns the norm
    before clipping (as ``torch.nn.utils``)."""
    tm = getattr(tm, "trainer", tm)
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
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in tm.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total
