"""Expert parallelism (``ep``, issue 44) on more models and meshes: HF OLMoE and DeepSeek-V3
(MLA attention, a shared expert beside the routed ones) on ep2, Mixtral on pp2·ep2 (each
stage routes its own layers) and ep2·ring_cp2 (each rank's zigzag share of the sequence
routed to the experts' ranks): logits equal one device, every MoE layer routed."""
from __future__ import annotations

import pytest
import torch

from tests.families import _common, _make, mixtral
from tests.test_expert_parallel import _parallel


def olmoe(layers: int):
    import transformers as T
    cfg = T.OlmoeConfig(intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        num_key_value_heads=2, **_common(layers))
    return _make(T.OlmoeForCausalLM, cfg)


def deepseek_v3(layers: int):
    import transformers as T
    cfg = T.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                             first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             num_key_value_heads=4, **_common(layers))
    return _make(T.DeepseekV3ForCausalLM, cfg)


@pytest.mark.parametrize("build,axes,layers", [
    (olmoe, dict(ep=2), 1), (deepseek_v3, dict(ep=2), 1), (mixtral, dict(pp=2, ep=2), 2),
    (mixtral, dict(ep=2, ring_cp=2), 1)],
    ids=["olmoe-ep2", "deepseek_v3-ep2", "mixtral-pp2ep2", "mixtral-ep2ring2"])
def test_logits_equal_one_device(build, axes, layers):
    model = build(layers)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    pm = _parallel(model, axes)
    with torch.no_grad():
        got = pm(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    routed = pm.explain().passes["expert_parallel_pass"]
    assert routed["moe_layers"] == layers, routed
    assert routed["dispatches"] == routed["combines"] == routed["moe_layers"], routed
    assert routed["experts_per_rank"] == 2, routed
    pm.close()
