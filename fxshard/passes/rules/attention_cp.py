"""CPU flash attention and its backward (joint training graphs) on the context-parallel axes.

Layout legend: q/out/grad_out ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]``, lse ``[B, Hq, S]``
(its sequence is dim 2 too), mask ``[B|1, H|1, S, S]``.

- ``ring_cp``: every tensor stays sequence-sharded (dim 2; zigzag like the rest of the
  sequence); the ``ring`` note makes ``fxshard.training.context_parallel`` lower the forward to
  ``fxshard::ring_attention`` (whose lse is the global one, saved) and the backward to
  ``fxshard::ring_attention_backward``. A mask is sharded by its query rows like q, its key
  columns whole::

      _flash_for_cpu(q: S(2), k: S(2), v: S(2))           -> [out S(2), lse S(2)]   (ring)
      _flash_for_cpu_backward(g, q, k, v, out, lse: S(2)) -> [dq, dk, dv S(2)]      (ring)

- ``ulysses_cp``: the sequence shard is traded for a heads shard (the redistribution table's
  all-to-all), attention runs on whole sequences of the rank's heads, and its results go back
  to the sequence shard where their users need it; the backward's inputs (grad_out, and the
  saved q, k, v, out, lse) take the same heads shard, so its all-to-alls are the forward's
  inverse::

      _flash_for_cpu(q: S(2), ...)            -> needs S(1) (all-to-all), out [S(1), S(1)]
      _flash_for_cpu_backward(g: S(2), ...)   -> needs S(1) (g: all-to-all), out [S(1)] * 3

  Both heads counts (after the heads axes before it in mesh order) must divide by the axis.
  With ``ring_cp`` too (USP) the heads shard on ``ulysses_cp`` and the sequence shard on
  ``ring_cp`` compose: the ring runs on the rank's heads. With ``ring_cp`` before
  ``ulysses_cp`` in the mesh the trade is one all-to-all each way; with ``ulysses_cp`` first
  the redistribution table moves the sequence by gathers and slices (correct, more bytes:
  inference's segmented ring layout is not used in training yet).
  Each result the attention's users read (out; dq, dk, dv) passes a ``ulysses_out`` marker
  (``fxshard.training.context_parallel``, dropped after ``insert_collectives``) whose rule
  moves it back to the sequence shard right away (``then``), as inference's SDPA rule does::

      getitem(flash, 0): S(1) -> ulysses_out -> all_to_all(x, 2, 1, 'ulysses_cp', 2): S(2)
"""
from __future__ import annotations

import torch.fx as fx

from ...mesh import RING, TP, ULYSSES
from ...placement import R, Shard
from . import Decision, RuleCtx, rule, tensor_inputs
from .attention import _note

__all__ = ["sequence_decision", "ulysses_out"]


def ulysses_out(x):
    """Identity: marks an attention result to go back to the sequence shard on ulysses_cp."""
    return x


@rule(ulysses_out)
def ulysses_out_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    p = ins[0]
    if ctx.axis == ULYSSES and p == Shard(1) and ctx.shape(node)[2] % ctx.size == 0:
        return Decision(ins=[p], out=p, then=Shard(2))
    return Decision(ins=[p], out=p)


def sequence_decision(node: fx.Node, ins: list, ctx: RuleCtx, q: fx.Node, k: fx.Node,
                      mask: fx.Node | None, n_out: int) -> Decision | None:
    """The decision on a CP axis when a tensor input arrives sequence-sharded, else None."""
    if ctx.axis not in (RING, ULYSSES):
        return None
    tensors = tensor_inputs(node)
    if not any(isinstance(p, Shard) and p.dim == 2 and t is not mask
               for p, t in zip(ins, tensors)):
        return None
    if ctx.axis == RING:
        _note(node, "ring", ctx.axis)
        return Decision(ins=[_mask_need(t, q, 2, ctx) if t is mask else Shard(2)
                             for t in tensors], out=[Shard(2)] * n_out)
    names = ctx.mesh.axis_names
    outer = [a for a in names[:names.index(ctx.axis)]
             if a == TP and ctx.mesh.axis_size(a) > 1]
    for what, t in (("query", q), ("key/value", k)):
        heads = ctx.shape(t)[1]
        for a in outer:
            heads //= ctx.mesh.axis_size(a)
        if heads % ctx.size:
            raise NotImplementedError(
                f"fxshard.training: attention {node.name} has {heads} {what} heads per rank, "
                f"which mesh axis {ctx.axis!r} of size {ctx.size} (mesh "
                f"{ctx.mesh.describe()}) cannot split: Ulysses trades the sequence shard for "
                f"a heads shard. Use a {ctx.axis} size dividing {heads}, or {RING}")
    return Decision(ins=[_mask_need(t, q, 1, ctx) if t is mask else Shard(1)
                         for t in tensors], out=[Shard(1)] * n_out)


def _mask_need(mask: fx.Node, q: fx.Node, dim: int, ctx: RuleCtx):
    """The mask follows q's shard of ``dim`` where it has that dim whole, else Replicate."""
    md = dim + ctx.ndim(mask) - 4
    whole = ctx.shape(q)[dim]
    return Shard(md) if md >= 0 and ctx.shape(mask)[md] == whole and whole > 1 else R
