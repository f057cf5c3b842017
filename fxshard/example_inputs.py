"""Example inputs fxshard can make itself, so the PyTorch order works: ``opt =
torch.optim.AdamW(pm.parameters())`` right after ``parallelize``, before any batch was seen
(the shards are placed when the first training program is built)."""
from __future__ import annotations

import torch

__all__ = ["language_model_example"]


def language_model_example(model: torch.nn.Module, spec, microbatches: int,
                           where: str) -> tuple:
    """Example inputs for a language model whose config names its vocabulary and positions
    and whose forward takes ``input_ids`` first (HF's causal LMs, fxshard's Llama): token ids
    ``[B, S]``, ``B`` the world size times the microbatches and ``S`` a multiple of twice the
    world size (every batch and sequence axis divides them), at least 8, at most the model's
    positions. The shards' placement comes from the plan and the parameters' shapes, not the
    input's: a later batch trains these same shards (a program that would place one otherwise
    is an error naming it). Otherwise a ValueError showing ``example_inputs=``."""
    import inspect
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    positions = next((getattr(cfg, a) for a in ("max_position_embeddings", "n_positions",
                                                "max_seq_len", "seq_length")
                      if isinstance(getattr(cfg, a, None), int)), None)
    try:
        first = next(iter(inspect.signature(model.forward).parameters), None)
    except (TypeError, ValueError):
        first = None
    if not isinstance(vocab, int) or positions is None or first != "input_ids":
        raise ValueError(
            f"{where}: the parameter shards are placed when the first training program is "
            f"built, and fxshard cannot infer example inputs for {type(model).__name__} (mesh "
            f"{spec.describe()}; it infers them for a language model whose config has "
            f"vocab_size and max_position_embeddings and "
            f"whose forward takes input_ids). Give a batch like the training one when "
            f"parallelizing: pm = fxshard.parallelize(model, mesh, example_inputs=(ids,)), "
            f"then opt = torch.optim.AdamW(pm.parameters()); or call pm(ids) once with "
            f"grad enabled before building the optimizer")
    world = spec.world_size
    step = 2 * world
    seq = min(max(step, -(-8 // step) * step), positions)
    batch = world * max(1, microbatches)
    device = torch.device(spec.device_type)
    ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
    return (ids,), {}
