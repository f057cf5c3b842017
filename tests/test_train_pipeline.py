"""Pipeline training: gradients and AdamW steps on a ``pp`` mesh equal one device's.

``pm(x)`` + ``loss.backward()`` runs GPipe (the backward receives the gradient of the whole
output, cut into microbatches); ``pm.train_step(..., schedule=)`` runs GPipe, 1F1B or
interleaved 1F1B with the loss inside. Sizes are uneven (hidden 48, intermediate 72, vocab 96,
5 layers over 4 stages).
"""
import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
from fxshard.training.schedules import actions, global_order
from tests.train_checks import named, no_further_from_float64

V, B, S = 96, 4, 6


def _llama(layers=2, tied=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny(
        num_hidden_layers=layers, vocab_size=V, hidden_size=48, intermediate_size=72,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g))


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _close_grads(model, pm):
    grads = pm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=named(name))


def _adamw_steps(model, pm, step, steps=3):
    """``steps`` AdamW steps on ``pm`` (``step(pm)`` runs forward+backward) and on the model;
    the trained weights equal (the model object keeps its weights: a copy trains)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    # eps 1e-6: Adam's m / (sqrt(v) + eps) with the default 1e-8 turns the fp32 rounding of a
    # near-zero gradient element into an update of arbitrary size (lm_head.weight: 1.1e-5
    # off on one CPU model, 2026-12-02; tests/test_train_models.py says the same)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ids, labels = _data()
    opt = None
    for _ in range(steps):
        step(pm)    # the first places the shards (an optimizer may come after it)
        opt = opt or torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
        _loss(model(ids), labels).backward()
        opt.step(), ref.step(), opt.zero_grad(), ref.zero_grad()
    sd = pm.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-5, atol=1e-5, msg=named(name))
    return model


@pytest.mark.parametrize("microbatches", [1, 2])
def test_gpipe_behind_loss_backward_equals_one_device(microbatches):
    model, (ids, labels) = _llama(), _data()
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=microbatches)
    out = pm(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-4)
    _loss(out, labels).backward()
    _loss(model(ids), labels).backward()
    _close_grads(model, pm)
    norm = fxshard.clip_grad_norm_(pm, 0.1)      # the global norm over every stage's shards
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    _close_grads(model, pm)
    model.zero_grad(), pm.zero_grad()
    trained = _adamw_steps(model, pm, lambda pm: _loss(pm(ids), labels).backward())
    # the trained shards are what inference computes with afterwards
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), trained(ids), rtol=1e-4, atol=1e-4)
    pm.load_state_dict(model.state_dict())       # into every stage's shards, in place
    for name, value in pm.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], msg=named(name))


@pytest.mark.parametrize("schedule,layers,virtual", [("gpipe", 2, None), ("1f1b", 2, None),
                                                     ("interleaved_1f1b", 4, 2)])
def test_schedules_train_as_one_device(schedule, layers, virtual):
    model, (ids, labels) = _llama(layers), _data()
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=4)
    losses = []

    def step(pm):
        losses.append(pm.train_step(ids, target=labels, loss_fn=_loss, schedule=schedule,
                                    virtual_stages=virtual))
    _adamw_steps(model, pm, step)
    assert pm.trainer.schedule["name"] == schedule
    assert len(losses) == 3 and all(loss.dim() == 0 for loss in losses)
    text = str(pm.explain())
    assert f"schedule {schedule}: pp=2, 4 microbatches" in text and "bubble" in text


def test_1f1b_holds_at_most_pp_microbatches():
    """Peak saved activations per rank (bytes alive at once): GPipe holds all m microbatches,
    1F1B at most pp - rank on rank ``rank``."""
    model, (ids, labels) = _llama(4), _data()
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=4)
        pm.train_step(ids, target=labels, loss_fn=_loss, schedule=schedule)
        peaks[schedule] = pm.trainer.peak_saved
        assert pm.trainer.memory(0)["saved"] == peaks[schedule][0]
    g, o = peaks["gpipe"], peaks["1f1b"]
    assert o[0] * 4 == g[0] * 2 and o[1] * 4 == g[1] * 1, peaks   # per microbatch equal
    assert all(o[r] < g[r] for r in g)


class _Skips(torch.nn.Module):
    """Values read by several later stages: the embedding added back after every layer, and
    the first layer's output added before the head (a skip over every stage cut)."""

    def __init__(self, layers=4, hidden=24):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, hidden)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, 40), torch.nn.Tanh(),
                                torch.nn.Linear(40, hidden)) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, V)

    def forward(self, ids):
        e = self.embed(ids)
        h, first = e, None
        for layer in self.layers:
            h = layer(h) + e
            first = h if first is None else first
        return self.head(h + first)


