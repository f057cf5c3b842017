"""End to end: data + tensor parallel (with and without sequence parallelism) against the
single-device model, fp32, rtol=atol=1e-4, and the collective structure of each rank."""
from __future__ import annotations

import pytest
import torch

import fxshard
from tests.models import TransformerBlock, hf_llama, our_llama, model_cache

TOL = dict(rtol=1e-4, atol=1e-4)
# the families below parallelize each model over many meshes: built and exported once each
# (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
built = model_cache()   # each model built once for this module
MESHES = [(dp, tp) for dp in (1, 2) for tp in (1, 2, 4) if dp * tp > 1]


def _seed_block():
    torch.manual_seed(3)
    return TransformerBlock(32, 4).eval()


def mesh_of(dp, tp):
    return fxshard.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def counts(pm, rank=0):
    return pm.explain().counts(rank)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("dp,tp", MESHES)
def test_our_llama(dp, tp, sp):
    model = built(our_llama, num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(ids)
    pm = fxshard.parallelize(model, mesh_of(dp, tp), sequence_parallel=sp)
    torch.testing.assert_close(pm(ids), want, **TOL)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("dp,tp", MESHES)
def test_hf_llama(dp, tp, sp):
    model = built(hf_llama, layers=2, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    pm = fxshard.parallelize(model, mesh_of(dp, tp), sequence_parallel=sp)
    out = pm(ids)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    torch.testing.assert_close(out.logits, want, **TOL)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("dp,tp", MESHES)
def test_seed_transformer_block(dp, tp, sp):
    model = built(_seed_block)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    want = model(x)
    pm = fxshard.parallelize(model, mesh_of(dp, tp), sequence_parallel=sp)
    torch.testing.assert_close(pm(x), want, **TOL)
    if tp > 1 and not sp:
        assert counts(pm)[("all_reduce", "tp")] == 2


@pytest.mark.parametrize("make", [our_llama, hf_llama], ids=["ours", "hf"])
def test_two_all_reduces_per_layer(make):
    """Without SP each decoder layer adds exactly two all-reduces on tp to every rank."""
    ids = torch.randint(0, 128, (2, 8))
    per_layers = {}
    for layers in (1, 3):
        model = make(**({"num_hidden_layers": layers} if make is our_llama else
                        {"layers": layers}))
        pm = fxshard.parallelize(model, mesh_of(2, 2), example_inputs=(ids,))
        ex = pm.explain()
        per_layers[layers] = [ex.counts(r) for r in range(4)]
        for c in per_layers[layers]:
            assert c[("all_reduce", "tp")] == 2 * layers
            assert c[("reduce_scatter", "tp")] == 0
    # the only other collectives: embedding all-gather, logits all-gather, batch all-gather
    assert per_layers[3][0] - per_layers[1][0] == {("all_reduce", "tp"): 4}


@pytest.mark.parametrize("make", [our_llama, hf_llama], ids=["ours", "hf"])
def test_sp_two_reduce_scatters_and_all_gathers_per_layer(make):
    ids = torch.randint(0, 128, (2, 8))
    c = {}
    for layers in (1, 3):
        model = make(**({"num_hidden_layers": layers} if make is our_llama else
                        {"layers": layers}))
        pm = fxshard.parallelize(model, mesh_of(1, 2), example_inputs=(ids,),
                                 sequence_parallel=True)
        c[layers] = pm.explain().counts(0)
        assert c[layers][("all_reduce", "tp")] == 0
        assert c[layers][("reduce_scatter", "tp")] == 2 * layers
    diff = c[3] - c[1]
    assert diff == {("reduce_scatter", "tp"): 4, ("all_gather", "tp"): 4}


def test_rank_module_is_self_contained_and_holds_slices():
    model = our_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh_of(1, 2), example_inputs=(ids,))
    gm = pm.rank_module(1)
    sd = gm.state_dict()
    full = model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert sd[q].shape == (32, 64) and torch.equal(sd[q], full[q][32:])
    assert sd[o].shape == (64, 32) and torch.equal(sd[o], full[o][:, 32:])
    assert torch.equal(sd["model.norm.weight"], full["model.norm.weight"])
    code = gm.code
    assert "torch.ops.fxshard.all_reduce" in code and "torch.ops.fxshard.attention" in code
    assert "aten.scaled_dot_product_attention" not in code


def test_tied_embeddings_vocab_and_embed_dim():
    model = our_llama(num_hidden_layers=1, tie_word_embeddings=True)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids)
    for style in ("embed_dim", "vocab"):
        pm = fxshard.parallelize(model, mesh_of(2, 2), embedding=style)
        torch.testing.assert_close(pm(ids), want, **TOL)


def test_vocab_embedding_with_sp():
    model = hf_llama(layers=1)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids).logits
    pm = fxshard.parallelize(model, mesh_of(1, 2), embedding="vocab", sequence_parallel=True)
    torch.testing.assert_close(pm(ids).logits, want, **TOL)
    assert pm.explain().counts(0)[("all_reduce", "tp")] == 0


def test_plan_override_by_glob():
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids)
    pm = fxshard.parallelize(model, mesh_of(1, 2),
                             plan={"model.layers.*.mlp.*": "replicate"})
    torch.testing.assert_close(pm(ids), want, **TOL)
    sd = pm.rank_module(0).state_dict()
    assert sd["model.layers.1.mlp.up_proj.weight"].shape == (160, 64)
    assert sd["model.layers.1.self_attn.q_proj.weight"].shape == (32, 64)
    # the MLP no longer all-reduces: one all-reduce per layer is left (attention)
    assert pm.explain().counts(0)[("all_reduce", "tp")] == 2


def test_gqa_kv_heads_replicated_when_tp_exceeds_them():
    model = our_llama(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids)
    pm = fxshard.parallelize(model, mesh_of(1, 4))
    torch.testing.assert_close(pm(ids), want, **TOL)
    sd = pm.rank_module(2).state_dict()
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)   # replicated
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (16, 64)   # 1 of 4 heads


def test_row_parallel_bias_added_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16)).eval()
    with torch.no_grad():
        model[2].bias.fill_(5.0)
    x = torch.randn(4, 16)
    pm = fxshard.parallelize(model, mesh_of(1, 4))
    torch.testing.assert_close(pm(x), model(x), **TOL)
    biases = [pm.rank_module(r).state_dict()["2.bias"] for r in range(4)]
    assert sum(int(b.abs().sum() > 0) for b in biases) == 1


def test_replicated_embedding_tied_and_strict():
    """embedding='replicate': no collective after the lookup, the same numbers; not an error
    under strict=True (asked for); a tied table feeding lm_head as well still computes
    right."""
    model = our_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (2, 8))
    pm = fxshard.parallelize(model, mesh_of(1, 2), embedding="replicate", strict=True)
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    assert pm.explain().counts(0)[("all_gather", "tp")] == 1     # the logits only
    tied = our_llama(num_hidden_layers=1, tie_word_embeddings=True)
    pm = fxshard.parallelize(tied, mesh_of(2, 2), embedding="replicate")
    torch.testing.assert_close(pm(ids), tied(ids), **TOL)
