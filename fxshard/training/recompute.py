"""Recomputation (activation checkpointing) of the model's repeated layers in the backward.

``recompute="layers"`` (``fxshard.parallelize`` / ``parallelize_for_training``): of the
activations inside each repeated layer (a child of a ``ModuleList``, e.g.
``model.layers.3``), the forward saves only what leaves the layer (its output: the next
layer's input); the backward recomputes the rest from it, just before the layer's own
backward needs it, as ``torch.utils.checkpoint`` around every block does. A 2-layer Llama
on ``dp=2``: 41 saved values (76,752 bytes per rank) become 7 (11,664: the embedding, each
layer's output, the final norm's and the head's inputs)::

    recompute=None:     forward -> (out, saved_embedding, saved_rsqrt, saved_mm, ...)
    recompute="layers": forward -> (out, saved_embedding, saved_add_5, saved_add_11, ...)
                        backward: ...; pow_1 = pow(saved_add_5, 2); ...   (layer 1 recomputed)
                                  ...layer 1's backward...; pow = ...      (then layer 0)

An int is a budget of saved bytes per rank (local shapes, as ``explain()`` counts them before
a step): the first layers are recomputed, as few as bring the saved bytes within it.

The collectives of a layer's forward (``tp``'s all-reduces, sequence parallelism's
all-gathers / reduce-scatters) are *not* recomputed: their outputs are saved when the
recomputation needs them, so the backward holds exactly the collectives it holds without
recompute (no extra communication, one saved tensor per such collective per layer). An fsdp
parameter's all-gather is a weight-only value and is redone in the backward either way
(``fsdp_reshard_after_forward=False`` keeps it, as without recompute; ``"layers"`` keeps
only those of the parameters outside the layer stack, which are not recomputed anyway).

Which layer a node belongs to comes from the export's ``nn_module_stack`` (the outermost
module whose name ends in an index); a node a pass inserted (a collective, a local view)
belongs to its first input's layer.
"""
from __future__ import annotations

import torch.fx as fx

__all__ = ["check_recompute", "choose", "layer_of_nodes", "recomputable"]



def check_recompute(where: str, value) -> None:
    """A clear ValueError for a ``recompute=`` value other than None, ``"layers"`` or a
    budget in bytes (an int >= 0)."""
    budget = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if value not in (None, "layers") and not budget:
        raise ValueError(
            f"{where}: recompute={value!r} is not an option; use None (the backward reads "
            f"every activation it needs, saved by the forward), 'layers' (each repeated "
            f"layer saves only its output and the backward recomputes the rest) or an int "
            f"(bytes of saved activations per rank: as few layers recomputed as fit)")


def _layer(node: fx.Node) -> str | None:
    """The outermost indexed module (``model.layers.3``) in the node's module stack."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path and path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def layer_of_nodes(nodes: list, forward: set) -> dict:
    """``{node: layer name or None}`` for the forward's call nodes (in graph order, so a
    pass-inserted node takes its first input's layer)."""
    out: dict = {}
    for n in nodes:
        if n not in forward or n.op != "call_function":
            continue
        layer = _layer(n)
        if layer is None and not n.meta.get("nn_module_stack"):
            layer = next((out[a] for a in n.all_input_nodes if out.get(a)), None)
        out[n] = layer
    return out


def recomputable(nodes: list, forward: set, from_input: set, where: str, model_name: str
                 ) -> dict:
    """``{layer: the forward values the backward would recompute instead of reading them
    saved}``: made from the user's inputs inside the layer, read by no forward node outside it
    (nor returned), and not a collective's output. Layers in forward order."""
    layer = layer_of_nodes(nodes, forward)
    if not any(layer.values()):
        raise ValueError(
            f"{where}: recompute found no repeated layer in {model_name} (a module whose name "
            f"ends in an index, such as model.layers.0, a ModuleList's child); use "
            f"recompute=None")
    out_node = nodes[-1]
    keep: dict = {}
    for n, name in layer.items():
        if name is None or n not in from_input or n.meta.get("fxshard_collective") is not None:
            continue
        users = [u for u in n.users if u in forward or u is out_node]
        if all(u is not out_node and layer.get(u) == name for u in users):
            keep.setdefault(name, set()).add(n)
    return keep


def choose(layers: dict, recompute, saved_bytes, where: str, model_name: str) -> set:
    """The values to recompute: every layer's (``"layers"``), or for a budget (bytes of saved
    activations per rank) those of the first layers, as few as bring ``saved_bytes(redo)``
    within it (a ValueError when recomputing every layer does not)."""
    every = set().union(*layers.values())
    if recompute == "layers":
        return every
    redo: set = set()
    for values in [set()] + list(layers.values()):
        redo |= values
        if saved_bytes(redo) <= recompute:
            return redo
    raise ValueError(
        f"{where}: recompute={recompute} bytes per rank cannot be met for {model_name}: with "
        f"every layer recomputed the forward still saves {saved_bytes(redo)} bytes per rank "
        f"(layer outputs and what lies outside the layers); raise the budget or use "
        f"recompute='layers'")
