"""Linear and matmul: the Megatron plan falls out of one rule.

``linear(x[..., K], w[N, K], b[N])`` on the ``tp`` axis, for a weight no earlier rule placed::

    x: R or S(batch/seq dim)  -> column-parallel: w S(0), b S(0), x gathered to R, out S(-1)
    x: S(-1)                  -> row-parallel:    w S(1), b P (added on one rank), out P
    x: P                      -> reduce x first, then column-parallel

On every other axis weights stay Replicate and the shard of ``x`` passes through. A weight
placed already (plan override, a tied embedding) is honoured and ``x`` is moved to match it.

A *fused* projection (one Linear whose output every consumer splits into parts along the last
dim: ``qkv_proj`` sliced into q, k, v; ``gate_up_proj`` chunked in two) is column-parallel part
by part: ``w StridedShard(0, parts)``, out ``StridedShard(-1, parts)``; each rank then holds its
share of every part and the split gives each part as a plain ``S(-1)``, with no gather::

    linear(x, w_qkv[128, 64]) -> slice [0:64], [64:96], [96:128]
    tp=2: w S(0|64+32+32) local [64, 64]; out S(2|64+32+32); slices local [0:32], [32:48], [48:64]

Parts whose heads ``tp`` cannot split (multi-query K/V: one head) are held whole by every rank
(``ctx.whole_parts``, decided by ``passes/whole_weights.py``): ``w S(0|64+R16+R16)`` local
``[64, 64]``, the K/V slices come out ``R`` and the query slice ``S(-1)``.

``baddbmm(self, b1, b2)`` (ALiBi) is ``bmm`` plus ``self`` following the output's placement.

``addmm(bias[N], x[M, K], w[K, N])`` (GPT-2's ``Conv1D``, weight stored ``[in, out]``) is the
same projection with the weight transposed: column-parallel ``w S(1)``, ``bias S(0)``, out
``S(1)``; row-parallel ``x S(1)``, ``w S(0)``, ``bias P``.

``matmul``/``mm``/``bmm`` use dimension labels, einsum style: a shard on a batch or free dim
passes through, a shard on the contracted dim of both operands gives a partial sum. A weight
applied as ``x @ w.T`` (``w[N, K]`` transposed, then ``matmul``) is the linear again: the
weight's placement is chosen through the transpose (``propagate``'s weight views)::

    matmul(x[B, S, K], t(w[N, K]))   tp=2: w S(0), out S(2)   (x S(2): w S(1), out P)
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Replicate, Shard, StridedShard
from . import UNDECIDED, Decision, RuleCtx, is_tensor_node, rule, tensor_inputs

aten = torch.ops.aten

_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.unsqueeze.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def split_intervals(node: fx.Node, dim: int) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` pieces a slice/split/chunk ``node`` takes out of dim ``dim`` of its
    input, or None when it is not such a split of that dim."""
    x = node.args[0]
    nd = x.meta["val"].dim()
    size = x.meta["val"].shape[dim]
    if node.target is aten.slice.Tensor:
        args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
        d, start, end, step = args[1] % nd, args[2], args[3], args[4]
        if d != dim or step != 1:
            return None
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else min(end, size))
        return [(start, end)]
    if node.target not in _SPLITS:
        return None
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if d % nd != dim:
        return None
    if node.target is aten.split_with_sizes.default:
        sizes = list(node.args[1])
    else:
        step = node.args[1] if node.target is aten.split.Tensor else -(-size // node.args[1])
        sizes = [min(step, size - i) for i in range(0, size, step)]
    bounds = [0]
    for k in sizes:
        bounds.append(bounds[-1] + k)
    return list(zip(bounds[:-1], bounds[1:]))


def _carries(user: fx.Node, src: fx.Node, dim: int) -> int | None:
    """The output dim of ``user`` that holds dim ``dim`` of ``src`` unchanged (a reshape that
    keeps it, or an elementwise op whose other inputs broadcast along it), or None."""
    from . import lookup
    from .pointwise import identity_rule, pointwise_rule, untagged_pointwise_rule
    val = user.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    in_shape, out_shape = tuple(src.meta["val"].shape), tuple(val.shape)
    if user.target in _RESHAPES:
        if user.args[0] is not src:
            return None
        before = math.prod(in_shape[:dim])
        for e, n in enumerate(out_shape):
            if n == in_shape[dim] and math.prod(out_shape[:e]) == before:
                return e
        return None
    if lookup(user.target) not in (pointwise_rule, identity_rule, untagged_pointwise_rule):
        return None
    e = dim + len(out_shape) - len(in_shape)
    if e < 0 or out_shape[e] != in_shape[dim]:
        return None
    for t in tensor_inputs(user):
        if t is src:
            continue
        shp = tuple(t.meta["val"].shape)
        td = e - (len(out_shape) - len(shp))
        if td >= 0 and shp[td] != 1 and t.op != "placeholder":
            return None  # another full-width activation: not a plain pass-through
        # (a full-width parameter or buffer, Falcon-H1's ``in_proj(x) * mup_vector``, is
        # sliced part by part like the projection's output)
    return e


def _into_heads(user: fx.Node, src: fx.Node, dim: int) -> int | None:
    """The output dim of reshape ``user`` that splits dim ``dim`` of ``src`` into (that dim,
    the next): ``[B, S, 72] -> [B, S, 6, 12]`` gives 2; else None."""
    val = user.meta.get("val")
    if user.target not in _RESHAPES or user.args[0] is not src or \
            not isinstance(val, torch.Tensor):
        return None
    in_shape, out_shape = tuple(src.meta["val"].shape), tuple(val.shape)
    if len(out_shape) != len(in_shape) + 1 or out_shape[:dim] != in_shape[:dim] or \
            out_shape[dim + 2:] != in_shape[dim + 1:] or \
            out_shape[dim] * out_shape[dim + 1] != in_shape[dim]:
        return None
    return dim


def fused_parts(node: fx.Node, dim: int, size: int, whole=frozenset()
                ) -> tuple[int, ...] | None:
    """Part sizes of a fused projection: when every use of ``node``'s dim ``dim`` ends, through
    reshapes and elementwise ops, in slices/splits that cut it into the same disjoint parts
    (each a multiple of ``size``, but the parts numbered in ``whole``), those parts; else None
    (a plain projection)."""
    total = node.meta["val"].shape[dim]
    pieces: set[tuple[int, int]] = set()
    stack, budget = [(node, dim, 1)], 64
    while stack:
        cur, d, scale = stack.pop()   # (scale: elements of ``node``'s dim per index of d)
        for u in cur.users:
            budget -= 1
            if budget < 0 or u.op != "call_function":
                return None
            iv = split_intervals(u, d) if u.args and u.args[0] is cur else None
            if iv is not None:
                from .split import nested_pieces   # a part split again (xBC -> x, B, C)
                nested = nested_pieces(u, d) if scale == 1 else {}
                for a, b in iv:
                    pieces.update(nested.get((a, b)) or [(a * scale, b * scale)])
                continue
            e = _carries(u, cur, d)
            if e is not None:
                stack.append((u, e, scale))
                continue
            e = _into_heads(u, cur, d)   # HF Falcon: view(.., heads + 2, d).split(.., -2)
            if e is None:
                return None
            stack.append((u, e, scale * u.meta["val"].shape[e + 1]))
    bounds = sorted({b for iv in pieces for b in iv} | {0, total})
    parts = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if len(parts) < 2 or any(k % size for j, k in enumerate(parts) if j not in whole) or \
            len(whole) >= len(parts) or \
            any(b - a not in parts or a not in bounds for a, b in pieces) or \
            any(sum(1 for x in bounds if a < x < b) for a, b in pieces):
        return None
    return parts


def fused_out(p, start: int, end: int):
    """The placement of ``[start, end)`` of a ``StridedShard`` dim: plain ``Shard`` when it is
    one part, a ``StridedShard`` of the parts when it is several, None when it cuts a part."""
    bounds = [0]
    for k in p.parts:
        bounds.append(bounds[-1] + k)
    if start not in bounds or end not in bounds or start >= end:
        return None
    first, stop = bounds.index(start), bounds.index(end)
    sub = tuple(p.parts[first:stop])
    whole = frozenset(j - first for j in p.whole if first <= j < stop)
    if len(whole) == len(sub):
        return R           # parts every rank holds whole
    return Shard(p.dim) if len(sub) == 1 else StridedShard(p.dim, sub, whole)


def _weight_of(n: fx.Node) -> str | None:
    """The parameter FQN of ``n`` or of the parameter ``n`` transposes (``w.T``)."""
    if n.op == "call_function" and n.target in (aten.t.default, aten.transpose.int,
                                                aten.permute.default, aten.numpy_T.default):
        n = n.args[0]
    return n.meta.get("fxshard_param")


def _is_param(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.meta.get("fxshard_param") is not None


@rule(aten.linear.default)
def linear_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    tensors = tensor_inputs(node)
    x, w = ins[0], ins[1]
    has_bias = len(ins) > 2
    b = ins[2] if has_bias else None
    last = ctx.ndim(node.args[0]) - 1
    bias_param = has_bias and _is_param(tensors[2])

    if w is UNDECIDED:
        if not ctx.is_tp:
            w = R
        elif isinstance(x, Shard) and x.dim == last:
            w = Shard(1)
        else:
            whole = ctx.whole_parts.get(_weight_of(tensors[1]), frozenset())
            parts = fused_parts(node, last, ctx.size, whole) if not has_bias or bias_param \
                and b is UNDECIDED else None
            w = StridedShard(0, parts, whole) if parts else Shard(0)

    if isinstance(w, StridedShard) and w.dim == 0:     # fused column-parallel
        need = [R, w] + ([w] if has_bias else [])
        return Decision(ins=need, out=replace(w, dim=last))
    if isinstance(w, Shard) and w.dim == 0:            # column-parallel
        need = [R, w] + ([Shard(0)] if has_bias else [])
        return Decision(ins=need, out=Shard(last))
    if isinstance(w, Shard) and w.dim == 1:            # row-parallel
        if has_bias and not (b is UNDECIDED and bias_param) and not isinstance(b, Partial):
            # a bias that is not ours to place cannot be added exactly once: gather the weight
            return Decision(ins=[R, R, R], out=R)
        need = [Shard(last), w] + ([P] if has_bias else [])
        return Decision(ins=need, out=P)
    # replicated weight
    bias = [R] if has_bias else []
    if isinstance(x, (Shard, StridedShard)) and x.dim != last:
        return Decision(ins=[x, R] + bias, out=x)
    if isinstance(x, Partial) and not has_bias:
        return Decision(ins=[P, R], out=P)
    return Decision(ins=[R, R] + bias, out=R)


def _matmul_labels(a_nd: int, b_nd: int, out_nd: int):
    """Labels per dim: batch dims 'b<i>' aligned to the output, then m, k / k, n."""
    nb = out_nd - 2
    a = [f"b{i + nb - (a_nd - 2)}" for i in range(a_nd - 2)] + ["m", "k"]
    b = [f"b{i + nb - (b_nd - 2)}" for i in range(b_nd - 2)] + ["k", "n"]
    out = [f"b{i}" for i in range(nb)] + ["m", "n"]
    return a, b, out


def einsum_decision(node: fx.Node, ins: list, labels_in: list[list[str]],
                    labels_out: list[str], ctx: RuleCtx, *, tensors=None) -> Decision:
    """Generic einsum strategy on one axis (no label may broadcast against a size-1 dim)."""
    tensors = tensor_inputs(node) if tensors is None else tensors
    shapes = [ctx.shape(t) for t in tensors]
    sizes = {}
    for lab, shp in zip(labels_in, shapes):
        for l, n in zip(lab, shp):
            sizes[l] = max(sizes.get(l, 1), n)

    def real(i, l):  # label l present in input i with its full (unbroadcast) size
        return l in labels_in[i] and shapes[i][labels_in[i].index(l)] == sizes[l]

    for i, p in enumerate(ins):
        if isinstance(p, Shard):
            l = labels_in[i][p.dim]
            if not real(i, l):
                continue
            if l in labels_out:
                need = [Shard(labels_in[j].index(l)) if real(j, l) else R
                        for j in range(len(ins))]
                return Decision(ins=need, out=Shard(labels_out.index(l)))
            if all(real(j, l) for j in range(len(ins))):
                return Decision(ins=[Shard(labels_in[j].index(l)) for j in range(len(ins))],
                                out=P)
    for i, p in enumerate(ins):   # a fused dim, or a merged [B*S] dim with S sharded (context
        if isinstance(p, StridedShard):   # parallelism): its parts pass (or contract) as one
            l = labels_in[i][p.dim]
            if not real(i, l):
                continue
            if l in labels_out:
                need = [replace(p, dim=labels_in[j].index(l)) if real(j, l) else R
                        for j in range(len(ins))]
                return Decision(ins=need, out=replace(p, dim=labels_out.index(l)))
            if not p.whole and all(real(j, l) for j in range(len(ins))):
                return Decision(ins=[replace(p, dim=labels_in[j].index(l))
                                     for j in range(len(ins))], out=P)
    partial = [isinstance(p, Partial) for p in ins]
    if sum(partial) == 1:
        return Decision(ins=[P if q else R for q in partial], out=P)
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def matmul_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """A 2-D weight ``w[K, N]`` no earlier rule placed as the right operand (``x @ w`` or,
    through a transpose of the parameter, ``x @ w.T``) is placed as ``linear`` places its
    weight: on ``tp`` column-parallel ``w S(1)`` (fused parts strided), out ``S(-1)``, or
    row-parallel ``w S(0)`` when ``x`` arrives sharded on K, out ``P``. Experts stored as one
    3-D parameter ``w[E, K, N]`` used through ``bmm(x[E, T, K], w)`` (Llama 4) are placed the
    same way, every expert at once: ``w S(2)`` (a fused gate/up: ``S(2|I+I)``) or ``w S(1)``."""
    a, b = node.args[0], node.args[1]
    a_nd, b_nd, out_nd = ctx.ndim(a), ctx.ndim(b), ctx.ndim(node)
    if a_nd < 2 or b_nd < 2:
        return Decision(ins=[R if q is UNDECIDED else q for q in ins], out=R)
    x, w = ins
    experts = b_nd == 3 and a_nd == 3 and _weight_of(b) is not None   # w[E, K, N] per expert
    if w is UNDECIDED and (b_nd == 2 or experts) and ctx.is_tp:
        last, col, row = out_nd - 1, b_nd - 1, b_nd - 2
        if isinstance(x, Shard) and x.dim == a_nd - 1:
            return Decision(ins=[x, Shard(row)], out=P)
        whole = ctx.whole_parts.get(_weight_of(b), frozenset())
        parts = fused_parts(node, last, ctx.size, whole)
        if parts:
            return Decision(ins=[R, StridedShard(col, parts, whole)],
                            out=StridedShard(last, parts, whole))
        if ctx.shape(b)[col] % ctx.size == 0:
            return Decision(ins=[R, Shard(col)], out=Shard(last))
    if isinstance(w, StridedShard) and w.dim == b_nd - 1 and (b_nd == 2 or experts):
        return Decision(ins=[R, w], out=replace(w, dim=out_nd - 1))
    la, lb, lo = _matmul_labels(a_nd, b_nd, out_nd)
    return einsum_decision(node, [R if q is UNDECIDED else q for q in ins], [la, lb], lo, ctx)


@rule(aten.baddbmm.default)
def baddbmm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``baddbmm(self, b1[B, M, K], b2[B, K, N], beta, alpha)`` (BLOOM/MPT ALiBi scores):
    the bmm decides, einsum style; ``self`` (broadcast to ``[B, M, N]``) follows the output's
    shard where it has that dim whole, and is a partial addend when the output is Partial."""
    tensors = tensor_inputs(node)
    if len(tensors) != 3:
        return Decision(ins=[R] * len(ins), out=R)
    la, lb, lo = _matmul_labels(3, 3, 3)
    d = einsum_decision(node, [R if q is UNDECIDED else q for q in ins[1:]], [la, lb], lo, ctx,
                        tensors=tensors[1:])
    out_shape, self_shape = ctx.shape(node), ctx.shape(tensors[0])
    if isinstance(d.out, Partial):
        if self_shape != out_shape or isinstance(ins[0], Shard):
            return Decision(ins=[R] * 3, out=R)
        return Decision(ins=[P] + d.ins, out=P)
    if isinstance(d.out, (Shard, StridedShard)):   # strided: a merged [B*H] dim, H on tp
        sd = d.out.dim - (len(out_shape) - len(self_shape))
        need = R if sd < 0 or self_shape[sd] != out_shape[d.out.dim] else \
            Shard(sd) if isinstance(d.out, Shard) else replace(d.out, dim=sd)
        return Decision(ins=[need] + d.ins, out=d.out)
    return Decision(ins=[R] + d.ins, out=d.out)


@rule(aten.addmm.default)
def addmm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    """``addmm(bias[N], x[M, K], w[K, N])``: a weight ``[in, out]`` (``Conv1D``). On ``tp`` an
    undecided weight is column-parallel (``w S(1)``, fused parts as for linear) or, when ``x``
    arrives sharded on K, row-parallel (``w S(0)``, bias Partial); a shard on M passes through."""
    bias, x, w = ins
    tensors = tensor_inputs(node)
    m, n = ctx.shape(node)
    if len(tensors) != 3 or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return Decision(ins=[R] * len(ins), out=R)
    bias_1d = ctx.shape(tensors[0]) == (n,)
    if w is UNDECIDED:
        if not ctx.is_tp or not bias_1d:
            w = R
        elif isinstance(x, Shard) and x.dim == 1:
            w = Shard(0)
        else:
            whole = ctx.whole_parts.get(_weight_of(tensors[2]), frozenset())
            parts = fused_parts(node, 1, ctx.size, whole) if bias is UNDECIDED else None
            w = StridedShard(1, parts, whole) if parts else Shard(1)
    if isinstance(w, StridedShard) and w.dim == 1 and bias_1d:        # fused column-parallel
        return Decision(ins=[replace(w, dim=0), R, w], out=w)
    if isinstance(w, Shard) and w.dim == 1 and bias_1d:               # column-parallel
        return Decision(ins=[Shard(0), R, w], out=Shard(1))
    if isinstance(w, Shard) and w.dim == 0 and bias_1d:               # row-parallel
        return Decision(ins=[P, Shard(1), w], out=P)
    if isinstance(x, (Shard, StridedShard)) and x.dim == 0 and \
            not isinstance(w, (Shard, StridedShard)):
        # rows (tokens) pass through: a batch shard, or the sequence shard of flattened tokens
        b = x if ctx.ndim(tensors[0]) == 2 and ctx.shape(tensors[0])[0] == m else R
        return Decision(ins=[b, x, R], out=x)
    return Decision(ins=[R, R, R], out=R)
