"""fxshard.plan / estimate / Hardware: checked against measurements and the programs' counts.

The memory test measures a real peak (benchmarks/plan_measure.py: a fresh process, VmHWM rise
plus the resident shards and AdamW state) and compares the prediction from one layer's
programs; the search test checks that a search builds one program per (tp, recompute), not
one per mesh.
"""
from __future__ import annotations

import pytest
import torch

import fxshard
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
from fxshard.plan import Hardware, estimate, plan
from fxshard.plan.units import one_layer_model

CFG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
GRAD = False   # (estimate traces the training programs with grad enabled itself)
BIG = Hardware.preset("h100").with_(memory_bytes=10 ** 12)


def _meta(**kw):
    with fxshard.init_empty_weights():
        return LlamaForCausalLM(LlamaConfig(**{**CFG, **kw}))


def test_presets_and_errors():
    h = Hardware.preset("H100")
    assert h.peak(torch.bfloat16) == 989e12 and h.memory_bytes == 80 * 10 ** 9
    assert Hardware.preset("mi300x").memory_bytes == 192 * 10 ** 9
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*h100"):
        Hardware.preset("tpu")
    with pytest.raises(ValueError, match="batch=3 does not divide over dp x fsdp"):
        estimate(_meta(), {"dp": 2}, hardware=BIG, batch=3, seq=64)
    with pytest.raises(ValueError, match="pp=3 is more stages than the model's 2 layers"):
        estimate(_meta(), {"pp": 3}, hardware=BIG, batch=6, seq=64, microbatches=2)


def test_one_layer_copy_shares_modules():
    model = _meta(num_hidden_layers=5)
    small = one_layer_model(model)
    assert len(small.model.layers) == 1 and len(model.model.layers) == 5
    assert small.model.layers[0] is model.model.layers[0]


def test_layers_scale_linearly():
    """rest + L * layer: parameters and FLOPs of 6 layers minus 2 layers = 4 layers' worth."""
    e2 = estimate(_meta(), {"tp": 2}, hardware=BIG, batch=2, seq=64)
    e6 = estimate(_meta(num_hidden_layers=6), {"tp": 2}, hardware=BIG, batch=2, seq=64)
    layer = (256 * 256 * 2 + 2 * 128 * 256 + 3 * 256 * 688) / 2 * 4 + 2 * 256 * 4
    assert e6.memory["parameters"] - e2.memory["parameters"] == pytest.approx(4 * layer)
    assert e6.flops_per_step > 2.5 * e2.flops_per_step


def test_search_builds_one_program_per_tp():
    p = plan(_meta(), devices=4, hardware=BIG, batch=8, seq=64, recompute=False)
    assert p.programs_built == 2                     # tp=1 and tp=2; dp/fsdp/pp priced
    assert len(p.candidates) >= 5
    assert any("tp=4 beyond the 2 KV heads" in why for _, _, why in p.rejected)
    tps = [e.tokens_per_second_per_device for e in p.candidates]
    assert tps == sorted(tps, reverse=True)


def test_does_not_fit_is_rejected():
    tiny = Hardware.preset("h100").with_(memory_bytes=2 * 10 ** 6)
    p = plan(_meta(), devices=2, hardware=tiny, batch=2, seq=64, recompute=False)
    assert not p.candidates
    fit = [mesh for mesh, _, why in p.rejected if why.startswith("does not fit: ")]
    assert {"dp": 2} in [{a: n for a, n in m.items() if n > 1} for m in fit]


@pytest.mark.parametrize("mesh", [{"fsdp": 2}])
def test_memory_within_10_percent_of_measured(mesh):
    from benchmarks.plan_measure import measure
    got = measure(CFG, mesh, batch=4, seq=256, training=True,
                  options={"sequence_parallel": False})
    e = estimate(_meta(), mesh, hardware=BIG, batch=4, seq=256, sequence_parallel=False)
    assert abs(e.memory["peak"] - got["memory"]) / got["memory"] < 0.10, (e.memory, got)


def test_cli_plan_prints_ranked_and_ruled_out(tmp_path, capsys):
    import json
    from fxshard.__main__ import main
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CFG, "model_type": "llama",
                                "architectures": ["LlamaForCausalLM"]}))
    assert main(["plan", "--config", str(path), "--devices", "4", "--seq", "64",
                 "--batch", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "configurations fit" in out and "Ruled out" in out
    assert "tp=4 beyond the 2 KV heads" in out and "tokens/s" in out


def test_inference_estimate_has_kv_cache_and_latencies():
    e = estimate(_meta(), {"tp": 2}, hardware=BIG, batch=2, seq=64, training=False,
                 new_tokens=16)
    kv = 2 * 2 * 1 * 64 * (64 + 16) * 2 * 4      # 2 x layers x local KV heads x dim x pos x b
    assert e.memory["kv_cache"] == kv
    assert 0 < e.step_time["decode"] < e.step_time["prefill"]
