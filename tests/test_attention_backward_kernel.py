"""The Triton attention backward (fxshard.kernels.triton_attention_bwd), its op
``fxshard::attention_backward`` and the CUDA training rewrite that puts the op in backward
rank programs (fxshard/training/cuda_attention.py).

Gradients are checked against autograd through ``reference_attention`` (float64, scores
materialised, K/V repeated per query head) for the loss ``sum(out * dout) + sum(lse * dlse)``.
The ``test_triton_interp_*`` tests run in a ``TRITON_INTERPRET=1`` subprocess
(``tests/triton_interp.py``), as the forward kernel's; bf16 ``tl.dot`` is an expected failure
of the interpreter (checked on a GPU by benchmarks/gpu_check.py). The rewrite is checked
without a GPU: programs built for a ``cuda`` mesh run on CPU tensors, where the op takes its
torch path.
"""
import dataclasses
import importlib.util
import math
import operator
import os
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from tests.test_attention_kernel import reference_attention
from tests.triton_interp import BF16_DOT_BUG, run_interpreter_tests

GRAD = True   # autograd computes the reference gradients

BWD_SCHEMA = ("fxshard::attention_backward(Tensor q, Tensor k, Tensor v, Tensor? mask, "
              "Tensor out, Tensor lse, Tensor dout, Tensor? dlse, bool causal, float? scale, "
              "SymInt q_offset, SymInt kv_offset, float softcap=0.) -> (Tensor, Tensor, Tensor)")