@pytest.mark.parametrize("axes,microbatches", [(dict(pp=2), 2), (dict(pp=4), 1),
                                               (dict(dp=2, pp=2), 2)])
def test_values_read_by_several_stages_train_as_one_device(axes, microbatches):
    """The embedding's gradient is the sum of what every stage sends back for it, and the
    skip's of its two readers: gradients and three AdamW steps equal one device's."""
    model, (ids, labels) = _Skips(), _data()
    pm = fxshard.parallelize(model, _mesh(**axes), microbatches=microbatches)
    loss = pm.train_step(ids, target=labels, loss_fn=_loss, schedule="1f1b")
    ref = _loss(model(ids), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)
    held = [set(stage.shards(0)) for stage in pm.trainer.stage_modules]
    assert len(held) == axes["pp"] and "embed.weight" in held[0], held
    assert all("embed.weight" not in h and "layers.0.0.weight" not in h for h in held[1:]), held
    model.zero_grad(), pm.zero_grad()
    _adamw_steps(model, pm, lambda pm: pm.train_step(ids, target=labels, loss_fn=_loss))


@pytest.mark.parametrize("axes,layers,stages,opts", [
    (dict(pp=4), 5, None, {}),                    # 5 layers over 4 stages: [0, 0, 1, 2, 3]
    (dict(dp=2, pp=2), 3, [0, 1, 1], {}),         # uneven stages given
    # pp2·tp2: the gloo test below and test_hf_llama_pipeline_gradients
    (dict(fsdp=2, pp=2), 2, None, {}),
    (dict(pp=2, ulysses_cp=2), 2, None, {}),
    (dict(tp=2, pp=2, ring_cp=2), 2, None, dict(ring_zigzag=False)),   # S=6: not 4 chunks
])
def test_meshes_with_pp_train_as_one_device(axes, layers, stages, opts):
    model, (ids, labels) = _llama(layers), _data()
    pm = fxshard.parallelize(model, _mesh(**axes), microbatches=2, stages=stages, **opts)
    loss = pm.train_step(ids, target=labels, loss_fn=_loss, schedule="1f1b")
    ref = _loss(model(ids), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)
    # a step, then inference reads each rank's stage shards (by its coordinates)
    trained = copy.deepcopy(model)     # (without the gradients)
    _loss(trained(ids), labels).backward()
    torch.optim.SGD(pm.parameters(), lr=0.5).step()
    torch.optim.SGD(trained.parameters(), lr=0.5).step()
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), trained(ids), rtol=1e-4, atol=1e-4)
    assert len(pm.parameters()) == sum(
        len(list(tm.shards(0).values())) * tm.spec.world_size for tm in pm.trainer.stage_modules)


def test_hf_llama_pipeline_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=72,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids, labels = _data()
    pm = fxshard.parallelize(model, _mesh(pp=2, tp=2), microbatches=2)
    _loss(pm(ids).logits, labels).backward()
    _loss(model(ids).logits, labels).backward()
    _close_grads(model, pm)
    model.zero_grad(), pm.zero_grad()
    loss = pm.train_step(ids, target=labels, loss_fn=lambda o, t: _loss(o.logits, t))
    ref = _loss(model(ids).logits, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)
    # HF's labels= (the loss inside the last stage), ignored tokens unevenly spread
    labels[0, 1:4] = -100
    model.zero_grad(), pm.zero_grad()
    loss = pm.train_step(ids, labels=labels, schedule="gpipe")
    ref = model(ids, labels=labels).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)


