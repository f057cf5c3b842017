"""Expert parallelism on real processes (gloo, 2 ranks, ep2, issue 44): the token exchanges go
through ``torch.distributed.all_to_all_single`` with split sizes read at run time. HF Mixtral
with uneven routing (rank 0's tokens all on its own experts, rank 1's spread): inference
equals one device, and three AdamW steps of training give every rank the single-device
gradients and parameters (``tm.gradients()`` / ``tm.state_dict()``, gathered on each rank)."""
import copy

import torch
import torch.nn.functional as F

from tests.launch import gloo_job

WORLD = 2


def _body(rank: int, report: dict) -> None:
    import fxshard
    from fxshard.training import parallelize_for_training
    from tests.families import mixtral
    from tests.test_expert_parallel import _force_routing
    model = mixtral(1)
    # even ids: experts 0 and 1 (rank 0's); odd ids: experts 1 and 3 (one per rank)
    _force_routing(model, [2, 1, 0, -1], [0, 2, -1, 1])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    ids[0] = ids[0] - ids[0] % 2
    labels = torch.randint(0, 128, (2, 8), generator=g)
    mesh = fxshard.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    with torch.no_grad():
        pm = fxshard.parallelize(copy.deepcopy(model).eval(), mesh)
        report["inference"] = (pm(ids).logits - model.eval()(ids).logits).abs().max().item()
    model.train()
    ref = copy.deepcopy(model)
    with torch.enable_grad():
        tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
        ours = torch.optim.AdamW(tm.parameters(), lr=1e-2, eps=1e-6)
        theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
        for step in range(3):
            ours.zero_grad()
            theirs.zero_grad()
            F.cross_entropy(tm(ids).logits.flatten(0, 1), labels.flatten()).backward()
            F.cross_entropy(ref(ids).logits.flatten(0, 1), labels.flatten()).backward()
            if step == 0:
                grads = tm.gradients()
                report["grads"] = max((grads[n] - p.grad).abs().max().item()
                                      for n, p in ref.named_parameters())
            ours.step()
            theirs.step()
        trained = tm.state_dict()
    report["params"] = max((trained[n] - p.detach()).abs().max().item()
                           for n, p in ref.named_parameters())
    report["dispatches"] = sum(c.op == "expert_dispatch" for c in tm.collectives("backward"))


def test_ep2_gloo_inference_and_training_equal_one_device(tmp_path):
    reports = gloo_job(_body, WORLD, str(tmp_path), timeout_s=400)
    for rank, r in reports.items():
        assert r["inference"] <= 1e-4, (rank, r)
        assert r["grads"] <= 1e-5, (rank, r)
        assert r["params"] <= 1e-5, (rank, r)
        assert r["dispatches"] == 1, (rank, r)
