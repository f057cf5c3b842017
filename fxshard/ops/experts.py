"""Expert parallelism's exchanges: per-expert row counts, and routed rows to their experts' ranks.

On a mesh axis of size ``n`` that splits a MoE layer's ``E`` experts by index, coordinate ``j``
holds experts ``j*E/n .. (j+1)*E/n - 1``. A rank's routed rows arrive sorted by expert (the
model's own sort), with ``offs`` their cumulative counts per expert (the grouped matmul's
offsets), so the rows for coordinate ``j``'s experts are one contiguous block::

    fxshard::expert_counts(Tensor offs, str axis, int size) -> Tensor            [n, E/n] int64
    fxshard::expert_dispatch(Tensor x, Tensor offs, Tensor counts, str axis, int size) -> Tensor
    fxshard::expert_combine(Tensor y, Tensor offs, Tensor counts, str axis, int size) -> Tensor

``expert_counts`` is the counts exchange (an all-to-all of equal blocks): row ``s`` of its
result holds how many rows coordinate ``s`` sends to each of this rank's experts.
``expert_dispatch(x [N, ...])`` sends every rank its experts' rows by one all-to-all with
variable split sizes (read from ``offs`` and ``counts`` at run time, never from the program)
and returns the received rows ordered by (local expert, source): the grouped matmul's layout,
with its offsets ``cumsum(counts.sum(0))``. Its first dim has the static bound ``n * N``
(every token of the group routed to this rank's experts: no capacity factor, nothing dropped);
rows past the counted ones are zeros, which the grouped matmul leaves out.
``expert_combine(y [n*N, ...])`` is its inverse (and adjoint): the counted rows go back to
their source ranks, which get ``[N, ...]`` in their own sorted order. The backward of each is
the other on the gradient, so a training graph's backward uses the same two ops.

A size-1 axis never reaches these ops (nothing is exchanged there).
"""
from __future__ import annotations

import torch

from fxshard.ops.collective_args import checked_backend
from fxshard.ops.library import define_op

__all__ = ["expert_counts", "expert_dispatch", "expert_combine", "EXPERT_OPS"]


def _own_counts(op: str, offs: torch.Tensor, size: int) -> torch.Tensor:
    """The rank's rows per expert from the cumulative ``offs`` [E], as int64 ``[size, E/size]``."""
    if offs.dim() != 1 or offs.numel() % size:
        raise ValueError(f"torch.ops.fxshard.{op}: offs of shape {list(offs.shape)} must hold "
                         f"one offset per expert, a multiple of the axis size {size}; give the "
                         f"expert-parallel axis a size that divides the experts")
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    return counts.view(size, -1)


@define_op("fxshard::expert_counts", "(Tensor offs, str axis, int size) -> Tensor")
def expert_counts(offs, axis, size):
    backend = checked_backend("expert_counts", axis, size)
    own = _own_counts("expert_counts", offs, size)
    return backend.all_to_all(own.contiguous(), 0, 0, axis)


@expert_counts.register_fake
def _(offs, axis, size):
    return offs.new_empty((size, offs.shape[0] // size), dtype=torch.int64)


def _splits(offs: torch.Tensor, counts: torch.Tensor, size: int):
    """Rows sent to each coordinate, rows received from each, and the received block sizes in
    (source, local expert) order."""
    sent = _own_counts("expert_dispatch", offs, size).sum(1).tolist()
    return sent, counts.sum(1).tolist(), counts.flatten().tolist()


def _check_rows(op: str, x: torch.Tensor, offs: torch.Tensor, rows: int) -> None:
    if x.dim() == 0 or x.shape[0] != rows:
        raise ValueError(f"torch.ops.fxshard.{op}: x of shape {list(x.shape)} must have "
                         f"{rows} rows (the routed rows counted by offs); the routing region "
                         f"was rewritten for other shapes")


@define_op("fxshard::expert_dispatch",
           "(Tensor x, Tensor offs, Tensor counts, str axis, int size) -> Tensor")
def expert_dispatch(x, offs, counts, axis, size):
    backend = checked_backend("expert_dispatch", axis, size)
    n = x.shape[0]
    _check_rows("expert_dispatch", x, offs, int(offs[-1]) if offs.numel() else 0)
    sent, received, blocks = _splits(offs, counts, size)
    got = backend.all_to_all_single(x.contiguous(), sent, received, axis)
    local = counts.shape[1]
    pieces = got.split(blocks)                  # (source, expert) order
    out = x.new_zeros((size * n, *x.shape[1:]))
    if sum(blocks):
        torch.cat([pieces[s * local + e] for e in range(local) for s in range(size)],
                  out=out[:sum(blocks)])
    return out


@expert_dispatch.register_fake
def _(x, offs, counts, axis, size):
    return x.new_empty((size * x.shape[0], *x.shape[1:]))


@define_op("fxshard::expert_combine",
           "(Tensor y, Tensor offs, Tensor counts, str axis, int size) -> Tensor")
def expert_combine(y, offs, counts, axis, size):
    backend = checked_backend("expert_combine", axis, size)
    if y.dim() == 0 or y.shape[0] % size:
        raise ValueError(f"torch.ops.fxshard.expert_combine: y of shape {list(y.shape)} must "
                         f"have a multiple of {size} rows (what expert_dispatch returned)")
    sent, received, blocks = _splits(offs, counts, size)
    local = counts.shape[1]
    by_expert = [counts[s, e] for e in range(local) for s in range(size)]
    pieces = y[:sum(blocks)].split(torch.stack(by_expert).tolist() if by_expert else [])
    back = [pieces[e * size + s] for s in range(size) for e in range(local)]
    rows = torch.cat(back) if back else y[:0]
    return backend.all_to_all_single(rows.contiguous(), received, sent, axis)


@expert_combine.register_fake
def _(y, offs, counts, axis, size):
    return y.new_empty((y.shape[0] // size, *y.shape[1:]))


EXPERT_OPS = frozenset({expert_counts.default, expert_dispatch.default, expert_combine.default})
"""The expert-parallel exchanges (collectives over one axis group)."""
