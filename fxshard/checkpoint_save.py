"""Saving an HF-layout safetensors checkpoint from a parallelized or training module.

``save_safetensors(module, directory, max_shard_size="5GB")`` writes::

    directory/model.safetensors.index.json        {"metadata": {"total_size": ...},
                                                   "weight_map": {name: file}}
    directory/model-00001-of-00003.safetensors    whole tensors, HF's names and layout
    ...
    directory/config.json                         an HF model's config (and
                                                  generation_config.json), as save_pretrained

which ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` and
``fxshard.load_safetensors(pm, directory)`` (any mesh) read. Tied weights are written once, under
the first name the model gives them (``model.embed_tokens.weight``; ``lm_head.weight`` is left
out), as HuggingFace saves them.

What is written: for a :class:`fxshard.ParallelModule`, its weights as loaded (the values its
rank programs are sliced from); for a :class:`fxshard.training.TrainModule`, the trained shards,
assembled (the model's persistent buffers as they are).

Design (memory): every file holds whole tensors (HF's format: one tensor per name). The plan,
which tensor goes to which file, follows from names, shapes and dtypes alone, so every rank
computes the same plan without talking. File ``k`` is written by rank ``k mod world``; that rank
writes the header first (offsets from shapes), then each tensor's bytes in turn, so it holds
one whole tensor at a time. A ParallelModule's weights as loaded are whole values on every
process (the model's tensors, or checkpoint sources read whole one tensor at a time), so its
writers need no messages. A training module's tensor is assembled one at a time by its
file's writer: on a simulated mesh from every rank's shard in this process; on a real mesh
(``torchrun``) the owners of its blocks (the coordinate-0 replica of each slice) send them to
the writer, which assembles and writes it, so a rank's peak is its own shards plus one whole
tensor. Rank 0 writes the index last. All of it goes to a temporary sibling of ``directory``,
switched in by rank 0 once every rank reported its files complete (:mod:`fxshard.atomic_dir`;
a write that fails is reported then, and every rank raises). A module trained on ``pp``: each
stage's shards are kept by the stage's ranks (on the mesh without ``pp``); under ``torchrun``
a process knows only its own stages', so the stages first tell each other along ``pp`` which
parameters they hold (name, placement, shape, dtype, pp coordinate: one object all-gather),
and every rank then has the same plan, each block sent by the rank of its stage that keeps
it.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re

import torch

from .mesh import PP, is_simulated
from .placement import Replicate, add_block, cut_to

__all__ = ["save_safetensors"]

_WHERE = "fxshard.save_safetensors"
INDEX = "model.safetensors.index.json"
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def shard_size_bytes(size) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"`` / ``"500MiB"`` as HF spells it."""
    if isinstance(size, int) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{_WHERE}: max_shard_size={size!r}; give bytes (an int > 0) or a "
                         f"string such as '5GB', '200MB' or '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


class _Entry:
    """One tensor of the checkpoint: its name, global shape and dtype, and how to get it."""

    def __init__(self, name, shape, dtype, whole=None, shards=None, mesh=None, stage=None,
                 padded=None, derived=None):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        # the shards' global shape where it pads the model's (a vocab padded for tp)
        self.padded = tuple(padded) if padded is not None else self.shape
        self.whole = whole        # () -> the whole tensor (a weight as loaded)
        self.shards = shards      # (spec, {rank: block getter}) of a trained parameter
        self.mesh = mesh          # the mesh of spec's ranks (a pipeline stage's), else None
        self.stage = stage        # with mesh: the stage's pp coordinate
        # (gather, [entries]): a tensor the model's state-dict hook makes of parameters
        # (fxshard.state_dict_hooks): those entries, whole, gathered
        self.derived = derived

    def holders(self, whole_mesh) -> list[tuple[int, int]]:
        """``(rank on the saved module's mesh, rank the block is kept by)`` of every block
        that makes up the tensor (a stage's ranks: on its mesh without ``pp``)."""
        spec = self.shards[0]
        if self.stage is None:
            return [(r, r) for r in _owners(spec, whole_mesh)]
        at = whole_mesh.axis_names.index(PP)
        out = []
        for r in _owners(spec, self.mesh):
            coords = list(self.mesh.coords(r))
            coords[at] = self.stage
            out.append((whole_mesh.rank_of(coords), r))
        return out

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _entries(module) -> list[_Entry]:
    """The checkpoint's tensors by the state dict's names (the model's hooks followed)."""
    from .state_dict_hooks import renaming
    from .training import TrainModule
    if isinstance(module, TrainModule):
        return _saved_names(_train_entries(module), renaming(module.model))
    if not hasattr(module, "weights") or not hasattr(module, "tied_names"):
        raise TypeError(f"{_WHERE}: expected a ParallelModule (fxshard.parallelize) or a "
                        f"TrainModule (fxshard.training.parallelize_for_training), got "
                        f"{type(module).__name__}")
    module.programs.sync_weights()   # the model's own changes since the last call
    return _saved_names(_parameter_entries(module), module.weights.renaming)


