"""Pipeline schedules: which forward (F) and backward (B) of which stage and microbatch each
``pp`` rank runs, in order; and one global order that honours them (the simulated mesh).

Stage ``k`` of ``pp * v`` (``v`` virtual stages per rank) lives on ``pp`` rank ``k % pp``.
``F(k, i)`` needs ``F(k - 1, i)`` (the activations it receives); ``B(k, i)`` needs
``F(k, i)`` and ``B(k + 1, i)`` (the gradients of its outputs). For pp=2, m=4::

    gpipe   rank 0: F0 F1 F2 F3 B0 B1 B2 B3       holds 4 microbatches' activations
            rank 1: F0 F1 F2 F3 B0 B1 B2 B3
    1f1b    rank 0: F0 F1 B0 F2 B1 F3 B2 B3       holds at most pp - rank (2, then 1)
            rank 1: F0 B0 F1 B1 F2 B2 F3 B3

``interleaved_1f1b`` is Megatron's: microbatches in groups of ``pp``, each group through every
virtual stage of the rank in turn, ``2 (pp - rank - 1) + (v - 1) pp`` warm-up forwards, then
one forward and one backward alternately (the bubble shrinks by ``v``). Every rank's
microbatches reach each of its stages' backwards in ascending order, whatever the schedule, so
the accumulated gradients are the same sums in the same order.
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "actions", "global_order"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_WHERE = "fxshard.training.pipeline"


def actions(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per ``pp`` rank, its ``("F" | "B", stage, microbatch)`` in the order it runs them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{_WHERE}: schedule={schedule!r}; use one of {', '.join(SCHEDULES)}")
    if schedule == "1f1b" and v != 1:
        raise ValueError(f"{_WHERE}: schedule='1f1b' runs one stage per rank but the stages "
                         f"were built with virtual_stages={v}; use 'interleaved_1f1b' or "
                         f"'gpipe'")
    if schedule == "interleaved_1f1b" and (v < 2 or m % pp):
        raise ValueError(
            f"{_WHERE}: schedule='interleaved_1f1b' needs virtual_stages >= 2 (got {v}) and "
            f"microbatches divisible by pp={pp} (got {m}); pass virtual_stages=2 to the first "
            f"pm.train_step(..., schedule='interleaved_1f1b') (before any pm(x) or "
            f"example_inputs= builds the stages) and microbatches= a multiple of {pp} to "
            f"fxshard.parallelize")
    out = []
    for r in range(pp):
        mine = [c * pp + r for c in range(v)]
        if schedule == "gpipe":
            out.append([("F", k, i) for k in mine for i in range(m)]
                       + [("B", k, i) for k in reversed(mine) for i in range(m)])
            continue
        if schedule == "1f1b":
            fwd = [("F", r, i) for i in range(m)]
            bwd = [("B", r, i) for i in range(m)]
            warm = min(pp - 1 - r, m)
        else:
            groups = range(m // pp)
            fwd = [("F", c * pp + r, g * pp + i) for g in groups for c in range(v)
                   for i in range(pp)]
            bwd = [("B", c * pp + r, g * pp + i) for g in groups for c in reversed(range(v))
                   for i in range(pp)]
            warm = min(2 * (pp - r - 1) + (v - 1) * pp, len(fwd))
        order = fwd[:warm]
        for j in range(len(fwd) - warm):
            order += [fwd[warm + j], bwd[j]]
        out.append(order + bwd[len(fwd) - warm:])
    return out


def global_order(per_rank: list[list[tuple]], n_stages: int, done: set | None = None
                 ) -> list[list[tuple]]:
    """Time steps: in each, every ``pp`` rank whose next action's inputs are ready runs it
    (``done``: actions run before). A ValueError if the ranks' orders wait on each other (a
    deadlock on real ranks)."""
    done = set(done or ())
    total = len(done) + sum(len(a) for a in per_rank)
    pos = [0] * len(per_rank)
    steps = []
    while len(done) < total:
        ready = []
        for r, acts in enumerate(per_rank):
            if pos[r] == len(acts):
                continue
            kind, k, i = acts[pos[r]]
            need = [("F", k - 1, i)] if kind == "F" and k else []
            if kind == "B":
                need = [("F", k, i)] + ([("B", k + 1, i)] if k + 1 < n_stages else [])
            if all(n in done for n in need):
                ready.append((r, acts[pos[r]]))
        if not ready:
            raise ValueError(f"{_WHERE}: the schedule deadlocks at {pos} (ranks' orders "
                             f"{per_rank})")
        for r, act in ready:
            done.add(act)
            pos[r] += 1
        steps.append(ready)
    return steps
