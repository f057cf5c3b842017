"""``torch.compile(model, backend=fxshard.backend(mesh))``: dynamo's lifted parameters are
sharded exactly like ``parallelize`` shards the model (bytes per rank, collectives in the rank
code, ``dp`` splitting the ids), new shapes retrace, graph breaks each get a parallel program.

Most tests pass ``compile=False`` (the rank programs run eagerly) to keep CI fast; the Inductor
path has its own tests at the end (``compile=True``, the backend's default).
"""
from __future__ import annotations

import re

import pytest
import torch

import fxshard
from tests.models import hf_llama, our_llama

TOL = dict(rtol=1e-4, atol=1e-4)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _compiled(model, mesh, **options):
    """``torch.compile`` with fxshard's backend, and the list of regions it compiled."""
    torch._dynamo.reset()
    inner = fxshard.backend(mesh, **options)
    regions = []

    def record(gm, example_inputs):
        run = inner(gm, example_inputs)
        regions.append(run)
        return run
    return torch.compile(model, backend=record), regions


def _user_input_shards(code: str, axis: str) -> list[str]:
    """Names of the placeholders that a rank program slices on ``axis`` (local_shard)."""
    signature = re.search(r"def forward\(self, ([^)]*)\)", code).group(1)
    inputs = [a.strip() for a in signature.split(",")]
    sliced = re.findall(rf"local_shard\.default\((\w+), 0, '{axis}'", code)
    return [s for s in sliced if s in inputs]


@pytest.mark.parametrize("make", [lambda: our_llama(num_hidden_layers=2),
                                  lambda: hf_llama(layers=2)], ids=["ours", "hf"])
def test_backend_shards_lifted_parameters_like_parallelize(make):
    model = make()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (2, 8))
    compiled, regions = _compiled(model, mesh, compile=False)
    torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)), **TOL)
    assert len(regions) == 1
    pm = regions[0].parallel_module
    ex = pm.explain()
    ref = fxshard.parallelize(model, mesh, example_inputs=(ids,)).explain()
    # the same weights under the model's own names, placed and counted the same way
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert ex.total_param_bytes == total
    assert ex.param_bytes == ref.param_bytes == {r: (total - norms) // 2 + norms
                                                 for r in range(4)}
    assert {f: s for f, s, *_ in ex.placements} == {f: s for f, s, *_ in ref.placements}
    assert {f for f, *_ in ex.placements} <= set(model.state_dict())
    assert ex.counts(0) == ref.counts(0)
    code = pm.rank_module(0).code
    assert code.count("torch.ops.fxshard.all_reduce.default") == 2 * 2   # 2 per layer
    assert len(_user_input_shards(code, "dp")) == 1                       # the ids, on dim 0
    up = pm.rank_module(1).state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (80, 64)


def test_backend_options_sequence_parallel_and_plan():
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 128, (2, 8))
    plan = {"model.layers.*.mlp.*": "replicate"}
    compiled, regions = _compiled(model, mesh, compile=False, sequence_parallel=True, plan=plan)
    torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    ex = regions[0].parallel_module.explain()
    ref = fxshard.parallelize(model, mesh, example_inputs=(ids,), sequence_parallel=True,
                              plan=plan).explain()
    assert ex.counts(0) == ref.counts(0)
    assert ex.counts(0)[("reduce_scatter", "tp")] >= 2            # sequence parallel is on
    placements = {f: s for f, s, *_ in ex.placements}
    assert "S" not in str(placements["model.layers.0.mlp.up_proj.weight"])  # the plan held
    assert "S(0)" in str(placements["model.layers.0.self_attn.q_proj.weight"])


def test_backend_tp_and_ring_cp_split_the_sequence():
    model = hf_llama(layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ring_cp"))
    ids = torch.randint(0, 128, (1, 8))
    compiled, regions = _compiled(model, mesh, compile=False)
    torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)), **TOL)
    pm = regions[0].parallel_module
    code = pm.rank_module(0).code
    assert "torch.ops.fxshard.ring_attention" in code
    assert "zigzag_shard.default" in code
    assert pm.explain().counts(0)[("all_reduce", "tp")] == 2


def test_backend_new_sequence_length_retraces():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    compiled, regions = _compiled(model, mesh, compile=False)
    for seq in (8, 6, 12, 6):
        ids = torch.randint(0, 128, (2, seq))
        torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    # dynamo recompiles once with a dynamic sequence; that region traces per concrete length
    assert len(regions) == 2
    dynamic = regions[1].parallel_module
    assert len(dynamic.programs) == 2                          # seq 6 and 12
    assert dynamic.explain().counts(0)[("all_reduce", "tp")] == 2


class _BreakAfterDecoder(torch.nn.Module):
    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids):
        h = self.llama.model(ids)
        torch._dynamo.graph_break()
        return self.llama.lm_head(h)


def test_backend_graph_break_parallelizes_each_region():
    llama = our_llama(num_hidden_layers=1)
    model = _BreakAfterDecoder(llama).eval()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (2, 8))
    compiled, regions = _compiled(model, mesh, compile=False)
    torch.testing.assert_close(compiled(ids), llama(ids), **TOL)
    assert len(regions) == 2
    first, second = (r.parallel_module.explain() for r in regions)
    assert first.counts(0)[("all_reduce", "tp")] == 2
    head = {f: s for f, s, *_ in second.placements}
    assert list(head) == ["llama.lm_head.weight"] and "S(0)" in str(head["llama.lm_head.weight"])
    assert second.param_bytes[0] == llama.lm_head.weight.numel() * 4 // 2
    code = regions[1].parallel_module.rank_module(0).code
    assert len(_user_input_shards(code, "dp")) == 1             # the hidden states, by batch


