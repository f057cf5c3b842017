"""Sharding rules, one op family at a time: hypothesis draws a mesh, input placements and
sizes (uneven ones too); every rank's local result must be its block of the global result,
checked by a plain loop over mesh coordinates (``fxshard.testing.assemble_check``). Inputs a
rule cannot take as they are are redistributed by the inserted collectives first, so the
property covers rule + redistribution together."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, strategies as st

from fxshard.mesh import MeshSpec
from fxshard.placement import Partial, Replicate, Shard, local_block, local_shape
from fxshard.testing import assemble_check, run_sharded


@st.composite
def meshes(draw):
    names = draw(st.sampled_from([("dp",), ("tp",), ("dp", "tp"), ("tp", "ulysses_cp")]))
    shape = tuple(draw(st.integers(1, 3)) for _ in names)
    assume(1 < __import__("math").prod(shape) <= 6)
    return MeshSpec(shape, names)


def placements(ndim, *, partial=True):
    """Shards and partials drawn more often than Replicate: they are what rules get wrong."""
    opts = [Shard(d) for d in range(ndim)] + ([Partial()] * 2 if partial else []) + [Replicate()]
    return st.sampled_from(opts)


def specs(draw, mesh, ndim, partial=False):
    return tuple(draw(placements(ndim, partial=partial)) for _ in mesh.shape)


def fit(shape, spec, mesh):
    """``spec`` with the shards that do not divide ``shape`` evenly replaced by Replicate."""
    out = list(spec)
    for i in range(len(out)):
        try:
            local_shape(shape, tuple(out[: i + 1]) + (Replicate(),) * (len(out) - i - 1), mesh)
        except ValueError:
            out[i] = Replicate()
    return tuple(out)


def check(fn, inputs, mesh, in_specs, *, tol=1e-5):
    """Run sharded; compare every output block with the slice of the global result."""
    in_specs = [fit(x.shape, s, mesh) for x, s in zip(inputs, in_specs)]
    want = fn(*inputs)
    wants = list(want) if isinstance(want, (tuple, list)) else [want]
    try:
        outs, out_specs, _ = run_sharded(fn, inputs, mesh, in_specs)
    except ValueError as e:
        # the inputs divide evenly, so a rule may only refuse heads it cannot split
        assert "cannot be split" in str(e) or "neither split nor replicated" in str(e), e
        assume(False)
        return
    for k, w in enumerate(wants):
        assemble_check(w, [o[k] for o in outs], out_specs[k], mesh, rtol=tol, atol=tol)


dims = st.sampled_from([1, 2, 3, 4, 5, 6, 12])


@pytest.mark.parametrize("op", ["add", "mul", "silu_mul", "div", "scalar_add", "neg_sub"])
@given(data=st.data())
def test_pointwise_broadcast(op, data):
    mesh = data.draw(meshes())
    b, s, h = data.draw(dims), data.draw(dims), data.draw(dims)
    x = torch.randn(b, s, h)
    y = torch.randn(*data.draw(st.sampled_from([(h,), (1, s, 1), (b, s, h), (s, 1)])))
    sx = specs(data.draw, mesh, 3, partial=True)
    sy = specs(data.draw, mesh, y.dim(), partial=True)
    fns = {"add": lambda a, c: a + c, "mul": lambda a, c: a * c,
           "silu_mul": lambda a, c: F.silu(a) * c, "div": lambda a, c: a / (c.abs() + 1),
           "scalar_add": lambda a, c: (a + 1.0) * c, "neg_sub": lambda a, c: -a - c}
    check(fns[op], (x, y), mesh, [sx, sy])


@pytest.mark.parametrize("op", ["sum", "mean", "amax", "softmax", "rms"])
@given(data=st.data())
def test_reductions(op, data):
    mesh = data.draw(meshes())
    x = torch.randn(data.draw(dims), data.draw(dims), data.draw(dims))
    sx = specs(data.draw, mesh, 3, partial=True)
    dim = data.draw(st.integers(-3, 2))
    keep = data.draw(st.booleans())
    fns = {"sum": lambda a: a.sum(dim, keepdim=keep), "mean": lambda a: a.mean(dim, keepdim=keep),
           "amax": lambda a: a.amax(dim, keepdim=keep), "softmax": lambda a: a.softmax(dim),
           "rms": lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)}
    check(fns[op], (x,), mesh, [sx])


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("op", ["sum", "mean", "amax"])
@pytest.mark.parametrize("names,shape", [(("tp",), (2,)), (("dp", "tp"), (2, 3))],
                         ids=["tp2", "dp2xtp3"])
def test_reduction_over_the_sharded_dim(names, shape, op, dim, keep):
    """The reduced dim itself sharded on every axis (the random draws above rarely get there
    with sizes that divide): the local result is a partial sum, a partial mean or a max."""
    mesh = MeshSpec(shape, names)
    x = torch.randn(6, 12, 6)
    spec = tuple(Shard(dim % 3) for _ in names)
    assert local_shape(x.shape, spec, mesh)  # it divides: the shard is kept, not fitted away
    fns = {"sum": lambda a: a.sum(dim, keepdim=keep), "mean": lambda a: a.mean(dim, keepdim=keep),
           "amax": lambda a: a.amax(dim, keepdim=keep)}
    check(fns[op], (x,), mesh, [spec])


@pytest.mark.parametrize("op", ["heads", "heads_back", "permute", "unsqueeze_expand", "slice",
                                "cat", "split", "flatten"])
@given(data=st.data())
def test_views(op, data):
    mesh = data.draw(meshes())
    b, s, hh, d = (data.draw(st.integers(1, 4)) for _ in range(4))
    x = torch.randn(b, s, hh * d)
    sx = specs(data.draw, mesh, 3, partial=True)
    fns = {
        "heads": lambda a: a.view(b, s, hh, d).transpose(1, 2),
        "heads_back": lambda a: a.view(b, s, hh, d).transpose(1, 2).transpose(1, 2)
        .reshape(b, s, -1),
        "permute": lambda a: a.permute(2, 0, 1).contiguous(),
        "unsqueeze_expand": lambda a: a.unsqueeze(2).expand(b, s, 3, hh * d).reshape(b, s * 3, -1),
        "slice": lambda a: a[:, :, : max(1, (hh * d) // 2)] * 2,
        "cat": lambda a: torch.cat([-a, a], dim=-1),
        "split": lambda a: a.split(1, dim=1)[0] + 1,
        "flatten": lambda a: a.flatten(0, 1),
    }
    check(fns[op], (x,), mesh, [sx])


@pytest.mark.parametrize("op", ["linear", "linear_bias", "matmul", "bmm"])
@given(data=st.data())
def test_linear_and_matmul(op, data):
    mesh = data.draw(meshes())
    b, s, k, n = (data.draw(dims) for _ in range(4))
    x, w, bias = torch.randn(b, s, k), torch.randn(n, k), torch.randn(n)
    sx = specs(data.draw, mesh, 3, partial=True)
    sw = specs(data.draw, mesh, 2)
    if op == "linear":
        check(lambda a, c: F.linear(a, c), (x, w), mesh, [sx, sw])
    elif op == "linear_bias":
        check(lambda a, c, e: F.linear(a, c, e), (x, w, bias), mesh, [sx, sw, specs(
            data.draw, mesh, 1)])
    elif op == "matmul":
        check(lambda a, c: a @ c.t(), (x, w), mesh, [sx, sw])
    else:
        y = torch.randn(b, k, n)
        check(torch.bmm, (x, y), mesh, [sx, specs(data.draw, mesh, 3, partial=True)])


@given(st.data())
def test_embedding(data):
    mesh = data.draw(meshes())
    v, e = data.draw(st.integers(2, 8)), data.draw(dims)
    ids = torch.randint(0, v, (data.draw(dims), data.draw(dims)))
    w = torch.randn(v, e)
    check(lambda i, t: F.embedding(i, t), (ids, w), mesh,
          [specs(data.draw, mesh, 2), specs(data.draw, mesh, 2)])


@given(st.data())
def test_attention(data):
    mesh = data.draw(meshes())
    b, hkv, g, s, d = (data.draw(st.integers(1, 3)) for _ in range(5))
    q = torch.randn(b, hkv * g, s, 4 * d)
    k, v = torch.randn(b, hkv, s + 1, 4 * d), torch.randn(b, hkv, s + 1, 4 * d)
    causal = data.draw(st.booleans())
    ss = [specs(data.draw, mesh, 4) for _ in range(3)]

    def fn(a, c, e):
        return F.scaled_dot_product_attention(a, c, e, is_causal=causal, enable_gqa=g > 1)
    check(fn, (q, k, v), mesh, ss)


@given(st.data())
def test_factory_and_positions(data):
    mesh = data.draw(meshes())
    b, s = data.draw(dims), data.draw(dims)
    x = torch.randn(b, s, 4)
    sx = specs(data.draw, mesh, 3)

    def fn(a):
        pos = torch.arange(a.shape[1], dtype=a.dtype)
        return a * torch.cos(pos)[None, :, None] + torch.zeros_like(a)
    check(fn, (x,), mesh, [sx])


def test_fallback_op_is_replicated_with_warning_and_strict_errors():
    mesh = MeshSpec((2,), ("tp",))
    x = torch.randn(4, 6)

    def fn(a):        # an op with no rule (flip got one)
        return torch.logcumsumexp(a, dim=1) * 2
    with pytest.warns(UserWarning, match="no sharding rule"):
        outs, out_specs, c = run_sharded(fn, (x,), mesh, [(Shard(1),)])
    assemble_check(fn(x), [o[0] for o in outs], out_specs[0], mesh)
    assert any("logcumsumexp" in f for f in c.ctx.fallbacks)
    with pytest.raises(NotImplementedError, match="no sharding rule for aten.logcumsumexp"):
        run_sharded(fn, (x,), mesh, [(Shard(1),)], strict=True)


def test_local_block_partial_sums_to_global():
    mesh = MeshSpec((2, 3), ("dp", "tp"))
    x = torch.randn(4, 6)
    blocks = [local_block(x, (Shard(0), Partial()), mesh, r) for r in range(6)]
    assert torch.equal(blocks[0] + blocks[1] + blocks[2], x[:2])


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@given(data=st.data())
def test_norms(norm, data):
    mesh = data.draw(meshes())
    x = torch.randn(data.draw(dims), data.draw(dims), 6)
    w, b = torch.randn(6), torch.randn(6)
    sx = specs(data.draw, mesh, 3, partial=True)
    if norm == "layer_norm":
        check(lambda a, c, e: F.layer_norm(a, (6,), c, e), (x, w, b), mesh,
              [sx, specs(data.draw, mesh, 1), specs(data.draw, mesh, 1)])
    else:
        check(lambda a, c: F.rms_norm(a, (6,), c, 1e-6), (x, w), mesh,
              [sx, specs(data.draw, mesh, 1)])
