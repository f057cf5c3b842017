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
from fxshard.ops.collectives import all_reduce_consuming
from fxshard.ops.library import direct_kernel
from fxshard.runtime.context import use_backend
from tests.models import our_llama

aten, ops = torch.ops.aten, torch.ops.fxshard


def test_eager_stage_binds_weights_once_and_sums_into_dead_inputs():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 16))
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = fxshard.parallelize(model, mesh)
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    c = pm.programs.last
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
    view = g.call_function(aten.reshape.default, (b, [-1]))      # aliases b, read again: copy
    rv = g.call_function(ops.all_reduce.default, (view, "tp", 2))
    rx = g.call_function(ops.all_reduce.default, (x, "tp", 2))   # the user's input: copy
    vx = g.call_function(aten.reshape.default, (x, [-1]))        # a view of the input: copy
    rvx = g.call_function(ops.all_reduce.default, (vx, "tp", 2))
    c = g.call_function(aten.mul.Tensor, (x, 2.0))               # fresh, read once: in place
    rc = g.call_function(ops.all_reduce.default, (c, "tp", 2))
    d = g.call_function(aten.mul.Tensor, (x, 3.0))               # a view of a fresh value
    vd = g.call_function(aten.reshape.default, (d, [-1]))        # read by it only: in place
    rvd = g.call_function(ops.all_reduce.default, (vd, "tp", 2))
    e = g.call_function(aten.mul.Tensor, (x, 4.0))               # read again below
    ue = g.call_function(aten._unsafe_view.default, (e, [-1]))   # a view (no alias in schema)
    rue = g.call_function(ops.all_reduce.default, (ue, "tp", 2))  # of e: copy
    out = g.call_function(aten.add.Tensor, (ra, a))
    g.output((out, rv, rx, rvx, rc, rvd, b, rue, e))
    stage = eager_stage(Program(graph=g))
    targets = {n.name: n.target for n in stage.module.graph.nodes if n.op == "call_function"}
    assert [targets[n.name] for n in (ra, rv, rx, rvx, rue)] == [ops.all_reduce.default] * 5
    assert targets[rc.name] is all_reduce_consuming
    assert targets[rvd.name] is all_reduce_consuming


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


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every overload that reaches the Python dispatch key."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _binding_cases():
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    m, w = torch.randn(3, 4), torch.randn(5, 4)
    ids = torch.tensor([[0, 2], [1, 4]])
    return {
        aten.add.Tensor: ((x, y), {"alpha": 2}), aten.sub.Tensor: ((x, 1.5), {}),
        aten.mul.Tensor: ((x, y), {}), aten.div.Tensor: ((x, 32), {}),
        aten.neg.default: ((x,), {}), aten.pow.Tensor_Scalar: ((x, 2), {}),
        aten.pow.Tensor_Tensor: ((x.abs(), y), {}), aten.pow.Scalar: ((10000.0, x), {}),
        aten.rsqrt.default: ((x.abs(),), {}), aten.reciprocal.default: ((x,), {}),
        aten.exp.default: ((x,), {}), aten.cos.default: ((x,), {}),
        aten.sin.default: ((x,), {}), aten.tanh.default: ((x,), {}),
        aten.mean.dim: ((x, [-1], True), {}), aten.sum.dim_IntList: ((x, [1]), {}),
        aten.linear.default: ((m, w), {}), aten.silu.default: ((x,), {}),
        aten.gelu.default: ((x,), {"approximate": "tanh"}),
        aten.embedding.default: ((w, ids), {}), aten.matmul.default: ((m, w.t()), {}),
        aten.mm.default: ((m, w.t()), {}), aten.bmm.default: ((x, y.transpose(1, 2)), {}),
        aten.addmm.default: ((torch.randn(5), m, w.t()), {}),
        aten.cat.default: (([x, y], -1), {}), aten.reshape.default: ((x, [6, 4]), {}),
        aten.view.default: ((x, [6, 4]), {}), aten.transpose.int: ((x, 1, 2), {}),
        aten.permute.default: ((x, [2, 0, 1]), {}), aten.unsqueeze.default: ((x, 1), {}),
        aten.expand.default: ((m[:1], [3, 4]), {}), aten.t.default: ((m,), {}),
        aten.softmax.int: ((x, -1), {}), aten.where.self: ((x > 0, x, y), {}),
        aten.arange.default: ((7,), {"dtype": torch.float32, "device": torch.device("cpu"),
                                      "pin_memory": False}),
        aten.arange.start_step: ((0, 32, 2), {"dtype": torch.float32,
                                              "device": torch.device("cpu"),
                                              "pin_memory": False}),
        aten._scaled_dot_product_flash_attention_for_cpu.default: (
            (x[None], y[None], y[None], 0.0, True), {"attn_mask": None, "scale": 0.3}),
    }


