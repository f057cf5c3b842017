"""One weight store: once training shards exist, they are the weights every program reads.

``fxshard.parallelize``'s inference programs slice their weights from the weight store's
values (:mod:`fxshard.runtime.weight_store`). When the first training program places the
shards, :func:`install` replaces each parameter's value by a :class:`TrainedShard`, a source
whose ``block(spec, mesh, rank)`` is rank ``rank``'s shard itself (the same storage, detached)
when the inference program places the parameter as training does::

    store.values["model.layers.0.mlp.up_proj.weight"]      before: the model's tensor
                                                            after:  TrainedShard(shards[r])
    rank_module(r).model.layers[0].mlp.up_proj.weight       is shards[r] (a view, no copy)

so an optimizer step (in place) is what the next ``torch.no_grad()`` call computes with, with
nothing re-sliced. A program that places a parameter differently gets a copy assembled from
the shards (simulated mesh), and :meth:`TrainedShard.stale` tells the program cache to cut it
again after the shards changed. From then on the model object is not the truth: it keeps its
initial weights; a change to it is an error naming ``pm.load_state_dict`` (see
:func:`fxshard.runtime.weight_store.check_model_unchanged`), which copies into the shards in place (:func:`load_into`).
"""
from __future__ import annotations

import torch

from ..placement import cut_to, local_block, pad_to, padded_block
from .rank_blocks import assemble

__all__ = ["TrainedShard", "install", "load_into", "check_on_device"]

_WHERE = "fxshard.parallelize"


class TrainedShard:
    """The trained value of one parameter: every held rank's shard under ``spec``."""

    def __init__(self, tm, fqn: str, spec: tuple, shape: tuple):
        self.tm, self.fqn, self.spec, self.shape = tm, fqn, spec, tuple(shape)
        self.copies: dict = {}     # rank -> (shard versions, copy) cut under another spec

    @property
    def device(self) -> torch.device:
        return next(iter(self.tm._shards.values()))[self.fqn].device

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.tm._shards.values()))[self.fqn].dtype

    def _versions(self) -> tuple:
        return tuple(m[self.fqn]._version for m in self.tm._shards.values())

    def block(self, spec: tuple, mesh, rank: int, shape: tuple | None = None
              ) -> torch.Tensor:
        """Rank ``rank``'s block under ``spec`` of the global ``shape`` (default: the
        training program's): its shard itself when both are the training ones, else a copy
        cut from the assembled whole (simulated mesh; a vocab the training program padded
        and the caller does not, or the other way round, is cut or padded first)."""
        shape = self.shape if shape is None else tuple(shape)
        if tuple(spec) == self.spec and shape == self.shape:
            return self.tm._shards[rank][self.fqn].detach()
        if not self.tm._simulated:
            raise NotImplementedError(
                f"{_WHERE}: {self.fqn} is placed {spec} by this inference program but "
                f"{self.spec} by training (mesh {mesh.describe()}); re-placing trained shards "
                f"across processes is not built. Run this input under grad (training "
                f"programs) or write the weights back with pm.state_dict()")
        whole = assemble([m[self.fqn].detach() for m in self.tm._shards.values()],
                         self.shape, self.spec, self.tm.spec)
        if shape != self.shape:        # the model's rows, padded as the caller's program
            model = self.tm._last.padded.get(self.fqn, self.shape)
            whole = pad_to(cut_to(whole, model), shape)
        copy = local_block(whole, spec, mesh, rank)
        self.copies[rank] = (self._versions(), copy)
        return copy

    def stale(self) -> bool:
        """A copy cut under another placement is older than the shards (an optimizer step)."""
        now = self._versions() if self.copies else None
        return any(v != now for v, _ in self.copies.values())


def install(store, tm, program) -> None:
    """Make ``tm``'s parameter shards the values of ``store`` (tied names share one)."""
    params = {n for n, _ in tm.model.named_parameters(remove_duplicate=False)}
    for fqn, spec in program.specs.items():
        if fqn in params:
            store.values[fqn] = TrainedShard(tm, fqn, tuple(spec), program.shapes[fqn])
    for other, kept in program.joint.tied.items():
        if kept in program.specs and isinstance(store.values.get(kept), TrainedShard):
            store.values[other] = store.values[kept]
    store.trained, store.load_trained = tm, load_into
    store.trained_sources = list({id(v): v for v in store.values.values()
                                  if isinstance(v, TrainedShard)}.values())
    store.rebind = True   # an inference program bound before reads the shards from now on


def load_into(tm, state_dict: dict) -> None:
    """Copy the whole tensors of ``state_dict`` into every held rank's shards, in place (the
    optimizer's references to ``pm.parameters()`` stay valid)."""
    for stage in getattr(tm, "stage_modules", ()):    # a pipeline: each stage's own shards
        if stage._shards is not None:
            load_into(stage, state_dict)
    if getattr(tm, "stage_modules", None) is not None:
        return
    with torch.no_grad():
        for rank, mine in tm._shards.items():
            for fqn, shard in mine.items():
                if fqn in state_dict:
                    value = state_dict[fqn]
                    padded = tm._last.shapes.get(fqn) if tm._last is not None else None
                    if hasattr(value, "block"):
                        value = value.block(tm._specs[fqn], tm.spec, rank, shape=padded)
                    elif padded is not None and tuple(value.shape) != tuple(padded):
                        # a vocab padded for tp: the model's rows, zeros after them
                        value = padded_block(value.detach().__getitem__, tuple(value.shape),
                                             tuple(padded), tm._specs[fqn], tm.spec, rank)
                    else:
                        value = local_block(value.detach().to(shard.device), tm._specs[fqn],
                                            tm.spec, rank)
                    shard.copy_(value)



def check_on_device(store, model) -> None:
    """Training a model built on the meta device (``fxshard.init_empty_weights()``) cuts its
    shards from what ``pm.load_state_dict`` / ``fxshard.load_safetensors`` loaded (each rank
    reads only its own blocks): raise unless every weight is loaded (what to load)."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if not meta:
        return
    from types import SimpleNamespace
    store.check_loaded([SimpleNamespace(slots=dict.fromkeys(store.internal))])
