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


def named(name: str):
    """``assert_close``'s ``msg=`` that keeps its numbers (``msg=name`` drops them)."""
    return lambda message: f"{name}: {message}"


#: how much further from float64 a parallel fp32 result may be than the single-device fp32
#: result. Both round every sum, in a different order, so their errors come from one mechanism
#: and are of one size, but per tensor they scatter (a bias whose single-device error happens
#: to be 4e-8 where another run's is 4e-7): each tensor is held to the single-device run's
#: largest error over the model, times this factor, plus a floor of ``FLOAT64_ULPS`` fp32 ulps
#: of the tensor's scale. A real error (a wrong gradient) moves a parameter by about ``lr`` per
#: step, far past the bound.
FLOAT64_FACTOR, FLOAT64_ULPS = 4.0, 64


def no_further_from_float64(got: dict, ref32: dict, ref64: dict, what: str = "") -> None:
    """Each tensor of ``got`` (the parallel fp32 result) is no further from the float64 run
    ``ref64`` than the single-device fp32 ``ref32`` is (see ``FLOAT64_FACTOR``; DESIGN
    section 3: tolerances derived, not chosen: several AdamW steps drift from float64 on any
    CPU, the single device's as much as the parallel run's)."""
    eps = torch.finfo(torch.float32).eps

    def error(values: dict, name: str) -> float:
        exact = ref64[name].detach().double()
        return (values[name].detach().double() - exact).abs().max().item()
    single = {name: error(ref32, name) for name in ref64}
    worst = max(single.values(), default=0.0)
    for name, exact in ref64.items():
        ours = error(got, name)
        bound = FLOAT64_FACTOR * worst + FLOAT64_ULPS * eps * exact.detach().abs().max().item()
        assert ours <= bound, (
            f"{what}{name}: {ours:.3g} from float64, single-device fp32 {single[name]:.3g} "
            f"(at most {worst:.3g} over the model); bound {bound:.3g} ({FLOAT64_FACTOR}x + "
            f"{FLOAT64_ULPS} ulps)")


def loss_and_grads_equal(pm, ref, loss_of) -> None:
    """One step's loss (``loss_of(module)``) and every parameter's gradient of ``pm`` (a
    ParallelModule or TrainModule) equal the single-device ``ref``'s (1e-5)."""
    loss, want = loss_of(pm), loss_of(ref)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=named(name))


def adamw_steps_equal(pm, ref, loss_of, *, steps: int = 3, lr: float = 1e-2,
                      clip: float = 0.5, eps: float = 1e-6, on_first=None,
                      ref64=None) -> None:
    """Train ``pm`` (a ParallelModule or TrainModule) and the single-device ``ref`` alike,
    ``steps`` AdamW steps with ``clip_grad_norm_``: ``loss_of(module)`` gives a step's loss;
    the losses, the first step's gradients, every step's norm and the final parameters must
    equal ``ref``'s (1e-5). ``on_first(pm)``: more checks after the first backward.
    ``eps`` 1e-6 (AdamW's default 1e-8): Adam's step g / (sqrt(v) + eps) turns the fp32
    rounding of a gradient near 0 (another summation order: 1e-7 off) into a step of about
    ``lr`` in either direction. ``ref64``: a float64 copy of ``ref``, trained alike; the final
    parameters are then held to :func:`no_further_from_float64` instead of 1e-5 (steps at a
    large ``lr`` carry one rounding difference along)."""
    import fxshard
    make = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, eps=eps)  # noqa: E731
    ours, theirs = make(pm.parameters()), make(ref.parameters())
    exact = make(ref64.parameters()) if ref64 is not None else None
    for step in range(steps):
        if ref64 is not None:
            loss_of(ref64).backward()
            torch.nn.utils.clip_grad_norm_(ref64.parameters(), clip)
            exact.step()
            exact.zero_grad()
        loss, want = loss_of(pm), loss_of(ref)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        loss.backward()
        want.backward()
        if step == 0:
            grads = pm.gradients()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=named(name))
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
    if ref64 is not None:
        no_further_from_float64(trained, dict(ref.named_parameters()),
                                dict(ref64.named_parameters()))
        return
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5,
                                   msg=named(name))
