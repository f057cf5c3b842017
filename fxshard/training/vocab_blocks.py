"""Where the blocks of a sharded ``pm(x)`` output live, and the collectives between them.

An output the forward holds sharded on its last dim over ``tp`` (the logits of a column-parallel
``lm_head``) and on its dim 0 over the batch axes (``dp``, ``fsdp``) leaves the program as each
rank's block, a grid of row groups by vocab blocks::

    whole [B, S, V]            dp=2, tp=2:   row group 0: [B/2, S, V/2] [B/2, S, V/2]
                                             row group 1: [B/2, S, V/2] [B/2, S, V/2]

A simulated mesh holds every block (row-major: row group, then ``tp`` block); a real one
(``torchrun``) this rank's. Reductions over the vocab (max, sum-exp, picked targets) run within
a row group over ``tp``; a loss's sum over rows runs over the batch axes (an all-reduce whose
backward is the identity: every rank computes the same loss, and each rank's rows reach it
only through its own share). :mod:`fxshard.training.vocab_output` builds the tensor on top;
the math its loss ops run on the blocks is here too: ``log_softmax`` / ``softmax`` over the
whole vocab (:class:`Normalized`), the picked targets (:class:`Pick`), the sum over the
vocab (:class:`Sum`), and a cross-entropy's per-row ``logsumexp(x) - x[t]`` in one piece
(:class:`CrossEntropyRows`: one logits-sized temporary in the forward and one, the
gradient, in the backward, where log-softmax then pick make four), each with its backward.
"""
from __future__ import annotations

import torch

from ..mesh import TP

__all__ = ["Blocks", "Normalized", "Pick", "Sum", "CrossEntropyRows"]


