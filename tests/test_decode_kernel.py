"""Tests for fxshard.kernels.decode_attention: the torch path and the Triton split-K kernel
(under TRITON_INTERPRET=1) against a float64 reference, the merge of cache pieces, error
messages, the kernel's sm_90 compilation and benchmarks/decode.py's report.

``reference_decode`` loops over (sequence, query head, query): it lists the keys the query sees
(``j < min(lengths[b], L)``, and ``j <= lengths[b] - Sq + i`` when causal), takes a float64
softmax over them, and gives ``out = 0``, ``lse = -inf`` when there are none.

The ``test_triton_interp_*`` tests need TRITON_INTERPRET=1 before triton is first imported, so
``test_triton_decode_kernel_subprocess`` reruns them in a fresh process with it set (as
tests/test_attention_kernel.py does for the forward kernel); here they skip.
"""
import importlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.triton_interp import BF16_DOT_BUG, run_interpreter_tests
from fxshard.kernels import decode_attention, merge_attention

REPO = Path(__file__).resolve().parents[1]


def reference_decode(q, k, v, lengths, *, causal, scale=None, softcap=0.0):
    """Float64 (out, lse) by a plain loop over (b, h, i); ``softcap``: each scaled score ``s``
    becomes ``softcap * tanh(s / softcap)``."""
    batch, heads_q, seq_q, head_dim = q.shape
    group = heads_q // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=torch.float64)   # v's head size
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    for b in range(batch):
        length = int(lengths[b])
        for h in range(heads_q):
            for i in range(seq_q):
                last = length - seq_q + i if causal else length - 1
                keys = [j for j in range(k.shape[2]) if j < length and j <= last]
                if not keys:
                    continue
                k_TD = k[b, h // group, keys].double()
                s_T = (k_TD @ q[b, h, i].double()) * scale
                if softcap:
                    s_T = softcap * torch.tanh(s_T / softcap)
                out[b, h, i] = torch.softmax(s_T, 0) @ v[b, h // group, keys].double()
                lse[b, h, i] = torch.logsumexp(s_T, 0)
    return out, lse


def assert_matches(out, lse, ref_out, ref_lse, *, tol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=tol, atol=tol)


def make_inputs(batch, heads_q, heads_kv, seq_q, capacity, head_dim, *, seed=0,
                dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, capacity, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, capacity, head_dim, generator=gen).to(dtype)
    return q, k, v


@st.composite
def decode_cases(draw, *, head_dims=(1, 4, 8, 16), max_capacity=40):
    heads_kv = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    capacity = draw(st.integers(0, max_capacity))
    lengths = draw(st.lists(st.sampled_from([0, 1, capacity]) | st.integers(0, capacity),
                            min_size=batch, max_size=batch))
    return {"batch": batch, "heads_kv": heads_kv, "heads_q": heads_kv * draw(st.integers(1, 4)),
            "seq_q": draw(st.integers(1, 4)), "capacity": capacity,
            "head_dim": draw(st.sampled_from(head_dims)), "lengths": lengths,
            "causal": draw(st.booleans()), "scale": draw(st.sampled_from([None, 0.3])),
            "seed": draw(st.integers(0, 2**16))}


def inputs_of(case, dtype=torch.float32):
    q, k, v = make_inputs(case["batch"], case["heads_q"], case["heads_kv"], case["seq_q"],
                          case["capacity"], case["head_dim"], seed=case["seed"], dtype=dtype)
    return q, k, v, torch.tensor(case["lengths"], dtype=torch.int64)


# ---------------------------------------------------------------- torch path


@given(decode_cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_path_matches_reference(dtype, case):
    q, k, v, lengths = inputs_of(case, dtype)
    out, lse = decode_attention(q, k, v, lengths, causal=case["causal"], scale=case["scale"],
                                backend="torch")
    assert out.shape == q.shape and out.dtype == dtype
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=case["causal"],
                                        scale=case["scale"])
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4 if dtype == torch.float32 else 1e-6)


@given(decode_cases(), st.booleans())
def test_eager_program_entries_match_reference(case, one_slot):
    """What eager rank programs call (``direct_kernel``: no argument checks, the new K/V's slot
    given as the index itself) computes what the checked ops do."""
    from fxshard.ops.library import direct_kernel
    q, k, v, lengths = inputs_of(case)
    attend = direct_kernel(torch.ops.fxshard.decode_attention.default)
    out, lse = attend(q, k, v, lengths, case["scale"], case["causal"])
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=case["causal"],
                                        scale=case["scale"])
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)
    write = direct_kernel(torch.ops.fxshard.cache_write.default)
    if case["capacity"] == 0:
        return
    new = q[:, :case["heads_kv"], :1 if one_slot else min(case["seq_q"], case["capacity"])]
    pos = torch.tensor([case["capacity"] - new.shape[2]])
    direct, checked = k.clone(), k.clone()
    write(direct, new, pos)
    torch.ops.fxshard.cache_write(checked, new, pos)
    assert torch.equal(direct, checked)
    assert torch.equal(direct[:, :, pos.item():pos.item() + new.shape[2]], new)


