"""Mixed precision: FSDP2's ``MixedPrecisionPolicy`` on ``parallelize`` and ``torch.autocast``
around calls.

**The policy** (``fxshard.parallelize(model, mesh, mixed_precision=MixedPrecisionPolicy(
param_dtype=torch.bfloat16, reduce_dtype=torch.float32))``, torch's own class, its fields
meaning what they mean for FSDP2). The model is traced as FSDP2 runs it: with its floating
parameters *already* in ``param_dtype`` (:func:`params_in`), so model code that reads a
dtype (HF's RMSNorm: ``input_dtype = x.dtype; ...; .to(input_dtype)``) sees bf16. Every pass
then works on that bf16 model. The rank programs take the fp32 masters (the model's own
dtype: ``pm.parameters()``, the optimizer state and checkpoints keep it) and cast each to
``param_dtype`` as a graph node before its first use; gradients are cast to ``reduce_dtype``
before their first reduction and to the masters' dtype after it
(:mod:`fxshard.passes.cast_params`, with the graphs before and after): on ``fsdp`` the
all-gather moves bf16, as FSDP2's.

``reduce_dtype=None`` reduces in ``param_dtype`` (FSDP2's default) and casts the reduced
gradient to the master's dtype. ``cast_forward_inputs`` casts the call's floating tensors to
``param_dtype`` and ``output_dtype`` the floating outputs, in Python at the edges, as FSDP2's
hooks on the root module do (:func:`cast_inputs`, :func:`cast_outputs`).

**Autocast**: ``torch.export`` ignores an autocast entered around it, so a call under
``torch.autocast`` traces the forward with the model's ``forward`` entered into the same
autocast (:func:`autocast_forward`); the export's ``wrap_with_autocast`` region, decomposed,
becomes the explicit ``_to_copy`` casts autocast makes op by op, which every pass then sees
as plain casts. Programs are keyed by :func:`autocast_state`, so a call outside autocast after
one inside runs its own program, and they run with autocast off (:func:`autocast_off`): the
casts are in the graph.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["check_policy", "autocast_state", "caller_autocast", "autocast_off", "autocast_forward", "inline_autocast",
           "policy_scope", "current_policy", "traced_autocast", "params_in", "cast_inputs",
           "cast_outputs", "output_cast_loss", "masters"]

aten = torch.ops.aten
_DEVICES = ("cpu", "cuda")
# (policy, {parameter FQN: master dtype}, autocast state) while programs are built
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("fxshard_mixed_precision",
                                                        default=None)


def check_policy(where: str, policy):
    """``policy`` if it is a ``torch.distributed.fsdp.MixedPrecisionPolicy`` with floating
    dtypes (or None); a TypeError that names the argument otherwise. A policy that casts
    nothing (``param_dtype=None``) is None: FSDP2 then computes in the model's dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if policy is None:
        return None
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{where}: mixed_precision={policy!r} ({type(policy).__name__}); pass torch's "
            f"torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            f"reduce_dtype=torch.float32) or None")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and
                                      dtype.is_floating_point):
            raise TypeError(
                f"{where}: mixed_precision.{field}={dtype!r}; pass a floating dtype such as "
                f"torch.bfloat16 or torch.float32, or None")
    if policy.param_dtype is None and policy.reduce_dtype is None and \
            policy.output_dtype is None:
        return None
    if policy.param_dtype is None:
        raise NotImplementedError(
            f"{where}: mixed_precision={policy} sets reduce_dtype/output_dtype without "
            f"param_dtype; fxshard supports a policy with param_dtype set (e.g. "
            f"MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))")
    return policy


# -- autocast ---------------------------------------------------------------------------
# the caller's autocast state, held while autocast itself is off (:func:`caller_autocast`)
_CALLER: contextvars.ContextVar = contextvars.ContextVar("fxshard_caller_autocast",
                                                         default=None)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled",
                        lambda: any(torch.is_autocast_enabled(d) for d in _DEVICES))


def autocast_state() -> tuple:
    """``((device_type, dtype), ...)`` of every device type autocast is on for (cpu, cuda),
    or the caller's held by :func:`caller_autocast`: part of every program's cache key."""
    held = _CALLER.get()
    if held is not None:
        return held
    if not _any_autocast():          # the common case: one call (pm(x)'s per-call budget)
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES
                 if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def caller_autocast():
    """The caller's autocast state kept for the programs' keys and traces while autocast is
    off for everything else (a loop that builds and runs programs: ``generate``)."""
    state = autocast_state()
    token = _CALLER.set(state)
    try:
        with autocast_off(state):
            yield
    finally:
        _CALLER.reset(token)


