"""Context-parallel training: the block backward of attention, ring and Ulysses backward, and
gradients and AdamW steps on ring_cp / ulysses_cp meshes equal to the single device's."""
import math

import pytest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxshard.kernels.attention_backward import attention_block_backward

GRAD = True


def _reference(q, k, v, causal, scale, q_offset, kv_offset, softcap, mask=None):
    """Attention by autograd-able plain ops (float64: its lse too), the keys at absolute
    positions; ``mask`` bool, True = attend."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1))
    s = s * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        i = torch.arange(q.shape[2])[:, None] + q_offset
        j = torch.arange(k.shape[2])[None, :] + kv_offset
        s = s.masked_fill(j > i, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return out, lse


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 5), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       group=st.sampled_from([1, 2, 3]), dv=st.sampled_from([3, 5]), causal=st.booleans(),
       softcap=st.sampled_from([0.0, 2.5]), q_offset=st.integers(0, 6), seed=st.integers(0, 99))
def test_block_backward_sums_to_autograd(sq, chunks, group, dv, causal, softcap, q_offset,
                                         seed):
    """The chunks' block backwards with the global out/lse add up to autograd's gradient of
    attention over all keys (float64; causal across chunks by offsets, GQA, Dv != D)."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, d = 2, 2, 4
    skv = sum(chunks)
    q = torch.randn(b, hkv * group, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, skv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, skv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hkv * group, sq, dv, generator=g, dtype=torch.float64)
    q_offset = q_offset if causal else 0   # keys from position 0: every row sees key 0
    scale = 0.7
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _reference(*leaves, causal, scale, q_offset, 0, softcap)
    (out * dout).sum().backward()
    out, lse = out.detach(), lse.detach()
    dq = torch.zeros_like(q)
    dk, dvv = [], []
    at = 0
    for n in chunks:
        a, bk, c = attention_block_backward(q, k[:, :, at:at + n], v[:, :, at:at + n], out,
                                            dout, lse, causal=causal, scale=scale,
                                            q_offset=q_offset, kv_offset=at, softcap=softcap)
        assert a.dtype == torch.float64
        dq += a
        dk.append(bk)
        dvv.append(c)
        at += n
    torch.testing.assert_close(dq, leaves[0].grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.cat(dk, 2), leaves[1].grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.cat(dvv, 2), leaves[2].grad, rtol=1e-9, atol=1e-9)


def test_block_backward_float32_accumulates_in_float32():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4)
    v, out, lse = torch.randn(1, 1, 5, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    grads = attention_block_backward(q.half(), k.half(), v.half(), out.half(), out.half(), lse)
    assert [t.dtype for t in grads] == [torch.float32] * 3
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]


def _rows(t, j, n, zigzag, segments=1):
    """Ring rank j's sequence rows (dim 2) in ``segments`` parts: chunk j of n, or chunks j and
    2n-1-j of 2n (zigzag), per part."""
    def one(p):
        if not zigzag:
            return p.chunk(n, dim=2)[j]
        pieces = p.chunk(2 * n, dim=2)
        return torch.cat([pieces[j], pieces[2 * n - 1 - j]], dim=2)
    return torch.cat([one(p) for p in t.chunk(segments, dim=2)], dim=2)


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([2, 3]), zigzag=st.booleans(), causal=st.booleans(),
       segments=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       softcap=st.sampled_from([0.0, 3.0]), masked=st.booleans(), seed=st.integers(0, 99))
