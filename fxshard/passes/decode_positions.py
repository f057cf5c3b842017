"""Decode step: positions derived from the sequence length start at the cache position.

The one-token decode program (``DECODE`` of :mod:`fxshard.passes.pipeline`) is traced at
sequence length 1. A model that takes its positions as an argument (``position_ids``,
``input_pos``, ...) gets them from ``generate`` (:mod:`fxshard.generation.positions`): an
integer user input after the token ids that the graph uses; the pass then changes nothing and
reports ``position_inputs``. A model that derives them from the sequence length traces them
as position 0; the pass rewrites each such source to read the ``cache_position`` state input
(0-dim int64, ``S + t``, filled per step by :class:`fxshard.generation.cache.Caches`):

- ``arange(1)`` (``torch.arange(T)``: RoPE angles, ``wpe(arange(T))``, a table's index)
  becomes ``arange(1) + cache_position``;
- ``slice(table, dim, 0, 1)`` of a constant table longer than 1 on ``dim`` (``cos[:T]``)
  becomes ``index_select(table, dim, cache_position[None])``.

Before / after (a RoPE table sliced ``[:T]``)::

    slice = aten.slice(cos, 0, 0, 1);               mul = aten.mul(q, slice)
    index = aten.unsqueeze(cache_position, 0)
    index_select = aten.index_select(cos, 0, index);  mul = aten.mul(q, index_select)

A source that starts elsewhere (``arange(p, p + 1)``, ``table[p:p + 1]`` with a Python ``p``)
cannot be moved to the cache position: ``NotImplementedError`` naming it. Runs after
``moe_routing`` (whose token ``arange`` it rewrites first) and before ``propagate``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassCtx

aten = torch.ops.aten

__all__ = ["decode_positions_pass", "position_sources", "POSITION"]

POSITION = "cache_position"
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _is_int_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and \
        not val.dtype.is_complex and val.dtype != torch.bool


def _constants(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from buffers and constants only (no input, no weight)."""
    const: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if n.meta.get("fxshard_buffer") is not None:
                const.add(n)
        elif n.op == "call_function" and all(a in const for a in n.all_input_nodes):
            const.add(n)
    return const


def _describe(node: fx.Node) -> str:
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
    return f"{node.name} = {node.target}({args})"


def _arange_start(node: fx.Node):
    if node.target is aten.arange.default:
        return 0
    return node.args[0]


def position_sources(graph: fx.Graph, length: int = 1, *, check: bool = True
                     ) -> list[tuple[str, fx.Node]]:
    """The graph's positions derived from a sequence of ``length``: ``("arange", node)`` for
    ``arange(length)``, ``("slice", node)`` for a constant table sliced to ``length`` on a
    longer dim. ``check``: a source that starts elsewhere than 0 is a NotImplementedError."""
    const = _constants(graph)
    found = []
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor):
            continue
        if n.target in _ARANGE and tuple(val.shape) == (length,):
            if _arange_start(n) != 0 and check:
                raise NotImplementedError(
                    f"fxshard.generate: the decode step's positions come from {_describe(n)}"
                    f", an arange that starts at {_arange_start(n)}, not at the sequence's "
                    f"start, so fxshard cannot move it to the cache position; give the "
                    f"forward a positions argument (position_ids [B, S]) instead")
            found.append(("arange", n))
        elif n.target is aten.slice.Tensor and n.args[0] in const:
            table = n.args[0].meta["val"]
            dim = n.args[1] if len(n.args) > 1 else 0
            dim = dim % table.dim()
            start = n.args[2] if len(n.args) > 2 else None
            if val.shape[dim] != length or table.shape[dim] <= length:
                continue
            if start not in (0, None) and check:
                raise NotImplementedError(
                    f"fxshard.generate: the decode step's positions come from {_describe(n)}"
                    f", a slice of a constant table from {start}, not from the sequence's "
                    f"start, so fxshard cannot move it to the cache position; give the "
                    f"forward a positions argument (position_ids [B, S]) instead")
            found.append(("slice", n))
    return found


def _copy_meta(new: fx.Node, like: fx.Node, val) -> None:
    new.meta.update({k: like.meta[k] for k in ("nn_module_stack", "stack_trace")
                     if k in like.meta})
    new.meta["val"] = val


def decode_positions_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Rewrite the decode program's derived positions (see the module doc)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    given = [n for n in placeholders if n.meta.get("fxshard_input") not in (None, 0)
             and _is_int_tensor(n) and n.users]
    if given:
        ctx.report("decode_positions_pass", position_inputs=len(given), rewritten=0,
                   changed=False)
        return gm
    sources = position_sources(graph)
    if not sources:
        ctx.report("decode_positions_pass", position_inputs=0, rewritten=0)
        return gm
    with graph.inserting_after(placeholders[-1]):
        pos = graph.placeholder(POSITION)
    pos.meta.update({"fxshard_state": POSITION,
                     "val": torch.empty((), dtype=torch.int64, device="meta")})
    for kind, n in sources:
        val = n.meta["val"]
        with graph.inserting_after(n):
            if kind == "arange":
                new = graph.call_function(aten.add.Tensor, (n, pos))
                _copy_meta(new, n, val)
                made = {new}
            else:
                table, dim = n.args[0], n.args[1] % n.args[0].meta["val"].dim()
                index = graph.call_function(aten.unsqueeze.default, (pos, 0))
                _copy_meta(index, n, torch.empty((1,), dtype=torch.int64, device="meta"))
                with graph.inserting_after(index):
                    new = graph.call_function(aten.index_select.default, (table, dim, index))
                _copy_meta(new, n, val)
                made = {new, index}
        n.replace_all_uses_with(new, delete_user_cb=lambda u, made=made: u not in made)
    ctx.report("decode_positions_pass", position_inputs=0, rewritten=len(sources))
    return gm
