"""Pad a vocab that ``tp`` does not divide, so the embedding table and the logits split over it.

GPT-2's tied table has 50257 rows: no ``tp > 1`` divides them, and an uneven shard would make the
ranks' programs differ. This pass makes the graph's table ``V' = ceil(V / tp) * tp`` rows long
(a large vocab's rows per rank rounded up to a multiple of 64: :func:`padded_rows`; the rank
holds ``V' / tp`` rows; the rows past ``V`` are zeros that no result reads), so every rule sees an even vocab split: the lookup is vocab-parallel and the head
column-parallel, as for a vocab that divides (an untied head of ``V`` rows, without a bias, is
padded alone: it was kept whole on every rank). The padded columns of the logits never reach a
result: a softmax, log-softmax, max or argmax over the vocab reads them masked to ``-inf``
(after any elementwise op on the way: a soft cap of ``-inf`` would not stay ``-inf``), their
gradients are zeros, and any other use, a graph output included, reads the logits sliced back
to ``V`` (a gather on ``tp``: correct, not vocab-parallel)::

    before (V = 91, tp = 2):
        embedding = embedding(w, ids)                           # w [91, 48]
        t = t(w); mm = mm(x, t)                                 # [N, 91]
        view = view(mm, [2, 8, 91]); logp = _log_softmax(view, -1, False)
        return (view, nll_loss_forward(logp, target, ...))
    after:
        embedding = embedding(w, ids)                           # w [92, 48]
        t = t(w); mm = mm(x, t)                                 # [N, 92]
        view = view(mm, [2, 8, 92])
        pad = ge(arange(0, 92), 91); masked = masked_fill(view, pad, -inf)
        logp = _log_softmax(masked, -1, False)
        return (slice(view, 2, 0, 91), nll_loss_forward(logp, target, ...))

A training joint (``ctx.padded_outputs`` a dict) leaves an output padded on its last dim (the
logits) and records ``{output index: V}``: the training module returns it as ``tp`` blocks
whose padded columns a loss on them never reads (:mod:`fxshard.training.vocab_output`), or
cut to ``V`` where it is gathered. The table's placeholder holds ``V'`` rows from here on: the rank programs' slots, the training
program's parameter and gradient. Where fxshard takes the model's weight (or a checkpoint's)
into shards it pads the rows (:func:`fxshard.placement.pad_to`), and where it gives a whole
tensor back (``gradients()``, ``state_dict()``, ``save_safetensors``) it cuts them
(:func:`fxshard.placement.cut_to`); ``ctx.padded`` maps each padded FQN to its model shape.
A table ``plan=`` places, or ``embedding_style="replicate"``, is not padded.
"""
from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx

from ..mesh import TP
from . import PassCtx

aten = torch.ops.aten

__all__ = ["pad_vocab_pass", "padded_rows"]

# the padded dim is kept (moved by a transpose); values elsewhere computed as before
_THROUGH = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.contiguous.default, aten.expand.default,
    aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.neg.default,
    aten.tanh.default, aten.squeeze.dim, aten.squeeze.dims, aten.select.int, aten.slice.Tensor,
}
# a reduction over the padded dim that reads it masked to -inf
_MASKED = {aten._log_softmax.default, aten._softmax.default, aten.log_softmax.int,
           aten.softmax.int, aten.argmax.default, aten.amax.default, aten.max.dim,
           aten.logsumexp.default}
# reads the log-probabilities at the targets only (never a padded class)
_AT_TARGETS = {aten.nll_loss_forward.default, aten.gather.default}
_SCALARS = {aten.mul.Tensor, aten.div.Tensor}
_MATMUL = {aten.mm.default, aten.matmul.default, aten.linear.default, aten.bmm.default}


