"""A model whose ``state_dict()`` names its weights unlike its parameters: its hooks, followed.

torchtitan's fused attention projection is one parameter, ``wqkv``, that a state-dict post-hook
saves as ``wq`` / ``wk`` / ``wv`` and a load pre-hook fuses back. fxshard's programs read
parameters; users read and load state dicts. :func:`renaming` learns the two maps between them
from the model's own hooks, and the weight store translates at its edges (``pm.state_dict()``,
``pm.load_state_dict``, ``save_safetensors``, ``load_safetensors``, ``write_back``)::

    parameters (the programs')                  state dict (the model's, its hooks applied)
    layers.0.attention.qkv_linear.wqkv.weight   layers.0.attention.qkv_linear.wq.weight [64, 64]
        [n_kv * (q/kv + 2) * head_dim, 64]       layers.0.attention.qkv_linear.wk.weight [32, 64]
      = [128, 64]                               layers.0.attention.qkv_linear.wv.weight [32, 64]

How: each outermost module with a save hook (or its own ``_save_to_state_dict``) is copied
without its weights and given *probes*: every element of its parameters and buffers holds its
own number (float64, exact). Its ``state_dict()`` then says, element by element, where each
saved value comes from; its ``load_state_dict`` of numbered saved tensors says where each
parameter element is loaded from. A second probe with random values checks that the hooks only
move values (split, join, reshape, reorder: a gather), and the two maps must undo each other.
A map kept as a strided view of its sources (:func:`strided_form`) costs a few integers, not an
index per element. A hook that computes values (a scale, a cast), or a model whose own
``load_state_dict`` cannot take what its ``state_dict()`` gives, is a NotImplementedError
naming the module and the keys (at ``parallelize``, or at the load it makes impossible).
"""
from __future__ import annotations

import copy

import torch

__all__ = ["Gather", "Scatter", "Renaming", "model_tensors", "renaming", "strided_form"]

_WHERE = "fxshard.parallelize"
_BASE = torch.nn.Module


