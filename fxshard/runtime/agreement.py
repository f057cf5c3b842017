"""Ranks agree on a call before they run it: one small exchange per new call signature.

Under ``torchrun`` every rank must make the same calls with the same input shapes and options
(each passes the same global input). Ranks that disagree (one calls ``pm(x)`` with a batch of
4, the other with 2; ``max_new_tokens=3`` against ``4``) would otherwise run different programs
against each other's collectives and end in a native abort or a "connection reset". So the
first time a process sees a call signature it exchanges it with every rank
(``all_gather_object`` over the default group) and, where they differ, every rank raises the
same ValueError showing each side::

    agree(mesh, seen, "fxshard.parallelize", key)   # key: shapes, dtypes, options of this call

On a simulated mesh (one process, one caller) there is nothing to agree on: no exchange. A
signature agreed once is remembered in ``seen`` (the program cache's set), so a call whose
signature is already known costs a set lookup. What this cannot see: a rank that repeats a
call it made before (nothing new to it, no exchange) while another makes a new one; catching
that would take an exchange on every call.
"""
from __future__ import annotations

import torch

__all__ = ["agree", "describe"]

_SHOWN = 3  # ranks named per distinct signature in the message


def describe(value):
    """A hashable, picklable summary of a call's argument: a tensor's shape, dtype and device
    (not its values: comparing those would cost a transfer of every input); containers element
    by element; plain values as they are, anything else by its repr."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (tuple, list)):
        return tuple(describe(v) for v in value)
    if isinstance(value, dict):
        return ("dict", tuple((str(k), describe(v)) for k, v in
                              sorted(value.items(), key=lambda kv: str(kv[0]))))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


def agree(mesh, seen: set, where: str, *values) -> None:
    """Check that every rank of ``mesh`` calls with the same ``values`` (described by
    :func:`describe`), the first time this process sees them (``seen``: the signatures agreed
    so far, updated); a ValueError on every rank naming the ranks and what each has where
    they differ."""
    from ..mesh import is_simulated
    if is_simulated(mesh):
        return
    signature = describe(values)
    if signature in seen:
        return
    import torch.distributed as dist
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, signature)
    if all(g == signature for g in gathered):
        seen.add(signature)
        return
    differ = _differing(gathered)
    groups: dict = {}
    for rank, g in enumerate(gathered):
        groups.setdefault(_show(g, differ), []).append(rank)
    sides = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks[:_SHOWN]))}{' ...' if len(ranks) > _SHOWN else ''}: {text}"
        for text, ranks in groups.items())
    raise ValueError(
        f"{where}: the ranks disagree on this call (this is rank {dist.get_rank()}): {sides}. "
        f"Under torchrun every rank must make the same calls with the same input shapes, "
        f"dtypes and options (each rank passes the same global input); give every rank the "
        f"same arguments")


def _differing(signatures: list) -> set | None:
    """The keys whose values differ, where every signature is one dict of the same keys (so
    the message shows those only); None otherwise (show everything)."""
    dicts = [g[0][1] for g in signatures if len(g) == 1 and isinstance(g[0], tuple)
             and len(g[0]) == 2 and g[0][0] == "dict"]
    if len(dicts) != len(signatures) or len({tuple(k for k, _ in d) for d in dicts}) != 1:
        return None
    return {k for i, (k, _) in enumerate(dicts[0]) if len({repr(d[i][1]) for d in dicts}) > 1}


def _show(value, keys: set | None = None) -> str:
    """A signature as a person reads it: ``max_new_tokens=3``, ``tensor[4, 6] torch.int64``."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "tensor":
        return f"tensor{list(value[1])} {value[2]} on {value[3]}"
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "dict":
        return ", ".join(f"{k}={_show(v)}" for k, v in value[1] if keys is None or k in keys)
    if isinstance(value, tuple):
        inner = ", ".join(_show(v, keys) for v in value)
        return inner if keys is not None and len(value) == 1 else f"({inner})"
    return repr(value)
