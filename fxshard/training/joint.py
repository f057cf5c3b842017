"""The joint forward+backward ATen graph of the single-device model.

``trace`` exports the model as for inference; that graph is then replayed under aot_autograd
(``aot_export_joint_with_descriptors``, as autoparallel does), which gives one functional graph
taking the parameters, buffers, user inputs and one *tangent* per differentiable output (the
gradient of the loss with respect to that output) and returning the outputs followed by the
gradient of every parameter. Its inputs and outputs carry descriptors; they are turned into the
same node tags the forward passes read::

    placeholder primals_2    ParamAOTInput('model.layers.0.self_attn.q_proj.weight')
                             -> meta["fxshard_param"] = "model.layers.0.self_attn.q_proj.weight"
    placeholder primals_13   PlainAOTInput(idx=0)        -> meta["fxshard_input"] = 0
    placeholder tangents_1   TangentAOTInput(output 0)   -> meta["fxshard_tangent"] = 0
    output [_unsafe_view_7, embedding_dense_backward, t_39, ...]
                             -> Joint.n_outputs = 1,
                                Joint.grads = ["model.embed_tokens.weight", ...]

The backward half holds aten's backward ops (``embedding_dense_backward``, ``silu_backward``,
``slice_backward``, CPU flash attention's backward, ...): their sharding rules are in
``fxshard/passes/rules/backward.py``. ``linear`` arrives decomposed (``t`` + ``mm``) and SDPA
as the backend op it dispatches to (``_scaled_dot_product_flash_attention_for_cpu`` on CPU).
A forward with a size that depends on the values (``torch.where(mask)``) is traced with that
size symbolic: :mod:`fxshard.training.dynamic_sizes`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..passes import PassReports
from ..passes.rules.linear import split_intervals
from ..trace import Traced, cleanup_pass, trace
from ..trace import without_cache as _without_cache
from ..weights import parameters_swapped
from .dropout import add_dropout_sites, pack_seed
from .dynamic_sizes import export_joint

__all__ = ["Joint", "input_grad_name", "joint_graph", "joint_of"]


@dataclass
class Joint:
    """A joint graph and what its inputs and outputs are."""

    gm: fx.GraphModule
    traced: Traced                # the forward export (out_spec, constants)
    n_outputs: int                # the first n_outputs outputs are the model's (flat)
    grads: list                   # per later output: the FQN whose gradient it is, or None
    params: list                  # parameter FQNs in placeholder order
    tied: dict                    # a tied parameter's other names -> the name kept
    seed: int | None = None       # the dropout step seed's user input index (dropout.py)
    flat: list | None = None      # the user inputs it was traced on (a rebuild reuses them)
    grad_inputs: frozenset = frozenset()


def _backward_trace_error(model: torch.nn.Module, e: Exception) -> Exception:
    """What failed when aot_autograd traced the backward of a forward that exported (and
    runs under ``torch.no_grad()``), as a NotImplementedError that names the cause and the
    ways on."""
    name, first = type(model).__name__, (str(e).strip().splitlines() or [""])[0][:300]
    if type(e).__name__ == "DynamicOutputShapeException":
        why = (f"an op whose output shape depends on the values ({first}: e.g. "
               f"torch.where(mask) or nonzero picking the tokens of each MoE expert), which "
               f"the backward trace cannot follow. Write it with fixed shapes (index_add_ / "
               f"scatter over every token, or a dense mask), or run it under "
               f"torch.no_grad() (inference traces it)")
    elif "derivative for" in first and "not implemented" in first:
        why = (f"an op without a derivative ({first}; aten::copy is an in-place write "
               f"into a slice of a fresh tensor, e.g. new_empty(...)[..., :n] = k). Write "
               f"it out of place (torch.cat), or run it under torch.no_grad()")
    else:
        why = (f"a step the backward trace (aot_autograd) failed on: {type(e).__name__}: "
               f"{first}. The forward alone runs under torch.no_grad()")
    return NotImplementedError(f"fxshard.training: cannot train {name}: its forward has {why}")


class _Replay(torch.nn.Module):
    """The exported forward as a module aot_autograd can trace: parameters ``p<i>`` and
    buffers ``b<i>`` in the export's placeholder order, the user's tensors as arguments."""

    def __init__(self, traced: Traced, model: torch.nn.Module, split: dict | None = None):
        super().__init__()
        self.gm = traced.gm
        self.split = {n: split[n.meta["fxshard_param"]] for n in traced.gm.graph.nodes
                      if n.op == "placeholder" and n.meta.get("fxshard_param") in (split or {})}
        params = dict(model.named_parameters(remove_duplicate=False))
        self.kinds: list[tuple[str, object]] = []
        for i, node in enumerate(n for n in traced.gm.graph.nodes if n.op == "placeholder"):
            if node.meta.get("fxshard_param") is not None:
                fqn = node.meta["fxshard_param"]
                p, shape = params[fqn], tuple(node.meta["val"].shape)
                if tuple(p.shape) != shape:    # a vocab padded for tp: the padded table
                    from ..placement import pad_to
                    p = torch.nn.Parameter(pad_to(p.detach(), shape),
                                           requires_grad=p.requires_grad)
                if p.dtype != node.meta["val"].dtype:   # traced in a policy's param_dtype
                    p = torch.nn.Parameter(p.detach().to(node.meta["val"].dtype),
                                           requires_grad=p.requires_grad)
                self.register_parameter(f"p{i}", p)
                self.kinds.append(("param", f"p{i}"))
            elif node.meta.get("fxshard_buffer") is not None:
                value = traced.constants[node.meta["fxshard_buffer"]]
                self.register_buffer(f"b{i}", value)
                self.kinds.append(("buffer", f"b{i}"))
            else:
                self.kinds.append(("input", node.meta["fxshard_input"]))

    def forward(self, *inputs):
        values = [getattr(self, ref) if kind != "input" else inputs[ref]
                  for kind, ref in self.kinds]
        return tuple(_Differentiable(self.gm, self.split).run(*values))


class _Parts:
    """A fused projection's output held as its parts along dim ``dim`` (negative: the last,
    or the heads dim after a view into heads), ``_Differentiable``'s: what a slice or split
    of it at the parts' bounds reads."""

    def __init__(self, parts: list, dim: int = -1):
        self.parts, self.dim = parts, dim
        self.bounds, acc = [0], 0
        for p in parts:
            acc += p.shape[dim]
            self.bounds.append(acc)

    def part(self, start: int, end: int):
        """The part that ``[start, end)`` of the parts' dim is (``_reads_parts`` checked that
        it is one)."""
        assert self.bounds[self.bounds.index(start) + 1] == end, (self.bounds, start, end)
        return self.parts[self.bounds.index(start)]


