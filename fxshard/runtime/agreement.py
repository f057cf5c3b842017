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

A call that is a collective by itself (``state_dict()`` once trained, ``save_safetensors``,
``save_training_state``) must be made by every rank; one made on rank 0 only (under ``if rank
== 0:``) would wait in a collective the other ranks never join. :func:`together` checks first,
through the process group's store (no collective, so a rank that is elsewhere cannot pair
with it): each rank posts the name of its ``n``-th such call and waits for every other
rank's ``n``-th; different names raise at once on every rank, a rank that does not come within
the timeout (``FXSHARD_CALL_TIMEOUT_S``, default 120 s, at most the process group's) makes the
waiting ranks raise, and a rank that comes after they gave up raises too::

    together(mesh, "fxshard.save_safetensors", "save_safetensors(pm, directory)")
"""
from __future__ import annotations

import os
import time

import torch

__all__ = ["agree", "describe", "together"]

_SHOWN = 3  # ranks named per distinct signature in the message
_TIMEOUT_ENV = "FXSHARD_CALL_TIMEOUT_S"
_GAVE_UP = 1 << 40    # added to a call's arrival count by a rank that stopped waiting


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


def agree(mesh, seen: set, where: str, *values, fix: str | None = None) -> None:
    """Check that every rank of ``mesh`` calls with the same ``values`` (described by
    :func:`describe`), the first time this process sees them (``seen``: the signatures agreed
    so far, updated); a ValueError on every rank naming the ranks and what each has where
    they differ, and ``fix`` (what to do; default: give every rank the same arguments)."""
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
        + (fix or "Under torchrun every rank must make the same calls with the same input "
                  "shapes, dtypes and options (each rank passes the same global input); give "
                  "every rank the same arguments"))


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


def _mesh_ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _timeout() -> float:
    """Seconds to wait for the other ranks: ``FXSHARD_CALL_TIMEOUT_S`` (default 120), at most
    the default process group's timeout (what its collectives would wait)."""
    import torch.distributed as dist
    raw = os.environ.get(_TIMEOUT_ENV, "120")
    try:
        mine = float(raw)
    except ValueError:
        raise ValueError(f"fxshard: {_TIMEOUT_ENV}={raw!r}; give seconds, e.g. 300") from None
    try:
        pg = dist.distributed_c10d._get_default_group()._get_backend(
            torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        pg = dist.default_pg_timeout.total_seconds()
    return min(mine, pg)


def together(mesh, where: str, call: str) -> None:
    """Every rank of ``mesh`` is making this collective call ``call`` (its ``n``-th checked
    call on that mesh, as on every rank); otherwise a ValueError (another call) or a
    RuntimeError (no call within the timeout) on every rank that made one, naming the call
    and the ranks. Nothing on a simulated mesh. Whether the ranks go on is decided once, in
    the store: by the last rank to arrive ("go") or by a rank that stopped waiting
    ("abandoned"), whichever comes first (``compare_set``)."""
    from ..mesh import is_simulated
    if is_simulated(mesh):
        return
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    ranks = _mesh_ranks(mesh)
    me = dist.get_rank()
    base = f"fxshard/together/{','.join(map(str, ranks))}"
    n = store.add(f"{base}/calls/{me}", 1)
    keys = [f"{base}/{n}/{r}" for r in ranks]
    state = f"{base}/{n}/state"
    store.set(keys[ranks.index(me)], call)
    if store.add(f"{base}/{n}/count", 1) == len(ranks):
        store.compare_set(state, "", "go")
    timeout = _timeout()
    deadline = time.monotonic() + timeout
    while not store.check([state]):
        if time.monotonic() > deadline:
            store.compare_set(state, "", f"abandoned by {me}")
            break
        time.sleep(0.01)
    verdict = store.get(state).decode()
    what = f"{where}: {call} is a collective call, which every rank of the mesh must make"
    if verdict == f"abandoned by {me}":
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise RuntimeError(
            f"{what}; this is rank {me}, and rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing[:8]))} did not make it within {timeout:.0f} s "
            f"({_TIMEOUT_ENV}). Call {call} on every rank, not under `if rank == 0:` "
            f"(each rank writes or gathers its part); if a rank is only slower (evaluation "
            f"on rank 0 first), set {_TIMEOUT_ENV} higher")
    if verdict != "go":
        raise RuntimeError(
            f"{what}; this is rank {me}, and rank {verdict.split()[-1]} stopped waiting for "
            f"the others at this call ({_TIMEOUT_ENV}) and raised. Call {call} on every rank "
            f"at the same point")
    names = [store.get(k).decode() for k in keys]
    if any(name != call for name in names):
        sides = "; ".join(f"rank {r}: {name}" for r, name in zip(ranks, names))
        raise ValueError(
            f"{what} at the same point; the ranks made different calls here ({sides}). "
            f"Call {call} on every rank, not under `if rank == 0:`")
