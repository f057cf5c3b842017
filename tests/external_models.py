"""Tiny random models from model libraries other than HuggingFace, built by each library's own,
unmodified model builders (no weights, no downloads): litgpt, torchtune, torchtitan.

``EXTERNAL[name] = (library, pattern, build)``; ``build(layers)`` returns the model in eval
mode with a fixed seed, hidden 64, 4 query heads of 16 (2 KV heads with GQA, 1 with MQA),
vocab 128. Each forward takes token ids ``[b, s]`` and returns logits ``[b, s, vocab]``.
``importlib.util.find_spec(library)`` says whether a library is installed (CI installs them
with ``--no-deps``; ``.ci/run``).
"""
from __future__ import annotations

import importlib.util

import torch

VOCAB = 128
HIDDEN = 64
SEQ = 64  # max_seq_len / block_size of every model here


def installed(library: str) -> bool:
    return importlib.util.find_spec(library) is not None


def _eval(model):
    return model.eval()


# -- litgpt: one GPT class, the family chosen by a named config -------------------------------

def _litgpt(name: str, **overrides):
    def build(layers: int):
        import litgpt
        from litgpt.model import GPT
        cfg = dict(n_layer=layers, n_embd=HIDDEN, n_head=4, head_size=16, n_query_groups=2,
                   intermediate_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                   block_size=SEQ) | overrides
        config = litgpt.Config.from_name(name, **cfg)
        torch.manual_seed(0)
        model = GPT(config)
        model.apply(model._init_weights)
        return _eval(model)
    return build


# -- torchtune: component builders returning a TransformerDecoder -----------------------------

def _torchtune(module: str, fn: str, **overrides):
    def build(layers: int):
        builders = importlib.import_module(f"torchtune.models.{module}._component_builders")
        cfg = dict(vocab_size=VOCAB, num_layers=layers, num_heads=4, num_kv_heads=2,
                   embed_dim=HIDDEN, intermediate_dim=128, max_seq_len=SEQ) | overrides
        torch.manual_seed(0)
        model = getattr(builders, fn)(**cfg)
        # random weights everywhere (some builders leave norms / scales at ones or zeros)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.1 * torch.randn(p.shape))
        return _eval(model)
    return build


# -- torchtitan: configs built into Llama3Model / DeepSeekV3Model ------------------------------

