"""``pm.explain().save(path)`` and ``python -m fxshard explain --svg``: the file is written and
holds the mesh (every rank labelled with its stage, layers, weight slices and how many more),
the collectives per layer (sent and received apart, every group named, one fixed colour per
collective) and the GPipe schedule (every microbatch on every stage, bubbles marked)."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch

import fxshard
from fxshard.plot import AXIS_HATCHES, OP_COLORS, STAGE_COLORS, gpipe_schedule, layer_groups
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
    assert "layer 0 q_proj.weight[0:32, 0:64]" in joined
    assert "layer 0 q_proj.weight[32:64, 0:64]" in joined
    # each box: its stage and layers, and how many sliced weights it does not list
    assert "stage 0: layers 0-1, 0.18 MiB weights" in joined
    assert "stage 1: layers 2-3, 0.18 MiB weights" in joined
    assert sum(t == "+12 more sliced weights" for t in joined.split("\n")) == 4
    for layer in range(4):  # both stages' layers appear once each
        assert f"layer {layer}" in texts
    # the transfer between the stages is its own group, after stage 0's last layer
    assert texts.index("layer 1") < texts.index("pp 0->1") < texts.index("layer 2")
    for name in ("all_reduce", "all_gather", "send", "recv", "axis tp", "axis pp"):
        assert name in texts, name
    assert "other" not in texts and not any("outside modules" in t for t in texts)
    assert texts.count("sent") == texts.count("recv") - 1 >= 6   # one "recv" is the legend's
    # GPipe: 2 stages x 3 microbatches, 4 time steps, 1 bubble step per stage
    assert sum(t.startswith("mb ") for t in texts) == 6 and texts.count("bubble") == 2
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
    assert layer_groups(ex, "received") == groups    # a ring collective receives what it sends


def test_sends_and_receives_apart_and_the_output_gather_named():
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ids = torch.randint(0, 128, (2, 8))
    ex = fxshard.parallelize(model, mesh, example_inputs=(ids,)).explain()
    sent, received = layer_groups(ex, "sent"), layer_groups(ex, "received")
    b, s, h, v = 1, 8, 64, 128   # per dp rank
    assert sent["pp 0->1"] == {("send", "pp"): b * s * h * 4}      # stage 0 sends
    assert received["pp 0->1"] == {("recv", "pp"): b * s * h * 4}  # stage 1 receives
    # the logits gathered on dp: (n - 1) * local bytes, sent and received
    assert sent["output gather"] == received["output gather"] == {("all_gather", "dp"):
                                                                  b * s * v * 4}
    with pytest.raises(ValueError, match="direction='both'"):
        layer_groups(ex, "both")


def test_collective_colours_are_fixed_and_not_the_stages(tmp_path):
    """all_reduce is drawn in its one colour in two different pictures; no collective shares a
    colour with another or with a pipeline stage (the mesh boxes and the schedule)."""
    assert len(set(OP_COLORS.values())) == len(OP_COLORS)
    assert not set(OP_COLORS.values()) & set(STAGE_COLORS)
    assert len(set(AXIS_HATCHES.values())) == len(AXIS_HATCHES)
    ids = torch.randint(0, 128, (2, 8))
    for axes in (dict(tp=2), dict(dp=2, tp=2)):
        mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        pm = fxshard.parallelize(our_llama(num_hidden_layers=1), mesh, example_inputs=(ids,))
        svg = (tmp_path / "p.svg")
        pm.explain().save(str(svg))
        assert f"fill: {OP_COLORS['all_reduce']}" in svg.read_text(), axes


def test_gpipe_schedule_is_diagonal():
    assert gpipe_schedule(2, 2) == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 2)]


def test_cli_svg(tmp_path):
    from fxshard.__main__ import main
    path = tmp_path / "cli.svg"
    assert main(["explain", "--mesh", "dp=2,pp=2", "--layers", "2", "--microbatches", "2",
                 "--svg", str(path)]) == 0
    assert "GPipe schedule: 2 stages x 2 microbatches, bubble 33% of each stage's time" in \
        _texts(path)