def _reads_parts(node: fx.Node, sizes: list, dim: int = -1) -> bool:
    """Every use of ``node`` (parts of ``sizes`` along its dim ``dim``, negative) reads one
    part: a slice or split at the parts' bounds on that dim, or an unsqueeze before it
    (GPTBigCode's ``c_attn(x).unsqueeze(1).split(..)``) or a view of the last dim into heads
    (HF Falcon's ``view(b, s, heads + 2, d).split([heads, 1, 1], -2)``) whose uses do."""
    aten = torch.ops.aten
    shape = tuple(node.meta["val"].shape)
    at = len(shape) + dim
    bounds = [0]
    for k in sizes:
        bounds.append(bounds[-1] + k)
    parts = set(zip(bounds[:-1], bounds[1:]))
    for user in node.users:
        if not user.args or user.args[0] is not node:
            return False
        pieces = split_intervals(user, at)   # (a slice / split / chunk of that dim, step 1)
        if pieces is not None:
            if not set(pieces) <= parts or len(pieces) > 1 and pieces != sorted(parts):
                return False
        elif user.target is aten.unsqueeze.default:
            if user.args[1] % (len(shape) + 1) > at or not _reads_parts(user, sizes, dim):
                return False
        elif user.target in (aten.view.default, aten.reshape.default) and dim == -1:
            out = tuple(user.meta["val"].shape)
            if out[:-2] != shape[:-1] or any(k % out[-1] for k in sizes) or \
                    not _reads_parts(user, [k // out[-1] for k in sizes], -2):
                return False
        else:
            return False
    return True


class _Differentiable(fx.Interpreter):
    """Runs the exported forward with its ops that have no derivative written as ops that
    have one: functional ``aten.copy(dst, src)`` (what export makes of ``buf[..., :n] = k``
    into a fresh tensor, DeepSeek's MLA ``expand_kv``) as ``src`` cast and broadcast to
    ``dst``'s dtype and shape, a copy: the same values, and a gradient into ``src``.

    ``split``: fused weights (placeholder -> the sizes of their parts on dim 0) whose
    ``linear`` (or ``x @ w.T``) runs as one per part on a slice of the weight (and bias)
    when every use of its output reads one part (``_reads_parts``), which then reads that
    part itself. A multi-query ``qkv`` whose K/V parts tp keeps whole is trained this way:
    the whole parts' weight slices are replicated, their gradients partial sums over tp that
    are reduced like any replicated weight's (``fxshard.training.program``), the query
    part's slice is a plain shard::

        linear(x, w_qkv)               ->  linear(x, slice(w_qkv, 0, 0, 48))
        slice(linear, 2, 0, 48)  (q)        linear(x, slice(w_qkv, 0, 48, 60))
        slice(linear, 2, 48, 60) (k)        linear(x, slice(w_qkv, 0, 60, 72))
    """

    def __init__(self, gm: fx.GraphModule, split: dict | None = None):
        super().__init__(gm)
        self.split = split or {}

    def _fused_weight(self, n: fx.Node) -> fx.Node | None:
        """The split weight ``n`` multiplies by: ``linear(x, w)`` or ``matmul(x, w.T)``."""
        aten = torch.ops.aten
        if n.op != "call_function" or len(n.args) < 2:
            return None
        if n.target is aten.linear.default:
            return n.args[1] if n.args[1] in self.split else None
        w = n.args[1]
        if n.target is aten.matmul.default and isinstance(w, fx.Node) and \
                (w.target is aten.t.default or w.target is aten.permute.default and
                 list(w.args[1]) == [1, 0]) and w.args[0] in self.split:
            return w.args[0]
        return None

    def run_node(self, n: fx.Node):
        aten = torch.ops.aten
        weight = self._fused_weight(n)
        if weight is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            x, w = args[0], args[1]     # (matmul: w.T, sliced on its dim 1)
            b = (args[2] if len(args) > 2 else kwargs.get("bias")) \
                if n.target is aten.linear.default else None
            parts, acc = [], 0
            for size in self.split[weight]:
                if n.target is aten.linear.default:
                    parts.append(aten.linear(x, aten.slice(w, 0, acc, acc + size),
                                             None if b is None else
                                             aten.slice(b, 0, acc, acc + size)))
                else:
                    parts.append(aten.matmul(x, aten.slice(w, 1, acc, acc + size)))
                acc += size
            sizes = [p.shape[-1] for p in parts]
            return _Parts(parts) if _reads_parts(n, sizes) else aten.cat(parts, -1)
        if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and \
                isinstance(self.env.get(n.args[0]), _Parts):
            held, args = self.env[n.args[0]], n.args
            if n.target is aten.slice.Tensor:
                (start, end), = split_intervals(n, n.args[0].meta["val"].dim() + held.dim)
                return held.part(start, end)
            if n.target is aten.unsqueeze.default:   # a dim before the parts' one
                return _Parts([p.unsqueeze(args[1]) for p in held.parts], held.dim)
            if n.target in (aten.view.default, aten.reshape.default):   # into heads
                d = n.meta["val"].shape[-1]
                return _Parts([p.unflatten(-1, (-1, d)) for p in held.parts], -2)
            return list(held.parts)   # a split into the parts (_reads_parts)
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.copy.default:
            dst, src = args[0], args[1]
            return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()
        return super().call_function(target, args, kwargs)


def joint_graph(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                ctx=None) -> Joint:
    """Trace ``model`` on ``args``/``kwargs`` (real tensors; nothing is computed) and build
    its joint forward+backward graph. ``ctx`` (a ``PassCtx``): a vocab ``tp`` does not divide
    is padded first (:mod:`fxshard.passes.pad_vocab`), so the joint holds the padded table
    and its gradient."""
    with _placeholders_for_meta(model, args, kwargs):
        return _joint_graph(model, args, kwargs, ctx)


@contextlib.contextmanager
def _placeholders_for_meta(model: torch.nn.Module, args: tuple, kwargs: dict | None):
    """A model built on ``meta`` (its weights loaded into ``pm``, not into it) is traced with
    uninitialized parameters on the inputs' device in place of the meta ones, so the trace
    records that device (``x.device`` in ``.to(device=x.device)``), not ``meta``; nothing
    is computed, and the meta parameters are put back afterwards (tied ones stay tied)."""
    import torch.utils._pytree as pytree
    device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)), torch.device("cpu"))

    def real(p):
        if p.device.type != "meta":
            return None
        return torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                  requires_grad=p.requires_grad)
    with parameters_swapped(model, real):
        yield


