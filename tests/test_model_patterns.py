"""Model code patterns found in the wild that once broke fxshard: in-place ops, copies that
must stay copies, `.contiguous().view()`, constant index tensors, extra inputs without a batch
or sequence dim, attention that is not 4-D, HF's loss, per-sample vs reduced outputs under
microbatches. Each must match the single-device model on every mesh, or fail with a clear
error."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.passes.rules import FallbackWarning
from fxshard.passes.rules.conv import SequenceGatherWarning
from tests.models import hf_llama, our_llama

MESHES = [dict(dp=2), dict(tp=2), dict(ring_cp=2), dict(dp=2, tp=2), dict(ulysses_cp=2)]


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


class CloneThenInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        y = h.clone()
        y.mul_(2)
        return h, y


class MaskedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, ids):
        logits = self.head(self.emb(ids))
        logits[..., 0] = float("-inf")
        y = logits * 1
        y[:, 0] = 0
        y += 1
        y[..., :2] *= 2
        return logits, y


class ConstantIndex(nn.Module):
    def forward(self, a):
        return a[:, [0, 3, 5]] * 2


class Attention3d(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, t):
        return self.lin(x) / t


class NanoGPTAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


CASES = [(CloneThenInPlace, lambda: (torch.randn(4, 8, 8),)),
         (MaskedHead, lambda: (torch.randint(0, 32, (4, 8)),)),
         (ConstantIndex, lambda: (torch.randn(4, 8),)),
         (Attention3d, lambda: (torch.randn(4, 8, 8),)),
         (Temperature, lambda: (torch.randn(4, 8), torch.tensor([2.0]))),
         (NanoGPTAttention, lambda: (torch.randn(4, 8, 16),))]


def run_parallel(model, m, *args, **kwargs):
    """``parallelize(model, m)(*args, **kwargs)`` with its warnings checked instead of printed:
    only FallbackWarnings, each about an op ``explain()`` lists as run replicated, and
    SequenceGatherWarnings (a CP axis gathering the sequence for a node: MaskedHead's
    ``y[:, 0] = 0`` writes one position, Attention3d's SDPA has no heads dim)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, m)
        out = pm(*args, **kwargs)
    others = [str(w.message) for w in caught
              if not issubclass(w.category, (FallbackWarning, SequenceGatherWarning))]
    assert not others, others
    gathers = [w for w in caught if issubclass(w.category, SequenceGatherWarning)]
    assert all(re.search(r"mesh axis '(ring_cp|ulysses_cp)'", str(w.message)) for w in gathers)
    warned = {re.search(r"\((\w+)\) ", str(w.message)).group(1)
              for w in caught if issubclass(w.category, FallbackWarning)}
    assert warned <= {f.split(":")[0] for f in pm.explain().fallbacks}
    return out


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("make,inputs", CASES, ids=[c[0].__name__ for c in CASES])
def test_pattern_matches_single_device(make, inputs, axes):
    torch.manual_seed(0)
    model = make().eval()
    args = inputs()
    want = model(*args)
    got = run_parallel(model, mesh(**axes), *args)
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_hf_llama_with_labels_returns_the_loss():
    model = hf_llama(layers=1)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids, labels=ids)
    got = run_parallel(model, mesh(dp=2, tp=2), ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)


def test_microbatches_refuse_outputs_that_are_not_per_sample():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x, x.sum(0)
    x = torch.randn(6, 8)
    pm = fxshard.parallelize(Pooled(), mesh(pp=2), microbatches=2)
    with pytest.raises(ValueError, match=r"output 1 has shape \(8,\) per microbatch of 3"):
        pm(x)


def test_heads_check_respects_a_replicating_plan():
    model = our_llama(num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                      hidden_size=48, head_dim=16, intermediate_size=96)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(tp=2),
                             plan={"model.layers.*.self_attn.*": "replicate"})
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)


class OneBlockEncoder(nn.Module):
    """Embedding (+ an optional learned position parameter), one attention block, optional
    pooling that splits the sequence dim: the second review's sequence-layout cases."""

    def __init__(self, seq=16, hidden=32, pos=False, pool=0):
        super().__init__()
        self.emb = nn.Embedding(64, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden)) if pos else None
        self.pool = pool

    def forward(self, ids):
        x = self.emb(ids)
        b, s, h = x.shape
        if self.pos is not None:
            x = x + self.pos
        q, k, v = self.qkv(x).view(b, s, 3, 4, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        return x.view(b, s // self.pool, self.pool, h).mean(2) if self.pool else x


class CrossAttention(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(64, hidden)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)

    def forward(self, ids, mem):
        x = self.emb(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, -1).transpose(1, 2)
        k, v = self.kv(mem).view(b, mem.shape[1], 2, 4, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("case", ["pos_param", "pool_40", "pool_8", "cross_usp", "cross_ring"])
def test_sequence_layout_cases(case):
    torch.manual_seed(0)
    if case == "pos_param":
        model, args, axes = OneBlockEncoder(pos=True), (torch.randint(0, 64, (2, 16)),), \
            dict(ring_cp=2)
    elif case.startswith("pool"):
        s = int(case.split("_")[1])
        model, args, axes = OneBlockEncoder(seq=s, pool=4), (torch.randint(0, 64, (2, s)),), \
            dict(ring_cp=2)
    else:
        model = CrossAttention()
        args = (torch.randint(0, 64, (2, 8)), torch.randn(2, 16, 32))
        axes = dict(ulysses_cp=2, ring_cp=2) if case == "cross_usp" else dict(ring_cp=2)
    model.eval()
    torch.testing.assert_close(fxshard.parallelize(model, mesh(**axes))(*args), model(*args),
                               rtol=1e-4, atol=1e-4)


def test_hf_position_ids_with_dp():
    model = hf_llama(layers=1)
    ids = torch.randint(0, 128, (4, 16))
    pos = torch.arange(16).expand(4, 16).contiguous()
    want = model(ids, position_ids=pos).logits
    got = run_parallel(model, mesh(dp=2, tp=2), ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bf16_state_dict_into_fp32_model_is_cast():
    model = our_llama(num_hidden_layers=1)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    ref = our_llama(num_hidden_layers=1)
    ref.load_state_dict(sd)  # nn.Module copies into fp32
    pm = fxshard.parallelize(our_llama(num_hidden_layers=1, seed=1), mesh(tp=2))
    pm.load_state_dict(sd)
    ids = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(pm(ids), ref(ids), rtol=1e-4, atol=1e-4)


def test_layers_run_out_of_order_cannot_be_pipelined():
    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in reversed(self.layers):
                x = layer(x)
            return x
    with pytest.raises(ValueError, match="runs its layer stack layers out of order"):
        fxshard.parallelize(Reversed(), mesh(pp=2), example_inputs=(torch.randn(2, 8),))
