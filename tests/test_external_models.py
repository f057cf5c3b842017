"""Model code of other libraries, unmodified, tiny random configs: litgpt's model builders
(Llama-3, Mistral, Gemma-2, Falcon's multi-query attention, Phi-2, Qwen2.5) on tp=2, dp2·tp2 and
tp2 with sequence parallelism. Skipped where the library is not installed (it is not a
dependency; ``pip install --no-deps litgpt lightning lightning-utilities torchmetrics psutil``
installs it without touching torch).

Each: equal to the single-device model, at most 0.55 of the layer matrices per rank at tp=2,
two activation all-reduces per layer (attention and MLP), no FallbackWarning."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxshard
from fxshard.passes.rules import FallbackWarning
from tests.families import layer_param_fraction

litgpt = pytest.importorskip("litgpt", reason="litgpt is not installed")

LAYERS = 2
LITGPT = {"llama3": ("Llama-3.2-1B", 2), "mistral": ("Mistral-7B-v0.1", 2),
          "gemma2": ("gemma-2-2b", 2), "falcon_mqa": ("falcon-7b", 1), "phi2": ("phi-2", 4),
          "qwen2_5": ("Qwen2.5-0.5B", 2)}


def litgpt_model(key: str):
    from litgpt import Config
    from litgpt.model import GPT
    name, groups = LITGPT[key]
    cfg = Config.from_name(name, n_layer=LAYERS, n_embd=64, n_head=4, n_query_groups=groups,
                           head_size=16, intermediate_size=128, padded_vocab_size=128,
                           vocab_size=128, block_size=64)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


@pytest.mark.parametrize("axes,sp", [(dict(tp=2), False), (dict(dp=2, tp=2), False),
                                     (dict(tp=2), True)], ids=["tp2", "dp2_tp2", "tp2_sp"])
@pytest.mark.parametrize("key", LITGPT)
def test_litgpt_models_shard_like_megatron(key, axes, sp):
    model = litgpt_model(key)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh(**axes), sequence_parallel=sp,
                                 example_inputs=(ids,))
        with torch.no_grad():
            got = pm(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    e = pm.explain()
    assert not e.fallbacks and not e.replicated, (e.fallbacks, e.replicated)
    assert layer_param_fraction(pm, model) <= 0.55, e
    code = pm.rank_module(0).code
    if sp:
        assert code.count("fxshard.reduce_scatter") == 2 * LAYERS, code
    else:
        assert code.count("fxshard.all_reduce") == 2 * LAYERS, code
    if key == "falcon_mqa":   # the fused qkv's one K/V head is held whole, its queries split
        placed = {f: s for f, s, _, _ in e.placements}
        assert "R16+R16" in placed["transformer.h.0.attn.qkv.weight"], placed
    pm.close()
