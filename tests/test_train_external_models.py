"""Training models from litgpt, torchtune and torchtitan: their own model code, unmodified,
tiny random configs (tests/external_models.py), on the most composed training mesh.

litgpt's Mixtral picks each expert's tokens with ``torch.where(mask)``: its joint graph holds
sizes known only at run time (:mod:`fxshard.training.dynamic_sizes`); it trains over steps
whose routing differs, and ``compile=True`` on it is a clear error.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxshard
from tests.external_models import EXTERNAL, is_weight_of_layers, token_ids
from tests.test_external_models import SAME_CODE, _needs
from tests.train_checks import adamw_steps_equal, loss_and_grads_equal


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", list(EXTERNAL))
def test_training_on_fsdp_tp_sp_matches_single_device(name):
    """Training the library's own model code on fsdp2·tp2 with sequence parallelism: the loss
    and every parameter's gradient equal one device's (1e-5), and rank 0 holds at most
    0.3 of the layer matrices (a quarter, plus the weights kept whole on tp: the MoE router,
    MLA's latent projection, multi-query K/V). litgpt's Mixtral picks each expert's tokens
    with torch.where(mask): its joint graph holds sizes known only at run time."""
    _needs(name)
    if name in SAME_CODE:
        pytest.skip(f"{name} runs {SAME_CODE[name]}'s code")
    model = EXTERNAL[name][2](2)
    ref = copy.deepcopy(model).eval()
    ids, labels = token_ids(4, 16), token_ids(4, 16).roll(1, 0)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    pm = fxshard.parallelize(model, mesh, sequence_parallel=True)

    def loss_of(module):
        out = _logits(module(ids))
        return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
    try:
        loss_and_grads_equal(pm, ref, loss_of)
        mine = pm.shards(0)
        full = local = 0
        for fqn, p in ref.named_parameters():
            if p.dim() >= 2 and is_weight_of_layers(fqn) and fqn in mine:
                full, local = full + p.numel(), local + mine[fqn].numel()
        assert 0 < local / full <= 0.3, (name, local / full)
    finally:
        pm.close()


@pytest.mark.parametrize("axes", [("tp",), ("dp", "tp")])
def test_where_routed_moe_trains_over_steps_that_route_differently(axes):
    """litgpt's Mixtral (``token_idx, expert_idx = torch.where(mask)`` per expert, then
    ``y[token_idx] += ..``): three AdamW steps with clipping, each on another batch (other
    token counts per expert), equal one device's; the rank programs hold the ``nonzero`` and
    no stand-in size. It was a NotImplementedError (aot_autograd's static trace)."""
    _needs("litgpt_mixtral")
    torch.manual_seed(0)
    model = EXTERNAL["litgpt_mixtral"][2](1)
    ref = copy.deepcopy(model).eval()
    mesh = fxshard.init_device_mesh("cpu", (2,) * len(axes), mesh_dim_names=axes)
    pm = fxshard.parallelize(model, mesh, example_inputs=(token_ids(4, 16),))
    batches = iter([token_ids(4, 16).roll(k, 1) * (k + 1) % 128 for k in range(3)
                    for _ in (pm, ref)])

    def loss_of(module):
        ids = next(batches)
        return F.cross_entropy(_logits(module(ids)).flatten(0, 1), ids.roll(1, 1).flatten())

    try:
        # AdamW's eps 1e-4: with 1e-6 its step amplifies the rounding of gradients near 0
        # (HF's Mixtral drifts alike, 3e-5 after three steps of lr 1e-2)
        adamw_steps_equal(pm, ref, loss_of, eps=1e-4)
        experts = {f: p for f, p in ref.named_parameters() if ".experts." in f}
        assert experts and all(pm.shards(0)[f].numel() * 2 == p.numel()   # split on tp
                               for f, p in experts.items()), experts.keys()
        for which in ("forward", "backward"):
            code = pm.rank_module(0, which).code
            assert "nonzero" in code or which == "backward", code
            assert "1099511627" not in code, code    # 2**40: a stand-in read as a number
    finally:
        pm.close()


def test_compiling_a_where_routed_moe_for_training_is_a_clear_error():
    """The backward takes the saved rows of each expert, whose count changes every step:
    Inductor would fix it to the first step's; compile=True says so (inference compiles)."""
    _needs("litgpt_mixtral")
    model = EXTERNAL["litgpt_mixtral"][2](1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, compile=True)
    try:
        with pytest.raises(NotImplementedError, match=r"compile=True: this program's input "
                           r"\w+ \(u\d+.*known only when it runs.*Use compile=False"):
            pm(token_ids(2, 8))
    finally:
        pm.close()


def test_a_stand_in_size_read_as_a_number_is_an_error():
    """A size known only at run time that a pass read with int() (its stand-in, 2**40 + 1)
    must not reach a program: check_no_stand_ins names the node; sys.maxsize (a slice to
    the end) is not one."""
    from fxshard.training.dynamic_sizes import STAND_IN, check_no_stand_ins
    g = torch.fx.Graph()
    x = g.placeholder("x")
    end = g.call_function(torch.ops.aten.slice.Tensor, (x, 0, 0, 2 ** 63 - 1))
    g.output(g.call_function(torch.ops.aten.view.default, (end, [STAND_IN + 1, 64])))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(NotImplementedError, match=r"where: .*view.*holds 1099511627777, a size "
                       r"known only when the program runs"):
        check_no_stand_ins(gm, "where")
    g2 = torch.fx.Graph()
    y = g2.placeholder("x")
    g2.output(g2.call_function(torch.ops.aten.slice.Tensor, (y, 0, 0, 2 ** 63 - 1)))
    check_no_stand_ins(torch.fx.GraphModule(torch.nn.Module(), g2), "where")   # no error


def _where_moe_body(rank, report):
    """One rank of a dp2·tp2 gloo job: litgpt's Mixtral, two AdamW steps on batches routed
    differently; this rank's gradient and parameter shards against one device's."""
    from tests.launch import mesh, worst_block
    torch.manual_seed(0)
    model = EXTERNAL["litgpt_mixtral"][2](1)
    ref = copy.deepcopy(model).eval()
    pm = fxshard.parallelize(model, mesh(dp=2, tp=2), example_inputs=(token_ids(4, 16),))
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4)  # noqa: E731  (see above)
    ours, theirs = make(pm.parameters()), make(ref.parameters())
    report["grad"] = report["params"] = 0.0
    for k in range(2):
        ids = token_ids(4, 16).roll(k, 1) * (k + 1) % 128
        for module in (pm, ref):
            F.cross_entropy(_logits(module(ids)).flatten(0, 1), ids.roll(1, 1).flatten()
                            ).backward()
        report["grad"] = max(report["grad"], worst_block(
            pm.shards(rank), dict(ref.named_parameters()), pm.trainer._specs, pm.spec, rank,
            of=lambda p: p.grad))
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad()
    report["params"] = worst_block(pm.shards(rank), dict(ref.named_parameters()),
                                   pm.trainer._specs, pm.spec, rank)


