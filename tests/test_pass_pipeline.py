"""The pass driver (``fxshard.passes.pipeline.run_passes``) and the pass lists as data."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard.runtime.program_cache import compile_program
from fxshard.mesh import mesh_spec
from fxshard.passes import PassCtx, PassReports
from fxshard.passes.decode_positions import decode_positions_pass
from fxshard.passes.kv_cache import (decode_attention_pass, greedy_tokens_pass,
                                     prefill_cache_pass)
from fxshard.passes.lower_attention import lower_attention_pass
from fxshard.passes.moe_routing import moe_routing_pass
from fxshard.passes.pipeline import (DECODE, DECODE_GREEDY, FORWARD, PREFILL, passes_for,
                                     run_passes)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _graph_with_dead_node() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops.aten.neg.default, (x,))       # read by nothing
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _counting(gm: fx.GraphModule, monkeypatch) -> dict:
    calls = {"lint": 0, "recompile": 0}
    lint, recompile = gm.graph.lint, gm.recompile

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call
    monkeypatch.setattr(gm.graph, "lint", counted("lint", lint))
    monkeypatch.setattr(gm, "recompile", counted("recompile", recompile))
    return calls


def looks_pass(gm, *, ctx):
    ctx.report("looks_pass", changed=False, nodes=len(gm.graph.nodes))
    return gm


def nothing_pass(gm, *, ctx):
    ctx.report("nothing_pass", rewritten=0)
    return gm


def relu_to_abs_pass(gm, *, ctx):
    n = 0
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.relu.default:
            node.target = torch.ops.aten.abs.default
            n += 1
    ctx.report("relu_to_abs_pass", rewritten=n)
    return gm


def test_a_pass_that_changes_nothing_is_not_linted_or_recompiled(monkeypatch):
    gm = _graph_with_dead_node()
    calls = _counting(gm, monkeypatch)
    ctx = PassReports()
    assert run_passes(gm, [nothing_pass, looks_pass], ctx) is gm
    assert calls == {"lint": 0, "recompile": 0}
    assert "aten.neg" in gm.code    # no dead-code elimination either
    assert ctx.reports == {"nothing_pass": {"rewritten": 0}, "looks_pass": {"nodes": 4}}


def test_a_pass_that_changed_the_graph_gets_dead_code_eliminated_linted_recompiled(monkeypatch):
    gm = _graph_with_dead_node()
    calls = _counting(gm, monkeypatch)
    ctx = PassReports()
    run_passes(gm, [relu_to_abs_pass, nothing_pass, relu_to_abs_pass], ctx)
    # once (the second run rewrote nothing); dead-code elimination lints too
    assert calls["recompile"] == 1 and calls["lint"] == 2, calls
    assert "aten.abs" in gm.code and "aten.neg" not in gm.code, gm.code
    assert ctx.reports == {"relu_to_abs_pass": {"rewritten": 1}, "nothing_pass": {"rewritten": 0}}
    torch.testing.assert_close(gm(torch.tensor([-2.0, 3.0])), torch.tensor([2.0, 3.0]))


def test_reports_are_counts_that_add_up():
    ctx = PassReports()
    ctx.report("emit_pass", changed=False, programs=1, weights=3)
    ctx.report("emit_pass", changed=False, programs=1, weights=4)
    assert ctx.reports == {"emit_pass": {"programs": 2, "weights": 7}} and not ctx.changed
    with pytest.raises(AssertionError):
        ctx.report("emit_pass", weights="seven")


def _ctx(axes: dict) -> PassCtx:
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return PassCtx(mesh=mesh_spec(mesh))


def test_compile_program_runs_the_forward_list_in_order():
    ctx = _ctx(dict(tp=2))
    c = compile_program(_Stack(), (torch.randn(3, 8),), {}, ctx)
    assert list(ctx.reports) == [p.__name__ for p in FORWARD]
    assert ctx.reports["emit_pass"] == {"programs": 1, "weights": 4, "unused_weights_dropped": 0}
    assert ctx.reports["split_stages_pass"] == {"stages": 1, "sends": 0, "receives": 0}
    assert [p.stage for p in c.programs] == [0]


def test_split_stages_hands_the_rest_of_the_list_to_each_stage():
    ctx = _ctx(dict(pp=2))
    c = compile_program(_Stack(), (torch.randn(3, 8),), {}, ctx)
    assert ctx.reports["split_stages_pass"] == {"stages": 2, "sends": 1, "receives": 1}
    assert ctx.reports["emit_pass"] == {"programs": 2, "weights": 4, "unused_weights_dropped": 0}
    assert [p.stage for p in c.programs] == [0, 1]
    assert [sorted(p.slots) for p in c.programs] == [["layers.0.bias", "layers.0.weight"],
                                                     ["layers.1.bias", "layers.1.weight"]]


def test_generation_lists_add_their_passes_to_forward():
    def rest(passes, *new):
        return [p for p in passes if p not in new] == FORWARD
    assert rest(PREFILL, prefill_cache_pass)
    assert rest(DECODE, decode_attention_pass, decode_positions_pass)
    assert rest(DECODE_GREEDY, decode_attention_pass, greedy_tokens_pass, decode_positions_pass)
    assert DECODE.index(decode_positions_pass) == DECODE.index(moe_routing_pass) + 1
    assert PREFILL.index(prefill_cache_pass) == PREFILL.index(lower_attention_pass) + 1
    assert DECODE_GREEDY.index(greedy_tokens_pass) + 1 == \
        DECODE_GREEDY.index(decode_attention_pass) == \
        DECODE_GREEDY.index(lower_attention_pass) - 1
    assert passes_for(None) is FORWARD and passes_for(("prefill", 8)) is PREFILL
    assert passes_for(("decode", 8)) is DECODE
    assert passes_for(("decode", 8, "greedy")) is DECODE_GREEDY
    with pytest.raises(ValueError, match=r"generation=\('prefill', 8, 'greedy'\)"):
        passes_for(("prefill", 8, "greedy"))


def test_explain_prints_one_line_per_pass_from_its_counts():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(_Stack(), mesh, example_inputs=(torch.randn(3, 8),))
    e = pm.explain()
    lines = str(e).split("\nPasses\n")[1].splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [p.__name__ for p in FORWARD]
    assert "  split_stages_pass: 1 stages, 0 sends, 0 receives" in lines
    assert e.passes["emit_pass"] == {"programs": 1, "weights": 4, "unused_weights_dropped": 0}
    pm.close()
