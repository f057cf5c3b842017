"""Models the tests parallelize: ours, HuggingFace's Llama, and the seed lesson's block."""
from __future__ import annotations

import torch
import torch.nn as nn


class SimpleAttention(nn.Module):
    """The tensor-parallel lesson's attention stand-in (q + k + v, then wo), with biases."""

    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.wq = nn.Linear(hidden_size, hidden_size)
        self.wk = nn.Linear(hidden_size, hidden_size)
        self.wv = nn.Linear(hidden_size, hidden_size)
        self.wo = nn.Linear(hidden_size, hidden_size)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads

    def forward(self, x):
        q = self.wq(x)
        k = self.wk(x)
        v = self.wv(x)
        return self.wo(q + k + v)


class SimpleMLP(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, 4 * hidden_size)
        self.w2 = nn.Linear(4 * hidden_size, hidden_size)
        self.activation = nn.GELU()

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)))


class TransformerBlock(nn.Module):
    """The seed lesson's block, unchanged: attention then MLP, no norms or residuals."""

    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.attention = SimpleAttention(hidden_size, num_heads)
        self.mlp = SimpleMLP(hidden_size)

    def forward(self, x):
        x = self.attention(x)
        x = self.mlp(x)
        return x


def hf_llama(*, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=160, vocab=128,
             tie=False, seed=0):
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        tie_word_embeddings=tie, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def our_llama(*, seed=0, **overrides):
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig.tiny(**overrides)).eval()


def model_cache():
    """A test module's ``built(make, **kwargs)``: ``make(**kwargs)`` built once for that module
    and handed out again (for models that are only parallelized, never changed; with the
    ``export_once`` fixture of tests/conftest.py each is also exported once)."""
    models: dict = {}

    def built(make, **kwargs):
        key = (make.__name__, tuple(sorted(kwargs.items())))
        if key not in models:
            models[key] = make(**kwargs)
        return models[key]
    return built
