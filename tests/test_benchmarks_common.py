"""benchmarks/common.py, the benchmarks' shared harness: size flags, tables, timing helpers and
the launcher's error for a failing rank (benchmarks themselves are not timed tests)."""
from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import common


def test_add_model_args_adds_named_flags_with_defaults():
    ap = common.add_model_args(argparse.ArgumentParser(), **common.RUNTIME_TP, batch=2, seq=64)
    args = ap.parse_args(["--kv-heads", "2", "--layers", "3"])
    assert (args.hidden, args.heads, args.kv_heads, args.layers, args.batch, args.seq) == \
        (256, 8, 2, 3, 2, 64)
    assert not hasattr(args, "prompt")            # only the flags named are added
    assert common.sizes(args, vocab=100) == dict(common.RUNTIME_TP, kv_heads=2, layers=3,
                                                 vocab=100)


def test_add_model_args_rejects_an_unknown_size():
    with pytest.raises(ValueError, match=r"unknown size flag\(s\) \['hiden'\]"):
        common.add_model_args(argparse.ArgumentParser(), hiden=64)


def test_bundled_llama_from_flags():
    args = argparse.Namespace(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1,
                              vocab=40)
    model = common.bundled_llama(args)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.intermediate_size,
            cfg.num_hidden_layers, cfg.vocab_size) == (32, 2, 48, 1, 40)
    assert torch.equal(model.lm_head.weight, common.bundled_llama(args).lm_head.weight)
    assert common.token_ids(40, 2, 5).shape == (2, 5)


def test_format_table_aligns_columns_and_prints_missing_as_dash():
    text = common.format_table([("variant", "<8"), ("ms", ">7.2f"), ("ratio", ">6.3f")],
                               [["a", 1.5, None], ["bb", "n/a", 2.0]])
    assert text.splitlines() == ["variant       ms  ratio",
                                 "a           1.50      -",
                                 "bb           n/a  2.000"]


def test_stats_and_percentile():
    s = common.stats_ms([0.001, 0.002, 0.003, 0.004, 0.010])
    assert s["median_ms"] == pytest.approx(3.0) and s["n"] == 5
    assert s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(7.6)
    assert common.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_interleaved_orders_blocks_and_counts_calls():
    seen = []
    variants = {"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}
    out = common.interleaved(variants, 2, calls=2, warmup=1, order="alternate")
    assert seen == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]
    assert [len(out[k]["wall"]) for k in "ab"] == [4, 4]
    out = common.interleaved(variants, 3, calls=2, warmup=0, per_call=False)
    assert [len(out[k]["cpu"]) for k in "ab"] == [3, 3]


def _fail_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure")
    torch.distributed.barrier()                   # rank 0 waits on the rank that failed
    return rank


def test_launch_names_the_rank_that_failed():
    with pytest.raises(common.RankFailed, match=r"(?s)rank 1 of 2 failed.*deliberate failure"):
        common.launch(_fail_on_rank_1, 2, timeout_s=120)


def test_megatron_baseline_slices_and_refuses_what_it_cannot_split():
    args = argparse.Namespace(hidden=32, heads=4, kv_heads=2, intermediate=48, layers=1,
                              vocab=40)
    model = common.bundled_llama(args)
    m = common.MegatronLlama(model, 1, 2, embedding="vocab")  # builds slices, no collective
    wq = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(m.layers[0]["wq"], wq[16:]) and m.layers[0]["wq"].data_ptr() != \
        wq[16:].data_ptr()                        # a copy: training it leaves the model alone
    assert torch.equal(m.layers[0]["wd"], model.model.layers[0].mlp.down_proj.weight[:, 24:])
    with pytest.raises(ValueError, match="2 key/value heads do not split over tp=4"):
        common.MegatronLlama(model, 0, 4)
    odd = common.bundled_llama(argparse.Namespace(**dict(vars(args), vocab=41)))
    with pytest.raises(ValueError, match=r"shape \[41, 32\] does not split evenly on dim 0"):
        common.MegatronLlama(odd, 0, 2, embedding="vocab")
