"""Model code written the way litgpt, torchtune, torchtitan and Meta's reference Llama write it
(our own tiny plain-PyTorch versions of their patterns), parallel on tp like a HuggingFace model:

- GQA expanded with ``repeat_interleave`` over the head dim, or ``expand`` + ``reshape``;
- a fused ``qkv`` projection split into (q, k, v) with fewer KV groups, and multi-query
  attention (one KV head: its K/V part stays whole, the query part is split);
- weights applied as ``x @ w.T`` (``t`` / ``transpose`` / ``permute`` of the weight);
- complex RoPE (``view_as_complex``, complex multiply, ``view_as_real``, ``polar``);
- a soft-capped eager attention written in another op order;
- data-dependent sizes (``torch.where(mask)`` routing) under dp;
- torchtitan's MoE: ``argsort`` of the routing, expert weights cast to bf16 before the grouped
  matmul, the rows added back by a library custom op (``scatter_add`` inside).

Each model: equal to the single-device model, at most 0.55 of the layer matrices per rank at
tp=2, the Megatron minimum of activation all-reduces per layer, no FallbackWarning."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.passes.rules import FallbackWarning
from fxshard.placement import R
from tests.families import layer_param_fraction
from tests.test_rules import check, meshes, specs

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, hd: int, base: float = 10000.0):
    freqs = 1.0 / base ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.outer(torch.arange(seq).float(), freqs)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class FusedQKVAttention(nn.Module):
    """litgpt's way: one ``qkv`` Linear split into (q, k, v) of ``groups`` KV heads, heads
    moved to dim 1, rotate-half RoPE, K/V expanded to every query head before SDPA."""

    def __init__(self, dim=DIM, heads=HEADS, groups=2, expand="repeat_interleave"):
        super().__init__()
        self.h, self.g, self.d, self.expand = heads, groups, dim // heads, expand
        self.qkv = nn.Linear(dim, (heads + 2 * groups) * self.d, bias=False)
        self.proj = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((self.h * self.d, self.g * self.d, self.g * self.d), -1)
        q = q.view(b, t, self.h, self.d).transpose(1, 2)
        k = k.view(b, t, self.g, self.d).transpose(1, 2)
        v = v.view(b, t, self.g, self.d).transpose(1, 2)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        n = self.h // self.g
        if self.expand == "repeat_interleave":
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        else:   # expand + reshape
            k = k[:, :, None].expand(b, self.g, n, t, self.d).reshape(b, self.h, t, self.d)
            v = v[:, :, None].expand(b, self.g, n, t, self.d).reshape(b, self.h, t, self.d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.h * self.d))


class TransposedWeightAttention(nn.Module):
    """Weights held as bare ``[out, in]`` Parameters and applied as ``x @ w.T`` (also
    ``.t()``, ``.transpose(0, 1)``, ``.permute(1, 0)``); K/V expanded by ``repeat_interleave``."""

    def __init__(self, dim=DIM, heads=HEADS, groups=2):
        super().__init__()
        self.h, self.g, self.d = heads, groups, dim // heads
        self.wq = nn.Parameter(torch.randn(heads * self.d, dim) / math.sqrt(dim))
        self.wk = nn.Parameter(torch.randn(groups * self.d, dim) / math.sqrt(dim))
        self.wv = nn.Parameter(torch.randn(groups * self.d, dim) / math.sqrt(dim))
        self.wo = nn.Parameter(torch.randn(dim, heads * self.d) / math.sqrt(dim))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = (x @ self.wq.T).view(b, t, self.h, self.d).transpose(1, 2)
        k = torch.matmul(x, self.wk.t()).view(b, t, self.g, self.d).transpose(1, 2)
        v = (x @ self.wv.transpose(0, 1)).view(b, t, self.g, self.d).transpose(1, 2)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        n = self.h // self.g
        k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1) @ self.wo.permute(1, 0)


def complex_rope(x, freqs_cis):
    """Meta's reference / torchtitan's RoPE: pairs of the head dim as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * f).flatten(3).type_as(x)


