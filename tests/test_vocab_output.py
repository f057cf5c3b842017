"""``pm(x)``'s logits held as ``tp`` blocks (``fxshard.training.vocab_output``).

On the tensor alone (simulated blocks of uneven widths, hypothesis): the ops a loss takes on
the way to a cross-entropy run on the blocks and give the values and gradients the same ops
give on the joined tensor; any other op sees the whole tensor (gathered once); an in-place op
is an error. On a model: a cross-entropy on ``pm(ids)``'s logits equals the single device's
(loss, every gradient, AdamW steps) on tp, dp·tp, fsdp·tp with sequence parallel, and the
forward program gathers no ``[B, S, V]`` over ``tp``.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.training.vocab_output import Blocks, VocabShardedTensor
from tests.test_train_grads import V, _data, _llama

GRAD = True   # autograd on (tests/conftest.py)
TOL = dict(rtol=1e-5, atol=1e-5)


def _pair(widths, lead=(3, 5), seed=0, dtype=torch.float32):
    """Leaf blocks ``[*lead, w]`` per width, the tensor over them, and the joined leaf."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(*lead, sum(widths), generator=g, dtype=torch.float64).to(dtype) * 3
    blocks = [b.clone().requires_grad_(True) for b in whole.split(list(widths), -1)]
    joined = whole.clone().requires_grad_(True)
    return blocks, VocabShardedTensor(blocks, Blocks(len(widths), list(range(len(widths))))), \
        joined


def _same(got, want, blocks, joined):
    """Values equal; the gradients of a random weighting of the result equal, block by block."""
    torch.testing.assert_close(got, want.detach(), **TOL)
    if not want.requires_grad:      # (an integer result)
        return
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=want.dtype)
    (got * w).sum().backward()
    (want * w).sum().backward()
    for b, part in zip(blocks, joined.grad.split([b.shape[-1] for b in blocks], -1)):
        torch.testing.assert_close(b.grad, part, **TOL)


_LEADING = [  # ops on the leading dims, as a loss writes them: (name, fn)
    ("shift", lambda x: x[:-1]),
    ("flatten", lambda x: x.flatten(0, -2)),
    ("view", lambda x: x.contiguous().view(-1, x.size(-1))),   # (a view needs contiguity)
    ("reshape", lambda x: x.reshape(-1, x.shape[-1])),
    ("ellipsis", lambda x: x[..., 1:, :]),
    ("float", lambda x: x.float()),
    ("to", lambda x: x.to(torch.float32)),
    ("temperature", lambda x: x / 0.7),
    ("scale", lambda x: 2.0 * x),
    ("contiguous", lambda x: x.contiguous()),
    ("index", lambda x: x[torch.tensor([1, 0])]),
]


@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       ops=st.lists(st.sampled_from(range(len(_LEADING))), max_size=3),
       reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.1]), ignored=st.integers(0, 3),
       seed=st.integers(0, 5))
def test_cross_entropy_on_blocks_equals_the_joined_tensors(widths, ops, reduction, smoothing,
                                                           ignored, seed):
    blocks, x, joined = _pair(widths, lead=(6, 5), seed=seed)
    y = joined
    for i in ops:
        x, y = _LEADING[i][1](x), _LEADING[i][1](y)
        assert isinstance(x, VocabShardedTensor), _LEADING[i][0]   # ran on the blocks
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, sum(widths), (y.shape[0],), generator=g)
    target[:ignored] = -100
    got = F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)
    want = F.cross_entropy(y, target, reduction=reduction, label_smoothing=smoothing)
    assert not isinstance(got, VocabShardedTensor) and not x.gathered
    _same(got, want, blocks, joined)


_PADDED_OPS = [   # a loss's ops on blocks of a padded vocab: (name, fn of (x, target, weight))
    ("ce", lambda x, t, w: F.cross_entropy(x, t)),
    ("ce_smooth_weight", lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.1,
                                                         ignore_index=2)),
    ("ce_rows", lambda x, t, w: F.cross_entropy(x, t, reduction="none")),
    ("logp_at_targets", lambda x, t, w: x.log_softmax(-1).gather(-1, t[:, None])),
    ("softmax", lambda x, t, w: x.softmax(-1)),
    ("full", lambda x, t, w: x * 2.0 + 0),
]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 4), width=st.integers(1, 5), short=st.integers(1, 8),
       op=st.sampled_from(range(len(_PADDED_OPS))), seed=st.integers(0, 5))