def _joint_graph(model: torch.nn.Module, args: tuple, kwargs: dict | None, ctx=None) -> Joint:
    traced = trace(model, args, kwargs)
    cleanup_pass(traced.gm, ctx=PassReports())
    tied = _untie(traced, model)
    if ctx is not None:
        from ..passes.pad_vocab import pad_vocab_pass
        from ..passes.pipeline import run_passes
        ctx.padded_outputs = {}      # the logits left padded: blocks, or cut by the caller
        run_passes(traced.gm, [pad_vocab_pass], ctx)
    # the user's tensors in the export's input order (non-tensor inputs are baked in)
    import torch.fx._pytree as fx_pytree
    flat = list(fx_pytree.tree_flatten_spec(
        (tuple(args), _without_cache(model, dict(kwargs or {}))), traced.in_spec))
    factories_on_device(traced.gm, next((t.device for t in flat if isinstance(t, torch.Tensor)
                                         and t.device.type != "meta"), torch.device("cpu")))
    if add_dropout_sites(traced.gm, len(flat)) is not None:
        flat.append(pack_seed(0))
    return joint_of(traced, model, flat, tied)


def factories_on_device(gm: fx.GraphModule, device: torch.device) -> int:
    """A forward traced on meta inputs bakes ``device="meta"`` into the factory ops that take
    an input's device (``torch.arange(S, device=ids.device)``: positions for a learned table);
    the joint graph replays it on the inputs' ``device`` (inference's ``localize_pass`` does
    the same for rank programs). Returns how many ops moved."""
    moved = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device) \
                and node.kwargs["device"].type == "meta":
            node.update_kwarg("device", device)
            moved += 1
    if moved:
        gm.recompile()
    return moved


