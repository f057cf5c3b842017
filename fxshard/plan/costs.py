"""What one rank program does, node by node, before any hardware prices it.

:func:`program_costs` walks a rank program built by fxshard (a training forward or backward,
or an inference forward) on the mesh it was built for and records, per node:

- compute: its FLOPs on this rank's local shapes (``torch.utils.flop_counter``'s formulas;
  attention, which those formulas count as non-causal, by its own rule below) and the bytes
  it reads and writes; views and other aliases cost nothing;
- communication: each collective (:func:`fxshard.explain.collectives_of`), with its axis;
- memory: the bytes alive after each node (a node's output lives until its last user ran;
  the forward's saved values until the backward reads them).

Each number is split into what grows with the local batch (built at one sequence per rank:
multiply by the batch) and what does not (a weight's all-gather, a gradient's reduction):
a value is batch-free when it is computed from weights and constants only, or is a
reduction whose input has a gradient's shape. And each is attributed to the model's
repeated layer (``model.layers.0``) or to the rest (embedding, final norm, head, loss), so
an ``L``-layer model costs ``rest + L * layer`` from a program built with one layer.

Attention FLOPs: ``4 * B * H * Sq * Sk * D`` forward (two matmuls), halved when causal with
``Sq == Sk`` (the masked half is skipped by flash kernels), and 2.5x that for the backward
(five matmuls against two)::

    q [1, 8, 1024, 128] causal -> 4 * 8 * 1024 * 1024 * 128 / 2 = 2.1 GFLOP forward
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ..explain import collectives_of, data_dependent
from ..mesh import FSDP
from ..placement import local_shape

__all__ = ["Costs", "Item", "Comm", "program_costs"]

_FREE = {"aten.t", "aten.view", "aten.reshape", "aten._unsafe_view", "aten.transpose",
         "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.slice",
         "aten.select", "aten.split", "aten.split_with_sizes", "aten.detach", "aten.alias",
         "aten.as_strided", "aten.unbind", "aten.chunk", "aten.narrow", "_operator.getitem",
         "aten.lift_fresh_copy"}
_MATMUL = {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul", "aten.linear",
           "aten.convolution", "aten._scaled_mm"}
_ATTENTION_FWD = {"aten._scaled_dot_product_flash_attention_for_cpu",
                  "aten._scaled_dot_product_flash_attention",
                  "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_cudnn_attention",
                  "aten.scaled_dot_product_attention", "fxshard.attention",
                  "fxshard.attention_out", "fxshard.ring_attention"}
_ATTENTION_BWD = {"aten._scaled_dot_product_flash_attention_for_cpu_backward",
                  "aten._scaled_dot_product_flash_attention_backward",
                  "aten._scaled_dot_product_efficient_attention_backward",
                  "aten._scaled_dot_product_cudnn_attention_backward",
                  "fxshard.attention_backward", "fxshard.ring_attention_backward"}
_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce_scatter_bucket")


@dataclass
class Item:
    """One compute node: ``kind`` is ``"matmul"``, ``"attention"`` or ``"other"``."""

    kind: str
    flops: float
    bytes: float
    dtype: torch.dtype
    batch: bool          # grows with the local batch
    layer: str           # "layer" (the repeated layer), "pre" (before it: the embedding)
    #                      or "post" (after it: final norm, head, loss)


@dataclass
class Comm:
    """One collective: ``bytes`` is the tensor handed to it on the built mesh; ``full``: the
    size that does not change with the axis size (the gathered size of an all-gather, the
    input of a reduction), so the wire bytes of another axis size follow."""

    op: str
    axis: str
    bytes: float
    full: float
    wire: float
    batch: bool
    layer: str
    weight: bool         # a weight's gather or a gradient's reduction


@dataclass
class Costs:
    """One rank program's items, collectives and memory trajectory (see the module doc)."""

    items: list = field(default_factory=list)
    comms: list = field(default_factory=list)
    # bytes alive after each node: (batch, fixed, fsdp-gathered weights, the node's region)
    live: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)    # (region, batch?) -> bytes saved
    outputs: dict = field(default_factory=dict)  # (region, batch?) -> bytes returned
    grads: float = 0.0                           # gradient bytes returned (backward)


def _name(target) -> str:
    s = str(target)
    if s.startswith("<built-in function"):
        return "_operator." + s.split()[-1].rstrip(">")
    return ".".join(s.split(".")[:2])


def _local(node, mesh) -> tuple | None:
    val, spec = node.meta.get("val"), node.meta.get("fxshard_spec")
    if not isinstance(val, torch.Tensor) or data_dependent(val.shape):
        return None
    if not isinstance(spec, tuple):
        return tuple(int(n) for n in val.shape)
    return tuple(int(n) for n in local_shape(tuple(val.shape), spec, mesh))


