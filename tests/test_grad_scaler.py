"""Loss scaling over ``pm.parameters()`` (issue 42 item 4): ``torch.amp.GradScaler`` and
``fxshard.GradScaler`` skip a step on every rank or on none, so a scaled run equals one
device's ``GradScaler`` run step for step: the same steps skipped (an inf or a nan injected
into one rank's gradient shard), the same scale sequence (halved on the skip, grown after
``growth_interval`` clean steps), the same parameters. On a simulated mesh every rank's shards
sit in the one optimizer; under ``torchrun`` (gloo, 2 processes) the check is all-reduced."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxshard
from tests.launch import gloo_job

INIT, GROWTH_INTERVAL, INJECT = 2.0 ** 10, 2, 1
SCALES = [1024.0, 512.0, 512.0, 1024.0]     # clean, inf (halved), clean, clean (grown)


def _llama():
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=2, vocab_size=64,
                                             hidden_size=32, intermediate_size=48,
                                             num_attention_heads=4, num_key_value_heads=2))


def _ids(step: int):
    return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(step))


def _loss(out, ids):
    return F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _train(module, params, scaler, poison, steps=len(SCALES)):
    """``steps`` scaled AdamW steps; ``poison(step)`` may write an inf into a gradient."""
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    scales = []
    for step in range(steps):
        ids = _ids(step)
        scaler.scale(_loss(module(ids), ids)).backward()
        if step == INJECT:
            poison()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _inf_into_first(params, value=float("inf")):
    def poison():
        with torch.no_grad():
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = value
    return poison


# mesh, the scaler (torch's own, the call scripts make, or fxshard's), the value injected
MESHES = {"dp2": ((2,), ("dp",), torch.amp.GradScaler, float("inf")),
          "tp2": ((2,), ("tp",), fxshard.GradScaler, float("nan")),
          "fsdp2.tp2": ((2, 2), ("fsdp", "tp"), fxshard.GradScaler, float("inf")),
          "pp2": ((2,), ("pp",), torch.amp.GradScaler, float("-inf"))}


@pytest.mark.grad
@pytest.mark.parametrize("name", list(MESHES))
def test_scaled_steps_equal_one_devices_with_an_inf_in_one_ranks_shard(name):
    shape, axes, scaler, value = MESHES[name]
    model = _llama()
    ref = copy.deepcopy(model)
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", shape, mesh_dim_names=axes))
    params = pm.parameters()
    ref_params = list(ref.parameters())
    want = _train(ref, ref_params, torch.amp.GradScaler("cpu", init_scale=INIT,
                                                         growth_interval=GROWTH_INTERVAL),
                  _inf_into_first(ref_params))
    # the inf (nan) in the last rank's last shard only (rank-major): every rank skips
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    got = _train(pm, params, scaler("cpu", init_scale=INIT, growth_interval=GROWTH_INTERVAL),
                 _inf_into_first(params[::-1], value))
    assert want == SCALES and got == SCALES
    state = pm.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    for key, _ in ref.named_parameters():
        assert not torch.equal(state[key], before[key]), key    # the clean steps stepped


def _gloo_body(rank: int, report: dict) -> None:
    import fxshard
    model = _llama()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    params = pm.parameters()
    scaler = fxshard.GradScaler("cpu", init_scale=INIT, growth_interval=GROWTH_INTERVAL)
    # rank 1 alone finds an inf (its lm_head block): both ranks must skip that step
    poison = _inf_into_first(params) if rank == 1 else (lambda: None)
    report["scales"] = _train(pm, params, scaler, poison)
    ref = _llama()
    _train(ref, list(ref.parameters()), torch.amp.GradScaler(
        "cpu", init_scale=INIT, growth_interval=GROWTH_INTERVAL), _inf_into_first(
        list(ref.parameters())))
    state = pm.state_dict()
    report["worst"] = max((state[k] - v).abs().max().item()
                          for k, v in ref.state_dict().items())


@pytest.mark.grad
def test_gloo_one_ranks_inf_skips_the_step_on_every_rank(tmp_path):
    reports = gloo_job(_gloo_body, 2, str(tmp_path), timeout_s=240, grad=True)
    for rank, r in reports.items():
        assert r["scales"] == SCALES, (rank, r["scales"])
        assert r["worst"] < 1e-5, (rank, r["worst"])
