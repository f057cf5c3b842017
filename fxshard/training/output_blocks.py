"""Where a training output kept as ``tp`` blocks (the logits, :mod:`fxshard.training.vocab_output`)
has its blocks: which ranks hold them, which is a rank's, and their slots among the outputs.

A mixin of :class:`fxshard.training.module.TrainModule` (it reads ``spec``, ``mesh``,
``ranks`` and whether the mesh is simulated)::

    dp=2 x tp=2, logits kept (S(0), S(2)):   block ranks [0, 1, 2, 3]   (row 0: tp 0, 1; row 1)
    outputs: (logits_block_of_rank0, ..., logits_rank1, logits_rank2, logits_rank3)
"""
from __future__ import annotations

import math

__all__ = ["OutputBlocks"]


class OutputBlocks:
    """The kept outputs' block bookkeeping of a trainer."""

    def _block_axes(self, program) -> tuple:
        """The batch axes (``((axis, size), ...)``, mesh order) that split the kept outputs'
        dim 0 (every kept output is placed alike: the logits)."""
        from ..mesh import BATCH_AXES
        from ..placement import Shard
        spec = next(iter(program.vocab_outputs.values()))
        return tuple((a, n) for a, n, p in zip(self.spec.axis_names, self.spec.shape, spec)
                     if n > 1 and a in BATCH_AXES and p == Shard(0))

    def _block_ranks(self, program) -> list[int]:
        """The ranks whose blocks a kept output holds: each row group's (batch axes'
        coordinates, the outer axis first) ``tp`` blocks in order, coordinate 0 on every other
        axis (a simulated mesh); this process's rank (a real one)."""
        if not self._simulated:
            return list(self.ranks)
        from ..mesh import TP
        names = self.spec.axis_names
        axes = [names.index(a) for a, _ in self._block_axes(program)]
        sizes = [self.spec.shape[i] for i in axes]
        tp = names.index(TP)
        out = []
        for row in range(math.prod(sizes)):
            coords = [0] * len(names)
            rest = row
            for i, n in reversed(list(zip(axes, sizes))):
                coords[i], rest = rest % n, rest // n
            for c in range(self.spec.shape[tp]):
                coords[tp] = c
                out.append(self.spec.rank_of(coords))
        return out

    def _block_of(self, program, rank: int) -> int:
        """Which of the held blocks is ``rank``'s (its row group's, then its ``tp``
        coordinate; a real mesh: 0)."""
        if not self._simulated:
            return 0
        from ..mesh import TP
        names, coords = self.spec.axis_names, self.spec.coords(rank)
        row = 0
        for a, n in self._block_axes(program):
            row = row * n + coords[names.index(a)]
        return row * self.spec.axis_size(TP) + coords[names.index(TP)]

    def _tangent_slots(self, program) -> dict:
        """Output index -> the positions of its blocks among ``_Step``'s outputs (the
        output's own position, then the extra blocks after the model's outputs)."""
        slots, nxt = {}, program.split.n_outputs
        if not program.vocab_outputs:
            return slots
        extra = len(self._block_ranks(program)) - 1
        for i in sorted(program.vocab_outputs):
            slots[i] = [i] + list(range(nxt, nxt + extra))
            nxt += extra
        return slots

    def _vocab_blocks(self, program, valid: int | None = None):
        """The blocks' grid; ``valid``: the vocab where the blocks hold it padded (the
        columns past it are never read)."""
        from ..mesh import TP
        from .vocab_blocks import Blocks
        n = self.spec.axis_size(TP)
        data = self._block_axes(program)
        rows = math.prod(size for _, size in data)
        if self._simulated:
            return Blocks(n, list(range(n)), rows=rows, data_axes=data, valid=valid)
        from ..runtime.distributed import backend_for
        backend = backend_for(self.mesh)
        row = 0
        for a, size in data:
            row = row * size + backend.axis_index(a)
        return Blocks(n, [backend.axis_index(TP)], backend, rows=rows, row_coords=[row],
                      data_axes=data, valid=valid)
