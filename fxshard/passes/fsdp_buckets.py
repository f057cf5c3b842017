"""``fsdp`` buckets: one all-gather per layer, one reduce-scatter per layer (as FSDP2 groups).

:mod:`fxshard.passes.fsdp` gathers each parameter on its own (and the training backward
reduce-scatters each gradient on its own): a Llama layer's nine parameters cost nine
collectives in the forward, nine in the backward and nine reduce-scatters, each a rendezvous of
the whole axis. This pass, run on each rank program, groups them into *buckets*: one per
repeated layer (the layer stack :func:`fxshard.passes.split_stages.find_layer_stack` finds, as
the pipeline split uses; a parameter belongs to the layer its FQN lies under), and the
parameters outside the layers by position (those gathered before the first layer, between two
layers, after the last: the embedding; the final norm and the head). A bucket holds one dtype,
and only parameters of at most :data:`BUCKET_MAX_BYTES` (norms and biases at real sizes):
a bigger one keeps its own collective, whose result lands in place without the bucket's
copies in and out.

- All-gathers (forward, backward, inference): the bucket's gathers become one
  ``fxshard::all_gather_bucket`` placed where its first gather was (the layer's first use of a
  weight): one collective of a flat buffer of the local shards, and each parameter's gathered
  value exactly as its own ``all_gather`` gave it (any dim, nested inside tp's shards).
- Reduce-scatters (backward): a bucket's gradients' reduce-scatters become one
  ``fxshard::reduce_scatter_bucket`` placed right after its last gradient is made; what read
  the shards (dp's all-reduce in HSDP, the output) follows it.

Memory: a bucket's gathered weights are one layer's, alive from the layer's first use (FSDP2's
unsharded layer); inside the op the flat buffer and the copies-out live together for a moment
(twice one layer's gathered weights, as FSDP2's all-gather output and its unsharded parameters).
A model without a layer stack keeps its per-parameter collectives (never one bucket holding
every weight). Before (rank program, fsdp=2, one layer)::

    all_gather = fxshard.all_gather(w_q, 1, 'fsdp', 2);  t = t(all_gather);  ...
    all_gather_1 = fxshard.all_gather(w_k, 0, 'fsdp', 2); t_1 = t(all_gather_1); ...

After::

    all_gather_bucket = fxshard.all_gather_bucket([w_q, w_k, ...], [1, 0, ...], 'fsdp', 2)
    getitem = all_gather_bucket[0];  getitem_1 = all_gather_bucket[1];  ...
    t = t(getitem);  ...;  t_1 = t(getitem_1);  ...
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import PassCtx
from .fsdp import AXIS
from .insert_collectives import collective_target
from .split_stages import find_layer_stack

__all__ = ["layer_of", "layer_stack_for_buckets", "fsdp_buckets_pass", "GRADIENTS",
           "BUCKET_MAX_BYTES"]

GRADIENTS = "fxshard_gradients"
"""Output-node meta of a training backward: the parameter FQN of each output (or None)."""


def layer_stack_for_buckets(model: torch.nn.Module) -> tuple[str | None, tuple | None]:
    """The layer stack (FQN, block names) the buckets follow, or ``(None, None)`` when the
    model has none (its collectives then stay per parameter)."""
    try:
        return find_layer_stack(model)
    except (ValueError, NotImplementedError):
        return None, None


def layer_of(fqn: str, ctx: PassCtx) -> str | None:
    """The layer (``model.layers.3``) of the layer stack that parameter ``fqn`` belongs to, or
    None for one outside the stack (or without one)."""
    prefix = f"{ctx.layer_stack}." if ctx.layer_stack else ""
    if fqn.startswith(prefix):
        head = fqn[len(prefix):].split(".", 1)[0]
        if head in (ctx.layer_names or ()):
            return prefix + head
    return None


def _is(node: fx.Node, op: str) -> bool:
    return node.op == "call_function" and node.target is collective_target(op) and \
        len(node.args) == 4 and node.args[2] == AXIS


#: a parameter whose gathered value (a gradient's reduce-scatter input) is bigger stays in its
#: own collective: a bucket copies its tensors into a flat buffer and back out, which costs
#: more than the rendezvous it saves once they are big (measured: the 8-layer, hidden-1024
#: Llama of ``benchmarks/train_step.py --ranks 4`` on fsdp2·tp2 stepped 1.55x Megatron with
#: every parameter bucketed, 1.36x with none); norms and biases, latency-bound, are bucketed
BUCKET_MAX_BYTES = 128 * 1024


def _small(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() * val.element_size() <= BUCKET_MAX_BYTES


def _group(items: list, ctx: PassCtx) -> dict:
    """``{key: [(node, fqn), ...]}`` in graph order: one key per layer, and one per stretch
    of parameters outside the layers (how many layers came before them); per dtype; only
    parameters of at most :data:`BUCKET_MAX_BYTES` (``items`` says the node to measure)."""
    buckets: dict = {}
    layers: list = []
    for node, fqn, dtype in items:
        layer = layer_of(fqn, ctx)
        if layer is not None and layer not in layers:
            layers.append(layer)
        if not _small(node if node.target is collective_target("all_gather") else node.args[0]):
            continue
        key = (layer if layer is not None else ("outside", len(layers)), dtype)
        buckets.setdefault(key, []).append(node)
    return {k: v for k, v in buckets.items() if len(v) > 1}


def _unpack(graph: fx.Graph, bucket: fx.Node, old: list) -> list:
    """``getitem`` nodes right after ``bucket`` taking the place of ``old``'s collectives."""
    out, at = [], bucket
    for i, o in enumerate(old):
        with graph.inserting_after(at):
            at = graph.call_function(operator.getitem, (bucket, i))
        at.meta.update({k: v for k, v in o.meta.items() if k != "fxshard_collective"})
        o.replace_all_uses_with(at)
        out.append(at)
    for o in old:
        graph.erase_node(o)
    return out


