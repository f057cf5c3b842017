"""Where a decode step's position comes from, for any causal LM that takes token ids.

A decode step runs one new token per sequence at position ``S + t``. A model learns it in one
of two ways, tried in this order when the first decode program is built:

1. **A forward argument of positions**, whatever it is called: HuggingFace ``position_ids``,
   litgpt / torchtune ``input_pos``, torchtitan ``positions``. The candidates are the forward's
   parameters (after the token ids) whose name speaks of positions; each is passed as a
   ``[B, 1]`` int64 tensor of ``S + t`` (HuggingFace, torchtune, torchtitan) or, where the
   model cannot be traced with that, as ``[1]`` (positions of the sequence, shared by the
   batch). Whether the model really uses it is read from the traced graph
   (:func:`fxshard.passes.decode_positions.decode_positions_pass`: an integer input the graph
   uses); a candidate the model cannot be traced with (litgpt's ``input_pos`` asks for
   litgpt's own KV cache) or leaves unused is dropped.
2. **Positions derived from the sequence length** inside the model (``torch.arange(T)``, a RoPE
   table sliced ``[:T]``, a learned position embedding of ``arange(T)``): the decode program is
   traced with the token ids alone and its position sources are rewritten to start at the
   cache position (the state input ``cache_position``, ``S + t``, that
   :class:`fxshard.generation.cache.Caches` fills each step).

A model neither way fits gets an error naming what was tried and why it failed; so does one
whose prompt's forward derives positions from its length while its decode step shows no
source to move (it would decode every new token at position 0).
"""
from __future__ import annotations

import inspect

import torch

from .cache import prefill_placements

__all__ = ["DecodePositions", "position_candidates", "decode_program"]

_WHERE = "ParallelModule.generate"


def position_candidates(model) -> list[str]:
    """The forward's parameters after the first whose name speaks of positions, HuggingFace's
    ``position_ids`` first."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and "pos" in p.name.lower()]
    return sorted(names, key=lambda n: n != "position_ids")


class DecodePositions:
    """How the decode program takes its position: ``name``, an argument of shape ``[B, 1]``
    (``batched``) or ``[1]``, or ``None`` (derived inside the model from the
    ``cache_position`` state); and ``pinned``, the prefill's weight placements the program
    adopts (:func:`fxshard.generation.cache.prefill_placements`; ``()``: its own plan)."""

    def __init__(self, name: str | None, batched: bool = True):
        self.name, self.batched = name, batched
        self.pinned: tuple = ()

    def program(self, pm, tokens: torch.Tensor, position: int, generation: tuple, extra: dict):
        """The decode program and microbatches for ``tokens`` ``[B, 1]`` at ``position``."""
        kwargs = {**extra, **self.kwargs(tokens.shape[0], position, tokens.device)}
        return pm.programs.get((tokens,), kwargs, generation=generation, pinned=self.pinned)

    def kwargs(self, batch: int, position: int, device) -> dict:
        if self.name is None:
            return {}
        shape = (batch, 1) if self.batched else (1,)
        return {self.name: torch.full(shape, position, dtype=torch.int64, device=device)}

    def describe(self) -> str:
        if self.name is None:
            return "the token ids alone (positions derived inside the model)"
        return f"passing {self.name!r} as a {'[B, 1]' if self.batched else '[1]'} tensor of " \
               f"positions"

    def __repr__(self) -> str:
        return f"DecodePositions({self.name!r}, batched={self.batched})"


def decode_program(pm, tokens: torch.Tensor, position: int, generation: tuple, extra: dict,
                   prefill=None) -> tuple[object, list, DecodePositions]:
    """The decode program of ``generation`` for ``tokens`` ``[B, 1]`` at ``position``, the
    microbatches' flat inputs, and how its position is passed (tried as the module doc says).
    ``extra``: keyword arguments every call passes. ``prefill`` (the prompt's ``Compiled``,
    the prompt ``position`` tokens long): where it derives positions from the prompt's length
    and the decode step takes none, the decode step would sit at position 0: an error."""
    failures = []
    ways = [DecodePositions(n, b) for n in position_candidates(pm.model) for b in (True, False)]
    for way in ways + [DecodePositions(None)]:
        name = way.name
        try:
            c, micro = way.program(pm, tokens, position, generation, extra)
        except Exception as e:  # noqa: BLE001 - every way is tried, the errors are reported
            failures.append((way, e))
            continue
        found = c.ctx.reports.get("decode_positions_pass", {})
        if name is not None and not found.get("position_inputs"):
            failures.append((way, "the model does not use it"))
            continue
        if name is None and not found.get("rewritten") and prefill is not None:
            _check_prompt_positions(pm, prefill, position)
        if prefill is not None:
            way.pinned = prefill_placements(prefill, c)
            if way.pinned:   # the prompt's cache layout stands: built again, adopting it
                c, micro = way.program(pm, tokens, position, generation, extra)
        return c, micro, way
    tried = "; ".join(
        f"{w.describe()}: {type(e).__name__ + ': ' if isinstance(e, Exception) else ''}"
        f"{str(e)[:400]}" for w, e in failures)
    last = failures[-1][1]
    raise NotImplementedError(
        f"{_WHERE}: cannot build the one-token decode step of {type(pm.model).__name__} at "
        f"position {position}. Tried {tried}. A decode step needs the new token's position: "
        f"give the forward an optional positions argument (e.g. position_ids, [B, S] int64) "
        f"that indexes its RoPE table or position embedding, or derive positions from "
        f"torch.arange(T) / table[:T] inside") from (last if isinstance(last, Exception)
                                                     else None)


def _check_prompt_positions(pm, prefill, prompt: int) -> None:
    from ..passes.decode_positions import position_sources
    found = position_sources(prefill.traced.gm.graph, prompt, check=False)
    if found:
        names = ", ".join(n.name for _, n in found[:3])
        raise NotImplementedError(
            f"{_WHERE}: {type(pm.model).__name__}'s forward derives positions from the prompt's "
            f"length ({names}: {found[0][0]} of {prompt}), but fxshard found no such source in "
            f"the one-token decode step to move to the cache position, so the new tokens would "
            f"sit at position 0. Give the forward an optional positions argument (e.g. "
            f"position_ids, [B, S] int64) that indexes its RoPE table or position embedding")
