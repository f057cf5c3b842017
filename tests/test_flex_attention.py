"""FlexAttention (``torch.nn.attention.flex_attention`` with a ``BlockMask`` built in the
forward): lowered by ``fxshard.passes.lower_flex`` to SDPA with the ``mask_mod`` evaluated as
a boolean mask (explicit attention with a ``score_mod``), then parallelised like any
attention. Inference equals the model's own eager flex output; training (PyTorch has no flex
backward on CPU) equals the same weights with the equivalent dense-mask SDPA. Packed rows of
several documents of uneven lengths (``doc`` ids), a mask reading the head index (global heads
on tp), a score_mod (ALiBi-like bias over global positions on ring_cp).
"""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fxshard

GRAD = True       # each test sets its own grad mode
V, B, S = 37, 2, 12
# packed rows: documents of uneven lengths (5 + 7; 3 + 4 + 5)
DOCS = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5])


def _mask_mod(kind, doc):
    def causal(b, h, q, kv):
        return q >= kv

    def document(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    def per_head(b, h, q, kv):      # heads 0, 1: causal; heads 2, 3: a window of 3
        return (q >= kv) & ((h < 2) | (q - kv < 3))
    return {"causal": causal, "document": document, "per_head": per_head}[kind]


def _alibi(score, b, h, q, kv):
    return score - (h + 1).to(score.dtype) * 0.25 * (q - kv).to(score.dtype)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, kind, score_mod):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.kind, self.score_mod, self.flex = kind, score_mod, True
        self.q = nn.Linear(dim, heads * self.hd, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x, doc):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        mask_mod = _mask_mod(self.kind, doc)
        if self.flex:
            bm = create_block_mask(mask_mod, b, None, s, s, device=x.device)
            y = flex_attention(q, k, v, block_mask=bm, score_mod=self.score_mod,
                               enable_gqa=self.heads != self.kv_heads)
        else:       # the same attention by dense ops (trains on CPU)
            idx = [torch.arange(n, device=x.device).view(*[n if i == d else 1
                                                             for i in range(4)])
                   for d, n in enumerate((b, self.heads, s, s))]
            mask = mask_mod(*idx).expand(b, self.heads, s, s)
            if self.score_mod is None:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            else:
                g = self.heads // self.kv_heads
                sc = q @ k.repeat_interleave(g, 1).transpose(-2, -1) / math.sqrt(self.hd)
                sc = self.score_mod(sc, *idx).masked_fill(~mask, -math.inf)
                y = sc.softmax(-1) @ v.repeat_interleave(g, 1)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, kind, score_mod):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, kind, score_mod)
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim,
                                                                          bias=False)

    def forward(self, x, doc):
        x = x + self.attn(self.n1(x), doc)
        return x + self.down(F.silu(self.up(self.n2(x))))


class FlexLM(nn.Module):
    """A tiny Llama-like LM whose attention is FlexAttention over packed rows (``doc``)."""

    def __init__(self, kind="document", score_mod=None, dim=32, heads=4, kv_heads=2,
                 layers=1):
        super().__init__()
        self.embed = nn.Embedding(V, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, kind, score_mod)
                                    for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, V, bias=False)

    def forward(self, ids, doc):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, doc)
        return self.head(self.norm(x))


