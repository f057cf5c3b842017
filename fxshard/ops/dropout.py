"""``fxshard::dropout_mask(seed, site, shape, p, device)``: dropout site ``site``'s keep-mask
(bool, ``shape``, the whole unsharded value's) for the step packed in ``seed``, drawn from a
private generator on ``device`` seeded from (step, site): the same numbers on every rank and
every mesh (``fxshard/training/dropout.py`` rewrites the forward's dropouts to use it)::

    before: dropout = dropout(add_1, 0.1, True)
    after:  dropout_mask = fxshard.dropout_mask(dropout_seed, 0, [4, 6, 48], 0.1, cpu)
            mul = mul(add_1, dropout_mask); dropout = mul(mul, 1.1111111111111112)

``seed`` is a 0-d int64 on the host: the step seed with a pipeline microbatch's index and the
microbatch count packed below it (:func:`pack_seed`; a microbatch keeps its rows of the
whole batch's mask).
"""
from __future__ import annotations

import torch

from fxshard.ops.library import define_op

__all__ = ["draw_mask", "dropout_mask", "pack_seed"]

_MB = 1 << 12          # microbatch index and count are packed below the step seed


def pack_seed(step: int, microbatch: int = 0, microbatches: int = 1) -> torch.Tensor:
    """The program's seed input: a 0-d int64 (so no batch or sequence axis splits it)."""
    return torch.tensor((step * _MB + microbatch) * _MB + microbatches, dtype=torch.int64,
                        device="cpu")   # read on the host by fxshard::dropout_mask


def _generator_seed(step: int, site: int) -> int:
    """(step seed, site) mixed into one 63-bit generator seed (splitmix64's finalizer)."""
    z = (step * 0x9E3779B97F4A7C15 + (site + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) >> 1


def draw_mask(step: int, site: int, shape, p: float, device) -> torch.Tensor:
    """Site ``site``'s keep-mask (bool, ``shape``) of step ``step``: what every mesh draws."""
    g = torch.Generator(device=device)
    g.manual_seed(_generator_seed(step, site))
    return torch.rand(tuple(shape), generator=g, device=device) >= p


@define_op("fxshard::dropout_mask",
           "(Tensor seed, int site, int[] shape, float p, Device device) -> Tensor")
def dropout_mask(seed: torch.Tensor, site: int, shape: list, p: float,
                 device: torch.device) -> torch.Tensor:
    packed = int(seed.item())
    step, rest = divmod(packed, _MB * _MB)
    i, m = divmod(rest, _MB)
    rows = shape[0] if shape else 1
    whole = draw_mask(step, site, [rows * m, *shape[1:]] if shape else [], p, device)
    return whole[i * rows:(i + 1) * rows] if shape and m > 1 else whole


@dropout_mask.register_fake
def _(seed, site, shape, p, device):
    return torch.empty(tuple(shape), dtype=torch.bool, device=device)
