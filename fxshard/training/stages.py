"""The forward export cut into pipeline stages, each a forward of its own to train.

Layers go to stages as for inference (:mod:`fxshard.passes.split_stages`: the layer stack,
:func:`assign_layers_to_stages`, a node outside every layer on the stage of the last layer
before it, constant subgraphs recomputed where used). Each stage becomes an exported forward
(a :class:`fxshard.trace.Traced`) whose inputs are the user's flat inputs followed by the
values it receives from earlier stages, and whose outputs are the values later stages need
(the last stage: the model's outputs). Its joint graph (:func:`fxshard.training.joint.joint_of`)
then also returns the gradient of each received value: the backward of a stage takes the
gradient of its outputs and returns the gradient of its inputs and of its parameters.

Before (2 layers, 2 stages)::

    emb = embedding(w_e, ids); h0 = layer0(emb); h1 = layer1(h0); out = head(norm(h1))

After::

    stage 0 (ids)          : emb = embedding(w_e, ids); h0 = layer0(emb)   -> (h0,)
    stage 1 (ids, h0)      : h1 = layer1(h0); out = head(norm(h1))         -> out
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..passes.split_stages import is_constant, layer_of
from ..trace import Traced

__all__ = ["StageForward", "example_received", "split_forward"]

_WHERE = "fxshard.training.pipeline"


@dataclass
class StageForward:
    """One stage's forward: its export, the values it receives and the ones it sends."""

    traced: Traced
    receives: list      # names (in the whole forward) of the received values, input order
    sends: list         # names of the values it outputs for later stages (not the last)
    received: list      # per received value: (shape, dtype), the microbatch's


def _stage_of_nodes(nodes, prefix: str, index: dict, layer_stages: list) -> dict:
    stage, current = {}, 0
    for n in nodes:
        layer = layer_of(n, prefix, index)
        if layer is not None:
            current = layer_stages[layer]
        if n.op == "call_function":
            stage[n] = current
    return stage


def split_forward(traced: Traced, stack: str, names: tuple, layer_stages: list,
                  n_stages: int) -> list[StageForward]:
    """``traced`` (cleaned, tied parameters untied) cut into ``n_stages`` stage forwards."""
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    prefix, index = f"{stack}." if stack else "", {k: i for i, k in enumerate(names)}
    const: dict = {}
    for n in nodes:
        const[n] = is_constant(n, const) or n.op == "get_attr"
    stage = _stage_of_nodes(nodes, prefix, index, layer_stages)
    output = nodes[-1]
    # the user's flat inputs (+ dropout's step seed, fxshard.training.dropout), then received
    n_flat = traced.in_spec.num_leaves + any(n.meta.get("fxshard_seed") for n in nodes)
    last = n_stages - 1

    def stage_of_user(u):
        return last if u.op == "output" else stage.get(u, last)

    out, param_stage = [], {}
    for s in range(n_stages):
        mine = [n for n in nodes if n.op == "call_function" and stage[n] == s and not const[n]]
        placeholders, received, seen = set(), [], set()

        def visit(a, s=s):
            if a in seen:
                return
            seen.add(a)
            if a.op == "placeholder":
                placeholders.add(a)
            elif const[a]:
                for b in a.all_input_nodes:
                    visit(b)
            elif stage[a] != s:
                if stage[a] > s:
                    raise ValueError(
                        f"{_WHERE}: stage {s} needs {a.name}, made on stage {stage[a]} later "
                        f"in the forward: the model runs its layer stack {stack} out of order; "
                        f"drop the pp axis or pass stages= in the order the layers run")
                received.append(a)
        for n in mine:
            for a in n.all_input_nodes:
                visit(a)
        if s == last:
            for a in output.all_input_nodes:
                visit(a)
        received.sort(key=nodes.index)
        g, env = fx.Graph(), {}
        for p in nodes:
            if p in placeholders:
                env[p] = g.node_copy(p)
                fqn = p.meta.get("fxshard_param")
                if fqn is not None:
                    param_stage.setdefault(fqn, set()).add(s)
        for j, a in enumerate(received):
            ph = g.placeholder(a.name)
            ph.meta.update({k: v for k, v in a.meta.items()
                            if k in ("val", "tensor_meta", "stack_trace")})
            ph.meta["fxshard_input"] = n_flat + j
            env[a] = ph

        def get(a):
            if a not in env:      # a constant: recomputed on this stage
                env[a] = g.node_copy(a, get)
            return env[a]
        for n in mine:
            env[n] = g.node_copy(n, get)
        if s == last:
            g.output(fx.node.map_arg(output.args[0], get))
            sends = []
        else:
            sends = [n for n in mine if any(stage_of_user(u) > s for u in n.users)]
            g.output(tuple(env[n] for n in sends))
        g.lint()
        stage_gm = fx.GraphModule(gm, g, class_name=f"TrainStage{s}")
        out.append(StageForward(
            traced=Traced(gm=stage_gm, in_spec=traced.in_spec,
                          out_spec=traced.out_spec if s == last else None,
                          constants=traced.constants, param_names=traced.param_names),
            receives=[a.name for a in received], sends=[n.name for n in sends],
            received=[(tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in received]))
    shared = {f: sorted(v) for f, v in param_stage.items() if len(v) > 1}
    if shared:
        fqn, where = next(iter(shared.items()))
        raise NotImplementedError(
            f"{_WHERE}: parameter {fqn} is used on pipeline stages {where} (a tied embedding "
            f"and lm_head, or a layer outside the stack); training one tensor on several "
            f"stages needs its gradients summed across them, not built yet. Untie it "
            f"(tie_word_embeddings=False), or train without the pp axis")
    for s, sf in enumerate(out):
        if s < last and not sf.sends:
            raise ValueError(f"{_WHERE}: stage {s} sends nothing to later stages")
    return out


def example_received(sf: StageForward, device: torch.device) -> list[torch.Tensor]:
    """Zero tensors shaped as the values ``sf`` receives (for tracing its joint graph)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in sf.received]
