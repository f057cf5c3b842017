"""``recompute="layers"``: each repeated layer saves only its output; the backward recomputes
the rest (an int: a budget of saved bytes per rank, as few layers recomputed as fit).
Gradients equal one device; the saved bytes per rank (measured on the step and in
``explain()``) are lower; the backward holds the same collectives (the forward's tp
collectives are saved, not redone; fsdp's gathers are redone, not saved); bad values and a
model without repeated layers are clear errors. Sizes as tests/test_train_grads.py (uneven).
"""
import copy

import pytest
import torch

import fxshard
from fxshard.explain import collectives_of
from fxshard.training import parallelize_for_training
from tests.test_train_grads import _data, _llama, _loss


class _Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _counts(gm, spec):
    out: dict = {}
    for c in collectives_of(gm.graph, spec):
        out[(c.op, c.axis)] = out.get((c.op, c.axis), 0) + 1
    return out


def _saved_ops(gm) -> list:
    """What each of the backward's saved inputs is (its op in the forward)."""
    return [str(n.meta.get("original_aten") or n.target) for n in gm.graph.nodes
            if n.op == "placeholder" and n.name.startswith("saved_")]


@pytest.mark.parametrize("axes,sp", [({"tp": 2}, True), ({"fsdp": 2, "tp": 2}, False)])
def test_recompute_layers_equal_gradients_fewer_saved_bytes(axes, sp):
    model = _llama(layers=2)
    ref = copy.deepcopy(model)
    ids, labels = _data(seq=6)
    _loss(ref(ids), labels).backward()
    runs = {}
    for recompute in (None, "layers"):
        pm = fxshard.parallelize(copy.deepcopy(model), _mesh(**axes), sequence_parallel=sp,
                                 recompute=recompute)
        _loss(pm(ids), labels).backward()
        grads = pm.gradients()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
        ex, bwd = pm.explain(), pm.rank_module(0, "backward")
        runs[recompute] = (pm.trainer.memory(0)["saved"], ex.train_memory[0]["saved"],
                           _counts(bwd, pm.spec), _saved_ops(bwd), bwd)
    (m0, e0, c0, s0, _), (m1, e1, c1, s1, bwd) = runs[None], runs["layers"]
    assert m1 == e1 and m1 < m0 / 2 and e0 == m0          # measured = explain()
    assert c1 == c0                                       # no collective redone or added
    assert len(s1) < len(s0)
    recomputed = [n for n in bwd.graph.nodes if n.meta.get("fxshard_recompute")]
    assert any("_scaled_dot_product" in str(n.target) for n in recomputed)
    # fsdp: a recomputed layer reads the gathered weight made in the backward, never saved
    saved_gathers = [n.name for n in bwd.graph.nodes if n.op == "placeholder" and
                     (getattr(n.meta.get("fxshard_collective"), "axis", None),
                      getattr(n.meta.get("fxshard_collective"), "op", None)) ==
                     ("fsdp", "all_gather")]
    assert saved_gathers == []
    if "tp" in axes and sp:     # sequence parallelism's collectives: outputs saved, not redone
        assert any("all_gather" in s or "all_to_all" in s for s in s1)


def test_recompute_budget_recomputes_as_few_layers_as_fit_and_trains_as_one_device():
    model = _llama(layers=2)
    ids, labels = _data()

    def build(recompute):
        pm = fxshard.parallelize(copy.deepcopy(model), _mesh(dp=2), recompute=recompute,
                                 example_inputs=(ids,))
        pm.parameters()
        return pm, pm.explain().train_memory[0]["saved"]    # from the programs' shapes
    (_, none), (_, every) = build(None), build("layers")
    pm, one = build(none - 1)              # one layer recomputed is enough
    assert every < one < none
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(p, lr=1e-2, eps=1e-6)
                    for p in (pm.parameters(), ref.parameters()))
    for _ in range(2):
        for o, step in ((opt, pm), (ref_opt, ref)):
            o.zero_grad()
            _loss(step(ids), labels).backward()
            o.step()
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    # the budget reaches parallelize_for_training's programs too
    with pytest.raises(ValueError, match=rf"recompute={every - 1} bytes per rank cannot be "
                                         rf"met for LlamaForCausalLM.*saves {every} bytes"):
        parallelize_for_training(model, _mesh(dp=2), recompute=every - 1,
                                 example_inputs=(ids,))


def test_recompute_errors():
    model = _llama(layers=1)
    with pytest.raises(ValueError, match=r"parallelize: recompute='all'.*None.*'layers'"):
        fxshard.parallelize(model, _mesh(dp=2), recompute="all")
    for bad in (True, -1, 0.5):
        with pytest.raises(ValueError, match=rf"recompute={bad} is not an option.*an int"):
            parallelize_for_training(model, _mesh(dp=2), recompute=bad)
    pm = fxshard.parallelize(_Flat(), _mesh(dp=2), recompute="layers")
    with pytest.raises(ValueError, match=r"no repeated layer in _Flat.*recompute=None"):
        pm(torch.randn(4, 6))