class ComplexRopeAttention(nn.Module):
    """torchtitan's layout: ``[B, S, H, D]`` heads, complex RoPE, ``repeat_kv`` by
    ``expand`` + ``reshape`` on dim 3, then heads to dim 1 for SDPA."""

    def __init__(self, dim=DIM, heads=HEADS, groups=2):
        super().__init__()
        self.h, self.g, self.d = heads, groups, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, groups * self.d, bias=False)
        self.wv = nn.Linear(dim, groups * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.h, self.d)
        k = self.wk(x).view(b, t, self.g, self.d)
        v = self.wv(x).view(b, t, self.g, self.d)
        q, k = complex_rope(q, freqs_cis), complex_rope(k, freqs_cis)
        n = self.h // self.g
        k = k[:, :, :, None, :].expand(b, t, self.g, n, self.d).reshape(b, t, self.h, self.d)
        v = v[:, :, :, None, :].expand(b, t, self.g, n, self.d).reshape(b, t, self.h, self.d)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SoftcapAttention(nn.Module):
    """Eager attention soft-capped in orders other than Gemma-2's ``tanh(s * scale / c) * c``
    (``q_scaled``: the queries scaled in place before ``q @ k^T``, the probabilities cast back
    by ``type_as``)."""

    def __init__(self, dim=DIM, heads=HEADS, cap=5.0, order="mul_first"):
        super().__init__()
        self.h, self.d, self.cap, self.order = heads, dim // heads, cap, order
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, self.d).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        if self.order == "q_scaled":       # the scale on q in place, then tanh(s / c) * c
            q.mul_(self.d ** -0.5)
        s = q @ k.transpose(-2, -1)
        if self.order == "mul_first":      # c * tanh(s * (1 / c)), then the scale
            s = self.cap * torch.tanh(s * (1.0 / self.cap)) / math.sqrt(self.d)
        elif self.order == "scale_first":  # tanh((s * scale) / c) * c: the scale first
            s = torch.tanh(s * self.d ** -0.5 / self.cap) * self.cap
        else:
            s = torch.tanh(s / self.cap) * self.cap
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        # (q_scaled: the softmax in float32, cast back to the queries' dtype)
        p = torch.softmax((s + mask).float(), dim=-1).type_as(q) if self.order == "q_scaled" \
            else torch.softmax(s + mask, dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim=DIM, hidden=64):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = attn
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, *rope):
        x = x + self.attn(self.attn_norm(x), *rope)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks, final norm, lm_head; RoPE tables as buffers sliced to
    the sequence (``rope='complex'``: one complex ``freqs_cis`` buffer; ``'polar'``: computed in
    forward with ``torch.polar``)."""

    def __init__(self, make_attn, layers=LAYERS, rope="real", seq=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(make_attn()) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.rope, hd = rope, DIM // HEADS
        if rope == "real":
            cos, sin = rope_tables(seq, hd)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif rope == "complex":
            freqs = torch.outer(torch.arange(seq).float(),
                                1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd))
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs),
                                 persistent=False)
        else:
            self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float()
                                                                 / hd), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        if self.rope == "real":
            rope = (self.cos[:t], self.sin[:t])
        elif self.rope == "complex":
            rope = (self.freqs_cis[:t],)
        else:
            ang = torch.outer(torch.arange(t, device=ids.device).float(), self.inv_freq)
            rope = (torch.polar(torch.ones_like(ang), ang),)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, *rope)
        return self.lm_head(self.norm(x))


PATTERNS = {
    "repeat_interleave": lambda: TinyLM(FusedQKVAttention),
    "expand_reshape": lambda: TinyLM(lambda: FusedQKVAttention(expand="expand")),
    "mqa_fused": lambda: TinyLM(lambda: FusedQKVAttention(groups=1)),
    "x_at_w_T": lambda: TinyLM(TransposedWeightAttention),
    "complex_rope": lambda: TinyLM(ComplexRopeAttention, rope="complex"),
    "polar_rope": lambda: TinyLM(ComplexRopeAttention, rope="polar"),
}
IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def run(model, axes, ids=IDS, tol=1e-4, **options):
    """The parallel logits (checked against the model's) with FallbackWarnings as errors."""
    with torch.no_grad():
        want = model(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh(**axes), **options)
        with torch.no_grad():
            got = pm(ids)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not pm.explain().fallbacks
    return pm


def all_reduces(pm) -> int:
    return pm.rank_module(0).code.count("fxshard.all_reduce")


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_tp2_is_sharded_like_megatron(name):
    torch.manual_seed(0)
    model = PATTERNS[name]().eval()
    pm = run(model, dict(tp=2))
    e = pm.explain()
    assert layer_param_fraction(pm, model) <= 0.55, e
    assert not e.replicated, e.replicated
    assert all_reduces(pm) == 2 * LAYERS, pm.rank_module(0).code   # attention + MLP
    pm.close()


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("axes,sp", [(dict(dp=2, tp=2), False), (dict(tp=2), True)],
                         ids=["dp2_tp2", "tp2_sp"])
def test_pattern_on_bigger_meshes(name, axes, sp):
    torch.manual_seed(0)
    model = PATTERNS[name]().eval()
    pm = run(model, axes, sequence_parallel=sp)
    assert layer_param_fraction(pm, model) <= 0.55
    if sp:
        assert all_reduces(pm) == 0
        code = pm.rank_module(0).code
        assert code.count("fxshard.reduce_scatter") == 2 * LAYERS, code
    else:
        assert all_reduces(pm) == 2 * LAYERS
    pm.close()


@pytest.mark.parametrize("order", ["mul_first", "scale_first", "q_scaled"])
@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(ulysses_cp=2), dict(tp=2)],
                         ids=["ring2", "ulysses2", "tp2"])