def test_every_python_binding_reaches_its_aten_overload_with_the_same_result():
    from fxshard.runtime.aten_bindings import _BINDINGS, aten_binding
    cases = _binding_cases()
    assert set(cases) == set(_BINDINGS)
    for op, (args, kwargs) in cases.items():
        expected = op(*args, **kwargs)
        with _Recorder() as rec:
            got = aten_binding(op)(*args, **kwargs)
        # composite ops (linear, matmul, ...) reach the mode decomposed: compare with the
        # overload's own decomposition
        with _Recorder() as ref:
            op(*args, **kwargs)
        assert rec.calls == ref.calls, op
        for got_t, want_t in zip(*((r,) if isinstance(r, torch.Tensor) else r
                                   for r in (got, expected))):
            assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape, op
            assert torch.equal(got_t, want_t), op
    assert aten_binding(aten.slice.Tensor) is None


class _Loopback:
    """Rank 0 of a mesh that talks to nobody: the same collectives for both programs."""

    def __init__(self, spec):
        self.spec = spec

    def axis_index(self, axis):
        return 0

    def axis_size(self, axis):
        return self.spec.axis_size(axis)

    def all_gather(self, x, dim, axis):
        with torch.utils._python_dispatch._disable_current_modes():   # not recorded
            return torch.cat([x] * self.axis_size(axis), dim)

    def all_reduce(self, x, axis):
        return x

    def all_reduce_(self, x, axis, size):
        return x


def test_bindings_make_the_same_aten_calls_and_the_exact_result(monkeypatch):
    import fxshard.compile as fc
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 16))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    pm(ids)
    c = pm.programs.last
    program, mod = c.programs[0], pm.executor.module(c, 0)
    with_bindings = eager_stage(program)
    program.eager = None
    monkeypatch.setattr(fc, "aten_binding", lambda op: None)
    without = eager_stage(program)
    assert "torch.mul(" not in pm.rank_module(0).code    # the readable module is unchanged
    runs = {}
    with torch.no_grad(), use_backend(_Loopback(pm.spec)):
        for name, stage in (("bindings", with_bindings), ("op._op", without)):
            fn = stage.bind(mod)
            with _Recorder() as rec:
                out = fn(ids)
            runs[name] = out[0], rec.calls
    assert torch.equal(runs["bindings"][0], runs["op._op"][0])
    calls = runs["op._op"][1]
    assert runs["bindings"][1] == calls and len(calls) > 50
    assert aten.mul.Tensor in calls and aten.cat.default in calls and aten.mm.default in calls
    pm.close()


def _bshd(shape, g):
    b, h, s, d = shape
    return torch.randn(b, s, h, d, generator=g, dtype=torch.float64).transpose(1, 2)