def _nbytes(node, mesh) -> float:
    shape = _local(node, mesh)
    if shape is None:
        v = node.meta.get("val")
        if isinstance(v, (list, tuple)):
            return sum(_nbytes_val(x) for x in v)
        return 0.0
    return float(torch.Size(shape).numel() * node.meta["val"].element_size())


def _nbytes_val(v) -> float:
    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


def _meta_arg(a, mesh):
    if isinstance(a, fx.Node):
        shape = _local(a, mesh)
        if shape is None:
            return a.meta.get("val")
        return torch.empty(shape, dtype=a.meta["val"].dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta_arg(x, mesh) for x in a)
    return a


def _named_args(node) -> dict:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    out = {a.name: v for a, v in zip(schema.arguments, node.args)}
    out.update(node.kwargs)
    return out


def _attention_flops(node, mesh, backward: bool) -> float:
    args = _named_args(node)
    q = args.get("q", args.get("query"))
    k = args.get("k", args.get("key"))
    if not isinstance(q, fx.Node) or not isinstance(k, fx.Node):
        return 0.0
    qs, ks = _local(q, mesh), _local(k, mesh)
    if qs is None or ks is None or len(qs) != 4:
        return 0.0
    b, h, sq, d = qs
    sk = ks[2]
    flops = 4.0 * b * h * sq * sk * d
    causal = bool(args.get("causal", args.get("is_causal", False)))
    if causal and sq == sk:
        flops /= 2
    if _name(node.target) == "fxshard.ring_attention":   # every ring step's chunk of keys
        flops *= args.get("size", 1)
    return flops * (2.5 if backward else 1.0)


def _flops(node, mesh, name: str) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in flop_registry:
        return 0.0
    try:
        args = [_meta_arg(a, mesh) for a in node.args]
        kwargs = {k: _meta_arg(v, mesh) for k, v in node.kwargs.items()}
        out = _meta_arg(node, mesh)
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    except (TypeError, RuntimeError, AttributeError, IndexError):
        return 0.0     # a formula that does not take this overload's arguments: not counted


def _layer_of(graph: fx.Graph, backward: bool) -> dict:
    """``{node: region}``: ``"layer"`` for nodes of the repeated layer (their module stack
    names an indexed module; a node without one, a pass-inserted collective, takes its first
    input's), else ``"pre"`` / ``"post"`` by their place before or after the layer's nodes
    (in a backward, which runs the model in reverse, the other way round)."""
    inside = {}
    for n in graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        layer = any(path and path.rsplit(".", 1)[-1].isdigit() for path, _ in stack.values())
        if not stack and n.op == "call_function":
            layer = next((inside[a] for a in n.all_input_nodes if a in inside), False)
        inside[n] = layer
    nodes = list(graph.nodes)
    marks = [i for i, n in enumerate(nodes) if inside[n]]
    first, last = (marks[0], marks[-1]) if marks else (len(nodes), len(nodes))
    before, after = ("post", "pre") if backward else ("pre", "post")
    return {n: "layer" if inside[n] else before if i < first else after if i > last
            else "layer" for i, n in enumerate(nodes)}


def _weight_region(node, regions: dict, grads: list | None) -> str | None:
    """The region of the weight a weight-only collective moves (its parameter's, through its
    first inputs) or of the gradient a reduction makes (the output it feeds), from
    ``regions`` (FQN -> region); None where neither is found."""
    n = node
    while isinstance(n, fx.Node):
        fqn = n.meta.get("fxshard_param") or n.meta.get("fxshard_buffer")
        if fqn in regions:
            return regions[fqn]
        n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if grads is None:
        return None
    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output":
            outs = list(u.args[0])
            for i, a in enumerate(outs):
                if a in seen or a is node:
                    return regions.get(grads[i]) if i < len(grads) else None
            return None
        todo.extend(u.users)
    return None


