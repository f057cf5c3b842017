"""MLA-style attention (DeepSeek-V3): the value head size (16) differs from the query/key head
size (24). A small plain-PyTorch causal LM equals the single-device model on tp, ring and
Ulysses, and generates the greedy loop's tokens with a V cache of v's head size."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxshard
from fxshard.placement import Shard
from tests.plain_lms import TinyLM, greedy_reference
from tests.models import model_cache

TOL = dict(rtol=1e-4, atol=1e-4)
MESHES = {"tp2": dict(tp=2), "ring2": dict(ring_cp=2), "ulysses2": dict(ulysses_cp=2),
          "tp2ring2": dict(tp=2, ring_cp=2)}


# each model is parallelized over several meshes: built and exported once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
built = model_cache()   # each model built once for this module


def parallel(model, axes):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh)


def mla():
    return TinyLM(qk_head=24, v_head=16, positions="table").eval()


def _targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("mesh", ["tp2", "ring2", "ulysses2"])
def test_forward_equals_single_device(mesh):
    model = built(mla)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = parallel(model, MESHES[mesh])
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    targets = _targets(pm.rank_module(0))
    if mesh == "ring2":
        assert "fxshard.ring_attention.default" in targets
    if mesh == "tp2":   # heads split: each rank holds half of every attention projection
        sd = pm.rank_module(0).state_dict()
        assert sd["layers.0.attn.wq.weight"].shape == (2 * 24, 32)
        assert sd["layers.0.attn.wv.weight"].shape == (2 * 16, 32)
        assert sd["layers.0.attn.wo.weight"].shape == (32, 2 * 16)
    pm.close()


@pytest.mark.parametrize("mesh", ["tp2", "tp2ring2", "ulysses2"])
def test_generate_equals_a_greedy_loop(mesh):
    model = built(mla)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = parallel(model, MESHES[mesh])
    got = pm.generate(ids, max_new_tokens=5)
    caches = dict((k, s) for p in pm.programs.last.programs for k, s, _ in p.kv_caches)
    pm.close()
    torch.testing.assert_close(got, greedy_reference(model, ids, 5), rtol=0, atol=0)
    assert caches["kv.0.k"][-1] == 24 and caches["kv.0.v"][-1] == 16   # per-rank heads: 2
    assert caches["kv.0.k"][1] == caches["kv.0.v"][1] == 2   # 4 heads over 2 ranks


def _hf_deepseek_v3():
    """HF DeepSeek-V3 with a query LoRA (``q_lora_rank``, as its real configs): on tp=2 the
    automatic plan splits ``kv_b_proj`` by heads for the prompt but not for one token."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
        topk_group=1, max_position_embeddings=64)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("axes", [dict(tp=2), dict(dp=2, tp=2)], ids=["tp2", "dp2tp2"])
def test_hf_deepseek_v3_generate_equals_hf_on_tp(axes):
    """The one-token step adopts the prompt's placement of the weights it would place
    otherwise, so both programs keep the KV cache in one layout (it was torch's raw
    ``index_copy_(): Source/destination tensor must have same slice shapes``, then a
    NotImplementedError asking for ``plan=``): greedy tokens equal HF's."""
    model = built(_hf_deepseek_v3)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, do_sample=False, max_new_tokens=4,
                          attention_mask=torch.ones_like(ids), pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallel(model, axes)
        got = pm.generate(ids, max_new_tokens=4)
    decode, prefill = pm.programs.last, [c for (gen, _), c in pm.programs.items()
                                         if gen[0] == "prefill"][0]
    pm.close()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    pinned = dict(decode.ctx.pinned)
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert pinned[kv_b] == Shard(0), pinned          # split by heads, as for the prompt
    assert decode.program.slots[kv_b].spec == prefill.program.slots[kv_b].spec
    caches = [{k: s for k, s, _ in c.program.kv_caches} for c in (prefill, decode)]
    assert caches[0] == caches[1], caches            # one layout for both programs
    batch = 4 // axes.get("dp", 1)   # layer 0: the rank's 2 of 4 heads
    assert caches[0]["kv.0.k"] == (batch, 2, 65, 24) and caches[0]["kv.0.v"] == (batch, 2, 65, 16)


def test_caches_kept_in_two_layouts_even_when_adopted_are_a_clear_error():
    """What adopting the prompt's weight placements cannot reconcile stays a clear error naming
    the cache, both shapes and a plan= that pins the projection."""
    from types import SimpleNamespace as NS
    from fxshard.generation.cache import check_same_caches
    import torch.fx as fx
    graph = fx.Graph()
    graph.output(None)

    def c(shape):
        program = NS(kv_caches=(("kv.0.k", shape, torch.float32),), graph=graph)
        return NS(programs=[program], program=program)
    with pytest.raises(NotImplementedError, match=r"cache kv\.0\.k as \[2, 2, 65, 24\] per "
                       r"rank .* \[2, 4, 65, 24\], even with the prompt's placement .*plan="):
        check_same_caches(c((2, 2, 65, 24)), c((2, 4, 65, 24)))
    check_same_caches(c((2, 2, 65, 24)), c((2, 2, 65, 24)))