def test_schedule_orders_and_errors():
    per = actions("1f1b", 2, 4)
    assert per[0] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1),
                      ("F", 0, 3), ("B", 0, 2), ("B", 0, 3)]
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 2)]:
        for pp, m in [(2, 4), (4, 4), (4, 8), (3, 6)]:
            global_order(actions(name, pp, m, v), pp * v)     # never deadlocks
    with pytest.raises(ValueError, match="deadlocks"):
        global_order([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], 2)
    with pytest.raises(ValueError, match="interleaved_1f1b.*divisible by pp=2"):
        actions("interleaved_1f1b", 2, 3, 2)
    with pytest.raises(ValueError, match="schedule='zb'"):
        actions("zb", 2, 4)
    ids, labels = _data()
    pm = fxshard.parallelize(_llama(tied=True), _mesh(pp=2))
    with pytest.raises(NotImplementedError, match="lm_head.weight.*stages \\[0, 1\\]|"
                                                   "embed_tokens.weight.*stages \\[0, 1\\]"):
        pm(ids)
    pm = fxshard.parallelize(_llama(), _mesh(pp=2), microbatches=3)
    with pytest.raises(ValueError, match="batch 4 does not divide into microbatches=3"):
        pm(ids)


_GLOO_CASES = (("pp_tp", dict(pp=2, tp=2), {}),
               ("fsdp_pp", dict(fsdp=2, pp=2), dict(fsdp_reshard_after_forward="layers")))
_CLIP = 0.05


def _gloo_body(rank: int, report: dict, out_dir: str) -> None:
    for key, axes, opts in _GLOO_CASES:
        report[key] = {}
        _gloo_case(rank, report[key], axes, opts, f"{out_dir}/{key}")


def _worst_whole(whole: dict, model, of) -> float:
    return max((whole[n] - of(p)).abs().max().item() for n, p in model.named_parameters())


def _gloo_case(rank: int, report: dict, axes: dict, opts: dict, out_dir: str) -> None:
    from tests.launch import worst_block
    model, (ids, labels) = _llama(2), _data()
    ref = copy.deepcopy(model)
    pm = fxshard.parallelize(model, _mesh(**axes), microbatches=2, **opts)
    out = pm(ids)                                  # GPipe behind loss.backward()
    report["forward"] = (out - ref(ids)).abs().max().item()
    _loss(out, labels).backward()
    _loss(ref(ids), labels).backward()
    t = pm.trainer
    tms, sub = t._where(rank)
    named = dict(ref.named_parameters())

    def worst(what):
        return max(worst_block(tm.shards(sub), named, tm._specs, t.sub, sub, of=what)
                   for tm in tms)
    report["grad"] = worst(lambda p: p.grad)
    # every stage's whole gradients on every rank (each stage gathers its own, then they
    # are shared along pp)
    report["gradients"] = _worst_whole(pm.gradients(), ref, lambda p: p.grad)
    pm.zero_grad(), ref.zero_grad()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    report["loss"], report["norm"] = [], []
    for _ in range(3):
        loss = pm.train_step(ids, target=labels, loss_fn=_loss, schedule="1f1b")
        expect = _loss(ref(ids), labels)
        expect.backward()
        report["loss"].append(abs(loss.item() - expect.item()))
        # the global norm: every stage counts its own parameters, each replica once
        norm = fxshard.clip_grad_norm_(pm, _CLIP).item()
        report["norm"].append(abs(norm - torch.nn.utils.clip_grad_norm_(
            ref.parameters(), _CLIP).item()) / norm)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    report["params"] = worst(lambda p: p.detach())
    report["state_dict"] = _worst_whole(pm.state_dict(), ref, lambda p: p.detach())
    # checkpoints: the trained shards of every stage, each process writing its own part
    report["written"] = [os.path.basename(f) for f in fxshard.save_safetensors(
        pm, f"{out_dir}/hf", max_shard_size=20_000)]
    fxshard.save_training_state(pm, opt, f"{out_dir}/dcp")
    # the collectives the runner issued in the background (post_emit.prefetch_fsdp_pass)
    from fxshard.ops.collectives import START
    report["background"] = sum(
        n.target in START.values()
        for tm in tms for kind in ("forward", "backward")
        for n in tm.rank_module(sub, kind).__dict__["_fxshard_direct"][2].graph.nodes)
    pm.close()


