"""Greedy generation on ``pp >= 2``: the groups of sequences flow through the stages across steps.

``microbatches=m`` cuts the batch into ``m`` groups. Group ``j``'s decode step ``t + 1`` needs
only group ``j``'s token of step ``t``, so no step waits for the whole batch: every rank runs
its stage on the units ``(step, group)`` in the order ``(-1, 0) .. (-1, m-1), (0, 0) .. (0, m-1),
(1, 0) ..`` (step ``-1`` is the prefill, step ``t >= 0`` the decode step that reads token ``t``
at position ``S + t``). After unit ``(t, j)`` the last stage takes the argmax of group ``j``'s
last-position logits (and applies eos/pad), and sends the token ids, ``[b]`` integers (not the
``[b, vocab]`` logits: greedy needs nothing else), to the rank of every earlier stage that
shares its other mesh coordinates. Sends do not wait for the receiver; an earlier stage
receives group ``j``'s token of step ``t`` just before it runs ``(t + 1, j)``. So the first
stage starts group ``j``'s next step as soon as the last stage has produced group ``j``'s token,
and works on the other groups meanwhile: with ``m >= pp`` no stage idles in steady state
(:func:`schedule` below, one tick per stage run)::

    pp=2, m=2    tick: 0       1       2       3       4
    stage 0           (-1,0)  (-1,1)  (0,0)   (0,1)   (1,0) ...
    stage 1                   (-1,0)  (-1,1)  (0,0)   (0,1) ...

A group whose sequences have all emitted eos stops being computed on every stage (each stage
knows it from the group's tokens); its later tokens are pad, and generation ends when every
group has finished or after ``max_new_tokens``: the output HF ``generate`` gives (it pads
finished sequences and stops when all have finished). Every rank ends with every token and
returns the same ``[B, S + new]``.

Sampling keeps the step-synchronous loop of :mod:`fxshard.generation.loop`: HF draws one
``torch.multinomial`` over the whole batch's ``[B, vocab]`` per step, and per-group draws would
consume the generator differently (a schedule choice: the tokens stay HF's).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..runtime.executor import bind_inputs
from ..mesh import PP

__all__ = ["schedule"]


def schedule(stages: int, groups: int, steps: int) -> list[list[tuple[int, int] | None]]:
    """The ticks of the pipelined decode with every stage run taking one tick and no group
    finishing early: ``ticks[k][s]`` is the unit ``(step, group)`` stage ``s`` runs at tick
    ``k``, or None (idle). ``steps`` counts the prefill (step -1) and the decode steps."""
    if stages < 1 or groups < 1 or steps < 1:
        raise ValueError(f"fxshard.generation.pipelined.schedule: stages={stages}, groups={groups}, "
                         f"steps={steps} must all be >= 1")
    done: dict[tuple[int, int, int], int] = {}   # (stage, step, group) -> tick it ends
    free = [0] * stages                           # the first tick stage s is free
    for t in range(-1, steps - 1):
        for j in range(groups):
            for s in range(stages):
                start = free[s]
                if s > 0:
                    start = max(start, done[(s - 1, t, j)])                # its activations
                elif t >= 0:
                    start = max(start, done[(stages - 1, t - 1, j)])       # its token
                done[(s, t, j)] = free[s] = start + 1
    ticks: list[list[tuple[int, int] | None]] = [
        [None] * stages for _ in range(max(done.values()))]
    for (s, t, j), end in done.items():
        ticks[end - 1][s] = (t, j)
    return ticks


def _flat(tokens: torch.Tensor, position: int, way) -> list:
    """The decode program's flat inputs for ``tokens`` ``[b]`` at ``position``, the position
    passed as ``way`` (:class:`fxshard.generation.positions.DecodePositions`) says."""
    kwargs = way.kwargs(tokens.shape[0], position, tokens.device)
    return pytree.tree_flatten(((tokens[:, None],), kwargs))[0]


class _Rank:
    """One rank's walk through the units; ``hook(rank, stage, step, group)`` runs before each."""

    def __init__(self, pm, rank, prefill, pre_micro, decode, caches, *, greedy, new, eos, pad,
                 input_ids, hook, positions):
        self.positions = positions
        self.executor, self.rank, self.caches = pm.executor, rank, caches
        self.stage, self.last = pm.stage_of(rank), pm.spec.axis_size(PP) - 1
        self.m, self.new, self.pad, self.hook = pm.microbatches, new, pad, hook
        self.greedy, self.eos = greedy, eos
        self.prompt = input_ids.shape[1]
        self.out_dtype, self.out_device = input_ids.dtype, input_ids.device
        self.mesh_device = torch.device(pm.spec.device_type)
        self.b = input_ids.shape[0] // self.m
        self.pre_micro = pre_micro
        self.programs = {    # step < 0: the prefill; else decode: (Compiled, stage program)
            phase: (c, c.programs[self.stage])
            for phase, c in ((True, prefill), (False, decode)) if c is not None}
        self.tokens: list[list[torch.Tensor]] = [[] for _ in range(self.m)]
        self.unfinished = [torch.ones(self.b, dtype=torch.bool, device=self.out_device)
                           for _ in range(self.m)]
        self.done = [False] * self.m

    def _take(self, j: int, tok: torch.Tensor) -> None:
        if self.eos is not None:
            tok = torch.where(self.unfinished[j], tok, torch.full_like(tok, self.pad))
            self.unfinished[j] = self.unfinished[j] & ~torch.isin(tok, self.eos)
            self.done[j] = not bool(self.unfinished[j].any())
        self.tokens[j].append(tok)

    def _run(self, t: int, j: int, backend) -> None:
        c, program = self.programs[t < 0]
        flat = self.pre_micro[j] if t < 0 else _flat(self.tokens[j][t], self.prompt + t,
                                                           self.positions)
        mod = self.executor.runner(c, self.rank, flat)
        if self.hook is not None:
            self.hook(self.rank, self.stage, t, j)
        out = mod(*bind_inputs(flat, program, self.caches.state[self.rank], j, self.m))
        if self.stage != self.last:
            return
        tok = self.greedy(c, out).to(device=self.out_device, dtype=self.out_dtype)
        self._take(j, tok)
        sent = self.tokens[j][-1].to(self.mesh_device)
        for dst in range(self.last):
            backend.send(sent, PP, dst)

    def _receive(self, j: int, backend) -> None:
        tok = backend.recv([self.b], self.out_dtype, self.mesh_device, PP, self.last)
        self._take(j, tok.to(self.out_device))

    def __call__(self) -> torch.Tensor:
        from ..runtime.context import current_backend
        backend = current_backend("fxshard.generate")
        with torch.no_grad():   # per thread: simulated ranks are threads
            for t in range(-1, self.new):       # unit (t, j) makes token t + 1 of group j
                if 0 <= t < self.new - 1:
                    self.caches.step(t, ranks=[self.rank])
                for j in range(self.m):
                    if self.stage != self.last and t >= 0 and not self.done[j] and \
                            len(self.tokens[j]) == t:
                        self._receive(j, backend)          # token t, made by unit (t-1, j)
                    if self.done[j] or t == self.new - 1:
                        continue
                    self._run(t, j, backend)
                if all(self.done):
                    break
        length = max(len(toks) for toks in self.tokens)
        rows = [torch.stack(toks + [torch.full_like(toks[0], self.pad)
                                    for _ in range(length - len(toks))], dim=1)
                for toks in self.tokens]
        return torch.cat(rows, dim=0)


