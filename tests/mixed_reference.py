"""The single-device reference of a mixed-precision policy, applied by hand, and the check that
a parallel run is no further from float64 than it.

FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` on one device: the forward and
backward run on ``param_dtype`` copies of the fp32 masters (inputs cast too), each copy's
gradient is cast to ``reduce_dtype`` (the reduction FSDP2 would run; one device has none) and
then to the master's dtype onto the master's ``.grad``; the optimizer steps the masters::

    ref = PolicyReference(model, policy)         # model: the fp32 masters (a deep copy)
    loss = loss_of(ref.working())                # the bf16 copies, fresh from the masters
    loss.backward(); ref.grads_to_masters()      # master.grad = copy.grad -> reduce -> fp32
    opt = torch.optim.AdamW(ref.masters.parameters()); opt.step()

Mixed precision is not bitwise: ``mixed_steps_close`` compares a parallel run and the
reference with a float64 run of the same model, and holds the parallel one to
``FACTOR`` times the reference's distance plus ``ULPS`` of ``param_dtype``'s rounding of the
value: two orders of summation in bf16 round differently, each by up to a few ulps, so the
parallel run may land on the other side of float64 as far again (2x), and a value whose exact
answer is near 0 is held to the rounding of the largest value of its tensor.
"""
from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree

FACTOR, ULPS = 2.0, 4


class PolicyReference:
    """``masters`` (an fp32 copy of the model) trained under ``policy`` by hand."""

    def __init__(self, model: torch.nn.Module, policy):
        self.masters = copy.deepcopy(model)
        self.policy = policy
        self.work = copy.deepcopy(model)
        for p in self.work.parameters():
            if p.is_floating_point():
                p.data = p.data.to(policy.param_dtype)

    def working(self) -> "_Cast":
        """The working copies, refreshed from the masters, with the policy's input casts."""
        with torch.no_grad():
            for w, m in zip(self.work.parameters(), self.masters.parameters()):
                w.copy_(m)
                w.grad = None
        return _Cast(self.work, self.policy)

    def grads_to_masters(self) -> None:
        reduce = self.policy.reduce_dtype or self.policy.param_dtype
        for w, m in zip(self.work.parameters(), self.masters.parameters()):
            if w.grad is not None:
                g = w.grad.to(reduce).to(m.dtype)
                m.grad = g if m.grad is None else m.grad + g


class _Cast:
    """The working model called with FSDP2's casts of floating inputs and outputs."""

    def __init__(self, model, policy):
        self.model, self.policy = model, policy

    def __call__(self, *args, **kwargs):
        dtype = self.policy.param_dtype
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and \
            x.is_floating_point() else x  # noqa: E731
        out = self.model(*pytree.tree_map(cast, args), **pytree.tree_map(cast, kwargs))
        if self.policy.output_dtype is not None:
            out = pytree.tree_map(lambda x: x.to(self.policy.output_dtype) if isinstance(
                x, torch.Tensor) and x.is_floating_point() else x, out)
        return out


def close_to_float64(got, ref, exact, what: str, dtype=torch.bfloat16) -> None:
    """``got`` no further from ``exact`` (float64) than ``ref`` (the single-device mixed
    result) is, within ``FACTOR`` and ``ULPS`` of ``dtype``'s rounding of ``exact``'s largest
    value."""
    exact = exact.detach().double()
    ours = (got.detach().double() - exact).abs().max().item()
    theirs = (ref.detach().double() - exact).abs().max().item()
    floor = ULPS * torch.finfo(dtype).eps * exact.abs().max().item()
    assert ours <= FACTOR * theirs + floor, (
        f"{what}: {ours:.3g} from float64, the single-device policy run {theirs:.3g}; bound "
        f"{FACTOR}x + {ULPS} ulps of {dtype} = {FACTOR * theirs + floor:.3g}")


def mixed_steps_close(pm, model: torch.nn.Module, policy, loss_of, *, steps: int = 3,
                      lr: float = 1e-2) -> None:
    """``steps`` AdamW steps of ``pm`` (parallelized under ``policy``), of the single-device
    :class:`PolicyReference` and of a float64 copy of ``model``: the losses, the first step's
    gradients and the final parameters of ``pm`` no further from float64 than the
    reference's (:func:`close_to_float64`); the shards' ``.grad`` and optimizer state fp32."""
    ref = PolicyReference(model, policy)
    exact = copy.deepcopy(model).double()
    make = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, eps=1e-6)  # noqa: E731
    opts = [make(pm.parameters()), make(ref.masters.parameters()), make(exact.parameters())]
    dtype = policy.param_dtype
    for step in range(steps):
        want64 = loss_of(exact, torch.float64)
        want64.backward()
        want = loss_of(ref.working(), None)
        want.backward()
        ref.grads_to_masters()
        loss = loss_of(pm, None)
        loss.backward()
        close_to_float64(loss, want, want64, f"step {step} loss", dtype)
        if step == 0:
            grads = pm.gradients()
            for name, p in exact.named_parameters():
                assert grads[name].dtype == model.get_parameter(name).dtype, name
                close_to_float64(grads[name], ref.masters.get_parameter(name).grad, p.grad,
                                 f"gradient of {name}", dtype)
            assert all(p.grad.dtype == torch.float32 for p in pm.parameters()
                       if p.grad is not None)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert all(v.dtype == torch.float32 for s in opts[0].state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim())
    trained = pm.state_dict()
    for name, p in exact.named_parameters():
        assert trained[name].dtype == model.get_parameter(name).dtype, name
        close_to_float64(trained[name], ref.masters.get_parameter(name), p,
                         f"trained {name}", dtype)