def _saved_names(entries: list[_Entry], names) -> list[_Entry]:
    """``entries`` (by parameter name) as the state dict names them: a tensor a state-dict
    hook makes of parameters (``names``: a :class:`fxshard.state_dict_hooks.Renaming`) is
    derived from their entries."""
    if names is None:
        return entries
    by = {e.name: e for e in entries}
    out = []
    for name, (shape, dtype) in names.saved.items():
        g = names.save.get(name)
        if g is None:
            if name in by:
                out.append(by[name])
        elif all(s in by for s in g.sources):
            out.append(_Entry(name, shape, dtype, derived=(g, [by[s] for s in g.sources])))
    return out


def _parameter_entries(module) -> list[_Entry]:
    store, out = module.weights, []
    if store.trained is not None:    # training placed shards: they are the weights now
        return _trained_entries(module, store.trained)
    dropped = _tied_duplicates(module.model)
    for name, (shape, dtype) in store.internal.items():
        if name in dropped:
            continue
        value = store.values[name]
        if getattr(value, "device", None) is not None and value.device.type == "meta" \
                and not hasattr(value, "block"):
            raise ValueError(f"{_WHERE}: {name!r} has no value (the model was built on the "
                             f"meta device and nothing is loaded); load weights first")
        out.append(_Entry(name, shape, dtype, whole=lambda v=value, s=shape: _read_whole(v, s)))
    return out


def _read_whole(value, shape) -> torch.Tensor:
    if hasattr(value, "whole"):   # loaded through the model's hooks (state_dict_hooks)
        return value.whole()
    if hasattr(value, "block"):   # a checkpoint source: read the tensor whole
        from safetensors import safe_open
        with safe_open(value.file, framework="pt") as f:
            return f.get_tensor(value.key).to(value.dtype)   # (read as the model's dtype)
    return value.detach()


def _tied_duplicates(model: torch.nn.Module) -> set[str]:
    """Every name of a tied parameter but the first (HF saves a tied weight once)."""
    seen, dropped = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        (dropped.add(name) if id(p) in seen else seen.add(id(p)))
    return dropped


def _train_entries(tm, mesh=None) -> list[_Entry]:
    """Every tensor of ``tm``'s model: a trained parameter by its shards (``mesh``: the mesh
    the shards' ranks belong to, when it is not the saved module's), the rest as it is."""
    from .state_dict_hooks import model_tensors
    program = tm._require("save_safetensors")
    dropped = _tied_duplicates(tm.model)
    out = []
    values = tm.model.state_dict(keep_vars=True)
    if set(values) != set(model_tensors(tm.model)):   # a state-dict hook renames: by parameter
        values = model_tensors(tm.model)
    for name, value in values.items():
        if name in dropped:
            continue
        spec = tm._specs.get(name)
        held = {r: tm._shards[r][name] for r in tm.ranks if name in tm._shards[r]}
        if spec is None or not held or not isinstance(held[tm.ranks[0]], torch.nn.Parameter):
            out.append(_Entry(name, value.shape, value.dtype,
                              whole=lambda v=value: v.detach()))
            continue
        out.append(_Entry(name, value.shape, value.dtype,
                          shards=(spec, {r: (lambda b=b: b.detach()) for r, b in held.items()}),
                          mesh=mesh, padded=program.shapes[name]))
    return out


