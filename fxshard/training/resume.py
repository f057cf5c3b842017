"""Resumable, reshardable training state: parameters and optimizer state by the model's names.

::

    fxshard.save_training_state(pm, opt, "ckpt/step2")       # mesh A (e.g. fsdp=4)
    ...
    pm = fxshard.parallelize(model, mesh_b, example_inputs=(ids,))   # e.g. dp=2 x tp=2
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    fxshard.load_training_state(pm, opt, "ckpt/step2")       # the next steps are mesh A's

The directory is a ``torch.distributed.checkpoint`` (DCP) checkpoint in the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``::

    {"model": {fqn: tensor},
     "optim": {"state": {fqn: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

An optimizer state tensor of its parameter's shard shape (AdamW's moments, SGD's momentum) is
sharded like the parameter and is stored whole, by the parameter's name; any other value
(AdamW's ``step``) is the same on every rank and stored once. On a simulated mesh the whole
tensors are assembled from the shards and written by this process; on real ranks each
parameter and state shard is given to DCP as a ``DTensor`` over the mesh, so each process
writes only what it owns (replicas once) and DCP reads back, on any other mesh, exactly the
slices each rank holds there. A fused projection's strided shard (q, k, v each split) has no
DTensor placement: it is gathered whole on every rank and written once (its whole value and
state in memory during the save), and read whole, each rank keeping its block. Loading
copies into the shards in place (the optimizer's references stay valid) and sets the
optimizer's state and its groups' hyperparameters (``lr``, ``betas``, ...: a scheduler's
changes carry over), as ``optimizer.load_state_dict``.
Either mesh may be simulated or real; the files are the same.

A save writes into a temporary sibling of the directory and switches it in when complete
(:mod:`fxshard.atomic_dir`): a save that fails (a full disk) leaves the previous checkpoint as
it was and raises an OSError (or RuntimeError) naming the file, on every rank; a load names a
truncated or missing ``.distcp`` file. On real ranks every rank must make either call (else
every rank that did raises, :func:`fxshard.runtime.agreement.together`).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..placement import cut_to

__all__ = ["save_training_state", "load_training_state"]

_SAVE = "fxshard.save_training_state"
_LOAD = "fxshard.load_training_state"


def _trainer(pm, where: str):
    """The trainer behind ``pm`` (a ParallelModule or a TrainModule), shards placed."""
    pm.parameters()     # a clear error when nothing is traced yet; places example_inputs'
    tm = getattr(pm, "trainer", pm)
    tm._require(where)
    return tm


def _together(tm, where: str, call: str) -> None:
    """Real ranks: every rank is making this call (else every rank raises, none waits)."""
    if not tm._simulated:
        from ..runtime.agreement import together
        together(getattr(tm, "device_mesh", None) or tm.mesh, where, call)


def _parts(tm) -> list:
    """The TrainModules whose shards make up ``tm``'s: itself, or a pipeline's stages that
    run in this process (each a TrainModule on the mesh without ``pp``; their parameters
    differ, so each is saved and loaded as a model of its own, under the same names)."""
    stages = getattr(tm, "stage_modules", None)
    return [tm] if stages is None else [t for t in stages if t._last is not None]


def _described(tm) -> str:
    """The user's mesh (a pipeline stage's: the whole mesh, not its mesh without ``pp``)."""
    from ..mesh import mesh_spec
    whole = getattr(tm, "device_mesh", None)
    return tm.spec.describe() if whole is None else mesh_spec(whole).describe()


def _owners(tm, optimizer, where: str) -> dict:
    """``{id(parameter shard): (rank, fqn)}``; every parameter of ``optimizer`` must be one."""
    owners = {id(p): (rank, fqn) for part in _parts(tm) for rank in part.ranks
              for fqn, p in part.shards(rank).items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owners:
                raise ValueError(
                    f"{where}: the optimizer holds a parameter of shape {tuple(p.shape)} that "
                    f"is not one of pm.parameters() (mesh {tm.spec.describe()}); build the "
                    f"optimizer over pm.parameters()")
    return owners


def _placements(tm, fqn: str, where: str) -> list:
    from torch.distributed.tensor import Replicate, Shard
    spec = tm._specs[fqn]
    if not all(isinstance(p, (Shard, Replicate)) for p in spec):
        raise NotImplementedError(
            f"{where}: {fqn} is placed {spec} on mesh {_described(tm)}; only Shard and "
            f"Replicate placements are written per rank (a DTensor); save from a simulated "
            f"mesh, or train this parameter without that placement")
    return list(spec)


def _shape(tm, fqn: str) -> tuple:
    """``fqn``'s shape in the model (and the checkpoint): the program's, less the rows a
    vocab padded for tp added (:mod:`fxshard.passes.pad_vocab`)."""
    return tuple(tm._last.padded.get(fqn, tm._last.shapes[fqn]))


def _dtensor(tm, fqn: str, local: torch.Tensor, where: str):
    """This process's block ``local`` of parameter ``fqn`` (or of a state sharded like it) as
    a DTensor over the mesh, which tells DCP where the block lies in the whole."""
    from torch.distributed.tensor import DTensor
    shape = torch.Size(tm._last.shapes[fqn])
    stride = torch.empty(shape, device="meta").stride()
    # a pipeline stage's placements name every axis, pp replicated: the whole mesh's, on
    # which only the stage's ranks hold the name
    mesh = getattr(tm, "device_mesh", None) or tm.mesh
    return DTensor.from_local(local, device_mesh=mesh,
                              placements=_placements(tm, fqn, where), run_check=False,
                              shape=shape, stride=stride)


def _sharded(value, shard: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def _as_dtensor(tm, fqn: str) -> bool:
    """Real ranks hand ``fqn`` (and state sharded like it) to DCP as a DTensor: its placement
    is Shard/Replicate on every axis. A fused projection's strided shard (``StridedShard``:
    q, k, v each split, or some kept whole) has no DTensor placement, and a vocab padded for
    tp holds rows DTensor's uneven shards do not (64-row rounding): both are gathered whole,
    the checkpoint holding the model's shape."""
    from torch.distributed.tensor import Replicate, Shard
    return fqn not in tm._last.padded and \
        all(isinstance(p, (Shard, Replicate)) for p in tm._specs[fqn])


