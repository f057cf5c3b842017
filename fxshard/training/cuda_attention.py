"""On CUDA, the joint graph's attention backward runs fxshard's Triton kernel.

aot_autograd's joint graph holds the backward op SDPA's backend has (CPU flash attention's, on
CUDA flash's or memory-efficient attention's). When the training program runs on CUDA
(``ctx.mesh.device_type == "cuda"``), each is replaced by ``fxshard::attention_backward``
(:mod:`fxshard.ops.attention`: the Triton backward of :mod:`fxshard.kernels.triton_attention_bwd`
where it takes the shapes, torch's math otherwise), fed the forward's own ``out`` and ``lse``
(the forward op stays aten's; all of them store the natural-log logsumexp, fp32). The node
keeps its name, placement and users (``getitem`` 0, 1, 2 are dq, dk, dv in both)::

    before: bwd = aten._scaled_dot_product_flash_attention_backward(
                      grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True,
                      seed, offset, scale=0.125)
    after:  bwd = fxshard.attention_backward(q, k, v, None, out, lse, grad_out, None, True,
                                             0.125, 0, 0, 0.0)

Memory-efficient attention's lse is padded to a multiple of 32 rows: a ``slice`` to ``Sq``
rows is put before. Left as they are (aten's backward, the same result): dropout, an attention
bias/mask, a gradient of the bias, cuDNN's attention (its statistics' layout differs), head
sizes or dtypes the kernel does not take, and q/k/v split along the sequence (a ring_cp
attention, whose backward is the ring's). SDPA's ``is_causal`` is the top-left diagonal:
offsets 0, 0.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops.attention import attention_backward_op
from ..passes import PassCtx
from ..placement import Shard

aten = torch.ops.aten

__all__ = ["cuda_attention_backward_pass"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)     # fxshard.kernels.triton_attention.HEAD_DIMS


def _args(node: fx.Node, names: list[str]) -> dict:
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    return out


def _cpu_flash(node: fx.Node) -> dict | None:
    a = _args(node, ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p",
                     "is_causal"])
    if a.get("attn_mask") is not None:
        return None
    return a


def _cuda_flash(node: fx.Node) -> dict | None:
    return _args(node, ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                        "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                        "philox_seed", "philox_offset"])


def _efficient(node: fx.Node) -> dict | None:
    a = _args(node, ["grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp",
                     "philox_seed", "philox_offset", "dropout_p", "grad_input_mask",
                     "is_causal"])
    a["grad_out"] = a.pop("grad_out_")
    mask = list(a.get("grad_input_mask") or [])
    if a.get("attn_bias") is not None or (len(mask) > 3 and mask[3]) or any(
            u.target is not operator.getitem or u.args[1] == 3 for u in node.users):
        return None
    seq_q = a["query"].meta["val"].shape[2]
    if a["logsumexp"].meta["val"].shape[2] != seq_q:
        a["slice_lse_to"] = seq_q
    return a


_BACKWARDS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash,
    aten._scaled_dot_product_flash_attention_backward.default: _cuda_flash,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient,
}


def _sequence_sharded(a: dict) -> bool:
    """q, k or v split along the sequence (ring_cp): the ring's backward, not a local one
    (``passes/lower_attention.py`` lowers it; this pass must not take it first)."""
    return any(Shard(2) in (a[n].meta.get("fxshard_spec") or ())
               for n in ("query", "key", "value"))


def _kernel_takes(a: dict) -> bool:
    q, v, lse = (a[n].meta["val"] for n in ("query", "value", "logsumexp"))
    return (not a.get("dropout_p") and q.dtype in _DTYPES and q.shape[-1] in _HEAD_DIMS
            and v.shape[-1] in _HEAD_DIMS and lse.dtype == torch.float32
            and not _sequence_sharded(a))


def cuda_attention_backward_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Replace aten's attention backward by ``fxshard::attention_backward`` on a CUDA mesh
    (reports ``rewritten`` and ``left``: backward nodes kept as aten's)."""
    rewritten = left = 0
    if ctx.mesh.device_type != "cuda":
        ctx.report("cuda_attention_backward_pass", changed=False, rewritten=0, left=0)
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        read = _BACKWARDS.get(node.target) if node.op == "call_function" else None
        if read is None:
            continue
        a = read(node)
        if a is None or not _kernel_takes(a):
            left += 1
            continue
        lse = a["logsumexp"]
        if "slice_lse_to" in a:
            with graph.inserting_before(node):
                lse = graph.call_function(aten.slice.Tensor, (lse, 2, 0, a["slice_lse_to"]))
            val = a["logsumexp"].meta["val"]
            lse.meta.update({k: v for k, v in a["logsumexp"].meta.items() if k != "val"})
            lse.meta["val"] = val[:, :, :a["slice_lse_to"]]
        node.target = attention_backward_op.default
        node.args = (a["query"], a["key"], a["value"], None, a["out"], lse, a["grad_out"], None,
                     bool(a.get("is_causal", False)), a.get("scale"), 0, 0, 0.0)
        node.kwargs = {}
        if isinstance(node.meta.get("val"), (list, tuple)):
            node.meta["val"] = tuple(node.meta["val"][:3])   # efficient's 4th: the bias's
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    ctx.report("cuda_attention_backward_pass", changed=bool(rewritten), rewritten=rewritten,
               left=left)
    return gm
