"""The eager rank runner (``fxshard.compile.eager_stage``): what ``pm(x)`` runs per rank when
``compile=False``. The same graph as ``pm.rank_module(r)``, with the weights bound once as
inputs, ops called without ``OpOverload.__call__`` frames, and each ``all_reduce`` of a value
nobody reads again summed into that value's memory (as hand-written Megatron does)."""
import operator

import torch
import torch.fx as fx

import fxshard
from fxshard.compile import eager_stage
from fxshard.passes.emit import Program
from fxshard.runtime.library import direct_kernel
from fxshard.runtime.ops import all_reduce_consuming
from tests.models import our_llama

aten, ops = torch.ops.aten, torch.ops.fxshard


def test_eager_stage_binds_weights_once_and_sums_into_dead_inputs():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 16))
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = fxshard.parallelize(model, mesh)
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    c = pm._last
    stage = c.programs[0].eager
    code = stage.module.code
    assert "self." not in code                      # no weight read through attributes
    assert code.count("all_reduce_consuming(") == 4  # o_proj and down_proj of 2 layers
    assert "torch.ops.fxshard.all_reduce" not in code
    readable = pm.rank_module(0).code                 # what users read is unchanged
    assert readable.count("torch.ops.fxshard.all_reduce.default(") == 4
    assert "all_reduce_consuming" not in readable
    assert sorted(c.runners) == [0, 1, 2, 3]          # every rank bound to the one stage
    assert len(stage.names) == len(c.programs[0].slots)
    # a weight changed in place after the first call is seen by the bound runner
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    pm.close()


def test_all_reduce_copies_an_input_that_is_read_again_a_view_or_a_graph_input():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = g.call_function(aten.linear.default, (x, w))             # read again below: copy
    ra = g.call_function(ops.all_reduce.default, (a, "tp", 2))
    b = g.call_function(aten.linear.default, (x, w))
    view = g.call_function(aten.reshape.default, (b, [-1]))      # aliases b: copy
    rv = g.call_function(ops.all_reduce.default, (view, "tp", 2))
    rx = g.call_function(ops.all_reduce.default, (x, "tp", 2))   # the user's input: copy
    c = g.call_function(aten.mul.Tensor, (x, 2.0))               # fresh, read once: in place
    rc = g.call_function(ops.all_reduce.default, (c, "tp", 2))
    out = g.call_function(aten.add.Tensor, (ra, a))
    g.output((out, rv, rx, rc))
    stage = eager_stage(Program(graph=g))
    targets = {n.name: n.target for n in stage.module.graph.nodes if n.op == "call_function"}
    assert [targets[n.name] for n in (ra, rv, rx)] == [ops.all_reduce.default] * 3
    assert targets[rc.name] is all_reduce_consuming


def test_fxshard_ops_run_their_python_kernels_directly():
    for op in (ops.all_gather.default, ops.all_reduce.default, ops.attention.default,
               ops.send.default, ops.recv.default):
        assert callable(direct_kernel(op)) and direct_kernel(op) is not op
    assert direct_kernel(aten.mul.Tensor) is None
    g = fx.Graph()
    q = g.placeholder("q")
    att = g.call_function(ops.attention.default, (q, q, q, None, True, None, 0, 0))
    g.output((g.call_function(operator.getitem, (att, 0)),))
    fn = eager_stage(Program(graph=g)).fn
    t = torch.randn(1, 2, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(fn(t)[0], torch.nn.functional.scaled_dot_product_attention(
            t, t, t, is_causal=True))