def test_where_routed_moe_trains_on_gloo_ranks(tmp_path):
    """The same programs under torch.distributed (4 gloo processes, dp2·tp2): sizes known only
    at run time are read from each rank's own tensors."""
    _needs("litgpt_mixtral")
    from tests.launch import gloo_job
    reports = gloo_job(_where_moe_body, 4, str(tmp_path), timeout_s=300, grad=True)
    for r in reports.values():
        assert r["grad"] < 1e-5 and r["params"] < 1e-5, r


@pytest.mark.parametrize("axes", [dict(dp=2), dict(fsdp=2, tp=2), dict(pp=2)],
                         ids=["dp2", "fsdp2tp2", "pp2"])
def test_pytorch_tensor_parallel_test_transformer_trains(axes):
    """The model of PyTorch's own tensor-parallel tests (``common_dtensor.Transformer``):
    its learned position table is read at ``torch.arange(S, device=tokens.device)``, which
    the trace on meta inputs baked as ``device="meta"`` (FakeTensorDeviceMismatchError in the
    joint graph on every mesh). Gradients equal one device's, and three AdamW steps are no
    further from a float64 run than one device's."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                             Transformer)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=32,
                                  n_heads=4, dropout_p=0.0,
                                  weight_tying="pp" not in axes))   # pp: a clear error if tied
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(1, 1)
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))

    def loss_of(m):
        return F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())

    adamw_steps_equal(pm, ref, loss_of, ref64=ref64)
