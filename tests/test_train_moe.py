"""Training a torchtitan-style sorted MoE (``argsort`` of the flat expert ids, the rows gathered
by token, grouped matmuls, the rows added back by ``scatter_add``; the counts from a one-hot
sum), fp32 with transformers' grouped matmul op. HF Mixtral's form (``sort``, the inverse
permutation, ``index``): tests/test_train_models.py ``test_moe_trains``.

dp2·tp2: each dp rank sorts, multiplies and adds back its own tokens' rows in forward and
backward (``passes/moe_routing.py``: the joint graph's region takes its backward along), the
experts' partial sums reduced on ``[T, H]`` on tp. ring_cp2: each rank routes its own zigzag
share of every sequence (the rows' gradient sliced locally into that fused layout)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.training import parallelize_for_training
from tests.train_checks import expert_rows

moe = pytest.importorskip("transformers.integrations.moe")   # registers the grouped matmul op

V, D, E, K, HID, B = 64, 24, 4, 2, 20, 4


class SortedMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, HID, D) * D ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, HID, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, HID) * HID ** -0.5)

    def forward(self, x):
        gmm = torch.ops.transformers.grouped_mm_fallback
        b, t, d = x.shape
        scores = self.gate(x).softmax(-1)
        top_s, ids = scores.topk(K, dim=-1)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ids, True).sum((0, 1))
        xt = x.view(-1, d)
        order = torch.argsort(ids.view(-1, K).view(-1), stable=True)
        s_sorted = top_s.view(-1, K).view(-1)[order]
        tok = order // K
        rows = xt[tok]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(gmm(rows, self.w1.transpose(-2, -1), offs)) * \
            gmm(rows, self.w3.transpose(-2, -1), offs)
        y = gmm(h, self.w2.transpose(-2, -1), offs) * s_sorted.reshape(-1, 1)
        out = torch.zeros_like(xt).scatter_add(0, tok.reshape(-1, 1).expand(-1, d), y)
        return out.view(b, t, d)


class SortedMoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = SortedMoE()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.moe(x))


@pytest.mark.parametrize("axes", [dict(dp=2, tp=2), dict(ring_cp=2)], ids=["dp2_tp2", "ring2"])
def test_sorted_moe_trains_on_each_ranks_tokens(axes):
    torch.manual_seed(0)
    model = SortedMoELM()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    S = 8
    ids, labels = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
    ours = torch.optim.AdamW(tm.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    for step in range(2):
        ours.zero_grad()
        theirs.zero_grad()
        out, want = tm(ids), ref(ids)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
        F.cross_entropy(want.flatten(0, 1), labels.flatten()).backward()
        if step == 0:
            grads = tm.gradients()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
        ours.step()
        theirs.step()
    trained = tm.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)
    T = B * S
    if "ring_cp" in axes:   # token-local: each rank routes its own (zigzag) tokens' rows
        assert expert_rows(tm, "forward") == expert_rows(tm, "backward") == [T * K // 2] * 3
        # what communicates: the returned logits, gathered once, and the weights' gradients
        # (partial sums over the rank's tokens); the rows' gradients enter the rows' fused
        # layout (each sequence's zigzag share of the flattened tokens) by local slices
        fwd = [(c.op, c.shape) for c in tm.collectives("forward") if c.op != "zigzag_shard"]
        assert fwd == [("zigzag_gather", (B, S // 2, V))], fwd
        shapes = {tuple(p.shape) for p in ref.parameters()}
        bwd = [(c.op, c.shape) for c in tm.collectives("backward") if c.op != "zigzag_shard"]
        assert bwd and all(op == "all_reduce" and shape in shapes for op, shape in bwd), bwd
        return
    # 3 expert matmuls (w1, w3, w2) forward and backward, each on the rank's T*k/dp rows
    assert expert_rows(tm, "forward") == expert_rows(tm, "backward") == [T * K // 2] * 3
    for which in ("forward", "backward"):
        cs = tm.collectives(which)
        gathers = [c.shape for c in cs if c.axis == "dp" and c.op == "all_gather"]
        # nothing: the logits stay blocks over dp and tp (fxshard.training.vocab_output)
        assert gathers == [], (which, gathers)
        reduced = sorted(c.shape for c in cs if c.axis == "tp" and c.op == "all_reduce")
        t = T // 2   # a dp rank's tokens, as [B, S, D] or [T, D] / [T, k]
        assert (t * K, D) not in reduced, (which, reduced)
        if which == "forward":   # the experts' partial output, once, on [B, S, D]
            assert reduced == [(B // 2, S, D)], reduced
