"""Checkpoints that cannot be lost or mixed (simulated mesh): ``save_safetensors`` and
``save_training_state`` write beside the old checkpoint and switch when complete; a save that
fails (ENOSPC on the second shard, injected) raises an ordinary OSError naming the file and
leaves the old checkpoint as it was; the files of an older save that the new one does not write
(an HF ``model.safetensors`` beside a new sharded index, a stale ``.distcp``) are gone, the
user's other files kept. A damaged ``.distcp`` is named on load; an int64 weight in a
safetensors file is cast to the parameter's dtype, as ``model.load_state_dict`` does."""
from __future__ import annotations

import builtins
import errno
import io
import os

import pytest
import torch

import fxshard
from tests.models import hf_llama
from tests.test_train_grads import _data, _llama, _loss


def _ids():
    return torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))


def _pm(seed):
    ref = hf_llama(layers=1, hidden=48, intermediate=72, vocab=96, seed=seed)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return ref, fxshard.parallelize(ref, mesh, example_inputs=(_ids(),))


def _listing(d) -> dict:
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def _fail_on(monkeypatch, where, pattern):
    """``open`` (``where``: builtins or io) whose files named like ``pattern`` raise ENOSPC at
    the first write; returns the names that failed."""
    real, failed = getattr(where, "open"), []

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            failed.append(os.path.basename(str(self.fh.name)))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def fake(file, mode="r", *args, **kwargs):
        fh = real(file, mode, *args, **kwargs)
        if "w" in mode and "b" in mode and pattern in os.path.basename(str(file)):
            return Full(fh)
        return fh
    monkeypatch.setattr(where, "open", fake)
    return failed


def test_save_over_an_hf_single_file_checkpoint_replaces_it(tmp_path):
    import transformers
    old, _ = _pm(seed=1)
    old.save_pretrained(tmp_path)                  # model.safetensors, no index
    (tmp_path / "tokenizer.json").write_text("{}")   # the user's: kept
    ref, pm = _pm(seed=0)
    fxshard.save_safetensors(pm, str(tmp_path), max_shard_size=20_000)
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors" not in names and "tokenizer.json" in names, names
    assert not [n for n in os.listdir(tmp_path.parent) if "fxshard-" in n]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(hf.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # and the other way round: fewer shards than before leave no stale one behind
    fxshard.save_safetensors(pm, str(tmp_path), max_shard_size="1GB")
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors")) == \
        ["model-00001-of-00001.safetensors"]


def test_save_failing_on_the_second_shard_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    old, pm_old = _pm(seed=1)
    fxshard.save_safetensors(pm_old, str(tmp_path), max_shard_size=20_000)
    before = _listing(tmp_path)
    _, pm = _pm(seed=0)
    failed = _fail_on(monkeypatch, builtins, "model-00002-of-")
    with pytest.raises(OSError, match="model-00002-of-.*No space left") as info:
        fxshard.save_safetensors(pm, str(tmp_path), max_shard_size=20_000)
    monkeypatch.undo()
    assert failed and info.value.errno == errno.ENOSPC
    assert isinstance(info.value, Exception) and str(tmp_path) in str(info.value)
    assert _listing(tmp_path) == before
    assert not [n for n in os.listdir(tmp_path.parent) if "fxshard-" in n]
    _, pm2 = _pm(seed=2)
    fxshard.load_safetensors(pm2, str(tmp_path))
    for k, v in old.state_dict().items():
        torch.testing.assert_close(pm2.state_dict()[k], v, rtol=0, atol=0, msg=k)


def _trained(steps=1):
    ids, labels = _data(seq=6)
    pm = fxshard.parallelize(_llama(layers=1), fxshard.init_device_mesh(
        "cpu", (2,), mesh_dim_names=("fsdp",)), example_inputs=(ids,))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        _loss(pm(ids), labels).backward()
        opt.step()
    return pm, opt


@pytest.mark.grad
def test_training_state_failing_midway_keeps_the_previous_one(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    pm, opt = _trained()
    fxshard.save_training_state(pm, opt, ckpt)
    saved = {k: v.clone() for k, v in pm.state_dict().items()}
    (tmp_path / "ckpt" / "__7_0.distcp").write_bytes(b"stale")   # of an older save
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    fxshard.save_training_state(pm, opt, ckpt)
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "notes.txt"]
    before = _listing(ckpt)
    _, labels = _data(seq=6)
    opt.zero_grad()
    _loss(pm(_data(seq=6)[0]), labels).backward()
    opt.step()
    failed = _fail_on(monkeypatch, io, ".distcp")
    with pytest.raises(OSError, match=r"__0_0\.distcp.*No space left") as info:
        fxshard.save_training_state(pm, opt, ckpt)     # (was a CheckpointException)
    monkeypatch.undo()
    assert failed and info.value.errno == errno.ENOSPC and ckpt in str(info.value)
    assert _listing(ckpt) == before
    assert not [n for n in os.listdir(tmp_path) if "fxshard-" in n]
    pm2, opt2 = _trained(steps=0)
    fxshard.load_training_state(pm2, opt2, ckpt)
    for k, v in pm2.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)


