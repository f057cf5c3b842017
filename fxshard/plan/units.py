"""The rank programs the planner costs: one layer of the model's stack, built for real.

The layers of a stack are alike, so the planner builds a copy of the model with one layer
(the same modules, the stack cut to its first block; ``config.num_hidden_layers`` set to 1
where the model has one) and costs ``rest + L * layer`` (:mod:`fxshard.plan.costs`). The copy
is built on a mesh with the candidate's ``tp``, ``ulysses_cp`` and ``ring_cp`` sizes and 2
on ``dp`` and ``fsdp`` (another size changes only how many ranks share a weight, which the
costing scales: a gathered weight's bytes and a reduction's wire bytes follow the axis size;
size 1 prices their collectives at nothing) and no ``pp`` (a stage is a run of the same layers: the schedule is priced from the
layer's costs), at one sequence per data-parallel rank (the costs that grow with the batch
are scaled by it). One program per (tp, cp sizes, sequence parallelism, recompute, reshard
policy, sequence length): a search over meshes builds a handful.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..mesh import DP, FSDP, PP, MeshSpec, SimulatedMesh
from .costs import Costs, program_costs

__all__ = ["Unit", "layer_stack", "one_layer_model", "build_unit"]


@dataclass
class Unit:
    """The costs of one layer's programs and the weights they hold."""

    forward: Costs
    backward: Costs | None           # None for inference
    weights: dict                    # FQN -> (global shape, spec, dtype, in the layer?)
    mesh: MeshSpec                   # the mesh it was built on
    stack: str                       # the layer stack's FQN ("model.layers")


def layer_stack(model: torch.nn.Module) -> tuple[str, int]:
    """(FQN, number of layers) of the model's repeated layer stack."""
    from ..passes.split_stages import find_layer_stack
    name, blocks = find_layer_stack(model)
    return name, len(blocks)


def one_layer_model(model: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``model`` whose layer stack holds only its first block (the modules
    are shared, nothing is copied but the containers on the way to the stack)."""
    name, _ = layer_stack(model)
    out = copy.copy(model)
    out._modules = dict(model._modules)
    parent, parts = out, name.split(".")
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    stack = parent._modules[parts[-1]]
    first = next(iter(stack._modules))
    small = copy.copy(stack)
    small._modules = {first: stack._modules[first]}
    parent._modules[parts[-1]] = small
    for holder in (out, *[m for m in out.modules() if hasattr(m, "config")]):
        config = getattr(holder, "config", None)
        if config is not None and hasattr(config, "num_hidden_layers"):
            config = copy.copy(config)
            config.num_hidden_layers = 1
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = config.layer_types[:1]
            object.__setattr__(holder, "config", config) if isinstance(
                holder, torch.nn.Module) else None
    return out


def unit_mesh(axes: dict) -> SimulatedMesh:
    """The mesh a unit is built on (module docstring): ``dp`` and ``fsdp`` of size 2 (added
    in front when the candidate lacks them: a candidate without them prices their
    collectives at size 1, nothing), no ``pp``, the other axes as given, in their order."""
    names = [a for a in (DP, FSDP) if a not in axes] + list(axes)
    shape = [2 if a in (DP, FSDP) else 1 if a == PP else axes[a] for a in names]
    return SimulatedMesh(tuple(shape), tuple(names))


def _loss(out, labels):
    """Next-token cross-entropy of the model's logits (an HF output's ``.logits``)."""
    logits = getattr(out, "logits", out)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_unit(model: torch.nn.Module, axes: dict, *, seq: int, training: bool,
               sequence_parallel: bool, recompute=None, reshard_after_forward=True) -> Unit:
    """Build and cost the one-layer programs of ``model`` for mesh ``axes`` (module doc)."""
    small = one_layer_model(model)
    stack, _ = layer_stack(model)
    mesh = unit_mesh(axes)
    rows = mesh.axis_size(DP) * mesh.axis_size(FSDP)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0),
                        device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if training:     # (the joint graph is traced with grad enabled, as pm(x) trains)
            with torch.enable_grad():
                return _train_unit(small, mesh, stack, ids, sequence_parallel, recompute,
                                   reshard_after_forward)
        return _inference_unit(small, mesh, stack, ids, sequence_parallel)


def _train_unit(small, mesh, stack, ids, sequence_parallel, recompute, reshard_after_forward
                ) -> Unit:
    from ..passes import PassCtx
    from ..weights import tied_names
    from ..training.program import build_train_program
    from ..training.with_loss import WithLoss
    ctx = PassCtx(mesh=mesh, sequence_parallel=sequence_parallel,
                  aliases=tied_names(small))
    module = WithLoss(small.train(False), _loss, with_target=True)
    prog = build_train_program(module, ((ids,), {}, ids), {}, ctx,
                               reshard_after_forward=reshard_after_forward,
                               recompute=recompute, vocab_outputs=True)
    split = prog.split
    names = {n.name for n in split.forward.graph.nodes if n.op == "placeholder"}
    wnames = {n.name for n in split.forward.graph.nodes
              if n.op == "placeholder" and (n.meta.get("fxshard_param") or
                                             n.meta.get("fxshard_buffer"))}
    regions = {f: _region(small, f, stack) for f in split.weights}
    fwd = program_costs(split.forward, mesh, weights=wnames,
                        n_outputs=split.n_outputs, regions=regions)
    outs = split.forward.graph.output_node().args[0]
    saved = {}
    for a in outs[split.n_outputs:]:
        saved[f"saved_{a.name}"] = _batch_of(split.forward, a, wnames)
    bwd = program_costs(split.backward, mesh, weights=wnames & names,
                        saved_from=saved, backward=True, regions=regions, grads=split.grads)
    dtypes = {n.meta.get("fxshard_param") or n.meta.get("fxshard_buffer"):
              n.meta["val"].dtype for n in split.forward.graph.nodes
              if n.op == "placeholder" and n.name in wnames}
    weights = {f: (prog.shapes[f], prog.specs[f], dtypes.get(f, torch.float32),
                   _region(small, f, stack))
               for f in split.weights if f in prog.shapes}
    return Unit(fwd, bwd, weights, mesh, stack)


def _inference_unit(small, mesh, stack, ids, sequence_parallel) -> Unit:
    with torch.no_grad():
        from ..api import parallelize
        pm = parallelize(small, mesh, example_inputs=(ids,),
                         sequence_parallel=sequence_parallel)
        gm = pm.rank_module(0)
        fwd = program_costs(gm, mesh, weights=set())
        params = dict(small.named_parameters())
        weights = {}      # inference: the local shapes as built (spec None)
        for fqn, _spec, shape, _stage in pm.explain().placements:
            if fqn in params:
                weights[fqn] = (tuple(shape), None, params[fqn].dtype,
                                _region(small, fqn, stack))
        return Unit(fwd, None, weights, mesh, stack)


def _region(model: torch.nn.Module, fqn: str, stack: str) -> str:
    """``"layer"`` for a weight of the layer stack, ``"pre"`` for one registered before it
    (the embedding: the first pipeline stage's), ``"post"`` after it (the last stage's)."""
    if fqn.startswith(stack + "."):
        return "layer"
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    first = next((i for i, n in enumerate(names) if n.startswith(stack + ".")), len(names))
    return "pre" if fqn in names and names.index(fqn) < first else "post"


def _batch_of(gm, node, wnames: set) -> bool:
    """Whether forward value ``node`` depends on the user's inputs."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name not in wnames:
            return True
        todo.extend(n.all_input_nodes)
    return False
