"""The benchmarks' one harness: model sizes, a gloo launcher, timing, tables and the baselines.

Every script in ``benchmarks/`` takes what it shares with another from here, so that two
scripts measuring "hand-written Megatron" or "DTensor" measure the same code:

- sizes: :func:`add_model_args` adds the model-size flags (``--hidden --heads --kv-heads
  --intermediate --layers --vocab`` and the input's ``--batch --seq --prompt --new``) with a
  script's defaults (the presets below: ``RUNTIME_TP``, ``SMALL_HF``, ``GENERATE``);
  :func:`bundled_llama`, :func:`hf_llama` and :func:`tutorial_blocks` build the model from the
  parsed flags, :func:`token_ids` the inputs;
- launch (:mod:`benchmarks.rank_launch`): :func:`launch` runs a worker on N gloo ranks on
  loopback (a free port held by the launcher's store, ``torch.set_num_threads`` per rank),
  returns every rank's result, shuts the ranks down cleanly, and names the rank that failed
  with its traceback;
- timing (:mod:`benchmarks.timing_tables`): :func:`time_calls`, :func:`stats_ms`,
  :func:`interleaved` (variants alternated round by round, so a burst of other load hits all
  of them alike), :func:`rotated`, and :func:`format_table` (fixed-width text tables);
- the hand-written Megatron baseline (:mod:`benchmarks.megatron_baseline`; :class:`MegatronTP`:
  the collectives, with Megatron-LM's f/g backward as autograd functions when trainable):
  :class:`MegatronLlama` (the bundled or HuggingFace Llama: column/row-parallel linears on
  weight slices, its own KV cache for decoding, a vocab-parallel cross-entropy;
  :func:`megatron_step` = forward + backward + optimizer step, data parallel over a second
  group) and :class:`MegatronBlocks` (the seed lesson's TransformerBlocks);
- the DTensor baseline (:mod:`benchmarks.dtensor_baseline`): :func:`dtensor_tp_plan` (the one
  ``parallelize_module`` plan), :func:`dtensor_tp`, and :func:`dtensor_train` +
  :func:`dtensor_step` (TP plan + ``fully_shard``: torchtitan's 2-D recipe; FSDP2 runs on CPU
  gloo with torch 2.13).

The sizes live here; the rest is imported from those modules, so a script imports everything
from here. Benchmarks run as scripts (``python benchmarks/x.py``) and import this as
``benchmarks.common`` with the checkout's root on ``sys.path``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's fxshard, wherever the script is run from
    sys.path.insert(0, str(ROOT))

from benchmarks.dtensor_baseline import (dtensor_loss, dtensor_step, dtensor_tp,  # noqa: E402
                                         dtensor_tp_plan, dtensor_train)
from benchmarks.megatron_baseline import (MegatronBlocks, MegatronLlama, MegatronTP,  # noqa: E402
                                          megatron_step, shard_cols, shard_rows,
                                          wait_collective)
from benchmarks.rank_launch import RankFailed, free_port, launch  # noqa: E402
from benchmarks.timing_tables import (cpu_model, environment, format_table,  # noqa: E402
                                      interleaved, now, percentile, reproduce, rotated,
                                      slowest_rank, stats_ms, time_calls, write_json)

__all__ = [
    "ROOT", "RUNTIME_TP", "SMALL_HF", "GENERATE", "add_model_args", "sizes", "llama_config",
    "bundled_llama", "hf_llama", "tutorial_blocks", "token_ids",
    "RankFailed", "free_port", "launch",
    "now", "time_calls", "percentile", "stats_ms", "slowest_rank", "write_json", "rotated",
    "interleaved", "format_table", "cpu_model", "environment", "reproduce",
    "MegatronTP", "MegatronLlama", "MegatronBlocks", "megatron_step", "shard_rows",
    "shard_cols", "wait_collective",
    "dtensor_tp_plan", "dtensor_tp", "dtensor_train", "dtensor_loss", "dtensor_step",
]


# --- model sizes -----------------------------------------------------------------------------

#: runtime_tp's bundled Llama (also eager_overhead's and collective_overhead's forwards)
RUNTIME_TP = dict(hidden=256, heads=8, kv_heads=4, intermediate=688, layers=2, vocab=512)
#: the small HF Llama of generate_ab / pipeline_decode / generate's smaller runs
SMALL_HF = dict(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=4, vocab=8000)
#: issue 11's generation size (generate.py's default)
GENERATE = dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000)

_SIZE_FLAGS = {  # name -> help
    "hidden": "hidden size", "heads": "attention heads", "kv_heads": "key/value heads",
    "intermediate": "MLP intermediate size", "layers": "decoder layers",
    "vocab": "vocabulary size", "batch": "sequences per batch", "seq": "tokens per sequence",
    "prompt": "prompt tokens", "new": "new tokens to generate",
}
_MODEL_KEYS = ("hidden", "heads", "kv_heads", "intermediate", "layers", "vocab")


def add_model_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add ``--<name>`` (``kv_heads`` -> ``--kv-heads``) for every size named in ``defaults``,
    with that default, e.g. ``add_model_args(ap, **RUNTIME_TP, batch=2, seq=64)``. A name that
    is not a size flag is a ``ValueError`` (a typo must not become a silent default)."""
    unknown = sorted(set(defaults) - set(_SIZE_FLAGS))
    if unknown:
        raise ValueError(f"add_model_args: unknown size flag(s) {unknown}; known: "
                         f"{sorted(_SIZE_FLAGS)}")
    for name in _SIZE_FLAGS:  # a fixed order, so --help reads the same in every script
        if name in defaults:
            parser.add_argument("--" + name.replace("_", "-"), type=int,
                                default=defaults[name], help=f"{_SIZE_FLAGS[name]} "
                                f"(default {defaults[name]})")
    return parser


def sizes(args, **override) -> dict:
    """The model sizes in ``args`` (a namespace from :func:`add_model_args`), with overrides."""
    return {k: override.get(k, getattr(args, k)) for k in _MODEL_KEYS
            if k in override or hasattr(args, k)}


def llama_config(args, **override):
    """``fxshard.models.llama.LlamaConfig.tiny`` at the sizes in ``args``."""
    from fxshard.models.llama import LlamaConfig
    s = sizes(args, **override)
    return LlamaConfig.tiny(vocab_size=s["vocab"], hidden_size=s["hidden"],
                            intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                            num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"])


def bundled_llama(args, seed: int = 0, **override):
    """The bundled ``LlamaForCausalLM`` (random weights from ``seed``), eval mode."""
    from fxshard.models.llama import LlamaForCausalLM
    cfg = llama_config(args, **override)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def hf_llama(args, seed: int = 0, **override):
    """A random HuggingFace ``LlamaForCausalLM`` (SDPA attention, 4096 positions), eval mode,
    with ``eos_token_id = None`` so generation always makes exactly the tokens asked for."""
    import transformers
    s = sizes(args, **override)
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=4096,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tutorial_blocks(args, seed: int = 0):
    """``--layers`` of the seed tensor-parallel lesson's ``TransformerBlock`` (``tests/models.py``:
    q + k + v then wo, a GELU MLP of 4x ``--hidden``, all with biases; no norms or residuals)
    in an ``nn.Sequential``, eval mode."""
    from tests.models import TransformerBlock
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[TransformerBlock(args.hidden, args.heads)
                                 for _ in range(args.layers)]).eval()


def token_ids(vocab: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """``[batch, seq]`` random token ids (same on every rank for the same seed)."""
    return torch.randint(0, vocab, (batch, seq), device="cpu",
                         generator=torch.Generator().manual_seed(seed))
