"""The weights a ParallelModule's rank programs are sliced from, and what changed since.

``WeightStore(model, spec)`` holds one global value per FQN: the model's own tensors (its state
dict and its non-persistent buffers), replaced by what ``load_state_dict`` loads (a tensor, or a
checkpoint source with ``block(spec, mesh, rank)`` that reads only a rank's slice). Each rank
module holds its blocks of these values (:func:`fxshard.passes.emit.build_rank_module`).

:class:`WeightWatch` notices when the user changes the model after ``parallelize`` (an in-place
update, ``model.load_state_dict``, a reassigned ``Parameter``); :meth:`WeightStore.sync` takes
those tensors and says whether the programs must be re-sliced or retraced, so the ranks never
compute with stale weights.
"""
from __future__ import annotations

import operator

import torch

from ..checks import check_state_dict_values
from ..mesh import MeshSpec
from ..placement import R
from ..state_dict_hooks import model_tensors, renaming
from ..weights import non_persistent_buffers

__all__ = ["WeightStore", "WeightWatch", "check_model_unchanged", "full_state_dict"]

_WHERE = "fxshard.parallelize"


_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


class WeightWatch:
    """Remembers each parameter and buffer of ``model`` (its identity, ``_version`` and
    ``data_ptr``) and reports the FQNs whose tensor was replaced, re-pointed (``p.data = t``,
    ``model.half()``) or modified in place since the last :meth:`changed` call.

    torch keeps no version counter over a set of tensors, so every call reads each tensor's:
    identity, ``_version`` and ``data_ptr`` in three C-level passes (``map``) over the slots,
    ~0.2 us per tensor (18 us of CPU for 96 tensors on a busy 2-core CPU, 22 us with the
    per-tensor tuples it replaced), once per forward; the per-FQN comparison runs only when
    one of them differs."""

    def __init__(self, model: torch.nn.Module):
        self._fqns, self._tables, self._leaves, self._tensors = [], [], [], []
        for mname, module in model.named_modules(remove_duplicate=False):
            for table in (module._parameters, module._buffers):
                for leaf, t in table.items():
                    if t is not None:
                        self._fqns.append(f"{mname}.{leaf}" if mname else leaf)
                        self._tables.append(table)
                        self._leaves.append(leaf)
                        self._tensors.append(t)
        self._remember(self._tensors)

    def __len__(self) -> int:
        return len(self._fqns)

    def _remember(self, tensors: list) -> None:
        # _version: in-place ops; data_ptr: `p.data = t`, model.to(dtype/device) (same
        # Parameter, new storage). An in-place write through `p.data` changes neither.
        self._tensors = tensors
        self._complete = all(isinstance(t, torch.Tensor) for t in tensors)
        self._versions = [t._version if t is not None else -1 for t in tensors]
        self._ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]

    def _same(self, now: list) -> bool:
        """Whether ``now`` are the remembered tensors, unmodified (the per-call check)."""
        if not all(map(operator.is_, now, self._tensors)):
            return False
        if self._complete:   # every slot holds a tensor: no per-item None test needed
            return list(map(_VERSION, now)) == self._versions and \
                list(map(_DATA_PTR, now)) == self._ptrs
        return [t._version if t is not None else -1 for t in now] == self._versions and \
            [t.data_ptr() if t is not None else 0 for t in now] == self._ptrs

    def changed(self) -> dict[str, torch.Tensor]:
        """``{fqn: current tensor}`` for every entry changed since the last call."""
        now = list(map(dict.get, self._tables, self._leaves))
        if self._same(now):
            return {}
        old_tensors, old_versions, old_ptrs = self._tensors, self._versions, self._ptrs
        self._remember(now)
        return {f: t for f, t, old, v, w, p, q in zip(
                    self._fqns, now, old_tensors, self._versions, old_versions, self._ptrs,
                    old_ptrs) if t is not old or v != w or p != q}