def test_ring_attention_backward_matches_autograd(n, zigzag, causal, segments, group, softcap,
                                                  masked, seed):
    """Every rank's (dq, dk, dv) from ``fxshard::ring_attention_backward`` (simulated ring)
    equals its rows of autograd's gradient of the whole attention (float64)."""
    import fxshard.ops.ring  # noqa: F401
    from fxshard.mesh import MeshSpec
    from fxshard.runtime.simulated import SimulatedWorld
    g = torch.Generator().manual_seed(seed)
    b, hkv, s = 2, 2, 2 * n * segments * 2
    f64 = dict(generator=g, dtype=torch.float64)
    q, k = torch.randn(b, hkv * group, s, 4, **f64), torch.randn(b, hkv, s, 4, **f64)
    v, dout = torch.randn(b, hkv, s, 3, **f64), torch.randn(b, hkv * group, s, 3, **f64)
    mask = torch.rand(1, 1, s, s, generator=g) < 0.7 if masked else None
    if mask is not None:
        mask[..., 0] = True    # every row sees a key
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _reference(*leaves, causal, 0.6, 0, 0, softcap, mask)
    (out * dout).sum().backward()
    stride = s // segments

    def rank(j):
        def rows(t):
            return _rows(t, j, n, zigzag, segments)
        return torch.ops.fxshard.ring_attention_backward(
            rows(dout), rows(q), rows(k), rows(v), rows(out.detach()),
            rows(lse.detach().unsqueeze(-1)).squeeze(-1), causal, 0.6, "ring_cp", n, segments, stride,
            zigzag, -1, softcap, None if mask is None else rows(mask))
    with SimulatedWorld(MeshSpec((n,), ("ring_cp",))) as w:
        grads = w.run(rank)
    for j in range(n):
        for got, leaf in zip(grads[j], leaves):
            torch.testing.assert_close(got, _rows(leaf.grad, j, n, zigzag, segments),
                                       rtol=1e-9, atol=1e-9)


# -- training on CP meshes: gradients and AdamW steps equal one device's ---------------------

V, B, S = 96, 2, 8      # S: 2 * ring pieces (zigzag), hidden 48, intermediate 72: uneven


def _mesh(**axes):
    import fxshard
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _our_llama(heads=4, kv_heads=2):
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny(
        num_hidden_layers=2, vocab_size=V, hidden_size=48, intermediate_size=72,
        num_attention_heads=heads, num_key_value_heads=kv_heads))


def _hf(family):
    import pytest
    T = pytest.importorskip("transformers")
    cls, cfg = {"llama": (T.LlamaForCausalLM, T.LlamaConfig),
                "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config),
                "mistral": (T.MistralForCausalLM, T.MistralConfig)}[family]
    extra = dict(sliding_window=3) if family == "mistral" else {}   # < S: a banded mask
    config = cfg(vocab_size=V, hidden_size=48, intermediate_size=72, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                 max_position_embeddings=64, attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    return cls(config).eval()


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _ring_ops(pm, which):
    import collections
    out = collections.Counter()
    for n in pm.rank_module(0, which).graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("fxshard."):
            out[str(n.target).split(".")[1]] += 1
    return out


def _check(model, mesh, *, steps=0, ring_zigzag=True, logits=lambda o: o):
    """pm's gradients (and after ``steps`` AdamW steps its parameters) equal a copy's trained
    on one device; returns pm."""
    import copy
    import fxshard
    ref = copy.deepcopy(model)
    ids, labels = _data()
    pm = fxshard.parallelize(model, mesh, ring_zigzag=ring_zigzag)
    out = pm(ids)
    torch.testing.assert_close(logits(out), logits(ref(ids)), rtol=1e-4, atol=1e-4)
    _loss(logits(out), labels).backward()
    _loss(logits(ref(ids)), labels).backward()
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    if steps:
        pm.zero_grad()
        ref.zero_grad()
        for step_model, params in ((pm, pm.parameters()), (ref, ref.parameters())):
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
            for _ in range(steps):
                opt.zero_grad()
                _loss(logits(step_model(ids)), labels).backward()
                opt.step()
        trained = pm.state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5,
                                       msg=name)
    return pm


def test_ring_zigzag_trains_as_one_device():
    """ring_cp=2 (zigzag): gradients and three AdamW steps; the backward runs one ring
    attention backward per layer and no attention gather (only the weight gradients'
    all-reduces over the ring)."""
    pm = _check(_our_llama(), _mesh(ring_cp=2), steps=3)
    assert _ring_ops(pm, "forward")["ring_attention"] == 2
    bwd = _ring_ops(pm, "backward")
    assert bwd["ring_attention_backward"] == 2 and bwd["all_gather"] == 0
    assert bwd["zigzag_gather"] == 0 and bwd["all_reduce"] == 21   # one per parameter
    # K/V of a rank [B=2, Hkv=2, S/2=4, D=12] float32: one hop, their gradients two
    ring = [c for c in pm.trainer.collectives("backward") if c.op == "ring_attention_backward"]
    chunk = 2 * (2 * 2 * 4 * 12) * 4
    assert [(c.shape, c.wire_bytes) for c in ring] == [((2, 2, 4, 12), 3 * chunk)] * 2


