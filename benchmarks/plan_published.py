"""Published GPU training results of Llama-class models, and fxshard's prediction beside each.

    python benchmarks/plan_accuracy.py published

Sources (read from the repository, cited by file; the hardware model's efficiency factors were
set before this table was made and are not fitted to it):

- [T24] torchtitan ``docs/performance.md`` (2024 version): Llama 3 8B and 70B, FSDP2 over 64
  A100 80GB, local batch 1, sequence 8192, bf16; WPS per GPU and MFU.
- [T25] torchtitan ``docs/performance.md`` (2025 version): Llama 3.1 8B on 8 H100 (the
  Grand Teton H100: 96 GB HBM2e at 2.4 TB/s, 500 W), FSDP 8, local batch 2, sequence 8192,
  selective activation checkpointing, TPS/GPU and memory; and Llama 3.1 405B on 128 H100
  (94 GB), FSDP 16 x TP 8, local batch 2, full activation checkpointing (2024 version).

Mapping to fxshard's options, stated rather than tuned: "full" activation checkpointing is
``recompute="layers"``; "selective" (every other layer, or saving only matmul outputs) has no
fxshard equivalent: predicted with ``recompute=None`` (memory an upper bound) and marked so.
Rows with Float8 are left out (fxshard has no FP8 path). The Grand Teton H100 is the H100
preset with the platform's stated memory and bandwidth.
"""
from __future__ import annotations

GIB = 2 ** 30

# (source, hardware key, model, mesh, local batch, seq, recompute, tok/s/GPU, GiB, note)
ROWS = [
    ("T24", "a100", "llama3-8b", {"fsdp": 64}, 1, 8192, "layers", 2904, None,
     "selective layer AC; predicted with every layer recomputed"),
    ("T24", "a100", "llama3-70b", {"fsdp": 64}, 1, 8192, "layers", 331, None, "full AC"),
    ("T25", "h100-gt", "llama3-8b", {"fsdp": 8}, 2, 8192, None, 5762, 82.4,
     "selective AC; predicted without recompute (memory an upper bound)"),
    ("T24", "h100-gt94", "llama3-405b", {"fsdp": 16, "tp": 8}, 2, 8192, "layers", 109, None,
     "full AC, FSDP 16 x TP 8"),
]

CONFIGS = {   # the models' published shapes (Llama 3 / 3.1 model cards' config.json)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                        num_hidden_layers=126, num_attention_heads=128,
                        num_key_value_heads=8, max_position_embeddings=8192),
}


def _hardware(key: str):
    from fxshard.plan import Hardware
    if key == "h100-gt":
        return Hardware.preset("h100").with_(name="H100 (Grand Teton, 96 GB, 500 W)",
                                             memory_bytes=96 * 10 ** 9,
                                             memory_bandwidth=2.4e12)
    if key == "h100-gt94":
        return Hardware.preset("h100").with_(name="H100 (94 GB)", memory_bytes=94 * 10 ** 9,
                                             memory_bandwidth=2.4e12)
    return Hardware.preset(key)


def published_table() -> str:
    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    lines = [f"{'src':4s} {'model':12s} {'hardware':30s} {'mesh':14s} {'b':>2s} "
             f"{'pub tok/s':>9s} {'pred':>8s} {'err':>7s} {'pub GiB':>7s} {'pred GiB':>8s} "
             f"{'err':>7s}  note"]
    units: dict = {}
    for src, hw_key, name, mesh, b, seq, rc, tps, gib, note in ROWS:
        with fxshard.init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig(**CONFIGS[name]))
        hw = _hardware(hw_key)
        data = 1
        for a in ("dp", "fsdp"):
            data *= mesh.get(a, 1)
        e = fxshard.estimate(model, mesh, hardware=hw, batch=b * data, seq=seq,
                             mixed_precision="bf16", recompute=rc, _units=units)
        pred = e.tokens_per_second_per_device
        mem = e.memory["peak"] / GIB
        m_err = f"{(mem - gib) / gib:+7.1%}" if gib else f"{'':>7s}"
        lines.append(f"{src:4s} {name:12s} {hw.name[:30]:30s} "
                     f"{','.join(f'{k}={v}' for k, v in mesh.items()):14s} {b:>2d} "
                     f"{tps:>9,d} {pred:>8,.0f} {(pred - tps) / tps:+7.1%} "
                     f"{gib if gib else '':>7} {mem:>8.1f} {m_err}  {note}")
    return "\n".join(lines)
