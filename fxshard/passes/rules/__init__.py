"""Sharding rules: a decorator registry from ATen op to a per-axis rule.

A rule looks at one node and the current placements of its tensor inputs *on one mesh axis*
and returns the placements it needs its inputs in and the placement of its output::

    @rule(aten.linear.default)
    def linear_rule(node, ins, ctx) -> Decision:   # ins: [x, weight, bias] placements on ctx.axis
        ...
        return Decision(ins=[R, Shard(0), Shard(0)], out=Shard(2))   # column-parallel

Axes are independent (a Llama shards batch on ``dp``, heads on ``tp``, sequence on the CP
axes), so rules are written for one axis and the propagation pass runs them once per axis.
``ins[i]`` is ``UNDECIDED`` for a parameter whose placement no earlier rule fixed: rules that
own weights (linear, embedding) choose one, every other rule sees ``Replicate()``.

An op without a rule falls back to "every input Replicate, output Replicate" (always correct),
is warned about and listed by ``explain()``; ``strict=True`` turns the fallback into an error.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ...mesh import MeshSpec, TP
from ...placement import R

__all__ = ["rule", "lookup", "Decision", "RuleCtx", "UNDECIDED", "tensor_inputs", "fallback",
           "FallbackWarning", "WholeWeightWarning", "token_local", "held", "caller_level"]

aten = torch.ops.aten


class _Undecided:
    """Placement of a parameter that no consumer has chosen yet."""

    def __repr__(self) -> str:
        return "UNDECIDED"


UNDECIDED = _Undecided()


class FallbackWarning(UserWarning):
    """An op had no sharding rule and was computed replicated."""


class WholeWeightWarning(UserWarning):
    """Weight matrices of repeated layers stay whole on ``tp`` (every rank holds them)."""


@dataclass
class Decision:
    """What a rule needs: input placements (aligned with ``tensor_inputs``), the output placement
    (a list for ops returning several tensors) and, optionally, the placement the output is
    redistributed to right after the op (``then``: e.g. the embedding's all-gather)."""

    ins: list
    out: Any
    then: Any = None


@dataclass
class RuleCtx:
    axis: str
    size: int
    mesh: MeshSpec
    sequence_parallel: bool = False
    embedding_style: str = "embed_dim"
    user_plan: bool = False       # the user placed some weights with plan=
    zigzag: bool = False          # shards on this axis are zigzag: 2 * size chunks
    whole_parts: dict = field(default_factory=dict)   # fused weight FQN -> parts kept whole

    @property
    def chunks(self) -> int:
        """How many equal chunks a shard on this axis cuts a dim into."""
        return 2 * self.size if self.zigzag else self.size

    @property
    def is_tp(self) -> bool:
        return self.axis == TP

    @staticmethod
    def shape(n) -> tuple[int, ...]:
        return tuple(n.meta["val"].shape)

    @staticmethod
    def ndim(n) -> int:
        return n.meta["val"].dim()


Rule = Callable[[fx.Node, list, RuleCtx], Decision]
_RULES: dict[Any, Rule] = {}


def rule(*ops) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of each op (an OpOverload, a packet for all overloads, or
    the ``"namespace::name"`` of a custom op another library registers when imported)."""
    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise AssertionError(f"two sharding rules for {op}")
            _RULES[op] = fn
        return fn
    return register


def lookup(target) -> Rule | None:
    """The rule of ``target``: registered for the overload, its packet, or pointwise by tag."""
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet in _RULES:
        return _RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and target.name() in _RULES:
        return _RULES[target.name()]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return pointwise.pointwise_rule
    return None


def token_local(node: fx.Node, ctx: RuleCtx) -> bool:
    """``node`` is inside an expert-routing region (``passes/moe_routing.py``) and ``ctx.axis``
    may shard its tokens: each rank then sorts and un-sorts its own rows."""
    return node.meta.get("fxshard_token_local") is not None and not ctx.is_tp


def is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued inputs of ``node`` in argument order (lists flattened, kwargs last)."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if is_tensor_node(a)]


def held(node: fx.Node):
    """The placement ``node``'s consumers receive: ``fxshard_then`` where the value moves
    right after it is made (the embedding's gather), else its ``fxshard_spec``."""
    return node.meta.get("fxshard_then") or node.meta.get("fxshard_spec")


def out_count(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return len(val)
    return None


def fallback(node: fx.Node, ins: list, ctx: RuleCtx, *, why: str = "no sharding rule") -> Decision:
    """Gather every input to Replicate and compute the op whole on every rank."""
    n = out_count(node)
    return Decision(ins=[R] * len(ins), out=[R] * n if n is not None else R)


def warn_fallback(node: fx.Node, why: str) -> None:
    warnings.warn(f"fxshard: {node.target} ({node.name}) {why}; it runs replicated (correct, "
                  f"but every rank computes it whole)", FallbackWarning,
                  stacklevel=caller_level())


def caller_level() -> int:
    """Stack level of the first frame outside the fxshard package (the user's call)."""
    import os
    import sys
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


# Import the rule families so that they register themselves.
from . import (pointwise, views, reductions, linear, embedding, attention, factory,  # noqa: E402,F401
               indexing, experts, complex, loss)
from . import conv, einsum, split  # noqa: E402,F401
