"""A model whose state_dict() names its weights unlike its parameters (state-dict hooks): fxshard
follows the hooks both ways. After training on a mesh, ``pm.state_dict()``, ``save_safetensors``
and ``write_back`` hold the trained weights under the model's own state-dict names, and
``pm.load_state_dict`` / ``load_safetensors`` (also into a model built on meta) map them back
to the parameters: each checked against the same model trained on one device, for a fused
weight saved as parts, a renamed and transposed one, and a tied pair (dp2·tp2, and on 2 gloo
ranks); torchtitan's Llama-3 with its fused ``wqkv`` (tp2). A hook that computes values, or one
no load hook undoes, is a clear error.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fxshard
from fxshard.state_dict_hooks import renaming, strided_form

GRAD = True   # training runs with autograd (tests/conftest.py)
V, D, HEADS = 64, 32, 4


def _split_on_save(module, sd, prefix, local_metadata):
    w = sd.pop(prefix + "w")
    for name, part in zip(("q", "k", "v"), w.split(module.parts)):
        sd[f"{prefix}{name}.weight"] = part


def _merge_on_load(module, sd, prefix, *args):
    keys = [f"{prefix}{n}.weight" for n in ("q", "k", "v")]
    if all(k in sd for k in keys):
        sd[prefix + "w"] = torch.cat([sd.pop(k) for k in keys])


class FusedQKV(torch.nn.Module):
    """One parameter ``w`` [q + k + v, D], saved as ``q.weight`` / ``k.weight`` / ``v.weight``."""

    def __init__(self, parts=(D, D // 2, D // 2)):
        super().__init__()
        self.parts = list(parts)
        self.w = torch.nn.Parameter(torch.randn(sum(parts), D) * D ** -0.5)
        self.register_state_dict_post_hook(_split_on_save)
        self.register_load_state_dict_pre_hook(_merge_on_load)

    def forward(self, x):
        return F.linear(x, self.w).split(self.parts, -1)


class Transposed(torch.nn.Linear):
    """A Linear whose weight is saved as ``kernel``, transposed ([in, out], as Conv1D)."""

    def __init__(self):
        super().__init__(D, D, bias=False)
        self._register_state_dict_hook(self._save)
        self._register_load_state_dict_pre_hook(self._load)

    @staticmethod
    def _save(module, sd, prefix, local_metadata):
        sd[prefix + "kernel"] = sd.pop(prefix + "weight").t()

    def _load(self, sd, prefix, *args):
        if prefix + "kernel" in sd:
            sd[prefix + "weight"] = sd.pop(prefix + "kernel").t()


class ToyLM(torch.nn.Module):
    """Embedding tied to the output head, a fused GQA projection, a renamed transposed one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D)
        self.qkv = FusedQKV()
        self.proj = Transposed()
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, -1, D // HEADS).transpose(1, 2) for t in self.qkv(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(h + self.proj(a.transpose(1, 2).reshape(b, s, D)))


def _ids(seed, b=4, s=8, v=V):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


