"""Collectives over a whole real mesh for looking inside training (``torchrun``).

On a real mesh each process holds its own rank's shards. ``pm.gradients()`` and
``pm.state_dict()`` gather every rank's block to *every* rank (one all-gather per mesh axis,
innermost first, so the blocks arrive in rank order) and assemble them as on a simulated
mesh: each rank then holds the whole tensors (for tests, debugging, logging; a checkpoint is
``fxshard.save_safetensors``, which writes each rank's own part). ``clip_grad_norm_`` gathers
nothing: each rank sums ``|g|^p`` of the blocks it owns (coordinate 0 of every axis that
replicates the parameter, so a replica counts once; a Partial gradient is reduced over its
axes first), and the sums are all-reduced over every axis::

    mesh (dp=2, tp=2), norm's weight R,R: only rank 0 counts it; q_proj R,S(0): ranks 0, 1
    local = sum_p owned(p) * sum |g_p|^2;  total = all_reduce(all_reduce(local, tp), dp)^(1/2)

On a mesh with ``pp`` each stage's ranks gather only over the other axes (``skip``), then the
stages' whole tensors are shared along ``pp`` (:func:`share_along`); in the norm every stage
counts its own parameters (``distinct``), and the sum is all-reduced over ``pp`` too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..placement import Partial, owned_block, shard_dim

__all__ = ["gather_blocks", "owned_norm", "share_along"]


def _axes(backend, skip=()) -> list[str]:
    return [a for a, n in zip(backend.mesh.axis_names, backend.mesh.shape)
            if n > 1 and a not in skip]


def gather_blocks(backend, block: torch.Tensor, skip=()) -> list[torch.Tensor]:
    """Every rank's ``block`` (equal shapes), indexed by mesh rank, on every rank. ``skip``:
    axes not gathered over (a pipeline stage's mesh leaves out ``pp``: the blocks come indexed
    by the rank on the mesh without it)."""
    axes = _axes(backend, skip)
    x = block.detach().contiguous().unsqueeze(0)
    for axis in reversed(axes):                # innermost first: rank-major order
        x = backend.all_gather(x, 0, axis)
    return list(x.unbind(0)) if axes else [block.detach()]


def share_along(backend, axis: str, mine: dict) -> dict:
    """Every coordinate's ``mine`` (name -> tensor or None) along mesh ``axis``, merged, on
    every rank of it: a pipeline's stages hold different parameters, each rank its stage's
    whole tensors; afterwards each holds all of them. The names, shapes and dtypes travel as
    one object all-gather, each tensor as a broadcast from the coordinate that has it (on its
    device)."""
    group = backend.device_mesh.get_group(axis)
    ranks = dist.get_process_group_ranks(group)
    metas = [None] * len(ranks)
    dist.all_gather_object(metas, {k: None if v is None else (tuple(v.shape), v.dtype)
                                   for k, v in mine.items()}, group=group)
    me = ranks.index(dist.get_rank())
    device = next((v.device for v in mine.values() if v is not None), backend.device)
    out = {}
    for i, meta in enumerate(metas):
        for name, about in meta.items():
            if about is None:
                out[name] = None
                continue
            t = mine[name].detach().contiguous() if i == me else \
                torch.empty(about[0], dtype=about[1], device=device)
            dist.broadcast(t, src=ranks[i], group=group)
            out[name] = t
    return out


def owned_norm(backend, grads: list, specs: list, norm_type: float,
               distinct=()) -> torch.Tensor:
    """The global ``norm_type``-norm of the model's gradient from this rank's shard gradients
    ``grads`` placed as ``specs``: each element counted once over the mesh. ``distinct``: axes
    whose coordinates hold different parameters (``pp``'s stages): every coordinate counts
    its own."""
    mesh, coords = backend.mesh, backend.coords
    inf = norm_type == float("inf")
    local = None
    for g, spec in zip(grads, specs):
        if g is None:
            continue
        g = g.detach()
        for axis, n, p in zip(mesh.axis_names, mesh.shape, spec):
            if n > 1 and isinstance(p, Partial):      # the rank's share of a partial sum
                g = backend.all_reduce(g, axis)
        owner = all(c == 0 for a, n, c, p in zip(mesh.axis_names, mesh.shape, coords, spec)
                    if n > 1 and shard_dim(p) is None and a not in distinct)
        g = owned_block(g, spec, mesh, coords)   # (a fused shard's whole parts: once)
        part = g.abs().amax() if inf else g.abs().pow(norm_type).sum()
        part = part.float() if owner else torch.zeros((), dtype=torch.float32,
                                                      device=g.device)
        local = part if local is None else (torch.maximum(local, part) if inf
                                            else local + part)
    if local is None:
        local = torch.zeros((), dtype=torch.float32,
                            device=torch.device(mesh.device_type))
    for axis in _axes(backend):
        if inf:
            local = local.clone()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=backend.device_mesh.get_group(axis))
        else:
            local = backend.all_reduce(local, axis)
    return local if inf else local.pow(1.0 / norm_type)
