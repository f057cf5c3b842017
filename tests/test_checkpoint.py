"""Sharded safetensors loading on a simulated mesh: a meta-built model, a checkpoint written
here in two shard files, every rank reading only its slices."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fxshard
from tests.models import our_llama


def write_shards(model, directory, *, drop=()):
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop}
    keys = sorted(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(directory / "model-00002-of-00002.safetensors"))


def test_meta_model_reads_only_its_slices(tmp_path):
    ref = our_llama(num_hidden_layers=2)
    write_shards(ref, tmp_path)
    with torch.device("meta"):
        meta = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(meta, mesh, example_inputs=(ids,))
    fxshard.load_safetensors(pm, str(tmp_path))
    torch.testing.assert_close(pm(ids), ref(ids), rtol=1e-4, atol=1e-4)
    total = sum(p.numel() for p in ref.parameters())
    read = {}
    for name, src in pm.weights.values.items():
        assert hasattr(src, "block"), name
        read[name] = sum(src.reads)
    # each weight read once per rank that holds it, only its block: q_proj is split over tp
    # and lives on stage 0 only, so its 2 blocks add up to the full weight exactly once
    assert read["model.layers.0.self_attn.q_proj.weight"] == 64 * 64
    assert read["model.layers.1.mlp.down_proj.weight"] == 64 * 160
    assert sum(read.values()) < 2 * total
    for r in range(4):
        sd = pm.rank_module(r).state_dict()
        assert sum(t.numel() for t in sd.values()) < total / 2 + 3 * 64 * 4


def test_tied_checkpoint_saved_once_and_file_path(tmp_path):
    ref = our_llama(num_hidden_layers=1, tie_word_embeddings=True)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta = our_llama(num_hidden_layers=1, tie_word_embeddings=True)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(meta, mesh, embedding="vocab")
    fxshard.load_safetensors(pm, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(pm(ids), ref(ids), rtol=1e-4, atol=1e-4)


def test_bad_checkpoint_paths_and_keys(tmp_path):
    ref = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(ref, mesh)
    with pytest.raises(ValueError, match="does not exist"):
        fxshard.load_safetensors(pm, str(tmp_path / "nope.safetensors"))
    write_shards(ref, tmp_path, drop=("model.norm.weight",))
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\]"):
        fxshard.load_safetensors(pm, str(tmp_path))


def _one_file(tmp_path):
    ref = our_llama(num_hidden_layers=1)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return ref, path, fxshard.parallelize(ref, mesh)


def _edit_header(path, edit):
    import json
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * max(0, n - len(text))
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def test_corrupt_header_names_the_file(tmp_path):
    _, path, pm = _one_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(ValueError, match=rf"{path.name} has a corrupt header"):
        fxshard.load_safetensors(pm, str(path))
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=rf"{path.name} is not a safetensors file or is "
                                         rf"truncated"):
        fxshard.load_safetensors(pm, str(path))


def test_truncated_file_is_refused_at_load_naming_the_tensor(tmp_path):
    _, path, pm = _one_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - 100])
    with pytest.raises(ValueError, match=rf"tensor '[\w.]+' in .*{path.name} ends at byte "
                                         rf"\d+ of a data section of \d+ bytes"):
        fxshard.load_safetensors(pm, str(path))


def test_unknown_dtype_and_wrong_offsets_are_value_errors(tmp_path):
    _, path, pm = _one_file(tmp_path)
    _edit_header(path, lambda h: h["model.norm.weight"].update(dtype="Q4"))
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' in .* has dtype 'Q4', "
                                         r"which fxshard cannot read \(supported: F64"):
        fxshard.load_safetensors(pm, str(path))
    _, path, pm = _one_file(tmp_path)
    _edit_header(path, lambda h: h["model.norm.weight"].update(shape=[65]))
    with pytest.raises(ValueError, match=r"'model.norm.weight' .* takes 256 bytes but shape "
                                         r"\[65\] of F32 needs 260"):
        fxshard.load_safetensors(pm, str(path))


def write_indexed(model, directory) -> dict:
    """Two shards and ``model.safetensors.index.json`` as ``save_pretrained`` writes them."""
    import json
    write_shards(model, directory)
    keys = sorted(model.state_dict())
    half = len(keys) // 2
    weight_map = {k: ("model-00001-of-00002.safetensors" if i < half
                      else "model-00002-of-00002.safetensors") for i, k in enumerate(keys)}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_index_decides_the_files_a_stray_consolidated_file_is_ignored(tmp_path):
    ref = our_llama(num_hidden_layers=1)
    write_indexed(ref, tmp_path)
    # a consolidated file with different (renamed, Mistral-style) keys next to the shards
    save_file({"stray." + k: v.contiguous() for k, v in ref.state_dict().items()},
              str(tmp_path / "consolidated.safetensors"))
    with torch.device("meta"):
        meta = our_llama(num_hidden_layers=1)
    pm = fxshard.parallelize(meta, fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    fxshard.load_safetensors(pm, str(tmp_path))
    ids = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(pm(ids), ref(ids), rtol=1e-4, atol=1e-4)
    assert {src.file for src in pm.weights.values.values() if hasattr(src, "block")} == {
        str(tmp_path / "model-00001-of-00002.safetensors"),
        str(tmp_path / "model-00002-of-00002.safetensors")}
    # the index's own path works too
    pm2 = fxshard.parallelize(our_llama(num_hidden_layers=1),
                              fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    fxshard.load_safetensors(pm2, str(tmp_path / "model.safetensors.index.json"))
    torch.testing.assert_close(pm2(ids), ref(ids), rtol=1e-4, atol=1e-4)


def test_a_listed_file_that_is_missing_is_named_with_a_key_it_holds(tmp_path):
    ref = our_llama(num_hidden_layers=1)
    weight_map = write_indexed(ref, tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    key = next(k for k, v in weight_map.items() if v == "model-00002-of-00002.safetensors")
    pm = fxshard.parallelize(our_llama(num_hidden_layers=1),
                             fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors is listed in .*"
                                         rf"index\.json \(it holds '{key}' and \d+ more"):
        fxshard.load_safetensors(pm, str(tmp_path))


def test_an_index_that_disagrees_with_its_files_is_an_error(tmp_path):
    import json
    ref = our_llama(num_hidden_layers=1)
    weight_map = write_indexed(ref, tmp_path)
    key = next(iter(weight_map))
    weight_map[key] = "model-00002-of-00002.safetensors"  # the key is really in shard 1
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    pm = fxshard.parallelize(our_llama(num_hidden_layers=1),
                             fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    with pytest.raises(ValueError, match=rf"the index lists '{key}' in .*00002.*but it is in "
                                         r".*00001"):
        fxshard.load_safetensors(pm, str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read the index"):
        fxshard.load_safetensors(pm, str(tmp_path))