def _plain_cross_entropy(node: fx.Node) -> bool:
    """``cross_entropy_loss(x, target)`` without class weights or label smoothing."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    args = dict(zip(names, node.args), **node.kwargs)
    return args.get("weight") is None and not args.get("label_smoothing", 0.0)


#: a large padded vocab's rows per rank are a multiple of this: a matmul of 16001 columns
#: ran 12% slower than one of 16000 or 16064 on CPU (``benchmarks/padded_vocab.py``), and GPU
#: kernels tile by 64 or 128 as well (Megatron pads to 128 per rank)
ALIGN = 64


def padded_rows(rows: int, n: int) -> int:
    """``rows`` rounded up to a multiple of ``n``; where each rank holds at least
    ``ALIGN * ALIGN`` rows, to a multiple of ``n * ALIGN`` (at most 1/64 more rows)."""
    per = -(-rows // n)
    if per >= ALIGN * ALIGN:
        per = -(-per // ALIGN) * ALIGN
    return per * n


def _tables(gm: fx.GraphModule, ctx: PassCtx, n: int) -> list[fx.Node]:
    """The vocab weights whose rows ``n`` does not divide and that ``plan=`` does not place:
    a tied table (an embedding's weight that is also a matmul's; not under
    ``embedding_style="replicate"``), and an untied head (a matmul's weight only, with as many
    rows as the graph's largest embedding table: the lm_head)."""
    from .rules.embedding import tied_to_matmul
    lookups = {u.args[0] for u in gm.graph.nodes if u.target is aten.embedding.default}
    # the vocab: the largest table's rows (not a position table's)
    vocabs = {max((t.meta["val"].shape[0] for t in lookups if isinstance(t, fx.Node)),
                  default=None)}
    out = []
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param")
        if node.op != "placeholder" or fqn is None or not tied_to_matmul(node):
            continue
        val = node.meta["val"]
        if val.dim() != 2 or val.shape[0] % n == 0 or ctx.plan_for(fqn) is not None:
            continue
        if node in lookups:
            if ctx.embedding_style == "replicate":
                continue
        elif val.shape[0] not in vocabs or any(
                u.target is aten.embedding.default or u.target is aten.linear.default and
                (len(u.args) > 2 and u.args[2] is not None or u.kwargs.get("bias") is not None)
                for u in node.users):
            continue     # (a head with a bias of V: kept as it was, whole on tp)
        out.append(node)
    return out


def _fake(vals):
    from torch._guards import detect_fake_mode
    return detect_fake_mode(vals)


def _value(node: fx.Node, mode=None):
    """The node's value computed again from its inputs' (fake) values (``mode``: the fake
    mode for a node without tensor inputs, a factory: never a real tensor on the traced
    device)."""
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a
    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    if node.target is operator.getitem:
        return args[0][args[1]]
    mode = _fake([a.meta["val"] for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)]) or mode
    if mode is None:
        return node.target(*args, **kwargs)
    with mode:
        return node.target(*args, **kwargs)