def _case(b, hq, hkv, sq, skv, d, dv, *, causal, q_offset=0, kv_offset=0, softcap=0.0,
          scale=0.3, dlse=True, dtype=torch.float32, seed=0):
    """Inputs, the forward's (out, lse) from the float64 reference, and the float64 gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) * (3.0 if softcap else 1.0)
    k, v = torch.randn(b, hkv, skv, d, generator=g), torch.randn(b, hkv, skv, dv, generator=g)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    opts = dict(causal=causal, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
                softcap=softcap or None)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, **opts)
    dout = torch.randn(ref_out.shape, generator=g).to(dtype)
    d_lse = torch.randn(ref_lse.shape, generator=g) if dlse else None
    loss = (ref_out * dout.double()).sum()
    if dlse:
        loss = loss + (torch.where(torch.isneginf(ref_lse), 0.0, ref_lse) * d_lse).sum()
    want = torch.autograd.grad(loss, leaves)
    out, lse = ref_out.detach().to(dtype), ref_lse.detach().float()
    return (q, k, v, out, dout, lse, d_lse), opts, want


def _assert_grads(got, want, tol):
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == w.shape and not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), w, rtol=tol, atol=tol, msg=name)


@pytest.fixture(scope="module")
def triton_interpret():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_triton_bwd_subprocess")
    from fxshard.kernels.triton_attention import interpreting
    assert interpreting(), "TRITON_INTERPRET=1 was set after triton was imported"


def test_triton_bwd_subprocess():
    """Run the test_triton_interp_* tests in a TRITON_INTERPRET=1 process."""
    run_interpreter_tests(__file__, min_passed=8, xfailed=1)


def _run_kernel(tensors, opts, config=None, grad_dtype=torch.float32):
    from fxshard.kernels.triton_attention_bwd import attention_bwd
    q, k, v, out, dout, lse, dlse = tensors
    return attention_bwd(q, k, v, out, dout, lse, causal=opts["causal"], scale=opts["scale"],
                         q_offset=opts["q_offset"], kv_offset=opts["kv_offset"],
                         softcap=opts["softcap"] or 0.0, dlse=dlse, grad_dtype=grad_dtype,
                         config=config)


# (B, Hq, Hkv, Sq, Skv, D, Dv), options; lengths are not multiples of the blocks
@pytest.mark.parametrize("shape, opts", [
    ((2, 2, 2, 33, 50, 16, 16), dict(causal=False, dlse=False)),
    ((1, 4, 2, 37, 29, 32, 16), dict(causal=True, q_offset=9, kv_offset=2)),
    ((1, 4, 1, 20, 27, 16, 32), dict(causal=True, kv_offset=20, softcap=2.0)),  # hidden rows
    ((1, 2, 1, 24, 24, 16, 16), dict(causal=True, softcap=0.5, scale=None)),
])
def test_triton_interp_matches_float64(triton_interpret, shape, opts):
    opts = dict(opts)
    if opts.get("scale", 0.3) is None:
        opts["scale"] = 1 / math.sqrt(shape[5])
    tensors, kw, want = _case(*shape, **opts)
    got = _run_kernel(tensors, kw)
    _assert_grads(got, want, 1e-4)
    if opts.get("kv_offset") == 20:   # rows 0..19 see no key: no gradient
        assert torch.count_nonzero(got[0][:, :, :20]) == 0


def test_triton_interp_causal_block_boundaries(triton_interpret):
    """Diagonal shifts around the block edges, with the GPU configs' unequal block shapes
    (BLOCK_M1 < BLOCK_N1, BLOCK_M2 > BLOCK_N2): the masked/mask-free loop splits of both
    kernels must be exact to the row and key."""
    for delta in (-17, -1, 0, 1, 16, 31):
        tensors, kw, want = _case(1, 2, 1, 40, 48, 16, 16, causal=True,
                                  q_offset=max(delta, 0), kv_offset=max(-delta, 0),
                                  seed=delta + 40)
        _assert_grads(_run_kernel(tensors, kw, config=(16, 32, 32, 16, 4, 1)), want, 1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2),
                                        pytest.param(torch.bfloat16, 6e-2, marks=BF16_DOT_BUG)])
def test_triton_interp_low_precision(triton_interpret, dtype, tol):
    tensors, kw, want = _case(1, 4, 2, 30, 41, 32, 32, causal=True, q_offset=11, dtype=dtype)
    got = _run_kernel(tensors, kw, grad_dtype=dtype)
    assert [g.dtype for g in got] == [dtype] * 3
    _assert_grads(got, want, tol)
    accumulated = _run_kernel(tensors, kw)          # the default: float32, as a ring sums them
    assert [g.dtype for g in accumulated] == [torch.float32] * 3
    _assert_grads(accumulated, want, tol)


def test_triton_interp_layouts_and_empty(triton_interpret):
    """Strided [B, S, H, D] inputs (the gradients keep their layout), and zero-length sides."""
    tensors, kw, want = _case(1, 4, 2, 19, 23, 16, 16, causal=False)
    q, k, v, out, dout, lse, dlse = tensors
    bshd = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, out, dout)]
    got = _run_kernel((*bshd, lse, dlse), kw)
    assert got[0].stride() == bshd[0].stride() and got[2].stride() == bshd[2].stride()
    _assert_grads(got, want, 1e-4)
    empty = torch.zeros(1, 2, 0, 16)
    dq, dk, dv = _run_kernel((empty, k, v, empty, empty, torch.zeros(1, 2, 0), None), kw)
    assert dq.shape == empty.shape and torch.equal(dk, torch.zeros_like(k))


def test_triton_bwd_compiles_for_hopper(causal=True, softcap=True):
    """Both kernels compile for sm_90 at bf16 D=128 with their launch options (no GPU
    needed): what the lenient interpreter does not see, and shared memory within 227 KiB."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton was imported in interpreter mode")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this triton version moved its compiler API: {err}")
    from fxshard.kernels import triton_attention_bwd as bwd

    m1, n1, m2, n2, warps, stages = bwd._GPU_CONFIGS[2][128]
    for kernel, bm, bn in ((bwd._attn_bwd_dkdv, m1, n1), (bwd._attn_bwd_dq, m2, n2)):
        constexprs = {"HEAD_DIM": 128, "HEAD_DIM_V": 128, "BLOCK_M": bm, "BLOCK_N": bn,
                      "CAUSAL": causal, "SOFTCAP": softcap, "INPUT_PRECISION": "tf32"}
        signature, aligned = {}, []
        for index, name in enumerate(kernel.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in ("Q", "K", "V", "DOut", "DQ", "DK", "DV"):
                signature[name] = "*bf16"
                aligned.append(index)
            elif name in ("Lse", "Delta"):
                signature[name] = "*fp32"
                aligned.append(index)
            elif name in ("qk_scale", "sm_scale", "cap_log2"):
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
                if name.startswith(("stride", "SEQ")):
                    aligned.append(index)
        source = ASTSource(kernel, signature, constexprs,
                           {(index,): [["tt.divisibility", 16]] for index in aligned})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        assert compiled.metadata.shared <= 227 * 1024
        assert "wgmma" in compiled.asm["ptx"]


def _gpu_check():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("fxshard_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_triton_interp_gpu_check_tables(triton_interpret, monkeypatch):
    """benchmarks/gpu_check.py's backward and MLA tables at a tiny CPU size, timings stubbed:
    rows, TFLOP/s, the error vs SDPA, and a failing part kept in its row."""
    check = _gpu_check()
    calls = []
    monkeypatch.setattr(check, "_bench", lambda fn: calls.append(fn()) or 2.0)
    rows = check.backward_table(seqs=(40,), tokens=40, hidden=32, head_dim=16, device="cpu",
                                dtype=torch.float32)
    assert [r["causal"] for r in rows] == [False, True] and len(calls) >= 4
    flops = check.backward_flops(1, 2, 40, 16, 16, True)
    assert flops == 2.5 * check.forward_flops(1, 2, 40, 16, 16, True) == 40 * 40 * 160   # 2 B H S^2 (3D + 2Dv) / 2
    assert rows[1]["ours_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert rows[1]["flash_ms"] == 2.0 and rows[1]["max_err"] < 1e-4   # CPU's flash backward
    assert "cudnn" in rows[1]["error"]                                  # none on CPU
    mla = check.mla_table(((24, 16, 40, True), (32, 16, 40, False)), batch=1, heads=2,
                          device="cpu", dtype=torch.float32)
    assert "head_dim is 24" in mla[0]["error"] and mla[1]["max_err"] < 1e-4
    lines = check.format_table(mla, check.MLA_COLUMNS).splitlines()
    assert len(lines) == 4 and len(lines[0]) == len(lines[1]) == len(lines[3])


def test_kernel_error_messages():
    bwd = pytest.importorskip("fxshard.kernels.triton_attention_bwd")
    tensors, kw, _ = _case(1, 2, 1, 5, 7, 16, 16, causal=True)
    q, k, v, out, dout, lse, dlse = tensors

    def call(**change):
        args = {**dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, dlse=dlse), **change}
        return bwd.attention_bwd(**args, causal=True, scale=0.3)
    with pytest.raises(ValueError, match=r"attention_bwd: got a mask of shape \(5, 7\), but the "
                                         r"Triton backward takes none"):
        call(mask=torch.ones(5, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"grad_dtype=torch.float64; expected one of"):
        bwd.attention_bwd(q, k, v, out, dout, lse, grad_dtype=torch.float64)
    cases = [
        (dict(lse=lse.double()), r"lse has dtype torch.float64; expected torch.float32"),
        (dict(dlse=dlse[..., :3]), r"dlse has shape \(1, 2, 3\), expected \[1, 2, 5\]"),
        (dict(out=out[..., :8]), r"out has shape \(1, 2, 5, 8\), expected \[1, 2, 5, 16\]"),
        (dict(k=torch.randn(1, 3, 7, 16), v=torch.randn(1, 3, 7, 16)),
         r"q has 2 heads, k has 3; Hq must be a multiple of Hkv"),
        (dict(v=v.half()), r"v has dtype torch.float16, q torch.float32; cast them"),
        (dict(q=q.double(), k=k.double(), v=v.double(), out=out.double(), dout=dout.double()),
         r"q has dtype torch.float64; the Triton backward supports torch.float16"),
        (dict(q=torch.randn(1, 2, 5, 24), k=torch.randn(1, 1, 7, 24)),
         r"head_dim is 24; the Triton backward supports head_dim in \{16, 32, 64, 128, 256\}"),
        (dict(q=q[0]), r"q has shape \(2, 5, 16\); expected 4 dims"),
    ]
    if not bwd.interpreting():
        cases.append((dict(), r"got tensors on cpu, but the Triton kernels run on CUDA only; "
                              r"set TRITON_INTERPRET=1"))
    for change, message in cases:
        with pytest.raises(ValueError, match=r"fxshard.kernels.triton_attention_bwd."
                                             r"attention_bwd: " + message):
            call(**change)


# ---------------------------------------------------------------- the op


def test_op_schema_torch_path_and_fake():
    """On CPU the op is the torch backward: the float64 gradients, each in its input's
    layout; the fake impl gives the same shapes and strides; opcheck passes."""
    op = torch.ops.fxshard.attention_backward.default
    assert str(op._schema) == BWD_SCHEMA
    tensors, kw, want = _case(2, 4, 2, 6, 9, 8, 12, causal=True, q_offset=3, softcap=1.5,
                              dtype=torch.float64)
    q, k, v, out, dout, lse, dlse = tensors
    q = q.transpose(1, 2).contiguous().transpose(1, 2)      # [B, S, H, D] storage
    args = (q, k, v, None, out, lse, dout, dlse, True, 0.3, 3, 0, 1.5)
    got = op(*args)
    _assert_grads(got, want, 1e-6)
    assert got[0].stride() == q.stride()
    fake = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert [(f.shape, f.stride()) for f in fake] == [(g.shape, g.stride()) for g in got]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(NotImplementedError, match=r"no backward of its own"):
        op(q.requires_grad_(), *args[1:])
    q.requires_grad_(False)
    with pytest.raises(ValueError, match=r"q has 4 heads, k has 3"):
        op(q, k[:, :1].expand(2, 3, 9, 8), v[:, :1].expand(2, 3, 9, 12), *args[3:])
    with pytest.raises(ValueError, match=r"fxshard::attention_backward: lse has shape "
                                         r"\(2, 4, 5\), expected \[2, 4, 6\]"):
        op(*args[:5], lse[..., :5], *args[6:])


# ---------------------------------------------------------------- the CUDA rewrite


def _llama():
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(num_hidden_layers=1, vocab_size=96, hidden_size=64,
                           intermediate_size=72, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _attention_targets(gm):
    return sorted(str(n.target) for n in gm.graph.nodes
                  if n.op == "call_function" and "attention" in str(n.target))


def test_cuda_training_program_runs_fxshard_attention_backward(monkeypatch):
    """Training programs (dp=2 x tp=2) whose rewrite pass sees a cuda mesh hold
    fxshard::attention_backward instead of aten's attention backward; run here on CPU tensors
    (the op's torch path), every gradient equals the single-device model's. On a cpu mesh the
    pass keeps aten's op."""
    from fxshard.mesh import SimulatedMesh
    from fxshard.training import parallelize_for_training
    from fxshard.training.cuda_attention import cuda_attention_backward_pass as rewrite
    from fxshard.training import pass_lists

    def rewrite_as_on_cuda(gm, *, ctx):   # only this pass sees cuda (the rest runs on CPU)
        on_cuda = dataclasses.replace(ctx, mesh=dataclasses.replace(ctx.mesh, device_type="cuda"))
        gm = rewrite(gm, ctx=on_cuda)
        ctx.reports.update(on_cuda.reports)
        return gm
    model = _llama()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 96, (4, 6), generator=g), torch.randint(0, 96, (4, 6),
                                                                           generator=g)
    mesh = SimulatedMesh((2, 2), ("dp", "tp"), "cpu")
    cpu = parallelize_for_training(model, mesh, example_inputs=(ids,))
    assert _attention_targets(cpu.rank_module(0, "backward")) == [
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    monkeypatch.setattr(pass_lists, "TRAIN_JOINT", [rewrite_as_on_cuda if p is rewrite else p
                                                    for p in pass_lists.TRAIN_JOINT])
    tm = parallelize_for_training(model, mesh)
    out = tm(ids)
    assert tm._last.reports["cuda_attention_backward_pass"] == {"rewritten": 1, "left": 0}
    assert cpu._last.reports["cuda_attention_backward_pass"] == {"rewritten": 0, "left": 0}
    assert _attention_targets(tm.rank_module(0, "backward")) == [
        "fxshard.attention_backward.default"]
    assert "attention_backward" not in tm.rank_module(0, "forward").code
    F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
    grads = tm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def _graph_with(op, args_of, n_out):
    """A graph calling one CUDA attention backward op on meta tensors [2, 4, 40, 64]."""
    graph = fx.Graph()
    val = torch.empty(2, 4, 40, 64, device="meta")
    nodes = {}
    for name in ("grad_out", "q", "k", "v", "out"):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = val
    nodes["lse"] = graph.placeholder("lse")
    nodes["lse"].meta["val"] = torch.empty(2, 4, 64 if n_out == 4 else 40, device="meta")
    node = graph.call_function(op, *args_of(nodes))
    node.meta["val"] = (val,) * n_out
    outs = [graph.call_function(operator.getitem, (node, i)) for i in range(3)]
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph), node


def test_rewrite_maps_cuda_flash_and_efficient_arguments():
    from fxshard.mesh import MeshSpec
    from fxshard.passes import PassCtx
    from fxshard.training.cuda_attention import cuda_attention_backward_pass

    aten = torch.ops.aten
    new = torch.ops.fxshard.attention_backward.default
    flash = (aten._scaled_dot_product_flash_attention_backward.default,
             lambda n: ((n["grad_out"], n["q"], n["k"], n["v"], n["out"], n["lse"], None, None,
                         40, 40, 0.0, True, None, None), {"scale": 0.125}), 3)
    efficient = (aten._scaled_dot_product_efficient_attention_backward.default,
                 lambda n: ((n["grad_out"], n["q"], n["k"], n["v"], None, n["out"], n["lse"],
                             None, None, 0.0, [True, True, True, False], False), {}), 4)
    for op, args_of, n_out in (flash, efficient):
        gm, node = _graph_with(op, args_of, n_out)
        ctx = PassCtx(mesh=MeshSpec((2,), ("tp",), "cpu"))
        cuda_attention_backward_pass(gm, ctx=ctx)
        assert node.target is op                    # a cpu mesh: left as it is
        ctx = PassCtx(mesh=MeshSpec((2,), ("tp",), "cuda"))
        cuda_attention_backward_pass(gm, ctx=ctx)
        assert node.target is new and ctx.reports["cuda_attention_backward_pass"]["rewritten"] == 1
        q, k, v, mask, out, lse, dout, dlse, causal, scale, q_off, kv_off, cap = node.args
        assert [x.name for x in (q, k, v, out, dout)] == ["q", "k", "v", "out", "grad_out"]
        assert (mask, dlse, q_off, kv_off, cap) == (None, None, 0, 0, 0.0)
        assert (causal, scale) == ((True, 0.125) if n_out == 3 else (False, None))
        if n_out == 4:   # efficient attention's lse has 64 rows for 40 queries: sliced
            assert lse.target is aten.slice.Tensor and lse.args == (gm.graph.find_nodes(
                op="placeholder", target="lse")[0], 2, 0, 40)
            assert tuple(lse.meta["val"].shape) == (2, 4, 40)
        else:
            assert lse.name == "lse"
    gm, node = _graph_with(flash[0], *flash[1:])
    from fxshard.placement import R, Shard
    node.args[1].meta["fxshard_spec"] = (R, Shard(2))            # q on a sequence shard
    ctx = PassCtx(mesh=MeshSpec((2, 2), ("tp", "ring_cp"), "cuda"))
    cuda_attention_backward_pass(gm, ctx=ctx)                  # the ring's: left
    assert node.target is flash[0] and ctx.reports["cuda_attention_backward_pass"]["left"] == 1
    gm, node = _graph_with(flash[0], lambda n: (flash[1](n)[0][:10] + (0.1,)
                                                + flash[1](n)[0][11:], {}), 3)
    ctx = PassCtx(mesh=MeshSpec((2,), ("tp",), "cuda"))
    cuda_attention_backward_pass(gm, ctx=ctx)                  # dropout: aten's
    assert node.target is flash[0] and ctx.reports["cuda_attention_backward_pass"]["left"] == 1