def _train(step_model, params, ids, target, steps=2):
    opt = torch.optim.SGD(params, lr=0.5)
    for _ in range(steps):
        loss = F.cross_entropy(step_model(ids).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _close(got: dict, want: dict, what: str):
    assert list(got) == list(want), (what, list(got), list(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


def _round_trip(build, ids, axes, tmp_path, *, vocab):
    """Train on ``axes`` and on one device; the checkpoints of the mesh equal one device's and
    load back, into a fresh module and into one built on meta."""
    target = _ids(7, *ids.shape, v=vocab)
    model, ref = build(), build()
    model.requires_grad_(True)
    ref.requires_grad_(True)
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    _train(pm, pm.parameters(), ids, target)
    _train(ref, ref.parameters(), ids, target)
    want = ref.state_dict()
    assert set(want) != {n for n, _ in ref.named_parameters(remove_duplicate=False)}
    _close(pm.state_dict(), want, "pm.state_dict()")
    fxshard.save_safetensors(pm, str(tmp_path))
    from safetensors.torch import load_file
    files = [load_file(str(f)) for f in sorted(tmp_path.glob("*.safetensors"))]
    saved = {k: v for f in files for k, v in f.items()}
    kept = [k for k in want if k in saved]    # a tied weight once
    assert set(saved) == set(kept), (sorted(saved), kept)
    _close({k: saved[k] for k in kept}, {k: want[k] for k in kept}, "saved")
    ref.eval()
    with torch.no_grad():
        expect = ref(ids)
        fresh = fxshard.parallelize(build().requires_grad_(False), mesh)
        fresh.load_state_dict(want)
        torch.testing.assert_close(fresh(ids), expect, rtol=1e-4, atol=1e-4)
        with fxshard.init_empty_weights():
            empty = build()
        lazy = fxshard.parallelize(empty.requires_grad_(False), mesh)
        fxshard.load_safetensors(lazy, str(tmp_path))
        torch.testing.assert_close(lazy(ids), expect, rtol=1e-4, atol=1e-4)
        _close(lazy.state_dict(), {k: want[k] for k in lazy.state_dict()}, "loaded lazily")
    pm.write_back()
    _close(model.state_dict(), want, "write_back")
    for m in (pm, fresh, lazy):
        m.close()


def test_fused_renamed_and_tied_weights_round_trip_like_one_device(tmp_path):
    _round_trip(ToyLM, _ids(0), dict(dp=2, tp=2), tmp_path, vocab=V)


def test_torchtitan_llama3_fused_wqkv_round_trips_like_one_device(tmp_path):
    """torchtitan's default fused ``wqkv``, saved as ``wq`` / ``wk`` / ``wv`` (it was refused;
    before that, trained, its checkpoints held the initial wq/wk/wv)."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (.ci/run installs "
                                             "it with --no-deps)")
    from tests.external_models import _torchtitan_llama3
    model = _torchtitan_llama3(1, fuse_qkv=True)
    names = renaming(model)
    wq = "layers.0.attention.qkv_linear.wq.weight"
    assert names.save[wq].sources == ("layers.0.attention.qkv_linear.wqkv.weight",)
    assert names.save[wq].form is not None          # a strided view: no index per element
    _round_trip(lambda: _torchtitan_llama3(1, fuse_qkv=True), _ids(0, 2, 16, 128),
                dict(tp=2), tmp_path, vocab=128)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self._register_state_dict_hook(self._save)

    @staticmethod
    def _save(module, sd, prefix, local_metadata):
        sd[prefix + "scaled"] = sd.pop(prefix + "weight") * 2

    def forward(self, x):
        return x @ self.weight


class _SaveOnly(torch.nn.Module):
    """A fused ``qkv`` saved as ``q`` / ``k`` / ``v`` and no load hook (its own
    ``load_state_dict`` cannot take its state dict either)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(12, 4))
        self._register_state_dict_hook(self._split)

    @staticmethod
    def _split(module, sd, prefix, local_metadata):
        for name, part in zip("qkv", sd.pop(prefix + "qkv").chunk(3)):
            sd[prefix + name] = part

    def forward(self, x):
        return x @ self.qkv.t()


def _mesh():
    return fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def test_a_hook_that_computes_values_is_refused_clearly():
    with pytest.raises(NotImplementedError, match=r"fxshard\.parallelize: _Scaled's module "
                       r"\(the model\) \(_Scaled\) computes the values of scaled in its state "
                       r"dict, not only their names and layout"):
        fxshard.parallelize(_Scaled().requires_grad_(False), _mesh())


def test_a_state_dict_no_load_hook_undoes_saves_but_cannot_load():
    model = _SaveOnly().requires_grad_(False)
    pm = fxshard.parallelize(model, _mesh())
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x))
    sd = pm.state_dict()
    assert list(sd) == ["q", "k", "v"] and torch.equal(torch.cat(list(sd.values())), model.qkv)
    with pytest.raises(NotImplementedError, match=r"ParallelModule\.load_state_dict: _SaveOnly's "
                       r"module \(the model\) \(_SaveOnly\): its own load_state_dict cannot "
                       r"take what its state_dict\(\) gives .*Missing key"):
        pm.load_state_dict(sd)
    pm.close()


