"""Split a sharded, localized joint graph into a forward and a backward rank program.

Every rank runs the same two graphs (collectives name mesh axes, as for inference)::

    forward(weights..., inputs...)            -> (outputs..., saved...)
    backward(weights..., saved..., tangents...) -> (one gradient per parameter, in order)

The rule (our own; torch's partitioners expect aot_autograd's naming and know nothing of
collectives): the forward is what the model's outputs need; the backward is what the
gradients need besides. Values the backward reads from the forward are *saved* when they
depend on the user's inputs (activations); a forward value that depends on weights and
constants alone (a transposed weight, a gathered weight, the RoPE tables) is recomputed in the
backward instead of kept alive between the two calls: an fsdp parameter's all-gather is done
again in the backward (ZeRO-3), unless ``keep`` names it. In both programs such values are
computed just before their first use; a gradient's own collectives (dp's all-reduce, fsdp's
reduce-scatter) run just after it is made. Before/after on one linear::

    joint:     t = t(w); mm = mm(x, t); ...; mm_8 = mm(t(tangent), x); t_10 = t(t); mm_9 = ...
    forward:   t = t(w); mm = mm(x, t)                      -> (out, x)        (x saved)
    backward:  t = t(w); t_10 = t(t); mm_8 = mm(t(tangent), x); mm_9 = mm(tangent, t_10)

``partition_pass`` is the last pass of :data:`fxshard.training.pass_lists.TRAIN_JOINT`: it
leaves the :class:`Split` on ``ctx.split`` (the fsdp gathers to keep and the recompute
choice from ``ctx``) and returns the joint graph unchanged.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..mesh import MeshSpec
from ..passes.fsdp import AXIS as FSDP
from ..passes.fsdp_buckets import GRADIENTS, layer_of
from ..placement import local_shape
from .recompute import choose, recomputable
from .train_ctx import TrainCtx

__all__ = ["Split", "partition", "partition_pass"]


@dataclass
class Split:
    """The two programs and their calling convention."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    weights: list        # FQNs of the leading inputs of both programs (params, then buffers)
    inputs: list         # the user's input index of each later forward input
    n_outputs: int       # the forward's first outputs are the model's; then the saved values
    n_saved: int
    tangents: list       # the output index each tangent input of the backward belongs to
    grads: list          # the parameter FQN of each backward output


def _weight(node: fx.Node) -> str | None:
    return node.meta.get("fxshard_param") or node.meta.get("fxshard_buffer")


def _ident(fqn: str) -> str:
    name = fqn.replace(".", "_")
    return name if name.isidentifier() else "w_" + name


