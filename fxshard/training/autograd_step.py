"""The autograd Function that joins the rank programs to ``loss.backward()``, and its checks.

``Step.apply(runner, program, n, *shards, *user)`` runs every rank's forward program and
returns the outputs; autograd's backward of them runs every rank's backward program with the
outputs' gradients and returns each shard's gradient::

    out = Step.apply(tm, program, 2, w0_rank0, w0_rank1, ids)    # forward programs
    out.sum().backward()                                        # backward programs -> w.grad
"""
from __future__ import annotations

import torch

__all__ = ["Step", "check_inputs_need_no_grad", "check_backward_once"]

_WHERE = "fxshard.training"


def check_inputs_need_no_grad(where: str, user: list) -> None:
    """A NotImplementedError for a user input that requires grad: the rank programs give
    gradients to the parameters only, so a module upstream of ``pm`` would get none."""
    for i, x in enumerate(user):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise NotImplementedError(
                f"{where}: input {i} (shape {tuple(x.shape)}, {x.dtype}) requires grad, and "
                f"fxshard does not yet compute gradients into its inputs (only into "
                f"pm.parameters()): whatever made it would get no gradient. Parallelize the "
                f"module that makes it together with the model, or pass it .detach()ed")


def check_backward_once(where: str, saved) -> None:
    """A clear error for a second backward through one forward (``retain_graph=True``): the
    rank programs' saved activations are freed by the first."""
    if saved is None:
        raise RuntimeError(
            f"{where}: a second backward through one pm(x) output (retain_graph=True?); "
            f"fxshard frees the ranks' saved activations in the first backward. Call pm(x) "
            f"again for another backward, or add the losses and call backward once")


class Step(torch.autograd.Function):
    """Every rank's forward; its backward is every rank's backward. Inputs: the runner, the
    number of shard tensors, every rank's shards (rank-major), then the user's tensors."""

    @staticmethod
    def forward(ctx, runner, program, n_shards: int, *flat):
        shards, user = flat[:n_shards], flat[n_shards:]
        outs, saved, extra = runner._run_forward(program, shards, user)
        ctx.runner, ctx.program, ctx.saved_per_rank = runner, program, saved
        ctx.n_user = len(user)
        # the backward reads the shards: autograd's version check makes an in-place change
        # between forward and backward (opt.step() before loss.backward()) its usual error,
        # as on one device, instead of gradients at the changed weights
        ctx.save_for_backward(*shards)
        outs = list(outs) + extra    # a vocab output's other blocks follow the outputs
        ctx.shapes = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None
                      for o in outs]
        ints = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        ctx.mark_non_differentiable(*ints)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        program, runner = ctx.program, ctx.runner
        check_backward_once(_WHERE, ctx.saved_per_rank)
        ctx.saved_tensors    # noqa: B018  (raises if a shard changed in place since forward)

        def grad(i):
            g, meta = grad_outputs[i], ctx.shapes[i]
            return g if g is not None else torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        slots = runner._tangent_slots(program)

        def tangents(rank):
            return [grad(slots[i][runner._block_of(program, rank)] if i in slots else i)
                    for i in program.split.tangents]
        grads = runner._run_backward(program, ctx.saved_per_rank, tangents)
        ctx.saved_per_rank = None
        return (None, None, None, *grads, *([None] * ctx.n_user))
