"""Training on real processes (gloo, 4 ranks, dp2·tp2): each rank's shard gradients and its
shards after two AdamW steps equal its blocks of the single-device model's; on dp2·tp2 and
fsdp2·tp2, ``tm.gradients()`` / ``tm.state_dict()`` (gathered to every rank) and
``clip_grad_norm_`` (each element counted once over the mesh) over three AdamW steps equal
the single-device model's."""
import copy
import datetime
import json
import os
import traceback

import pytest
import torch

from tests.launch import launch

WORLD = 4


def _whole_on_every_rank(report, names, model, ids, loss_of, rank):
    """Three AdamW steps with clipping on mesh ``names`` (2, 2): every rank's whole gradients
    (first step), norms and final state dict against a single-device copy."""
    import fxshard
    from fxshard.training import clip_grad_norm_, parallelize_for_training
    ref = copy.deepcopy(model)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    tm = parallelize_for_training(copy.deepcopy(model), mesh, example_inputs=(ids,))
    ours = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    key = "_".join(names)
    for step in range(3):
        ours.zero_grad()
        theirs.zero_grad()
        loss_of(tm(ids)).backward()
        loss_of(ref(ids)).backward()
        if step == 0:
            grads = tm.gradients()
            report[key + "_grads"] = max((grads[n] - p.grad).abs().max().item()
                                         for n, p in ref.named_parameters())
        norm = clip_grad_norm_(tm, 0.05)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        report.setdefault(key + "_norms", []).append([norm.item(), want.item()])
        ours.step()
        theirs.step()
    trained = tm.state_dict()
    report[key + "_params"] = max((trained[n] - p.detach()).abs().max().item()
                                  for n, p in ref.named_parameters())
    report[key + "_names"] = sorted(trained) == sorted(n for n, _ in ref.named_parameters())


def _worker(rank: int, port: int, out_dir: str, entry: str = "training") -> None:
    report = {"rank": rank, "errors": []}
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        import warnings
        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        import torch.distributed as dist
        import torch.nn.functional as F
        import fxshard
        from fxshard.mesh import mesh_spec
        from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
        from fxshard.placement import local_block
        from fxshard.training import parallelize_for_training
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        cfg = LlamaConfig.tiny(num_hidden_layers=2, vocab_size=96, hidden_size=48,
                               intermediate_size=72, num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(cfg)
        g = torch.Generator().manual_seed(1)
        ids, labels = torch.randint(0, 96, (4, 6), generator=g), torch.randint(0, 96, (4, 6),
                                                                                generator=g)

        def loss_of(logits):
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

        if entry == "training":
            for names in (("dp", "tp"), ("fsdp", "tp")):
                _whole_on_every_rank(report, names, model, ids, loss_of, rank)
        mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        initial = copy.deepcopy(model)
        if entry == "parallelize":   # pm(x) with grad enabled trains
            tm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
            report["ranks"] = tm.trainer.ranks
        else:
            tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
            report["ranks"] = tm.ranks
        # the reference trains a copy: pm's model object is not to be edited after training
        ref_model = copy.deepcopy(model) if entry == "parallelize" else model
        opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
        out = tm(ids)
        report["forward"] = (out - ref_model(ids)).abs().max().item()
        loss_of(out).backward()
        loss_of(ref_model(ids)).backward()
        spec = mesh_spec(mesh)
        specs = (tm.trainer if entry == "parallelize" else tm)._specs
        report["grad"] = max((p.grad - local_block(dict(ref_model.named_parameters())[n].grad,
                                                   specs[n], spec, rank)).abs().max().item()
                             for n, p in tm.shards(rank).items())
        opt.step()
        for _ in range(1):
            opt.zero_grad()
            loss_of(tm(ids)).backward()
            opt.step()
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
        ref.step()
        for _ in range(1):
            ref.zero_grad()
            loss_of(ref_model(ids)).backward()
            ref.step()
        report["params"] = max((p.detach() - local_block(dict(ref_model.named_parameters())[n]
                                                         .detach(), specs[n], spec, rank))
                               .abs().max().item() for n, p in tm.shards(rank).items())
        if entry == "parallelize":   # inference on the trained shards: the trained model's
            with torch.no_grad():
                report["after"] = (tm(ids) - ref_model(ids)).abs().max().item()
            report["kept"] = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                                  initial.parameters()))
    except BaseException:  # noqa: BLE001 - reported to the test process
        report["errors"].append(traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)


@pytest.mark.parametrize("entry", ["training", "parallelize"])
def test_dp2_tp2_gloo_gradients_and_steps(tmp_path, entry):
    reports = launch(_worker, WORLD, str(tmp_path), entry, timeout_s=300, grad=True)
    for rank, r in reports.items():
        assert not r["errors"], r["errors"][0]
        assert r["ranks"] == [rank]
        assert r["forward"] < 1e-4 and r["grad"] < 1e-5 and r["params"] < 1e-5, r
        assert entry == "training" or (r["after"] < 1e-4 and r["kept"]), r
        if entry == "training":
            for key in ("dp_tp", "fsdp_tp"):
                assert r[key + "_grads"] < 1e-5 and r[key + "_params"] < 1e-5, (key, r)
                assert r[key + "_names"], key
                norms = r[key + "_norms"]
                assert all(w > 0.05 for _, w in norms), norms     # every step clips
                assert all(abs(a - w) <= 1e-5 * w for a, w in norms), (key, norms)