def _whole(tm, fqn: str, blocks: dict, where: str):
    """The whole value from every held rank's block (simulated), or on real ranks this rank's
    as a DTensor; a strided shard's from every rank's block, gathered (every rank holds the
    same whole tensor; DCP writes it once)."""
    from .module import assemble
    if not tm._simulated:
        (block,) = blocks.values()
        if _as_dtensor(tm, fqn):
            return _dtensor(tm, fqn, block.detach(), where)
        return cut_to(assemble(tm._gather_blocks(block.detach()), tm._last.shapes[fqn],
                               tm._specs[fqn], tm.spec), _shape(tm, fqn))
    return cut_to(assemble([blocks[r].detach() for r in tm.ranks], tm._last.shapes[fqn],
                           tm._specs[fqn], tm.spec), _shape(tm, fqn))


def _groups(tm, optimizer, owners: dict) -> list:
    """The optimizer's groups with their parameters' names. A pipeline on a real mesh: each
    process's optimizer holds its own stages' parameters; the names of every stage's come
    along ``pp`` (one object all-gather), in the model's order, so each rank saves them all."""
    out = []
    for group in optimizer.param_groups:
        names = list(dict.fromkeys(owners[id(p)][1] for p in group["params"]))
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    if tm._simulated or getattr(tm, "stage_modules", None) is None:
        return out
    import torch.distributed as dist
    from ..mesh import PP
    group = tm.mesh.get_group(PP)
    told = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, [g["params"] for g in out], group=group)
    order = {n: i for i, (n, _) in enumerate(tm.model.named_parameters(remove_duplicate=False))}
    for k, g in enumerate(out):
        names = {n for stage in told for n in stage[k]}
        g["params"] = sorted(names, key=lambda n: order.get(n, len(order)))
    return out


