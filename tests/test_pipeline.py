"""Pipeline parallelism: stage assignment, send/recv at the cuts, per-stage programs,
microbatches (GPipe), alone and with dp and tp, against the single-device model."""
from __future__ import annotations

import pytest
import torch

import fxshard
from fxshard.passes.split_stages import assign_layers_to_stages
from tests.models import hf_llama, our_llama

TOL = dict(rtol=1e-4, atol=1e-4)


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def ops_in(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_assign_layers_to_stages():
    assert assign_layers_to_stages(4, 2) == [0, 0, 1, 1]
    assert assign_layers_to_stages(5, 2) == [0, 0, 0, 1, 1]
    assert assign_layers_to_stages(7, 4) == [0, 0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="pp axis has 3 stages but the model has only 2 layers"):
        assign_layers_to_stages(2, 3)


CASES = [dict(pp=2), dict(pp=4), dict(dp=2, pp=2), dict(tp=2, pp=2), dict(dp=2, tp=2, pp=2)]


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _case_id(make: str, axes: dict, mb: int) -> str:
    return f"{make}-" + "x".join(f"{k}{v}" for k, v in axes.items()) + f"-{mb}"


# HF's Llama (what users run) on every mesh, with and without microbatches; the bundled Llama
# (also pipelined by tests/test_seed_llama.py) on the deepest and the widest mesh
PIPELINE_CASES = [("hf", axes, mb) for axes in CASES for mb in (1, 2)] + [
    ("ours", dict(pp=4), 2), ("ours", dict(dp=2, tp=2, pp=2), 1)]


@pytest.mark.parametrize("make,axes,mb", PIPELINE_CASES,
                         ids=[_case_id(*c) for c in PIPELINE_CASES])
def test_llama_pipeline(make, axes, mb):
    model = our_llama(num_hidden_layers=4) if make == "ours" else hf_llama(layers=4)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    pm = fxshard.parallelize(model, mesh(**axes), microbatches=mb)
    torch.testing.assert_close(_logits(pm(ids)), _logits(model(ids)), **TOL)


def test_five_layers_on_two_stages_and_stage_contents():
    model = our_llama(num_hidden_layers=5)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(pp=2))
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    first, last = pm.rank_module(0).state_dict(), pm.rank_module(1).state_dict()
    assert "lm_head.weight" not in first and "model.embed_tokens.weight" in first
    assert "model.embed_tokens.weight" not in last and "lm_head.weight" in last
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1", "2"}
    assert {k.split(".")[2] for k in last if k.startswith("model.layers.")} == {"3", "4"}


@pytest.mark.parametrize("make", [our_llama, hf_llama], ids=["ours", "hf"])
def test_one_send_per_boundary_and_rope_never_sent(make):
    model = make(**({"num_hidden_layers": 4} if make is our_llama else {"layers": 4}))
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(pp=4), example_inputs=(ids,))
    for stage in range(4):
        gm = pm.rank_module(stage)
        sends, recvs = ops_in(gm, "fxshard.send"), ops_in(gm, "fxshard.recv")
        assert len(sends) == (1 if stage < 3 else 0)
        assert len(recvs) == (1 if stage > 0 else 0)
        for s in sends:  # only the hidden state [B, S, H] crosses a cut
            assert tuple(s.args[0].meta["val"].shape) == (2, 8, 64)
        assert ops_in(gm, "aten.cos"), "every stage recomputes its RoPE table"


def test_microbatches_send_once_per_microbatch_and_match():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (6, 8))
    pm = fxshard.parallelize(model, mesh(pp=2), microbatches=3)
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    assert len(ops_in(pm.rank_module(0), "fxshard.send")) == 1  # the program runs per microbatch
    assert tuple(ops_in(pm.rank_module(0), "fxshard.send")[0].args[0].meta["val"].shape)[0] == 2


