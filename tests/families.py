"""Tiny random HuggingFace causal LMs, one per model pattern fxshard must shard (no downloads).

``FAMILIES[name] = (pattern, build)``; ``build(layers)`` returns the model in eval mode with a
fixed seed. Hidden 64, 4 heads of 16 (2 KV heads where the family has GQA), vocab 128.
"""
from __future__ import annotations

import torch

VOCAB = 128
HIDDEN = 64


def _common(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                num_attention_heads=4, use_cache=False, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)


def _make(cls, cfg):
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).eval()


def phi3(layers: int):
    import transformers as T
    return _make(T.Phi3ForCausalLM, T.Phi3Config(intermediate_size=128, num_key_value_heads=2,
                                                 **_common(layers)))


def gpt_neox(layers: int):
    import transformers as T
    return _make(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(intermediate_size=128,
                                                       **_common(layers)))


def gpt2(layers: int):
    import transformers as T
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=4,
                       n_positions=64, use_cache=False, bos_token_id=1, eos_token_id=2)
    return _make(T.GPT2LMHeadModel, cfg)


def gptj(layers: int):
    import transformers as T
    cfg = T.GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=4, rotary_dim=8,
                       n_positions=64, use_cache=False, bos_token_id=1, eos_token_id=2)
    return _make(T.GPTJForCausalLM, cfg)


def olmo2(layers: int):
    import transformers as T
    return _make(T.Olmo2ForCausalLM, T.Olmo2Config(intermediate_size=128, num_key_value_heads=2,
                                                   **_common(layers)))


def llama_eager(layers: int):
    """Llama with HuggingFace's eager attention (matmul -> softmax -> matmul)."""
    import transformers as T
    cfg = T.LlamaConfig(intermediate_size=128, num_key_value_heads=2, **_common(layers))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg).eval()


def gemma2(layers: int, *, sliding_window: int = 4096):
    """Gemma-2 with HuggingFace's eager attention: scores soft-capped (``tanh(s / 5) * 5``;
    Gemma-2 ships 50) before the mask, with q/k projections scaled x20 so that the random
    scores reach the tanh's curved range (otherwise the cap changes the logits by ~1e-7 and a
    lost cap would go unseen). Sliding-window and full attention alternate (layer 0 slides);
    the window only matters for sequences longer than ``sliding_window``."""
    import transformers as T
    cfg = T.Gemma2Config(intermediate_size=128, num_key_value_heads=2, head_dim=16,
                         sliding_window=sliding_window, attn_logit_softcapping=5.0,
                         **_common(layers))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def mistral(layers: int, *, sliding_window: int = 5):
    """Mistral with SDPA and a sliding window shorter than the tests' 16 tokens: every layer
    attends with one explicit (banded causal) mask, shared by all layers."""
    import transformers as T
    return _make(T.MistralForCausalLM, T.MistralConfig(
        intermediate_size=128, num_key_value_heads=2, sliding_window=sliding_window,
        **_common(layers)))


def bloom(layers: int):
    """BLOOM: ALiBi through ``baddbmm`` with heads merged into the batch (``[B*H, S, D]``),
    fused ``query_key_value`` viewed as ``[B, S, H, 3, D]``; eager attention only."""
    import transformers as T
    cfg = T.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=layers, n_head=4,
                        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return T.BloomForCausalLM(cfg).eval()


def mixtral(layers: int):
    """Mixtral: router, top-k, grouped expert matmuls (transformers' MoE kernels)."""
    import transformers as T
    cfg = T.MixtralConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, **_common(layers))
    return _make(T.MixtralForCausalLM, cfg)


def qwen2_moe(layers: int):
    """Qwen2-MoE: routed experts plus a shared expert with a sigmoid gate."""
    import transformers as T
    cfg = T.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_experts=4,
                           num_experts_per_tok=2, num_key_value_heads=2, **_common(layers))
    return _make(T.Qwen2MoeForCausalLM, cfg)


# name -> (pattern, builder, collectives per layer at tp=2: {(op, "full"|"stat"): n} without
# and with sequence parallelism; "stat" = a [b, s, 1] norm statistic)
FAMILIES = {
    "phi3": ("fused qkv_proj + gate_up_proj (slice / chunk)", phi3,
             {("all_reduce", "full"): 2},
             {("reduce_scatter", "full"): 2, ("all_gather", "full"): 2}),
    "gpt_neox": ("fused query_key_value (view to heads, split per head), parallel block",
                 gpt_neox, {("all_reduce", "full"): 1},
                 # two norms of the same input (attention's, MLP's): each output gathered
                 {("reduce_scatter", "full"): 1, ("all_gather", "full"): 2}),
    "gpt2": ("Conv1D weights [in, out] through addmm, fused c_attn", gpt2,
             {("all_reduce", "full"): 2},
             {("reduce_scatter", "full"): 2, ("all_gather", "full"): 2}),
    "gptj": ("interleaved RoPE (stack + flatten), parallel attention/MLP block", gptj,
             {("all_reduce", "full"): 1},
             {("reduce_scatter", "full"): 1, ("all_gather", "full"): 1}),
    "olmo2": ("post-norm block, q/k RMSNorm over the whole projection width", olmo2,
              {("all_reduce", "full"): 2, ("all_reduce", "stat"): 2},
              {("reduce_scatter", "full"): 2, ("all_gather", "full"): 2,
               ("all_reduce", "stat"): 2}),
}


def collectives_by_kind(pm, rank: int = 0):
    """``{(op, "full" | "stat"): count}`` of rank ``rank``'s communicating collectives on tp."""
    from collections import Counter
    out = Counter()
    for c in pm.explain().collectives[rank]:
        if c.axis != "tp" or c.op in ("local_shard", "partial_from_replicate"):
            continue
        out[(c.op, "stat" if c.shape[-1] == 1 else "full")] += 1
    return out


def layer_param_fraction(pm, model) -> float:
    """Largest per-rank share of the layer stack's matrices (embeddings, lm_head, norms and
    other 1-D weights aside)."""
    import math
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    full = local = 0
    for fqn, _spec, shape, _stage in pm.explain().placements:
        if len(shape) < 2 or "embed" in fqn or "wte" in fqn or "wpe" in fqn or \
                fqn.startswith("lm_head") or "embed_out" in fqn:
            continue
        full += math.prod(shapes[fqn])
        local += math.prod(shape)
    return local / full
