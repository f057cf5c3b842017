"""Targets outside the vocab where the loss is vocab-parallel.

One device raises ``IndexError: Target 200 is out of bounds.`` for a label outside
``[0, V)`` (and not ``ignore_index``). Split over ``tp``, no rank holds such a target, so
the pick adds 0 and the loss was a plausible number (5.05 where one device raised). Every
place the loss is split checks the bounds once per call: the graph's loss
(``fxshard::vocab_nll_loss_forward``: HF's ``labels=``, ``train_step(loss_fn=, target=)``)
and a loss on ``pm(ids)``'s vocab blocks (``CrossEntropyRows``, ``Pick``); a vocab padded
for tp is bounded by the model's vocab, not the padded width.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxshard
from tests.models import hf_llama
from tests.test_train_models import TV, _model

GRAD = True   # autograd on (tests/conftest.py)
V = 128


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _ce(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _ids():
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))


def _labels(m, ids, t):
    return m(ids, labels=t).loss


def _gather(m, ids, t):
    return m(ids).logits.gather(-1, t.unsqueeze(-1)).sum()


# name -> (the call on pm, the same on the single-device model)
_CALLS = {
    "labels-step": (lambda pm, ids, t: pm.train_step(ids, labels=t), _labels),
    "labels-forward": (_labels, _labels),
    "loss_fn": (lambda pm, ids, t: pm.train_step(ids, loss_fn=_ce, target=t),
                lambda m, ids, t: _ce(m(ids), t)),
    "blocks": (lambda pm, ids, t: _ce(pm(ids), t), lambda m, ids, t: _ce(m(ids), t)),
    "blocks-gather": (_gather, _gather),
}


@pytest.mark.parametrize("call,bad", [("labels-step", 200), ("labels-forward", V),
                                      ("loss_fn", -1), ("blocks", V), ("blocks", -1),
                                      ("blocks-gather", 200)])
def test_a_target_outside_the_vocab_raises_as_on_one_device(call, bad):
    model = hf_llama(layers=1, vocab=V).train()
    ids = _ids()
    target = ids.clone()
    target[1, 4] = bad
    parallel, one_device = _CALLS[call]
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        one_device(model, ids, target)
    pm = fxshard.parallelize(model, _mesh(dp=1, tp=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(IndexError, match=rf"target {bad} is out of bounds for {V} classes"):
            parallel(pm, ids, target)


def test_ignored_targets_still_equal_one_device():
    """The bound check leaves ``ignore_index`` (-100, and a custom one) alone."""
    model = hf_llama(layers=1, vocab=V).train()
    ref = copy.deepcopy(model)
    ids = _ids()
    target = ids.clone()
    target[0, 2] = -100
    pm = fxshard.parallelize(model, _mesh(tp=2))
    torch.testing.assert_close(pm(ids, labels=target).loss, ref(ids, labels=target).loss)
    custom = ids.clone()
    custom[1, 1] = 999

    def ce(out, t):
        return F.cross_entropy(out.logits.flatten(0, 1), t.flatten(), ignore_index=999)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(ce(pm(ids), custom), ce(ref(ids), custom))


@pytest.mark.parametrize("where", ["labels", "blocks"])
def test_a_target_in_the_padding_of_a_padded_vocab_raises(where):
    """GPT-2 with 91 rows on tp=2 holds 92 (one padded): target 91 is outside the model's
    vocab although a rank holds column 91."""
    model = _model("gpt2_odd")
    v = TV + 1
    ids = torch.randint(0, v, (2, 6), generator=torch.Generator().manual_seed(0))
    target = ids.clone()
    target[0, 3] = v
    pm = fxshard.parallelize(model, _mesh(tp=2))
    with warnings.catch_warnings(), \
            pytest.raises(IndexError, match=rf"target {v} is out of bounds for {v} classes"):
        warnings.simplefilter("ignore")
        if where == "labels":
            pm.train_step(ids, labels=target)
        else:
            _ce(pm(ids), target)
