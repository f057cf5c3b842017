"""Training mistakes that used to give a silently wrong result (issue 43) or a poor error:
each is now a clear error naming what to do, or the one-device result.

An optimizer over ``model.parameters()`` (the shards are the weights), a detached loss in
``train_step``, a loss function reading a global that changes, an optimizer state loaded into
another optimizer type, and the PyTorch order ``AdamW(pm.parameters())`` right after
``parallelize`` (issue 41)."""
import copy

import pytest
import torch

import fxshard
from tests.test_train_grads import _data, _llama, _loss


def _mesh(dp, tp):
    return fxshard.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


# -- item 6: an optimizer over the model's parameters -----------------------------------------
def test_optimizer_over_model_parameters_raises_at_step():
    model = _llama(layers=1)
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(1, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(pm(ids), labels).backward()
    with pytest.raises(ValueError, match=r"AdamW\(pm\.parameters\(\)") as e:
        opt.step()
    assert "original model's parameters" in str(e.value) and "model.embed_tokens.weight" in \
        str(e.value), str(e.value)
    # the right optimizer steps, and the model's own training (its own gradients) is not
    # mistaken for it
    good = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    good.step()
    ref = copy.deepcopy(model)
    _loss(ref(ids), labels).backward()
    torch.optim.SGD(ref.parameters(), lr=1e-2).step()


# -- item 4: a detached loss in train_step ----------------------------------------------------
@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1)])
def test_train_step_detached_loss_raises_like_one_device(dp, tp):
    ids, labels = _data()
    model = _llama(layers=1)
    with pytest.raises(RuntimeError, match="does not require grad"):   # one device
        _loss(model(ids).detach(), labels).backward()
    pm = fxshard.parallelize(model, _mesh(dp, tp))
    with pytest.raises(RuntimeError, match=r"does not require grad.*train_step|train_step.*"
                                           r"does not require grad") as e:
        pm.train_step(ids, loss_fn=lambda out, t: _loss(out.detach(), t), target=labels)
    assert "detach" in str(e.value)
    # the same pm trains with the loss not detached
    loss = pm.train_step(ids, loss_fn=_loss, target=labels)
    assert torch.isfinite(loss) and all(p.grad is not None for p in pm.parameters())


# -- item 5: a loss function reading a value that changes -------------------------------------
SCALE = 1.0


class _Config:
    scale = 1.0


CONFIG = _Config()


def _scaled_by_global(out, target):
    return _loss(out, target) * SCALE


def _scaled_by_attribute(out, target):
    return _loss(out, target) * CONFIG.scale


@pytest.mark.parametrize("how", ["global", "closure", "attribute", "module_object"])
def test_loss_fn_reading_a_changing_value_is_traced_again(how):
    """The loss after the value changed is one device's (15.1, not the first trace's 5.04)."""
    global SCALE
    ids, labels = _data()
    model = _llama(layers=1)
    ref = copy.deepcopy(model)
    pm = fxshard.parallelize(model, _mesh(1, 2))
    box = {"scale": 1.0}

    def closure_fn():
        scale = box["scale"]
        return lambda out, target: _loss(out, target) * scale
    ce = torch.nn.CrossEntropyLoss()

    def module_object_fn(out, target):
        return ce(out.flatten(0, 1), target.flatten())

    def set_scale(v):
        global SCALE
        SCALE = v
        CONFIG.scale = v
        box["scale"] = v
        ce.reduction = "mean" if v == 1.0 else "sum"
    fn = {"global": lambda: _scaled_by_global, "closure": closure_fn,
          "attribute": lambda: _scaled_by_attribute, "module_object": lambda: module_object_fn}[how]
    try:
        for v in (1.0, 3.0, 3.0, 1.0):
            set_scale(v)
            got = pm.train_step(ids, loss_fn=fn(), target=labels)
            want = fn()(ref(ids), labels)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5,
                                       msg=f"{how}: value {v}")
            pm.zero_grad()
    finally:
        set_scale(1.0)


# -- item 8: an optimizer state loaded into another optimizer type -----------------------------
def test_load_training_state_into_another_optimizer_type_raises(tmp_path):
    ids, labels = _data()
    pm = fxshard.parallelize(_llama(layers=1), _mesh(1, 2), example_inputs=(ids,))
    adamw = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    _loss(pm(ids), labels).backward()
    adamw.step()
    fxshard.save_training_state(pm, adamw, str(tmp_path / "ckpt"))
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="AdamW.*SGD") as e:
        fxshard.load_training_state(pm, sgd, str(tmp_path / "ckpt"))
    assert "load_training_state" in str(e.value)
    assert sgd.param_groups[0]["weight_decay"] == 0 and "betas" not in sgd.param_groups[0]
    # the same type loads
    again = torch.optim.AdamW(pm.parameters(), lr=5e-3)
    fxshard.load_training_state(pm, again, str(tmp_path / "ckpt"))
    assert again.param_groups[0]["lr"] == 1e-2 and again.param_groups[0]["weight_decay"] == 0.1


def test_load_training_state_checks_group_keys_without_a_recorded_type():
    """A checkpoint with no recorded optimizer type (saved before it was): its groups' keys."""
    from fxshard.training import resume
    params = [torch.nn.Parameter(torch.zeros(2))]
    saved = dict(torch.optim.AdamW(params, lr=1e-2).param_groups[0])
    with pytest.raises(ValueError, match=r"betas") as e:
        resume._check_same_optimizer("ckpt", None, [saved], torch.optim.SGD(params, lr=0.1))
    assert "SGD" in str(e.value)
    resume._check_same_optimizer("ckpt", None, [saved], torch.optim.AdamW(params, lr=0.1))