def test_pp2_tp2_and_fsdp2_pp2_gloo_1f1b(tmp_path):
    """4 processes, pp2·tp2 then fsdp2·pp2 (FSDP2's reshard policy, ``"layers"``): activations
    and their gradients cross the cut as gloo isend/irecv, fsdp's all-gathers run one ahead
    and its reduce-scatters in the background beside them; GPipe's gradients and three 1F1B
    AdamW steps with ``clip_grad_norm_`` equal one device's. ``pm.gradients()`` and
    ``pm.state_dict()`` give every rank every stage's whole tensors; ``save_safetensors``
    (every rank writing files) and ``save_training_state`` hold the trained model, which
    resumes in this process on a simulated fsdp2·tp2 mesh for a fourth step equal to one
    device's."""
    from safetensors.torch import load_file
    from tests.launch import gloo_job
    reports = gloo_job(_gloo_body, 4, str(tmp_path), str(tmp_path), timeout_s=240, grad=True)
    for rank, by_mesh in reports.items():
        for key, _, _ in _GLOO_CASES:
            r = by_mesh[key]
            assert r["forward"] < 1e-4 and r["grad"] < 1e-5 and r["params"] < 1e-5, (key, r)
            assert r["gradients"] < 1e-5 and r["state_dict"] < 1e-5, (key, r)
            assert max(r["loss"]) < 1e-5 and max(r["norm"]) < 1e-5, (key, r)
            assert (r["background"] > 0) == (key == "fsdp_pp"), (key, r)
    # the single device, trained as the ranks were: GPipe's gradients dropped, three clipped
    # AdamW steps; then a fourth
    ref, (ids, labels) = _llama(2), _data()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    def step():
        opt.zero_grad()
        _loss(ref(ids), labels).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), _CLIP)
        opt.step()
    for _ in range(3):
        step()
    want = ref.state_dict()
    for key, _, _ in _GLOO_CASES:
        ckpt = tmp_path / key / "hf"
        files = sorted(p.name for p in ckpt.glob("*.safetensors"))
        written = sorted(f for r in reports.values() for f in r[key]["written"])
        assert written == sorted(files + ["model.safetensors.index.json"]), (key, written)
        assert sum(bool(r[key]["written"]) for r in reports.values()) == 4   # every rank
        got = {k: v for f in files for k, v in load_file(str(ckpt / f)).items()}
        assert set(got) == set(want), key
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=named(name))
    # the ranks' training state, resumed in this process on another mesh: the fourth step
    # equals one device's
    step()
    import torch.distributed.checkpoint as dcp
    for key, _, _ in _GLOO_CASES:
        groups = {"optim": {"param_groups": [{"params": None}]}}   # every stage's names
        with warnings.catch_warnings():   # DCP: "assuming ... a single process" (it is)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(groups, checkpoint_id=str(tmp_path / key / "dcp"), no_dist=True)
        assert groups["optim"]["param_groups"][0]["params"] == \
            [n for n, _ in ref.named_parameters()], key
        pm = fxshard.parallelize(_llama(2), _mesh(fsdp=2, tp=2), example_inputs=(ids,))
        opt2 = torch.optim.AdamW(pm.parameters(), lr=1.0, eps=1e-6)
        fxshard.load_training_state(pm, opt2, str(tmp_path / key / "dcp"))
        _loss(pm(ids), labels).backward()
        fxshard.clip_grad_norm_(pm, _CLIP)
        opt2.step()
        trained = pm.state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5,
                                       msg=f"{key} {name}")


def test_recompute_on_pp_saves_less_with_equal_gradients():
    """``recompute="layers"`` reaches every stage's program: gradients equal one device, each
    stage saves less for its backward than without."""
    ids, labels = _data()
    saved = {}
    for recompute in (None, "layers"):
        model = _llama(layers=4)
        pm = fxshard.parallelize(model, _mesh(pp=2), recompute=recompute)
        model.zero_grad()
        _loss(model(ids), labels).backward()
        _loss(pm(ids), labels).backward()
        _close_grads(model, pm)
        saved[recompute] = [tm.memory(0)["saved"] for tm in pm.trainer.stage_modules]
    assert all(0 < r < n / 2 for r, n in zip(saved["layers"], saved[None])), saved


def test_compile_on_pp_compiles_each_stage_forward_and_backward():
    """``compile=True`` on fsdp2·pp2: every stage's forward and backward programs are
    Inductor's (the backward ran the plain GraphModule before), and a 1F1B step's loss and
    gradients equal one device's."""
    model, (ids, labels) = _llama(2), _data()
    pm = fxshard.parallelize(model, _mesh(fsdp=2, pp=2), microbatches=2, compile=True)
    loss = pm.train_step(ids, target=labels, loss_fn=_loss, schedule="1f1b")
    ref = _loss(model(ids), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)
    for tm in pm.trainer.stage_modules:
        assert set(tm._last.compiled) == {"forward", "backward"}, tm._last.compiled