def save_training_state(pm, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write ``pm``'s trained parameters and ``optimizer``'s state (over ``pm.parameters()``)
    to the DCP checkpoint directory ``path``, by the model's parameter names, whole; on real
    ranks every process calls it and writes what it owns. See :mod:`fxshard.training.resume`."""
    import torch.distributed.checkpoint as dcp
    top = _trainer(pm, "save_training_state")
    _together(top, _SAVE, "save_training_state(pm, optimizer, path)")
    owners = _owners(top, optimizer, _SAVE)
    model, state = {}, {}
    for tm, fqn in ((t, fqn) for t in _parts(top) for fqn in t.shards(t.ranks[0])):
        shards = {r: tm.shards(r)[fqn] for r in tm.ranks}
        model[fqn] = _whole(tm, fqn, shards, _SAVE)
        held = {r: optimizer.state.get(p) for r, p in shards.items()}
        if not any(held.values()):
            continue       # not stepped yet (or not in this optimizer)
        if not all(held.values()):
            raise ValueError(
                f"{_SAVE}: the optimizer holds state for {fqn} on some ranks only (mesh "
                f"{top.spec.describe()}); build it over every rank's shards, pm.parameters()")
        first = held[tm.ranks[0]]
        mine = {}
        for key, value in first.items():
            if _sharded(value, shards[tm.ranks[0]]):
                mine[key] = _whole(tm, fqn, {r: s[key] for r, s in held.items()}, _SAVE)
                continue
            if isinstance(value, torch.Tensor):
                if any(not torch.equal(s[key], value) for s in held.values()):
                    raise ValueError(
                        f"{_SAVE}: optimizer state {key!r} of {fqn} differs between ranks "
                        f"(mesh {top.spec.describe()}); only a value the same on every rank "
                        f"or one sharded like its parameter can be saved by name")
                value = value.detach().clone()
            mine[key] = value
        state[fqn] = mine
    sd = {"model": model, "optim": {"state": state,
                                    "param_groups": _groups(top, optimizer, owners),
                                    "class": _class_name(optimizer)}}
    from torch.distributed.checkpoint.api import CheckpointException
    from ..atomic_dir import replacing
    rank = None if top._simulated else torch.distributed.get_rank()
    with replacing(path, where=_SAVE, owned=_owned, rank=rank) as stage:
        try:
            with _one_process(top):
                dcp.save(sd, checkpoint_id=stage.path, no_dist=top._simulated)
        except CheckpointException as e:     # (a BaseException: every rank gets it)
            r, (cause, _) = sorted(e.failures.items())[0]
            stage.fail(cause, f"{_rank_files(stage.path, r)} (written by rank {r})")


def _owned(name: str) -> bool:
    """A file of a DCP checkpoint (a new save leaves none of an older one's beside its own)."""
    return name == ".metadata" or name.endswith(".distcp")


def _rank_files(directory: str, rank: int) -> str:
    import os
    names = sorted(f for f in os.listdir(directory) if f.startswith(f"__{rank}_"))
    return ", ".join(names) or f"__{rank}_0.distcp"


@contextlib.contextmanager
def _one_process(tm):
    """A simulated mesh's whole tensors are written by this one process: DCP's warning that it
    assumes so is expected, not news."""
    with warnings.catch_warnings():
        if tm._simulated:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    category=UserWarning)
        yield


def _metadata(path: str) -> dict:
    """The checkpoint's tensors and values by key; every file its ``.metadata`` lists checked
    to be there and long enough (a truncated ``.distcp`` named here, not by DCP's error)."""
    import torch.distributed.checkpoint as dcp
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise ValueError(f"{_LOAD}: {path!r} is not a torch.distributed.checkpoint directory "
                         f"written by fxshard.save_training_state ({e})") from None
    except Exception as e:      # noqa: BLE001 - an unreadable .metadata
        raise ValueError(f"{_LOAD}: the checkpoint {path!r} is damaged: its .metadata cannot "
                         f"be read ({type(e).__name__}: {e}). Load an intact checkpoint (save "
                         f"it again)") from e
    _check_lengths(path, getattr(meta, "storage_data", None) or {})
    return meta.state_dict_metadata


def _check_lengths(path: str, storage: dict) -> None:
    import os
    need: dict = {}
    for info in storage.values():
        end = getattr(info, "offset", 0) + getattr(info, "length", 0)
        name = getattr(info, "relative_path", None)
        if name is not None:
            need[name] = max(need.get(name, 0), end)
    for name, end in sorted(need.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            raise ValueError(
                f"{_LOAD}: the checkpoint {path!r} is damaged: {file} "
                f"{'is missing' if size is None else f'has {size} bytes'}, its .metadata says "
                f"it holds {end} (truncated by a full disk or an interrupted copy?). Load an "
                f"intact checkpoint (save it again)")


def _data_files(path: str) -> list:
    import os
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))


