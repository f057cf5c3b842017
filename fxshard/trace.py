"""torch.export front end: an ATen FX graph with global shapes, parameters named by FQN.

``trace`` exports non-strict on fake inputs, so a model built on the ``meta`` device traces
without weights. Each placeholder is tagged with what it is::

    node.meta["fxshard_param"]  = "model.layers.0.self_attn.q_proj.weight"   (parameter)
    node.meta["fxshard_buffer"] = "model.rotary_emb.inv_freq"                (buffer/constant)
    node.meta["fxshard_input"]  = 0                                           (user input #0)

``cleanup_pass`` then drops export's no-op artefacts::

    before: _assert_tensor_metadata(x, dtype=float32); y = to(x, float32); z = mul(y, w)
    after:  z = mul(x, w)
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .export_errors import export_quietly, summarise_export_error
from .mixed_precision import (autocast_forward, autocast_off, inline_autocast, params_in,
                              traced_autocast)

aten = torch.ops.aten

__all__ = ["Traced", "trace", "cleanup_pass", "without_cache"]


@dataclass
class Traced:
    """One exported program and what the passes need from its signature."""

    gm: fx.GraphModule
    in_spec: Any            # pytree spec of (args, kwargs)
    out_spec: Any           # pytree spec of the output
    constants: dict         # FQN -> tensor, buffers and lifted constants (real values)
    param_names: dict       # placeholder name -> parameter FQN


def _fake_like(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    return x


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
          real_inputs: bool = False) -> Traced:
    """Export ``model`` on meta copies of ``args``/``kwargs`` (no compute, no weights needed).
    ``real_inputs``: a model with real weights is exported on the inputs themselves (export
    fakes them; nothing is computed), for inputs that meet a buffer (``position_ids`` times
    RoPE's ``inv_freq``), where meta copies would mix devices.

    In-place ops (``y[..., 0] = -inf``, ``x.mul_(2)``) are functionalised (``select_scatter``,
    out-of-place ``mul``): the passes move values between ranks, which would break the aliasing
    an in-place op relies on.
    """
    kwargs = without_cache(model, dict(kwargs or {}))
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    meta_args = torch.utils._pytree.tree_map(_fake_like, args)
    meta_kwargs = torch.utils._pytree.tree_map(_fake_like, kwargs)
    # under torch.autocast: the forward entered into it (export ignores one around it), the
    # rest with it off; under a mixed-precision policy: traced in param_dtype (see
    # fxshard.mixed_precision)
    autocast = traced_autocast()
    with autocast_off(), params_in(model), autocast_forward(model, autocast):
        ep = _export(model, args, kwargs, meta_args, meta_kwargs, on_meta, real_inputs)
    if autocast or any(_mutates(n) for n in _all_nodes(ep.graph_module)):
        # autocast's region (wrap_with_autocast) decomposes into its explicit casts;
        # an update under torch.no_grad() sits in a wrap_with_set_grad_enabled subgraph,
        # which export leaves out of the signature: functionalised, it becomes a
        # BUFFER_MUTATION output (an error below) instead of being silently dropped
        with warnings.catch_warnings():  # torch's own deprecation inside its deepcopy
            warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)",
                                    FutureWarning)
            try:
                inline_autocast(ep.graph_module)
                with autocast_off():
                    ep = ep.run_decompositions({})
            except RuntimeError as e:
                if "is mutated" not in str(e):
                    raise
                raise NotImplementedError(
                    f"fxshard.parallelize: {type(model).__name__}'s forward mutates a tensor "
                    f"attribute in place ({e}); fxshard supports no state updated in the "
                    f"forward: update it outside the forward") from None
        bad = [n for n in _all_nodes(ep.graph_module) if _mutates(n)]
        if bad:
            raise NotImplementedError(
                f"fxshard.parallelize: {type(model).__name__}'s forward mutates state in place "
                f"({bad[0].target} at {bad[0].name}); fxshard runs pure inference graphs")
        _dropout_again(ep.graph_module)
    from .decompose import decompose_custom_ops
    return _from_exported(decompose_custom_ops(ep), model)


def _dropout_again(gm: fx.GraphModule) -> int:
    """``run_decompositions`` turns ``aten.dropout`` into ``native_dropout`` and its output
    0; fxshard's dropout sites (:mod:`fxshard.training.dropout`) are ``aten.dropout``: where
    only the output is read (the mask is not), put it back. Returns how many."""
    import operator
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default or \
                any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
            continue
        with gm.graph.inserting_before(node):
            plain = gm.graph.call_function(aten.dropout.default, tuple(node.args[:3]))
        for user in list(node.users):
            plain.meta.update(user.meta)
            user.replace_all_uses_with(plain)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        n += 1
    if n:
        gm.recompile()
    return n


def _export(model, args, kwargs, meta_args, meta_kwargs, on_meta: bool,
            real_inputs: bool) -> ExportedProgram:
    try:
        if real_inputs and not on_meta:
            raise _RealInputs()
        with _buffers_on_meta(model, on_meta), export_quietly():
            ep = torch.export.export(model, tuple(meta_args), meta_kwargs, strict=False)
    except Exception as e:  # meta inputs on a model with real weights: export on real inputs
        if on_meta:
            raise summarise_export_error(model, e) from None
        ep = _export_real(model, args, kwargs)
    if not on_meta and any(isinstance(v, torch.Tensor) and v.device.type == "meta"
                           for v in ep.constants.values()):
        # constants the forward makes (torch.tensor([0, 3])) came out on meta: trace for real
        ep = _export_real(model, args, kwargs)
    return ep


class _RealInputs(Exception):
    """Export on the real inputs straight away."""


@contextlib.contextmanager
def _buffers_on_meta(model: torch.nn.Module, on_meta: bool):
    """A model with its parameters on meta and its buffers real (``init_empty_weights``)
    traces with meta copies of the buffers, as if built wholly on meta: a forward that mixes a
    buffer with an activation (``x * self.scale``) would otherwise mix devices. The real buffers
    are back when the trace ends; ``_from_exported`` reads their values from the model."""
    if not on_meta:
        yield
        return
    saved = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type != "meta":
                saved.append((module, name, buf))
    try:
        for module, name, buf in saved:
            module._buffers[name] = buf.to("meta")
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf


def without_cache(model: torch.nn.Module, kwargs: dict) -> dict:
    """Trace HuggingFace-style models without their KV cache: a forward with a ``use_cache``
    parameter (``config.use_cache=True`` by default) gets ``use_cache=False`` unless the caller
    set it. The output keeps its structure (``CausalLMOutputWithPast`` with
    ``past_key_values=None``). A cache asked for explicitly is an error: fxshard traces
    single forward passes."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" not in params:
        return kwargs
    if kwargs.get("use_cache"):
        raise NotImplementedError(
            f"fxshard.parallelize: {type(model).__name__} was called with use_cache=True; "
            f"pm(...) runs forward passes without a KV cache. To generate text with a KV "
            f"cache use pm.generate(input_ids, max_new_tokens=...) (a static cache per rank); "
            f"otherwise call pm(...) without use_cache (fxshard passes use_cache=False)")
    kwargs.setdefault("use_cache", False)
    return kwargs


def _export_real(model, args, kwargs) -> ExportedProgram:
    try:
        with export_quietly():
            return torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:
        raise summarise_export_error(model, e) from None


def _all_nodes(gm: fx.GraphModule):
    """The nodes of ``gm``'s graph and of its subgraphs (higher-order ops' bodies)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target._schema.is_mutable)


def _from_exported(ep: ExportedProgram, model: torch.nn.Module) -> Traced:
    sig = ep.graph_signature
    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = dict(model.state_dict(keep_vars=True))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    constants, params = {}, {}
    user_index = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.PARAMETER:
            node.meta["fxshard_param"] = spec.target
            params[node.name] = spec.target
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            node.meta["fxshard_buffer"] = spec.target
            # a buffer's value is the model's own (export holds meta copies when the model
            # was traced with meta buffers); a lifted constant's is export's
            value = state.get(spec.target) if spec.kind == InputKind.BUFFER else None
            if value is None:
                value = ep.constants.get(spec.target, ep.state_dict.get(spec.target))
            constants[spec.target] = value
        elif spec.kind == InputKind.USER_INPUT:
            node.meta["fxshard_input"] = user_index
            node.meta["fxshard_input_name"] = node.name     # the forward's argument name
            user_index += 1
        else:
            raise NotImplementedError(
                f"fxshard.parallelize: exported input {node.name} of kind {spec.kind.name} "
                f"is not supported (only parameters, buffers, constants and user inputs)")
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise NotImplementedError(
                f"fxshard.parallelize: {type(model).__name__}'s forward mutates "
                f"{spec.target} ({spec.kind.name}, model.training={model.training}); fxshard "
                f"supports no buffer updated in the forward (a running statistic): update it "
                f"outside the forward, or, if it changes only in train mode (BatchNorm), "
                f"call pm.eval()")
    return Traced(gm=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
                  constants=constants, param_names=params)


def _is_noop_to(node: fx.Node) -> bool:
    """A cast that changes nothing and, as in eager mode, returns its input itself (``to``
    without a change aliases; ``clone``/``contiguous``/``_to_copy`` copy, so they stay)."""
    if node.target not in (aten.to.dtype, aten.to.device, aten.to.dtype_layout,
                           aten.alias.default):
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or node.kwargs.get("copy") or \
            (node.target is aten.to.dtype and len(node.args) > 3 and node.args[3]):
        return False
    a, b = src.meta.get("val"), node.meta.get("val")
    # a weight or buffer moved to or from meta moves between the trace's device and the
    # weight's: every weight of a rank program lives on the mesh's device, so this changes
    # nothing there
    weight = src.op == "placeholder" and (src.meta.get("fxshard_param") is not None
                                          or src.meta.get("fxshard_buffer") is not None)
    same_device = a.device == b.device or weight and "meta" in (a.device.type, b.device.type) \
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else False
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and same_device and a.shape == b.shape)


def cleanup_pass(gm: fx.GraphModule, *, ctx) -> fx.GraphModule:
    """Drop ``_assert_tensor_metadata``, casts/copies that change nothing and unused
    non-tensor inputs (the first pass of :mod:`fxshard.passes.pipeline`'s lists)."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.meta.get("fxshard_input") is not None and \
                not isinstance(node.meta.get("val"), torch.Tensor) and not node.users:
            # a non-tensor argument (use_cache=False) is specialised into the graph; the
            # runtime passes tensors only
            gm.graph.erase_node(node)
            changed += 1
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            changed += 1
        elif _is_noop_to(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed += 1
    ctx.report("cleanup_pass", removed_nodes=changed)
    # FlexAttention lowered to SDPA / explicit attention (fxshard.passes.lower_flex)
    from .passes.lower_flex import lower_flex_attention_pass
    return lower_flex_attention_pass(gm, ctx=ctx)
