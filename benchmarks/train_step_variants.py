"""train_step.py's variants: :func:`build` makes each one's training step on a rank
(``megatron``: :class:`benchmarks.common.MegatronLlama` + data parallel over fsdp; ``dtensor``:
TP + FSDP2; ``fxshard*``: ``fxshard.parallelize`` with the loss on the logits, inside the
traced module (:class:`WithLoss`), through ``train_step(loss_fn=)``, meta-built and loaded,
with recompute or compiled), every one with :func:`adamw`; :func:`reference` gives the
single-device losses and gradient norms they are checked against.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import (MegatronLlama, bundled_llama, dtensor_step, dtensor_train,
                               megatron_step, token_ids)

__all__ = ["batch_of", "reference", "adamw", "build", "WithLoss", "mesh_of"]


def batch_of(args):
    """The global batch's inputs and next-token labels (``--batch`` x ``--seq``)."""
    ids = token_ids(args.vocab, args.batch, args.seq + 1, seed=1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference(model, args) -> tuple[list[float], list[float]]:
    """The single-device model's losses and gradient norms over ``--check-steps`` AdamW steps on
    the whole batch (``--mixed bf16``: under bf16 autocast, float32 weights and AdamW)."""
    if getattr(args, "mixed", None) == "bf16":
        from benchmarks.train_step_mixed import reference_mixed
        return reference_mixed(model, args, batch_of, adamw)
    m = copy.deepcopy(model).train()
    opt = adamw(m.parameters(), args)
    ids, labels = batch_of(args)
    losses, norms = [], []
    for _ in range(args.check_steps):
        loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        norms.append(sum(p.grad.double().pow(2).sum() for p in m.parameters()).sqrt().item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def adamw(params, args) -> torch.optim.AdamW:
    """Every variant's (and the reference's) optimizer: ``torch.optim.AdamW`` in the
    ``--optimizer`` implementation (``fused``: torchtitan's default, one kernel over each
    tensor; ``foreach``; ``for-loop``: torch's CPU default, a temporary per op)."""
    impl = {"fused": dict(fused=True), "foreach": dict(foreach=True),
            "for-loop": dict(foreach=False)}[args.optimizer]
    return torch.optim.AdamW(params, lr=args.lr, **impl)


def build(name: str, model, mesh, args):
    """``(step, mean_loss)`` of variant ``name`` on this rank: ``step(norms=None)`` runs one
    training step on this rank's share of the batch (appending the global gradient norm to
    ``norms``) and returns this rank's loss; ``mean_loss`` averages it over the fsdp ranks."""
    fsdp = mesh["fsdp"].get_local_rank()
    per = args.batch // mesh["fsdp"].size()
    ids, labels = (t[fsdp * per:(fsdp + 1) * per] for t in batch_of(args))
    dp_group = mesh.get_group("fsdp")

    def mean_over_fsdp(loss: float) -> float:
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=dp_group)
        return t.item() / mesh["fsdp"].size()

    if getattr(args, "mixed", None) == "bf16":     # benchmarks/train_step_mixed.py
        from benchmarks.train_step_mixed import build_mixed
        return build_mixed(name, model, mesh, args, batch_of=batch_of, adamw=adamw,
                           local_batch=(ids, labels)), mean_over_fsdp

    if name == "megatron":
        m = MegatronLlama(model, mesh["tp"].get_local_rank(), mesh["tp"].size(),
                          mesh.get_group("tp"), trainable=True)
        opt = adamw(m.parameters(), args)
        return (lambda norms=None: megatron_step(m, opt, ids, labels, dp_group, norms),
                mean_over_fsdp)
    if name == "dtensor":
        m = dtensor_train(model, mesh)
        opt = adamw(m.parameters(), args)
        return lambda norms=None: dtensor_step(m, opt, ids, labels, norms), mean_over_fsdp
    if name in ("fxshard", "fxshard-dp", "fxshard-layers", "fxshard-keep", "fxshard-loss",
                "fxshard-lossfn",
                "fxshard-recompute", "fxshard-meta", "fxshard-compile"):
        import fxshard
        # fxshard-dp: the same ranks as (dp, tp), Megatron's parallelism
        on = mesh_of(args, ("dp", "tp")) if name == "fxshard-dp" else mesh
        ids, labels = batch_of(args)    # every rank passes the global batch; fxshard splits it
        if name in ("fxshard-meta", "fxshard-layers", "fxshard-keep"):  # meta-built: each rank
            with fxshard.init_empty_weights():                          # loads its shards
                empty = bundled_llama(args)
            reshard = {"fxshard-layers": "layers", "fxshard-keep": False}.get(name, True)
            pm = fxshard.parallelize(empty.train(), on, example_inputs=(ids,),
                                     fsdp_reshard_after_forward=reshard)
            fxshard.load_safetensors(pm, args.checkpoint)
            loss_of = lambda: F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten())  # noqa
        elif name == "fxshard-lossfn":  # the loss given to train_step: traced with the model
            pm = fxshard.parallelize(copy.deepcopy(model).train(), on, example_inputs=(ids,))
            loss_of = lambda: pm.train_step(ids, loss_fn=_ce, target=labels)  # noqa: E731
        elif name not in ("fxshard-loss", "fxshard-compile"):  # the loss on the logits
            recompute = "layers" if name == "fxshard-recompute" else None
            pm = fxshard.parallelize(copy.deepcopy(model).train(), on, example_inputs=(ids,),
                                     recompute=recompute)
            loss_of = lambda: F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten())  # noqa
        else:                         # the loss inside the traced module: vocab-parallel
            pm = fxshard.parallelize(WithLoss(copy.deepcopy(model).train()), on,
                                     example_inputs=(ids, labels),
                                     compile=name == "fxshard-compile")
            loss_of = lambda: pm(ids, labels)  # noqa: E731
        opt = adamw(pm.parameters(), args)

        def step(norms=None) -> float:
            loss = loss_of()
            if name != "fxshard-lossfn":   # train_step ran the backward itself
                loss.backward()
            if norms is not None:
                norms.append(float(fxshard.clip_grad_norm_(pm, float("inf"))))
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        # the loss is already the global batch's: its mean over the fsdp ranks is itself
        return step, mean_over_fsdp
    raise ValueError(f"train_step.build: unknown variant {name!r}")


def _ce(logits, labels):
    """The loss ``fxshard-lossfn`` gives ``train_step``: cross-entropy of the logits."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class WithLoss(torch.nn.Module):
    """``model`` and its cross-entropy in one module, so the loss is in fxshard's graph (as
    HF's ``labels=``): vocab-parallel on tp, the logits never gathered."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return F.cross_entropy(self.model(ids).flatten(0, 1), labels.flatten())


def mesh_of(args, names=("fsdp", "tp")):
    """The ``(ranks / tp, tp)`` device mesh on CPU, its axes named ``names``."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (args.ranks // args.tp, args.tp), mesh_dim_names=names)