def _bucket_node(graph: fx.Graph, op: str, old: list, name: str) -> fx.Node:
    node = graph.call_function(collective_target(op), ([o.args[0] for o in old],
                                                       [o.args[1] for o in old], AXIS,
                                                       old[0].args[3]))
    node.meta.update({"val": [o.meta.get("val") for o in old], "fxshard_bucket": name,
                      "fxshard_stage": old[0].meta.get("fxshard_stage")})
    return node


def _name(key) -> str:
    """The layer a bucket holds ("" outside the layers: explain's module column)."""
    return key[0] if isinstance(key[0], str) else ""


def _gathers(gm: fx.GraphModule, ctx: PassCtx) -> int:
    graph = gm.graph
    items = [(n, n.args[0].meta["fxshard_param"], n.args[0].meta["val"].dtype)
             for n in graph.nodes if _is(n, "all_gather") and n.args[0].op == "placeholder"
             and n.args[0].meta.get("fxshard_param") is not None]
    done = 0
    for key, old in _group(items, ctx).items():
        with graph.inserting_before(old[0]):
            bucket = _bucket_node(graph, "all_gather_bucket", old, _name(key))
        _unpack(graph, bucket, old)
        done += len(old)
    return done


def _follow(node: fx.Node, before: set, at: fx.Node) -> fx.Node:
    """Move the users of ``node`` that come before the bucket (in ``before``) to after
    ``at``, and theirs in turn; return the last node placed."""
    for u in list(node.users):
        if u in before and u.op != "output":
            at.append(u)
            before.discard(u)
            at = u
            at = _follow(u, before, at)
    return at


def _scatters(gm: fx.GraphModule, ctx: PassCtx) -> int:
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    fqns = out.meta.get(GRADIENTS)
    if fqns is None:
        return 0
    owner = {}
    for fqn, g in zip(fqns, out.args[0]):
        while fqn is not None and isinstance(g, fx.Node) and g.op == "call_function":
            if _is(g, "reduce_scatter"):
                owner[g] = fqn
                break
            if g.meta.get("fxshard_collective") is None:
                break
            g = g.args[0]
    items = [(n, owner[n], n.args[0].meta["val"].dtype) for n in graph.nodes if n in owner]
    done = 0
    for key, old in _group(items, ctx).items():
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max((o.args[0] for o in old), key=order.__getitem__)
        with graph.inserting_after(last):
            bucket = _bucket_node(graph, "reduce_scatter_bucket", old, _name(key))
        before = {n for n in graph.nodes if order.get(n, len(order)) < order[last]}
        new = _unpack(graph, bucket, old)
        at = new[-1]
        for g in new:
            at = _follow(g, before, at)
        done += len(old)
    return done


def fsdp_buckets_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Bucket the fsdp parameters' all-gathers and their gradients' reduce-scatters (see the
    module docstring). Nothing to do without an fsdp axis or a layer stack."""
    if AXIS not in ctx.mesh.axis_names or ctx.mesh.axis_size(AXIS) == 1 or \
            ctx.layer_stack is None:
        ctx.report("fsdp_buckets_pass", changed=False, gathers_bucketed=0, scatters_bucketed=0)
        return gm
    gathered = _gathers(gm, ctx)
    scattered = _scatters(gm, ctx)
    ctx.report("fsdp_buckets_pass", gathers_bucketed=gathered, scatters_bucketed=scattered)
    return gm