def _empty(tm, fqn: str, meta, like: torch.Tensor, key: str | None = None):
    """A placeholder DCP loads ``meta``'s entry into: the whole (simulated) or this rank's
    block (a DTensor) of a value sharded like ``fqn``; else a tensor of the stored size."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not isinstance(meta, TensorStorageMetadata):
        return None        # a Python value (a hyperparameter): replaced by the loaded one
    shape = _shape(tm, fqn)
    dtype = meta.properties.dtype
    if tuple(meta.size) == shape and len(shape) > 0:
        if tm._simulated or not _as_dtensor(tm, fqn):   # (a strided shard: read whole)
            return torch.empty(shape, dtype=dtype, device=like.device)
        return _dtensor(tm, fqn, torch.empty(like.shape, dtype=dtype, device=like.device),
                        _LOAD)
    device = torch.device("cpu") if key == "step" else like.device    # as torch.optim keeps it
    return torch.empty(tuple(meta.size), dtype=dtype, device=device)


def _block(tm, fqn: str, value, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of a loaded whole value or DTensor (real ranks); a padded
    vocab's rows padded again."""
    from torch.distributed.tensor import DTensor
    from ..placement import local_block, padded_block
    shape, padded = _shape(tm, fqn), tuple(tm._last.shapes[fqn])
    if isinstance(value, DTensor):
        return value.to_local()
    if shape != padded:
        return padded_block(value.__getitem__, shape, padded, tm._specs[fqn], tm.spec, rank)
    return local_block(value, tm._specs[fqn], tm.spec, rank)


