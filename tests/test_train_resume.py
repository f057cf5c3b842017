"""Resumable, reshardable training state (``fxshard.save_training_state`` /
``load_training_state``, a torch.distributed.checkpoint directory): two AdamW steps on mesh A,
save, load into a new pm and a new optimizer on mesh B; steps 3-4 equal the uninterrupted
single-device run (1e-5). Simulated meshes here; real ranks (gloo, fsdp4 -> dp2·tp2, each
process writing its own shards, the resumed run recomputing its layers; then HF Phi-3's fused
projections, strided shards, dp2·tp2 -> tp4) in one launch. Sizes
uneven as tests/test_train_grads.py.
"""
import copy
import os

import pytest
import torch

import fxshard
from tests.launch import gloo_job, worst_block
from tests.test_train_grads import _data, _llama, _loss

WORLD = 4


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _adamw(params):
    # eps 1e-6 (AdamW's default 1e-8): see tests/train_checks.py, the step of a gradient near
    # 0 turns its rounding (another summation order) into a difference of about lr
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def _steps(model_call, opt, ids, labels, n, sched=None):
    for _ in range(n):
        opt.zero_grad()
        _loss(model_call(ids), labels).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("a,b", [({"fsdp": 4}, {"tp": 2, "dp": 2}), ({"tp": 2}, {"dp": 2})])
def test_resume_on_another_mesh_equals_not_stopping(tmp_path, a, b):
    model = _llama(layers=1)
    ref = copy.deepcopy(model)
    ids, labels = _data(seq=6)
    ref_opt = _adamw(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    _steps(ref, ref_opt, ids, labels, 4, ref_sched)

    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(**a), example_inputs=(ids,))
    opt = _adamw(pm.parameters())
    _steps(pm, opt, ids, labels, 2, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    fxshard.save_training_state(pm, opt, str(tmp_path / "step2"))

    fresh = _llama(layers=1)
    torch.nn.init.zeros_(fresh.model.embed_tokens.weight)   # overwritten by the load
    pm2 = fxshard.training.parallelize_for_training(fresh, _mesh(**b), example_inputs=(ids,))
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=123.0, eps=1e-6)    # lr, state: the checkpoint's
    fxshard.load_training_state(pm2, opt2, str(tmp_path / "step2"))
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    _steps(pm2, opt2, ids, labels, 2, sched2)
    trained = pm2.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    step = {float(s["step"]) for s in opt2.state.values()}
    assert step == {4.0}


def test_resume_errors(tmp_path):
    model = _llama(layers=1)
    ids, _ = _data(seq=6)
    pm = fxshard.parallelize(model, _mesh(dp=2), example_inputs=(ids,))
    stray = torch.optim.AdamW(list(pm.parameters()) + [torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match=r"save_training_state: the optimizer holds a "
                                         r"parameter of shape \(3,\).*pm\.parameters\(\)"):
        fxshard.save_training_state(pm, stray, str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"not a torch.distributed.checkpoint directory"):
        fxshard.load_training_state(pm, _adamw(pm.parameters()), str(tmp_path / "none"))
    other = _llama(layers=2)
    pm2 = fxshard.parallelize(other, _mesh(dp=2), example_inputs=(ids,))
    fxshard.save_training_state(pm, _adamw(pm.parameters()), str(tmp_path / "one"))
    with pytest.raises(ValueError, match=r"holds no model\.layers\.1\..*same model"):
        fxshard.load_training_state(pm2, _adamw(pm2.parameters()), str(tmp_path / "one"))


def _body(rank: int, report: dict, ckpt: str) -> None:
    import torch.distributed as dist
    from fxshard.mesh import mesh_spec
    model = _llama(layers=1)
    ref = copy.deepcopy(model)
    ids, labels = _data(seq=6)
    ref_opt = _adamw(ref.parameters())
    _steps(ref, ref_opt, ids, labels, 4)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(fsdp=4), example_inputs=(ids,))
    opt = _adamw(pm.parameters())
    _steps(pm, opt, ids, labels, 2)
    fxshard.save_training_state(pm, opt, ckpt)
    report["files"] = sorted(os.listdir(ckpt))
    mesh_b = _mesh(dp=2, tp=2)
    pm2 = fxshard.parallelize(_llama(layers=1), mesh_b, example_inputs=(ids,),
                              recompute="layers")     # composes with resuming
    opt2 = _adamw(pm2.parameters())
    fxshard.load_training_state(pm2, opt2, ckpt)
    _steps(pm2, opt2, ids, labels, 2)
    spec, specs = mesh_spec(mesh_b), pm2.trainer._specs
    full = dict(ref.named_parameters())
    report["params"] = worst_block(pm2.shards(rank), full, specs, spec, rank)
    report["moments"] = worst_block(pm2.shards(rank), full, specs, spec, rank,
                                    of=lambda p: opt2.state[p]["exp_avg_sq"],
                                    full_of=lambda p: ref_opt.state[p]["exp_avg_sq"])
    report["step"] = sorted({float(s["step"]) for s in opt2.state.values()})
    dist.barrier()
    pm.close()
    pm2.close()
    _fused_body(rank, report, ckpt + "_fused")