def pipelined_greedy(pm, input_ids: torch.Tensor, prefill, pre_micro: list[list], decode,
                     caches, *, greedy, new: int, eos: list[int], pad: int | None,
                     hook=None, positions=None) -> torch.Tensor:
    """The new tokens ``[B, n <= new]``, the same on every rank (see the module docstring).
    ``decode`` is the decode program's Compiled (None when ``new == 1``); ``greedy(c, out)``
    turns the last stage's flat outputs into the ``[b]`` argmax ids of the last position;
    ``positions``: how the decode program takes its position (``DecodePositions``)."""
    eos_t = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device) if eos else None
    decode_flat = None if decode is None else \
        _flat(input_ids[:input_ids.shape[0] // pm.microbatches, 0], 0, positions)

    def driver(rank: int) -> torch.Tensor:
        return _Rank(pm, rank, prefill, pre_micro, decode, caches, greedy=greedy, new=new,
                     eos=eos_t, pad=pad, input_ids=input_ids, hook=hook,
                     positions=positions)()

    bind = [(prefill, pre_micro[0])] + ([(decode, decode_flat)] if decode is not None else [])
    results = pm.executor.on_ranks(driver, bind)   # built (or compiled) here, not in threads
    assert all(torch.equal(x, results[0]) for x in results), "ranks' tokens differ"
    return results[0]
