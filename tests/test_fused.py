"""Fused projections (StridedShard), token-flattening reshapes, norms over a sharded width,
Partial values reduced once, and the index/stack/topk rules."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fxshard
from fxshard.mesh import MeshSpec
from fxshard.placement import R, Shard, StridedShard, local_block, local_shape
from tests.test_rules import check, meshes, specs


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def test_strided_block_is_every_parts_share():
    m = MeshSpec((2,), ("tp",))
    t = torch.arange(128.0)
    spec = (StridedShard(0, (64, 32, 32)),)
    want = [torch.cat([t[0:32], t[64:80], t[96:112]]), torch.cat([t[32:64], t[80:96], t[112:]])]
    for r in range(2):
        torch.testing.assert_close(local_block(t, spec, m, r), want[r])
    with pytest.raises(ValueError, match=r"parts \[33, 31\] do not divide by 2"):
        local_shape((128,), (StridedShard(0, (64, 33, 31)),), m)


def test_strided_block_from_safetensors(tmp_path):
    from safetensors.torch import save_file
    from fxshard.checkpoint import SafetensorsSource
    w = torch.randn(96, 8)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    src = SafetensorsSource(str(tmp_path / "m.safetensors"), "w", (96, 8), torch.float32)
    m = MeshSpec((2, 2), ("dp", "tp"))
    spec = (R, StridedShard(0, (48, 24, 24)))
    for r in range(4):
        torch.testing.assert_close(src.block(spec, m, r), local_block(w, spec, m, r))


class FusedAttention(nn.Module):
    """A Phi-3 style block: qkv_proj sliced into q, k, v; gate_up_proj chunked."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, bias=False, parts=None):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.d, bias=bias)
        self.o = nn.Linear(hidden, hidden, bias=bias)
        self.gate_up = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.down = nn.Linear(2 * hidden, hidden, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q = qkv[..., :self.h * self.d].view(b, s, self.h, self.d).transpose(1, 2)
        k = qkv[..., self.h * self.d:(self.h + self.kv) * self.d]
        v = qkv[..., (self.h + self.kv) * self.d:]
        k, v = (t.view(b, s, self.kv, self.d).transpose(1, 2) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@pytest.mark.parametrize("axes", [dict(tp=2), dict(dp=2, tp=2), dict(tp=2, ring_cp=2)],
                         ids=["tp2", "dp2_tp2", "tp2_ring2"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_is_strided_and_local(axes, bias):
    torch.manual_seed(0)
    model = FusedAttention(bias=bias).eval()
    x = torch.randn(2, 8, 32)
    pm = fxshard.parallelize(model, mesh(**axes))
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    placed = {fqn: spec for fqn, spec, _, _ in pm.explain().placements}
    assert "tp:S(0|32+16+16)" in placed["qkv.weight"]
    assert "tp:S(0|64+64)" in placed["gate_up.weight"]
    if bias:
        assert "tp:S(0|32+16+16)" in placed["qkv.bias"]
    counts = pm.explain().counts(0)
    assert counts[("all_reduce", "tp")] == 2 and counts[("all_gather", "tp")] == 0, counts
    pm.close()


def test_fused_parts_that_do_not_divide_stay_plain_and_correct():
    torch.manual_seed(0)
    model = FusedAttention(hidden=24, heads=3, kv_heads=3).eval()   # parts 24+24+24 over tp=4
    x = torch.randn(2, 8, 24)
    pm = fxshard.parallelize(model, mesh(tp=4), plan={"qkv": "replicate", "o": "replicate"})
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    placed = {fqn: spec for fqn, spec, _, _ in pm.explain().placements}
    assert placed["gate_up.weight"] == "tp:S(0|48+48)"
    pm.close()
    # a split the parts do not line up with: a plain column shard, gathered before the split
    lin = nn.Linear(8, 12).eval()
    pm = fxshard.parallelize(lambda_module(lambda x: lin(x)[..., 1:7] * 2), mesh(tp=2))
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(pm(x), lin(x)[..., 1:7] * 2, rtol=1e-5, atol=1e-5)
    assert "|" not in dict((f, s) for f, s, _, _ in pm.explain().placements)["lin.weight"]
    pm.close()


class lambda_module(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        for name, v in fn.__closure__ and zip(fn.__code__.co_freevars, fn.__closure__) or ():
            if isinstance(v.cell_contents, nn.Module):
                self.add_module(name, v.cell_contents)

    def forward(self, x):
        return self.fn(x)


class FlattenTokens(nn.Module):
    """GPT-2's Conv1D flattens [B, S, H] to [B*S, H]; a cumsum over the tokens needs them all."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        b, s, h = x.shape
        y = torch.addmm(self.b, x.reshape(-1, h), self.w)
        return y.view(b, s, -1), y.cumsum(0).view(b, s, -1)


@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(ulysses_cp=2), dict(dp=2, ring_cp=2),
                                  dict(tp=2, ulysses_cp=2)])
def test_flattened_tokens_keep_the_sequence_shard(axes):
    torch.manual_seed(0)
    model = FlattenTokens().eval()
    x = torch.randn(2, 8, 16)
    pm = fxshard.parallelize(model, mesh(**axes), ring_zigzag=True)
    for got, want in zip(pm(x), model(x)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    pm.close()


class PostNorm(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.w = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        h = self.down(F.gelu(self.up(x)))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return x + h


@pytest.mark.parametrize("sp", [False, True])
def test_post_norm_partial_is_reduced_once(sp):
    torch.manual_seed(0)
    model = PostNorm().eval()
    x = torch.randn(2, 8, 16)
    pm = fxshard.parallelize(model, mesh(tp=2), sequence_parallel=sp)
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    code = pm.rank_module(0).code
    if sp:
        assert code.count("fxshard.reduce_scatter") == 1 and "all_reduce" not in code, code
    else:
        assert code.count("fxshard.all_reduce") == 1, code
    pm.close()


def test_norm_over_a_sharded_width_reduces_a_statistic():
    """OLMo-2's q norm: RMSNorm over the whole q projection, which stays column-sharded."""
    class QNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(16, 32, bias=False)
            self.o = nn.Linear(32, 16, bias=False)
            self.w = nn.Parameter(torch.rand(32) + 0.5)

        def forward(self, x):
            q = self.q(x)
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
            return self.o(q)

    torch.manual_seed(0)
    model = QNorm().eval()
    x = torch.randn(2, 8, 16)
    pm = fxshard.parallelize(model, mesh(tp=2))
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    shapes = [c.shape for c in pm.explain().collectives[0] if c.op == "all_reduce"]
    assert shapes == [(2, 8, 1), (2, 8, 16)], shapes
    assert "all_gather" not in pm.rank_module(0).code
    pm.close()


@pytest.mark.parametrize("op", ["stack_flatten", "index_table", "index_mid", "gather", "topk",
                                "repeat_interleave"])
@given(data=st.data())
def test_index_and_stack_rules(op, data):
    m = data.draw(meshes())
    b, s, h = (data.draw(st.sampled_from([1, 2, 3, 4, 6])) for _ in range(3))
    x = torch.randn(b, s, 2 * h)
    sx = specs(data.draw, m, 3)
    if op == "stack_flatten":
        fn = lambda a: torch.stack((-a[..., 1::2], a[..., ::2]), dim=-1).flatten(-2)  # noqa
        check(fn, (x,), m, [sx])
    elif op == "index_table":
        table = torch.randn(12, 5)
        pos = torch.randint(0, 12, (b, s))
        check(lambda t, p: t[p], (table, pos), m, [specs(data.draw, m, 2), specs(data.draw, m, 2)])
    elif op == "index_mid":
        idx = torch.tensor([0, s - 1, 0])
        check(lambda a, i: a[:, i] * 2, (x, idx), m, [sx, specs(data.draw, m, 1)])
    elif op == "gather":
        idx = torch.randint(0, 2 * h, (b, s, 3))
        check(lambda a, i: torch.gather(a, 2, i), (x, idx), m, [sx, specs(data.draw, m, 3)])
    elif op == "topk":
        check(lambda a: torch.topk(a, 2, dim=-1), (x,), m, [sx])
    else:
        check(lambda a: a.repeat_interleave(2, dim=1), (x,), m, [sx])


def test_replicated_weights_are_listed_and_strict_refuses_them():
    from tests.models import hf_llama
    model = hf_llama(layers=1, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(tp=4), example_inputs=(ids,))
    reasons = dict(pm.explain().replicated)
    assert set(reasons) == {"model.layers.0.self_attn.k_proj.weight",
                            "model.layers.0.self_attn.v_proj.weight"}, reasons
    assert reasons["model.layers.0.self_attn.k_proj.weight"].startswith(
        "tp=4 exceeds the 2 KV heads (view_1 splits it into 2 heads of 16)")
    assert "Weights kept whole on tp: 2" in str(pm.explain())
    with pytest.raises(NotImplementedError, match=r"strict=True\): weight model\.layers\.0\."
                       r"self_attn\.k_proj\.weight \(32, 64\) stays whole on mesh axis 'tp' of "
                       r"size 4 .*: tp=4 exceeds the 2 KV heads .* "
                       r"plan=\{'model\.layers\.0\.self_attn\.k_proj': 'replicate'\}"):
        fxshard.parallelize(model, mesh(tp=4), strict=True, example_inputs=(ids,))
    plan = {"model.layers.*.self_attn.k_proj": "replicate",
            "model.layers.*.self_attn.v_proj": "replicate"}
    pm = fxshard.parallelize(model, mesh(tp=4), strict=True, plan=plan, example_inputs=(ids,))
    assert dict(pm.explain().replicated)["model.layers.0.self_attn.k_proj.weight"] == \
        "plan= asks for it"
    torch.testing.assert_close(pm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    pm.close()


@pytest.mark.parametrize("hidden", [8, 16])  # 8 == batch*seq: a wrong dim would still fit
@pytest.mark.parametrize("pick", ["select", "index_expand"])
def test_select_on_flattened_tokens_under_cp(hidden, pick):
    """GPT-2's Conv1D flattens tokens, so under CP the token dim is a strided shard; ``select``
    on it gathers, and on an earlier dim shifts it."""
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(hidden, hidden))
            self.b = torch.nn.Parameter(torch.randn(hidden))

        def forward(self, x):
            b, s, h = x.shape
            y = torch.addmm(self.b, x.reshape(b * s, h), self.w)
            z = y.unsqueeze(0).select(0, 0) if pick == "select" else y[0].expand(b * s, h)
            return z.reshape(b, s, h)

    torch.manual_seed(0)
    model, x = Flat().eval(), torch.randn(2, 4, hidden)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ulysses_cp",))
    pm = fxshard.parallelize(model, mesh)
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