def test_softcap_in_another_order_runs_ring_attention(order, axes):
    torch.manual_seed(0)
    model = TinyLM(lambda: SoftcapAttention(order=order)).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = run(model, axes, ids=ids, strict=True)
    code = pm.rank_module(0).code
    assert not pm.explain().gathered, pm.explain().gathered
    assert code.count("softcap") >= LAYERS or code.count("attention") >= LAYERS, code
    if "ring_cp" in axes:
        assert code.count("fxshard.ring_attention.default(") == LAYERS, code
    assert "tanh" not in code
    pm.close()


class WhereRoutedMoE(nn.Module):
    """Mistral's reference MoE loop: per expert, ``torch.where(ids == e)`` picks its tokens (a
    data-dependent count) and their outputs are added back by index."""

    def __init__(self, dim=DIM, experts=4, top=2, hidden=32):
        super().__init__()
        self.top = top
        self.gate = nn.Linear(dim, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, ids = torch.topk(self.gate(x), self.top, dim=-1)
        weights = weights.softmax(-1)
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            tok, nth = torch.where(ids == e)
            out[tok] += weights[tok, nth, None] * down(F.silu(up(x[tok])))
        return out.reshape(b, t, d)


class WhereMoELM(nn.Module):
    def __init__(self, **moe):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = WhereRoutedMoE(**moe)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.lm_head(x + self.moe(x))


@pytest.mark.parametrize("op", ["slice_scatter", "select_scatter", "complex", "outer",
                                "repeat_interleave_heads", "x_at_w_T", "fill", "new_zeros",
                                "argsort", "upcast"])
@given(data=st.data())
@settings(deadline=None, max_examples=15)
def test_rules_give_each_rank_its_block(op, data):
    m = data.draw(meshes())
    b, s = (data.draw(st.sampled_from([1, 2, 3, 4])) for _ in range(2))
    x = torch.randn(b, s, 6)
    sx = specs(data.draw, m, 3, partial=True)
    if op == "slice_scatter":
        y = torch.randn(b, s, 2)
        check(lambda a, c: a.slice_scatter(c, dim=2, start=2, end=4), (x, y), m,
              [sx, specs(data.draw, m, 3, partial=True)])
    elif op == "select_scatter":
        y = torch.randn(b, 6)
        check(lambda a, c: a.select_scatter(c, 1, s - 1), (x, y), m,
              [sx, specs(data.draw, m, 2, partial=True)])
    elif op == "complex":
        f = torch.randn(s, 3, 2)
        check(lambda a, c: torch.view_as_real(
            torch.view_as_complex(a.reshape(b, s, 3, 2)) * torch.view_as_complex(c)).flatten(2),
            (x, f), m, [sx, specs(data.draw, m, 3)])
    elif op == "outer":
        check(lambda a, c: torch.polar(torch.ones(a.shape[0], c.shape[0]), torch.outer(a, c)),
              (torch.randn(2 * b), torch.randn(2 * s)), m,
              [specs(data.draw, m, 1), specs(data.draw, m, 1)])
    elif op == "repeat_interleave_heads":
        h = torch.randn(b, 2 * s, 4, 3)
        check(lambda a: a.repeat_interleave(3, dim=1) * 2, (h,), m,
              [specs(data.draw, m, 4, partial=True)])
    elif op == "fill":
        check(lambda a: torch.fill(a, 3.0) + a, (x,), m, [sx])
    elif op == "new_zeros":
        check(lambda a: a.new_zeros(b, s, 6) + 2 * a, (x,), m, [sx])
    elif op == "argsort":
        d = data.draw(st.sampled_from([1, 2]))
        check(lambda a: torch.argsort(a, dim=d, stable=True), (x,), m, [specs(data.draw, m, 3)])
    elif op == "upcast":   # a partial sum stays partial through bf16 -> fp32 -> fp64
        check(lambda a: (a.bfloat16().float() * 2).double() + 1, (x,), m, [sx])
    else:
        w = torch.randn(4, 6)
        check(lambda a, c: a @ c.T, (x, w), m, [sx, specs(data.draw, m, 2)])


def test_where_routing_under_dp_and_tp_explains_data_dependent_sizes():
    """``torch.where(ids == e)`` per expert: the positions need the whole mask (a rule says so,
    no fallback); on tp the loop's ``out[tok] += ...`` of row-parallel outputs stays a partial
    sum and is reduced once, after the loop. With one expert (one step: its rows are reduced)
    ``explain()`` reports the collective of data-dependent size instead of failing on it."""
    torch.manual_seed(0)
    model = WhereMoELM().eval()
    for axes in (dict(dp=2), dict(tp=2), dict(dp=2, tp=2)):
        pm = run(model, axes)
        str(pm.explain())
        if "tp" in axes:
            assert all_reduces(pm) == 1, pm.rank_module(0).code   # not one per expert (4)
            assert pm.explain().passes["reassociate_partials_pass"][
                "accumulations_reduced_once"] == 1
        pm.close()
    pm = run(WhereMoELM(experts=1, top=1).eval(), dict(dp=2, tp=2))
    text = str(pm.explain())
    assert "data-dependent sizes" in text and "(u" in text, text
    pm.close()


def test_whole_layer_weights_are_warned_once_with_the_real_reason():
    from fxshard.passes.rules import WholeWeightWarning
    from tests.models import hf_llama
    model = hf_llama(layers=2, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh(tp=4), example_inputs=(ids,))
        pm(ids)
    whole = [str(w.message) for w in caught if w.category is WholeWeightWarning]
    assert len(whole) == 1, whole
    assert "4 weight matrices of repeated layers stay whole on mesh axis 'tp' of size 4" in \
        whole[0] and "model.layers.*.self_attn.v_proj.weight (2 layers): tp=4 exceeds the 2 KV " \
        "heads" in whole[0] and "plan={'model.layers.*.self_attn.k_proj': 'replicate'" in \
        whole[0], whole[0]
    pm.close()
    plan = {"model.layers.*.self_attn.k_proj": "replicate",
            "model.layers.*.self_attn.v_proj": "replicate"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", WholeWeightWarning)
        fxshard.parallelize(model, mesh(tp=4), plan=plan, example_inputs=(ids,)).close()
        fxshard.parallelize(model, mesh(tp=2), example_inputs=(ids,)).close()


def test_multi_query_fused_projection_keeps_only_kv_whole(tmp_path):
    """One K/V head cannot split: the fused qkv keeps that part whole on every rank (said in the
    placement, ``R8``, and the pass log), its query part split; no gather of its output."""
    torch.manual_seed(0)
    model = PATTERNS["mqa_fused"]().eval()
    pm = run(model, dict(tp=2))
    e = pm.explain()
    placed = {f: s for f, s, _, _ in e.placements}
    assert placed["layers.0.attn.qkv.weight"] == "tp:S(0|32+R8+R8)", placed
    notes = [m for m in e.partly_whole.values() if "kept whole on tp" in m]
    assert len(notes) == LAYERS and "tp=2 exceeds the 1 KV head" in notes[0], notes
    assert ("all_gather", "tp") not in {(c.op, c.axis) for c in e.collectives[0]
                                        if "attn" in c.module}, e
    pm.close()
    # the block each rank loads: its query rows and every K/V row, from memory or safetensors
    from safetensors.torch import save_file
    from fxshard.checkpoint import SafetensorsSource
    from fxshard.mesh import MeshSpec
    from fxshard.placement import StridedShard, local_block
    w = torch.arange(48.0)[:, None].expand(48, 3).contiguous()
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    src = SafetensorsSource(str(tmp_path / "m.safetensors"), "w", (48, 3), torch.float32)
    m = MeshSpec((2, 2), ("dp", "tp"))
    spec = (R, StridedShard(0, (32, 8, 8), frozenset({1, 2})))
    for r in range(4):
        want = torch.cat([w[16 * (r % 2):16 * (r % 2) + 16], w[32:]])
        torch.testing.assert_close(local_block(w, spec, m, r), want)
        torch.testing.assert_close(src.block(spec, m, r), want)


def test_hf_deepseek_v3_tp2_writes_its_rotary_part_sharded():
    """HF DeepSeek-V3 (MLA) writes the rotary part of its heads with a slice assignment
    (``slice_scatter``): ``kv_b_proj`` splits by heads, two all-reduces a layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
        topk_group=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh(tp=2), example_inputs=(ids,))
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, want, rtol=1e-4, atol=1e-4)
    placed = {f: s for f, s, _, _ in pm.explain().placements}
    assert placed["model.layers.0.self_attn.kv_b_proj.weight"] == "tp:S(0)", placed
    assert layer_param_fraction(pm, model) <= 0.55
    assert all_reduces(pm) == 2 * 2
    pm.close()


@pytest.mark.parametrize("axes", [dict(ring_cp=2), dict(tp=2, ulysses_cp=2)],
                         ids=["ring2", "tp2_ulysses2"])
def test_repeat_interleave_kv_reaches_attention_unrepeated(axes):
    """``repeat_interleave(k, G, dim=1)`` in front of SDPA is dropped (attention maps query
    heads to KV heads itself): ring attention passes the KV heads once, not ``G`` times."""
    torch.manual_seed(0)
    model = PATTERNS["repeat_interleave"]().eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = run(model, axes, ids=ids, strict=True)
    assert pm.explain().passes["unrepeat_kv_pass"]["unrepeated_attentions"] == LAYERS
    if "tp" not in axes:   # (Ulysses over tp's 1 KV head a rank repeats it for its own heads)
        assert "repeat_interleave" not in pm.rank_module(0).code
    pm.close()


class ParallelBlock(Block):
    """Attention and MLP side by side on one norm, written ``mlp(h) + (attn(h) + x)``: the
    residual joins the first row-parallel partial sum before the second arrives."""

    def forward(self, x, *rope):
        h = self.attn_norm(x)
        y = self.attn(h, *rope) + x
        return self.w2(F.silu(self.w1(h)) * self.w3(h)) + y


class ParallelLM(TinyLM):
    def __init__(self):
        super().__init__(FusedQKVAttention)
        self.layers = nn.ModuleList(ParallelBlock(FusedQKVAttention()) for _ in range(LAYERS))


@pytest.mark.parametrize("axes,sp", [(dict(tp=2), False), (dict(tp=2), True),
                                     (dict(dp=2, tp=2), False)],
                         ids=["tp2", "tp2_sp", "dp2_tp2"])
def test_parallel_block_reduces_its_two_partial_sums_once(axes, sp):
    """``m + (a + x)`` with ``a``, ``m`` row-parallel partial sums is computed ``(a + m) + x``:
    one all-reduce (or reduce-scatter) per layer, equal to one device up to rounding."""
    torch.manual_seed(0)
    model = ParallelLM().eval()
    pm = run(model, axes, sequence_parallel=sp)
    code = pm.rank_module(0).code
    assert pm.explain().passes["reassociate_partials_pass"]["partial_sums_added_first"] == LAYERS
    assert all_reduces(pm) == (0 if sp else LAYERS), code
    assert code.count("fxshard.reduce_scatter") == (LAYERS if sp else 0), code
    pm.close()


class WindowMaskAttention(nn.Module):
    """litgpt's sliding window: the prompt's forward fills a ``[T, T]`` mask with ``-inf`` and
    zeroes each row's window in a Python loop (the plain causal mask while ``T <= window``);
    the window is an attribute of the module (no config)."""

    def __init__(self, window, dim=DIM, heads=HEADS):
        super().__init__()
        self.h, self.d, self.sliding_window_size = heads, dim // heads, window
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, self.d).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        mask = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device)
        for i in range(t):
            mask[i, max(0, i - self.sliding_window_size + 1):i + 1] = 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, t, t))
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_window_mask_built_in_the_prompt_folds_to_causal_and_bounds_generate():
    """A window at least the prompt + new tokens: the prompt's additive mask is the causal one
    (folded), and generate equals greedy on tp2. Past the window generate refuses, as the KV
    cache would attend tokens the model does not."""
    from tests.plain_lms import greedy_reference
    torch.manual_seed(0)
    model = TinyLM(lambda: WindowMaskAttention(window=12)).eval()
    pm = fxshard.parallelize(model, mesh(tp=2), example_inputs=(IDS,))
    try:
        assert torch.equal(pm.generate(IDS, max_new_tokens=4),
                           greedy_reference(model, IDS, 4))
        assert pm.explain().passes["fold_causal_mask_pass"]["folded_masks"] == LAYERS
        with pytest.raises(NotImplementedError, match=r"sliding window of 12 tokens, and the "
                                                      r"prompt plus max_new_tokens needs 13"):
            pm.generate(IDS, max_new_tokens=5)
    finally:
        pm.close()


@torch.library.custom_op("fxshard_tests::add_rows", mutates_args=())
def add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A library's own op around plain tensor code (torchtitan's deterministic scatter_add)."""
    return out.scatter_add(0, index, src)


@add_rows.register_fake
def _(out, index, src):
    return torch.empty_like(out)


class SortedMoE(nn.Module):
    """torchtitan's MoE: top-k routing, ``argsort(stable=True)`` of the flat expert ids, the
    rows gathered in expert order, grouped matmuls with the ``[E, F, D]`` weights cast to bf16,
    the outputs scaled, added back to their tokens by a custom op; a shared expert."""

    def __init__(self, dim=DIM, experts=4, top=2, hidden=32):
        super().__init__()
        self.top = top
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.s1 = nn.Linear(dim, hidden, bias=False)
        self.s2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        scores = self.gate(x).softmax(-1)
        top_s, ids = scores.topk(self.top, dim=-1)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ids, True).sum((0, 1))
        xt = x.view(-1, d)
        # [T, K] first, then flat (as torchtitan writes it)
        order = torch.argsort(ids.view(-1, self.top).view(-1), stable=True)
        s_sorted = top_s.view(-1, self.top).view(-1)[order]
        tok = order // self.top
        rows = xt[tok]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)

        def mm(a, w):
            return torch._grouped_mm(a, w.bfloat16().transpose(-2, -1), offs=offs)
        h = F.silu(mm(rows.bfloat16(), self.w1)) * mm(rows.bfloat16(), self.w3)
        y = mm(h, self.w2).type_as(xt) * s_sorted.reshape(-1, 1)
        out = add_rows(torch.zeros_like(xt), tok.reshape(-1, 1).expand(-1, d), y)
        return out.view(b, t, d) + self.s2(F.silu(self.s1(x)))