def _ancestors(roots, stop=lambda n: False) -> set:
    seen, stack = set(), [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            stack.extend(n.all_input_nodes)
    return seen


def _just_in_time(graph: fx.Graph) -> int:
    """Move each value made from weights alone (an fsdp parameter's all-gather, a transposed
    weight) and each recomputed activation to just before its first use, so a recomputed
    gather in the backward is not done for every parameter at the start (which would hold the
    whole model at once), nor every layer's forward recomputed before the first backward."""
    weights = {n for n in graph.nodes if n.op == "placeholder" and _weight(n)}
    derived = set(weights)
    for n in graph.nodes:
        if n.op == "call_function" and (n.meta.get("fxshard_recompute") or n.all_input_nodes
                                        and all(a in derived for a in n.all_input_nodes)):
            derived.add(n)
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    moved = 0
    for n in reversed(list(graph.nodes)):
        if n in weights or n not in derived or not n.users:
            continue
        first = min(n.users, key=order.__getitem__)
        if first is n.next:
            continue
        before = first.prev
        first.prepend(n)
        order[n] = (order[before] + order[first]) / 2
        moved += 1
    return moved


def _reduce_early(graph: fx.Graph) -> int:
    """Move the collectives that only carry a gradient to the output (all-reduce,
    reduce-scatter) to just after the gradient is made: each full gradient is then freed at
    once instead of every one living to the end of the backward."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    moved = 0
    for g in out.all_input_nodes:
        chain = []
        while g.meta.get("fxshard_collective") is not None and len(g.users) == 1:
            chain.append(g)
            g = g.args[0]
        if g.op == "placeholder":
            continue
        for c in reversed(chain):
            if g.next is not c:
                g.append(c)
                moved += 1
            g = c
    return moved


def partition(gm: fx.GraphModule, n_outputs: int, grad_fqns: list, keep: set = frozenset(),
              recompute=None, model_name: str = "the model",
              nbytes=lambda node: 0) -> Split:
    """``gm``: a joint graph whose placeholders carry ``fxshard_param`` / ``fxshard_buffer`` /
    ``fxshard_input`` / ``fxshard_tangent`` and whose output is the model's ``n_outputs``
    outputs followed by one gradient per entry of ``grad_fqns`` (None: not a parameter's).
    ``keep``: weight-only forward values to save all the same (an fsdp parameter's gather
    when it is not to be redone). ``recompute="layers"``: activations inside each repeated
    layer are recomputed in the backward from the layer's saved output; an int: as few
    layers as keep the saved bytes per rank (``nbytes`` of each saved node) within it
    (:mod:`fxshard.training.recompute`)."""
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    outs = list(out.args[0])
    fwd_outs, grad_outs = outs[:n_outputs], outs[n_outputs:]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if n.meta.get("fxshard_tangent") is not None]
    user = [n for n in placeholders if n.meta.get("fxshard_input") is not None]
    params = [n for n in placeholders if n.meta.get("fxshard_param") is not None]
    buffers = [n for n in placeholders if n.meta.get("fxshard_buffer") is not None]

    from_input = set()
    for n in nodes:
        if n in user or any(a in from_input for a in n.all_input_nodes):
            from_input.add(n)
    forward = _ancestors(fwd_outs)
    # a multi-output op's other results are made with it (flash attention's logsumexp)
    forward |= {n for n in nodes if n.target is operator.getitem and n.args[0] in forward}
    assert not any(t in forward for t in tangents), "a model output depends on a tangent"
    grads = [(fqn, g) for fqn, g in zip(grad_fqns, grad_outs) if fqn is not None]
    # the backward: what the gradients need, stopping at saved forward activations
    savable = from_input | set(keep)

    def split(redo):
        backward = _ancestors([g for _, g in grads],
                              stop=lambda n: n in forward and n in savable - redo)
        saved = [n for n in nodes if n in backward and n in forward and n in savable - redo
                 and n.op != "output"]
        return saved, [n for n in nodes if n in backward and n.op == "call_function"
                       and n not in saved]
    redo = set()
    if recompute is not None:
        layers = recomputable(nodes, forward, from_input, "fxshard.training", model_name)
        redo = choose(layers, recompute, lambda r: sum(map(nbytes, split(r)[0])),
                      "fxshard.training", model_name)
    saved, backward = split(redo)

    def new_placeholder(graph, node, name):
        ph = graph.placeholder(name)
        ph.meta.update(node.meta)
        return ph

    fg, env = fx.Graph(), {}
    for n in params + buffers:
        env[n] = new_placeholder(fg, n, _ident(_weight(n)))
    for n in user:
        env[n] = new_placeholder(fg, n, f"input_{n.meta['fxshard_input']}")
    for n in nodes:
        if n.op == "call_function" and n in forward:
            env[n] = fg.node_copy(n, lambda a: env[a])
    fg.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in fwd_outs)
              + tuple(env[s] for s in saved))

    bg, benv = fx.Graph(), {}
    for n in params + buffers:
        benv[n] = new_placeholder(bg, n, _ident(_weight(n)))
    for n in saved:
        benv[n] = new_placeholder(bg, n, f"saved_{n.name}")
    for t in tangents:
        benv[t] = new_placeholder(bg, t, f"grad_output_{t.meta['fxshard_tangent']}")
    for n in backward:
        benv[n] = bg.node_copy(n, lambda a: benv[a])
        if n in redo:
            benv[n].meta["fxshard_recompute"] = True
    bout = bg.output(tuple(benv[g] if isinstance(g, fx.Node) else g for _, g in grads))
    bout.meta[GRADIENTS] = [fqn for fqn, _ in grads]   # whose gradient each output is
    for g in (fg, bg):
        g.eliminate_dead_code()
        _just_in_time(g)
    _reduce_early(bg)
    for g in (fg, bg):
        g.lint()
    root = torch.nn.Module()
    return Split(forward=fx.GraphModule(root, fg, class_name="TrainForward"),
                 backward=fx.GraphModule(root, bg, class_name="TrainBackward"),
                 weights=[_weight(n) for n in params + buffers],
                 inputs=[n.meta["fxshard_input"] for n in user], n_outputs=len(fwd_outs),
                 n_saved=len(saved), tangents=[t.meta["fxshard_tangent"] for t in tangents],
                 grads=[fqn for fqn, _ in grads])


def partition_pass(gm: fx.GraphModule, *, ctx: TrainCtx) -> fx.GraphModule:
    """Partition the joint graph (:func:`partition`) into ``ctx.split``: ``ctx.joint``'s
    outputs and gradients, ``ctx.reshard_after_forward``'s gathers kept, ``ctx.recompute``."""
    ctx.split = partition(gm, ctx.joint.n_outputs, ctx.joint.grads,
                          keep=_fsdp_gathers(gm, ctx.reshard_after_forward, ctx),
                          recompute=ctx.recompute, model_name=ctx.model_name,
                          nbytes=lambda n: _local_bytes(n, ctx.mesh))
    return gm


def _fsdp_gathers(gm: fx.GraphModule, reshard_after_forward, ctx: TrainCtx) -> set:
    """The all-gathers of fsdp-sharded parameters the forward saves rather than the backward
    redoes: none (``reshard_after_forward=True``), all (``False``) or those of the parameters
    outside the layer stack (``"layers"``: the embedding, the final norm, the head; what
    FSDP2's root keeps when ``fully_shard`` wraps each layer and the model)."""
    if reshard_after_forward is True:
        return set()
    out = set()
    for node in gm.graph.nodes:
        step = node.meta.get("fxshard_collective")
        src = node.args[0] if node.args else None
        fqn = src.meta.get("fxshard_param") if isinstance(src, fx.Node) else None
        if step is not None and step.axis == FSDP and step.op == "all_gather" and \
                fqn is not None and (reshard_after_forward is False or
                                     layer_of(fqn, ctx) is None):
            out.add(node)
    return out


def _local_bytes(node: fx.Node, mesh: MeshSpec) -> int:
    """Bytes of a node's value on one rank (its global value and placement)."""
    from ..explain import data_dependent
    val, spec = node.meta.get("val"), node.meta.get("fxshard_spec")
    if not isinstance(val, torch.Tensor) or not isinstance(spec, tuple) or \
            data_dependent(val.shape):    # (a size known only at run time: not counted)
        return 0
    return int(torch.Size(local_shape(tuple(val.shape), spec, mesh)).numel()) * \
        val.element_size()
