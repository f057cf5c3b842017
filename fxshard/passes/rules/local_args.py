"""Arguments that hold a global size and must become the rank's local one in ``localize``.

A registry from op to a function ``fn(node, local_in) -> bool`` (``local_in(n)``: the local
shape of input node ``n``, or None) that rewrites ``node``'s arguments in place and says
whether it changed them. ``localize`` calls it for every node whose op is registered::

    conv1d(x[B, 160, L], w, b, [1], [3], [1], 160)      # depthwise, channels S(1) on tp=2
    ->  conv1d(x[B, 80, L], w, b, [1], [3], [1], 80)
    repeat_interleave(x[B, S, 2, 8], 4, 2, output_size=8)   # groups S(2) on tp=2
    ->  repeat_interleave(x[B, S, 1, 8], 4, 2, output_size=4)
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["local_args", "localize_args"]

_LOCAL_ARGS: dict = {}


def local_args(*ops) -> Callable:
    """Register ``fn`` as the local-argument rewrite of each op."""
    def register(fn):
        for op in ops:
            assert op not in _LOCAL_ARGS, f"two local-argument rewrites for {op}"
            _LOCAL_ARGS[op] = fn
        return fn
    return register


def localize_args(node: fx.Node, local_in: Callable) -> bool:
    """Rewrite ``node``'s global size arguments to local ones (see the module docstring)."""
    fn = _LOCAL_ARGS.get(node.target) if node.op == "call_function" else None
    return bool(fn is not None and fn(node, local_in))


@local_args(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node, local_in: Callable) -> bool:
    """An ``output_size`` is the global ``size(dim) * repeats``: the local one follows the
    rank's block of ``dim``."""
    args = list(node.args)
    sized = args[3] if len(args) > 3 else node.kwargs.get("output_size")
    if sized is None or not isinstance(args[1], int):
        return False
    x = args[0]
    local = local_in(x)
    dim = (args[2] if len(args) > 2 else node.kwargs.get("dim")) % x.meta["val"].dim()
    want = local[dim] * args[1] if local is not None else sized
    if want == sized:
        return False
    if len(args) > 3:
        args[3] = want
        node.args = tuple(args)
    else:
        node.update_kwarg("output_size", want)
    return True