class SortedMoELM(WhereMoELM):
    def __init__(self):
        super().__init__()
        self.moe = SortedMoE()


@pytest.mark.parametrize("axes,sp", [(dict(tp=2), False), (dict(dp=2, tp=2), False),
                                     (dict(ring_cp=2), False), (dict(tp=2), True)],
                         ids=["tp2", "dp2_tp2", "ring2", "tp2_sp"])
def test_sorted_moe_with_cast_experts_and_a_custom_op_is_megatron(axes, sp):
    """The cast ``w.bfloat16().transpose(-2, -1)`` hands the expert weights' placement through
    to the grouped matmul (split on each expert's hidden dim); argsort has a rule; the custom
    op is traced to ``scatter_add``, whose rule keeps the partial sum; the bf16 expert output
    cast back to fp32 stays partial (a widening cast rounds nothing): one all-reduce for the
    routed and the shared experts together. Only the ``[E, D]`` router stays whole (said). On
    dp the tokens stay split through the routing (the add-back by ``scatter_add`` closes the
    region)."""
    torch.manual_seed(0)
    model = SortedMoELM().eval()
    # the experts run in bf16: the split changes their rounding (by a bf16 ulp)
    pm = run(model, axes, tol=2e-2, sequence_parallel=sp)
    e = pm.explain()
    code = pm.rank_module(0).code
    if "tp" not in axes:   # the zigzag sequence shard of each rank routed by itself too
        assert e.passes["moe_routing_pass"]["routing_sorts"] == 1
        assert e.passes["propagate_pass"]["routing_regions_gathered"] == 0, code
        pm.close()
        return
    placed = {f: s for f, s, _, _ in e.placements}
    assert "tp:S(1)" in placed["moe.w1"] and "tp:S(2)" in placed["moe.w2"], placed
    assert [f for f, _ in e.replicated] == ["moe.gate.weight"], e.replicated
    if sp:   # the MoE input gathered once (router, routing and shared expert), reduce-scattered
        # gathers: the MoE input, the residual before lm_head, the logits
        assert code.count("all_gather.default(") == 3 and all_reduces(pm) == 0 and \
            code.count("reduce_scatter.default(") == 1, code
        pm.close()
        return
    assert all_reduces(pm) == 1 and "scatter_add" in code and "add_rows" not in code, code
    if "dp" in axes:
        # each dp rank sorts, multiplies and adds back its own tokens (a routing region):
        # nothing moves on dp but the logits at the end
        assert e.passes["moe_routing_pass"]["routing_sorts"] == 1
        assert code.count("'dp', 2)") == 2, code   # local_shard of the ids, the logits' gather
    pm.close()