def load_training_state(pm, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load a checkpoint of :func:`save_training_state` (written on any mesh) into ``pm``'s
    parameter shards (in place) and ``optimizer`` (over ``pm.parameters()``): its state per
    shard and its groups' hyperparameters. On real ranks every process calls it."""
    import torch.distributed.checkpoint as dcp
    top = _trainer(pm, "load_training_state")
    _together(top, _LOAD, "load_training_state(pm, optimizer, path)")
    _owners(top, optimizer, _LOAD)
    meta = _metadata(path)
    model, state = {}, {}
    for tm, fqn, shard in ((t, fqn, shard) for t in _parts(top)
                           for fqn, shard in t.shards(t.ranks[0]).items()):
        m = meta.get(f"model.{fqn}")
        if m is None or tuple(getattr(m, "size", ())) != _shape(tm, fqn):
            raise ValueError(
                f"{_LOAD}: {path!r} holds {'no' if m is None else 'a different'} "
                f"{fqn}{'' if m is None else f' (shape {tuple(m.size)})'}; the model's is "
                f"{_shape(tm, fqn)}. Load a checkpoint of the same model")
        model[fqn] = _empty(tm, fqn, m, shard)
        prefix = f"optim.state.{fqn}."
        keys = {k[len(prefix):]: v for k, v in meta.items()
                if k.startswith(prefix) and "." not in k[len(prefix):]}
        if keys:
            state[fqn] = {k: _empty(tm, fqn, v, shard, k) for k, v in keys.items()}
    n_groups = 1 + max((int(k.split(".")[2]) for k in meta
                        if k.startswith("optim.param_groups.")), default=-1)
    if n_groups != len(optimizer.param_groups):
        raise ValueError(f"{_LOAD}: {path!r} holds {n_groups} optimizer param groups, this "
                         f"optimizer {len(optimizer.param_groups)}; build it with as many")
    groups = [{k.split(".", 3)[3]: None for k in meta
               if k.startswith(f"optim.param_groups.{i}.")} for i in range(n_groups)]
    sd = {"model": model, "optim": {"state": state, "param_groups": groups}}
    if "optim.class" in meta:      # (a checkpoint saved before it was recorded has none)
        sd["optim"]["class"] = None
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with _one_process(top):
            dcp.load(sd, checkpoint_id=path, no_dist=top._simulated)
    except (CheckpointException, Exception) as e:   # (a BaseException, naming no file;
        r, (cause, _) = sorted(e.failures.items())[0] if isinstance(  # one process: raw)
            e, CheckpointException) else (top.ranks[0], (e, None))
        raise ValueError(
            f"{_LOAD}: the checkpoint {path!r} is damaged: reading it failed on rank {r} "
            f"({type(cause).__name__}: {str(cause).splitlines()[0][:160]}); its files {_data_files(path)} do not hold "
            f"what its .metadata lists. Load an intact checkpoint (save it again)") from cause
    groups = sd["optim"]["param_groups"]
    _check_same_optimizer(path, sd["optim"].get("class"), groups, optimizer)
    with torch.no_grad():
        for tm in _parts(top):
            for rank in tm.ranks:
                for fqn, shard in tm.shards(rank).items():
                    shard.copy_(_block(tm, fqn, model[fqn], rank))
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for tm, rank in ((t, r) for t in _parts(top) for r in t.ranks):
        for fqn, p in tm.shards(rank).items():
            if fqn not in state or id(p) not in stepped:
                continue
            optimizer.state[p] = {
                k: (_block(tm, fqn, v, rank).clone() if _sharded_like(v, tm, fqn) else
                    v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in state[fqn].items()}
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _class_name(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_same_optimizer(path: str, saved_class, groups: list, optimizer) -> None:
    """A ValueError for a checkpoint of another optimizer type (recorded at save), or whose
    param groups hold hyperparameters this optimizer has not (AdamW's ``betas`` into SGD):
    loading it would give this optimizer the other's settings and state silently."""
    mine = type(optimizer).__qualname__
    if saved_class is not None and saved_class != _class_name(optimizer):
        raise ValueError(
            f"{_LOAD}: {path!r} holds the state of a {saved_class.rsplit('.', 1)[-1]} "
            f"optimizer ({saved_class}) but this optimizer is a {mine} "
            f"({_class_name(optimizer)}); its state and hyperparameters do not apply. Build "
            f"the optimizer the checkpoint was saved with, "
            f"{saved_class.rsplit('.', 1)[-1]}(pm.parameters(), ...), or start this one "
            f"fresh (load only the weights: pm.load_state_dict)")
    if saved_class is not None:
        return
    # no type recorded: hyperparameters of a torch optimizer this one has not (the keys an LR
    # scheduler adds to a group, initial_lr, are no optimizer's: not compared)
    import inspect
    known = {name for cls in vars(torch.optim).values()
             if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
             for name in inspect.signature(cls).parameters} - {"params"}
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        foreign = sorted((set(saved) - set(group)) & known)
        if foreign:
            raise ValueError(
                f"{_LOAD}: param group {i} of {path!r} has hyperparameters {foreign} that this "
                f"{mine} optimizer has not (its are {sorted(set(group) - {'params'})}): the "
                f"checkpoint is another optimizer's. Build the optimizer the checkpoint was "
                f"saved with, or start this one fresh (load only the weights: "
                f"pm.load_state_dict)")


def _sharded_like(value, tm, fqn: str) -> bool:
    """A loaded value that is the whole of a state sharded like parameter ``fqn``."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        return True
    shape = _shape(tm, fqn)
    return (tm._simulated or not _as_dtensor(tm, fqn)) and isinstance(value, torch.Tensor) \
        and len(shape) > 0 and tuple(value.shape) == shape
