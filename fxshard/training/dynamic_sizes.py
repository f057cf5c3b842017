"""Sizes known only when the program runs, in the joint graph.

litgpt's Mixtral picks each expert's tokens with ``torch.where(mask)`` (``aten.nonzero``): how
many rows it returns depends on the values. ``torch.export`` traces it with an *unbacked* size
``u0``; aot_autograd, tracing the joint graph on real tensors with static shapes, refuses it
(``DynamicOutputShapeException``). :func:`export_joint` then traces the joint again on fake
inputs under a ``ShapeEnv``, so the joint graph holds unbacked sizes as the inference graph
does::

    before: aot_export_joint_with_descriptors(..) -> DynamicOutputShapeException (nonzero)
    after:  nonzero = aten.nonzero(mask)                    # [u0, 2]
            index_2 = aten.index(x, [getitem_5])            # [u0, 64]: the expert's rows
            mm = aten.mm(index_2, w)                        # [u0, 128]
            ...
            mm_9 = aten.mm(t_9, index_2)                    # its weight gradient: [128, u0] @
                                                            # [u0, 64], u0 contracted

The sharding rules ask questions of these sizes that have no answer before the program runs
(``u0 == 1``: a broadcast dim? ``u0 > 1``?). Each unbacked symbol gets a *stand-in* value,
``2**40`` plus a distinct odd number, which answers every such question as for a large size
equal to no other: the size-oblivious reading torch's own compiler gives unbacked sizes.
A rule cannot shard such a dim (``nonzero``'s rule gathers the mask: every rank computes all
the positions), so no local size is ever cut from one. A stand-in that reached a program as
a number (a size read with ``int()``) would be a wrong program: :func:`check_no_stand_ins`
makes that an error. torch logs each stand-in answer as a warning; :func:`quiet` drops those
records while fxshard builds a program.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx

__all__ = ["export_joint", "quiet", "check_no_stand_ins", "STAND_IN"]

#: the smallest stand-in: no real tensor has a dim this large
STAND_IN = 2 ** 40

_LOGGER = "torch.fx.experimental.symbolic_shapes"


class _DropStandIns(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("propagate_real_tensors")


@contextlib.contextmanager
def quiet():
    """Drop torch's log records of guards answered by stand-ins (fxshard's own questions)."""
    flt = _DropStandIns()
    logging.getLogger(_LOGGER).addFilter(flt)
    try:
        yield
    finally:
        logging.getLogger(_LOGGER).removeFilter(flt)


def _unbacked(gm: fx.GraphModule) -> list:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    found: set = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else (val,):
            if isinstance(v, (torch.Tensor, torch.SymInt)):
                found |= free_unbacked_symbols(v)
    return sorted(found, key=str)


def export_joint(replay: torch.nn.Module, tensors: list) -> fx.GraphModule:
    """aot_autograd's joint graph of ``replay`` on ``tensors``; a forward with an op whose
    output size depends on the values is traced again on fake inputs under a ``ShapeEnv``
    (its sizes unbacked symbols, each given a stand-in, see the module docstring)."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    try:
        with contextlib.ExitStack() as stack:
            return aot_export_joint_with_descriptors(stack, replay, tuple(tensors)).graph_module
    except Exception as e:
        env = ShapeEnv()
        if type(e).__name__ != "DynamicOutputShapeException" or \
                not isinstance(getattr(env, "real_tensor_prop_unbacked_vals", None), dict):
            raise
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes = tuple(mode.from_tensor(t, static_shapes=True) for t in tensors)
    with contextlib.ExitStack() as stack:   # (its own: the first trace's modes are closed)
        gm = aot_export_joint_with_descriptors(stack, replay, fakes).graph_module
    import sympy
    env.real_tensor_prop_unbacked_vals.update(
        {u: sympy.Integer(STAND_IN + 2 * k + 1) for k, u in enumerate(_unbacked(gm))})
    return gm


def check_no_stand_ins(gm: fx.GraphModule, where: str) -> None:
    """An error when a stand-in size (or a multiple: ``u0 * 64``) became a number in
    ``gm``'s arguments."""
    import torch.utils._pytree as pytree
    for node in gm.graph.nodes:
        for a in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, int) and not isinstance(a, bool) and \
                    STAND_IN <= abs(a) < 2 ** 62:    # (2**63 - 1: a slice to the end)
                raise NotImplementedError(
                    f"{where}: {node.format_node()} holds {a}, a size known only when the "
                    f"program runs (torch.where(mask) / nonzero) read as a number while "
                    f"building the program; training this forward is not supported yet. "
                    f"Run it under torch.no_grad() (inference traces it), or write the "
                    f"data-dependent step with fixed shapes (index_add_ / scatter over every "
                    f"token, or a dense mask)")
