"""Dropout in training (``fxshard.training.dropout``): HF GPT-2 with its default 0.1 dropouts
(embeddings, residuals, attention probabilities: eager's ``F.dropout`` and SDPA's
``dropout_p``) gives on tp, dp·tp, fsdp and pp (with recompute) the gradients of the
single-device model run with the same masks (``same_masks``, the same ``torch.manual_seed``);
masks keep ``1 - p``, change every step and differ between dp ranks' batch rows; on real
processes both ranks agree (the step seed is rank 0's); what is not built is a clear error."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.training import parallelize_for_training
from fxshard.training.dropout import draw_mask, pack_seed, same_masks
from tests.launch import gloo_job

transformers = pytest.importorskip("transformers")

V, B, S = 96, 4, 6


def _gpt2(attn="eager", tied=True):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=48, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=attn,
                                  tie_word_embeddings=tied)   # dropouts: the default 0.1
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _ids(seq=S):
    return torch.randint(0, V, (B, seq), generator=torch.Generator().manual_seed(1))


def _loss(out, ids):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _reference(model, ids, seed):
    """The single-device model with the masks fxshard draws after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    with same_masks():
        loss = _loss(model(ids), ids)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _close(grads, want):
    assert set(want) <= set(grads)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def _mask_nodes(gm):
    return [n for n in gm.graph.nodes if str(n.target) == "fxshard.dropout_mask.default"]


@pytest.mark.parametrize("attn,axes,recompute", [
    ("eager", dict(tp=2), None),
    ("sdpa", dict(dp=2, tp=2), None),
    ("eager", dict(fsdp=2), None),
    ("sdpa", dict(tp=2), "layers"),
])
def test_gradients_equal_same_masks(attn, axes, recompute):
    ids = _ids()
    want_loss, want = _reference(_gpt2(attn), ids, seed=7)
    tm = parallelize_for_training(_gpt2(attn), _mesh(**axes), recompute=recompute)
    torch.manual_seed(7)
    loss = _loss(tm(ids), ids)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    _close(tm.gradients(), want)
    forward = tm.rank_module(0, "forward")
    assert len(_mask_nodes(forward)) == 2 * 3 + 1   # embd; per layer attn, resid, mlp
    if recompute:   # the backward redraws the layers' residual masks from the saved seed
        # (the probabilities' masks are head-sliced: a slice is saved, as collectives are)
        assert len(_mask_nodes(tm.rank_module(0, "backward"))) == 2 * 2


def test_pipeline_microbatches_recompute():
    """pp=2 over 2 microbatches: each stage keeps the whole model's site indices and its
    microbatch's rows of the whole batch's masks (recompute redraws them)."""
    ids = _ids()
    _, want = _reference(_gpt2(tied=False), ids, seed=3)
    model = _gpt2(tied=False)
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=2, recompute="layers")
    model.train()   # fxshard.parallelize puts the model in eval mode
    torch.manual_seed(3)
    _loss(pm(ids), ids).backward()
    _close(pm.gradients(), want)


class _Drop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        return F.dropout(x, 0.25, self.training) * self.w


def test_masks_keep_fraction_change_per_step_and_per_dp_rank():
    x = torch.ones(B, 32, 64)
    tm = parallelize_for_training(_Drop().train(), _mesh(dp=2))
    torch.manual_seed(11)
    first, second = tm(x), tm(x)
    keep = first != 0
    assert abs(keep.float().mean().item() - 0.75) < 0.02
    torch.testing.assert_close(first[keep], torch.full_like(first[keep], 1 / 0.75))
    assert (keep != (second != 0)).float().mean() > 0.3        # a new mask each step
    assert (keep[:2] != keep[2:]).float().mean() > 0.3         # dp ranks' rows differ
    torch.manual_seed(11)
    with same_masks():
        torch.testing.assert_close(first, _Drop().train()(x))
    # the rank program draws the whole batch's mask and keeps its rows
    mask, = _mask_nodes(tm.rank_module(1, "forward"))
    assert list(mask.args[2]) == [B, 32, 64]
    # eval mode and no_grad inference draw nothing
    tm.model.eval()
    torch.testing.assert_close(tm(x), x)