class Blocks:
    """A sharded output's grid: ``n`` blocks of the last dim over ``axis`` (``coords``: the
    ``tp`` coordinates held per row group), and ``rows`` row groups of dim 0 over the batch
    axes ``data_axes`` (``((axis, size), ...)`` in mesh order; ``row_coords``: the row
    groups held). ``backend``: the real mesh's (None: a simulated mesh, every block held)."""

    def __init__(self, n: int, coords: list[int], backend=None, axis: str = TP,
                 rows: int = 1, row_coords: list[int] | None = None,
                 data_axes: tuple = (), valid: int | None = None):
        self.n, self.coords, self.backend, self.axis = n, list(coords), backend, axis
        self.valid = valid      # a vocab padded for tp: the columns past it are never read
        self.rows, self.data_axes = rows, tuple(data_axes)
        self.row_coords = list(row_coords) if row_coords is not None else list(range(rows))

    def describe(self) -> str:
        """The blocks' axes, e.g. ``dp=2, tp=2``."""
        return ", ".join(f"{a}={n}" for a, n in (*self.data_axes, (self.axis, self.n)))

    @property
    def per_row(self) -> int:
        """Blocks held per row group."""
        return len(self.coords)

    def groups(self, parts: list) -> list[list]:
        """``parts`` (one per held block) cut into their row groups."""
        k = self.per_row
        return [parts[i:i + k] for i in range(0, len(parts), k)]

    # -- within a row group, over tp ---------------------------------------------------------
    def sum(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every block's share summed over ``tp`` (each block gets its row group's total)."""
        if self.backend is None:
            out = []
            for group in self.groups(parts):
                total = group[0]
                for p in group[1:]:
                    total = total + p
                out += [total] * len(group)
            return out
        return [self.backend.all_reduce(parts[0], self.axis)]

    def max(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.backend is None:
            out = []
            for group in self.groups(parts):
                top = group[0]
                for p in group[1:]:
                    top = torch.maximum(top, p)
                out += [top] * len(group)
            return out
        import torch.distributed as dist
        top = parts[0].contiguous().clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX,
                        group=self.backend.device_mesh.get_group(self.axis))
        return [top]

    def firsts(self, parts: list) -> list:
        """One value per held row group (of values every block of the group shares)."""
        return [g[0] for g in self.groups(parts)]

    def starts(self, widths: list[int]) -> list[int]:
        """Each held block's first vocab index (blocks of one real mesh have equal widths)."""
        if self.backend is None:
            first = widths[:self.per_row]
            return [sum(first[:i]) for i in range(len(first))] * (len(widths) // self.per_row)
        return [self.coords[0] * widths[0]]

    def classes(self, widths: list[int]) -> int:
        """The whole last dim's size (the model's vocab where it is padded for tp)."""
        if self.valid is not None:
            return self.valid
        return sum(widths[:self.per_row]) if self.backend is None else self.n * widths[0]

    def check_indices(self, indices: list, widths: list[int], where: str) -> None:
        """One device's ``IndexError`` for an index outside the whole last dim: no block
        would hold it, and the pick would add 0 silently (ignored targets come here as 0)."""
        from ..ops.loss import check_targets
        limit = self.classes(widths)
        for index in {id(i): i for i in indices}.values():
            check_targets(index, None, limit, where)

    # -- a vocab padded for tp (fxshard.passes.pad_vocab) --------------------------------------
    def pad_masks(self, xs: list[torch.Tensor]) -> list:
        """Per block, a bool mask of its columns past ``valid`` (None: it has none)."""
        if self.valid is None:
            return [None] * len(xs)
        out = []
        for x, lo in zip(xs, self.starts([x.shape[-1] for x in xs])):
            w = x.shape[-1]
            out.append(None if lo + w <= self.valid else
                       torch.arange(lo, lo + w, device=x.device) >= self.valid)
        return out

    def valid_widths(self, xs: list[torch.Tensor]) -> list[int]:
        """Per block, how many of its columns (the first ones) are the vocab's."""
        widths = [x.shape[-1] for x in xs]
        if self.valid is None:
            return widths
        return [max(0, min(w, self.valid - lo)) for w, lo in zip(widths, self.starts(widths))]

    def masked(self, xs: list[torch.Tensor], fill: float) -> list[torch.Tensor]:
        """``xs`` with their padded columns set to ``fill`` (a new tensor where a block has
        any: the last ``tp`` block only)."""
        return [x if m is None else x.masked_fill(m, fill)
                for x, m in zip(xs, self.pad_masks(xs))]

    # -- over the batch axes -----------------------------------------------------------------
    def row_slice(self, t: torch.Tensor, g: int) -> torch.Tensor:
        """The rows of the whole tensor ``t`` (dim 0) the ``g``-th held row group has."""
        if self.rows == 1:
            return t
        size = t.shape[0] // self.rows
        return t.narrow(0, self.row_coords[g] * size, size)

    def row_sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The sum over every row group of one value per held row group (differentiable)."""
        total = values[0]
        for v in values[1:]:
            total = total + v
        if self.backend is None or self.rows == 1:
            return total
        return _RowSum.apply(self, total)

    def row_cat(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from one dim-0 piece per held row group (differentiable)."""
        if self.rows == 1:
            return values[0]
        if self.backend is None:
            return torch.cat(values, 0)
        return _RowGather.apply(self, values[0])

    def gather(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor (differentiable: its gradient is sliced back to the blocks)."""
        if self.backend is None:
            out = self.row_cat([torch.cat(g, -1) for g in self.groups(blocks)])
        else:
            out = self.row_cat([_Gather.apply(self, blocks[0])])
        return out if self.valid is None else out.narrow(-1, 0, self.valid)


class _Gather(torch.autograd.Function):
    """A real mesh's all-gather over ``tp``; its backward: this rank's slice of the
    gradient (every rank's loss is the same function of the whole tensor)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, block):
        ctx.width, ctx.start = block.shape[-1], blocks.coords[0] * block.shape[-1]
        return blocks.backend.all_gather(block.contiguous(), block.dim() - 1, blocks.axis)

    @staticmethod
    def backward(ctx, g):
        return None, g.narrow(-1, ctx.start, ctx.width).contiguous()


class _RowGather(torch.autograd.Function):
    """A real mesh's all-gather of dim 0 over the batch axes (the inner axis first, so the
    row groups land in order); its backward: this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, blocks: Blocks, piece):
        ctx.rows, ctx.start = piece.shape[0], blocks.row_coords[0] * piece.shape[0]
        out = piece.contiguous()
        for axis, _ in reversed(blocks.data_axes):
            out = blocks.backend.all_gather(out, 0, axis)
        return out

    @staticmethod
    def backward(ctx, g):
        return None, g.narrow(0, ctx.start, ctx.rows).contiguous()


class _RowSum(torch.autograd.Function):
    """A real mesh's all-reduce over the batch axes of a loss's share; its backward is the
    identity (the same loss on every rank: this rank's share reaches it once)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, value):
        out = value.contiguous().clone()
        for axis, _ in blocks.data_axes:
            out = blocks.backend.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, g):
        return None, g


# -- the math of a loss on the blocks (fxshard.training.vocab_output calls these) -------------

def _log_softmax(blocks: Blocks, xs) -> list[torch.Tensor]:
    """``log_softmax`` over the whole last dim, per block (fp32 inside, as PyTorch's kernels
    accumulate; a row of ``-inf`` gives NaN, as theirs)."""
    xf = blocks.masked([x.float() for x in xs], float("-inf"))
    top = blocks.max([x.amax(-1, keepdim=True) for x in xf])
    top = [torch.where(torch.isfinite(t), t, torch.zeros_like(t)) for t in top]
    zs = [x - t for x, t in zip(xf, top)]     # one [rows, V/tp] buffer per block: the result
    sums = blocks.sum([z.exp().sum(-1, keepdim=True) for z in zs])
    return [z.sub_(s.log()).to(xs[0].dtype) for z, s in zip(zs, sums)]


class Normalized(torch.autograd.Function):
    """``log_softmax`` (``log=True``) or ``softmax`` from the blocks; the backward sums one
    value per row over the axis (the gradient's row sum, or its dot with the softmax)."""

    @staticmethod
    def forward(ctx, blocks: Blocks, log: bool, *xs):
        outs = _log_softmax(blocks, xs)
        if not log:
            outs = [lp.float().exp().to(lp.dtype) for lp in outs]
        ctx.blocks, ctx.log = blocks, log
        ctx.save_for_backward(*outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        outs = ctx.saved_tensors
        gs = [torch.zeros_like(o) if g is None else g.float() for g, o in zip(gs, outs)]
        if ctx.log:     # d log_softmax: g - softmax * sum(g)
            rows = ctx.blocks.sum([g.sum(-1, keepdim=True) for g in gs])
            grads = []
            for g, o, r in zip(gs, outs, rows):     # one new [rows, V/tp] buffer per block
                e = o.float().exp().mul_(r)         # (o is saved: not written)
                grads.append(torch.sub(g, e, out=e))
        else:           # d softmax: softmax * (g - sum(g * softmax))
            rows = ctx.blocks.sum([(g * o.float()).sum(-1, keepdim=True)
                                   for g, o in zip(gs, outs)])
            grads = [o.float() * (g - r) for g, o, r in zip(gs, outs, rows)]
        grads = ctx.blocks.masked(grads, 0.0)     # (a padded vocab's columns: no gradient)
        return (None, None, *[g.to(o.dtype) for g, o in zip(grads, outs)])


class Pick(torch.autograd.Function):
    """``x.gather(-1, index)`` from the blocks: each picks the indices in its vocab range
    (zeros elsewhere), summed over ``tp``; one result per row group (``indices``: each
    block's rows of the index). The backward scatters into each block."""

    @staticmethod
    def forward(ctx, blocks: Blocks, indices, starts, *xs):
        blocks.check_indices(indices, [x.shape[-1] for x in xs],
                             f"gather over the vocab blocks of pm(x)'s output ({blocks.describe()})")
        parts = []
        for x, index, lo in zip(xs, indices, starts):
            local = index - lo
            inside = (local >= 0) & (local < x.shape[-1])
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1))
            parts.append(torch.where(inside, picked, torch.zeros_like(picked)))
        ctx.blocks, ctx.indices, ctx.starts = blocks, indices, starts
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(blocks.firsts(blocks.sum(parts)))

    @staticmethod
    def backward(ctx, *gs):
        grads, k = [], ctx.blocks.per_row
        for i, ((shape, dtype, device), index, lo) in enumerate(
                zip(ctx.shapes, ctx.indices, ctx.starts)):
            out = torch.zeros(shape, dtype=dtype, device=device)
            g = gs[i // k]
            if g is not None:
                local = index - lo
                inside = (local >= 0) & (local < shape[-1])
                out.scatter_add_(-1, local.clamp(0, shape[-1] - 1),
                                 torch.where(inside, g, torch.zeros_like(g)).to(dtype))
            grads.append(out)
        return (None, None, None, *grads)


class Sum(torch.autograd.Function):
    """The sum over the whole last dim (each block's share, summed over ``tp``): one result
    per row group."""

    @staticmethod
    def forward(ctx, blocks: Blocks, *xs):
        ctx.metas, ctx.k = [(x.shape, x.dtype, x.device) for x in xs], blocks.per_row
        ctx.blocks = blocks
        xs = blocks.masked(list(xs), 0.0)      # (a padded vocab's columns: not summed)
        return tuple(blocks.firsts(blocks.sum([x.sum(-1) for x in xs])))

    @staticmethod
    def backward(ctx, *gs):
        grads = [torch.zeros(s, dtype=dt, device=dev) if gs[i // ctx.k] is None else
                 gs[i // ctx.k].unsqueeze(-1).expand(s)
                 for i, (s, dt, dev) in enumerate(ctx.metas)]
        return (None, *ctx.blocks.masked(grads, 0.0))


class CrossEntropyRows(torch.autograd.Function):
    """Per row, ``logsumexp(x) - x[t]`` over the whole vocab from the blocks (``t``: each
    block's rows of the target, in range; the caller masks ignored rows): one result per
    row group. Saves the blocks and each row's ``logsumexp``, not the log-probabilities;
    the backward is ``g * (softmax - onehot(t))`` written into one new buffer per block::

        forward:  m = max(amax(x)), s = sum(exp(x - m))       (over tp)   lse = m + log(s)
                  nll = lse - x[t]                           (x[t] from the block holding t)
        backward: dx = exp(x - lse) * g;  dx[t] -= g          (no collective)
    """

    @staticmethod
    def forward(ctx, blocks: Blocks, indices, starts, *xs):
        # a padded vocab (Blocks.valid): the columns past it are read nowhere (no copy)
        blocks.check_indices(indices, [x.shape[-1] for x in xs],
                             f"cross_entropy over the vocab blocks of pm(x)'s output "
                             f"({blocks.describe()})")
        widths = blocks.valid_widths(list(xs))
        # the maxima in the blocks' dtype (exact), everything after in float32 a slice of
        # rows at a time: no float32 copy of a bf16 block (fxshard/ops/loss.py's slices)
        top = blocks.max([x.narrow(-1, 0, w).amax(-1, keepdim=True).float() if w else
                          x.new_full((*x.shape[:-1], 1), float("-inf"), dtype=torch.float32)
                          for x, w in zip(xs, widths)])
        top = [torch.where(torch.isfinite(t), t, torch.zeros_like(t)) for t in top]
        sums = blocks.sum([_sum_exp(x.narrow(-1, 0, w), t) for x, t, w in zip(xs, top, widths)])
        lse = [t + s.log() for t, s in zip(top, sums)]
        parts = []
        for x, index, lo, w in zip(xs, indices, starts, widths):
            local = index - lo
            inside = (local >= 0) & (local < w)
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1)).float()
            parts.append(torch.where(inside, picked, torch.zeros_like(picked)))
        picked = blocks.sum(parts)
        ctx.blocks, ctx.indices, ctx.starts, ctx.widths = blocks, indices, starts, widths
        ctx.save_for_backward(*xs, *lse)
        return tuple((l - p).squeeze(-1).to(xs[0].dtype)
                     for l, p in zip(blocks.firsts(lse), blocks.firsts(picked)))

    @staticmethod
    def backward(ctx, *gs):
        saved, k = ctx.saved_tensors, ctx.blocks.per_row
        n = len(saved) // 2
        grads = []
        for i, (x, lse, index, lo, w) in enumerate(zip(saved[:n], saved[n:], ctx.indices,
                                                       ctx.starts, ctx.widths)):
            g = gs[i // k]
            if g is None:
                grads.append(torch.zeros_like(x))
                continue
            g = g.float().unsqueeze(-1)
            local = index - lo
            inside = (local >= 0) & (local < w)
            at = torch.where(inside, -g, torch.zeros_like(g))
            dx = torch.empty_like(x)      # the backward's one new buffer, in x's dtype
            for r0, r1 in _slices(x):
                d = torch.sub(x[r0:r1], lse[r0:r1]).exp_().mul_(g[r0:r1])   # float32 (promoted)
                d.narrow(-1, w, d.shape[-1] - w).zero_()    # (a padded vocab's columns)
                d.scatter_add_(-1, local[r0:r1].clamp(0, x.shape[-1] - 1), at[r0:r1])
                dx[r0:r1].copy_(d)
            grads.append(dx)
        return (None, None, None, *grads)


def _slices(x: torch.Tensor) -> list[tuple[int, int]]:
    """Ranges of ``x``'s rows (dim 0) whose float32 copy holds at most
    ``fxshard.ops.loss._SLICE_ELEMENTS`` values (all of them for a 1-d ``x``)."""
    from ..ops import loss
    if x.dim() < 2:
        return [(0, x.shape[0])] if x.dim() else [(0, 1)]
    step = max(1, loss._SLICE_ELEMENTS // max(1, x[0].numel()))
    return [(r, min(r + step, x.shape[0])) for r in range(0, x.shape[0], step)]


def _sum_exp(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``sum(exp(x - top), -1, keepdim=True)`` in float32, a slice of rows at a time."""
    out = torch.zeros((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x.shape[-1] == 0 or x.dim() < 2:
        return out if x.shape[-1] == 0 else torch.sub(x, top).exp_().sum(-1, keepdim=True)
    for r0, r1 in _slices(x):
        torch.sum(torch.sub(x[r0:r1], top[r0:r1]).exp_(), -1, keepdim=True, out=out[r0:r1])
    return out
