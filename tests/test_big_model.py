"""The path a user with a big model takes, on a simulated mesh: a HuggingFace checkpoint
directory (several safetensors shards and the index JSON, written by ``save_pretrained``), the
model built from its config without weights (``torch.device("meta")`` or
``fxshard.init_empty_weights()``), ``parallelize``, ``load_safetensors``, run; compared with
``from_pretrained`` on one device. Also: HF models with their default config
(``use_cache=True``), rank programs built on meta equal to those built on CPU for several
families, weights changed after ``parallelize``, non-persistent buffers, biases under tp=4.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn as nn
import transformers
from safetensors.torch import save_file

import fxshard
from tests.models import TransformerBlock

TOL = dict(rtol=1e-4, atol=1e-4)
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))


def _llama_config(**kw):
    # HF's defaults otherwise, use_cache=True included: users do not edit configs to call a model
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, **kw)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random HF Llama saved the way HF saves big models: shards plus index."""
    path = tmp_path_factory.mktemp("hf_ckpt")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(path, max_shard_size="40KB")
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(path), shards
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = ref(IDS).logits
    return str(path), want, sum(p.numel() * p.element_size() for p in ref.parameters())


def _build_empty(how: str):
    if how == "meta":
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(_llama_config())
    with fxshard.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(_llama_config())


@pytest.mark.parametrize("how", ["meta", "init_empty_weights"])
@pytest.mark.parametrize("shape,names,evidence", [
    ((2,), ("tp",), "torch.ops.fxshard.all_reduce.default"),
    ((2, 2), ("tp", "ring_cp"), "torch.ops.fxshard.ring_attention.default"),
    ((2, 2), ("tp", "pp"), "torch.ops.fxshard.send.default"),
])
def test_hf_checkpoint_dir_built_empty(hf_checkpoint, how, shape, names, evidence):
    path, want, full_bytes = hf_checkpoint
    model = _build_empty(how)
    assert all(p.device.type == "meta" for p in model.parameters())
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = fxshard.parallelize(model, mesh)
    fxshard.load_safetensors(pm, path)
    got = pm(IDS)
    assert type(got).__name__ == "CausalLMOutputWithPast" and got.past_key_values is None
    torch.testing.assert_close(got.logits, want, **TOL)
    assert evidence in pm.rank_module(0).code
    ex = pm.explain()
    tp = dict(zip(names, shape))["tp"]
    for r in range(mesh.world_size):  # every weight matrix split: only the norms are whole
        assert ex.param_bytes[r] < full_bytes / (tp * dict(zip(names, shape)).get("pp", 1)) \
            + 6 * 64 * 4, (r, ex.param_bytes[r], full_bytes)
    pm.close()