class SkipStack(torch.nn.Module):
    """Blocks in a ModuleList not called ``layers``, and a value the last stage needs from the
    first (a long skip connection)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16),
                                                              torch.nn.Tanh()) for _ in range(4))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h0 = self.inp(x)
        h = h0
        for b in self.blocks:
            h = b(h)
        return self.out(h + h0)


def test_non_adjacent_value_and_custom_stack_name():
    torch.manual_seed(0)
    model = SkipStack().eval()
    x = torch.randn(4, 8)
    pm = fxshard.parallelize(model, mesh(pp=4))
    torch.testing.assert_close(pm(x), model(x), **TOL)
    sends0 = ops_in(pm.rank_module(0), "fxshard.send")
    assert sorted(s.args[2] for s in sends0) == [1, 3]  # h0 goes straight to the last stage


def test_parameter_bytes_per_rank():
    model = our_llama(num_hidden_layers=4)
    ids = torch.randint(0, 128, (2, 8))
    ex = fxshard.parallelize(model, mesh(tp=2, pp=2), example_inputs=(ids,)).explain()
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    for r in range(4):
        assert abs(ex.param_bytes[r] - (total - norms) / 4) <= norms


def test_bad_pipeline_inputs():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (3, 8))
    with pytest.raises(ValueError, match="pp axis has 4 stages but the model has only 2"):
        fxshard.parallelize(model, mesh(pp=4), example_inputs=(ids,))
    with pytest.raises(ValueError, match=r"shape \(3, 8\) cannot be split into microbatches=2"):
        fxshard.parallelize(model, mesh(pp=2), microbatches=2)(ids)


def test_stages_override():
    model = our_llama(num_hidden_layers=4)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh(pp=2), stages=[0, 1, 1, 1])
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    first = pm.rank_module(0).state_dict()
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0"}
    with pytest.raises(ValueError, match="must give each of the 4 layers"):
        fxshard.parallelize(model, mesh(pp=2), stages=[0, 1], example_inputs=(ids,))


class TwoStreams(torch.nn.Module):
    """Each block passes two values of one shape to the next, so two values cross every cut
    from the same stage: receiving them in another order than they were sent swaps them."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(TwoStreamBlock() for _ in range(2))

    def forward(self, x):
        a = self.inp(x)
        b = torch.tanh(a) * 3
        for blk in self.blocks:
            a, b = blk(a, b)
        return a - 2 * b


class TwoStreamBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fa = torch.nn.Linear(16, 16)
        self.fb = torch.nn.Linear(16, 16)

    def forward(self, a, b):
        return self.fa(a) + b, torch.sigmoid(self.fb(b)) - a


@pytest.mark.parametrize("mb", [1, 2])
def test_two_values_crossing_one_cut_keep_their_order(mb):
    torch.manual_seed(0)
    model = TwoStreams().eval()
    x = torch.randn(4, 8)
    pm = fxshard.parallelize(model, mesh(pp=2), microbatches=mb)
    torch.testing.assert_close(pm(x), model(x), **TOL)
    sends = ops_in(pm.rank_module(0), "fxshard.send")
    recvs = ops_in(pm.rank_module(1), "fxshard.recv")
    assert len(sends) == len(recvs) == 2
    assert [tuple(s.args[0].meta["val"].shape) for s in sends] == [(4 // mb, 16)] * 2


def test_explain_counts_per_forward_with_microbatches():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (4, 8))
    one, four = (fxshard.parallelize(model, mesh(tp=2, pp=2), example_inputs=(ids,),
                                     microbatches=m).explain() for m in (1, 4))
    # rank 0 is (tp=0, stage 0): embedding all-gather, 2 all-reduces in layer 0, one send
    assert one.counts(0) == {("all_gather", "tp"): 1, ("all_reduce", "tp"): 2, ("send", "pp"): 1}
    assert four.counts(0) == {k: 4 * n for k, n in one.counts(0).items()}
    assert four.counts(1) == {k: 4 * n for k, n in one.counts(1).items()}
    rows = {}
    for ex in (one, four):  # the table: 4x the calls, the same bytes per forward
        line = next(ln for ln in str(ex).splitlines() if ln.strip().startswith("all_reduce"))
        rows[ex.microbatches] = [int(v.replace(",", "")) for v in line.split()[2:]]
    assert rows[4][0] == 4 * rows[1][0] and rows[4][1:] == rows[1][1:]


@pytest.mark.parametrize("container,mb", [("dict", 1), ("dict", 2), ("seq", 1), ("seq", 2)])
def test_layer_stack_in_any_container(container, mb):
    """A ModuleDict (torchtitan's ``layers``) or Sequential stack splits as a ModuleList does:
    equal to one device, each stage holding its own layers' parameters only."""
    from tests.plain_lms import TinyLM
    model = TinyLM(layers=4, container=container,
                   positions="wpe" if container == "seq" else "table").eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    pm = fxshard.parallelize(model, mesh(pp=2), microbatches=mb)
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    first, last = pm.rank_module(0).state_dict(), pm.rank_module(1).state_dict()
    layers = {s: {k.split(".")[1] for k in sd if k.startswith("layers.")}
              for s, sd in ((0, first), (1, last))}
    assert layers == {0: {"0", "1"}, 1: {"2", "3"}}
    assert "wte.weight" in first and "wte.weight" not in last
    assert "head.weight" in last and "head.weight" not in first


def test_no_layer_container_is_a_clear_error():
    from tests.models import SimpleMLP
    with pytest.raises(ValueError, match="found no stack of repeated layers.*ModuleDict"):
        fxshard.parallelize(SimpleMLP(8), mesh(pp=2), example_inputs=(torch.randn(2, 8),))