def test_models_without_renaming_hooks_are_not_probed():
    from tests.models import our_llama
    assert renaming(our_llama()) is None      # load hooks only (the tied lm_head)
    assert renaming(torch.nn.Linear(3, 2)) is None


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_strided_form_reproduces_a_strided_view(sizes, data):
    """A view of a flat tensor (any sizes, strides >= 0, offset) is found again; the
    gather it describes equals indexing with the element numbers."""
    strides = [data.draw(st.integers(0, 6)) for _ in sizes]
    offset = data.draw(st.integers(0, 5))
    base = torch.arange(200)
    view = base.as_strided(sizes, strides, offset)
    form = strided_form(view)
    assert form is not None
    assert torch.equal(base.as_strided(*form).reshape(-1), view.reshape(-1))
    shuffled = view.reshape(-1)[torch.randperm(view.numel(), generator=torch.Generator()
                                               .manual_seed(0))]
    if (shuffled[1:] - shuffled[:-1] < 0).any():
        assert strided_form(shuffled) is None or torch.equal(
            base.as_strided(*strided_form(shuffled)).reshape(-1), shuffled)


def test_training_state_of_a_renaming_model_resumes_on_another_mesh(tmp_path):
    """save_training_state keeps the parameters' own names (the fused ``w``): resumed on
    another mesh, the next step equals one device's."""
    ids, target = _ids(0), _ids(7)
    ref = ToyLM().requires_grad_(True)
    pms = []
    for axes in (dict(tp=2), dict(dp=2)):
        mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        pms.append(fxshard.parallelize(ToyLM().requires_grad_(True), mesh, example_inputs=(ids,)))
    opts = [torch.optim.AdamW(pm.parameters(), lr=1e-2) for pm in pms]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for pm, opt, steps in ((pms[0], opts[0], 2), (pms[1], opts[1], 1)):
        if pm is pms[1]:
            fxshard.load_training_state(pm, opt, str(tmp_path))
        for _ in range(steps):
            F.cross_entropy(pm(ids).flatten(0, 1), target.flatten()).backward()
            opt.step()
            opt.zero_grad()
        if pm is pms[0]:
            fxshard.save_training_state(pm, opt, str(tmp_path))
    for _ in range(3):
        F.cross_entropy(ref(ids).flatten(0, 1), target.flatten()).backward()
        ropt.step()
        ropt.zero_grad()
    _close(pms[1].state_dict(), ref.state_dict(), "resumed")
    for pm in pms:
        pm.close()


def _gloo_body(rank: int, report: dict, ckpt: str) -> None:
    from tests.launch import mesh
    ids, target = _ids(0), _ids(7)
    pm = fxshard.parallelize(ToyLM().requires_grad_(True), mesh(tp=2), example_inputs=(ids,))
    _train(pm, pm.parameters(), ids, target)
    report["state_dict"] = {k: v.tolist() for k, v in pm.state_dict().items()}
    report["written"] = sorted(f.rsplit("/", 1)[-1] for f in
                               fxshard.save_safetensors(pm, ckpt, max_shard_size=4000))


def test_gloo_ranks_save_a_renaming_model_like_one_device(tmp_path):
    """Real ranks (gloo, tp=2): each saved tensor a hook makes of a parameter (q/k/v of the
    fused ``w``, the transposed ``kernel``) is assembled on its file's writer from both ranks'
    shards; files and ``pm.state_dict()`` equal the model trained on one device."""
    from safetensors.torch import load_file
    from tests.launch import gloo_job
    ckpt = tmp_path / "ckpt"
    reports = gloo_job(_gloo_body, 2, str(tmp_path), str(ckpt), timeout_s=240, grad=True)
    ref = ToyLM().requires_grad_(True)
    _train(ref, ref.parameters(), _ids(0), _ids(7))
    want = ref.state_dict()
    for r, rep in reports.items():
        _close({k: torch.tensor(v) for k, v in rep["state_dict"].items()}, want, f"rank {r}")
    data = [f for rep in reports.values() for f in rep["written"] if f.endswith(".safetensors")]
    assert all(any(f.endswith(".safetensors") for f in rep["written"])
               for rep in reports.values()), reports   # both ranks wrote files
    saved = {k: v for f in data for k, v in load_file(str(ckpt / f)).items()}
    assert set(saved) == set(want) - {"head.weight"}    # the tied head once
    _close({k: saved[k] for k in want if k in saved}, {k: want[k] for k in want if k in saved},
           "saved on 2 ranks")
