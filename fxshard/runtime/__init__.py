"""The runtime: the backends that run fxshard's collectives, and the runners of rank programs.

The ops themselves (``torch.ops.fxshard.{all_gather, all_reduce, reduce_scatter, all_to_all,
local_shard, send, recv}``, ...) are defined in :mod:`fxshard.ops`. Each op executes on the
current :class:`Backend` of its thread: a :class:`SimulatedBackend` (threads of one process,
installed by :meth:`SimulatedWorld.run`) or a ``fxshard.runtime.distributed.DistributedBackend``
(torch.distributed on a ``DeviceMesh``, installed with :func:`use_backend`).
"""
from fxshard.runtime.context import Backend, axis_index, axis_size, current_backend, use_backend
from fxshard.runtime.simulated import SimulatedBackend, SimulatedWorld

__all__ = ["Backend", "SimulatedWorld", "SimulatedBackend", "DistributedBackend", "backend_for",
           "use_backend", "current_backend", "axis_index", "axis_size", "COLLECTIVE_OPS",
           "POINT_TO_POINT_OPS", "is_communication", "is_point_to_point"]

_FROM_OPS = ("COLLECTIVE_OPS", "POINT_TO_POINT_OPS", "is_communication", "is_point_to_point")


def __getattr__(name: str):
    # torch.distributed's collectives load only when a real mesh is used; the op sets come from
    # fxshard.ops, which imports this package's context module (so not at import time here).
    if name in ("DistributedBackend", "backend_for"):
        from fxshard.runtime import distributed
        return getattr(distributed, name)
    if name in _FROM_OPS:
        from fxshard.ops import collectives
        return getattr(collectives, name)
    raise AttributeError(f"module 'fxshard.runtime' has no attribute {name!r}")