def test_blocks_of_a_padded_vocab_read_only_its_columns(n, width, short, op, seed):
    """Blocks of a vocab padded for tp (``Blocks(valid=V)``, the columns past ``V`` hold
    garbage, whole blocks of it where blocks are narrower than the padding): every op reads
    the ``V`` columns only, as on the joined tensor cut to ``V``; the padded columns get no
    gradient."""
    total = n * width
    pad = min(short, total - 1)   # (whole blocks of padding where a block is narrower)
    valid = total - pad
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(7, total, generator=g, dtype=torch.float64).float() * 3
    blocks = [b.clone().requires_grad_(True) for b in whole.split(width, -1)]
    x = VocabShardedTensor(blocks, Blocks(n, list(range(n)), valid=valid))
    joined = whole[:, :valid].clone().requires_grad_(True)
    assert x.shape == (7, valid)
    target = torch.randint(0, valid, (7,), generator=g)
    weight = torch.linspace(0.5, 1.5, valid)
    name, fn = _PADDED_OPS[op]
    got, want = fn(x, target, weight), fn(joined, target, weight)
    torch.testing.assert_close(got, want.detach(), **TOL)
    r = torch.randn(want.shape, generator=g)
    (got * r).sum().backward()
    (want * r).sum().backward()
    grad = torch.cat([b.grad for b in blocks], -1)
    torch.testing.assert_close(grad[:, :valid], joined.grad, **TOL)
    if pad:
        assert grad[:, valid:].abs().max().item() == 0, name


def test_cross_entropy_on_blocks_saves_no_log_probabilities():
    """Without label smoothing the cross-entropy runs in one piece on each block
    (``CrossEntropyRows``): the only block-sized tensors autograd saves are the blocks
    themselves (log-softmax then pick would save ``[rows, V/tp]`` log-probabilities), and
    values and gradients equal the joined tensor's, in bfloat16 too."""
    for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        blocks, x, joined = _pair([4, 7, 2], lead=(15,), dtype=dtype)
        target = torch.arange(15) % 13
        target[3] = -100
        saved = []

        def pack(t):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = F.cross_entropy(x, target)
        big = [t for t in saved if t.dim() == 2 and t.shape[-1] > 1]
        assert big and all(any(t.data_ptr() == b.data_ptr() for b in blocks) for t in big), \
            [tuple(t.shape) for t in big]
        want = F.cross_entropy(joined.float(), target).to(dtype)
        torch.testing.assert_close(got, want.detach(), **tol)
        got.backward()
        want.backward()
        for b, part in zip(blocks, joined.grad.split([4, 7, 2], -1)):
            torch.testing.assert_close(b.grad, part, **tol)


@pytest.mark.parametrize("name,fn", [
    ("log_softmax", lambda x: F.log_softmax(x, dim=-1)),
    ("softmax", lambda x: torch.softmax(x, -1)),
    ("method", lambda x: x.log_softmax(-1)),
    ("nll", lambda x: F.nll_loss(F.log_softmax(x.flatten(0, 1), -1),
                                 torch.arange(15) % x.shape[-1], ignore_index=3)),
    ("token_logprobs", lambda x: x.log_softmax(-1).gather(
        -1, (torch.arange(15).view(3, 5, 1) * 7) % x.shape[-1]).squeeze(-1)),
    ("chunked", lambda x: torch.cat([F.cross_entropy(c, t, reduction="none") for c, t in zip(
        x.flatten(0, 1).split(4), (torch.arange(15) % x.shape[-1]).split(4))])),
    ("crossentropyloss", lambda x: torch.nn.CrossEntropyLoss()(
        x.flatten(0, 1), torch.arange(15) % x.shape[-1])),
])
def test_the_losses_ops_on_blocks(name, fn):
    blocks, x, joined = _pair([4, 7, 2])
    got = fn(x)
    assert not x.gathered          # ran on the blocks
    _same(got, fn(joined), blocks, joined)


