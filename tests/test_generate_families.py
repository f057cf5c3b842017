"""``pm.generate`` on the HuggingFace families of the README's models table, against the same
model's greedy ``generate`` on one device, token for token.

The table lists, per family, the meshes its forward is checked on. Generating on every one of
them is too slow for CI, so this file runs every family on its hardest listed mesh (the most
axes; ``tp2·ring2`` for the four-mesh families) and every listed mesh on at least one family:
``tp2``, ``tp2+SP``, ``ring2``, ``ulysses2``, ``dp2·tp2``, ``tp2·ring2``, ``ulysses2·ring2``,
``tp2·ulysses2·ring2``. Llama and the bundled Llama are ``tests/test_generate.py``'s. BLOOM
(ALiBi: attention with an explicit additive mask) cannot generate: a clear error, tested.
Tiny configs (1 layer, hidden 64), a prompt of 8, 3 new tokens.
"""
from __future__ import annotations

import pytest
import torch

import fxshard
from tests import families

NEW = 3

# (builder in tests/families.py, mesh); Mistral's window (5 in its forward tests, shorter
# than a prompt) is widened: a KV cache keeps every position, and generation past the window
# is refused (tests/test_generate_limits.py)
CASES = [
    ("gpt2", dict(tp=2, ring_cp=2)),
    ("gpt2", dict(tp=2, sequence_parallel=True)),
    ("gptj", dict(tp=2, ring_cp=2)),
    ("gpt_neox", dict(tp=2, ring_cp=2)),
    ("gpt_neox", dict(ulysses_cp=2, ring_cp=2)),
    ("olmo2", dict(tp=2, ring_cp=2)),
    ("olmo2", dict(tp=2)),
    ("phi3", dict(tp=2, ring_cp=2)),
    ("gemma2", dict(ring_cp=2)),
    ("gemma2", dict(ulysses_cp=2)),
    ("mistral", dict(tp=2, ulysses_cp=2, ring_cp=2)),
    ("mixtral", dict(tp=2, ring_cp=2)),
    ("qwen2_moe", dict(dp=2, tp=2)),
]


def _name(case) -> str:
    name, axes = case
    return name + "-" + "".join(f"{k.split('_')[0]}{v}" if k != "sequence_parallel" else "sp"
                                for k, v in axes.items())


def _prompt():
    return torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(1))


def _parallel(model, axes: dict):
    axes = dict(axes)
    sp = axes.pop("sequence_parallel", False)
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh, sequence_parallel=sp)


@pytest.mark.parametrize("name,axes", CASES, ids=[_name(c) for c in CASES])
def test_generate_equals_one_device_greedy(name, axes):
    pytest.importorskip("transformers")
    build = getattr(families, name)
    model = build(1, sliding_window=32) if name == "mistral" else build(1)
    ids = _prompt()
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          do_sample=False)
    pm = _parallel(model, axes)
    try:
        got = pm.generate(ids, max_new_tokens=NEW)
    finally:
        pm.close()
    assert got.shape == (4, 8 + NEW)
    assert torch.equal(got, want), (name, axes, got[:, 8:].tolist(), want[:, 8:].tolist())


def test_alibi_attention_cannot_generate_and_says_so():
    """BLOOM's attention adds an explicit ALiBi mask: the KV cache's decode attention takes
    none, so generation is refused before any token, naming the attention and the way out."""
    pytest.importorskip("transformers")
    pm = _parallel(families.bloom(1), dict(tp=2))
    with pytest.raises(NotImplementedError, match=r"is given an explicit mask; text generation "
                       r"with a KV cache needs causal self-attention without an explicit mask"):
        pm.generate(_prompt(), max_new_tokens=NEW)
    pm.close()
