"""Device meshes: axis names and roles, the simulated mesh, the torch DeviceMesh adapter.

A mesh is a grid of ranks with one named axis per kind of parallelism. :data:`AXIS_ROLES` is
the one place an axis name is spelled and its role said (what it splits, how attention crosses
it, whether it trains); the rest of fxshard reads the constants (``TP``, ``RING``, ...) and the
role sets (``BATCH_AXES``, ``SEQUENCE_AXES``, ``TRAINING_AXES``) below::

    axis         splits                 attention across it    trains
    dp           batch                  -                      yes
    fsdp         batch + weight storage -                      yes
    tp           weights (Megatron)     heads                  yes
    pp           layers (stages)        -                      no (not yet)
    ulysses_cp   sequence               all-to-all to heads    yes (with dp, fsdp, ring_cp)
    ring_cp      sequence               ring (K/V around)      yes (with dp, fsdp, tp,
                                                                    ulysses_cp)
    ep           batch + experts        -                      yes
                 (whole experts by index; tokens travel to their experts' ranks
                 by all-to-all: ``passes/expert_parallel.py``)

Ranks are laid out row-major over the mesh shape, as in ``torch.distributed.DeviceMesh``:
on a ``(dp=2, tp=2)`` mesh rank 3 has coordinates ``(1, 1)``.

``init_device_mesh`` returns a real ``DeviceMesh`` under a launcher (``torchrun``: it starts
the default process group when the script has not) and a :class:`SimulatedMesh` otherwise,
where every rank runs as a thread of this process. Passes only need the geometry, which
:func:`mesh_spec` extracts from either.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["AXIS_NAMES", "AXIS_ROLES", "AxisRole", "BATCH_AXES", "SEQUENCE_AXES",
           "TRAINING_AXES", "DP", "FSDP", "TP", "PP", "ULYSSES", "RING", "EP", "MeshSpec",
           "SimulatedMesh", "init_device_mesh", "mesh_spec", "canonical_axis"]

DP, FSDP, TP, PP, ULYSSES, RING, EP = "dp", "fsdp", "tp", "pp", "ulysses_cp", "ring_cp", "ep"


@dataclass(frozen=True)
class AxisRole:
    """What one mesh axis does. ``input_dim``: the dim of the user's inputs it splits (0 the
    batch, 1 the sequence; None: inputs stay whole on it); ``weights``: how it places weights
    (``"whole"``, ``"sharded"`` by the tensor-parallel plan, ``"stored"`` sharded and gathered
    before use, ``"stages"`` by layer, ``"experts"``: MoE expert weights split by expert index,
    every other weight whole); ``attention``: how attention crosses it (None: locally
    on every rank); ``trains``: gradients are built for it."""

    splits: str
    input_dim: int | None
    weights: str
    attention: str | None
    trains: bool


AXIS_ROLES: dict[str, AxisRole] = {
    DP: AxisRole("batch", 0, "whole", None, True),
    FSDP: AxisRole("batch, weight storage", 0, "stored", None, True),
    TP: AxisRole("weights", None, "sharded", "heads", True),
    PP: AxisRole("layers", None, "stages", None, True),
    ULYSSES: AxisRole("sequence", 1, "whole", "all_to_all", True),
    RING: AxisRole("sequence", 1, "whole", "ring", True),
    EP: AxisRole("batch, experts", 0, "experts", None, True),
}
AXIS_NAMES = tuple(AXIS_ROLES)
BATCH_AXES = tuple(a for a, r in AXIS_ROLES.items() if r.input_dim == 0)
SEQUENCE_AXES = tuple(a for a, r in AXIS_ROLES.items() if r.input_dim == 1)
TRAINING_AXES = tuple(a for a, r in AXIS_ROLES.items() if r.trains)
_ALIASES = {"ulysess_cp": "ulysses_cp"}  # the seed article's spelling


def canonical_axis(name: str, *, where: str = "fxshard") -> str:
    """Return the canonical spelling of a mesh axis name or raise a ValueError naming the set."""
    name = _ALIASES.get(name, name)
    if name not in AXIS_NAMES:
        raise ValueError(
            f"{where}: unknown mesh axis name {name!r}; the allowed names are "
            f"{', '.join(AXIS_NAMES)} (and the alias 'ulysess_cp'). Rename the mesh dimension.")
    return name


@dataclass(frozen=True)
class MeshSpec:
    """The geometry of a mesh: what every pass needs and nothing that talks to devices."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_type: str = "cpu"

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str) -> int:
        """Size of ``axis``; an axis the mesh does not have has size 1 (it is off)."""
        return self.shape[self.axis_names.index(axis)] if axis in self.axis_names else 1

    def active_axes(self) -> tuple[str, ...]:
        return tuple(a for a, n in zip(self.axis_names, self.shape) if n > 1)

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh {self.describe()} "
                             f"(ranks 0..{self.world_size - 1})")
        out = []
        for n in reversed(self.shape):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank_of(self, coords: Sequence[int]) -> int:
        rank = 0
        for c, n in zip(coords, self.shape):
            rank = rank * n + c
        return rank

    def axis_index(self, rank: int, axis: str) -> int:
        """Coordinate of ``rank`` along ``axis`` (0 for an axis the mesh does not have)."""
        if axis not in self.axis_names:
            return 0
        return self.coords(rank)[self.axis_names.index(axis)]

    def axis_group(self, rank: int, axis: str) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axis``, ordered by their coordinate."""
        if axis not in self.axis_names:
            return [rank]
        i = self.axis_names.index(axis)
        c = list(self.coords(rank))
        group = []
        for k in range(self.shape[i]):
            c[i] = k
            group.append(self.rank_of(c))
        return group

    def describe(self) -> str:
        return "(" + ", ".join(f"{a}={n}" for a, n in zip(self.axis_names, self.shape)) + ")"


class SimulatedMesh(MeshSpec):
    """A mesh whose ranks all run in this process, one thread per rank.

    The seed article's "single-device distributed simulation": the same script runs on a laptop
    and, with the same mesh shape under ``torchrun``, on real ranks.
    """

    def __repr__(self) -> str:
        return f"SimulatedMesh({self.device_type!r}, {self.describe()})"


def _validate(where: str, mesh_shape, mesh_dim_names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
        raise TypeError(f"{where}: mesh_shape={mesh_shape!r} must be a tuple of ints, one size "
                        f"per mesh axis, e.g. mesh_shape=(2, 2)")
    for n in mesh_shape:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{where}: mesh_shape={tuple(mesh_shape)!r} holds {n!r} "
                            f"({type(n).__name__}); every axis size must be an int, "
                            f"e.g. mesh_shape=(2, 2)")
    shape = tuple(int(n) for n in mesh_shape)
    if mesh_dim_names is None:
        raise ValueError(f"{where}: mesh_dim_names is required, e.g. "
                         f"mesh_dim_names=(\"dp\", \"tp\") for a mesh of shape {shape}")
    if isinstance(mesh_dim_names, str) or not isinstance(mesh_dim_names, Sequence) or \
            not all(isinstance(n, str) for n in mesh_dim_names):
        raise TypeError(f"{where}: mesh_dim_names={mesh_dim_names!r} must be a tuple of axis "
                        f"names, one per mesh dimension, e.g. mesh_dim_names=(\"tp\",) (note "
                        f"the comma: a bare string is not a tuple)")
    names = tuple(canonical_axis(n, where=where) for n in mesh_dim_names)
    if len(names) != len(shape):
        raise ValueError(f"{where}: mesh_shape {shape} has {len(shape)} dimensions but "
                         f"mesh_dim_names {tuple(mesh_dim_names)} has {len(names)}; give one name "
                         f"per dimension")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: mesh_dim_names {names} repeats a name; each axis once")
    if any(n < 1 for n in shape):
        raise ValueError(f"{where}: every mesh dimension must be >= 1, got {shape}")
    return shape, names


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str]):
    """Mirror of ``torch.distributed.device_mesh.init_device_mesh`` with fxshard's axis names.

    Under ``torchrun`` this returns a real ``DeviceMesh`` and the world size must equal the
    product of ``mesh_shape``; as torch's does, it starts the default process group itself when
    the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``) is there and none is
    started yet (gloo for cpu, nccl for cuda, whose device it sets from ``LOCAL_RANK``). In a
    plain process it returns a :class:`SimulatedMesh` whose ranks run as threads on
    ``device_type``.
    """
    where = "fxshard.init_device_mesh"
    shape, names = _validate(where, mesh_shape, mesh_dim_names)
    _check_device_type(where, device_type)
    import torch.distributed as dist
    if dist.is_available() and not dist.is_initialized() and _launched():
        _init_default_group(where, device_type, shape)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != math.prod(shape):
            raise ValueError(
                f"{where}: mesh_shape {shape} holds {math.prod(shape)} ranks but "
                f"torch.distributed was started with world size {world}; launch "
                f"torchrun --nproc_per_node={math.prod(shape)} or change the mesh shape")
        from torch.distributed.device_mesh import init_device_mesh as torch_init
        device_mesh = torch_init(device_type, shape, mesh_dim_names=names)
        _bound_axis_timeouts(device_mesh, names)
        return device_mesh
    return SimulatedMesh(shape, names, device_type)


_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def _launched() -> bool:
    """The environment a launcher (``torchrun``, SLURM wrappers) gives each process."""
    import os
    return all(k in os.environ for k in _LAUNCH_ENV)


def _init_default_group(where: str, device_type: str, shape: tuple[int, ...]) -> None:
    """Under a launcher with no default process group yet: check that the launched world
    matches the mesh, set this process's CUDA device from ``LOCAL_RANK`` (as torch's
    ``init_device_mesh`` does), then start the group: gloo for cpu, nccl for cuda."""
    import os

    import torch.distributed as dist
    text = os.environ["WORLD_SIZE"]
    if not text.strip().isdigit():
        raise ValueError(f"{where}: the launcher's WORLD_SIZE={text!r} is not a number")
    world = int(text)
    if world != math.prod(shape):
        raise ValueError(
            f"{where}: mesh_shape {shape} holds {math.prod(shape)} ranks but the launcher "
            f"started WORLD_SIZE={world} processes; launch torchrun "
            f"--nproc_per_node={math.prod(shape)} or change the mesh shape to hold {world}")
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")


def _check_device_type(where: str, device_type) -> None:
    if not isinstance(device_type, str):
        raise TypeError(f"{where}: device_type={device_type!r} must be a string such as "
                        f"\"cpu\" or \"cuda\"")
    try:
        device = torch.device(device_type)
    except RuntimeError:
        raise ValueError(f"{where}: device_type={device_type!r} is not a torch device type; "
                         f"use \"cpu\" or \"cuda\"") from None
    if device.index is not None:
        raise ValueError(f"{where}: device_type={device_type!r} names one device; give the type "
                         f"only (\"{device.type}\"): ranks pick their device by rank")
    if device.type == "meta":
        raise ValueError(f"{where}: device_type=\"meta\" cannot run a model; build the model "
                         f"on meta if you like, but give the mesh the device it runs on "
                         f"(\"cpu\" or \"cuda\")")
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and not (module is not None and hasattr(module, "is_available")
                                     and module.is_available()):
        raise ValueError(f"{where}: device_type={device_type!r} but this machine has no "
                         f"{device.type} device that torch can use (torch {torch.__version__}); "
                         f"use \"cpu\", or install a torch build for {device.type}")


def _bound_axis_timeouts(device_mesh, names) -> None:
    """torch gives a DeviceMesh's per-axis groups the backend's default timeout (30 minutes for
    gloo), not the one ``init_process_group`` was given; copy the latter, so that a rank whose
    peer died fails within the timeout the user chose instead of hanging."""
    import torch.distributed as dist
    c10d = dist.distributed_c10d
    try:
        world = c10d._get_default_group()
        timeout = world._get_backend(torch.device(device_mesh.device_type)).options._timeout
        for axis in names:
            c10d._set_pg_timeout(timeout, device_mesh.get_group(axis))
    except (AttributeError, RuntimeError):  # private API moved: keep torch's defaults
        return


def mesh_spec(mesh, *, where: str = "fxshard") -> MeshSpec:
    """The geometry of a :class:`SimulatedMesh`, a :class:`MeshSpec` or a torch ``DeviceMesh``."""
    if isinstance(mesh, MeshSpec):
        _validate(where, mesh.shape, mesh.axis_names)
        return mesh
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(mesh, DeviceMesh):
        shape, names = _validate(where, tuple(mesh.mesh.shape), mesh.mesh_dim_names)
        return MeshSpec(shape, names, mesh.device_type)
    raise TypeError(f"{where}: expected a mesh from fxshard.init_device_mesh or a torch "
                     f"DeviceMesh, got {type(mesh).__name__}")


def is_simulated(mesh) -> bool:
    return isinstance(mesh, MeshSpec)
