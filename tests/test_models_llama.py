"""fxshard.models.llama: numerics vs transformers.LlamaForCausalLM, and export."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

transformers = pytest.importorskip("transformers")


def _load_llama():
    try:
        from fxshard.models import llama
        return llama
    except Exception:  # the package __init__ may be mid-edit: load the file by path
        path = Path(__file__).resolve().parents[1] / "fxshard" / "models" / "llama.py"
        spec = importlib.util.spec_from_file_location("_fxshard_models_llama", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


llama = _load_llama()
LlamaConfig, LlamaForCausalLM = llama.LlamaConfig, llama.LlamaForCausalLM

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def hf_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=160,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, attn_implementation="sdpa")
    base.update(kw)
    return transformers.LlamaConfig(**base)


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(cfg).eval()
    # HF inits norms to ones: randomise them so the weight multiply is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def ours_from_hf(hf):
    ours = LlamaForCausalLM(LlamaConfig.from_hf(hf.config)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids, use_cache=False).logits


def call_targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


# --------------------------------------------------------------------- config

def test_config_defaults():
    cfg = LlamaConfig.tiny()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128, 64, 160)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 16
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.mlp_bias
    assert LlamaConfig.tiny(hidden_size=96, num_attention_heads=2).head_dim == 48
    assert LlamaConfig.tiny(head_dim=8).head_dim == 8
    with pytest.raises(ValueError):
        LlamaConfig.tiny(num_key_value_heads=3)


def test_from_hf_roundtrip():
    cfg = LlamaConfig.from_hf(hf_config(tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5))
    assert cfg.tie_word_embeddings and cfg.rope_theta == 5e5 and cfg.rms_norm_eps == 1e-5
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 2


# ------------------------------------------------------------ numerics vs HF

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tie", [False, True])
def test_matches_hf(tie, attn):
    hf = hf_model(hf_config(tie_word_embeddings=tie, attn_implementation=attn))
    ours = ours_from_hf(hf)
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 128, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(ids)
    assert isinstance(got, torch.Tensor) and got.shape == (3, 13, 128)
    torch.testing.assert_close(got, hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_bias_variants_match_hf():
    hf = hf_model(hf_config(attention_bias=True, mlp_bias=True, num_key_value_heads=1))
    ours = ours_from_hf(hf)
    assert "model.layers.0.self_attn.q_proj.bias" in ours.state_dict()
    assert "model.layers.1.mlp.down_proj.bias" in ours.state_dict()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_bf16_matches_hf():
    hf = hf_model(hf_config())
    ours = ours_from_hf(hf)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        got = ours(ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, hf_logits(hf, ids), rtol=2e-2, atol=2e-2)


def test_tied_checkpoint_without_lm_head_loads():
    hf = hf_model(hf_config(tie_word_embeddings=True))
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = LlamaForCausalLM(LlamaConfig.from_hf(hf.config)).eval()
    ours.load_state_dict(sd, strict=True)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_materialise_then_load(tie):
    """Built on meta, materialised with to_empty, loaded: no state is lost
    (the model has no non-persistent buffers; the tie survives to_empty)."""
    hf = hf_model(hf_config(tie_word_embeddings=tie))
    with torch.device("meta"):
        ours = LlamaForCausalLM(LlamaConfig.from_hf(hf.config))
    assert list(ours.buffers()) == []
    ours.to_empty(device="cpu")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


@given(
    layers=st.integers(1, 2),
    heads=st.sampled_from([1, 2, 4, 8]),
    kv_div=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([4, 8, 16]),
    explicit_head_dim=st.booleans(),
    inter=st.integers(8, 48),
    vocab=st.integers(16, 64),
    seq=st.integers(1, 12),
    batch=st.integers(1, 3),
    tie=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_matches_hf(layers, heads, kv_div, head_dim, explicit_head_dim,
                               inter, vocab, seq, batch, tie, seed):
    kv = heads // kv_div if heads % kv_div == 0 else heads
    # explicit head_dim: hidden_size is *not* heads * head_dim
    hidden = 24 if explicit_head_dim else heads * head_dim
    cfg = hf_config(num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, hidden_size=hidden,
                    head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                    tie_word_embeddings=tie)
    hf = hf_model(cfg, seed=seed)
    ours = ours_from_hf(hf)
    assert ours.config.head_dim == head_dim
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------- export

def _check_exported(ep, model):
    targets = call_targets(ep.graph_module)
    sdpa = [n for n in ep.graph.nodes if n.target is SDPA]
    assert len(sdpa) == model.config.num_hidden_layers
    for n in sdpa:  # no mask tensor, causal flag, GQA without repeat_kv
        assert len(n.args) == 3 or n.args[3] is None
        is_causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal")
        assert is_causal is True
        gqa = model.config.num_key_value_heads != model.config.num_attention_heads
        assert n.kwargs.get("enable_gqa", False) == gqa
    assert torch.ops.aten.expand.default not in targets  # no repeat_kv
    # no higher-order ops / submodules, no data-dependent ops
    assert not [name for name, _ in ep.graph_module.named_children()]
    assert all(isinstance(t, torch._ops.OpOverload) for t in targets), targets
    assert not any(t._schema.is_mutable for t in targets)
    sig = ep.graph_signature
    assert set(sig.parameters) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(sig.parameters) == set(model.state_dict())  # HF names
    assert "model.layers.0.self_attn.q_proj.weight" in sig.parameters
    assert "model.layers.1.mlp.down_proj.weight" in sig.parameters
    assert list(sig.buffers) == [] and not ep.constants


@pytest.mark.parametrize("tie", [False, True])
def test_export_real(tie):
    model = LlamaForCausalLM(LlamaConfig.tiny(tie_word_embeddings=tie)).eval()
    ids = torch.randint(0, 128, (2, 8))
    ep = torch.export.export(model, (ids,), strict=False)
    _check_exported(ep, model)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_export_meta(kv):
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.tiny(num_key_value_heads=kv, tie_word_embeddings=kv == 1))
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    ep = torch.export.export(model, (ids,), strict=False)
    _check_exported(ep, model)
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 8, 128)


def test_export_meta_and_real_same_graph():
    ids = torch.zeros(2, 8, dtype=torch.long)
    real = torch.export.export(LlamaForCausalLM(LlamaConfig.tiny()), (ids,), strict=False)
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(LlamaConfig.tiny())
    meta = torch.export.export(meta_model, (ids.to("meta"),), strict=False)
    seq = lambda ep: [n.target for n in ep.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert seq(real) == seq(meta)