@pytest.mark.parametrize("head_dim_v, causal, lengths", [(16, True, [9, 4]), (5, False, [9, 0]),
                                                        (40, True, [9, 9])])
def test_torch_path_value_head_size_differs(head_dim_v, causal, lengths):
    """MLA: v's head size (and so out's) differs from q/k's (24); the fused CPU path (equal
    lengths) is not taken where it cannot be."""
    q, k, _ = make_inputs(2, 4, 2, 1, 9, 24, seed=2)
    v = torch.randn(2, 2, 9, head_dim_v, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor(lengths)
    out, lse = decode_attention(q, k, v, lengths, causal=causal, backend="torch")
    assert out.shape == (2, 4, 1, head_dim_v)
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=causal)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-5)
    fake = torch.ops.fxshard.decode_attention(q.to("meta"), k.to("meta"), v.to("meta"),
                                              lengths.to("meta"), None, causal)
    assert fake[0].shape == out.shape


@given(decode_cases(), st.sampled_from([0.7, 2.0, 30.0]))
def test_torch_path_soft_cap_matches_reference(case, softcap):
    """The soft-cap on the torch path (fused CPU path not taken) and in eager programs."""
    from fxshard.ops.library import direct_kernel
    q, k, v, lengths = inputs_of(case)
    ref_out, ref_lse = reference_decode(3 * q, k, v, lengths, causal=case["causal"],
                                        scale=case["scale"], softcap=softcap)
    out, lse = decode_attention(3 * q, k, v, lengths, causal=case["causal"],
                                scale=case["scale"], softcap=softcap, backend="torch")
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)
    attend = direct_kernel(torch.ops.fxshard.decode_attention.default)
    out, lse = attend(3 * q, k, v, lengths, case["scale"], case["causal"], softcap)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


def test_torch_path_rows_without_keys():
    """lengths 0 and 1, causal with Sq > length: those rows are exactly 0 and -inf; on CPU
    'auto' is the torch path."""
    q, k, v = make_inputs(3, 4, 2, 3, 5, 8, seed=1)
    lengths = torch.tensor([0, 1, 5], dtype=torch.int32)
    out, lse = decode_attention(q, k, v, lengths, causal=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    # length 1, Sq 3: queries 0 and 1 see no key, query 2 sees key 0 alone (out = v[0])
    assert torch.isneginf(lse[1, :, :2]).all() and torch.equal(out[1, :, :2], 0 * out[1, :, :2])
    torch.testing.assert_close(out[1, :, 2], v[1, :, 0].repeat_interleave(2, 0))
    assert torch.isfinite(lse[2]).all()
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=True)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


@given(decode_cases(head_dims=(4, 8), max_capacity=30), st.floats(0.0, 1.0))
def test_merge_of_cache_pieces_equals_whole(case, cut_at):
    """Flash-decoding across ranks: the cache cut at ``cut`` into a past piece (every query sees
    all its valid keys: causal=False) and the rest (causal, lengths shifted by ``cut``), merged
    by logsumexp, equals attention to the whole cache. With causal the cut stays at or below
    the first query's position (a past piece holds no key a query must not see)."""
    q, k, v, lengths = inputs_of(case)
    cut = round(cut_at * case["capacity"])
    if case["causal"]:
        cut = max(0, min(cut, min(case["lengths"]) - case["seq_q"] + 1))
    past = decode_attention(q, k[:, :, :cut], v[:, :, :cut], lengths.clamp(max=cut),
                            causal=False, scale=case["scale"], backend="torch")
    rest = decode_attention(q, k[:, :, cut:], v[:, :, cut:], (lengths - cut).clamp(min=0),
                            causal=case["causal"], scale=case["scale"], backend="torch")
    out, lse = merge_attention(*past, *rest)
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=case["causal"],
                                        scale=case["scale"])
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


# ---------------------------------------------------------------- errors


def test_error_messages():
    q, k, v = make_inputs(2, 4, 2, 1, 6, 8)
    lengths = torch.tensor([3, 6])
    name = r"fxshard.kernels.decode_attention: "
    with pytest.raises(ValueError, match=name + r"backend='bogus'; choose one of"):
        decode_attention(q, k, v, lengths, backend="bogus")
    with pytest.raises(ValueError, match=name + r"q must be a 4-dim floating tensor .* got "
                                                r"torch.float32 of shape \(2, 4, 8\)"):
        decode_attention(q[:, :, 0], k, v, lengths)
    with pytest.raises(ValueError, match=name + r"k_cache has shape \(2, 2, 6, 8\), v_cache "
                                                r"\(2, 2, 5, 8\)"):
        decode_attention(q, k, v[:, :, :5], lengths)
    with pytest.raises(ValueError, match=name + r"q has shape \(1, 4, 1, 8\) and the cache "
                                                r"\(2, 2, 6, 8\); batch"):
        decode_attention(q[:1], k, v, lengths)
    with pytest.raises(ValueError, match=name + r"q has 4 heads, the cache 3; Hq must be a "
                                                r"multiple of Hkv"):
        decode_attention(q, k[:, :1].expand(2, 3, 6, 8), v[:, :1].expand(2, 3, 6, 8), lengths)
    with pytest.raises(ValueError, match=name + r"q \(torch.float64, cpu\) and the cache "
                                                r"\(torch.float32, cpu\) must share dtype"):
        decode_attention(q.double(), k, v, lengths)
    with pytest.raises(ValueError, match=name + r"lengths must be an integer tensor of shape "
                                                r"\[2\] on cpu, got torch.float32 of shape"):
        decode_attention(q, k, v, lengths.float())
    with pytest.raises(ValueError, match=r"got torch.int64 of shape \(3,\)"):
        decode_attention(q, k, v, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=name + r"scale=nan; expected a finite float or None"):
        decode_attention(q, k, v, lengths, scale=float("nan"))
    with pytest.raises(ValueError, match=name + r"softcap=-1.0; expected a finite float >= 0"):
        decode_attention(q, k, v, lengths, softcap=-1.0)


@pytest.mark.grad   # the forward-only check is about inputs that require grad
def test_triton_error_messages(monkeypatch):
    triton_decode = pytest.importorskip("fxshard.kernels.triton_decode")
    name = r"fxshard.kernels.decode_attention: "
    q, k, v = make_inputs(1, 2, 1, 1, 6, 320)
    lengths = torch.tensor([4])
    with pytest.raises(ValueError, match=name + r"head_dim is 320, but backend='triton' "
                                                r"supports head_dim up to 256"):
        decode_attention(q, k, v, lengths, backend="triton")
    q, k, v = q[..., :16].double(), k[..., :16].double(), v[..., :16].double()
    with pytest.raises(ValueError, match=name + r"q has dtype torch.float64, but "
                                                r"backend='triton' supports"):
        decode_attention(q, k, v, lengths, backend="triton")
    q, k, v = q.float().requires_grad_(True), k.float(), v.float()
    with pytest.raises(ValueError, match=name + r"backend='triton' \(what 'auto' picks on "
                                                r"CUDA\) is forward-only"):
        decode_attention(q, k, v, lengths, backend="triton")
    q = q.detach()
    if not triton_decode.interpreting():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match=name + r"backend='triton' got tensors on cpu, .* "
                                                    r"set the environment variable "
                                                    r"TRITON_INTERPRET=1"):
            decode_attention(q, k, v, lengths, backend="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(ValueError, match=name + r"TRITON_INTERPRET=1 is set, but triton "
                                                    r"was imported before it was"):
            decode_attention(q, k, v, lengths, backend="triton")
    with pytest.raises(ValueError, match=name + r"n_splits=0; expected an int >= 1"):
        triton_decode.decode_fwd(q, k, v, lengths, scale=0.25, causal=True, n_splits=0)
    with pytest.raises(ValueError, match=name + r"block_n=24; block sizes must be powers of "
                                                r"two >= 16"):
        triton_decode.decode_fwd(q, k, v, lengths, scale=0.25, causal=True, block_n=24)


def test_without_triton_the_triton_backend_says_so(monkeypatch):
    import fxshard.kernels

    decode_module = importlib.import_module("fxshard.kernels.decode")
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "fxshard.kernels.triton_decode", raising=False)
    monkeypatch.delattr(fxshard.kernels, "triton_decode", raising=False)
    decode_module._triton_module.cache_clear()
    try:
        q, k, v = make_inputs(1, 2, 1, 1, 4, 16)
        out, lse = decode_attention(q, k, v, torch.tensor([3]))
        assert out.shape == q.shape and torch.isfinite(lse).all()
        with pytest.raises(ValueError, match=r"backend='triton' needs the triton package, which "
                                             r"is not installed; .* backend='torch'"):
            decode_attention(q, k, v, torch.tensor([3]), backend="triton")
    finally:
        decode_module._triton_module.cache_clear()


def test_num_splits_heuristic():
    triton_decode = pytest.importorskip("fxshard.kernels.triton_decode")
    # H200 (132 SMs), GQA 32/8, BLOCK_N 64: B=1 fills ~2 waves at 32k keys, while no split
    # gets fewer than 4 key blocks at 4k; B=8 needs fewer splits; a tiny cache takes one
    assert triton_decode.num_splits(32768, 8, 132, 64) == 33
    assert triton_decode.num_splits(4096, 8, 132, 64) == 16
    assert triton_decode.num_splits(32768, 64, 132, 64) == 5
    assert triton_decode.num_splits(100, 8, 132, 64) == 1
    assert triton_decode.num_splits(1, 10**6, 132, 16) == 1


# ---------------------------------------------------------------- Triton kernel (interpreter)


@pytest.fixture(scope="module")
def triton_interpret():
    """Skip unless this process runs Triton in the interpreter (see the module docstring)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of "
                    "test_triton_decode_kernel_subprocess")
    from fxshard.kernels.triton_decode import interpreting
    assert interpreting(), "TRITON_INTERPRET=1 was set after triton was imported"


def test_triton_decode_kernel_subprocess():
    """Run the test_triton_interp_* tests in a TRITON_INTERPRET=1 process; all must pass (the
    bf16 one is an expected failure of Triton's interpreter)."""
    run_interpreter_tests(__file__, min_passed=11, xfailed=1)


# (B, Hq, Hkv, Sq, L, D, lengths, causal, n_splits): GQA groups 1/2/4/24 (24 x 3 rows: two
# row blocks), Sq 1 and 3, lengths 0, 1, L and uneven, several splits (some past every length),
# one split, head dims 8 and 24 (padded to 16 and 32 in the kernel)
INTERP_CASES = [
    (3, 4, 1, 1, 37, 24, [37, 0, 19], True, None),
    (2, 4, 2, 3, 45, 32, [1, 45], True, 3),
    (2, 2, 2, 3, 33, 8, [2, 30], False, 4),
    (1, 8, 2, 3, 20, 16, [20], True, 1),
    (1, 24, 1, 3, 18, 16, [17], True, 2),
]


@pytest.mark.parametrize("batch, heads_q, heads_kv, seq_q, capacity, head_dim, lengths, "
                         "causal, n_splits", INTERP_CASES)
def test_triton_interp_matches_reference(triton_interpret, batch, heads_q, heads_kv, seq_q,
                                         capacity, head_dim, lengths, causal, n_splits):
    from fxshard.kernels.triton_decode import decode_fwd

    q, k, v = make_inputs(batch, heads_q, heads_kv, seq_q, capacity, head_dim, seed=capacity)
    lengths = torch.tensor(lengths)
    out, lse = decode_fwd(q, k, v, lengths, scale=0.3, causal=causal, n_splits=n_splits)
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=causal, scale=0.3)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


# MLA-style caches: v's head size differs from q/k's (both padded in the kernel)
MLA_CASES = [(2, 4, 2, 1, 37, 24, 16, [37, 5], True, 3), (1, 4, 1, 3, 20, 16, 40, [20], True, 1)]


@pytest.mark.parametrize("batch, heads_q, heads_kv, seq_q, capacity, head_dim, head_dim_v, "
                         "lengths, causal, n_splits", MLA_CASES)
def test_triton_interp_value_head_size_differs(triton_interpret, batch, heads_q, heads_kv,
                                               seq_q, capacity, head_dim, head_dim_v, lengths,
                                               causal, n_splits):
    from fxshard.kernels.triton_decode import decode_fwd

    q, k, _ = make_inputs(batch, heads_q, heads_kv, seq_q, capacity, head_dim, seed=capacity)
    v = torch.randn(batch, heads_kv, capacity, head_dim_v, generator=torch.Generator()
                    .manual_seed(1))
    lengths = torch.tensor(lengths)
    out, lse = decode_fwd(q, k, v, lengths, scale=0.3, causal=causal, n_splits=n_splits)
    assert out.shape == (batch, heads_q, seq_q, head_dim_v)
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=causal, scale=0.3)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


@pytest.mark.parametrize("causal, lengths, n_splits", [(True, [37, 4], 3), (False, [20, 0], 1)])
def test_triton_interp_soft_cap(triton_interpret, causal, lengths, n_splits):
    """Gemma-2's soft-cap of the scaled scores, with scores large enough (x4) to bend the
    tanh at cap 2: the kernel equals the capped reference (and differs from the uncapped)."""
    from fxshard.kernels.triton_decode import decode_fwd

    q, k, v = make_inputs(2, 4, 2, 2, 37, 16, seed=7)
    lengths = torch.tensor(lengths)
    out, lse = decode_fwd(4 * q, k, v, lengths, scale=0.3, causal=causal, softcap=2.0,
                          n_splits=n_splits)
    ref_out, ref_lse = reference_decode(4 * q, k, v, lengths, causal=causal, scale=0.3,
                                        softcap=2.0)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)
    assert (out - decode_fwd(4 * q, k, v, lengths, scale=0.3, causal=causal)[0]).abs().max() > .1


def test_triton_interp_every_length(triton_interpret):
    """One sequence per length 0..L (L = 24, 16-key blocks, two splits of 16 keys), causal with
    3 queries: the mask-free loop's end, the causal corner and the split edge are exact to the
    key."""
    from fxshard.kernels.triton_decode import decode_fwd

    q, k, v = make_inputs(25, 2, 1, 3, 24, 16, seed=3)
    lengths = torch.arange(25)
    out, lse = decode_fwd(q, k, v, lengths, scale=0.3, causal=True, n_splits=2)
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=True, scale=0.3)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)


def test_triton_interp_layouts_and_merge(triton_interpret):
    """A [B, L, Hkv, D] cache viewed as [B, Hkv, L, D] (strided), int32 lengths, a 32-key
    block; and two pieces of the cache merged by logsumexp equal the whole."""
    q, _, _ = make_inputs(2, 4, 2, 1, 40, 16, seed=5)
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(2, 40, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(2, 40, 2, 16, generator=gen).transpose(1, 2)
    lengths = torch.tensor([40, 23], dtype=torch.int32)
    out, lse = decode_attention(q, k, v, lengths, backend="triton")
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=True)
    assert_matches(out, lse, ref_out, ref_lse, tol=1e-4)
    from fxshard.kernels.triton_decode import decode_fwd
    out, lse = decode_fwd(q, k, v, lengths, scale=0.25, causal=True, block_n=32, n_splits=2)
    assert_matches(out, lse, *reference_decode(q, k, v, lengths, causal=True, scale=0.25),
                   tol=1e-4)
    cut = 16
    past = decode_attention(q, k[:, :, :cut], v[:, :, :cut], lengths.clamp(max=cut),
                            causal=False, backend="triton")
    rest = decode_attention(q, k[:, :, cut:], v[:, :, cut:], lengths - cut, backend="triton")
    assert_matches(*merge_attention(*past, *rest), ref_out, ref_lse, tol=1e-4)



@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3),
                                        pytest.param(torch.bfloat16, 1.5e-2, marks=BF16_DOT_BUG)])
def test_triton_interp_low_precision(triton_interpret, dtype, tol):
    q, k, v = make_inputs(2, 4, 2, 1, 35, 32, seed=9, dtype=dtype)
    lengths = torch.tensor([35, 12])
    out, lse = decode_attention(q, k, v, lengths, backend="triton")
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = reference_decode(q, k, v, lengths, causal=True)
    assert_matches(out, lse, ref_out, ref_lse, tol=tol)


def test_triton_interp_empty_shapes(triton_interpret):
    q, k, v = make_inputs(2, 2, 1, 1, 0, 16)
    out, lse = decode_attention(q, k, v, torch.tensor([0, 0]), backend="triton")
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    q, k, v = make_inputs(2, 2, 1, 0, 8, 16)
    out, lse = decode_attention(q, k, v, torch.tensor([3, 8]), backend="triton")
    assert out.shape == q.shape and lse.shape == (2, 2, 0)


# ---------------------------------------------------------------- sm_90 compilation


