"""Emit per-rank ``torch.fx.GraphModule``s: the localized graph with weights as attributes.

Parameters and buffers stop being graph inputs and become attributes under their original
FQNs, holding only the rank's slice, so ``rank_module(r).state_dict()`` reads like the model's
own state dict with smaller tensors. Ranks of one stage share the graph and its generated code
(generated and compiled once per stage, bound to each rank's weights); collectives name mesh
axes, and each rank's coordinate comes from the runtime. The pass appends stage
``ctx.stage``'s :class:`Program` to ``ctx.programs`` and returns its input unchanged.

Before::  forward(self, p_model_layers_0_self_attn_q_proj_weight, ..., input_ids)
After::   forward(self, input_ids)
              model_layers_0_self_attn_q_proj_weight = self.model.layers.0.self_attn.q_proj.weight
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..placement import local_block, local_shape, padded_block
from ..mesh import MeshSpec
from . import PassCtx
from .kv_cache import WRITE_POS, cache_keys, greedy_output

__all__ = ["Program", "Slot", "emit_pass", "build_rank_module"]


@dataclass
class Slot:
    """One weight of the program: where it lives and how it is split."""

    fqn: str
    kind: str               # "param" | "buffer"
    spec: tuple
    shape: tuple
    dtype: torch.dtype
    model_shape: tuple | None = None   # the model's shape where the vocab is padded (pad_vocab)


@dataclass
class Program:
    """A graph every rank of one stage runs, the weights it reads, and its state contract.

    The state contract is what the runtime binds besides the user's inputs, read once from the
    node meta the passes wrote (:mod:`fxshard.passes.kv_cache`): ``state_inputs``, the
    ``fxshard_state`` placeholders' keys in input order (after the user's tensors);
    ``kv_caches``, ``(key, local shape, dtype)`` of each KV-cache input; ``write_pos``, the key
    of the cache write position (one slot for every sequence, so not cut into microbatches),
    or None; ``token_ids``, which flat output holds the chosen token ids of a greedy decode
    program, or None (the program returns logits)."""

    graph: fx.Graph
    slots: dict = field(default_factory=dict)   # fqn -> Slot
    stage: int = 0
    eager: object = field(default=None, repr=False, compare=False)  # fxshard.compile.eager_stage
    state_inputs: tuple = field(default=(), init=False)
    kv_caches: tuple = field(default=(), init=False)
    write_pos: str | None = field(default=None, init=False)
    token_ids: int | None = field(default=None, init=False)

    def __post_init__(self):
        self.state_inputs = tuple(n.meta["fxshard_state"] for n in self.graph.nodes
                                  if n.op == "placeholder"
                                  and n.meta.get("fxshard_state") is not None)
        self.kv_caches = tuple(cache_keys(self.graph))
        self.write_pos = WRITE_POS if WRITE_POS in self.state_inputs else None
        if any(n.op == "output" for n in self.graph.nodes):
            self.token_ids = greedy_output(self.graph)


def emit_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Stage ``ctx.stage``'s :class:`Program` onto ``ctx.programs``: a copy of ``gm``'s graph
    with weight placeholders turned into attributes, the ones nothing reads dropped. ``gm``
    itself is returned unchanged."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    slots: dict[str, Slot] = {}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        fqn = node.meta.get("fxshard_param") or node.meta.get("fxshard_buffer")
        if fqn is None:  # a user input (non-tensor ones went in cleanup_pass)
            continue
        if not node.users:
            graph.erase_node(node)
            dropped += 1
            continue
        val = node.meta["val"]
        spec = node.meta["fxshard_spec"]
        kind = "param" if node.meta.get("fxshard_param") is not None else "buffer"
        slots[fqn] = Slot(fqn, kind, spec, tuple(val.shape), val.dtype,
                          ctx.padded.get(fqn))
        with graph.inserting_before(first):
            attr = graph.get_attr(fqn)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)
    graph.lint()
    ctx.report("emit_pass", changed=False, programs=1, weights=len(slots),
               unused_weights_dropped=dropped)
    ctx.programs.append(Program(graph=graph, slots=slots, stage=ctx.stage))
    return gm


def build_rank_module(program: Program, rank: int, mesh: MeshSpec, values: dict,
                      device: torch.device) -> fx.GraphModule:
    """Rank ``rank``'s GraphModule, holding its blocks of ``values`` (FQN -> global tensor, or a
    source with ``block(spec, mesh, rank)``; a missing or meta value gives a meta tensor)."""
    root = torch.nn.Module()
    for fqn, slot in program.slots.items():
        full = values.get(fqn)
        if hasattr(full, "block"):  # a checkpoint source that reads only this rank's block
            # (or trained shards; ``shape``: the slot's, a vocab padded for tp or not)
            t = full.block(slot.spec, mesh, rank, shape=slot.shape)
            t = t.to(device=device, dtype=slot.dtype)
        elif slot.model_shape is not None and full is not None and \
                full.device.type != "meta" and tuple(full.shape) == slot.model_shape:
            # a vocab padded for tp: the model's rows, zeros after them
            t = padded_block(full.detach().__getitem__, slot.model_shape, slot.shape,
                             slot.spec, mesh, rank)
            t = t.to(device=device, dtype=slot.dtype)
        elif full is None or full.device.type == "meta":
            shape = local_shape(slot.shape, slot.spec, mesh, what=fqn)
            t = torch.empty(shape, dtype=slot.dtype, device="meta")
        else:
            # cast to the traced dtype, as nn.Module.load_state_dict copies into its parameters
            t = local_block(full, slot.spec, mesh, rank).to(device=device, dtype=slot.dtype)
        owner_path, _, leaf = fqn.rpartition(".")
        owner = root
        for part in owner_path.split(".") if owner_path else []:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if slot.kind == "param":
            owner.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
        else:
            owner.register_buffer(leaf, t)
    return _RankModule(root, program.graph, class_name=f"Rank{rank}Stage{program.stage}")


class _Code:
    """The code generated for one stage's graph, bound to every rank's module of the stage."""

    def __init__(self, gm: fx.GraphModule, python_code):
        self.python_code = python_code
        self.size = _size(gm.graph)
        self.fields = {k: getattr(gm, k) for k in ("_code", "_lineno_map", "_prologue_start",
                                                   "_in_spec", "_out_spec") if hasattr(gm, k)}
        self.forward = type(gm).forward
        self.call = type(gm).__call__ if "__call__" in vars(type(gm)) else None

    def bind(self, gm: fx.GraphModule):
        gm.__dict__.update(self.fields)
        cls = type(gm)          # GraphModule makes one class per instance
        cls.forward = self.forward
        wrapped = getattr(fx.graph_module, "_WrappedCall", None)  # fx's error context
        if self.call is not None and wrapped is not None:
            cls._wrapped_call = wrapped(cls, None)
            cls.__call__ = self.call
        return self.python_code


def _size(graph: fx.Graph) -> tuple:
    """Catches nodes added or removed since the code was generated (a pass that rewires a
    program's graph in place must call ``recompile()`` on the modules built, as for any
    GraphModule)."""
    nodes = graph.nodes
    return len(nodes), id(next(iter(nodes), None)), id(next(reversed(nodes), None))


# graph -> its generated code: the first rank of a stage generates it, the others reuse it
_SHARED: "weakref.WeakKeyDictionary[fx.Graph, _Code]" = weakref.WeakKeyDictionary()


class _RankModule(fx.GraphModule):
    """A GraphModule that, while it is being built, takes the code an earlier rank of the same
    stage generated for the same graph instead of generating and compiling it again (ranks of
    one stage run one program, only their weights differ). An explicit ``recompile()`` later
    (after editing the graph) generates fresh code, as for any GraphModule."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph, class_name: str = "GraphModule"):
        self.__dict__["_fxshard_building"] = True
        super().__init__(root, graph, class_name=class_name)
        self.__dict__["_fxshard_building"] = False

    def recompile(self):
        shared = _SHARED.get(self._graph) if self.__dict__.get("_fxshard_building") else None
        if shared is not None and shared.size == _size(self._graph):
            return shared.bind(self)
        python_code = super().recompile()
        _SHARED[self._graph] = _Code(self, python_code)
        return python_code