def test_default_config_output_and_explicit_cache():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).eval()
    assert model.config.use_cache
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    got = pm(IDS)
    with torch.no_grad():
        want = model(IDS, use_cache=False)
    assert type(got) is type(want) and got.past_key_values is None
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    with pytest.raises(NotImplementedError, match="use_cache=True"):
        pm(IDS, use_cache=True)


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "llama-eager": lambda: transformers.LlamaConfig(**_COMMON, attn_implementation="eager"),
    "mistral": lambda: transformers.MistralConfig(**_COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=32, bos_token_id=0, eos_token_id=0),
}
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def _calls(gm: torch.fx.GraphModule, prefix: str) -> list[str]:
    """The ``prefix`` calls of a rank program with their arguments, names left out."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith(prefix):
            args = [a if not isinstance(a, torch.fx.Node) else "%" for a in n.args]
            out.append(f"{n.target}({args})")
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_meta_build_gives_the_cpu_rank_programs(family):
    """Built on meta, the passes must make the same rank programs as for the CPU model: the
    same collectives with the same arguments, the same attention lowering, the same weight
    slots and placements; then, loaded, the same numbers."""
    config = FAMILIES[family]()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.device("meta"):
        empty = transformers.AutoModelForCausalLM.from_config(config).eval()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ring_cp"))
    on_cpu = fxshard.parallelize(ref, mesh, example_inputs=(IDS,))
    on_meta = fxshard.parallelize(empty, mesh, example_inputs=(IDS,))
    for r in range(mesh.world_size):
        a, b = on_cpu.rank_module(r), on_meta.rank_module(r)
        assert _calls(a, "fxshard.") == _calls(b, "fxshard."), r
        assert _calls(a, "aten.scaled_dot") == _calls(b, "aten.scaled_dot"), r
        assert {k: (tuple(v.shape), v.dtype) for k, v in a.state_dict().items()} == \
            {k: (tuple(v.shape), v.dtype) for k, v in b.state_dict().items()}, r
    assert on_cpu.explain().counts(0) == on_meta.explain().counts(0)
    assert on_cpu.explain().param_bytes == on_meta.explain().param_bytes
    on_meta.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref(IDS).logits
    torch.testing.assert_close(on_meta(IDS).logits, want, **TOL)
    torch.testing.assert_close(on_cpu(IDS).logits, want, **TOL)


def test_causal_mask_folds_on_meta():
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(_llama_config())
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    pm = fxshard.parallelize(empty, mesh, example_inputs=(IDS,))
    assert pm.explain().passes["fold_causal_mask_pass"] == {"folded_masks": 2,
                                                            "masks_on_meta": 0}
    assert pm.rank_module(0).code.count("fxshard.ring_attention") == 2


# --- weights changed after parallelize -----------------------------------------------------

def _tp2(model):
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return fxshard.parallelize(model, mesh)


def test_weight_changes_after_parallelize_are_seen():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).eval()
    pm = _tp2(model)
    pm(IDS)
    modules = dict(pm.programs.last.modules)
    pm(IDS)
    assert pm.programs.last.modules == modules  # nothing changed: no re-slicing

    def check():
        with torch.no_grad():
            torch.testing.assert_close(pm(IDS).logits, model(IDS).logits, **TOL)

    with torch.no_grad():  # in place
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    check()
    torch.manual_seed(1)  # model.load_state_dict copies in place
    model.load_state_dict(transformers.LlamaForCausalLM(_llama_config()).state_dict())
    check()
    q = model.model.layers[1].self_attn.q_proj  # a new Parameter object
    q.weight = nn.Parameter(torch.randn_like(q.weight))
    check()
    model.model.rotary_emb.inv_freq.mul_(0.5)  # a buffer
    check()
    model.model.layers[0].mlp.up_proj.weight.data = torch.randn_like(  # new storage via .data
        model.model.layers[0].mlp.up_proj.weight)
    check()
    model.double()  # a new dtype: the program is traced again in float64
    with torch.no_grad():
        got, want = pm(IDS).logits, model(IDS).logits
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, **TOL)


def test_a_loaded_mask_buffer_decides_the_causal_fold():
    """The fold reads the buffer values pm holds: a mask buffer loaded into pm (not into the
    model) that is not causal must not be folded to causal attention."""
    torch.manual_seed(0)
    ref = MaskBuffer().eval()
    with fxshard.init_empty_weights():
        empty = MaskBuffer()  # its real buffer is causal
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    pm = fxshard.parallelize(empty, mesh)
    full = torch.ones(8, 8, dtype=torch.bool)  # attend everywhere: not causal
    pm.load_state_dict({**ref.state_dict(), "causal": full})
    ref.causal = full
    torch.testing.assert_close(pm(IDS), ref(IDS), **TOL)
    call, = [line for line in pm.rank_module(0).code.splitlines() if "ring_attention.default(" in line]
    assert re.search(r"ring_attention\.default\(\w+, \w+, \w+, False, .*, 0\.0, \w+\)",
                     call), call   # not causal: the loaded mask rides the ring


def test_pm_load_state_dict_then_model_edits():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).eval()
    pm = _tp2(model)
    torch.manual_seed(2)
    other = transformers.LlamaForCausalLM(_llama_config()).eval()
    pm.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pm(IDS).logits, other(IDS).logits, **TOL)
        model.lm_head.weight.add_(1.0)  # the latest write wins: the model's lm_head now
        other.lm_head.weight.copy_(model.lm_head.weight)
        torch.testing.assert_close(pm(IDS).logits, other(IDS).logits, **TOL)


# --- non-persistent buffers ------------------------------------------------------------------

class Scaled(nn.Module):
    """A model with a non-persistent buffer its constructor computes (no HF initialiser)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 32)
        self.proj = nn.Linear(32, 64)
        self.out = nn.Linear(64, 32)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32), persistent=False)

    def forward(self, ids):
        return self.out(torch.relu(self.proj(self.emb(ids) * self.scale)))


