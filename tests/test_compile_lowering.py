"""The post-emit rewrites the runners apply (``fxshard.passes.post_emit``), on small hand-built
graphs (no Inductor, no processes: each graph runs eagerly before and after the rewrite).

``aten_attention_pass``: an ``fxshard::attention`` / ``attention_out`` whose contract is aten's
becomes aten's CPU flash attention (what compiled hand-written code calls); the others keep the
fxshard op. Values equal the fxshard op's, and ``attention_out``'s ``[B, S, H, D]`` storage is
kept.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import fxshard  # noqa: F401  (registers the fxshard ops)
from fxshard.ops.attention import attention_out
from fxshard.passes.pipeline import run_passes
from fxshard.passes.post_emit import PostEmitCtx, aten_attention_pass

FLASH = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default("


def _aten_attention(gm: fx.GraphModule) -> int:
    """Run ``aten_attention_pass`` on ``gm`` as the runners do; how many it lowered."""
    ctx = PostEmitCtx()
    run_passes(gm, [aten_attention_pass], ctx)
    return ctx.reports["aten_attention_pass"]["flash_attentions"]


def _attention_graph(op, inputs: dict, options: dict, *, read_lse: bool) -> fx.GraphModule:
    """``op(q, k, v, mask, **options)`` as an FX graph over ``inputs`` (its placeholders'
    ``meta["val"]`` are the inputs themselves), returning ``out`` (and ``lse``)."""
    graph = fx.Graph()
    ph = {}
    for name, value in inputs.items():
        ph[name] = graph.placeholder(name)
        ph[name].meta["val"] = value
    args = (ph["q"], ph["k"], ph["v"], ph.get("mask"), options["causal"], options["scale"],
            options["q_offset"], options["kv_offset"], options.get("softcap", 0.0))
    node = graph.call_function(op, args)
    if op is attention_out.default:
        graph.output(node)
    else:
        out = graph.call_function(operator.getitem, (node, 0))
        lse = graph.call_function(operator.getitem, (node, 1))
        out.meta["val"], lse.meta["val"] = torch.ops.fxshard.attention(
            inputs["q"], inputs["k"], inputs["v"], inputs.get("mask"), *args[4:])
        graph.output((out, lse) if read_lse else out)
    return fx.GraphModule(torch.nn.Module(), graph)


def _qkv(dtype=torch.float32, seq_q=7, seq_kv=7, heads=4, kv_heads=2, head_dim=8):
    g = torch.Generator().manual_seed(0)
    # q stored as [B, S, H, D], as the rank programs' q (a transposed projection)
    q = torch.randn(2, seq_q, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(2, kv_heads, seq_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, seq_kv, head_dim, generator=g).to(dtype)
    return {"q": q, "k": k, "v": v}


def _opts(causal=True, scale=None, q_offset=0, kv_offset=0, softcap=0.0):
    return dict(causal=causal, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
                softcap=softcap)


_FLOAT_MASK = torch.randn(2, 1, 7, 7, generator=torch.Generator().manual_seed(1))
_FLOAT_MASK[0, 0, 3] = -float("inf")                         # a row that sees no key: out 0

LOWERED = {
    "out causal GQA": (attention_out.default, _qkv(), _opts(scale=0.3), False),
    "out causal, equal offsets": (attention_out.default, _qkv(), _opts(q_offset=5,
                                                                       kv_offset=5), False),
    "out non-causal, offsets ignored": (attention_out.default, _qkv(seq_q=5),
                                        _opts(causal=False, q_offset=0, kv_offset=9), False),
    "out causal, Sq < Skv": (attention_out.default, _qkv(seq_q=4), _opts(), False),
    "out float mask, an empty row": (attention_out.default, {**_qkv(), "mask": _FLOAT_MASK},
                                     _opts(causal=False), False),
    "attention out+lse float64": (torch.ops.fxshard.attention.default,
                                  _qkv(torch.float64), _opts(), True),
    "attention out only": (torch.ops.fxshard.attention.default, _qkv(), _opts(), False),
}
KEPT = {
    "causal, unequal offsets (ring step)": (attention_out.default, _qkv(),
                                            _opts(q_offset=0, kv_offset=7), False),
    "soft-cap": (attention_out.default, _qkv(), _opts(softcap=20.0), False),
    "bool mask": (attention_out.default,
                  {**_qkv(), "mask": torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()},
                  _opts(causal=False), False),
    "bfloat16": (attention_out.default, _qkv(torch.bfloat16), _opts(), False),
    "no keys": (torch.ops.fxshard.attention.default, _qkv(seq_kv=0), _opts(), True),
}


@pytest.mark.parametrize("case", list(LOWERED))
def test_aten_attention_lowers_aten_contract_to_cpu_flash(case):
    op, inputs, options, read_lse = LOWERED[case]
    gm = _attention_graph(op, inputs, options, read_lse=read_lse)
    want = gm(*inputs.values())
    assert _aten_attention(gm) == 1
    assert gm.code.count(FLASH) == 1 and "fxshard" not in gm.code, gm.code
    got = gm(*inputs.values())
    tol = dict(rtol=1e-6, atol=1e-6) if "mask" in inputs else dict(rtol=0, atol=0)
    for w, g in zip(*(t if isinstance(t, tuple) else (t,) for t in (want, got))):
        torch.testing.assert_close(g, w, **tol)   # same dtypes too (lse float32)
        if op is attention_out.default:
            assert g.stride() == w.stride()      # [B, S, H, D] storage, as attention_out's


@pytest.mark.parametrize("case", list(KEPT))
def test_aten_attention_keeps_fxshard_op_beyond_aten_contract(case):
    op, inputs, options, read_lse = KEPT[case]
    gm = _attention_graph(op, inputs, options, read_lse=read_lse)
    before = gm.code
    assert _aten_attention(gm) == 0
    assert gm.code == before and "_scaled_dot_product" not in gm.code


def test_aten_attention_leaves_graphs_with_as_strided_alone():
    inputs = _qkv()
    gm = _attention_graph(torch.ops.fxshard.attention.default, inputs, _opts(), read_lse=False)
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    with gm.graph.inserting_after(out):
        strided = gm.graph.call_function(torch.ops.aten.as_strided.default,
                                         (out, (2, 4, 7, 8), (224, 56, 8, 1)))
    out.replace_all_uses_with(strided, delete_user_cb=lambda n: n is not strided)
    gm.recompile()
    assert _aten_attention(gm) == 0