def test_attention_out_is_attentions_out_stored_as_bshd():
    from fxshard.kernels.attention_out import _bshd_strides
    g = torch.Generator().manual_seed(0)
    q, k, v = _bshd((2, 6, 5, 8), g), _bshd((2, 3, 5, 8), g), _bshd((2, 3, 5, 8), g)
    nan_q = q.clone()
    nan_q[1, 2, 3, 0] = float("nan")                    # exact path: NaN row, as the op
    mask = torch.rand(5, 5, generator=g) > 0.3
    cases = [((q, k, v, None, True, None, 0, 0), "flash, q already [B, S, H, D]"),
             ((q.contiguous(), k, v, None, True, 0.3, 0, 0), "flash, q contiguous: copy"),
             ((q.float(), k.float(), v.float(), None, False, None, 0, 0), "float32"),
             ((nan_q, k, v, None, True, None, 0, 0), "non-finite: exact path"),
             ((q, k, v, mask, False, None, 0, 0), "mask: exact path"),
             ((q, k, v, None, True, None, 3, 0), "offsets: exact path")]
    with torch.no_grad():
        for args, what in cases:
            want = ops.attention(*args)[0]
            got = ops.attention_out(*args)
            assert got.stride() == _bshd_strides(got.shape), what
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)
    # the NaN query row: NaN, or 0 where torch's own CPU SDPA gives 0 (AVX-512), as one device
    from fxshard.kernels.attention import sdpa_zeroes_nan_rows
    row = ops.attention_out(*cases[3][0])[1, 2, 3]
    zeroes = sdpa_zeroes_nan_rows(nan_q.dtype, k.shape[2], None)   # k.shape[2] keys, no mask
    assert (row == 0).all() if zeroes else torch.isnan(row).all()


def _attention_graph(read, q_offset=3):
    g = fx.Graph()
    q = g.placeholder("q")
    q.meta["val"] = torch.empty(1, 2, 5, 4)
    # q_offset 3: a causal diagonal aten's flash kernel does not take (offsets 0 lower to it)
    att = g.call_function(ops.attention.default, (q, q, q, None, True, None, q_offset, 0))
    out = g.call_function(operator.getitem, (att, 0))
    g.output((read(g, att, out),))
    return Program(graph=g)


def test_only_attention_whose_out_is_transposed_back_and_lse_unread_loses_its_lse():
    t = torch.randn(1, 2, 5, 4)
    reads = {
        "transposed": (lambda g, att, out: g.call_function(aten.transpose.int, (out, 1, 2)),
                       True),
        "viewed": (lambda g, att, out: g.call_function(aten.view.default, (out, [1, 10, 4])),
                   False),
        "lse read": (lambda g, att, out: [g.call_function(aten.transpose.int, (out, 1, 2)),
                                          g.call_function(operator.getitem, (att, 1))][1],
                     False),
    }
    for name, (read, rewritten) in reads.items():
        program = _attention_graph(read)
        reference = fx.GraphModule(torch.nn.Module(), program.graph)
        stage = eager_stage(program)
        targets = [n.target for n in stage.module.graph.nodes if n.op == "call_function"]
        assert (ops.attention_out.default in targets) is rewritten, name
        assert (ops.attention.default in targets) is not rewritten, name
        with torch.no_grad():
            torch.testing.assert_close(stage.fn(t)[0], reference(t)[0], rtol=0, atol=0)
        # aten's contract (equal offsets): the eager runner calls aten's flash kernel itself,
        # the op the single-device model's SDPA runs on CPU (the same bits as fxshard's fast path)
        program = _attention_graph(read, q_offset=0)
        reference = fx.GraphModule(torch.nn.Module(), program.graph)
        stage = eager_stage(program)
        targets = [n.target for n in stage.module.graph.nodes if n.op == "call_function"]
        assert aten._scaled_dot_product_flash_attention_for_cpu.default in targets, name
        assert not {ops.attention.default, ops.attention_out.default} & set(targets), name
        with torch.no_grad():
            torch.testing.assert_close(stage.fn(t)[0], reference(t)[0], rtol=0, atol=0)
