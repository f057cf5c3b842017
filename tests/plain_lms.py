"""Tiny plain-PyTorch causal LMs written the ways non-HuggingFace model code writes them.

``TinyLM(layers=..., positions=..., container=..., qk_head=..., v_head=...)``:

- ``container``: the layer stack as a ``"list"`` (ModuleList), ``"dict"`` (ModuleDict keyed
  ``"0"``, ``"1"``, ... as torchtitan) or ``"seq"`` (Sequential; blocks then take ``x`` only and
  positions come from a learned embedding).
- ``positions``: where the positions come from: ``"input_pos"`` (an optional forward argument
  indexing the RoPE table, as litgpt / torchtune), ``"arange"`` (``torch.arange(T)`` inside, RoPE
  computed from it), ``"table"`` (a RoPE table sliced ``[:T]``, as torchtitan), ``"wpe"`` (a
  learned position embedding of ``arange(T)``, as GPT-2).
- ``qk_head`` / ``v_head``: query/key and value head sizes (MLA-style when they differ).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim, heads, qk_head, v_head):
        super().__init__()
        self.heads, self.qk_head, self.v_head = heads, qk_head, v_head
        self.wq = nn.Linear(dim, heads * qk_head, bias=False)
        self.wk = nn.Linear(dim, heads * qk_head, bias=False)
        self.wv = nn.Linear(dim, heads * v_head, bias=False)
        self.wo = nn.Linear(heads * v_head, dim, bias=False)

    def forward(self, x, cos=None, sin=None):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.qk_head).transpose(1, 2)
        k = self.wk(x).view(b, t, self.heads, self.qk_head).transpose(1, 2)
        v = self.wv(x).view(b, t, self.heads, self.v_head).transpose(1, 2)
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, self.heads * self.v_head))


class Block(nn.Module):
    def __init__(self, dim, heads, qk_head, v_head):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, qk_head, v_head)
        self.up, self.down = nn.Linear(dim, 3 * dim), nn.Linear(3 * dim, dim)

    def forward(self, x, cos=None, sin=None):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, *, layers=2, dim=32, heads=4, qk_head=8, v_head=None, vocab=64,
                 max_len=64, positions="input_pos", container="list", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        v_head = qk_head if v_head is None else v_head
        self.positions, self.container = positions, container
        self.wte = nn.Embedding(vocab, dim)
        blocks = [Block(dim, heads, qk_head, v_head) for _ in range(layers)]
        if container == "dict":
            self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        elif container == "seq":
            assert positions == "wpe", "a Sequential's blocks take x only"
            self.layers = nn.Sequential(*blocks)
        else:
            self.layers = nn.ModuleList(blocks)
        if positions == "wpe":
            self.wpe = nn.Embedding(max_len, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, qk_head, 2).float()
                                                          / qk_head), persistent=False)
        freqs = torch.outer(torch.arange(max_len).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def _rope(self, t, device, input_pos):
        if self.positions == "input_pos":
            pos = torch.arange(t, device=device) if input_pos is None else input_pos
            return self.cos[pos], self.sin[pos]
        if self.positions == "table":
            return self.cos[:t], self.sin[:t]
        if self.positions == "arange":
            freqs = torch.outer(torch.arange(t, device=device).float(), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()
        return None, None

    def forward(self, idx, input_pos=None):
        t = idx.shape[1]
        x = self.wte(idx)
        if self.positions == "wpe":
            x = x + self.wpe(torch.arange(t, device=idx.device))
        if self.container == "seq":
            return self.head(self.norm(self.layers(x)))
        cos, sin = self._rope(t, idx.device, input_pos)
        blocks = self.layers.values() if self.container == "dict" else self.layers
        for block in blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


@torch.no_grad()
def greedy_reference(model, ids, new):
    """Greedy decoding by a full re-forward each step (no cache)."""
    for _ in range(new):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