def _sdpa(blocks):
    """torchtitan's language-model builders take flex / varlen attention only (CUDA kernels);
    give each block the library's own ``ScaledDotProductAttention`` (causal) instead."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return blocks


def _torchtitan_llama3(layers: int, fuse_qkv: bool = False):
    from torchtitan.models import llama3 as t
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    config = t.Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN,
                                        param_init=t._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=t._NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB,
                              param_init=t._output_linear_init(HIDDEN)),
        layers=_sdpa(t._build_llama3_layers(
            fuse_qkv=fuse_qkv, n_layers=layers, dim=HIDDEN, n_heads=4, n_kv_heads=2,
            hidden_dim=128, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=16, max_seq_len=SEQ, theta=500000, scaling="llama"))))
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return _eval(model)


def _torchtitan_deepseek_v3(layers: int):
    from torchtitan.models import deepseek_v3 as t
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    blocks = _sdpa(t._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=HIDDEN, n_heads=4, q_lora_rank=0,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=SEQ, theta=10000.0, scaling="none")))
    config = t.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=HIDDEN,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN,
                                        param_init=t._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=t._NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB,
                              param_init=t._output_linear_init(HIDDEN)),
        layers=blocks, mtp_layers=[])
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return _eval(model)


# name -> (library, pattern, build)
EXTERNAL = {
    "litgpt_llama3": ("litgpt", "GQA via repeat_interleave of K/V heads, fused qkv",
                      _litgpt("Llama-3.2-1B")),
    "litgpt_mistral": ("litgpt", "Mistral: GQA, fused qkv", _litgpt("Mistral-7B-v0.1")),
    "litgpt_qwen2_5": ("litgpt", "Qwen2.5: GQA, qkv bias", _litgpt("Qwen2.5-0.5B")),
    "litgpt_gemma": ("litgpt", "Gemma: GeGLU, scaled embedding, tied lm_head",
                     _litgpt("Gemma-2b")),
    "litgpt_gemma2": ("litgpt", "Gemma-2: soft-capped attention and logits, post norms",
                      _litgpt("Gemma-2-2b", sliding_window_size=SEQ)),
    "litgpt_phi2": ("litgpt", "Phi-2: partial rotary, parallel block, MHA",
                    _litgpt("phi-2", n_query_groups=4)),
    "litgpt_falcon": ("litgpt", "Falcon: multi-query attention in a fused projection",
                      _litgpt("falcon-7b", n_query_groups=1)),
    "litgpt_mixtral": ("litgpt", "Mixtral: MoE (router, top-k, per-expert loop with where)",
                       _litgpt("Mixtral-8x7B-v0.1", n_expert=4, n_expert_per_token=2)),
    "torchtune_llama3": ("torchtune", "Llama-3: GQA via expand + reshape, input_pos",
                         _torchtune("llama3", "llama3")),
    "torchtune_mistral": ("torchtune", "Mistral", _torchtune("mistral", "mistral")),
    "torchtune_qwen2": ("torchtune", "Qwen2: qkv bias", _torchtune("qwen2", "qwen2")),
    "torchtune_gemma": ("torchtune", "Gemma: GeGLU, head_dim given",
                        _torchtune("gemma", "gemma", head_dim=16)),
    "torchtune_gemma2": ("torchtune", "Gemma-2: soft-capped attention and logits",
                         _torchtune("gemma2", "gemma2", head_dim=16, sliding_window_size=SEQ)),
    "torchtune_phi3": ("torchtune", "Phi-3: fused qkv and gate_up", _torchtune("phi3", "phi3")),
    "torchtitan_llama3": ("torchtitan", "Llama-3: complex RoPE, ModuleDict layers, positions "
                          "(wq/wk/wv: the fused wqkv renames itself in state_dict hooks)",
                          _torchtitan_llama3),
    "torchtitan_deepseek_v3": ("torchtitan", "DeepSeek-V3: MLA (qk head 24 != v head 16), "
                               "MoE with shared expert", _torchtitan_deepseek_v3),
}


# -- measuring one model on one mesh (shared by tests/test_external_models.py and
#    benchmarks/families.py --external) ----------------------------------------------------------

MESHES = {"tp2": (dict(tp=2), False), "dp2_tp2": (dict(dp=2, tp=2), False),
          "tp2_sp": (dict(tp=2), True), "pp2": (dict(pp=2), False),
          "ring2": (dict(ring_cp=2), False), "ulysses2": (dict(ulysses_cp=2), False)}


def token_ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def is_weight_of_layers(fqn: str) -> bool:
    """A layer-stack matrix: embeddings and the output head aside (every library's names)."""
    return not ("embed" in fqn or "wte" in fqn or fqn.startswith(("lm_head", "output")))


def layer_param_fraction(pm, model) -> float:
    """Largest per-rank share of the layer stack's matrices (1-D weights aside)."""
    import math
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    full = local = 0
    for fqn, _spec, shape, _stage in pm.explain().placements:
        if len(shape) < 2 or not is_weight_of_layers(fqn):
            continue
        full += math.prod(shapes[fqn])
        local += math.prod(shape)
    return local / full


def mqa_kv_share(model) -> float:
    """Share of the layer matrices that is a single K/V head's projection (multi-query
    attention, which tp cannot split): 0 for models with more than one KV head."""
    import math
    cfg = getattr(model, "config", None)
    if getattr(cfg, "n_query_groups", None) != 1:
        return 0.0
    kv = 2 * cfg.head_size * cfg.n_embd * cfg.n_layer
    full = sum(math.prod(v.shape) for k, v in model.state_dict().items()
               if v.dim() >= 2 and is_weight_of_layers(k))
    return kv / full


def collectives_by_kind(pm, rank: int = 0):
    """``{(op, "full" | "stat"): n}`` of rank ``rank``'s communicating collectives on tp."""
    from collections import Counter
    out = Counter()
    for c in pm.explain().collectives[rank]:
        if c.axis != "tp" or c.op in ("local_shard", "partial_from_replicate"):
            continue
        out[(c.op, "stat" if c.shape[-1] == 1 else "full")] += 1
    return out


def measure(name: str, axes: dict, sp: bool = False, layers: int = 2) -> dict:
    """Parallelize ``EXTERNAL[name]`` over a simulated mesh with ``axes``; run one forward.

    Returns ``err`` (max abs difference from the single-device logits), ``frac``
    (:func:`layer_param_fraction`), ``fallbacks`` (FallbackWarnings raised), ``collectives``
    (:func:`collectives_by_kind`), ``code`` (rank 0's program) and the explanation."""
    import warnings

    import fxshard
    from fxshard.passes.rules import FallbackWarning
    model = EXTERNAL[name][2](layers)
    ids = token_ids()
    with torch.no_grad():
        want = logits(model(ids))
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp)
        try:
            with torch.no_grad():
                got = logits(pm(ids))
            explanation = pm.explain()
            out = dict(err=(got - want).abs().max().item(), frac=layer_param_fraction(pm, model),
                       collectives=collectives_by_kind(pm), code=pm.rank_module(0).code,
                       explain=explanation, kv_share=mqa_kv_share(model),
                       parallel_block=bool(getattr(getattr(model, "config", None),
                                                   "parallel_residual", False)))
        finally:
            pm.close()
    out["fallbacks"] = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    return out


def greedy(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding by re-running the whole sequence each step (no cache)."""
    with torch.no_grad():
        for _ in range(new):
            nxt = logits(model(ids))[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids
