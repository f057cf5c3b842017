"""Context parallelism: Ulysses (all-to-all to heads around attention) and ring attention
(K/V chunks passed around the axis, merged by logsumexp), alone and combined with dp, tp, pp,
against the single-device model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import fxshard
import fxshard.ops.ring  # noqa: F401  (registers fxshard::ring_attention)
from fxshard.kernels.attention import attention
from fxshard.mesh import MeshSpec
from fxshard.runtime.simulated import SimulatedWorld
from tests.models import hf_llama, our_llama, model_cache

TOL = dict(rtol=1e-4, atol=1e-4)
# the mesh families below parallelize each model over many meshes: built and exported once
# each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
built = model_cache()   # each model built once for this module


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,hq,hkv,s", [(2, 4, 2, 6), (4, 2, 1, 8), (3, 3, 3, 9)])
def test_ring_attention_op_matches_full_attention(n, hq, hkv, s, causal):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, h, s, 8, generator=g) for h in (hq, hkv, hkv))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    world = MeshSpec((n,), ("ring_cp",))
    chunk = s // n

    def rank(r):
        sl = slice(r * chunk, (r + 1) * chunk)
        out, lse = torch.ops.fxshard.ring_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                    causal, None, "ring_cp", n)
        return out
    with SimulatedWorld(world) as w:
        outs = w.run(rank)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, **TOL)


def _rows(t: torch.Tensor, j: int, n: int, zigzag: bool) -> torch.Tensor:
    """Ring rank j's sequence rows (dim 2): chunk j of n, or chunks j and 2n-1-j of 2n."""
    if not zigzag:
        return t.chunk(n, dim=2)[j]
    pieces = t.chunk(2 * n, dim=2)
    return torch.cat([pieces[j], pieces[2 * n - 1 - j]], dim=2)


def _usp_rows(t: torch.Tensor, j: int, n: int, zigzag: bool, segments: int) -> torch.Tensor:
    """Ring rank j's rows when the sequence is ``segments`` parts (USP: one per Ulysses
    coordinate), each laid out over the ring like a whole sequence."""
    return torch.cat([_rows(p, j, n, zigzag) for p in t.chunk(segments, dim=2)], dim=2)


@given(n=st.sampled_from([2, 3]), zigzag=st.booleans(), is_bool=st.booleans(),
       shape=st.sampled_from(["11SS", "B1SS", "BHSS", "SS", "B11S"]), seed=st.integers(0, 99),
       segments=st.sampled_from([1, 2, 3]), causal=st.booleans())
def test_ring_attention_with_a_mask_matches_the_whole_attention(n, zigzag, is_bool, shape, seed,
                                                                segments, causal):
    """A mask sharded by query rows like q (zigzag or contiguous; in ``segments`` parts as USP
    lays it out), all key columns: each ring step slices the visiting chunk's columns. Bool
    masks include fully masked rows (out 0, as the unsharded kernel); float masks are a bias
    (checked against torch SDPA too)."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s = 2, 4, 2, 2 * n * 3 * segments
    q, k, v = (torch.randn(b, h, s, 8, generator=g) for h in (hq, hkv, hkv))
    full = {"11SS": (1, 1, s, s), "B1SS": (b, 1, s, s), "BHSS": (b, hq, s, s), "SS": (s, s),
            "B11S": (b, 1, 1, s)}[shape]
    if is_bool:
        mask = torch.rand(full, generator=g) < 0.6
        if shape != "B11S":
            mask[..., 1, :] = False  # a row that sees no key
    else:
        mask = torch.randn(full, generator=g) * 3
    want, _ = attention(q, k, v, mask=mask, causal=causal, backend="torch")
    if not is_bool and not causal:
        torch.testing.assert_close(want, F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True), **TOL)
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))

    def local(t, j):
        return _usp_rows(t, j, n, zigzag, segments)

    def rank(j):
        m = mask if mask4.shape[2] == 1 else local(mask4, j)
        m = m.reshape(m.shape[-mask.dim():])  # a 2-D mask stays 2-D
        out, _ = torch.ops.fxshard.ring_attention(
            local(q, j), local(k, j), local(v, j), causal, None, "ring_cp", n, segments,
            s // segments, zigzag, -1, 0.0, m)
        return out
    with SimulatedWorld(MeshSpec((n,), ("ring_cp",))) as w:
        outs = w.run(rank)
    for j in range(n):
        torch.testing.assert_close(outs[j], local(want, j), **TOL)


def test_ring_attention_mask_of_the_wrong_width_is_a_value_error():
    q = torch.randn(1, 2, 4, 8)

    def rank(j):
        torch.ops.fxshard.ring_attention(q, q, q, False, None, "ring_cp", 2, 1, 0, False, -1,
                                         0.0, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with SimulatedWorld(MeshSpec((2,), ("ring_cp",))) as w, pytest.raises(
            ValueError, match=r"fxshard.ring_attention on axis 'ring_cp' \(size 2\): mask of "
                              r"shape \(1, 1, 4, 4\) must be .* all 8 key columns"):
        w.run(rank)


CASES = [dict(ulysses_cp=2), dict(ring_cp=2), dict(ring_cp=4), dict(tp=2, ulysses_cp=2),
         dict(tp=2, ring_cp=2), dict(ulysses_cp=2, ring_cp=2), dict(dp=2, ring_cp=2),
         dict(pp=2, ring_cp=2), dict(dp=2, tp=2, pp=2, ulysses_cp=2),
         dict(tp=2, ulysses_cp=2, ring_cp=2), dict(ulysses_cp=2, ring_cp=4)]


@pytest.mark.parametrize("axes", CASES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_our_llama_context_parallel(axes):
    model = built(our_llama, num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = fxshard.parallelize(model, mesh(**axes))
    torch.testing.assert_close(pm(ids), model(ids), **TOL)


@pytest.mark.parametrize("axes", CASES[:6], ids=lambda a: "x".join(f"{k}{v}"
                                                                    for k, v in a.items()))
def test_hf_llama_context_parallel(axes):
    model = built(hf_llama, layers=2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = fxshard.parallelize(model, mesh(**axes))
    torch.testing.assert_close(pm(ids).logits, model(ids).logits, **TOL)


def test_ulysses_four_all_to_alls_per_layer():
    ids = torch.randint(0, 128, (2, 8))
    counts = {}
    for layers in (1, 3):
        model = our_llama(num_hidden_layers=layers, num_key_value_heads=4)
        pm = fxshard.parallelize(model, mesh(ulysses_cp=2), example_inputs=(ids,))
        counts[layers] = pm.explain().counts(0)
    assert counts[3] - counts[1] == {("all_to_all", "ulysses_cp"): 8}


def test_ring_sends_no_activation_collectives_per_layer():
    ids = torch.randint(0, 128, (2, 8))
    counts = {}
    for layers in (1, 3):
        model = our_llama(num_hidden_layers=layers)
        pm = fxshard.parallelize(model, mesh(ring_cp=4), example_inputs=(ids,))
        counts[layers] = pm.explain().counts(0)
        code = pm.rank_module(0).code
        assert code.count("torch.ops.fxshard.ring_attention") == layers
    # besides the ring steps inside the attention op, only the final output gather
    assert counts[3] - counts[1] == {("ring_attention", "ring_cp"): 2}
    assert counts[1] == {("ring_attention", "ring_cp"): 1, ("zigzag_gather", "ring_cp"): 1}


def test_ulysses_heads_must_divide():
    model = our_llama(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      hidden_size=32, head_dim=16)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(ValueError, match=r"ulysses_cp.*Ulysses splits heads"):
        fxshard.parallelize(model, mesh(tp=2, ulysses_cp=2), example_inputs=(ids,))


def test_sequence_not_divisible_by_ring_is_a_value_error():
    model = our_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (1, 6))
    with pytest.raises(ValueError, match=r"ring_cp shards the sequence zigzag.*has 6 elements"
                                         r".*divides by 8.*ring_zigzag=False"):
        fxshard.parallelize(model, mesh(ring_cp=4))(ids)
    with pytest.raises(ValueError, match=r"dim 1 over mesh axis 'ring_cp' of size 4"):
        fxshard.parallelize(model, mesh(ring_cp=4), ring_zigzag=False)(ids)
    pm = fxshard.parallelize(model, mesh(ring_cp=3), ring_zigzag=False)  # 6 = 3 x 2
    torch.testing.assert_close(pm(ids), model(ids), **TOL)


@pytest.mark.parametrize("n", [2, 3])
def test_zigzag_layout_round_trip_and_balance(n):
    """Rank j holds chunks j and 2n-1-j; gathering restores the order; every rank's causal
    work (visible query-key pairs) is the same."""
    import fxshard.ops.local  # noqa: F401
    x = torch.arange(2 * n * 3 * 2, dtype=torch.float32).view(2, 2 * n * 3)
    with SimulatedWorld(MeshSpec((n,), ("ring_cp",))) as w:
        parts = w.run(lambda r: torch.ops.fxshard.zigzag_shard(x, 1, "ring_cp", n))
        back = w.run(lambda r: torch.ops.fxshard.zigzag_gather(parts[r], 1, "ring_cp", n))
    chunks = x.chunk(2 * n, 1)
    for j in range(n):
        assert torch.equal(parts[j], torch.cat([chunks[j], chunks[2 * n - 1 - j]], 1))
        assert torch.equal(back[j], x)
    work = [sum(int(p) + 1 for p in parts[j][0] - 0) for j in range(n)]  # positions + 1
    assert len(set(work)) == 1, work


def test_ring_without_zigzag_matches_too():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(ring_cp=4), ring_zigzag=False)
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    assert "zigzag" not in pm.rank_module(0).code


@pytest.mark.parametrize("kv,axes", [(1, dict(tp=2, ulysses_cp=2)), (1, dict(tp=4, ulysses_cp=2)),
                                     (2, dict(ulysses_cp=4)), (2, dict(ulysses_cp=2, tp=2)),
                                     (1, dict(ulysses_cp=2, tp=4)), (2, dict(ulysses_cp=2, tp=4))],
                         ids=lambda x: str(x))
def test_kv_heads_replicated_over_tp_and_ulysses(kv, axes):
    model = built(our_llama, num_hidden_layers=1, num_key_value_heads=kv, num_attention_heads=8,
                  head_dim=8)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(**axes))
    torch.testing.assert_close(pm(ids), model(ids), **TOL)


def test_explain_counts_ring_bytes():
    """Ring traffic per layer is 2(p-1)/p * b*s*h_kv*B (K and V, each p-1 chunk steps)."""
    model = our_llama(num_hidden_layers=2)   # 2 KV heads of 16: h_kv = 32
    ids = torch.randint(0, 128, (2, 8))
    p = 4
    ex = fxshard.parallelize(model, mesh(ring_cp=p), example_inputs=(ids,)).explain()
    ring = [c for c in ex.collectives[0] if c.op == "ring_attention"]
    assert len(ring) == 2
    b, s, h_kv, nbytes = 2, 8, 32, 4
    assert all(c.wire_bytes == 2 * (p - 1) * b * s * h_kv * nbytes // p for c in ring)


def test_usp_ulysses_inside_ring_outside():
    """Both CP axes: per layer 4 all-to-alls on ulysses_cp around one ring attention, and no
    gathers of activations on either axis (only the final output)."""
    ids = torch.randint(0, 128, (2, 8))
    counts = {}
    for layers in (1, 2):
        model = our_llama(num_hidden_layers=layers, num_key_value_heads=4)
        pm = fxshard.parallelize(model, mesh(ulysses_cp=2, ring_cp=2))
        torch.testing.assert_close(pm(ids), model(ids), **TOL)
        counts[layers] = pm.explain().counts(0)
    assert counts[2] - counts[1] == {("all_to_all", "ulysses_cp"): 4,
                                     ("ring_attention", "ring_cp"): 1}


class _BiasedAttention(torch.nn.Module):
    """Two attention layers sharing one mask computed from the sequence-sharded activations,
    ``bias[b, h, i, j] = a[b, h, i] * c[b, h, j]`` (per head, or one for all heads): the mask
    arrives sharded by rows (not a slice of a whole one), so USP must move its rows."""

    def __init__(self, per_head: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.ac = torch.nn.Linear(32, 8 if per_head else 2)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 96) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        b, s, _ = x.shape
        a, c = self.ac(x).view(b, s, 2, -1).unbind(2)
        bias = a.transpose(1, 2)[..., None] * c.transpose(1, 2)[:, :, None, :]
        for layer in self.qkv:
            q, k, v = layer(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = x + o.transpose(1, 2).reshape(b, s, 32)
        return x


@pytest.mark.parametrize("per_head,order,zigzag", [
    (True, ("ulysses_cp", "ring_cp"), True), (False, ("ring_cp", "ulysses_cp"), False)],
    ids=["per_head-u2r2", "broadcast-r2u2-contiguous"])
def test_usp_moves_a_sharded_mask_once_for_all_layers(per_head, order, zigzag):
    """A mask computed sharded by rows: USP trades its rows for heads (all-to-all, like q) or
    gathers them (heads broadcast) on ulysses_cp, once for both layers; ring attention gets
    it (segments 2 or 1), strict=True accepts it and the values equal one device."""
    model = _BiasedAttention(per_head).eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", (2, 2),
                                                             mesh_dim_names=order),
                             strict=True, ring_zigzag=zigzag)
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), model(ids), **TOL)
    lines = pm.rank_module(0).code.splitlines()
    calls = [ln for ln in lines if "fxshard.ring_attention.default(" in ln]
    masks = {c.split("(")[1].split(")")[0].split(", ")[-1] for c in calls}
    exchange = "all_to_all" if per_head else "all_gather"
    assert len(calls) == 2 and len(masks) == 1 and masks.pop().startswith(exchange), calls
    ulysses = [ln for ln in lines if "'ulysses_cp'" in ln and "fxshard.all_" in ln]
    # q, k, v, out: 4 all-to-alls a layer; all-gathers: the output, c (the mask's key
    # columns, whole); one exchange of the mask's rows
    assert sum("all_to_all" in ln for ln in ulysses) == 8 + per_head, ulysses
    assert sum("all_gather" in ln for ln in ulysses) == 2 + (not per_head), ulysses
    assert not pm.explain().gathered
    pm.close()


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("order", list(__import__("itertools").permutations(
    ("tp", "ulysses_cp", "ring_cp"))), ids="-".join)
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_usp_and_tp_in_any_mesh_order(order, kv, zigzag):
    """Axes nest in mesh order, so every order lays the sequence and heads out differently;
    USP must follow each (ulysses before or after ring) and KV heads each split."""
    model = built(our_llama, num_hidden_layers=1, num_key_value_heads=kv, num_attention_heads=8,
                  head_dim=8)
    ids = torch.randint(0, 128, (2, 16))
    m = fxshard.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=order)
    pm = fxshard.parallelize(model, m, ring_zigzag=zigzag)
    torch.testing.assert_close(pm(ids), model(ids), **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_segments(causal):
    """The USP layout: each ring rank holds one piece of the sequence from every Ulysses
    coordinate; piece t of ring rank j starts at t * stride + j * piece."""
    g = torch.Generator().manual_seed(3)
    n_ring, n_u, piece = 2, 3, 2
    s = n_ring * n_u * piece
    q, k, v = (torch.randn(1, 2, s, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    stride = s // n_u

    def local(t, j):
        return torch.cat([t[:, :, u * stride + j * piece:u * stride + (j + 1) * piece]
                          for u in range(n_u)], dim=2)

    def rank(j):
        out, _ = torch.ops.fxshard.ring_attention(local(q, j), local(k, j), local(v, j), causal,
                                                  None, "ring_cp", n_ring, n_u, stride)
        return out
    with SimulatedWorld(MeshSpec((n_ring,), ("ring_cp",))) as w:
        outs = w.run(rank)
    for j in range(n_ring):
        torch.testing.assert_close(outs[j], local(want, j), **TOL)
