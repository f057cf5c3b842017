"""MLA-style attention (DeepSeek-V3): the value head size (16) differs from the query/key head
size (24). A small plain-PyTorch causal LM equals the single-device model on tp, ring and
Ulysses, and generates the greedy loop's tokens with a V cache of v's head size."""
from __future__ import annotations

import pytest
import torch

import fxshard
from tests.plain_lms import TinyLM, greedy_reference
from tests.models import model_cache

TOL = dict(rtol=1e-4, atol=1e-4)
MESHES = {"tp2": dict(tp=2), "ring2": dict(ring_cp=2), "ulysses2": dict(ulysses_cp=2),
          "tp2ring2": dict(tp=2, ring_cp=2)}


# each model is parallelized over several meshes: built and exported once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
built = model_cache()   # each model built once for this module


def parallel(model, axes):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh)


def mla():
    return TinyLM(qk_head=24, v_head=16, positions="table").eval()


def _targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("mesh", ["tp2", "ring2", "ulysses2"])
def test_forward_equals_single_device(mesh):
    model = built(mla)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = parallel(model, MESHES[mesh])
    torch.testing.assert_close(pm(ids), model(ids), **TOL)
    targets = _targets(pm.rank_module(0))
    if mesh == "ring2":
        assert "fxshard.ring_attention.default" in targets
    if mesh == "tp2":   # heads split: each rank holds half of every attention projection
        sd = pm.rank_module(0).state_dict()
        assert sd["layers.0.attn.wq.weight"].shape == (2 * 24, 32)
        assert sd["layers.0.attn.wv.weight"].shape == (2 * 16, 32)
        assert sd["layers.0.attn.wo.weight"].shape == (32, 2 * 16)
    pm.close()


@pytest.mark.parametrize("mesh", ["tp2", "tp2ring2", "ulysses2"])
def test_generate_equals_a_greedy_loop(mesh):
    model = built(mla)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = parallel(model, MESHES[mesh])
    got = pm.generate(ids, max_new_tokens=5)
    caches = dict((k, s) for p in pm.programs.last.programs for k, s, _ in p.kv_caches)
    pm.close()
    torch.testing.assert_close(got, greedy_reference(model, ids, 5), rtol=0, atol=0)
    assert caches["kv.0.k"][-1] == 24 and caches["kv.0.v"][-1] == 16   # per-rank heads: 2
    assert caches["kv.0.k"][1] == caches["kv.0.v"][1] == 2   # 4 heads over 2 ranks
