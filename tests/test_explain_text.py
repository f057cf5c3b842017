"""The text plan (``str(pm.explain())``): a legend for the placements and the two byte columns
that covers every placement the plan prints, and pipeline rank groups that say their stage and
its layers."""
from __future__ import annotations

import re

import torch

import fxshard
from fxshard.explain import LEGEND
from tests.models import our_llama

_PLACEMENT = re.compile(r"^(S\(\d+\)|S\(\d+\|\d+(\+\d+)+\)|R|P)$")


def _plan(axes: dict, layers: int = 4, **options):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = fxshard.parallelize(our_llama(num_hidden_layers=layers), mesh, example_inputs=(ids,),
                             **options)
    return pm.explain()


def test_legend_explains_placements_and_wire_bytes():
    text = str(_plan(dict(dp=2, tp=2), layers=1))
    head = text.split("Collectives per rank")[0]
    assert LEGEND in head
    for token in ("S(d)", "S(d|a+b)", "R ", "P ", "tensor bytes", "wire bytes", "2(n-1)/n"):
        assert token in LEGEND, token


def test_every_printed_placement_is_a_legend_form():
    ex = _plan(dict(tp=2, ring_cp=2), layers=1)
    seen = set()
    for _fqn, spec, _shape, _stage in ex.placements:
        for part in spec.split():
            place = part.split(":")[-1]
            assert _PLACEMENT.match(place), (spec, place)
            seen.add(place[0])
    assert {"S", "R"} <= seen


def test_pipeline_rank_groups_name_their_stage_and_layers():
    ex = _plan(dict(tp=2, pp=2), layers=5)
    assert ex.stage_layers() == {0: (0, 2), 1: (3, 4)}   # earlier stages take the extra layer
    text = str(ex)
    collectives = text.split("Collectives per rank")[1].split("Parameter bytes")[0]
    params = text.split("Parameter bytes per rank")[1].split("Placements")[0]
    for section in (collectives, params):
        assert "ranks 0,2 (stage 0: layers 0-2)" in section, section
        assert "ranks 1,3 (stage 1: layers 3-4)" in section, section


def test_no_stage_label_without_pipeline():
    text = str(_plan(dict(tp=2), layers=1))
    assert "  ranks 0,1:" in text and "(stage 0" not in text