def test_triton_decode_compiles_for_hopper():
    """The interpreter is lenient about types and layouts: compile the split kernel (bf16,
    D=128, the benchmark's shape) and the merge kernel for sm_90 without a GPU."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton was imported in interpreter mode")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this triton version moved its compiler API: {err}")
    from fxshard.kernels import triton_decode

    block_n, num_warps, num_stages = triton_decode._GPU_CONFIGS[2][128]
    constexprs = {"HEAD_DIM": 128, "BLOCK_D": 128, "HEAD_DIM_V": 128, "BLOCK_DV": 128,
                  "BLOCK_M": 16, "BLOCK_N": block_n,
                  "CAUSAL": True, "INPUT_PRECISION": "tf32", "stride_qk": 1, "stride_kk": 1,
                  "stride_vk": 1, "stride_pk": 1, "stride_ls": 1}
    kernel = triton_decode._decode_split
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Lengths": "*i64",
                "OutPart": "*fp32", "LsePart": "*fp32"}
    signature, aligned = {}, []
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            aligned.append(index)
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith(("stride", "CAPACITY", "SPLIT")):
                aligned.append(index)
    source = ASTSource(kernel, signature, constexprs,
                       {(index,): [["tt.divisibility", 16]] for index in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "mma.sync" in ptx and "cp.async" in ptx and ".local" not in ptx   # no spills

    merge = triton_decode._decode_merge
    constexprs = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 64, "CHUNK_S": 16, "stride_pk": 1,
                  "stride_ls": 1, "stride_ok": 1}
    signature = {name: "constexpr" if name in constexprs else
                 "*bf16" if name == "Out" else "*fp32" if name[0].isupper() and
                 name not in ("H_Q", "SEQ_Q", "N_SPLITS") else "i32"
                 for name in merge.arg_names}
    compiled = triton.compile(ASTSource(merge, signature, constexprs, {}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert ".local" not in compiled.asm["ptx"]


# ---------------------------------------------------------------- benchmark report


def _load_benchmark():
    path = REPO / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("fxshard_decode_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_report_on_fake_timings():
    bench = _load_benchmark()
    case = {"batch": 8, "keys": 32768, "itemsize": 2}
    assert bench.kv_bytes(case) == 2 * 8 * 8 * 32768 * 128 * 2
    # 1 GiB of K+V in 250 us is 4295 GB/s, 89.5 % of 4.8 TB/s
    row = dict(case, ours_us=250.0, ours_eager_us=270.0, flash_us=None, cudnn_us=300.0,
               cudnn_max_err=1e-3)
    for name in ("ours", "flash", "cudnn"):
        row[f"{name}_gbps"] = bench.gbps(case, row[f"{name}_us"])
    row["ours_pct_h200"] = 100 * row["ours_gbps"] * 1e9 / bench.H200_BANDWIDTH
    table = bench.format_table([row, dict(row, batch=1, keys=4096)])
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert "4295.0" in lines[2] and "89.5" in lines[2] and "3579.1" in lines[2]
    assert "flash us" in lines[0] and "sdpa" not in lines[0]


def test_benchmark_runs_on_cpu(tmp_path, capsys):
    bench = _load_benchmark()
    out = tmp_path / "decode.json"
    assert bench.main(["--device", "cpu", "--batch", "2", "--keys", "48", "--reps", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["batch"] == 2 and row["keys"] == 48 and row["dtype"] == "float32"
    assert row["ours_us"] > 0 and row["sdpa_us"] > 0 and row["sdpa_max_err"] < 1e-5
    assert row["ours_pct_h200"] is None and data["environment"]["head_dim"] == 128
    assert "sdpa us" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert bench.main(["--json", str(tmp_path / "b.json")]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out
        assert not (tmp_path / "b.json").exists()


def test_gpu_check_decode_dry_run(capsys):
    """benchmarks/gpu_check.py's decode check, on the CPU (the torch path vs its float64
    reference): the prepared GPU script's code runs and its reference agrees."""
    spec = importlib.util.spec_from_file_location("fxshard_gpu_check",
                                                  REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.decode_checks("cpu")
    assert "PASS decode_attention(backend='torch') on cpu" in capsys.readouterr().out
    q, k, v = make_inputs(2, 4, 2, 3, 9, 8, seed=4)
    lengths = torch.tensor([9, 2])
    want = reference_decode(q, k, v, lengths, causal=True)
    got = module.decode_reference(q, k, v, lengths, True)
    assert_matches(got[0].float(), got[1].float(), *want, tol=1e-6)
