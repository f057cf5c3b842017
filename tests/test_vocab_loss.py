"""The vocab-parallel loss: HF's ``labels=`` loss and a cross-entropy inside the graph on tp and
dp·tp equal one device, and nothing ``[B, S, V]``-sized moves for it (forward or backward)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.explain import collectives_of
from fxshard.training import parallelize_for_training
from tests.models import hf_llama
from tests.train_checks import loss_and_grads_equal

V, B, S = 160, 2, 7      # V / tp (80, 40) is no other tensor's size


def _mesh(shape):
    names = {1: ("tp",), 2: ("dp", "tp")}[len(shape)]
    return fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = labels[1, 5] = -100
    return ids, labels


class LossOnly(torch.nn.Module):
    """The model's loss and nothing else (so no logits are returned, or gathered)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels=labels).loss


def _vocab_sized(gm: fx.GraphModule, spec, nodes=None) -> list:
    """Collectives of ``gm`` (those among ``nodes``) moving logits-like tensors: a vocab-sized
    dim and a token dim (a weight's gradient, ``[V, E]``, has none: 7 and 14 are no weight's
    size)."""
    return [c for c in collectives_of(gm.graph, spec) if (nodes is None or c.node in nodes)
            and any(d in (V, V // 2, V // 4) for d in c.shape)
            and any(d in (S, B * S) for d in c.shape)]


def _ancestors(gm: fx.GraphModule, index: int = 0) -> set[str]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    todo, seen = [out.args[0][index]], set()
    while todo:
        n = todo.pop()
        if isinstance(n, fx.Node) and n.name not in seen:
            seen.add(n.name)
            todo.extend(n.all_input_nodes)
    return seen


def _targets(gm):
    return {str(n.target) for n in gm.graph.nodes}


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_hf_labels_loss_on_tp_equals_one_device_without_gathering_logits(shape):
    model = hf_llama(hidden=48, intermediate=72, vocab=V)
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(shape))
    with torch.no_grad():
        out, ref = pm(ids, labels=labels), model(ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    gm = pm.rank_module(0)
    assert "fxshard.vocab_nll_loss_forward.default" in _targets(gm)
    # the loss reads no gathered logits: the one [B, S, V] gather is the returned logits'
    assert _vocab_sized(gm, pm.spec, _ancestors(gm, 0)) == []
    tp = [c for c in collectives_of(gm.graph, pm.spec) if c.node in _ancestors(gm, 0)
          and c.axis == "tp" and c.op in ("all_gather", "all_reduce")]
    n = B * S // (shape[0] if len(shape) == 2 else 1)
    loss_ops = sorted((c.op, c.shape) for c in tp if c.shape in ((n, 1), ()))
    assert loss_ops == [("all_gather", (n, 1)), ("all_reduce", ()), ("all_reduce", (n, 1))]


def test_loss_only_module_moves_nothing_vocab_sized_forward():
    model = LossOnly(hf_llama(hidden=48, intermediate=72, vocab=V))
    ids, labels = _data(1)
    pm = fxshard.parallelize(model, _mesh((2, 2)))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, labels), model(ids, labels), rtol=1e-5, atol=1e-5)
    assert _vocab_sized(pm.rank_module(0), pm.spec) == []


@pytest.mark.grad   # trains: grad enabled
@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_training_with_the_loss_inside_gradients_equal_one_device(shape):
    model = LossOnly(hf_llama(hidden=48, intermediate=72, vocab=V))
    ids, labels = _data(2)
    tm = parallelize_for_training(model, _mesh(shape))
    loss_and_grads_equal(tm, model, lambda m: m(ids, labels))
    for which in ("forward", "backward"):
        assert _vocab_sized(tm.rank_module(0, which), tm.spec) == [], which
    backward = _targets(tm.rank_module(0, "backward"))
    assert "aten._log_softmax_backward_data.default" not in backward   # rewritten, sharded
    # the cross-entropy's backward is one op over the [B*S, V/tp] logits (softmax recomputed
    # from the saved exp and log-sum-exp, times the row's weight, minus it at the target) and
    # moves nothing: the NLL gradient's row sum is known (it was zeros + scatter, a sum, its
    # all-reduce, exp, mul and sub: five passes)
    g = tm.rank_module(0, "backward").graph
    over_logits = [n.name for n in g.nodes if n.op == "call_function" and n.target not in
                   _MOVES_NOTHING and any(_logits_like(a) for a in (n, *n.all_input_nodes))]
    assert over_logits == ["vocab_cross_entropy_backward_default"], over_logits
    assert not [c for c in collectives_of(g, tm.spec) if c.shape == (B * S // shape[0], 1)]


_MOVES_NOTHING = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                  torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default,
                  torch.ops.aten.mm.default)   # views, and the lm_head's gradient matmuls


def _logits_like(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and tuple(v.shape) == (B * S, V)


class _Head(torch.nn.Module):
    def __init__(self, hidden, vocab, reduction, ignore):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.reduction, self.ignore = reduction, ignore

    def forward(self, x, target):
        logits = self.head(torch.relu(self.proj(x)))
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(),
                               reduction=self.reduction, ignore_index=self.ignore)
        return loss.sum() if self.reduction == "none" else loss


@pytest.mark.grad   # trains: grad enabled
@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(shape=st.sampled_from([(2,), (4,), (2, 2)]), reduction=st.sampled_from(["mean", "sum",
                                                                               "none"]),
       ignore=st.sampled_from([-100, 3]), vocab=st.sampled_from([12, 20]),
       seed=st.integers(0, 2 ** 16))
def test_cross_entropy_inside_any_reduction_and_ignore_index(shape, reduction, ignore, vocab,
                                                             seed):
    torch.manual_seed(seed)
    model = _Head(8, vocab, reduction, ignore)
    x = torch.randn(2, 6, 8)
    target = torch.randint(0, vocab, (2, 6))
    target[0, :2] = ignore if ignore >= 0 else -100
    # the head column-parallel: its logits vocab-sharded (the auto plan pairs it rowwise)
    tm = parallelize_for_training(model, _mesh(shape), plan={"proj": "replicate",
                                                             "head": "colwise"})
    loss_and_grads_equal(tm, model, lambda m: m(x, target))
    forward = tm.rank_module(0, "forward")
    assert "fxshard.vocab_nll_loss_forward.default" in _targets(forward)
