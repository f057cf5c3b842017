"""A plain Llama-3 decoder in ordinary PyTorch.

There is deliberately **no parallel code** in here: fxshard parallelises this
model (like any other unmodified model) by tracing it with ``torch.export`` and
rewriting the ATen FX graph.  The module is meant to be a small, readable,
trace-friendly reference that is numerically interchangeable with
``transformers.LlamaForCausalLM`` (default RoPE, no scaling variants):

* parameter names match HuggingFace exactly, so
  ``LlamaForCausalLM(cfg).load_state_dict(hf_model.state_dict())`` works with
  ``strict=True``;
* RMSNorm computes in float32 and casts back before the weight multiply (as HF);
* RoPE uses the ``rotate_half`` convention (as HF Llama);
* attention is one ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
  scale=head_dim**-0.5, enable_gqa=True)`` call: no attention mask tensor, no
  ``repeat_kv`` expand/reshape; K/V keep ``num_key_value_heads`` heads in the
  graph (``enable_gqa`` is only passed when ``num_kv_heads < num_heads``);
* the MLP is SwiGLU: ``down(silu(gate(x)) * up(x))``.

RoPE design choice
------------------
HF keeps ``inv_freq`` as a *non-persistent buffer* computed in ``__init__``.
A model built under ``torch.device("meta")`` and materialised later
(``to_empty`` + ``load_state_dict``) silently loses such a buffer: it is not in
the checkpoint, so it stays uninitialised garbage.  This module therefore has
**no buffers at all**: ``inv_freq`` and the cos/sin tables are recomputed in
``forward`` from ``torch.arange`` (a small constant subgraph with no inputs
other than the sequence length, which the device placement of ``input_ids``
decides).  The arithmetic is the same op sequence HF uses, so cos/sin are
bit-identical to HF's.  ``max_position_embeddings`` is kept in the config for
compatibility only; nothing is cached up to it.

Forward contract: ``LlamaForCausalLM.forward(input_ids[B, S]) -> logits[B, S,
vocab]`` as a plain tensor; positions are ``arange(S)``; no KV cache, no
padding mask.  There is no data-dependent control flow and no in-place op, so
``torch.export.export(model, (ids,), strict=False)`` traces it, with real
weights or on the meta device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "LlamaRMSNorm",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "rope_cos_sin",
    "rotate_half",
    "apply_rotary_pos_emb",
]


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; pass head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A tiny config for tests and demos (intermediate 160 is deliberately
        not a power of two)."""
        kw = dict(
            vocab_size=128, hidden_size=64, intermediate_size=160,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf(cls, hf_config) -> "LlamaConfig":
        """Build from a ``transformers.LlamaConfig`` (default RoPE only)."""
        rope = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads,
            head_dim=getattr(hf_config, "head_dim", None),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype,
                 position_ids: torch.Tensor | None = None):
    """cos/sin tables ``[seq_len, head_dim]`` for positions ``arange(seq_len)``, or
    ``[B, 1, seq_len, head_dim]`` for explicit ``position_ids`` ``[B, seq_len]``.

    Same op sequence as HF's default RoPE (float32 throughout, cast at the
    end), so the result is bit-identical; computed on every call, no buffer.
    """
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if position_ids is not None:
        freqs = position_ids[:, None, :, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k: ``[B, H, S, D]``; cos, sin: ``[S, D]`` or ``[B, 1, S, D]`` (broadcast)."""
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        h, d = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = hidden_states.shape
        # view(..., -1, head_dim): the head count is inferred, so a graph pass
        # that shards the projection's output features need not patch it.
        q = self.q_proj(hidden_states).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        gqa = self.num_key_value_heads != self.num_heads
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scaling, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, sin)
        hidden_states = hidden_states + self.mlp(
            self.post_attention_layernorm(hidden_states))
        return hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(
            input_ids.shape[1], self.config.head_dim, self.config.rope_theta,
            device=hidden_states.device, dtype=hidden_states.dtype, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids[B, S], position_ids=None) -> logits[B, S, vocab]`` (a plain tensor).

    With ``tie_word_embeddings`` the output projection shares its parameter
    with the embedding (``lm_head.weight is model.embed_tokens.weight``).
    ``state_dict()`` then lists both names like ``torch``/HF do, and
    ``load_state_dict`` also accepts a checkpoint without ``lm_head.weight``
    (as tied safetensors checkpoints are saved).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._register_load_state_dict_pre_hook(self._fill_tied_lm_head)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.tie_weights())

    def _fill_tied_lm_head(self, state_dict, prefix, *args, **kwargs):
        key, src = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
        if self.config.tie_word_embeddings and key not in state_dict and src in state_dict:
            state_dict[key] = state_dict[src]

    def tie_weights(self) -> None:
        """(Re-)tie ``lm_head.weight`` to ``model.embed_tokens.weight``.

        Called automatically after ``_apply`` (``to``, ``to_empty``, ``half``,
        ...: converting a meta-built model with ``to_empty`` otherwise creates
        two separate parameters) and after ``load_state_dict`` (``assign=True``
        would otherwise assign two distinct Parameter objects)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``[B, S]`` (default ``arange(S)``): the positions RoPE encodes, as
        in HuggingFace's models (text generation passes them for the new tokens)."""
        return self.lm_head(self.model(input_ids, position_ids))
