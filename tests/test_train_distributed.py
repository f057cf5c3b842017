"""Training on real processes (gloo, 4 ranks, dp2·tp2): each rank's shard gradients and its
shards after two AdamW steps equal its blocks of the single-device model's; on dp2·tp2 and
fsdp2·tp2, ``tm.gradients()`` / ``tm.state_dict()`` (gathered to every rank) and
``clip_grad_norm_`` (each element counted once over the mesh) over three AdamW steps equal
the single-device model's, and on fsdp2·tp2 no rank holds more than half of a parameter and
the rank programs gather (reduce-scatter) once per layer (the fsdp tests' real-process
check: the bucket collectives on torch.distributed). One launch checks it all."""
import copy

import torch
import torch.nn.functional as F

from tests.launch import gloo_job, worst_block
from tests.test_train_grads import _data, _llama, _loss

WORLD = 4


def _whole_on_every_rank(report, names, model, ids, loss_of, rank):
    """Three AdamW steps with clipping on mesh ``names`` (2, 2): every rank's whole gradients
    (first step), norms and final state dict against a single-device copy."""
    import fxshard
    from fxshard.training import clip_grad_norm_, parallelize_for_training
    ref = copy.deepcopy(model)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    tm = parallelize_for_training(copy.deepcopy(model), mesh, example_inputs=(ids,))
    ours = torch.optim.AdamW(tm.parameters(), lr=1e-3, eps=1e-6)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
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
    full = dict(ref.named_parameters())
    # the collectives that ran: fsdp's buckets (one per layer, one for norm + head)
    report[key + "_buckets"] = [
        sum(str(n.target) == f"fxshard.{op}.default" for n in tm.rank_module(rank, kind).graph.nodes)
        for kind, op in (("forward", "all_gather_bucket"), ("backward", "all_gather_bucket"),
                         ("backward", "reduce_scatter_bucket"))]
    report[key + "_split"] = all(2 * p.numel() <= full[n].numel()
                                 for n, p in tm.shards(rank).items())