def test_ulysses_trains_as_one_device():
    """ulysses_cp=2: gradients and three AdamW steps; the backward's all-to-alls are the
    forward's inverse (no activation gather)."""
    pm = _check(_our_llama(), _mesh(ulysses_cp=2), steps=3)
    fwd, bwd = _ring_ops(pm, "forward"), _ring_ops(pm, "backward")
    assert fwd["all_to_all"] == 8    # q, k, v to heads, out back: per layer
    assert bwd["all_to_all"] == 8    # grad_out to heads, dq, dk, dv back
    assert bwd["all_gather"] == bwd["reduce_scatter"] == 0 and bwd["all_reduce"] == 21


@pytest.mark.parametrize("axes", [dict(tp=2, ring_cp=2), dict(fsdp=2, ulysses_cp=2)],
                         ids=["tp2_ring2", "fsdp2_ulysses2"])
def test_cp_with_other_axes_gradients(axes):
    """tp2·ring2 with the contiguous layout (ring_zigzag=False), fsdp2·ulysses2; dp2·ring2:
    the gloo test."""
    pm = _check(_our_llama(), _mesh(**axes), ring_zigzag=False)
    fwd, bwd = _ring_ops(pm, "forward"), _ring_ops(pm, "backward")
    assert fwd["zigzag_shard"] == 0
    if "ring_cp" in axes:
        assert bwd["ring_attention_backward"] == 2
    else:
        # fsdp: one reduce-scatter per layer (and the norm + head's), the embedding's own
        assert bwd["all_to_all"] == 8 and bwd["reduce_scatter"] == 1
        assert bwd["reduce_scatter_bucket"] == 3


@pytest.mark.parametrize("outer", ["ring_cp", "ulysses_cp"])
def test_usp_gradients(outer):
    """USP (ulysses2·ring2), both mesh orders: the ring on the rank's heads. Ring outside
    trades sequence for heads with one all-to-all each way (4 per layer and direction);
    Ulysses outside moves them by gathers (more bytes, the same numbers)."""
    axes = dict(ring_cp=2, ulysses_cp=2) if outer == "ring_cp" else dict(ulysses_cp=2,
                                                                        ring_cp=2)
    pm = _check(_our_llama(), _mesh(**axes))
    fwd, bwd = _ring_ops(pm, "forward"), _ring_ops(pm, "backward")
    assert fwd["ring_attention"] == bwd["ring_attention_backward"] == 2
    if outer == "ring_cp":
        assert fwd["all_to_all"] == bwd["all_to_all"] == 8 and bwd["all_gather"] == 0


@pytest.mark.parametrize("family,axes", [("llama", dict(ring_cp=2)), ("qwen2", dict(ulysses_cp=2)),
                                         ("mistral", dict(ring_cp=2))])
def test_hf_models_train_on_cp(family, axes):
    """HF Llama, Qwen2 (q/k/v biases) and Mistral with a sliding window of 3 < 8 tokens (a
    banded mask, sharded by query rows on the ring)."""
    pm = _check(_hf(family), _mesh(**axes), logits=lambda o: o.logits)
    if "ring_cp" in axes:
        assert _ring_ops(pm, "backward")["ring_attention_backward"] == 1


def test_tp_ulysses_and_the_seed_mesh_train_as_one_device():
    """Ulysses with tp (KV heads split over both: 4 KV heads, tp2·ulysses2), and the seed's
    16-rank dp2·tp2·pp2·ulysses_cp2 (GPipe behind loss.backward)."""
    pm = _check(_our_llama(heads=8, kv_heads=4), _mesh(tp=2, ulysses_cp=2))
    assert _ring_ops(pm, "backward")["all_to_all"] == 8
    _check(_our_llama(heads=8, kv_heads=4), _mesh(dp=2, tp=2, pp=2, ulysses_cp=2), steps=3)