class WeightStore:
    """FQN -> global value of every weight slot, the shapes and dtypes the trace expects, and
    the watch on the model's own tensors.

    ``values``: FQN -> tensor or checkpoint source; ``expected``: FQN -> (shape, dtype) of the
    state dict's entries; ``non_persistent``: the same for the buffers no state dict holds;
    ``buffer_fqns``: every buffer's FQN (a changed buffer may have been folded by the trace).

    A model whose state dict renames its weights (``renaming``: torchtitan's fused ``wqkv``
    saved as ``wq`` / ``wk`` / ``wv``, :mod:`fxshard.state_dict_hooks`) keeps ``values`` by
    parameter name (``internal``: their shapes and dtypes), as the programs read them, and
    ``expected`` by the state dict's; :meth:`load` and :meth:`state_dict` translate. For every
    other model ``internal`` is ``expected``."""

    def __init__(self, model: torch.nn.Module, spec: MeshSpec):
        self.spec = spec
        self.renaming = renaming(model)
        if self.renaming is None:
            self.values: dict = dict(model.state_dict(keep_vars=True))
            self.expected = {k: (tuple(v.shape), v.dtype) for k, v in self.values.items()}
            self.internal = self.expected
        else:
            self.values = dict(model_tensors(model))
            self.expected = dict(self.renaming.saved)
            self.internal = dict(self.renaming.internal)
        extra = non_persistent_buffers(model)  # in no state dict or checkpoint
        self.non_persistent = {k: (tuple(v.shape), v.dtype) for k, v in extra.items()}
        self.values.update(extra)
        self.buffer_fqns = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self.watch = WeightWatch(model)
        # the TrainModule whose shards are the parameters' values once training started
        # (fxshard.training.shards): the model object is no longer the truth then
        self.trained = None
        # set with ``trained``: load_trained(trained, state_dict) copies whole tensors into
        # its shards in place (training passes it in: the store imports nothing of training)
        self.load_trained = None
        self.trained_sources: list = []
        # set when training's shards become the values: every program bound before (an
        # inference call ahead of training) holds slices of the old values and is re-bound
        self.rebind = False
        self.edited: dict = {}     # model tensors changed after training started (an error)

    def sync(self) -> bool | None:
        """Take the model's tensors that changed since the last call (in place, reloaded,
        reassigned, cast). None: nothing changed; else whether the programs must be retraced
        (a new dtype or shape, or a changed buffer: a mask the trace may have folded) rather
        than only re-sliced."""
        changed = self.watch.changed()
        if not changed and self.trained is None:
            return None
        changed = {k: v for k, v in changed.items() if v is not None and v.device.type != "meta"}
        if self.trained is not None:
            self.edited.update(changed)     # an error on every call till loaded or written
            check_model_unchanged(self.edited)
            rebind, self.rebind = self.rebind, False
            if rebind or self.stale_copies():
                return False
        if not changed:
            return None
        self.values.update(changed)
        return self._needs_retrace(changed)

    def seen(self) -> None:
        """The model's own tensors as they are now count as seen (not a change)."""
        self.watch.changed()
        self.edited = {}

    def stale_copies(self) -> bool:
        """A trained parameter an inference program places unlike training holds a copy
        (:class:`fxshard.training.shards.TrainedShard`) older than the shards."""
        return any(v.copies and v.stale() for v in self.trained_sources)

    def _needs_retrace(self, values: dict) -> bool:
        """A changed buffer, dtype or shape needs a new trace; records the new dtypes/shapes."""
        retrace = False
        for k, v in values.items():
            table = self.internal if k in self.internal else self.non_persistent
            now = (tuple(v.shape), v.dtype)
            retrace |= k in self.buffer_fqns or table.get(k) != now
            table[k] = now
        return retrace

    def record_constants(self, constants: dict) -> None:
        """The values of the constants a trace found (tensors the model holds outside its
        state dict), for the slots that have none yet."""
        for fqn, value in constants.items():
            if value is not None:
                self.values.setdefault(fqn, value)

    def buffer_values(self) -> dict:
        """The buffers' values as loaded (a checkpoint's read whole: buffers are small)."""
        out = {}
        for fqn in self.buffer_fqns:
            v = self.values.get(fqn)
            if hasattr(v, "block"):
                v = v.block((R,) * len(self.spec.shape), self.spec, 0)
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                out[fqn] = v
        return out

    def check_loaded(self, programs: list) -> None:
        """Raise unless every weight slot of ``programs`` has a value (not an empty meta
        tensor): what to load, and how."""
        empty = [fqn for p in programs for fqn, slot in p.slots.items()
                 if self.values.get(fqn) is None or self.values[fqn].device.type == "meta"
                 and not hasattr(self.values[fqn], "block")]
        if not empty:
            return
        buffers = [f for f in empty if f in self.non_persistent]
        weights = [f for f in empty if f not in self.non_persistent]
        also = (f"; the weights are not loaded either ({weights[0]!r} and {len(weights) - 1} "
                f"more): call pm.load_state_dict(full_state_dict) or "
                f"fxshard.load_safetensors(pm, path)") if weights else ""
        if buffers:
            raise ValueError(
                f"{_WHERE}: the non-persistent buffers {buffers[:4]}"
                f"{' ...' if len(buffers) > 4 else ''} are on the meta device and no checkpoint "
                f"holds them (state_dict() leaves them out). Build the model under "
                f"fxshard.init_empty_weights() instead of torch.device('meta') so its "
                f"constructor computes them, or pass them by name to pm.load_state_dict{also}")
        raise ValueError(f"{_WHERE}: the model was built on the meta device and has no "
                         f"weights yet ({weights[0]!r} and {len(weights) - 1} more are empty); "
                         f"call pm.load_state_dict(full_state_dict) or "
                         f"fxshard.load_safetensors(pm, path) before running it")

    def load(self, state_dict: dict) -> bool:
        """Check and take the unsharded model's state dict (see
        :meth:`fxshard.ParallelModule.load_state_dict`); returns whether the programs must be
        retraced (a buffer was loaded: the trace may have folded it)."""
        check_state_dict_values("ParallelModule.load_state_dict", state_dict)
        missing = sorted(set(self.expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.expected) - set(self.non_persistent))
        if missing or unexpected:
            raise ValueError(
                f"ParallelModule.load_state_dict: the state dict does not match the model: "
                f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                f"keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}. Pass the "
                f"unsharded model's state_dict() with the same parameter names.")
        for k, (shape, _) in {**self.non_persistent, **self.expected}.items():
            if k not in state_dict:
                continue
            got = tuple(state_dict[k].shape)
            if got != shape:
                raise ValueError(
                    f"ParallelModule.load_state_dict: {k!r} has shape {got} but the model "
                    f"expects {shape}; load a checkpoint of the same configuration")
        if self.renaming is not None:   # the model's own load hooks, followed
            state_dict = self.renaming.to_internal(state_dict, "ParallelModule.load_state_dict")
        if self.trained is not None:   # the trained shards take the values, in place
            self.load_trained(self.trained, state_dict)
            state_dict = {k: v for k, v in state_dict.items()
                          if not hasattr(self.values.get(k), "stale")}
        self.values.update(state_dict)
        self.seen()
        return any(k in self.buffer_fqns for k in state_dict)