def _few(names, n: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _said(e: Exception) -> str:
    """An exception on one line, at most 300 characters of its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def strided_form(index: torch.Tensor) -> tuple[list[int], list[int], int] | None:
    """``(size, stride, offset)`` such that ``flat.as_strided(size, stride, offset)`` read in
    order is ``flat[index.reshape(-1)]``, or None (not a strided view with strides >= 0)."""
    cur = index.reshape(-1)
    sizes: list[int] = []
    strides: list[int] = []
    while cur.numel() > 1:
        step = int(cur[1] - cur[0])
        breaks = torch.nonzero(cur[1:] - cur[:-1] != step)
        run = int(breaks[0]) + 1 if breaks.numel() else cur.numel()
        if step < 0 or cur.numel() % run:
            return None
        rows = cur.view(-1, run)
        along = torch.arange(run, dtype=cur.dtype, device=cur.device) * step
        if not torch.equal(rows - rows[:, :1], along.expand_as(rows)):
            return None
        sizes.insert(0, run)
        strides.insert(0, step)
        cur = rows[:, 0]
    if cur.numel() == 0 or int(cur[0]) < 0:
        return None
    return sizes, strides, int(cur[0])


class Gather:
    """A tensor of ``shape`` made of elements of ``sources`` (names; their flattened values
    joined in this order): ``index`` (a strided view where possible) says which."""

    def __init__(self, sources: tuple, shape: tuple, index: torch.Tensor):
        self.sources, self.shape = tuple(sources), tuple(shape)
        form = strided_form(index)
        self.form = form
        self.index = None if form is not None else index.reshape(-1).clone()

    def identity_of(self) -> str | None:
        """The one source this gather copies unchanged, or None."""
        if len(self.sources) != 1 or self.form is None:
            return None
        size, stride, offset = self.form
        contiguous = [1] * len(size)
        for d in range(len(size) - 2, -1, -1):
            contiguous[d] = contiguous[d + 1] * size[d + 1]
        return self.sources[0] if offset == 0 and all(
            n == 1 or s == c for n, s, c in zip(size, stride, contiguous)) else None

    def apply(self, get) -> torch.Tensor:
        """The tensor, from ``get(name)`` -> each source's whole value."""
        parts = [get(n) for n in self.sources]
        flat = parts[0].reshape(-1) if len(parts) == 1 else \
            torch.cat([p.reshape(-1) for p in parts])
        flat = flat.contiguous()
        if self.form is None:
            out = flat[self.index.to(flat.device)]
        else:
            size, stride, offset = self.form
            out = flat.as_strided(size, stride, flat.storage_offset() + offset)
        return out.reshape(self.shape).clone()


class Scatter:
    """A tensor of ``shape`` whose strided views ``forms[k]`` are the sources (names): the
    inverse of strided :class:`Gather`\ s (a fused weight from its parts), no index kept."""

    def __init__(self, sources: tuple, shape: tuple, forms: list):
        self.sources, self.shape, self.forms = tuple(sources), tuple(shape), forms

    def identity_of(self) -> None:
        return None

    def apply(self, get) -> torch.Tensor:
        parts = [get(n) for n in self.sources]
        out = torch.empty(self.shape, dtype=parts[0].dtype, device=parts[0].device)
        for part, (size, stride, offset) in zip(parts, self.forms):
            out.as_strided(size, stride, offset).copy_(part.reshape(size))
        return out


def _as_scatter(name: str, g: Gather, save: dict) -> Scatter | None:
    """``g`` (loading ``name``) as the inverse of the strided save gathers of its sources."""
    forms = []
    for s in g.sources:
        sg = save.get(s)
        if sg is None or sg.sources != (name,) or sg.form is None:
            return None
        forms.append(sg.form)
    return Scatter(g.sources, g.shape, forms)


class Rearranged:
    """A parameter loaded lazily from checkpoint sources by a :class:`Gather`: a rank's block
    reads the sources whole, gathers the parameter, and cuts the block."""

    fresh_blocks = True

    def __init__(self, gather: Gather, sources: dict, dtype: torch.dtype):
        self.gather, self.sources, self.dtype = gather, sources, dtype
        self.shape = gather.shape

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def whole(self) -> torch.Tensor:
        from .mesh import TP, MeshSpec
        from .placement import R
        one = MeshSpec((1,), (TP,))

        def read(name):
            s = self.sources[name]
            return s.block((R,), one, 0) if hasattr(s, "block") else s.detach()
        return self.gather.apply(read).to(self.dtype)

    def block(self, spec: tuple, mesh, rank: int, shape: tuple | None = None) -> torch.Tensor:
        from .placement import local_block, padded_block
        whole = self.whole()
        if shape is not None and tuple(shape) != tuple(whole.shape):
            return padded_block(whole.__getitem__, tuple(whole.shape), tuple(shape), spec,
                                mesh, rank)
        return local_block(whole, spec, mesh, rank)


class Renaming:
    """The two maps between a model's parameter names (``internal``: parameters and persistent
    buffers, ``{name: (shape, dtype)}``) and its state dict's (``saved``, in
    ``state_dict()``'s order): ``save[saved name]`` and ``load[internal name]`` are
    :class:`Gather`\\ s; a name in neither is the same in both. ``load_error``: why the model's
    own ``load_state_dict`` cannot take its state dict (raised at a load), or None."""

    def __init__(self, internal: dict, saved: dict, save: dict, load: dict,
                 load_error: str | None, model_name: str):
        self.internal, self.saved = internal, saved
        self.save, self.load = save, load
        self.load_error, self.model_name = load_error, model_name

    def to_saved(self, values: dict) -> dict:
        """``{saved name: tensor}`` in ``state_dict()``'s order from ``{internal name:
        tensor}`` (whole tensors)."""
        out = {}
        for name in self.saved:
            g = self.save.get(name)
            if g is None:
                if name in values:
                    out[name] = values[name]
            elif all(s in values for s in g.sources):
                out[name] = g.apply(values.__getitem__)
        return out

    def to_internal(self, values: dict, where: str) -> dict:
        """``{internal name: tensor or lazy source}`` from the state dict ``values`` (every
        saved name; other keys, such as non-persistent buffers, pass through)."""
        if self.load_error is not None:
            raise NotImplementedError(f"{where}: {self.load_error}")
        out = {k: v for k, v in values.items() if k not in self.saved or k in self.internal
               and k not in self.load}
        for name, g in self.load.items():
            srcs = {s: values[s] for s in g.sources}
            dtype = self.internal[name][1]
            if all(isinstance(v, torch.Tensor) for v in srcs.values()):
                out[name] = g.apply(lambda s: srcs[s].detach()).to(dtype)
            else:
                out[name] = Rearranged(g, srcs, dtype)
        return out


def _hooked(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules whose state dict is written by a hook or their own
    ``_save_to_state_dict`` (their names' prefixes)."""
    out = []
    for name, m in model.named_modules():
        if any(name == p or name.startswith(p + ".") if p else True for p, _ in out):
            continue
        if m._state_dict_hooks or m._state_dict_pre_hooks or \
                type(m)._save_to_state_dict is not _BASE._save_to_state_dict:
            out.append((name, m))
    return out


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied names each), as the programs see them."""
    out = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for leaf, t in m._parameters.items():
            if t is not None:
                out[f"{mname}.{leaf}" if mname else leaf] = t
        for leaf, t in m._buffers.items():
            if t is not None and leaf not in m._non_persistent_buffers_set:
                out[f"{mname}.{leaf}" if mname else leaf] = t
    return out


def _with_probes(module: torch.nn.Module, probes: dict) -> torch.nn.Module:
    """A copy of ``module`` (no weights copied) holding ``probes`` as its parameters and
    persistent buffers."""
    memo = {id(t): torch.empty(t.shape, dtype=t.dtype, device="meta")
            for m in module.modules() for t in [*m._parameters.values(), *m._buffers.values()]
            if t is not None}
    clone = copy.deepcopy(module, memo)
    for mname, m in clone.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for leaf in list(table):
                name = f"{mname}.{leaf}" if mname else leaf
                if name in probes:
                    table[leaf] = probes[name]
    return clone


def _numbered(shapes: dict) -> tuple[dict, list]:
    """Float64 tensors numbering every element of ``shapes`` in turn, and ``(name, first,
    count)`` per name."""
    out, spans, start = {}, [], 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        out[name] = torch.arange(start, start + n, dtype=torch.float64,
                                 device="cpu").reshape(shape)
        spans.append((name, start, n))
        start += n
    return out, spans


def _gathers(results: dict, spans: list, total: int, what: str) -> dict:
    """``{name: Gather}`` from tensors holding element numbers (``results``)."""
    out = {}
    owner = torch.empty(total, dtype=torch.long, device="cpu")
    for k, (_, first, n) in enumerate(spans):
        owner[first:first + n] = k
    for name, got in results.items():
        if not _numbers(got, total):
            raise ValueError(f"{what} {name!r} holds values no weight element had")
        ids = got.detach().reshape(-1).long()
        used = sorted(set(owner[ids].tolist())) if ids.numel() else []
        base, local = 0, torch.empty_like(ids)
        for k in used:
            _, first, n = spans[k]
            mask = (ids >= first) & (ids < first + n)
            local[mask] = ids[mask] - first + base
            base += n
        out[name] = Gather(tuple(spans[k][0] for k in used), tuple(got.shape), local)
    return out


def _numbers(t: torch.Tensor, total: int) -> bool:
    """``t`` holds element numbers (whole numbers in ``[0, total)``) in float64."""
    t = t.detach()
    return t.dtype == torch.float64 and (not t.numel() or bool(
        torch.equal(t, t.round()) and t.min() >= 0 and t.max() < total))


def _check_moves(g: Gather, random: dict, got: torch.Tensor) -> bool:
    want = g.apply(lambda s: random[s])
    return tuple(got.shape) == tuple(want.shape) and torch.equal(got.detach(), want)


def _probe(prefix: str, module: torch.nn.Module, model_name: str):
    """This module's save and load :class:`Gather`\\ s (names without ``prefix``) and why
    loading cannot be followed (or None)."""
    where = f"{_WHERE}: {model_name}'s module {prefix or '(the model)'} " \
            f"({type(module).__name__})"
    tensors = model_tensors(module)
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    numbered, spans = _numbered(shapes)
    total = sum(n for _, _, n in spans)
    fix = ("Its hooks must only rename, split, join, reshape or reorder weights (as "
           "torchtitan's fused wqkv does); build the model without them (torchtitan: "
           "fuse_qkv=False) or remove the hook before parallelize")
    try:
        with torch.no_grad():
            saved = _with_probes(module, numbered).state_dict()
        saved = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    except Exception as e:  # noqa: BLE001 - the model's own hook, whatever it raises
        raise NotImplementedError(f"{where} saves its state dict through code fxshard cannot "
                                  f"follow ({_said(e)}). {fix}") from e
    computed = [k for k, v in saved.items() if not _numbers(v, total)]
    if computed:
        raise NotImplementedError(f"{where} computes the values of {_few(computed)} in its "
                                  f"state dict, not only their names and layout. {fix}")
    save = _gathers(saved, spans, total, "its state dict's")
    random = {k: torch.randn(s, dtype=torch.float64, device="cpu",
                              generator=torch.Generator().manual_seed(len(k)))
              for k, s in shapes.items()}
    with torch.no_grad():
        again = _with_probes(module, random).state_dict()
    changed = [k for k, g in save.items() if not _check_moves(g, random, again[k])]
    if changed:
        raise NotImplementedError(f"{where} computes the values of {_few(changed)} in its state "
                                  f"dict, not only their names and layout. {fix}")
    saved_shapes = {k: tuple(v.shape) for k, v in saved.items()}
    load, error = _probe_load(module, shapes, saved_shapes, save, where)
    return save, load, error, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}


def _probe_load(module, shapes: dict, saved_shapes: dict, save: dict, where: str):
    numbered, spans = _numbered(saved_shapes)
    total = sum(n for _, _, n in spans)
    why = (f"{where.split(': ', 1)[1]}: its own load_state_dict cannot take what its "
           f"state_dict() gives")
    targets = {k: torch.full(s, -1.0, dtype=torch.float64, device="cpu") for k, s in shapes.items()}
    try:
        with torch.no_grad():
            _with_probes(module, targets).load_state_dict(numbered, strict=True)
        load = _gathers(targets, spans, total, "its loaded parameter")
    except Exception as e:  # noqa: BLE001 - the model's own hook, whatever it raises
        return {}, (f"{why} ({_said(e)}); add a load hook that undoes the save hook, or "
                    f"build the model without the renaming hook")
    # loading what saving wrote must give every parameter back
    numbered_internal, _ = _numbered(shapes)
    saved_now = {k: (save[k].apply(numbered_internal.__getitem__) if k in save
                     else numbered_internal[k]) for k in saved_shapes}
    wrong = [k for k, g in load.items()
             if not torch.equal(g.apply(saved_now.__getitem__), numbered_internal[k])]
    if wrong:
        return {}, (f"{why}: loading its state dict does not give {_few(wrong)} back (its "
                    f"load hook does not undo its save hook)")
    for k, g in list(load.items()):   # no index per element where the save maps are views
        scatter = _as_scatter(k, g, save) if g.form is None else None
        if scatter is not None and torch.equal(scatter.apply(saved_now.__getitem__),
                                               numbered_internal[k]):
            load[k] = scatter
    return load, None


def renaming(model: torch.nn.Module) -> Renaming | None:
    """The model's state-dict names and how they map to its parameters, or None where
    ``state_dict()`` names exactly its parameters and persistent buffers (nearly every model:
    no probe runs then)."""
    internal = {k: (tuple(t.shape), t.dtype) for k, t in model_tensors(model).items()}
    state = model.state_dict(keep_vars=True)
    saved = {k: (tuple(v.shape), v.dtype) for k, v in state.items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    if set(saved) == set(internal):
        return None
    name = type(model).__name__
    save, load, errors = {}, {}, []
    probed_internal, probed_saved = set(), set()
    for prefix, module in _hooked(model):
        p = f"{prefix}." if prefix else ""
        s, ld, error, _ = _probe(prefix, module, name)
        save.update({p + k: g for k, g in s.items()})
        load.update({p + k: g for k, g in ld.items()})
        for g in list(s.values()) + list(ld.values()):
            g.sources = tuple(p + x for x in g.sources)
        if error:
            errors.append(error)
        probed_internal |= {p + k for k in model_tensors(module)}
        probed_saved |= {p + k for k in s}
    same = set(internal) - probed_internal
    if same != set(saved) - probed_saved:
        unsaved = sorted(set(internal) - set(saved) - probed_internal)
        renamed = sorted(set(saved) - set(internal) - probed_saved)
        raise NotImplementedError(
            f"{_WHERE}: {name}.state_dict() names its weights unlike its parameters "
            f"({_few(unsaved, 2) or 'nothing'} saved as {_few(renamed, 3) or 'nothing'}) "
            f"outside any module with a state-dict hook fxshard could follow (a hook on a "
            f"module renaming its parent's keys?). Build the model without the renaming, or "
            f"remove the hook before parallelize")
    save = {k: g for k, g in save.items() if g.identity_of() != k}
    load = {k: g for k, g in load.items() if g.identity_of() != k}
    return Renaming(internal, saved, save, load,
                    errors[0] if errors else None, name)
