"""Public API: mesh validation, errors that say what to change, meta models, state dicts,
explain(), the demo and the torch.compile backend."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fxshard
from tests.models import hf_llama, our_llama


def test_unknown_axis_name_lists_the_allowed_names():
    with pytest.raises(ValueError, match=r"unknown mesh axis name 'model'.*dp, fsdp, tp, pp, "
                                         r"ulysses_cp, ring_cp"):
        fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "model"))


def test_seed_alias_and_mesh_geometry():
    mesh = fxshard.init_device_mesh("cpu", (1, 2, 1, 2, 1),
                                    mesh_dim_names=("dp", "tp", "pp", "ulysess_cp", "ring_cp"))
    assert mesh.axis_names[3] == "ulysses_cp"
    assert mesh.world_size == 4 and mesh.coords(3) == (0, 1, 0, 1, 0)
    assert mesh.axis_group(3, "tp") == [1, 3]


def test_mesh_shape_and_names_must_match():
    with pytest.raises(ValueError, match="one name per dimension"):
        fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="repeats a name"):
        fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))


@pytest.mark.parametrize("heads,kv,head_dim,tp,message", [
    (4, 2, 16, 3, r"4 query heads.*'tp' of size 3.*divides 4"),
    (6, 3, 8, 2, r"3 key/value heads.*neither split nor replicated"),
], ids=["query_heads", "kv_heads"])
def test_heads_that_cannot_be_split_are_a_value_error(heads, kv, head_dim, tp, message):
    model = our_llama(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                      hidden_size=48, head_dim=head_dim, intermediate_size=96)
    mesh = fxshard.init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match=message):
        fxshard.parallelize(model, mesh, example_inputs=(torch.zeros(1, 6, dtype=torch.long),))


def test_batch_not_divisible_by_dp_names_dim_size_axis():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"dim 0 over mesh axis 'dp' of size 2.*3 elements"):
        fxshard.parallelize(model, mesh)(torch.zeros(3, 8, dtype=torch.long))


def test_state_dict_missing_and_misshaped_keys():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    sd = dict(model.state_dict())
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\]"):
        pm.load_state_dict(sd)
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3, 3\).*\(128, 64\)"):
        pm.load_state_dict(sd)


def test_meta_model_loads_only_slices():
    ref = our_llama(num_hidden_layers=2)
    with torch.device("meta"):
        meta = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(meta, mesh, example_inputs=(ids,))
    with pytest.raises(ValueError, match="meta device"):
        pm(ids)
    pm.load_state_dict(ref.state_dict())
    torch.testing.assert_close(pm(ids), ref(ids), rtol=1e-4, atol=1e-4)
    assert pm.rank_module(1).state_dict()["model.layers.0.mlp.up_proj.weight"].shape == (80, 64)


def test_traces_at_first_call_and_caches_per_signature():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    with pytest.raises(ValueError, match="nothing is traced yet"):
        pm.rank_module(0)
    for seq in (4, 6, 4):
        ids = torch.randint(0, 128, (1, seq))
        torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    assert len(pm.programs) == 2


def test_explain_counts_bytes_and_parameters():
    model = hf_llama(layers=2)
    mesh = fxshard.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (2, 8))
    ex = fxshard.parallelize(model, mesh, example_inputs=(ids,)).explain()
    text = str(ex)
    assert "all_reduce" in text and "Parameter bytes per rank" in text
    ar = [c for c in ex.collectives[0] if c.op == "all_reduce"]
    b, s, h, t = 2, 8, 64, 2
    assert sum(c.wire_bytes for c in ar) == 2 * 4 * (t - 1) * b * s * h * 4 // t  # 2 layers
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert ex.param_bytes[0] == (total - norms) // 2 + norms
    assert ex.fallbacks == []  # HF's mask folds to causal; nothing left without a rule


def test_demo_runs_and_reports_error():
    out = subprocess.run([sys.executable, "-m", "fxshard", "demo", "--mesh", "tp=2",
                          "--layers", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "all_reduce" in out.stdout and "max |parallel - single device|" in out.stdout
    assert "torch.ops.fxshard" in out.stdout


def test_compile_backend_with_pp_says_to_use_parallelize():
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    compiled = torch.compile(model, backend=fxshard.backend(mesh))
    with pytest.raises(Exception, match="use fxshard.parallelize"):
        compiled(torch.randint(0, 128, (2, 8)))
