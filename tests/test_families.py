"""HuggingFace families with the model patterns beyond the plain Llama (tests/families.py):
every one matches the single-device model on tp=2, dp=2·tp=2, tp=2 with sequence parallelism
and a context-parallel mesh, with no op falling back; holds at most 0.55 of the layer weights
per rank at tp=2; and communicates the Megatron minimum per layer (counted in the rank program
as the layer count grows)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fxshard
from fxshard.passes.rules import FallbackWarning
from tests.families import FAMILIES, collectives_by_kind, layer_param_fraction

MESHES = {
    "tp2": (dict(tp=2), False),
    "dp2_tp2": (dict(dp=2, tp=2), False),
    "tp2_sp": (dict(tp=2), True),
    "tp2_ring2": (dict(tp=2, ring_cp=2), False),
}


def _parallel(model, axes: dict, sp: bool, ids):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp)
        with torch.no_grad():
            out = pm(ids).logits
    return pm, out


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_single_device(family, mesh_name):
    model = FAMILIES[family][1](2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    axes, sp = MESHES[mesh_name]
    pm, got = _parallel(model, axes, sp, ids)
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert layer_param_fraction(pm, model) <= 0.55, pm.explain()
        assert not pm.explain().fallbacks
        if "ring_cp" in axes:
            code = pm.rank_module(0).code
            assert code.count("fxshard.ring_attention") == 2, code
            assert "fxshard.attention.default" not in code
    finally:
        pm.close()


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_collectives_per_layer_are_the_megatron_minimum(family, sp):
    _, build, per_layer, per_layer_sp = FAMILIES[family]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    counts = []
    for layers in (1, 2):
        pm, _ = _parallel(build(layers), dict(tp=2), sp, ids)
        counts.append(collectives_by_kind(pm))
        pm.close()
    grown = {k: counts[1][k] - counts[0][k] for k in counts[1] | counts[0]}
    assert {k: v for k, v in grown.items() if v} == (per_layer_sp if sp else per_layer)