@contextlib.contextmanager
def autocast_off(state: tuple | None = None):
    """Autocast off for the device types of ``state`` (default: the current state) — the
    programs hold autocast's casts as nodes; autocast must not cast again."""
    state = autocast_state() if state is None else state
    with contextlib.ExitStack() as stack:
        for device, _ in state:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def autocast_forward(model: torch.nn.Module, state: tuple):
    """``model.forward`` entered into the autocast of ``state`` while exported (export
    ignores an autocast around it, and records one inside the forward)."""
    if not state:
        yield
        return
    had = "forward" in model.__dict__
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for device, dtype in state:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            return inner(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = inner
        else:
            del model.forward


def inline_autocast(gm: fx.GraphModule) -> int:
    """Each ``wrap_with_autocast`` region of an export (``gm``: its graph module) as its body
    inlined between ``_enter_autocast`` and ``_exit_autocast`` calls, nested regions too, so
    that ``run_decompositions`` traces every op of it under that autocast (its casts
    explicit) and keeps each node's own ``nn_module_stack`` (decomposing the region whole
    gives every node the region's stack: the root module's, no layers for pipeline stages).
    Returns how many regions it inlined."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
    import operator
    graph, n = gm.graph, 0
    while True:
        node = next((x for x in graph.nodes if x.op == "call_function" and
                     x.target is torch.ops.higher_order.wrap_with_autocast), None)
        if node is None:
            break
        device, dtype, enabled, cache, sub, *operands = node.args
        body = getattr(gm, sub.target)
        env, outs = dict(zip((x for x in body.graph.nodes if x.op == "placeholder"),
                             operands)), None
        with graph.inserting_before(node):
            enter = graph.call_function(_enter_autocast, (device, dtype, enabled, cache))
            for x in body.graph.nodes:
                if x.op == "placeholder":
                    continue
                if x.op == "output":
                    outs = x.args[0]
                    continue
                if x.op == "get_attr":    # a nested region's body: onto gm, a fresh name
                    name = f"{sub.target}_{x.target}"
                    setattr(gm, name, getattr(body, x.target))
                    env[x] = graph.get_attr(name)
                    continue
                env[x] = graph.node_copy(x, lambda a: env[a])
            graph.call_function(_exit_autocast, (enter,))
        for user in list(node.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(env[outs[user.args[1]]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not sub.users:
            graph.erase_node(sub)
        n += 1
    if n:
        gm.recompile()
    return n


# -- the policy while programs are built -------------------------------------------------
def masters(model: torch.nn.Module, policy) -> dict:
    """``{FQN: dtype}`` of the floating parameters ``policy`` casts (their masters' dtype)."""
    if policy is None:
        return {}
    return {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)
            if p.dtype.is_floating_point and p.dtype != policy.param_dtype}


@contextlib.contextmanager
def policy_scope(policy, model: torch.nn.Module, autocast: tuple | None = None):
    """Build programs under ``policy`` (traced in ``param_dtype``; the rank programs' casts)
    and the autocast state ``autocast`` (default: the current one), which is then turned off
    until the scope ends: the trace enters the forward into it (:func:`traced_autocast`),
    and nothing else of the build may run under it (a pass's fake ops would be cast)."""
    autocast = autocast_state() if autocast is None else autocast
    token = _SCOPE.set((policy, masters(model, policy), autocast))
    try:
        with autocast_off(autocast_state()):
            yield
    finally:
        _SCOPE.reset(token)


def current_policy():
    """``(policy, {FQN: master dtype})`` of the programs being built (``(None, {})``)."""
    scope = _SCOPE.get()
    return (None, {}) if scope is None else scope[:2]


def traced_autocast() -> tuple:
    """The autocast state a trace enters the forward into: the building scope's, else the
    current one (:func:`autocast_state`)."""
    scope = _SCOPE.get()
    return autocast_state() if scope is None else scope[2]


@contextlib.contextmanager
def params_in(model: torch.nn.Module):
    """The model's floating parameters as ``param_dtype`` copies of the current policy while
    it is traced (tied ones stay tied); the masters are back afterwards."""
    policy, cast = current_policy()
    if policy is None or not cast:
        yield
        return
    from .weights import parameters_swapped

    def copy(p):
        if not p.dtype.is_floating_point or p.dtype == policy.param_dtype:
            return None
        return torch.nn.Parameter(p.detach().to(policy.param_dtype),
                                  requires_grad=p.requires_grad)
    with parameters_swapped(model, copy):
        yield


def cast_inputs(policy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """FSDP2's ``cast_forward_inputs``: the floating tensors of the call in ``param_dtype``."""
    if policy is None or not policy.cast_forward_inputs or policy.param_dtype is None:
        return args, kwargs
    dtype = policy.param_dtype
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x, (tuple(args), dict(kwargs)))


def cast_outputs(policy, out):
    """FSDP2's ``output_dtype``: the floating tensors of the output in it."""
    if policy is None or policy.output_dtype is None:
        return out
    dtype = policy.output_dtype
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x, out)


def output_cast_loss(policy, loss_fn):
    """``loss_fn`` taking the model's output cast by :func:`cast_outputs` (a loss traced with
    the model, ``train_step(loss_fn=)``, sees the output ``pm(x)`` returns)."""
    if policy is None or policy.output_dtype is None or not callable(loss_fn):
        return loss_fn    # (HF's labels=: the model's own loss, inside its forward)

    @functools.wraps(loss_fn)
    def loss(out, *target):
        return loss_fn(cast_outputs(policy, out), *target)
    return loss
