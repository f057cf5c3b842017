"""The seed article's test, as it reads there: one closure switches strategies by mesh shape
alone, with the seed's axis spelling ``ulysess_cp``, on HuggingFace's Llama."""
from __future__ import annotations

import pytest
import torch

import fxshard
from tests.models import hf_llama


@pytest.fixture(scope="module")
def reference():
    model = hf_llama(layers=4, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(7))
    return model, ids, model(ids).logits


def parallel_imp(reference, dp=1, tp=1, pp=1, ulysess_cp=1, ring_cp=1, **options):
    model, ids, want = reference
    mesh = fxshard.init_device_mesh("cpu", (dp, tp, pp, ulysess_cp, ring_cp),
                                    mesh_dim_names=["dp", "tp", "pp", "ulysess_cp", "ring_cp"])
    pm = fxshard.parallelize(model, mesh, **options)
    pm.load_state_dict(model.state_dict())
    torch.testing.assert_close(pm(ids).logits, want, rtol=1e-4, atol=1e-4)
    pm.close()


@pytest.mark.parametrize("axes", [dict(dp=2), dict(dp=2, tp=2, pp=2, ulysess_cp=2),
                                  dict(tp=2, pp=2, ring_cp=2), dict(dp=2, ulysess_cp=2, ring_cp=2)],
                         ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_switch_strategies_with_one_call(reference, axes):
    parallel_imp(reference, **axes)


def test_all_options_together(reference):
    parallel_imp(reference, dp=2, tp=2, pp=2, sequence_parallel=True, microbatches=2)