@settings(max_examples=6, deadline=None)
@given(axes=st.sampled_from([
    dict(pp=2, ring_cp=2), dict(pp=2, ulysses_cp=2), dict(dp=2, pp=2, ring_cp=2),
    dict(fsdp=2, ring_cp=2, ulysses_cp=2), dict(tp=2, pp=2, ring_cp=2),
    dict(pp=2, ring_cp=2, ulysses_cp=2), dict(fsdp=2, tp=2, ulysses_cp=2),
    dict(dp=2, tp=2, ring_cp=2), dict(ulysses_cp=2, pp=2, fsdp=2)]), zigzag=st.booleans())
def test_meshes_with_pp_and_cp_train_as_one_device(axes, zigzag):
    """Random meshes mixing the CP axes with pp and the others (product 8): gradients equal
    one device (Ulysses under tp with 4 KV heads so both can split them)."""
    heads, kv = (8, 4) if "tp" in axes and "ulysses_cp" in axes else (4, 2)
    _check(_our_llama(heads, kv), _mesh(**axes), ring_zigzag=zigzag)


def test_six_axis_mesh_trains_as_one_device():
    """dp2·fsdp2·tp2·pp2·ring2·ulysses2: 64 ranks, every axis at once (batch 4, sequence 8)."""
    import copy
    import fxshard
    model = _our_llama(heads=8, kv_heads=4)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, V, (4, 8), generator=g) for _ in range(2))
    mesh = _mesh(dp=2, fsdp=2, tp=2, pp=2, ring_cp=2, ulysses_cp=2)
    pm = fxshard.parallelize(model, mesh, ring_zigzag=False)
    _loss(pm(ids), labels).backward()
    _loss(ref(ids), labels).backward()
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("axes", [dict(tp=2, ulysses_cp=2), dict(pp=2, tp=2, ulysses_cp=2)],
                         ids=["tp2_ulysses2", "pp2_tp2_ulysses2"])
def test_ulysses_without_kv_heads_to_split_is_an_error(axes):
    """2 KV heads over tp=2 leave one per rank, which Ulysses cannot split further."""
    import fxshard
    pm = fxshard.parallelize(_our_llama(), _mesh(**axes))
    with pytest.raises(NotImplementedError, match=r"1 key/value heads per rank, which mesh "
                                                  r"axis 'ulysses_cp' of size 2"):
        pm(_data()[0])


# -- real processes: gloo, dp2·ring2 -------------------------------------------------------

def _gloo_body(rank: int, report: dict) -> None:
    import copy
    import fxshard
    from fxshard.mesh import mesh_spec
    from tests.launch import worst_block
    mesh = _mesh(dp=2, ring_cp=2)
    model = _our_llama()
    ref = copy.deepcopy(model)
    ids, labels = _data()
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    report["ranks"] = pm.trainer.ranks
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    spec, specs = mesh_spec(mesh), pm.trainer._specs
    named = dict(ref.named_parameters())
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        out = pm(ids)
        report.setdefault("forward", (out - ref(ids)).abs().max().item())
        _loss(out, labels).backward()
        _loss(ref(ids), labels).backward()
        if step == 0:
            report["grad"] = worst_block(pm.shards(rank), named, specs, spec, rank,
                                         of=lambda p: p.grad)
        opt.step()
        ref_opt.step()
    report["params"] = worst_block(pm.shards(rank), named, specs, spec, rank)
    report["ring_backward"] = _ring_ops(pm, "backward")["ring_attention_backward"]


def test_dp2_ring2_gloo_gradients_and_steps(tmp_path):
    from tests.launch import gloo_job
    reports = gloo_job(_gloo_body, 4, str(tmp_path), timeout_s=240, grad=True)
    for rank, r in reports.items():
        assert r["ranks"] == [rank] and r["ring_backward"] == 2, r
        assert r["forward"] < 1e-4 and r["grad"] < 1e-5 and r["params"] < 1e-5, r