def dense(model):
    """A copy of ``model`` attending through the equivalent dense-mask attention."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, Attention):
            m.flex = False
    return ref


def _model(kind="document", score_mod=None, **kw):   # one layer (two for pp)
    torch.manual_seed(0)
    return FlexLM(kind, score_mod, **kw)


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()),
                                    mesh_dim_names=tuple(axes))


def _ops(pm, rank=0, which=None):
    import collections
    gm = pm.rank_module(rank) if which is None else pm.rank_module(rank, which)
    return collections.Counter(str(n.target) for n in gm.graph.nodes
                               if n.op == "call_function")


def _loss(out, labels):
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


def _check(model, axes, *, doc=DOCS):
    """``pm(ids, doc)`` under no_grad equals the model's own eager flex output; one training
    step's loss and every gradient equal the dense-mask copy's (1e-5); returns pm."""
    ids, labels = _data()
    ref = dense(model)
    with torch.no_grad():
        want = model(ids, doc)
        torch.testing.assert_close(ref(ids, doc), want, rtol=1e-5, atol=1e-5)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(**axes))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, doc), want, rtol=1e-5, atol=1e-5)
    if axes.get("pp", 1) > 1:
        loss = pm.train_step(ids, doc, loss_fn=_loss, target=labels)
    else:
        loss = _loss(pm(ids, doc), labels)
        loss.backward()
    want_loss = _loss(ref(ids, doc), labels)
    want_loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-5)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return pm


def test_lowering_leaves_plain_attention_and_drops_block_tensors():
    """After the trace's cleanup no flex_attention op, subgraph or block-sparsity tensor
    (argsort of the blocks) is left: one SDPA per layer with the document mask, read from
    the ``doc`` input (the score_mod form is checked by its numbers below)."""
    from fxshard.passes import PassReports
    from fxshard.trace import cleanup_pass, trace
    ids, _ = _data()
    for score_mod, want in ((None, "aten.scaled_dot_product_attention.default"),):
        with torch.no_grad():
            traced = trace(_model("document", score_mod, layers=2), (ids, DOCS))
        reports = PassReports()
        gm = cleanup_pass(traced.gm, ctx=reports)
        ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        counts = [str(n.target) for n in gm.graph.nodes].count(want)
        assert counts == 2, (want, counts)
        assert not any("flex" in op or "argsort" in op for op in ops), sorted(ops)
        assert not [name for name, _ in gm.named_children()]
        assert reports.reports["lower_flex_attention_pass"] == {"lowered": 2}
        doc = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "doc")
        assert all(u.target is torch.ops.aten.index.Tensor for u in doc.users)


def test_per_head_mask_dp2_tp2_sees_global_heads():
    """A mask_mod reading the head index (heads 2, 3 windowed): the tp rank holding heads 2, 3
    must evaluate it at h = 2, 3 (at its local 0, 1 the result differs)."""
    _check(_model("per_head"), dict(dp=2, tp=2))


def test_document_mask_ring_cp2_zigzag():
    """Packed rows on ring_cp (zigzag): the document mask at global positions, attention as
    ring attention (K/V around the ring, not gathered)."""
    pm = _check(_model("document"), dict(ring_cp=2))
    assert _ops(pm)["fxshard.ring_attention.default"] == 1
    gathered = [n.args[0].meta["val"] for n in pm.rank_module(0).graph.nodes
                if n.op == "call_function" and "gather" in str(n.target)]
    # the doc ids (int64 [B, S], to evaluate the mask rows) and the logits, never K or V
    # (the programs' values carry global shapes)
    assert sorted(tuple(v.shape) for v in gathered) == [(B, S), (B, S, V)], gathered


def test_document_mask_ulysses_cp2():
    _check(_model("document"), dict(ulysses_cp=2))


def test_document_mask_pp2():
    _check(_model("document", layers=2), dict(pp=2))


def test_score_mod_ring_cp2():
    """An ALiBi-like score_mod over global heads and positions, with the document mask."""
    _check(_model("document", _alibi), dict(ring_cp=2))


# -- HuggingFace: attn_implementation="flex_attention", packed rows by position_ids resets --
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6],
                          [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]])


def _hf_llama(attn):
    T = pytest.importorskip("transformers")
    config = T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           use_cache=False, max_position_embeddings=64,
                           attn_implementation=attn)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(config).eval()


def _check_hf(model, axes):
    """HF's packed-sequence path (``position_ids`` restarting at each document): inference
    equals the model's own eager output and differs from the unpacked one; the gradients
    equal the same weights' with SDPA (PyTorch's flex has no CPU backward)."""
    ids, labels = _data()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(ids, position_ids=POSITIONS).logits
        assert (want - model(ids).logits).abs().max() > 1e-2     # the documents matter
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(**axes))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, position_ids=POSITIONS).logits, want,
                                   rtol=1e-5, atol=1e-5)
    loss = _loss(pm(ids, position_ids=POSITIONS).logits, labels)
    loss.backward()
    want_loss = _loss(ref(ids, position_ids=POSITIONS).logits, labels)
    want_loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-5)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return pm


def test_hf_llama_flex_attention_packed_tp2():
    _check_hf(_hf_llama("flex_attention"), dict(tp=2))


def test_hf_llama_sdpa_packed_position_ids_ring_cp2():
    """Packed documents through plain SDPA: HF builds the document mask from the
    position_ids resets; ring attention reads it at global positions."""
    pm = _check_hf(_hf_llama("sdpa"), dict(ring_cp=2))
    assert _ops(pm)["fxshard.ring_attention.default"] == 1


class _MaskArgument(nn.Module):
    def forward(self, x, block_mask):
        return flex_attention(x, x, x, block_mask=block_mask)


def test_block_mask_argument_is_a_clear_error():
    """torchtitan passes its BlockMask to forward (attention_masks): its mask_mod's captured
    tensors would be frozen into the program, so it is refused with the fix."""
    x = torch.randn(2, 2, 8, 4)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 2, None, 8, 8, device="cpu")
    pm = fxshard.parallelize(_MaskArgument(), _mesh(tp=2))
    with pytest.raises(NotImplementedError, match="BlockMask is passed to forward.*"
                       "create_block_mask there"):
        with torch.no_grad():
            pm(x, mask)


class _WithLse(nn.Module):
    """Attention whose log-sum-exp gates its output (an attention-sink style use)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o, self.flex = nn.Linear(16, 48, bias=False), nn.Linear(16, 16), True

    def forward(self, x, doc):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        mask_mod = _mask_mod("document", doc)
        if self.flex:
            bm = create_block_mask(mask_mod, b, None, s, s, device=x.device)
            y, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
        else:
            idx = [torch.arange(n).view(*[n if i == d else 1 for i in range(4)])
                   for d, n in enumerate((b, 4, s, s))]
            sc = (q @ k.transpose(-2, -1) / 2.0).masked_fill(~mask_mod(*idx), -math.inf)
            y, lse = sc.softmax(-1) @ v, sc.logsumexp(-1)
        y = y * torch.sigmoid(lse).unsqueeze(-1)
        return self.o(y.transpose(1, 2).reshape(b, s, 16))


def test_log_sum_exp_output_ring_cp2():
    torch.manual_seed(0)
    model, x = _WithLse(), torch.randn(B, S, 16)
    ref = copy.deepcopy(model)
    ref.flex = False
    with torch.no_grad():
        want = model(x, DOCS)
        torch.testing.assert_close(ref(x, DOCS), want, rtol=1e-5, atol=1e-5)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(ring_cp=2))
    with torch.no_grad():
        torch.testing.assert_close(pm(x, DOCS), want, rtol=1e-5, atol=1e-5)
    pm(x, DOCS).square().sum().backward()
    ref(x, DOCS).square().sum().backward()
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5)


def test_causal_mask_mod_folds_to_causal_ring_attention():
    """A plain causal mask_mod becomes is_causal (no mask tensor): zigzag ring attention."""
    ids, _ = _data()
    model = _model("causal")
    with torch.no_grad():
        want = model(ids, DOCS)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(ring_cp=2))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, DOCS), want, rtol=1e-5, atol=1e-5)
    ring = [n for n in pm.rank_module(0).graph.nodes
            if n.target is torch.ops.fxshard.ring_attention.default]
    assert len(ring) == 1 and ring[0].args[3] is True and len(ring[0].args) == 11, ring
