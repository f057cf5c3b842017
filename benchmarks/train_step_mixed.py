"""``train_step.py --mixed bf16``: the variants in bf16 mixed precision (issue 42's benchmark).

Every variant keeps float32 master weights and AdamW state and computes in bf16:

  megatron      Megatron-LM's recipe by hand: :class:`benchmarks.common.MegatronLlama` built on
                a bf16 copy of the model (bf16 weight slices, the compute), float32 main
                parameters beside them (what AdamW steps), the gradients copied into float32
                main gradients, averaged over fsdp in one float32 all-reduce, the step's result
                copied back to the bf16 weights. Its vocab-parallel loss upcasts the rank's
                logits to float32 (Megatron's). The baseline (1.00).
  fxshard       ``fxshard.parallelize(model, mesh, mixed_precision=MixedPrecisionPolicy(
                param_dtype=bf16, reduce_dtype=fp32))``; the loss on the returned (bf16,
                vocab-sharded) logits, ``.float()`` first as HF's loss does.
  fxshard-loss  the same with the cross-entropy (of ``logits.float()``) inside the traced
                module: vocab-parallel and upcast per block (no float32 copy of the logits).
  dtensor       torchtitan's recipe with the same policy: ``parallelize_module`` on tp
                (``loss_parallel``), ``fully_shard(..., mp_policy=policy)`` of every layer and
                the root on fsdp.

The reference is the single-device model under ``torch.autocast("cpu", dtype=bfloat16)`` with
float32 AdamW (:func:`reference_mixed`).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import MegatronLlama

__all__ = ["MIXED_VARIANTS", "policy", "reference_mixed", "build_mixed", "cpu_bf16_flags"]

MIXED_VARIANTS = ("megatron", "fxshard", "fxshard-loss", "dtensor")


def policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def cpu_bf16_flags() -> str:
    """The CPU's bf16 / AMX flags from /proc/cpuinfo (none: bf16 matmuls are emulated)."""
    want = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16", "avx512f")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    found = [w for w in want if w in flags]
    return ", ".join(found) if found else "none of " + "/".join(want[:3]) + \
        " (bf16 matmuls emulated in fp32)"


def reference_mixed(model, args, batch_of, adamw) -> tuple[list[float], list[float]]:
    """One device under bf16 autocast, float32 weights and AdamW: losses and gradient norms."""
    m = copy.deepcopy(model).train()
    opt = adamw(m.parameters(), args)
    ids, labels = batch_of(args)
    losses, norms = [], []
    for _ in range(args.check_steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        norms.append(sum(p.grad.double().pow(2).sum() for p in m.parameters()).sqrt().item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


class _LossF32(torch.nn.Module):
    """The model and the cross-entropy of its float32 logits in one traced module."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return F.cross_entropy(self.model(ids).float().flatten(0, 1), labels.flatten())


def _megatron(model, mesh, args, ids, labels, adamw):
    tp = mesh["tp"]
    m = MegatronLlama(copy.deepcopy(model).to(torch.bfloat16), tp.get_local_rank(), tp.size(),
                      mesh.get_group("tp"), trainable=True)
    params = m.parameters()
    main = [p.detach().float().requires_grad_() for p in params]
    opt = adamw(main, args)
    group = mesh.get_group("fsdp")

    def step(norms=None) -> float:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        loss = m.loss(ids, labels)
        loss.backward()
        grads = [p.grad.float() for p in params]       # float32 main gradients
        if dist.get_world_size(group) > 1:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat /= dist.get_world_size(group)
            grads = list(_unflatten_dense_tensors(flat, grads))
        for p, w, g in zip(params, main, grads):
            p.grad, w.grad = None, g
        if norms is not None:
            norms.append(_tp_norm(m, main))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, w in zip(params, main):
                p.copy_(w)
        return loss.item()
    return step


def _tp_norm(m, main) -> float:
    """``MegatronLlama.grad_norm`` of the float32 main gradients (``main`` in the order of
    ``m.parameters()``): tp-sharded ones summed over ranks, replicated ones counted once."""
    whole = {id(m.norm), *(id(L[k]) for L in m.layers for k in ("ln1", "ln2"))}
    if m.embedding == "replicate":
        whole.add(id(m.embed))
    sq = torch.zeros((), dtype=torch.float64)
    for p, w in zip(m.parameters(), main):
        if w.grad is not None and (id(p) not in whole or m.rank == 0):
            sq += w.grad.double().pow(2).sum()
    dist.all_reduce(sq, group=m.group)
    return sq.sqrt().item()


def _dtensor(model, mesh, args, ids, labels, adamw):
    from contextlib import nullcontext

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from benchmarks.dtensor_baseline import dtensor_tp_plan
    m = copy.deepcopy(model).train()
    parallelize_module(m, mesh["tp"], dtensor_tp_plan(model, loss_parallel=True))
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh["fsdp"], mp_policy=policy())
    fully_shard(m, mesh=mesh["fsdp"], mp_policy=policy())
    opt = adamw(m.parameters(), args)

    def step(norms=None) -> float:
        with loss_parallel() if mesh["tp"].size() > 1 else nullcontext():
            out = m(ids)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
        if norms is not None:
            sq = sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     .double().pow(2).sum() for p in m.parameters())
            norms.append(float(sq) ** 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor().item() if hasattr(loss, "full_tensor") else \
            loss.item()
    return step


def build_mixed(name: str, model, mesh, args, *, batch_of, adamw, local_batch):
    """``step(norms=None)`` of variant ``name`` in bf16 mixed precision on this rank.
    ``local_batch``: this rank's (fsdp) share of the batch; fxshard takes the global one."""
    ids, labels = local_batch
    if name == "megatron":
        return _megatron(model, mesh, args, ids, labels, adamw)
    if name == "dtensor":
        return _dtensor(model, mesh, args, ids, labels, adamw)
    if name not in ("fxshard", "fxshard-loss"):
        raise ValueError(f"train_step.py --mixed: variant {name!r} has no mixed-precision "
                         f"form; choose from {', '.join(MIXED_VARIANTS)}")
    import fxshard
    ids, labels = batch_of(args)      # every rank passes the global batch; fxshard splits it
    if name == "fxshard":
        pm = fxshard.parallelize(copy.deepcopy(model).train(), mesh, example_inputs=(ids,),
                                 mixed_precision=policy())
        loss_of = lambda: F.cross_entropy(pm(ids).float().flatten(0, 1),  # noqa: E731
                                          labels.flatten())
    else:
        pm = fxshard.parallelize(_LossF32(copy.deepcopy(model).train()), mesh,
                                 example_inputs=(ids, labels), mixed_precision=policy())
        loss_of = lambda: pm(ids, labels)  # noqa: E731
    opt = adamw(pm.parameters(), args)

    def step(norms=None) -> float:
        loss = loss_of()
        loss.backward()
        if norms is not None:
            norms.append(float(fxshard.clip_grad_norm_(pm, float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step