def joint_of(traced: Traced, model: torch.nn.Module, flat: list, tied: dict,
             grad_inputs: frozenset = frozenset(), split: dict | None = None) -> Joint:
    """The joint graph of an exported (cleaned, untied) forward ``traced`` of ``model``'s
    parameters on the flat user inputs ``flat``. ``grad_inputs``: user input indices whose
    gradient the joint returns too, named ``input_grad_name(index)`` in ``Joint.grads`` (a
    pipeline stage's received activations, :mod:`fxshard.training.pipeline`)."""
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput, GradAOTOutput, ParamAOTInput, PlainAOTInput, PlainAOTOutput,
        TangentAOTInput)
    user = [n for n in traced.gm.graph.nodes if n.op == "placeholder"
            and n.meta.get("fxshard_input") is not None]
    replay = _Replay(traced, model, split)
    tensors = [flat[n.meta["fxshard_input"]] for n in user]
    tensors = [t.detach().requires_grad_(True) if n.meta["fxshard_input"] in grad_inputs
               else t for n, t in zip(user, tensors)]
    # the replay reads user input k at position k of its arguments
    index = {n.meta["fxshard_input"]: k for k, n in enumerate(user)}
    replay.kinds = [(kind, index[ref]) if kind == "input" else (kind, ref)
                    for kind, ref in replay.kinds]
    names = {f"p{i}": n.meta["fxshard_param"] for i, n in enumerate(
        n for n in traced.gm.graph.nodes if n.op == "placeholder")
        if n.meta.get("fxshard_param") is not None}
    buffers = {f"b{i}": n.meta["fxshard_buffer"] for i, n in enumerate(
        n for n in traced.gm.graph.nodes if n.op == "placeholder")
        if n.meta.get("fxshard_buffer") is not None}
    try:
        gm = export_joint(replay, tensors)
    except Exception as e:   # a raw trace error would not say what to change
        if isinstance(e, NotImplementedError) and str(e).startswith("fxshard"):
            raise
        raise _backward_trace_error(model, e) from e
    gm.graph._codegen = fx.graph.CodeGen()   # plain flat inputs and outputs
    params = []
    for node in gm.graph.nodes:
        desc = node.meta.get("desc")
        if node.op != "placeholder":
            continue
        if isinstance(desc, ParamAOTInput):
            node.meta["fxshard_param"] = names[desc.target]
            params.append(names[desc.target])
        elif isinstance(desc, BufferAOTInput):
            node.meta["fxshard_buffer"] = buffers[desc.target]
        elif isinstance(desc, PlainAOTInput):
            for key in ("fxshard_input", "fxshard_input_name"):
                if key in user[desc.idx].meta:
                    node.meta[key] = user[desc.idx].meta[key]
        elif isinstance(desc, TangentAOTInput) and isinstance(desc.output, PlainAOTOutput):
            node.meta["fxshard_tangent"] = desc.output.idx
        else:
            raise NotImplementedError(
                f"fxshard.training: joint graph input {node.name} is {desc!r}; only "
                f"parameters, buffers, user inputs and output gradients are supported")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    descs = out.meta.get("desc") or []
    from torch._functorch._aot_autograd import descriptors
    mutations = tuple(getattr(descriptors, k) for k in (
        "InputMutationAOTOutput", "MetadataMutationAOTOutput") if hasattr(descriptors, k))
    odd = [d for d in descs if isinstance(d, mutations)]
    if odd:   # (a buffer updated under no_grad in forward: its new value came out first)
        target = getattr(getattr(odd[0], "mutated_input", None), "target", None)
        what = buffers.get(target) or names.get(target) or repr(odd[0])
        raise NotImplementedError(
            f"fxshard.training: {type(model).__name__}'s forward mutates {what} in place, "
            f"e.g. a running statistic updated in train mode; fxshard trains "
            f"forwards that only compute their outputs. Update such state outside forward, "
            f"or keep the module in eval() mode while training")
    n_outputs = sum(isinstance(d, PlainAOTOutput) for d in descs)
    grads = []
    for d in descs[n_outputs:]:
        if isinstance(d, GradAOTOutput) and isinstance(d.grad_of, ParamAOTInput):
            grads.append(names[d.grad_of.target])
        elif isinstance(d, GradAOTOutput) and isinstance(d.grad_of, PlainAOTInput):
            grads.append(input_grad_name(user[d.grad_of.idx].meta["fxshard_input"]))
        else:
            grads.append(None)
    if list(out.args[0][n_outputs:]) and len(grads) != len(out.args[0]) - n_outputs:
        raise AssertionError((descs, out.args))
    _no_dropout(gm, model)
    gm.recompile()
    seed = next((n.meta["fxshard_input"] for n in traced.gm.graph.nodes
                 if n.op == "placeholder" and n.meta.get("fxshard_seed")), None)
    return Joint(gm=gm, traced=traced, n_outputs=n_outputs, grads=grads, params=params,
                 tied=tied, seed=seed, flat=list(flat), grad_inputs=grad_inputs)