def program_costs(gm: fx.GraphModule, mesh, *, weights: set, saved_from: dict | None = None,
                  n_outputs: int | None = None, backward: bool = False,
                  regions: dict | None = None, grads: list | None = None) -> Costs:
    """The costs of rank program ``gm`` built on ``mesh``. ``weights``: the placeholder names
    that are weights. A training forward: ``n_outputs`` (its first outputs are the model's,
    the rest saved for the backward); a backward: ``backward=True`` and ``saved_from``
    (``{placeholder name: batch?}`` of the values the forward saved). ``regions``: weight
    FQN -> region, so a weight's collective counts where its weight lives (a backward places
    the head's gather wherever it is needed); ``grads``: the backward's output FQNs."""
    graph = gm.graph
    layer = _layer_of(graph, backward)
    nodes = list(graph.nodes)
    out_node = nodes[-1]
    returned = [a for a in out_node.args[0] if isinstance(a, fx.Node)] \
        if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    grad_shapes = {tuple(a.meta["val"].shape) for a in returned
                   if backward and isinstance(a.meta.get("val"), torch.Tensor)}
    batch: dict = {}
    for n in nodes:
        if n.op == "placeholder":
            if n.name in weights:
                batch[n] = False
            elif saved_from is not None and n.name in saved_from:
                batch[n] = saved_from[n.name]
            else:
                batch[n] = True
        elif n.op == "call_function":
            batch[n] = any(batch.get(a, False) for a in n.all_input_nodes)
    costs = Costs()
    comms = {c.node: c for c in collectives_of(graph, mesh)}
    for n in nodes:
        if n.op != "call_function":
            continue
        name = _name(n.target)
        if n.name in comms:
            c = comms[n.name]
            op = c.op
            reduction = op in _REDUCTIONS and (op.endswith("bucket") or tuple(
                n.args[0].meta["val"].shape) in grad_shapes)
            weight = not batch[n] or (backward and reduction)
            if op.startswith("all_gather"):
                full = c.tensor_bytes * c.size
            else:
                full = c.tensor_bytes
            region = layer[n]
            if weight and regions:    # a weight's gather or gradient's reduction: its own
                region = _weight_region(n, regions, grads if backward else None) or region
            costs.comms.append(Comm(op, c.axis, c.tensor_bytes, full, c.wire_bytes,
                                    batch[n] and not weight, region, weight))
            continue
        if name in _FREE or name.startswith("fxshard."):
            if name in _ATTENTION_FWD or name in _ATTENTION_BWD:
                pass
            else:
                continue
        ins = sum(_nbytes(a, mesh) for a in n.all_input_nodes)
        moved = ins + _nbytes(n, mesh)
        if name in _ATTENTION_FWD or name in _ATTENTION_BWD:
            kind, flops = "attention", _attention_flops(n, mesh, name in _ATTENTION_BWD)
        else:
            kind = "matmul" if name in _MATMUL else "other"
            flops = _flops(n, mesh, name)
        val = n.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else \
            next((a.meta["val"].dtype for a in n.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)), torch.float32)
        costs.items.append(Item(kind, flops, moved, dtype, batch[n], layer[n]))
    _walk(costs, nodes, mesh, batch, layer, returned, n_outputs, backward, comms, weights)
    return costs


def _walk(costs: Costs, nodes: list, mesh, batch: dict, layer: dict, returned: list,
          n_outputs, backward: bool, comms: dict, weights: set) -> None:
    """The bytes alive after each node (module doc); placeholders are held elsewhere
    (weights, saved values: counted by the caller), outputs kept to the end."""
    alias: dict = {}
    for n in nodes:
        if n.op == "call_function":
            name = _name(n.target)
            src = n.all_input_nodes[0] if n.all_input_nodes else None
            if src is not None and (name in _FREE or name == "_operator.getitem"):
                alias[n] = alias.get(src, src)
    last: dict = {}       # the last node reading a value or any alias of it
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[alias.get(a, a)] = i
    kept = {alias.get(n, n) for n in returned}
    saved = set(returned[n_outputs:]) if n_outputs is not None else set()
    live = {"b": 0.0, "f": 0.0, "g": 0.0}
    free_at: dict = {}
    for i, n in enumerate(nodes):
        held_input = backward and n.op == "placeholder" and batch.get(n) is not None and \
            n.name not in weights      # a saved value or a tangent: freed after its last use
        if held_input or (n.op == "call_function" and n not in alias and
                          not (backward and n in kept)):
            size = _nbytes(n, mesh)
            c = comms.get(n.name)
            key = "g" if (c is not None and c.axis == FSDP and c.op.startswith(
                "all_gather") and not batch[n]) else ("b" if batch[n] else "f")
            live[key] += size
            if n not in kept:
                free_at.setdefault(last.get(n, i), []).append((key, size))
        costs.live.append((live["b"], live["f"], live["g"], layer.get(n, "pre")))
        for key, size in free_at.pop(i, ()):
            live[key] -= size
    for n in returned:
        root = alias.get(n, n)
        size = _nbytes(n, mesh)
        key = (layer.get(root, "post"), batch.get(root, True))
        if backward:
            costs.grads += size
        elif n in saved:
            costs.saved[key] = costs.saved.get(key, 0.0) + size
        else:
            costs.outputs[key] = costs.outputs.get(key, 0.0) + size
