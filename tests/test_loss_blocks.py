"""The vocab-parallel loss of bf16 logits upcasts per block (issue 42 item 3): the maximum,
log-sum-exp and target logit in float32 on each rank's tp block, the gradient written in
bf16, and no float32 copy of the rank's logits made or saved (HF's ``logits.float()`` before
its loss included).

Tolerances are derived (DESIGN section 3): the parallel result is compared with a float64 run
of the same bf16 weights, and may be no further from it than ``FACTOR`` times the single-device
bf16 run is (plus a few bf16 ulps of the value): the parallel run rounds to bf16 what one device
rounds (each matmul's outputs), and in addition once more where a tp Partial sum is all-reduced
in bf16, so its rounding error is at most about twice one device's.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxshard
import fxshard.ops.loss as loss_ops
from fxshard.training import parallelize_for_training
from tests.models import hf_llama

V, B, S = 160, 2, 7
FACTOR, ULPS = 2.0, 4
_EPS16 = torch.finfo(torch.bfloat16).eps


def _mesh(shape):
    names = {1: ("tp",), 2: ("dp", "tp")}[len(shape)]
    return fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)


class LossOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels=labels).loss


def _no_further(got: dict, one: dict, exact: dict) -> None:
    for name, want in exact.items():
        err = (got[name].double() - want).abs().max().item()
        single = (one[name].double() - want).abs().max().item()
        bound = FACTOR * single + ULPS * _EPS16 * want.abs().max().item()
        assert err <= bound, f"{name}: {err:.3g} from float64, one device {single:.3g}"


def _float32_logits_nodes(gm: fx.GraphModule, rows: int, vocab: int = V) -> list[str]:
    """Nodes of ``gm`` holding a float32 tensor the size of the logits (global shapes in the
    node metadata: ``rows x vocab``, the padded vocab's too)."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() >= 1 and \
                v.shape[-1] in (vocab, vocab + 1) and v.numel() == rows * v.shape[-1]:
            out.append(n.name)
    return out


@pytest.mark.grad
def test_hf_bf16_loss_upcasts_per_block_without_a_float32_logits_copy(monkeypatch):
    # a slice of 3 rows at a time: the sliced loops run several times
    monkeypatch.setattr(loss_ops, "_SLICE_ELEMENTS", 3 * V // 2)
    model = LossOnly(hf_llama(hidden=48, intermediate=72, vocab=V)).to(torch.bfloat16)
    exact = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = -100
    tm = parallelize_for_training(copy.deepcopy(model), _mesh((2, 2)))
    loss, one, ref = tm(ids, labels), model(ids, labels), exact(ids, labels)
    assert loss.dtype == one.dtype == torch.float32       # HF's loss: in float32
    for x in (loss, one, ref):
        x.backward()
    _no_further({"loss": loss.detach()}, {"loss": one.detach()}, {"loss": ref.detach()})
    grads = tm.gradients()
    assert all(grads[k].dtype == torch.bfloat16 for k in grads)
    _no_further(grads, {k: p.grad for k, p in model.named_parameters()},
                {k: p.grad for k, p in exact.named_parameters()})
    # HF's logits.float() is gone from the rank programs: no float32 [B*S, V] node, forward
    # or backward (the fp32 path had five: the cast, x - max, exp (saved), logp, the
    # gradient); the backward reads the bf16 logits and a float32 [B*S, 1] lse
    for which in ("forward", "backward"):
        gm = tm.rank_module(0, which)
        assert _float32_logits_nodes(gm, B * S) == [], which
    targets = {str(n.target) for n in tm.rank_module(0, "backward").graph.nodes}
    assert "fxshard.vocab_cross_entropy_grad.default" in targets
    assert "fxshard.vocab_cross_entropy_backward.default" not in targets


class _Head(torch.nn.Module):
    """bf16 logits into a cross-entropy without a cast (the loss in bf16, as one device's)."""

    def __init__(self, hidden, vocab, reduction):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.reduction = reduction

    def forward(self, x, target):
        logits = self.head(torch.relu(self.proj(x)))
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction=self.reduction)
        return loss.sum() if self.reduction == "none" else loss


@pytest.mark.grad
@pytest.mark.parametrize("vocab,reduction", [(20, "mean"), (22, "sum"), (22, "none")])
def test_bf16_cross_entropy_of_bf16_logits_is_float32_inside(vocab, reduction):
    """A cross-entropy of bf16 logits (11 classes per rank): computed in float32
    per block and rounded to bf16 once, so no further from float64 than one device's bf16
    loss; the gradients too."""
    torch.manual_seed(vocab)
    model = _Head(8, vocab, reduction).to(torch.bfloat16)
    exact = copy.deepcopy(model).double()
    x = torch.randn(2, 6, 8)
    target = torch.randint(0, vocab, (2, 6))
    target[0, :2] = -100
    tm = parallelize_for_training(copy.deepcopy(model), _mesh((2,)),
                                  plan={"proj": "replicate", "head": "colwise"})
    loss, one = tm(x.bfloat16(), target), model(x.bfloat16(), target)
    ref = exact(x.double(), target)
    assert loss.dtype == torch.bfloat16
    for t in (loss, one, ref):
        t.backward()
    _no_further({"loss": loss.detach()}, {"loss": one.detach()}, {"loss": ref.detach()})
    _no_further(tm.gradients(), {k: p.grad for k, p in model.named_parameters()},
                {k: p.grad for k, p in exact.named_parameters()})
    for which in ("forward", "backward"):
        assert not _float32_logits_nodes(tm.rank_module(0, which), 12, vocab), which


@pytest.mark.grad
def test_the_check_sees_float32_logits():
    """The structure check above can fail: the float32 model's rank programs hold them."""
    torch.manual_seed(0)
    tm = parallelize_for_training(_Head(8, 20, "mean"), _mesh((2,)),
                                  plan={"proj": "replicate", "head": "colwise"})
    tm(torch.randn(2, 6, 8), torch.randint(0, 20, (2, 6))).backward()
    for which in ("forward", "backward"):
        assert _float32_logits_nodes(tm.rank_module(0, which), 12, 20), which


@pytest.mark.grad
def test_cross_entropy_on_bf16_blocks_upcasts_a_slice_of_rows_at_a_time(monkeypatch):
    """``F.cross_entropy`` on a vocab-sharded bf16 output of ``pm(x)`` (the eager blocks of
    ``fxshard.training.vocab_output``): float32 inside, 2 rows at a time, the gradient in
    bf16; the loss and gradients no further from float64 than the joined tensor's
    ``F.cross_entropy(x.float())`` rounded alike (loss to bf16, its gradient to bf16)."""
    from tests.test_vocab_output import _pair
    widths = [5, 9, 3]
    monkeypatch.setattr(loss_ops, "_SLICE_ELEMENTS", 2 * max(widths))
    blocks, x, joined = _pair(widths, lead=(11,), dtype=torch.bfloat16, seed=4)
    target = torch.arange(11) * 5 % sum(widths)
    target[2] = -100
    exact = joined.detach().double().requires_grad_()
    got = F.cross_entropy(x, target)
    assert got.dtype == torch.bfloat16 and not x.gathered
    one = F.cross_entropy(joined.float(), target)
    ref = F.cross_entropy(exact, target)
    for t in (got, one, ref):
        t.backward()
    _no_further({"loss": got.detach()}, {"loss": one.detach().bfloat16()},
                {"loss": ref.detach()})
    grad = torch.cat([b.grad for b in blocks], -1)
    assert grad.dtype == torch.bfloat16
    _no_further({"grad": grad}, {"grad": joined.grad}, {"grad": exact.grad})