@pytest.mark.grad
def test_truncated_distcp_file_is_named_on_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pm, opt = _trained()
    fxshard.save_training_state(pm, opt, ckpt)
    data = os.path.join(ckpt, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.write(b"\xff" * size)               # as long as before, not what it held
    pm2, opt2 = _trained(steps=0)
    with pytest.raises(ValueError, match=r"damaged.*__0_0\.distcp") as info:
        fxshard.load_training_state(pm2, opt2, ckpt)   # (was a CheckpointException,
    assert ckpt in str(info.value)                     # a BaseException naming no file)
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match=r"damaged.*__0_0\.distcp has \d+ bytes"):
        fxshard.load_training_state(pm2, opt2, ckpt)


@pytest.mark.grad
def test_int64_weight_in_safetensors_is_cast_as_load_state_dict_casts(tmp_path):
    from safetensors.torch import save_file
    ids, labels = _data(seq=6)
    model = _llama(layers=1)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"] = torch.arange(sd["model.norm.weight"].numel())   # int64
    save_file(sd, str(tmp_path / "model.safetensors"))
    one = _llama(layers=1)
    one.load_state_dict(sd)            # one device: copied into the fp32 parameter, cast
    assert one.model.norm.weight.dtype == torch.float32
    pm = fxshard.parallelize(_llama(layers=1), fxshard.init_device_mesh(
        "cpu", (2,), mesh_dim_names=("tp",)), example_inputs=(ids,))
    fxshard.load_safetensors(pm, str(tmp_path))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(one.parameters(), lr=0.1)
    for m, o in ((pm, opt), (one, ref_opt)):   # (was: only floating point tensors can
        _loss(m(ids), labels).backward()       # require gradients, at this step)
        o.step()
    got = pm.state_dict()
    for k, v in one.state_dict().items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replacing_switches_whole_and_recovers_an_interrupted_switch(tmp_path, monkeypatch,
                                                                     exchange):
    from fxshard import atomic_dir
    if not exchange:
        monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "old.bin").write_text("old")
    (d / "keep.txt").write_text("user")
    owned = lambda name: name.endswith(".bin")   # noqa: E731
    with atomic_dir.replacing(str(d), where="t", owned=owned) as stage:
        with stage.file("new.bin") as fh:
            fh.write(b"new")
    assert sorted(os.listdir(d)) == ["keep.txt", "new.bin"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.rename(d, tmp_path / ".ckpt.fxshard-old")     # a crash between the two renames
    with pytest.raises(RuntimeError, match=r"t: writing x\.bin of the checkpoint .*boom"):
        with atomic_dir.replacing(str(d), where="t", owned=owned) as stage:
            assert sorted(os.listdir(d)) == ["keep.txt", "new.bin"]   # put back first
            stage.fail(RuntimeError("boom"), "x.bin")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    monkeypatch.chdir(d)
    with pytest.raises(ValueError, match="working directory"):
        with atomic_dir.replacing(".", where="t", owned=owned):
            pass
