"""One rank's slices of a Llama state dict for the hand-written Megatron baselines
(``runtime_tp.py``, ``generate.py``): column-parallel q/k/v/gate/up/lm_head (weight dim 0),
row-parallel o/down (weight dim 1), norms whole. Each slice is a contiguous copy."""
from __future__ import annotations

import torch


def rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Column-parallel Linear (output features) or vocab-parallel Embedding: weight dim 0."""
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n].contiguous()


def cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Row-parallel Linear (input features) or embedding-dim-sharded Embedding: weight dim 1."""
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n].contiguous()


def layer_slices(sd: dict, layers: int, rank: int, tp: int) -> list[dict]:
    """Per decoder layer: ``wq wk wv wo wg wu wd`` (this rank's slices) and ``ln1 ln2``."""
    out = []
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append(dict(
            wq=rows(sd[p + "self_attn.q_proj.weight"], rank, tp),
            wk=rows(sd[p + "self_attn.k_proj.weight"], rank, tp),
            wv=rows(sd[p + "self_attn.v_proj.weight"], rank, tp),
            wo=cols(sd[p + "self_attn.o_proj.weight"], rank, tp),
            wg=rows(sd[p + "mlp.gate_proj.weight"], rank, tp),
            wu=rows(sd[p + "mlp.up_proj.weight"], rank, tp),
            wd=cols(sd[p + "mlp.down_proj.weight"], rank, tp),
            ln1=sd[p + "input_layernorm.weight"].clone(),
            ln2=sd[p + "post_attention_layernorm.weight"].clone()))
    return out