def _trained_entries(module, trainer) -> list[_Entry]:
    """A ParallelModule that trained: its trainer's shards (a pipeline: each stage's own, a
    parameter taken from the stage that holds it)."""
    stages = getattr(trainer, "stage_modules", None)
    if stages is None:
        return _train_entries(trainer)
    trainer._require("save_safetensors")
    found: dict = {}
    for k, tm in enumerate(stages):
        if tm._last is None:      # a real mesh: a stage another process holds
            continue
        for e in _train_entries(tm, mesh=tm.spec):
            if e.shards is not None or e.name not in found:   # a stage's shards win
                e.stage = k % trainer.pp
                found[e.name] = e
    if not is_simulated(module.mesh):
        _stages_elsewhere(module.mesh, trainer.sub, found)
    order = [n for n in module.weights.internal if n in found]
    return [found[n] for n in order]


def _stages_elsewhere(device_mesh, sub, found: dict) -> None:
    """A pipeline on a real mesh: each process knows its own stages' shards (every other
    parameter it lists whole, as the model has it: stale). The stages tell each other along
    ``pp`` which parameters they hold (name, placement, shape, dtype, pp coordinate); another
    stage's parameter becomes an entry whose blocks its holders send to the file's writer."""
    import torch.distributed as dist
    group = device_mesh.get_group(PP)
    mine = [(e.name, e.shards[0], e.shape, e.dtype, e.stage)
            for e in found.values() if e.shards is not None]
    told = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, mine, group=group)
    for held in told:
        for name, spec, shape, dtype, stage in held:
            if found.get(name) is None or found[name].shards is None:
                found[name] = _Entry(name, shape, dtype, shards=(spec, {}), mesh=sub,
                                     stage=stage)


