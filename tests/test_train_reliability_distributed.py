"""Training on real processes (gloo, 2 ranks, tp=2): ranks that freeze different parameters
(``requires_grad_(False)`` on rank 1 only) are a ValueError on every rank naming each rank's
frozen set (issue 43 item 7); it trained half of ``lm_head`` silently."""
import pytest

from tests.launch import gloo_job
from tests.test_train_grads import _data, _llama, _loss

WORLD = 2


def _body(rank: int, report: dict) -> None:
    import fxshard
    model = _llama(layers=1)
    ids, labels = _data()
    if rank == 1:
        model.lm_head.weight.requires_grad_(False)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    try:
        _loss(pm(ids), labels).backward()
        report["raised"] = None
    except ValueError as e:
        report["raised"] = str(e)
    # every rank frozen alike: trains, the frozen shard without a gradient
    model.lm_head.weight.requires_grad_(False)
    _loss(pm(ids), labels).backward()
    report["frozen_grad_none"] = pm.shards(rank)["lm_head.weight"].grad is None
    report["others_have_grads"] = all(p.grad is not None for n, p in pm.shards(rank).items()
                                      if n != "lm_head.weight")


def test_ranks_freezing_different_parameters_raise(tmp_path):
    reports = gloo_job(_body, WORLD, str(tmp_path), timeout_s=240, grad=True)
    for rank, r in reports.items():
        assert r["raised"] is not None, f"rank {rank} trained with different frozen sets"
        assert "frozen_parameters" in r["raised"] and "lm_head.weight" in r["raised"], r
        assert "freeze the same parameters" in r["raised"], r
        assert r["frozen_grad_none"] and r["others_have_grads"], r