def test_meta_buffer_without_initialiser_is_a_clear_error_with_fixes():
    torch.manual_seed(0)
    ref = Scaled().eval()
    empty = Scaled().to("meta")  # as built under torch.device("meta"), buffer included
    pm = _tp2(empty)
    pm.load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match=r"non-persistent buffers \['scale'\] are on the meta "
                                         r"device.*fxshard.init_empty_weights\(\)"):
        pm(IDS)
    pm.load_state_dict({**ref.state_dict(), "scale": ref.scale})  # fix 1: by name
    torch.testing.assert_close(pm(IDS), ref(IDS), **TOL)
    with fxshard.init_empty_weights():  # fix 2: buffers built for real
        empty = Scaled()
    assert empty.proj.weight.device.type == "meta" and empty.scale.device.type == "cpu"
    pm = _tp2(empty)
    pm.load_state_dict(ref.state_dict())
    torch.testing.assert_close(pm(IDS), ref(IDS), **TOL)
    with pytest.raises(ValueError, match=r"'scale' has shape \(3,\)"):
        pm.load_state_dict({**ref.state_dict(), "scale": torch.ones(3)})


class MaskBuffer(nn.Module):
    """Attention whose causal mask is a buffer (as older GPT-2 code registers ``bias``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 32)
        self.qkv = nn.Linear(32, 96)
        self.register_buffer("causal", torch.ones(8, 8, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).view(2, 8, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.causal)


def test_mask_from_a_meta_buffer_warns_and_stays_correct():
    torch.manual_seed(0)
    ref = MaskBuffer().eval()
    empty = MaskBuffer().to("meta")
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    with pytest.warns(UserWarning, match=r"reads the buffer 'causal'.*init_empty_weights"):
        pm = fxshard.parallelize(empty, mesh, example_inputs=(IDS,))
    pm.load_state_dict({**ref.state_dict(), "causal": ref.causal})
    torch.testing.assert_close(pm(IDS), ref(IDS), **TOL)
    with fxshard.init_empty_weights():  # real buffers: the mask folds to causal
        empty = MaskBuffer()
    pm = fxshard.parallelize(empty, mesh, example_inputs=(IDS,))
    assert "fxshard.ring_attention" in pm.rank_module(0).code
    pm.load_state_dict(ref.state_dict())
    torch.testing.assert_close(pm(IDS), ref(IDS), **TOL)


# --- biases under tp=4 ---------------------------------------------------------------------

def test_biases_loaded_under_tp4(tmp_path):
    """Column-parallel biases split like their weight; row-parallel biases are Partial: held
    whole by the tp coordinate 0 and zeros elsewhere, so the all-reduce adds them once."""
    torch.manual_seed(0)
    ref = TransformerBlock(64, 4).eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(tmp_path / "block.safetensors"))
    with torch.device("meta"):
        empty = TransformerBlock(64, 4)
    mesh = fxshard.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = torch.randn(2, 8, 64)
    pm = fxshard.parallelize(empty, mesh, example_inputs=(x,))
    fxshard.load_safetensors(pm, str(tmp_path / "block.safetensors"))
    torch.testing.assert_close(pm(x), ref(x), **TOL)
    blocks = [pm.rank_module(r).state_dict() for r in range(4)]
    for name in ("attention.wo.bias", "mlp.w2.bias"):  # row-parallel: Partial
        assert torch.equal(blocks[0][name], ref.state_dict()[name])
        assert all(not b[name].any() for b in blocks[1:]), name
    for name in ("attention.wq.bias", "mlp.w1.bias"):  # column-parallel: split
        torch.testing.assert_close(torch.cat([b[name] for b in blocks]), ref.state_dict()[name])


def test_qwen2_checkpoint_with_qkv_biases_under_tp4(tmp_path):
    config = transformers.Qwen2Config(**{**_COMMON, "num_key_value_heads": 4})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path, max_shard_size="40KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ref.model.layers[0].self_attn.k_proj.bias is not None
    with torch.device("meta"):
        empty = transformers.AutoModelForCausalLM.from_config(config)
    mesh = fxshard.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(empty, mesh)
    fxshard.load_safetensors(pm, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(pm(IDS).logits, ref(IDS).logits, **TOL)
    with open(tmp_path / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    bias = pm.rank_module(1).state_dict()["model.layers.0.self_attn.k_proj.bias"]
    assert bias.shape == (16,)  # 4 KV heads of 16 over tp=4: one head each