@settings(max_examples=8, deadline=None)
@given(step=st.integers(0, 1 << 38), site=st.integers(0, 50), rows=st.integers(1, 3),
       m=st.integers(1, 4), p=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_microbatch_masks_are_rows_of_the_whole(step, site, rows, m, p):
    whole = draw_mask(step, site, [rows * m, 5], p, "cpu")
    parts = [torch.ops.fxshard.dropout_mask(pack_seed(step, i, m), site, [rows, 5], p,
                                            torch.device("cpu")) for i in range(m)]
    assert torch.equal(torch.cat(parts), whole)
    assert whole.all() if p == 0 else (not whole.any() if p == 1 else True)


def test_unsupported_is_a_clear_error():
    model = _gpt2("sdpa")   # attention dropout_p on ring_cp: no dropout in ring attention
    tm = parallelize_for_training(model, _mesh(ring_cp=2))
    with pytest.raises(NotImplementedError, match=r"dropout_p > 0 on mesh .*attn_pdrop=0"):
        tm(_ids(8))

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x + torch.randn_like(x)) * self.w
    with pytest.raises(NotImplementedError, match=r"randn_like.*only dropout"):
        parallelize_for_training(Noisy(), _mesh(tp=2))(torch.ones(2, 4))


# -- real processes (gloo): the step seed is global rank 0's ---------------------------------
def _body(rank: int, report: dict) -> None:
    ids = _ids()
    tm = parallelize_for_training(_gpt2(), _mesh(tp=2))
    ref = _gpt2()
    report["errs"], report["sums"] = [], []
    for seed in (7, 100):          # two steps, two seeds: both rank 0's
        torch.manual_seed(seed + rank)    # the ranks' generators disagree on purpose
        _loss(tm(ids), ids).backward()
        grads = tm.gradients()
        ref.zero_grad()
        _, want = _reference(ref, ids, seed)
        report["errs"].append(max((grads[n] - want[n]).abs().max().item() for n in want))
        report["sums"].append(sum(g.double().sum().item() for g in grads.values()))
        for p in tm.parameters():
            p.grad = None


def test_real_mesh_ranks_agree(tmp_path):
    reports = gloo_job(_body, 2, str(tmp_path), timeout_s=300, grad=True)
    for r in reports.values():
        assert max(r["errs"]) < 1e-5, r["errs"]
    assert reports[0]["sums"] == reports[1]["sums"]


# -- compile=True: Inductor keeps every site's draw, per step ---------------------------------
class _DropMLP(torch.nn.Module):
    """Two dropout sites of one shape and p (only the site index tells them apart: a CSE
    across sites would merge them) around a tp-sharded MLP, and one on its sharded hidden."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(12, 20)
        self.down = torch.nn.Linear(20, 12)

    def forward(self, x):
        h = F.dropout(self.up(F.dropout(x, 0.3, self.training)), 0.3, self.training)
        return x + F.dropout(self.down(F.gelu(h)), 0.3, self.training)


def test_compiled_program_draws_every_site_every_step(monkeypatch):
    import fxshard.ops.dropout as ops_dropout
    draws = []
    real = ops_dropout.draw_mask
    monkeypatch.setattr(ops_dropout, "draw_mask", lambda step, site, *a: (
        draws.append((step, site)), real(step, site, *a))[1])
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    eager = parallelize_for_training(_DropMLP().train(), _mesh(tp=2))
    model = _DropMLP()
    compiled = fxshard.parallelize(model, _mesh(tp=2), compile=True)
    model.train()   # fxshard.parallelize puts the model in eval mode
    ref = _DropMLP().train()
    steps = []
    for seed in (5, 6):
        grads = []
        for tm in (eager, compiled):
            torch.manual_seed(seed)
            draws.clear()
            out = tm(x)
            out.pow(2).sum().backward()
            grads.append(tm.gradients())
            # 2 ranks x 3 sites, one step seed: no site folded into a constant or merged
            assert len(draws) == 6 and {s for _, s in draws} == {0, 1, 2}, draws
            assert len({st for st, _ in draws}) == 1
            for p in tm.parameters():
                p.grad = None
        torch.manual_seed(seed)
        with same_masks():
            want = ref(x)
        want.pow(2).sum().backward()
        _close(grads[1], {n: p.grad for n, p in ref.named_parameters()})
        _close(grads[1], grads[0])
        ref.zero_grad()
        steps.append((draws[0][0], grads[1]))
    assert steps[0][0] != steps[1][0]                           # a new step seed
    assert not torch.equal(steps[0][1]["up.weight"], steps[1][1]["up.weight"])  # new masks
    fns = compiled.trainer._last.compiled    # Inductor's functions, compiled once, reused
    assert set(fns) == {"forward", "backward"}
    assert not any(isinstance(f, torch.fx.GraphModule) for f in fns.values())