@pytest.mark.parametrize("name,fn", [
    ("argmax", lambda x: x.argmax(-1)),
    ("max", lambda x: x.max(-1).values),
    ("square", lambda x: (x ** 2).mean(-1)),
    ("vocab_slice", lambda x: x[..., 1:5]),
    ("transpose_ce", lambda x: F.cross_entropy(x.transpose(1, 2), torch.arange(15).view(3, 5) % 13)),
    ("weighted_ce", lambda x: F.cross_entropy(x.flatten(0, 1), torch.arange(15) % 13,
                                              weight=torch.linspace(0.5, 1.5, 13))),
    ("minus", lambda x: x - torch.ones(13)),
])
def test_other_ops_see_the_whole_tensor(name, fn):
    """An op the blocks do not run gathers them once, differentiably (the same values and
    gradients as on the joined tensor)."""
    blocks, x, joined = _pair([4, 7, 2])
    got = fn(x)
    assert not isinstance(got, VocabShardedTensor)
    _same(got, fn(joined), blocks, joined)
    assert x.full() is x.full()          # gathered once, kept


def test_reads_like_the_whole_tensor():
    blocks, x, joined = _pair([4, 7, 2])
    assert x.shape == (3, 5, 13) and x.size(-1) == 13 and x.dim() == 3 and x.numel() == 195
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.requires_grad
    assert x.is_floating_point() and len(x) == 3
    torch.testing.assert_close(x, joined.detach())
    assert repr(x) == repr(torch.cat(blocks, -1))


@pytest.mark.parametrize("fn", [lambda x: x.add_(1), lambda x: x.__setitem__(0, 0.0),
                                lambda x: x.mul_(2)])
def test_in_place_is_an_error_naming_the_fix(fn):
    _, x, _ = _pair([4, 7])
    with pytest.raises(NotImplementedError, match=r"in place .* x\.full\(\)"):
        fn(x)


# -- on a model -------------------------------------------------------------------------------

def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _vocab_gathers(tm, tp):
    """The forward's all-gathers over tp of a last dim of V / tp (the logits')."""
    last = {c.node: c.shape for c in tm.collectives("forward")
            if c.op.startswith("all_gather") and c.axis == "tp" and c.shape
            and c.shape[-1] == V // tp}
    return [n.name for n in tm.rank_module(0, "forward").graph.nodes if n.name in last
            and n.args[1] % len(last[n.name]) == len(last[n.name]) - 1]


def _batch_gathers(tm, tp: int) -> list[str]:
    """The forward's all-gathers over a batch axis of a value of last dim V / tp."""
    return [c.node for c in tm.collectives("forward") if c.op.startswith("all_gather")
            and c.axis in ("dp", "fsdp") and c.shape and c.shape[-1] == V // tp]


_CLASS_WEIGHT = torch.linspace(0.5, 1.5, V)


def _shifted(logits, labels, weighted=False):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=0, label_smoothing=0.05,
                           weight=_CLASS_WEIGHT if weighted else None)


@pytest.mark.parametrize("axes,sp,weighted", [
    (dict(tp=2), False, False), (dict(dp=2, tp=2), False, True),
    (dict(fsdp=2, tp=2), True, False), (dict(tp=2, dp=2, fsdp=2), False, True)],
    ids=["tp2", "dp2tp2-weight", "fsdp2tp2-sp", "tp2dp2fsdp2-weight"])
def test_cross_entropy_on_pm_logits_trains_as_one_device(axes, sp, weighted):
    """The user's loss on ``pm(ids)``'s logits: the logits are blocks, ``tp``'s of the vocab
    and the batch axes' of the rows (no all-gather of them in the forward program: each
    ``dp``/``fsdp`` rank computes the loss on its rows only), and loss, gradients and three
    AdamW steps equal the single device's (a class ``weight=`` too)."""
    model = _llama(layers=1)
    ref = copy.deepcopy(model)
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(**axes), sequence_parallel=sp)
    ours = None     # made after the first call placed the shards
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)   # (train_checks: eps)
    for step in range(3):
        out = pm(ids)
        rows = axes.get("dp", 1) * axes.get("fsdp", 1)
        assert isinstance(out, VocabShardedTensor) and out.shape == (4, 6, V)
        assert [tuple(b.shape) for b in out.blocks] == \
            [(4 // rows, 6, V // axes["tp"])] * axes["tp"] * rows
        loss = _shifted(out, labels, weighted)
        assert not out.gathered
        want = _shifted(ref(ids), labels, weighted)
        torch.testing.assert_close(loss, want.detach(), **TOL)
        loss.backward()
        want.backward()
        if step == 0:
            assert _vocab_gathers(pm.trainer, axes["tp"]) == []
            assert _batch_gathers(pm.trainer, axes["tp"]) == []
            grads = pm.gradients()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
            ours = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), **TOL, msg=name)