# (pp -> a mesh without pp: the gloo test resumes its ranks' state on one)
@pytest.mark.parametrize("a,b", [(dict(pp=2, tp=2), dict(fsdp=2, pp=2)),
                                 (dict(fsdp=2), dict(pp=2))])
def test_training_state_resumes_across_pp(tmp_path, a, b):
    """``save_training_state`` on a pp mesh (every stage's shards and AdamW state, by the
    model's names) and ``load_training_state`` onto a mesh with or without pp: two more
    steps equal four uninterrupted single-device steps."""
    ids, labels = _data()
    ref, ref64 = _llama(2), _llama(2).double()

    def steps(call, opt, n):
        for _ in range(n):
            opt.zero_grad()
            _loss(call(ids), labels).backward()
            opt.step()
    for model in (ref, ref64):
        steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), 4)
    micro = {"microbatches": 2}
    pm = fxshard.parallelize(_llama(2), _mesh(**a), **(micro if "pp" in a else {}))
    pm(ids)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    steps(pm, opt, 2)
    fxshard.save_training_state(pm, opt, str(tmp_path))
    fresh = _llama(2)
    torch.nn.init.zeros_(fresh.model.embed_tokens.weight)   # overwritten by the load
    pm2 = fxshard.parallelize(fresh, _mesh(**b), **(micro if "pp" in b else {}))
    pm2(ids)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=123.0, eps=1e-6)
    fxshard.load_training_state(pm2, opt2, str(tmp_path))
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2)
    steps(pm2, opt2, 2)
    # four AdamW steps at lr 1e-2 drift from float64 (1.2e-5 from fp32 one device on an
    # AVX-512 CPU): no further from the float64 run than one device's fp32 run is
    no_further_from_float64(pm2.state_dict(), dict(ref.named_parameters()),
                            dict(ref64.named_parameters()))
    assert {float(s["step"]) for s in opt2.state.values()} == {4.0}


def _uneven_labels():
    """Labels whose ignored (-100) tokens differ per microbatch of 2: 1 in the first half of
    the batch, 7 in the second."""
    ids, labels = _data()
    labels = labels.clone()
    labels[0, 2] = -100
    labels[2:, :3] = -100
    labels[3, 4] = -100
    return ids, labels


_LOSSES = {
    "mean-ignored": _loss,
    "sum": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum"),
    "sum-over-count": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(),
                                                     reduction="sum") / 17.0,
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", list(_LOSSES))
def test_microbatch_losses_weigh_as_the_whole_batch(kind, schedule):
    """A mean over tokens with ignored tokens spread unevenly over the microbatches, a sum,
    and a sum over a constant: the pipeline's loss and gradients equal one device's (each
    microbatch's mean was divided by m: gradients off by 0.024; a sum was divided by m)."""
    model, (ids, labels) = _llama(), _uneven_labels()
    loss_fn = _LOSSES[kind]
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=2)
    loss = pm.train_step(ids, target=labels, loss_fn=loss_fn, schedule=schedule)
    ref = loss_fn(model(ids), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(model, pm)


def test_hf_labels_weigh_microbatches_by_the_models_own_loss():
    """HF's labels= (the model shifts them): unevenly ignored tokens per microbatch, loss and
    gradients equal one device's."""
    from tests.models import hf_llama
    model = hf_llama(layers=2, vocab=V)
    ref = copy.deepcopy(model)
    ids, labels = _uneven_labels()
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=2)
    loss = pm.train_step(ids, labels=labels)
    want = ref(ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=named(name))


def test_a_loss_coupling_microbatches_is_refused():
    """A loss that is no weighted sum of its microbatches' losses (here a batch-wide
    normalisation) cannot equal one device on a pipeline: a ValueError before the step."""
    model, (ids, labels) = _llama(), _data()

    def coupled(out, t):
        return _loss(out, t) / out.std()
    pm = fxshard.parallelize(model, _mesh(pp=2), microbatches=2)
    with pytest.raises(ValueError, match=r"not a sum or a mean of its 2 microbatches' losses"):
        pm.train_step(ids, target=labels, loss_fn=coupled)
    assert all(p.grad is None for p in pm.parameters())
