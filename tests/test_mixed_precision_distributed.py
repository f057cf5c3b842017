"""The bf16 mixed-precision policy on real processes (gloo, 4 ranks, fsdp2·tp2): three AdamW
steps no further from float64 than the policy applied by hand on one device
(tests/mixed_reference.py), fp32 masters, gradients and AdamW state on every rank, and the
fsdp gathers moving bf16."""
from tests.launch import gloo_job

WORLD = 4


def _body(rank: int, report: dict) -> None:
    import copy

    import torch

    import fxshard
    from tests.mixed_reference import mixed_steps_close
    from tests.test_mixed_precision import BF16, _ids, _loss_of
    from tests.test_train_grads import _llama
    model, (ids, labels) = _llama(layers=1), _ids()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    pm = fxshard.parallelize(copy.deepcopy(model), mesh, mixed_precision=BF16)
    mixed_steps_close(pm, model, BF16, _loss_of(ids, labels))   # raises: report["errors"]
    report["steps"] = True
    gathers = [n for n in pm.rank_module(rank, "forward").graph.nodes
               if str(n.target).startswith("fxshard.all_gather") and "fsdp" in n.args]
    report["gathers_bf16"] = bool(gathers) and all(
        x.meta["val"].dtype == torch.bfloat16 for n in gathers
        for x in (n.args[0] if isinstance(n.args[0], list) else [n.args[0]]))


def test_fsdp2_tp2_gloo_bf16_policy(tmp_path):
    reports = gloo_job(_body, WORLD, str(tmp_path), timeout_s=400, grad=True)
    assert sorted(reports) == list(range(WORLD))
    for rank, r in reports.items():
        assert not r["errors"] and r["steps"] and r["gathers_bf16"], (rank, r)
