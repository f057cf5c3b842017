"""save_safetensors: an HF checkpoint from tp / dp·tp (simulated) that from_pretrained and
load_safetensors on another mesh read; a training module's trained shards."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.training import parallelize_for_training
from tests.models import hf_llama


def _ids(seed=0, b=2, s=7, v=96):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape,names", [((2,), ("tp",)), ((2, 2), ("dp", "tp"))])
@pytest.mark.parametrize("tie", [False, True])
def test_save_from_parallel_module_reads_back_in_hf_and_on_another_mesh(tmp_path, shape, names,
                                                                        tie):
    import transformers
    ref = hf_llama(hidden=48, intermediate=72, vocab=96, tie=tie)
    ids = _ids()
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = fxshard.parallelize(ref, mesh, example_inputs=(ids,))
    files = fxshard.save_safetensors(pm, str(tmp_path), max_shard_size=20_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(f"-of-{len(shards):05d}" in f for f in shards)
    assert sorted(os.path.basename(f) for f in files) == sorted(   # HF's config too, so
        shards + ["model.safetensors.index.json", "config.json",     # from_pretrained reads
                  "generation_config.json"])                          # the directory alone
    assert json.load(open(tmp_path / "config.json"))["architectures"] == ["LlamaForCausalLM"]
    assert ("lm_head.weight" in index["weight_map"]) is not tie   # a tied weight once
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    want = ref.state_dict()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    with torch.device("meta"):
        meta = hf_llama(hidden=48, intermediate=72, vocab=96, tie=tie)
    other = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)) if len(shape) == 1 \
        else fxshard.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    pm2 = fxshard.parallelize(meta, other, example_inputs=(ids,))
    fxshard.load_safetensors(pm2, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(pm2(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_max_shard_size_is_checked():
    from fxshard.checkpoint_save import shard_size_bytes
    assert shard_size_bytes("5GB") == 5 * 10 ** 9 and shard_size_bytes("2MiB") == 2 ** 21
    with pytest.raises(ValueError, match="max_shard_size='five'"):
        shard_size_bytes("five")


def _train(model, mesh, ids, labels, steps=2):
    tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(steps):
        out = tm(ids)
        F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return tm


@pytest.mark.grad   # trains: grad enabled
def test_trained_shards_saved_equal_single_device_training(tmp_path):
    import transformers
    model = hf_llama(hidden=48, intermediate=72, vocab=96)
    single = hf_llama(hidden=48, intermediate=72, vocab=96)
    ids, labels = _ids(1), _ids(2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tm = _train(model, mesh, ids, labels)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(2):
        F.cross_entropy(single(ids).logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()
    fxshard.save_safetensors(tm, str(tmp_path), max_shard_size="30KB")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    want, trained = single.state_dict(), tm.state_dict()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0)   # the shards, as trained
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-5)
    # the model object keeps its initial weights; the checkpoint has the trained ones
    assert not torch.equal(model.model.embed_tokens.weight, want["model.embed_tokens.weight"])
    with torch.device("meta"):
        meta = hf_llama(hidden=48, intermediate=72, vocab=96)
    pm = fxshard.parallelize(meta, fxshard.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
                             example_inputs=(ids,))
    fxshard.load_safetensors(pm, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, single.eval()(ids).logits, rtol=1e-4,
                                   atol=1e-4)


def _single_steps(model, ids, labels, steps, clip=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(steps):
        F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten()).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _pm_steps(pm, ids, labels, steps, clip=None):
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(steps):
        F.cross_entropy(pm(ids).logits.flatten(0, 1), labels.flatten()).backward()
        if clip is not None:
            fxshard.clip_grad_norm_(pm, clip)
        opt.step()
        opt.zero_grad()


@pytest.mark.grad   # trains: grad enabled
@pytest.mark.parametrize("shape,names,other", [
    ((2, 2), ("fsdp", "tp"), ((2,), ("pp",))),     # reloaded into a meta-built pipeline
    ((2,), ("pp",), ((2, 2), ("dp", "tp"))),       # saved from the stages' shards
])
def test_parallel_module_trained_saved_then_reloaded_elsewhere_trains_on(tmp_path, shape, names,
                                                                          other):
    """pm (fxshard.parallelize) trained, saved, read by from_pretrained, reloaded on another
    mesh and trained on: every step equals the single-device model's (the checkpoint holds
    the trained shards, not the model object's initial weights)."""
    import transformers
    kw = dict(hidden=48, intermediate=72, vocab=96)   # untied: pp trains no tied weight
    model, single = hf_llama(**kw), hf_llama(**kw)
    ids, labels = _ids(1), _ids(2)
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names),
                             example_inputs=(ids,))
    _pm_steps(pm, ids, labels, 2, clip=0.5)
    _single_steps(single, ids, labels, 2, clip=0.5)
    fxshard.save_safetensors(pm, str(tmp_path), max_shard_size="30KB")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    want, trained = single.state_dict(), pm.state_dict()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0)
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-5)
    with fxshard.init_empty_weights():
        meta = hf_llama(**kw)
    pm2 = fxshard.parallelize(meta, fxshard.init_device_mesh("cpu", other[0],
                                                             mesh_dim_names=other[1]),
                              example_inputs=(ids,))
    fxshard.load_safetensors(pm2, str(tmp_path))
    _pm_steps(pm2, ids, labels, 2, clip=0.5)
    _single_steps(single, ids, labels, 2, clip=0.5)
    got = pm2.state_dict()
    for k, v in single.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)
