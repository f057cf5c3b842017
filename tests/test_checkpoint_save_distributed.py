"""save_safetensors on real processes (gloo, 2 ranks): each rank writes only its files, the
owners' shards sent to each tensor's writer; the index is complete and the checkpoint equals
the single-device model trained the same way. A TrainModule on tp2, and ``fxshard.parallelize``
itself on fsdp2 (``pm(x)`` trained with ``clip_grad_norm_``: each rank's shard gradients
equal its blocks of one device's, then the trained shards saved), and HF Phi-3 with one KV
head on tp2 (its fused qkv's K/V rows held whole by both ranks: counted once by the clipping
norm and written once)."""
import json
import os

import pytest
import torch

from tests.launch import gloo_job, mesh

WORLD = 2


def _model(entry="tm"):
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if entry == "mqa":
        import transformers
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
            pad_token_id=0, bos_token_id=0, eos_token_id=0))
    cfg = LlamaConfig.tiny(num_hidden_layers=1, vocab_size=96, hidden_size=48,
                           intermediate_size=72, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (2, 6), generator=g), torch.randint(0, 96, (2, 6), generator=g)


def _step(params, forward, labels, clip=None):
    import torch.nn.functional as F
    opt = torch.optim.AdamW(params, lr=1e-3, eps=1e-6)
    out = forward()
    out = getattr(out, "logits", out)    # (an HF model's output)
    F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    if clip is not None:
        clip()
    opt.step()


def _clip(pm, report):
    import fxshard
    return lambda: report.setdefault("norm", fxshard.clip_grad_norm_(pm, 0.5).item())


def _clip_ref(model):
    return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def _body(rank: int, report: dict, ckpt: str, entry: str) -> None:
    import fxshard
    from fxshard.mesh import mesh_spec
    from fxshard.training import parallelize_for_training
    from tests.launch import worst_block
    ids, labels = _data()
    if entry == "tm":
        tm = parallelize_for_training(_model(), mesh(tp=WORLD), example_inputs=(ids,))
        _step(tm.parameters(), lambda: tm(ids), labels)
    else:   # pm(x) trains; its first gradients against one device's, rank by rank
        m = mesh(fsdp=WORLD) if entry == "pm" else mesh(tp=WORLD)
        tm = fxshard.parallelize(_model(entry), m, example_inputs=(ids,))
        ref = _model(entry)
        for which in (tm, ref):
            for p in which.parameters():
                p.grad = None
        _step(tm.parameters(), lambda: tm(ids), labels, _clip(tm, report))
        _step(ref.parameters(), lambda: ref(ids), labels, _clip_ref(ref))
        report["shards_after_step"] = worst_block(
            tm.shards(rank), dict(ref.named_parameters()), tm.trainer._specs,
            mesh_spec(m), rank)
    written = fxshard.save_safetensors(tm, ckpt, max_shard_size="20KB")
    report["written"] = sorted(os.path.basename(f) for f in written)


@pytest.mark.grad   # the single-device reference trains
@pytest.mark.parametrize("entry", ["tm", "pm", "mqa"],
                         ids=["train_module-tp2", "parallelize-fsdp2", "phi3-1kv-tp2"])
def test_gloo_each_rank_writes_its_files_index_complete(tmp_path, entry):
    from safetensors.torch import load_file
    ckpt = tmp_path / "ckpt"
    reports = gloo_job(_body, WORLD, str(tmp_path), str(ckpt), entry, timeout_s=240,
                       grad=True)
    index = json.load(open(ckpt / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    data = [f for r in reports.values() for f in r["written"] if f.endswith(".safetensors")]
    assert sorted(data) == files and len(files) >= WORLD      # each file by one rank
    assert all(r["written"] for r in reports.values())         # every rank wrote some
    assert "model.safetensors.index.json" in reports[0]["written"]
    ref = _model(entry)
    ids, labels = _data()
    norm = {}
    _step(ref.parameters(), lambda: ref(ids), labels,
          (lambda: norm.setdefault("ref", _clip_ref(ref)().item())) if entry != "tm" else None)
    if entry != "tm":
        assert all(r["shards_after_step"] < 1e-5 for r in reports.values()), reports
        assert all(abs(r["norm"] - norm["ref"]) <= 1e-5 * norm["ref"]
                   for r in reports.values()), (norm, reports)
    want = ref.state_dict()
    assert set(index["weight_map"]) == set(want)
    got = {k: v for f in files for k, v in load_file(str(ckpt / f)).items()}
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)