def _padded_dims(old, new, rows: int, padded: int) -> list[int] | None:
    """The dims of ``new`` that are the padded vocab (``old`` had ``rows`` there), or None
    where the shapes differ otherwise."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or \
            old.dim() != new.dim():
        return None
    dims = []
    for d, (a, b) in enumerate(zip(old.shape, new.shape)):
        if a == b:
            continue
        if a == rows and b == padded:
            dims.append(d)
        else:
            return None
    return dims


class _Padder:
    def __init__(self, gm: fx.GraphModule, rows: int, padded: int, ctx: PassCtx):
        self.gm, self.graph, self.rows, self.padded, self.ctx = gm, gm.graph, rows, padded, ctx
        self.dims: dict[fx.Node, list[int]] = {}     # padded node -> its padded dims
        self.cut: dict[fx.Node, fx.Node] = {}        # padded node -> its slice back to rows
        self.masked: dict[fx.Node, fx.Node] = {}
        self.counts = dict(masked=0, cut=0)

    def _new(self, target, args, like: fx.Node, kwargs=None) -> fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        for k in ("stack_trace", "nn_module_stack", "source_fn_stack", "fxshard_layer"):
            if k in like.meta:
                node.meta[k] = like.meta[k]
        node.meta["val"] = _value(node, _fake([like.meta["val"]]))
        return node

    def cut_of(self, node: fx.Node) -> fx.Node:
        """``node`` sliced back to ``rows`` on each padded dim (made once, after it)."""
        if node not in self.cut:
            out = node
            with self.graph.inserting_after(node):
                for d in self.dims[node]:
                    out = self._new(aten.slice.Tensor, (out, d, 0, self.rows), node)
                    out.meta["fxshard_vocab_cut"] = True    # (whole_weights: as the output)
            self.cut[node] = out
            self.counts["cut"] += 1
        return self.cut[node]

    def masked_of(self, node: fx.Node) -> fx.Node:
        """``node`` with its padded classes (its one padded dim, the last) set to -inf."""
        if node not in self.masked:
            dims = self.dims[node]
            d = dims[0] if len(dims) == 1 else None
            val = node.meta["val"]
            if d is None or d != val.dim() - 1 or not val.is_floating_point():
                return self.cut_of(node)
            with self.graph.inserting_after(node):
                iota = self._new(aten.arange.start, (0, self.padded), node,
                                 dict(dtype=torch.int64, device=val.device))
                with self.graph.inserting_after(iota):
                    pad = self._new(aten.ge.Scalar, (iota, self.rows), node)
                    with self.graph.inserting_after(pad):
                        self.masked[node] = self._new(aten.masked_fill.Scalar,
                                                      (node, pad, float("-inf")), node)
            self.counts["masked"] += 1
        return self.masked[node]

    def _reads_padded_dim(self, node: fx.Node, src: fx.Node) -> bool:
        """A reduction in ``_MASKED`` over ``src``'s padded (last) dim."""
        nd = src.meta["val"].dim()
        dims = self.dims[src]
        if node.target in (aten.argmax.default,):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            return dim is not None and dim % nd in dims
        if node.target in (aten.amax.default, aten.logsumexp.default):
            ds = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
            return list(d % nd for d in ds) == dims
        return node.args[1] % nd in dims      # softmax family, max.dim

    def _rewrite_shape(self, node: fx.Node) -> None:
        """A view's or expand's shape argument names the vocab: name the padded one."""
        if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                           aten.expand.default):
            shape = list(node.args[1])
            old = node.meta["val"].shape
            new = [self.padded if s == self.rows and d < len(old) and old[d] == self.rows
                   else s for d, s in enumerate(shape)]
            node.update_arg(1, new)

    def _keeps_vocab(self, node: fx.Node, new, dims: list[int]) -> bool:
        """A view or reshape keeps the padded dim as a dim of its own: as many elements
        before it and after it as in its input (``[2, 1, V] -> [V, 2]`` has the sizes right
        and the elements in another order: it reads the cut)."""
        if node.target not in (aten.view.default, aten.reshape.default,
                               aten._unsafe_view.default):
            return True
        src = node.args[0]
        before = self.dims.get(src, [])
        if len(before) != 1 or len(dims) != 1:
            return not before and not dims
        shape_in, shape_out = tuple(src.meta["val"].shape), tuple(new.shape)
        d_in, d_out = before[0], dims[0]
        return math.prod(shape_in[:d_in]) == math.prod(shape_out[:d_out]) and \
            math.prod(shape_in[d_in + 1:]) == math.prod(shape_out[d_out + 1:])

    def visit(self, node: fx.Node) -> None:
        srcs = [a for a in node.all_input_nodes if a in self.dims]
        if not srcs:
            return
        if node.op == "output":
            keep = getattr(self.ctx, "padded_outputs", None)
            flat = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for i, s in enumerate(flat):
                if s in self.dims and keep is not None and \
                        self.dims[s] == [s.meta["val"].dim() - 1]:
                    keep[i] = self.rows     # (training: left padded, cut by the caller)
            for s in srcs:
                if keep is None or self.dims[s] != [s.meta["val"].dim() - 1]:
                    node.replace_input_with(s, self.cut_of(s))
            return
        kind = self._kind(node, srcs)
        if kind == "cut":
            for s in srcs:
                node.replace_input_with(s, self.cut_of(s))
            return
        if kind == "masked":
            node.replace_input_with(srcs[0], self.masked_of(srcs[0]))
            srcs = [a for a in node.all_input_nodes if a in self.dims]
            if srcs:    # (masking fell back to a cut)
                return self.visit(node)
        old, args = node.meta.get("val"), node.args
        self._rewrite_shape(node)
        try:
            new = _value(node)
        except Exception:   # noqa: BLE001 (a shape the padded rows do not fit)
            new = None
        if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and \
                all(_padded_dims(a, b, self.rows, self.padded) == [] for a, b in zip(old, new)):
            node.meta["val"] = new               # (max.dim's values and indices: unpadded)
            return
        dims = _padded_dims(old, new, self.rows, self.padded)
        if dims is not None and not self._keeps_vocab(node, new, dims):
            dims = None
        if dims is None:     # the padded dim merged with another, or no value: on the cut
            node.args = args
            for s in [a for a in node.all_input_nodes if a in self.dims]:
                node.replace_input_with(s, self.cut_of(s))
            return
        node.meta["val"] = new
        if dims:
            self.dims[node] = dims

    def _kind(self, node: fx.Node, srcs: list[fx.Node]) -> str:
        t = node.target
        if t is aten.embedding.default and node.args[0] in srcs and len(srcs) == 1:
            return "through"          # rows looked up by ids below the vocab
        if t in _MATMUL and len(srcs) == 1:
            # the padded dim must be an output dim: the weight's rows, not the contraction
            src, i = srcs[0], node.args.index(srcs[0]) if srcs[0] in node.args else -1
            nd = src.meta["val"].dim()
            if t is aten.linear.default:
                return "through" if i == 1 and self.dims[src] == [0] else "cut"
            if i == 1 and self.dims[src] == [nd - 1]:
                return "through"
            if i == 0 and nd >= 2 and self.dims[src] == [nd - 2]:
                return "through"
            return "cut"
        if t in _THROUGH and node.args[0] in srcs and len(srcs) == 1:
            if t in (aten.select.int, aten.slice.Tensor, aten.squeeze.dim) and \
                    node.args[1] % node.args[0].meta["val"].dim() in self.dims[srcs[0]]:
                return "cut"          # indexing the padded dim: on the model's rows
            if t is aten.squeeze.dims:
                return "cut"
            return "through"
        if t in _SCALARS and len(srcs) == 1 and node.args[0] is srcs[0] and \
                not isinstance(node.args[1], fx.Node):
            return "through"
        if t in _MASKED and node.args[0] in srcs and len(srcs) == 1 and \
                self._reads_padded_dim(node, srcs[0]):
            return "masked"
        if t is aten.cross_entropy_loss.default and node.args[0] in srcs and \
                len(srcs) == 1 and _plain_cross_entropy(node) and \
                self.dims[srcs[0]] == [srcs[0].meta["val"].dim() - 1] and \
                srcs[0].meta["val"].dim() == 2:
            return "masked"           # (no class weight, no smoothing: classes at targets)
        if t in _AT_TARGETS and node.args[0] in srcs and len(srcs) == 1 and \
                (t is aten.gather.default or node.args[2] is None):
            src = srcs[0]
            last = src.meta["val"].dim() - 1
            dim_ok = (node.args[1] % (last + 1) == last) if t is aten.gather.default \
                else self.dims[src] == [last]
            if dim_ok and (src in self.masked.values() or src.target in _MASKED):
                return "through"      # the masked logits, or their log-probabilities
        return "cut"


