"""Library custom ops traced through to the ATen ops they compute.

A model library may wrap plain tensor code in its own op (``torch.library.custom_op``), which
export keeps as one opaque node that no sharding rule knows: it would run replicated, gathering
its inputs. When the op is functional (mutates nothing), has a Python implementation and no
fxshard rule of its own, the exported program is re-traced with that implementation as the op's
decomposition, so the passes see the ATen ops inside and their rules apply::

    before: out = torchtitan.deterministic_scatter_add(zeros, idx, rows)   (no rule)
    after:  out = aten.scatter_add(zeros, 0, idx, rows)                    (scatter's rules)

An implementation that does not trace (a compiled kernel, data-dependent Python) leaves its op
as it was (then a ``FallbackWarning``, as before). A rule registered for the op
(``@fxshard.passes.rules.rule("ns::name")``) keeps it opaque. What the op promised beyond its
values (a deterministic kernel on a GPU) is the decomposed op's: ``torch.use_deterministic_
algorithms(True)`` restores it for the whole program.
"""
from __future__ import annotations

import warnings

import torch
from torch.export import ExportedProgram

__all__ = ["decompose_custom_ops"]

_BUILTIN = ("aten", "prims", "higher_order", "fxshard")


def _python_impl(op):
    """The Python function a ``torch.library.custom_op`` was defined by, or None."""
    from torch._library.custom_ops import _maybe_get_opdef
    opdef = _maybe_get_opdef(op) if isinstance(op, torch._ops.OpOverload) else None
    return getattr(opdef, "_init_fn", None)


def _candidates(ep: ExportedProgram) -> dict:
    from .passes.rules import lookup
    found = {}
    for node in ep.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
                op.namespace in _BUILTIN or op._schema.is_mutable or lookup(op) is not None:
            continue
        impl = _python_impl(op)
        if impl is not None:
            found[op] = impl
    return found


def decompose_custom_ops(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with each traceable custom op (see the module docstring) replaced by its ATen
    ops; ops whose implementation fails to trace stay, one by one."""
    for op, impl in _candidates(ep).items():
        try:
            with warnings.catch_warnings():  # torch's own deprecation inside its deepcopy
                warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)",
                                        FutureWarning)
                ep = ep.run_decompositions({op: impl})
        except Exception:  # noqa: BLE001 - an untraceable implementation keeps its op
            continue
    return ep
