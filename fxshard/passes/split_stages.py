"""Pipeline stages: split the annotated graph into one graph per ``pp`` stage.

The model's stack of decoder layers is the container of blocks (of one class or several: a
hybrid model's attention and state-space layers) holding the most parameters: a ``ModuleList`` (``model.layers`` in a Llama, whatever its name elsewhere), a
``ModuleDict`` (torchtitan's ``layers``, keyed ``"0"``, ``"1"``, ...; any keys, in the dict's
order) or a ``Sequential``. A node belongs to the layer whose path (``stack.key``) its
``nn_module_stack`` names. Layers go to stages with
:func:`assign_layers_to_stages`; a node outside every layer belongs to the stage of the last
layer before it in execution order, so the embedding lands on the first stage and the final
norm and lm_head on the last. Values that cross stages become point-to-point messages along
``pp`` (sent straight to a non-adjacent stage that needs them); subgraphs that depend on no
input and no parameter (RoPE tables, position ids, constant masks) are recomputed on each
stage that uses them, never sent.

Before (pp=2, 2 layers)::

    emb = embedding(w_e, ids); h0 = layer0(emb, cos, sin); h1 = layer1(h0, cos, sin)
    out = linear(norm(h1), w_head)

After, stage 0 and stage 1::

    emb = embedding(w_e, ids); h0 = layer0(emb, cos, sin); fxshard.send(h0, "pp", 1)
    h0 = fxshard.recv([2, 8, 64], float32, cpu, "pp", 0); cos, sin = <recomputed>
    h1 = layer1(h0, cos, sin); out = linear(norm(h1), w_head)

Stages other than the last return nothing; the runner hands the last stage's output to the
caller (and, on a real mesh, to every rank). The layer stack and each layer's stage come on
``ctx.layer_stack`` / ``ctx.layer_stages`` (``fxshard.passes.pipeline.build_programs``); the
stage graphs go to ``ctx.stage_graphs`` and the pass returns its input unchanged: the pass
driver runs the passes after it (emit) on each stage graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..placement import local_shape
from . import PassCtx
from .insert_collectives import collective_target
from ..mesh import PP

__all__ = ["assign_layers_to_stages", "find_layer_stack", "is_constant", "layer_of",
           "split_stages_pass"]


def assign_layers_to_stages(num_layers: int, num_stages: int) -> list[int]:
    """Stage of each layer, as even as possible, earlier stages taking the extra layer:
    ``(4, 2) -> [0, 0, 1, 1]``, ``(5, 2) -> [0, 0, 0, 1, 1]``."""
    if num_stages > num_layers:
        raise ValueError(
            f"fxshard.parallelize: the pp axis has {num_stages} stages but the model has only "
            f"{num_layers} layers; use a pp size of at most {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    out = []
    for s in range(num_stages):
        out += [s] * (base + (1 if s < extra else 0))
    return out


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def find_layer_stack(model: torch.nn.Module) -> tuple[str, tuple[str, ...]]:
    """(FQN, the blocks' names in order) of the container (ModuleList, ModuleDict or
    Sequential) of blocks with the most parameters. The blocks may be of several classes
    (Jamba's list alternates attention and Mamba layers; a hybrid's ``layer_types``), but not
    containers themselves (a ``Sequential(embedding, ModuleList(layers), head)`` is not a
    stack: its ``ModuleList`` is)."""
    best, best_params = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, _CONTAINERS):
            continue
        children = list(mod.named_children())
        if not children or len(children) != len(mod._modules) or \
                len({type(m) for _, m in children}) > 1 and (
                    len(children) < 2 or any(isinstance(m, _CONTAINERS) for _, m in children)):
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = (name, tuple(k for k, _ in children)), n
    if best is None and isinstance(model, torch.fx.GraphModule):
        raise NotImplementedError(
            "fxshard.backend: torch.compile hands fxshard a flattened graph without the "
            "model's layer stack, so the pp axis cannot be split there yet; use "
            "fxshard.parallelize(model, mesh) for pipeline parallelism (the compile backend "
            "handles dp, tp and the context-parallel axes)")
    if best is None:
        raise ValueError(
            f"fxshard.parallelize: found no stack of repeated layers (a ModuleList, ModuleDict "
            f"or Sequential of blocks, holding parameters) in "
            f"{type(model).__name__} to split over the pp axis; keep the layers in such a "
            f"container, or drop the pp axis")
    return best


def layer_of(node: fx.Node, prefix: str, index: dict[str, int]) -> int | None:
    """Index of the layer of ``stack`` (``prefix`` = ``"stack."``) that ``node`` runs in."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(prefix):
            layer = index.get(path[len(prefix):].split(".", 1)[0])
            if layer is not None:
                return layer
    return None


