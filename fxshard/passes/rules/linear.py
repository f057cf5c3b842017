"""Linear and matmul: the Megatron plan falls out of one rule.

``linear(x[..., K], w[N, K], b[N])`` on the ``tp`` axis, for a weight no earlier rule placed::

    x: R or S(batch/seq dim)  -> column-parallel: w S(0), b S(0), x gathered to R, out S(-1)
    x: S(-1)                  -> row-parallel:    w S(1), b P (added on one rank), out P
    x: P                      -> reduce x first, then column-parallel

On every other axis weights stay Replicate and the shard of ``x`` passes through. A weight
placed already (plan override, a tied embedding) is honoured and ``x`` is moved to match it.

``matmul``/``mm``/``bmm`` use dimension labels, einsum style: a shard on a batch or free dim
passes through, a shard on the contracted dim of both operands gives a partial sum.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...placement import P, R, Partial, Replicate, Shard
from . import UNDECIDED, Decision, RuleCtx, rule, tensor_inputs

aten = torch.ops.aten


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
            w = Shard(0)

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
    if isinstance(x, Shard) and x.dim != last:
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
                    labels_out: list[str], ctx: RuleCtx) -> Decision:
    """Generic einsum strategy on one axis (no label may broadcast against a size-1 dim)."""
    tensors = tensor_inputs(node)
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
    partial = [isinstance(p, Partial) for p in ins]
    if sum(partial) == 1:
        return Decision(ins=[P if q else R for q in partial], out=P)
    return Decision(ins=[R] * len(ins), out=R)


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def matmul_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    a, b = node.args[0], node.args[1]
    a_nd, b_nd, out_nd = ctx.ndim(a), ctx.ndim(b), ctx.ndim(node)
    if a_nd < 2 or b_nd < 2:
        return Decision(ins=[R] * len(ins), out=R)
    la, lb, lo = _matmul_labels(a_nd, b_nd, out_nd)
    return einsum_decision(node, [R if q is UNDECIDED else q for q in ins], [la, lb], lo, ctx)


@rule(aten.addmm.default)
def addmm_rule(node: fx.Node, ins: list, ctx: RuleCtx) -> Decision:
    # addmm(bias[N], x[M, K], w[K, N]): a shard on M passes through, anything else replicates
    bias, x, w = ins
    if isinstance(x, Shard) and x.dim == 0 and isinstance(w, Replicate):
        return Decision(ins=[R, x, R], out=x)
    return Decision(ins=[R, R, R], out=R)
