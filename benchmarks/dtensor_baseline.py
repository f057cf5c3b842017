"""The DTensor baseline the benchmarks compare fxshard with: :func:`dtensor_tp_plan` (the one
``parallelize_module`` plan), :func:`dtensor_tp`, and :func:`dtensor_train` +
:func:`dtensor_step` (TP plan + ``fully_shard``: torchtitan's 2-D recipe; FSDP2 runs on CPU gloo
with torch 2.13), :func:`dtensor_loss`. Scripts import them through :mod:`benchmarks.common`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

__all__ = ["dtensor_tp_plan", "dtensor_tp", "dtensor_train", "dtensor_loss", "dtensor_step"]


def dtensor_tp_plan(model, *, embedding_and_head: bool = True, loss_parallel: bool = False):
    """The one ``parallelize_module`` plan. For :func:`tutorial_blocks`: ColwiseParallel
    wq/wk/wv/w1, RowwiseParallel wo/w2. For a Llama: ColwiseParallel q/k/v/gate/up,
    RowwiseParallel o/down; with ``embedding_and_head``, the embedding and lm_head
    ColwiseParallel with Replicate output (what fxshard shards too). ``loss_parallel``
    (training, torchtitan's recipe): the embedding RowwiseParallel (vocab-sharded), the lm_head's
    output left sharded on the vocab as a DTensor for ``torch.distributed.tensor.parallel.
    loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not hasattr(model, "config"):  # tutorial_blocks: the lesson's own plan
        plan = {}
        for i in range(len(model)):
            for name in ("attention.wq", "attention.wk", "attention.wv", "mlp.w1"):
                plan[f"{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "mlp.w2"):
                plan[f"{i}.{name}"] = RowwiseParallel()
        return plan
    plan = {}
    if loss_parallel:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    elif embedding_and_head:
        plan["model.embed_tokens"] = ColwiseParallel(output_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = RowwiseParallel()
    return plan


def dtensor_tp(model, device_mesh, *, embedding_and_head: bool = True):
    """A copy of ``model`` tensor-parallel by ``parallelize_module`` with
    :func:`dtensor_tp_plan`, on a 1-D ``torch.distributed`` device mesh."""
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(copy.deepcopy(model), device_mesh,
                              dtensor_tp_plan(model, embedding_and_head=embedding_and_head))


def dtensor_train(model, device_mesh, *, tp_axis: str | None = "tp",
                  fsdp_axis: str | None = "fsdp"):
    """A trainable copy of ``model`` by torchtitan's 2-D recipe: ``parallelize_module`` on the
    ``tp_axis`` sub-mesh (:func:`dtensor_tp_plan` with ``loss_parallel``), then
    ``fully_shard`` (FSDP2) of every decoder layer and of the root on the ``fsdp_axis`` sub-mesh
    (parameters sharded on dim 0, all-gathered before use and again in backward, gradients
    reduce-scattered). Either axis may be None. Train mode, fp32. Use :func:`dtensor_loss` for
    the loss."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    m = copy.deepcopy(model).train()
    if tp_axis is not None:
        parallelize_module(m, device_mesh[tp_axis], dtensor_tp_plan(model, loss_parallel=True))
    if fsdp_axis is not None:
        mesh = device_mesh[fsdp_axis]
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    m._fxshard_bench_loss_parallel = tp_axis is not None
    return m


def dtensor_loss(m, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of :func:`dtensor_train`'s model; under tp the logits stay
    vocab-sharded (``loss_parallel``). Call ``.backward()`` inside :func:`dtensor_backward`."""
    out = m(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def dtensor_step(m, opt, ids, labels, norms: list | None = None) -> float:
    """One forward + backward + optimizer step of :func:`dtensor_train`'s model; with a list
    ``norms``, appends the global gradient norm (before the step) to it."""
    from contextlib import nullcontext
    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel() if m._fxshard_bench_loss_parallel else nullcontext():
        loss = dtensor_loss(m, ids, labels)
        loss.backward()
    if norms is not None:  # each gradient gathered whole (its meshes differ under TP + FSDP)
        sq = sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 .double().pow(2).sum() for p in m.parameters())
        norms.append(float(sq) ** 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