def is_constant(node: fx.Node, const: dict) -> bool:
    """Whether ``node`` depends on no input (a buffer, or a call on constants only; never a
    send or recv), given ``const`` for the nodes before it: such a value (RoPE tables, a
    constant mask) is recomputed on each stage instead of sent."""
    if node.op == "placeholder":
        return node.meta.get("fxshard_buffer") is not None
    if node.op != "call_function" or "fxshard.send" in str(node.target) or \
            "fxshard.recv" in str(node.target):
        return False
    return all(const.get(a, False) for a in node.all_input_nodes)


def split_stages_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """One graph per stage on ``ctx.stage_graphs`` (``gm`` itself is returned unchanged; the
    pass driver runs the passes after this one on each stage graph);
    ``ctx.layer_stages[i]`` is the stage of layer ``i`` of ``ctx.layer_stack``. Nothing to do
    without a ``pp`` axis."""
    n_stages = ctx.mesh.axis_size(PP)
    if n_stages == 1:
        ctx.report("split_stages_pass", stages=1, sends=0, receives=0, changed=False)
        return gm
    stack, layer_stages = ctx.layer_stack, ctx.layer_stages
    names = ctx.layer_names or tuple(str(i) for i in range(len(layer_stages)))
    prefix, index = f"{stack}." if stack else "", {k: i for i, k in enumerate(names)}
    nodes = list(gm.graph.nodes)
    const: dict[fx.Node, bool] = {}
    stage: dict[fx.Node, int] = {}
    current = 0
    for n in nodes:
        const[n] = is_constant(n, const)
        layer = layer_of(n, prefix, index)
        if layer is not None:
            current = layer_stages[layer]
        if n.op == "call_function":
            stage[n] = current
    # a value is made on its stage; it is used on the stages of its users
    graphs = [fx.Graph() for _ in range(n_stages)]
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(n_stages)]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    users_stage = {n: sorted({stage.get(u, n_stages - 1) for u in n.users}) for n in nodes}

    def local_of(n: fx.Node):
        val, spec = n.meta["val"], n.meta["fxshard_spec"]
        return list(local_shape(tuple(val.shape), spec, ctx.mesh, what=n.name)), val.dtype

    sends = recvs = 0
    for s, g in enumerate(graphs):
        env = envs[s]
        for p in placeholders:
            used_here = any(stage.get(u, n_stages - 1) == s or const.get(u) for u in p.users)
            if p.meta.get("fxshard_input") is not None or used_here:
                env[p] = g.node_copy(p)

        def get(a: fx.Node) -> fx.Node:
            nonlocal recvs
            if a in env:
                return env[a]
            if const[a]:
                env[a] = g.node_copy(a, get)
                return env[a]
            src = stage[a]
            if src >= s:
                raise ValueError(
                    f"fxshard.parallelize: stage {s} needs {a.name}, made on stage {src} later "
                    f"in the forward: the model runs its layer stack {stack} out of order (or "
                    f"more than once), which a pipeline cannot do. Drop the pp axis or pass "
                    f"stages= that follow the order the forward runs the layers in")
            shape, dtype = local_of(a)
            r = g.call_function(collective_target("recv"),
                                (shape, dtype, torch.device(ctx.mesh.device_type), PP, src))
            r.meta.update(a.meta)
            env[a] = r
            recvs += 1
            return r

        incoming = [n for n in nodes if n in stage and not const[n] and stage[n] < s
                    and s in users_stage[n]]
        for n in incoming:  # receive in the order the senders send
            get(n)
        for n in nodes:
            if n.op != "call_function" or stage[n] != s or const[n] or n in env:
                continue  # constants are copied where they are used
            env[n] = g.node_copy(n, get)
            for dst in users_stage[n]:
                if dst > s and not const[n]:
                    g.call_function(collective_target("send"), (env[n], PP, dst))
                    sends += 1
        if s == n_stages - 1:
            g.output(torch.fx.node.map_arg(output.args[0], get))
        else:
            g.output(())
    ctx.report("split_stages_pass", stages=n_stages, sends=sends, receives=recvs, changed=False)
    ctx.stage_graphs = [fx.GraphModule(torch.nn.Module(), g, class_name=f"Stage{s}")
                        for s, g in enumerate(graphs)]
    return gm
