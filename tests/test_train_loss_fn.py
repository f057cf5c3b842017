"""``pm.train_step(ids, loss_fn=, target=)``: the user's loss traced with the model.

A cross-entropy on the logits is then vocab-parallel on tp inside the program (the logits
gathered over no axis; ``loss_fn(pm(ids), labels)`` runs on the logits' tp blocks, gathered
over dp); gradients and AdamW steps
equal the single-device model's; a loss is traced once per function (an inline lambda in a
loop too), losses that differ only in their closure are told apart, and a loss that cannot
be traced runs on the output with a warning. Sizes uneven on purpose (hidden 48, vocab 96,
sequence 6).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.training.with_loss import LossNotTracedWarning
from tests.test_train_grads import V, _data, _llama, _loss

TOL = dict(rtol=1e-5, atol=1e-5)
# the traced path, never the fallback, unless a test asks for the warning
pytestmark = pytest.mark.filterwarnings(
    "error::fxshard.training.with_loss.LossNotTracedWarning")


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()),
                                    mesh_dim_names=tuple(axes))


def _vocab_gathers(pm, which="forward"):
    """The all-gathers over tp of a tensor whose last dim is a vocab shard."""
    return [c for c in pm.trainer.collectives(which)
            if c.op.startswith("all_gather") and c.axis == "tp" and c.shape
            and c.shape[-1] == V // pm.spec.axis_size("tp")]


def _setup(**axes):
    """A ParallelModule of a one-layer Llama on mesh ``axes``, a copy of the model to train
    alone, and a batch."""
    model = _llama(layers=1)
    ref = copy.deepcopy(model)
    ids, labels = _data()
    return fxshard.parallelize(model, _mesh(**axes)), ref, ids, labels


def _same_step(pm, ref, loss, ref_loss):
    """pm's loss and gradients by name against the single-device model's (``ref_loss``'s
    backward is run here)."""
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


def _shifted_ce(out, labels):  # HF's causal-LM loss: predict token t+1 from tokens <= t
    return F.cross_entropy(out[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("axes", [dict(tp=2), dict(dp=2, tp=2), dict(fsdp=2, tp=2),
                                  dict(fsdp=2)])
@pytest.mark.parametrize("loss_fn", [_loss, _shifted_ce], ids=["ce", "shifted"])
def test_traced_loss_trains_as_one_device(axes, loss_fn):
    pm, ref, ids, labels = _setup(**axes)
    # step 0: the gradients; then three AdamW steps (the shards exist after the first call)
    loss = pm.train_step(ids, loss_fn=loss_fn, target=labels)
    ref_loss = loss_fn(ref(ids), labels)
    _same_step(pm, ref, loss, ref_loss)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    losses, want = [loss], [ref_loss.detach()]
    for _ in range(3):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(pm.train_step(ids, loss_fn=loss_fn, target=labels))
        ref_loss = loss_fn(ref(ids), labels)
        ref_loss.backward()
        want.append(ref_loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), **TOL)
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), **TOL, msg=name)
    if "tp" in axes:  # the loss in the graph: the logits are never gathered
        assert _vocab_gathers(pm) == []
        assert _vocab_gathers(pm, "backward") == []
    pm.close()


def test_neither_the_loss_on_the_output_nor_the_traced_loss_gathers_the_logits():
    """The same model, mesh and loss: on ``pm(ids)``'s output the logits are blocks over tp
    and dp (``fxshard.training.vocab_output``: the loss runs on them, no all-gather on
    either axis); traced, the loss is in the program (``vocab_nll_loss_forward``) and the
    logits are gathered on neither axis either."""
    from fxshard.training.vocab_output import VocabShardedTensor
    model = _llama(layers=1)
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(dp=2, tp=2))
    out = pm(ids)
    assert isinstance(out, VocabShardedTensor)
    _loss(out, labels).backward()
    assert _vocab_gathers(pm) == []
    over_dp = [c for c in pm.trainer.collectives("forward")
               if c.op.startswith("all_gather") and c.axis == "dp" and c.shape[-1:] == (V // 2,)]
    assert over_dp == [] and [tuple(b.shape) for b in out.blocks] == [(2, 6, V // 2)] * 4
    pm.zero_grad()
    pm.train_step(ids, loss_fn=_loss, target=labels)
    assert _vocab_gathers(pm) == []
    assert [c for c in pm.trainer.collectives("forward") if c.op.startswith("all_gather")
            and c.axis == "dp" and c.shape[-1:] == (V // 2,)] == []
    ops = {n.target for n in pm.rank_module(0, "forward").graph.nodes if n.op == "call_function"}
    assert torch.ops.fxshard.vocab_nll_loss_forward.default in ops
    pm.close()


def test_inline_lambda_is_traced_once_and_closures_are_told_apart():
    pm, ref, ids, labels = _setup(tp=2)

    def weighted(w):
        return lambda out, t: w * _loss(out, t)
    half, double = 0.5, 2.0
    for _ in range(3):   # a lambda made anew each step: one program
        pm.train_step(ids, loss_fn=lambda out, t: _loss(out, t), target=labels)
    n_programs = len(pm.programs.training)
    got = [pm.train_step(ids, loss_fn=weighted(w), target=labels) for w in (half, double)]
    assert len(pm.programs.training) == n_programs + 2   # w is in each closure: two programs
    for w, loss in zip((half, double), got):
        torch.testing.assert_close(loss, w * _loss(ref(ids), labels).detach(), **TOL)
    pm.close()


def test_untraceable_loss_warns_and_runs_on_the_output():
    pm, ref, ids, labels = _setup(tp=2)

    def picky(out, t):   # data-dependent Python: export cannot trace it
        loss = _loss(out, t)
        return loss * 2 if loss.item() > 1e9 else loss
    with pytest.warns(LossNotTracedWarning, match=r"fxshard.training.train_step: "
                                                  r"loss_fn=.*picky.* could not be traced"):
        loss = pm.train_step(ids, loss_fn=picky, target=labels)
    _same_step(pm, ref, loss, picky(ref(ids), labels))
    import warnings
    with warnings.catch_warnings():   # remembered: no second trace, no second warning
        warnings.simplefilter("error", LossNotTracedWarning)
        pm.train_step(ids, loss_fn=picky, target=labels)
    pm.close()


def test_loss_without_target_and_with_the_hf_output():
    from tests.models import hf_llama
    model = hf_llama(layers=1, vocab=V)
    ref = copy.deepcopy(model)
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(tp=2))
    loss = pm.train_step(ids, loss_fn=lambda out: out.logits.float().logsumexp(-1).mean())
    _same_step(pm, ref, loss, ref(ids).logits.float().logsumexp(-1).mean())
    pm.close()