def full_state_dict(store: WeightStore) -> dict:
    """``pm.state_dict()``: whole tensors by the state dict's names (the model's hooks
    followed), the trained shards' values once training started (assembled; a real mesh:
    gathered, so every rank must call it)."""
    out = {}
    for k in store.internal:
        v = store.values.get(k)
        out[k] = v.block((R,) * len(store.spec.shape), store.spec, 0) \
            if hasattr(v, "block") and not hasattr(v, "stale") else v
    if store.trained is not None:
        out.update({k: v for k, v in store.trained.state_dict().items() if k in out})
    out = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out if store.renaming is None else store.renaming.to_saved(out)


def check_model_unchanged(changed: dict) -> None:
    """Raise for a change to the model object after training started (its weights are no
    longer what the programs compute with: the trained shards are)."""
    if changed:
        names = sorted(changed)
        raise ValueError(
            f"{_WHERE}: the model's {names[:3]}{' ...' if len(names) > 3 else ''} changed "
            f"after training started; the trained shards, not the model object, are the "
            f"weights now (the model keeps its initial ones). To set new weights, call "
            f"pm.load_state_dict(state_dict) (copies into the shards in place; the optimizer "
            f"keeps working); to copy the trained weights into the model, "
            f"model.load_state_dict(pm.state_dict()) and parallelize it again")