def _body(rank: int, report: dict) -> None:
    import fxshard
    from fxshard.mesh import mesh_spec
    model = _llama()
    ids, labels = _data()

    def loss_of(logits):
        return _loss(logits, labels)

    for names in (("dp", "tp"), ("fsdp", "tp")):
        _whole_on_every_rank(report, names, model, ids, loss_of, rank)
    # each rank's own shards: pm(x) with grad enabled trains (the same TrainModule as
    # parallelize_for_training's, checked whole above)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    initial = copy.deepcopy(model)
    tm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    report["ranks"] = tm.trainer.ranks
    # the reference trains a copy: pm's model object is not to be edited after training
    ref_model = copy.deepcopy(model)
    with torch.no_grad():   # an inference program bound ahead of training: re-bound after
        report["before"] = (tm(ids) - ref_model(ids)).abs().max().item()
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3, eps=1e-6)
    out = tm(ids)
    # the logits: this rank's block (its dp rows, its tp columns:
    # fxshard.training.vocab_output), gathered on first use as a whole tensor (the
    # subtraction: over tp, then dp), a cross-entropy on the block
    report["blocks"] = [tuple(b.shape) for b in out.blocks]
    report["forward"] = (out - ref_model(ids)).abs().max().item()
    loss_of(out).backward()
    loss_of(ref_model(ids)).backward()
    spec, specs = mesh_spec(mesh), tm.trainer._specs
    named = dict(ref_model.named_parameters())
    report["grad"] = worst_block(tm.shards(rank), named, specs, spec, rank, of=lambda p: p.grad)
    opt.step()
    opt.zero_grad()
    loss_of(tm(ids)).backward()
    opt.step()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-6)
    ref.step()
    ref.zero_grad()
    loss_of(ref_model(ids)).backward()
    ref.step()
    report["params"] = worst_block(tm.shards(rank), named, specs, spec, rank)
    with torch.no_grad():   # inference on the trained shards: the trained model's
        report["after"] = (tm(ids) - ref_model(ids)).abs().max().item()
    report["kept"] = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                          initial.parameters()))
    # train_step(loss_fn=): the loss traced with the model (ranks agree on it by name), its
    # cross-entropy vocab-parallel: no all-gather of the logits in the forward program
    pm = fxshard.parallelize(copy.deepcopy(initial), mesh, example_inputs=(ids,))
    fresh = copy.deepcopy(initial)
    loss = pm.train_step(ids, loss_fn=lambda out, t: _loss(out, t), target=labels)
    want = _loss(fresh(ids), labels)
    want.backward()
    report["lossfn_loss"] = (loss - want).abs().item()
    report["lossfn_grad"] = worst_block(pm.shards(rank), dict(fresh.named_parameters()),
                                        pm.trainer._specs, spec, rank, of=lambda p: p.grad)
    # a shifted, smoothed, masked cross-entropy on pm(ids)'s blocks: tp reductions on gloo
    pm2 = fxshard.parallelize(copy.deepcopy(initial), mesh, example_inputs=(ids,))
    fresh2 = copy.deepcopy(initial)

    weight = torch.linspace(0.5, 1.5, 96)

    def shifted(logits, reduction="mean", smoothing=0.1):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=int(labels[0, 1]), label_smoothing=smoothing,
                               weight=weight, reduction=reduction)
    out2, fresh_out = pm2(ids), fresh2(ids)
    loss2, want2 = shifted(out2), shifted(fresh_out)
    # unsmoothed: the one-piece cross-entropy (CrossEntropyRows), its rows gathered
    rows, want_rows = shifted(out2, "none", 0.0), shifted(fresh_out, "none", 0.0)
    report["blocks_rows"] = (rows - want_rows).abs().max().item()
    (loss2 + 0.5 * rows.sum()).backward()
    (want2 + 0.5 * want_rows.sum()).backward()
    report["blocks_loss"] = (loss2 - want2).abs().item()
    report["blocks_grad"] = worst_block(pm2.shards(rank), dict(fresh2.named_parameters()),
                                        pm2.trainer._specs, spec, rank, of=lambda p: p.grad)
    report["blocks_gathers"] = sum(c.op.startswith("all_gather") and c.axis in ("tp", "dp")
                                   and c.shape[-1:] == (96 // 2,)
                                   for c in pm2.trainer.collectives("forward"))
    report["lossfn_gathers"] = sum(c.op.startswith("all_gather") and c.axis == "tp"
                                   and c.shape[-1:] == (96 // 2,)
                                   for c in pm.trainer.collectives("forward"))


def test_dp2_tp2_gloo_gradients_and_steps(tmp_path):
    reports = gloo_job(_body, WORLD, str(tmp_path), timeout_s=300, grad=True)
    for rank, r in reports.items():
        assert r["ranks"] == [rank]
        assert r["forward"] < 1e-4 and r["grad"] < 1e-5 and r["params"] < 1e-5, r
        assert r["before"] < 1e-4 and r["after"] < 1e-4 and r["kept"], r
        assert r["lossfn_loss"] < 1e-5 and r["lossfn_grad"] < 1e-5, r
        assert r["lossfn_gathers"] == 0, r
        assert r["blocks"] == [[2, 6, 48]], r     # (the report is JSON)
        assert r["blocks_loss"] < 1e-5 and r["blocks_grad"] < 1e-5, r
        assert r["blocks_rows"] < 1e-5, r
        assert r["blocks_gathers"] == 0, r
        for key in ("dp_tp", "fsdp_tp"):
            assert r[key + "_grads"] < 1e-5 and r[key + "_params"] < 1e-5, (key, r)
            assert r[key + "_names"], key
            norms = r[key + "_norms"]
            assert all(w > 0.05 for _, w in norms), norms     # every step clips
            assert all(abs(a - w) <= 1e-5 * w for a, w in norms), (key, norms)
        # fsdp: every rank holds at most half of each parameter; its collectives per layer
        assert r["fsdp_tp_split"], r
        assert r["fsdp_tp_buckets"] == [3, 3, 3] and r["dp_tp_buckets"] == [0, 0, 0], r
