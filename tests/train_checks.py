"""Checks shared by the training tests (no test functions here): structure, and AdamW
steps equal to one device's."""
from __future__ import annotations

import torch

from fxshard.placement import local_shape


def expert_rows(tm, which: str) -> list[int]:
    """Rows of each expert grouped matmul's input in rank 0's ``which`` program ("forward" /
    "backward") of the TrainModule ``tm``: on a batch axis, the rank's own routed rows."""
    out = []
    for n in tm.rank_module(0, which).graph.nodes:
        if n.op == "call_function" and "grouped_mm" in str(n.target):
            x = n.args[0]
            out.append(local_shape(tuple(x.meta["val"].shape), x.meta["fxshard_spec"],
                                   tm.mesh)[0])
    return out


def loss_and_grads_equal(pm, ref, loss_of) -> None:
    """One step's loss (``loss_of(module)``) and every parameter's gradient of ``pm`` (a
    ParallelModule or TrainModule) equal the single-device ``ref``'s (1e-5)."""
    loss, want = loss_of(pm), loss_of(ref)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def adamw_steps_equal(pm, ref, loss_of, *, steps: int = 3, lr: float = 1e-2,
                      clip: float = 0.5, eps: float = 1e-6, on_first=None) -> None:
    """Train ``pm`` (a ParallelModule or TrainModule) and the single-device ``ref`` alike,
    ``steps`` AdamW steps with ``clip_grad_norm_``: ``loss_of(module)`` gives a step's loss;
    the losses, the first step's gradients, every step's norm and the final parameters must
    equal ``ref``'s (1e-5). ``on_first(pm)``: more checks after the first backward.
    ``eps`` 1e-6 (AdamW's default 1e-8): Adam's step g / (sqrt(v) + eps) turns the fp32
    rounding of a gradient near 0 (another summation order: 1e-7 off) into a step of about
    ``lr`` in either direction."""
    import fxshard
    make = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, eps=eps)  # noqa: E731
    ours, theirs = make(pm.parameters()), make(ref.parameters())
    for step in range(steps):
        loss, want = loss_of(pm), loss_of(ref)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        loss.backward()
        want.backward()
        if step == 0:
            grads = pm.gradients()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
            if on_first is not None:
                on_first(pm)
        torch.testing.assert_close(fxshard.clip_grad_norm_(pm, clip),
                                   torch.nn.utils.clip_grad_norm_(ref.parameters(), clip),
                                   rtol=1e-5, atol=1e-6)
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