def _phi3_one_kv_head():
    import transformers
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0))


def _fused_body(rank: int, report: dict, ckpt: str) -> None:
    """Phi-3's fused qkv_proj / gate_up_proj (strided shards, K/V kept whole on tp: no DTensor
    placement, gathered whole for DCP) saved on dp2·tp2, resumed on tp4."""
    import torch.distributed as dist
    from fxshard.mesh import mesh_spec
    ids, labels = _data(seq=6)
    ref = _phi3_one_kv_head()
    ref_opt = _adamw(ref.parameters())
    _steps(lambda x: ref(x).logits, ref_opt, ids, labels, 4)
    pm = fxshard.parallelize(_phi3_one_kv_head(), _mesh(dp=2, tp=2), example_inputs=(ids,))
    opt = _adamw(pm.parameters())
    _steps(lambda x: pm(x).logits, opt, ids, labels, 2)
    fxshard.save_training_state(pm, opt, ckpt)
    mesh_b = _mesh(tp=4)
    pm2 = fxshard.parallelize(_phi3_one_kv_head(), mesh_b, example_inputs=(ids,))
    opt2 = _adamw(pm2.parameters())
    fxshard.load_training_state(pm2, opt2, ckpt)
    _steps(lambda x: pm2(x).logits, opt2, ids, labels, 2)
    spec, specs = mesh_spec(mesh_b), pm2.trainer._specs
    full = dict(ref.named_parameters())
    report["fused_spec"] = str(specs["model.layers.0.self_attn.qkv_proj.weight"])
    report["fused_params"] = worst_block(pm2.shards(rank), full, specs, spec, rank)
    report["fused_moments"] = worst_block(pm2.shards(rank), full, specs, spec, rank,
                                          of=lambda p: opt2.state[p]["exp_avg_sq"],
                                          full_of=lambda p: ref_opt.state[p]["exp_avg_sq"])
    dist.barrier()
    pm.close()
    pm2.close()


def test_resume_on_real_ranks_fsdp4_to_dp2_tp2(tmp_path):
    reports = gloo_job(_body, WORLD, str(tmp_path), str(tmp_path / "ckpt"), timeout_s=600,
                       grad=True)
    for r, rep in reports.items():
        assert rep["params"] < 1e-5 and rep["moments"] < 1e-5 and rep["step"] == [4.0], rep
        # (it raised NotImplementedError: a strided shard has no DTensor placement)
        assert "StridedShard" in rep["fused_spec"], rep
        assert rep["fused_params"] < 1e-5 and rep["fused_moments"] < 1e-5, rep
    # each process wrote its own file (DCP), the metadata once
    assert reports[0]["files"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)]