# -- issue 41: the PyTorch order, the optimizer right after parallelize -------------------------
@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 2)])
def test_optimizer_right_after_parallelize_trains_like_one_device(dp, tp):
    """``AdamW(pm.parameters())`` before any call (no example_inputs=): the shards placed on
    inputs inferred from the config are the ones the real batch trains."""
    from tests.train_checks import adamw_steps_equal
    model = _llama(layers=1)
    ids, labels = _data()
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(dp, tp))
    adamw_steps_equal(pm, model, lambda m: _loss(m(ids), labels), steps=2)


def test_optimizer_right_after_parallelize_without_inferable_inputs_teaches_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", (2,),
                                                            mesh_dim_names=("tp",)))
    with pytest.raises(ValueError, match=r"parallelize\(model, mesh, example_inputs=\(ids,\)\)"
                       ) as e:
        torch.optim.AdamW(pm.parameters())
    assert "ParallelModule.parameters" in str(e.value) and "Sequential" in str(e.value)


# -- issue 43 item 11: poor errors made clear, torch's signatures -----------------------------
def test_train_step_without_loss_fn_on_a_tensor_output_says_pass_loss_fn():
    ids, labels = _data()
    pm = fxshard.parallelize(_llama(layers=1), _mesh(1, 2))
    with pytest.raises(ValueError, match=r"loss_fn=.*target="):
        pm.train_step(ids)


def test_named_parameters_and_clip_grad_norm_on_the_shards():
    ids, labels = _data()
    model = _llama(layers=1)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(2, 2), example_inputs=(ids,))
    with pytest.raises(AttributeError, match=r"pm\.shards\(rank\)"):
        pm.named_parameters()
    _loss(pm(ids), labels).backward()
    _loss(model(ids), labels).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    # torch's signature, the shards as torch's clip_grad_norm_ takes parameters
    got = fxshard.clip_grad_norm_(pm.parameters(), 1e9, norm_type=2.0,
                                  error_if_nonfinite=True, foreach=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"fxshard.clip_grad_norm_\(pm, max_norm\)"):
        fxshard.clip_grad_norm_(pm.parameters()[:3], 1.0)
    pm.parameters()[0].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fxshard.clip_grad_norm_(pm, 1.0, error_if_nonfinite=True)


def test_load_state_dict_takes_torchs_signature():
    from torch.nn.modules.module import _IncompatibleKeys
    ids, _ = _data()
    model = _llama(layers=1)
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh(1, 2), example_inputs=(ids,))
    other = _llama(layers=1)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    sd = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    sd["extra.weight"] = torch.zeros(1)
    got = pm.load_state_dict(sd, strict=False)
    assert isinstance(got, _IncompatibleKeys)
    assert got.missing_keys == ["lm_head.weight"] and got.unexpected_keys == ["extra.weight"]
    now = pm.state_dict()
    torch.testing.assert_close(now["lm_head.weight"], model.state_dict()["lm_head.weight"])
    torch.testing.assert_close(now["model.norm.weight"], other.state_dict()["model.norm.weight"])
    assert pm.load_state_dict(other.state_dict(), strict=True) == _IncompatibleKeys([], [])
    with pytest.raises(ValueError, match="assign"):
        pm.load_state_dict(other.state_dict(), assign=True)


def _pp_mesh():
    return fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))


@pytest.mark.parametrize("virtual,match", [(-1, "virtual_stages=-1"),
                                           (3, r"virtual_stages=3 on pp=2.*4 layers")])
def test_bad_virtual_stages_name_virtual_stages(virtual, match):
    ids, labels = _data(batch=4)
    pm = fxshard.parallelize(_llama(layers=4), _pp_mesh(), microbatches=2)
    with pytest.raises(ValueError, match=match):
        pm.train_step(ids, loss_fn=_loss, target=labels, schedule="interleaved_1f1b",
                      virtual_stages=virtual)


def test_interleaved_after_example_inputs_gives_advice_that_works():
    ids, labels = _data(batch=4)
    pm = fxshard.parallelize(_llama(layers=4), _pp_mesh(), microbatches=2,
                             example_inputs=(ids,))
    pm.parameters()
    with pytest.raises(ValueError, match=r"virtual_stages=1 by an earlier call") as e:
        pm.train_step(ids, loss_fn=_loss, target=labels, schedule="interleaved_1f1b")
    assert "pm.train_step(..., schedule='interleaved_1f1b', virtual_stages=2)" in str(e.value)


def test_torchs_clip_grad_norm_on_the_shards_is_the_models_norm():
    """``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)``, the call training scripts
    make, counted every rank's copy of a replicated shard (1.550 where one device's norm is
    1.092): given fxshard's shards it now computes the model's norm and clips as one device;
    on other tensors it is torch's own."""
    import copy
    import torch.nn.functional as F
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1, vocab_size=64,
                                              hidden_size=32, intermediate_size=48,
                                              num_attention_heads=4, num_key_value_heads=2))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = fxshard.parallelize(model, mesh)
    params = pm.parameters()
    F.cross_entropy(pm(ids).flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(ref(ids).flatten(0, 1), ids.flatten()).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = torch.nn.utils.clip_grad_norm_(params, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(TypeError, match="fxshard.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(params[:1] + [torch.zeros(2, requires_grad=True)], 0.5)
