"""``pm.explain().save(path)`` and ``python -m fxshard explain --svg``: the file is written and
holds the mesh (every rank and its weight slices), the collectives per layer and the GPipe
schedule (every microbatch on every stage)."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch

import fxshard
from fxshard.plot import gpipe_schedule, layer_groups
from tests.models import our_llama

pytest.importorskip("matplotlib")


def _texts(path) -> list[str]:
    root = ET.parse(path).getroot()
    return [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]


def test_svg_shows_mesh_slices_layers_and_schedule(tmp_path):
    model = our_llama(num_hidden_layers=4)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    ids = torch.randint(0, 128, (3, 8))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,), microbatches=3)
    ex = pm.explain()
    path = ex.save(str(tmp_path / "plan.svg"))
    texts = _texts(path)
    joined = "\n".join(texts)
    for r in range(4):
        assert f"rank {r}" in joined
    # tp shards q_proj's rows: rank 0 (tp=0) rows 0:32, rank 2 (tp=1) rows 32:64
    assert "q_proj.weight[0:32, 0:64]" in joined and "q_proj.weight[32:64, 0:64]" in joined
    for layer in range(4):  # both stages' layers appear once each
        assert f"layer {layer}" in texts
    assert "all_reduce tp" in texts and "send pp" in texts
    # GPipe: 2 stages x 3 microbatches, 4 time steps, 1 bubble step per stage
    assert sum(t.startswith("mb ") for t in texts) == 6
    assert "GPipe schedule: 2 stages x 3 microbatches, bubble 25% of each stage's time" in texts


def test_layer_groups_bytes_match_explain_counts():
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 128, (2, 8))
    ex = fxshard.parallelize(model, mesh, example_inputs=(ids,)).explain()
    groups = layer_groups(ex)
    b, s, h, t = 2, 8, 64, 2
    per_layer = 2 * 2 * (t - 1) * b * s * h * 4 // t  # two all-reduces of [b, s, h] fp32
    assert groups["layer 0"] == {("all_reduce", "tp"): per_layer}
    assert groups["layer 1"] == {("all_reduce", "tp"): per_layer}


def test_gpipe_schedule_is_diagonal():
    assert gpipe_schedule(2, 2) == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 2)]


def test_cli_svg(tmp_path):
    from fxshard.__main__ import main
    path = tmp_path / "cli.svg"
    assert main(["explain", "--mesh", "dp=2,pp=2", "--layers", "2", "--microbatches", "2",
                 "--svg", str(path)]) == 0
    assert "GPipe schedule: 2 stages x 2 microbatches, bubble 33% of each stage's time" in \
        _texts(path)
