"""The runtime: collectives as ``torch.library`` custom ops and the backends that run them.

``fxshard.runtime.ops`` registers ``torch.ops.fxshard.{all_gather, all_reduce, reduce_scatter,
all_to_all, local_shard, send, recv}``. Each op executes on the current :class:`Backend` of its
thread: a :class:`SimulatedBackend` (threads of one process, installed by
:meth:`SimulatedWorld.run`) or a ``fxshard.runtime.distributed.DistributedBackend``
(torch.distributed on a ``DeviceMesh``, installed with :func:`use_backend`).
"""
from fxshard.runtime import ops
from fxshard.runtime.context import Backend, axis_index, axis_size, current_backend, use_backend
from fxshard.runtime.ops import (COLLECTIVE_OPS, POINT_TO_POINT_OPS, is_communication,
                                 is_point_to_point)
from fxshard.runtime.simulated import SimulatedBackend, SimulatedWorld

__all__ = ["Backend", "SimulatedWorld", "SimulatedBackend", "DistributedBackend", "backend_for",
           "use_backend", "current_backend", "axis_index", "axis_size", "COLLECTIVE_OPS",
           "POINT_TO_POINT_OPS", "is_communication", "is_point_to_point", "ops"]


def __getattr__(name: str):
    # torch.distributed's collectives load only when a real mesh is used.
    if name in ("DistributedBackend", "backend_for"):
        from fxshard.runtime import distributed
        return getattr(distributed, name)
    raise AttributeError(f"module 'fxshard.runtime' has no attribute {name!r}")