def pad_vocab_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Pad each vocab weight (a tied table, an untied head) whose rows ``tp`` does not divide
    (see the module)."""
    n = ctx.mesh.axis_size(TP) if TP in ctx.mesh.axis_names else 1
    tables = _tables(gm, ctx, n) if n > 1 else []
    counts = dict(tables=0, masked=0, cut=0)
    for w in tables:
        val = w.meta["val"]
        rows = val.shape[0]
        p = _Padder(gm, rows, padded_rows(rows, n), ctx)
        mode = _fake([val])
        with mode if mode is not None else contextlib.nullcontext():
            w.meta["val"] = torch.empty((p.padded, *val.shape[1:]), dtype=val.dtype,
                                        device=val.device if mode is not None else "meta")
        p.dims[w] = [0]
        for node in list(gm.graph.nodes):
            if node is not w:
                p.visit(node)
        fqn = w.meta["fxshard_param"]
        for name in {fqn, *ctx.aliases.get(fqn, ())}:
            ctx.padded[name] = tuple(val.shape)
        counts["tables"] += 1
        counts["masked"] += p.counts["masked"]
        counts["cut"] += p.counts["cut"]
    ctx.report("pad_vocab_pass", padded_tables=counts["tables"], masked=counts["masked"],
               cut=counts["cut"])
    return gm