def test_backend_rejects_example_inputs_option():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(TypeError, match="come from torch.compile"):
        fxshard.backend(mesh, example_inputs=(torch.zeros(1),))


def test_backend_needs_lifted_parameters():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(NotImplementedError, match=r"fxshard.backend: .*'weight'.*lifted"):
        fxshard.backend(mesh)(gm, [torch.zeros(2, 4)])


def test_parallelize_compile_must_be_bool():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(TypeError, match=r"fxshard.parallelize: compile='yes'"):
        fxshard.parallelize(our_llama(num_hidden_layers=1), mesh, compile="yes")


# --- Inductor ---------------------------------------------------------------------------------

def test_backend_compiles_rank_programs_with_inductor():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (2, 8))
    compiled, regions = _compiled(model, mesh)                  # compile=True by default
    torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    pm = regions[0].parallel_module
    c = pm.programs.last
    assert pm.compile and sorted(c.compiled) == [0]              # one compiled program
    assert len({id(c.runners[r][1]) for r in range(4)}) == 4     # bound to each rank's weights
    assert pm.explain().counts(0)[("all_reduce", "tp")] == 2
    torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    # Inductor got aten's CPU flash attention (as compiled hand-written code has), the
    # readable rank program still shows fxshard's op
    assert c.compiled[0].module.code.count(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(") == 1
    assert "fxshard.attention" not in c.compiled[0].module.code
    assert pm.rank_module(0).code.count("torch.ops.fxshard.attention.default(") == 1


def test_parallelize_compile_matches_eager_with_pipeline():
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    ids = torch.randint(0, 128, (2, 8))
    eager = fxshard.parallelize(model, mesh, microbatches=2)
    pm = fxshard.parallelize(model, mesh, microbatches=2, compile=True)
    out = pm(ids)
    torch.testing.assert_close(out, eager(ids), **TOL)
    torch.testing.assert_close(out, model(ids), **TOL)
    assert sorted(pm.programs.last.compiled) == [0, 1]                   # one per stage
    for stage in pm.programs.last.compiled.values():
        assert "_scaled_dot_product_flash_attention_for_cpu.default(" in stage.module.code


def _dynamic(model, mesh):
    torch._dynamo.reset()
    inner = fxshard.backend(mesh, compile=False)
    regions = []

    def record(gm, example_inputs):
        run = inner(gm, example_inputs)
        regions.append(run)
        return run
    return torch.compile(model, backend=record, dynamic=True), regions


@pytest.mark.parametrize("make", [lambda: our_llama(num_hidden_layers=1),
                                  lambda: hf_llama(layers=1)], ids=["ours", "hf"])
def test_backend_dynamic_true_one_program_per_concrete_shape(make):
    model = make()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    compiled, regions = _dynamic(model, mesh)
    for shape in ((2, 8), (4, 6), (2, 8)):
        ids = torch.randint(0, 128, shape)
        torch.testing.assert_close(_logits(compiled(ids)), _logits(model(ids)), **TOL)
    assert len(regions) == 1          # one symbolic graph: dynamo did not recompile
    pm = regions[0].parallel_module
    assert len(pm.programs) == 2     # fxshard: one program per concrete shape
    assert pm.explain().counts(0)[("all_reduce", "tp")] == 2


def test_backend_dynamic_true_with_a_graph_break():
    llama = our_llama(num_hidden_layers=1)
    model = _BreakAfterDecoder(llama).eval()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    compiled, regions = _dynamic(model, mesh)
    for shape in ((2, 8), (2, 5)):
        ids = torch.randint(0, 128, shape)
        torch.testing.assert_close(compiled(ids), llama(ids), **TOL)
    assert len(regions) == 2
    assert regions[0].parallel_module.explain().counts(0)[("all_reduce", "tp")] == 2


class _Branch(torch.nn.Module):  # a real data-dependent branch
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_real_data_dependent_branch_keeps_its_message_and_compiles_around_it():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(NotImplementedError, match=r"its forward branches on a tensor's value "
                                                  r"\(data-dependent control flow\) at .*"
                                                  r"`if y.sum\(\) > 0:`"):
        fxshard.parallelize(_Branch(), mesh)(torch.randn(2, 8))
    model = _Branch().eval()
    compiled, regions = _dynamic(model, mesh)  # dynamo breaks the graph at the branch
    for x in (torch.randn(2, 8), -torch.randn(3, 8).abs() - 10):
        torch.testing.assert_close(compiled(x), model(x), **TOL)


@pytest.mark.parametrize("options,error,message", [
    (dict(bogus=1), TypeError, r"unknown option bogus; the options are fxshard.parallelize's: "
                               r"plan, sequence_parallel, microbatches, strict, embedding"),
    (dict(microbatches=0), ValueError, r"microbatches=0 must be >= 1"),
    (dict(compile="yes"), TypeError, r"compile='yes'"),
    (dict(embedding="rows"), ValueError, r"embedding='rows'"),
])
def test_backend_options_are_checked_when_the_backend_is_made(options, error, message):
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(error, match=rf"^fxshard.backend: {message}"):
        fxshard.backend(mesh, **options)