def _plan(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Entries in order, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    files, size = [[]], 0
    for e in entries:
        if files[-1] and size + e.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _owners(spec: tuple, mesh) -> list[int]:
    """The ranks whose blocks make up the whole tensor: coordinate 0 of every axis the spec
    replicates (a Partial axis: every coordinate, their blocks summed)."""
    return [r for r in range(mesh.world_size)
            if all(c == 0 or n == 1 or not isinstance(p, Replicate)
                   for n, c, p in zip(mesh.shape, mesh.coords(r), spec))]


def _assemble_local(e: _Entry, mesh) -> torch.Tensor:
    spec, getters = e.shards
    mesh = e.mesh or mesh
    out = torch.zeros(e.padded, dtype=e.dtype, device=torch.device("cpu"))
    for r in _owners(spec, mesh):
        add_block(out, getters[r](), spec, mesh, r)
    return cut_to(out, e.shape)


def _header(entries: list[_Entry]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        if e.dtype not in _CODES:
            raise ValueError(f"{_WHERE}: {e.name!r} has dtype {e.dtype}, which safetensors "
                             f"cannot hold (supported: {sorted(map(str, _CODES))})")
        header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # safetensors aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw


def _write_bytes(fh, t: torch.Tensor, e: _Entry) -> None:
    if tuple(t.shape) != e.shape or t.dtype != e.dtype:
        raise AssertionError(f"{_WHERE}: {e.name} came out {tuple(t.shape)} {t.dtype}, "
                             f"expected {e.shape} {e.dtype}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        fh.write(flat.view(torch.uint8).numpy().tobytes())


def _save_config(model, directory: str) -> list[str]:
    """An HF model's ``config.json`` (with ``architectures``, as ``save_pretrained`` writes it)
    and ``generation_config.json`` beside the weights, so ``from_pretrained(directory)``
    reads the checkpoint alone; nothing for a model without an HF config. Returns the
    names written."""
    written = []
    for attr, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
        cfg = getattr(model, attr, None)
        if cfg is None or not callable(getattr(cfg, "save_pretrained", None)):
            continue
        if attr == "config":
            cfg = copy.deepcopy(cfg)
            cfg.architectures = [type(model).__name__]
        cfg.save_pretrained(directory)
        written.append(name)
    return written


def _owned(name: str) -> bool:
    """A file of an HF safetensors save (what ``from_pretrained`` could read as the weights):
    a new save leaves none of an older one's beside its own."""
    return _WEIGHTS.fullmatch(name) is not None


_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def save_safetensors(module, directory: str, *, max_shard_size="5GB") -> list[str]:
    """Write ``module``'s weights to ``directory`` as an HF checkpoint (see the module
    docstring); returns the files this process wrote. ``max_shard_size``: bytes per file
    (an int or ``"5GB"``-style string; a larger tensor gets a file to itself).

    The checkpoint is written into a temporary sibling directory and switched in when every
    file is complete (:mod:`fxshard.atomic_dir`): a save that fails leaves ``directory`` as it
    was and raises an OSError naming the file; the weights files of an older save are
    replaced, the directory's other files (a tokenizer) kept. On real ranks every rank must
    call it."""
    from .atomic_dir import replacing
    from .runtime.agreement import together
    limit = shard_size_bytes(max_shard_size)
    simulated = is_simulated(module.mesh)
    if not simulated:
        together(module.mesh, _WHERE, "save_safetensors(module, directory)")
    entries = _entries(module)
    files = _plan(entries, limit)
    n = len(files)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    mesh = module.spec
    comm = None if simulated else _Comm(module.mesh)
    me = 0 if simulated else comm.rank
    world = 1 if simulated else mesh.world_size
    written = []
    with replacing(directory, where=_WHERE, owned=_owned,
                   rank=None if simulated else comm.dist.get_rank()) as stage:
        for k, part in enumerate(files):
            writer = k % world
            if me != writer:
                if comm is not None:
                    for e in part:
                        for src in e.derived[1] if e.derived is not None else [e]:
                            if src.shards is not None:
                                comm.send_blocks(src, writer)
                continue
            with stage.file(names[k]) as fh:
                fh.write(_header(part))
                for e in part:
                    t = _whole(e, mesh, comm)
                    _write_bytes(fh, t, e)
                    del t
            written.append(names[k])
        if me == 0:
            try:
                written += _save_config(getattr(module, "model", None), stage.path)
            except OSError as e:
                stage.fail(e, "config.json")
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                     "weight_map": {e.name: names[k] for k, part in enumerate(files)
                                    for e in part}}
            with stage.file(INDEX) as fh:
                fh.write(json.dumps(index, indent=2, sort_keys=True).encode())
            written.append(INDEX)
    return [os.path.join(directory, f) for f in written]


def _whole(e: _Entry, mesh, comm) -> torch.Tensor:
    """Entry ``e``'s whole tensor, on its file's writer."""
    if e.derived is not None:
        gather, sources = e.derived
        wholes = {src.name: _whole(src, mesh, comm) for src in sources}
        return gather.apply(wholes.__getitem__)
    if e.whole is not None:
        return e.whole()
    return _assemble_local(e, mesh) if comm is None else comm.gather_whole(e)


class _Comm:
    """A real mesh: this process's mesh rank, and blocks sent to a tensor's writer."""

    def __init__(self, device_mesh):
        import torch.distributed as dist
        self.dist = dist
        from .mesh import mesh_spec
        self.spec = mesh_spec(device_mesh, where=_WHERE)
        self.globals = [int(g) for g in device_mesh.mesh.flatten().tolist()]
        self.rank = self.globals.index(dist.get_rank())
        from .runtime.distributed import backend_for
        self.device = backend_for(device_mesh).device   # receive buffers: the blocks' device

    def send_blocks(self, e: _Entry, writer: int) -> None:
        spec, getters = e.shards
        for r, kept in e.holders(self.spec):
            if r == self.rank:
                block = getters[kept]().contiguous()
                self.dist.send(block, dst=self.globals[writer])

    def gather_whole(self, e: _Entry) -> torch.Tensor:
        from .placement import local_shape
        spec, getters = e.shards
        mesh = e.mesh or self.spec
        out = torch.zeros(e.padded, dtype=e.dtype, device=torch.device("cpu"))
        for r, kept in e.holders(self.spec):
            if r == self.rank:
                block = getters[kept]()
            else:
                block = torch.empty(local_shape(e.padded, spec, mesh), dtype=e.dtype,
                                    device=self.device)
                self.dist.recv(block, src=self.globals[r])
            add_block(out, block, spec, mesh, kept)
        return cut_to(out, e.shape)

