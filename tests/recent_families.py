"""Tiny random configs of transformers' recent hybrid and MoE families (no downloads).

``RECENT[name] = build``; ``build(layers)`` returns the causal LM in eval mode with a fixed
seed: hidden 64, vocab 128, sizes chosen so every sharded dim divides by 2 and the
state-space / linear-attention layers sit next to full attention where the family mixes them.
"""
from __future__ import annotations

import torch

VOCAB = 128
HIDDEN = 64


def _ids(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, use_cache=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)


def _make(cls, cfg, attn: str = "sdpa"):
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).eval()


def mamba2(layers: int):
    import transformers as T
    cfg = T.Mamba2Config(num_hidden_layers=layers, num_heads=8, head_dim=16, state_size=8,
                         n_groups=2, expand=2, conv_kernel=4, chunk_size=8,
                         time_step_rank=8, **_ids())
    return _make(T.Mamba2ForCausalLM, cfg, "eager")


def granitemoehybrid(layers: int):
    import transformers as T
    types = ["mamba" if i % 2 == 0 else "attention" for i in range(layers)]
    cfg = T.GraniteMoeHybridConfig(
        num_hidden_layers=layers, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, layer_types=types, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        **_ids())
    return _make(T.GraniteMoeHybridForCausalLM, cfg)


def falcon_h1(layers: int):
    import transformers as T
    cfg = T.FalconH1Config(
        num_hidden_layers=layers, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, **_ids())
    return _make(T.FalconH1ForCausalLM, cfg)


def kimi_linear(layers: int):
    import transformers as T
    types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = T.KimiLinearConfig(
        num_hidden_layers=layers, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=types, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        **_ids())
    return _make(T.KimiLinearForCausalLM, cfg)


def qwen3_next(layers: int):
    import transformers as T
    types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = T.Qwen3NextConfig(
        num_hidden_layers=layers, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, layer_types=types, **_ids())
    return _make(T.Qwen3NextForCausalLM, cfg)


def gpt_oss(layers: int):
    import transformers as T
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = T.GptOssConfig(
        num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=8, layer_types=types, **_ids())
    return _make(T.GptOssForCausalLM, cfg, "eager")


def llama4(layers: int):
    import transformers as T
    cfg = T.Llama4TextConfig(
        num_hidden_layers=layers, intermediate_size=32, intermediate_size_mlp=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=list(range(layers)), attention_chunk_size=8192,
        **_ids())
    return _make(T.Llama4ForCausalLM, cfg)


def jamba(layers: int):
    import transformers as T
    cfg = T.JambaConfig(
        num_hidden_layers=layers, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=8, **_ids())
    return _make(T.JambaForCausalLM, cfg)


def deepseek_v3(layers: int):
    import transformers as T
    cfg = T.DeepseekV3Config(
        num_hidden_layers=layers, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=0, **_ids())
    return _make(T.DeepseekV3ForCausalLM, cfg)


RECENT = {"mamba2": mamba2, "granitemoehybrid": granitemoehybrid, "falcon_h1": falcon_h1,
          "kimi_linear": kimi_linear, "qwen3_next": qwen3_next, "gpt_oss": gpt_oss,
          "llama4": llama4, "jamba": jamba, "deepseek_v3": deepseek_v3}