def _untie(traced: Traced, model: torch.nn.Module) -> dict:
    """Tied parameters (one tensor under several names: a tied embedding and lm_head) are
    separate inputs of the export; make them one, so that autograd sums the gradients of
    every use into one (as the single-device model's ``.grad``). Returns {other name: the
    kept name}."""
    first: dict[int, fx.Node] = {}
    tied = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for node in list(traced.gm.graph.nodes):
        fqn = node.meta.get("fxshard_param")
        if node.op != "placeholder" or fqn is None:
            continue
        kept = first.setdefault(id(params[fqn]), node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            traced.gm.graph.erase_node(node)
            tied[fqn] = kept.meta["fxshard_param"]
    if tied:
        traced.gm.graph.lint()
        traced.gm.recompile()
    return tied


def input_grad_name(index: int) -> str:
    """The name a user input's gradient has in ``Joint.grads`` (never a parameter's FQN)."""
    return f"<input {index}>"


_RANDOM = ("native_dropout", "bernoulli", "rand", "randn", "randint", "rand_like",
           "randn_like")


def _no_dropout(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """A random op left in the joint graph (not one of the forward export's dropout sites,
    which :mod:`fxshard.training.dropout` rewrites to masks drawn alike on every mesh) would
    draw different numbers per rank: a clear error."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name == "native_dropout" and node.args[1] == 0:
            continue   # p = 0: an all-ones mask, the same on every rank
        if node.op == "call_function" and name in _RANDOM:
            raise NotImplementedError(
                f"fxshard.training: {type(model).__name__}'s joint graph draws random "
                f"numbers ({node.target} at {node.name}) outside the dropout sites fxshard "
                f"draws alike on every rank (aten.dropout, SDPA's dropout_p in the forward "
                f"export). Use torch.nn.functional.dropout for it, or call model.eval()")
