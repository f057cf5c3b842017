"""``python -m fxshard``: argument errors without tracebacks, a help text with help for every
option, one layer of the program as the excerpt, the line that says which backend ran."""
from __future__ import annotations

import re

import pytest

from fxshard.__main__ import layer_excerpt, main


@pytest.mark.parametrize("mesh,message", [
    ("dp=x", r"argument --mesh: expected NAME=SIZE pairs.*got 'dp=x'"),
    ("dp2", r"argument --mesh: expected NAME=SIZE pairs.*got 'dp2'"),
    ("tp=0", r"argument --mesh: expected NAME=SIZE pairs with sizes >= 1"),
    ("dp=2,tq=2", r"argument --mesh: unknown axis 'tq'; use dp, tp, pp, ulysses_cp, ring_cp"),
    ("tp=2,tp=2", r"argument --mesh: 'tp=2,tp=2' names an axis twice"),
])
def test_malformed_mesh_is_a_usage_error_without_traceback(mesh, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--mesh", mesh])
    err = capsys.readouterr().err
    assert info.value.code == 2 and re.search(message, err), err
    assert "Traceback" not in err


def test_an_error_from_fxshard_is_one_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--mesh", "tp=3", "--layers", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert re.search(r"python -m fxshard explain: error: .*'tp' of size 3", err), err


def test_help_has_no_markup_and_every_option_a_help_text(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "`" not in out
    lines = out.split("options:")[1].splitlines()
    for opt in ("--mesh", "--sp", "--layers", "--microbatches", "--batch", "--seq", "--lines",
                "--svg", "--prompt-len", "--new-tokens", "--seed"):
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(opt + " ")
                 or ln.strip() == opt)
        # help sits on the option's line or, for long options, on the next one
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert len(lines[i].split()) > 2 or (nxt.startswith(" " * 8)
                                             and not nxt.strip().startswith("-")), lines[i]


def test_demo_shows_one_layer_and_the_backend(capsys):
    assert main(["demo", "--mesh", "tp=2", "--layers", "3", "--lines", "200"]) == 0
    out = capsys.readouterr().out
    excerpt = out.split("One layer of rank 0's program")[1].split("ran on:")[0]
    # layer 1: both row-parallel all-reduces, no weight fetches, no other layer's weights
    assert excerpt.count("torch.ops.fxshard.all_reduce") == 2, excerpt
    assert "model_layers_1_mlp_down_proj_weight" in excerpt
    assert "model_layers_0_" not in excerpt and "model_layers_2_" not in excerpt
    assert "= self.model" not in excerpt and "getattr(self" not in excerpt
    assert "ran on: simulated mesh (tp=2), 2 ranks as threads of this process (cpu)" in out
    assert re.search(r"max \|parallel - single device\| = \S+ on mesh \(tp=2\)", out)


def test_layer_excerpt_falls_back_to_the_whole_body():
    code = "def forward(self, x):\n    w = self.w\n    y = torch.ops.aten.relu.default(x)\n"
    assert layer_excerpt(code) == ["    y = torch.ops.aten.relu.default(x)"]


def test_generate_prints_tokens_equal_to_one_device_and_the_speed(capsys):
    assert main(["generate", "--mesh", "tp=2", "--layers", "1", "--batch", "2",
                 "--prompt-len", "5", "--new-tokens", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "ran on: simulated mesh (tp=2), 2 ranks as threads of this process (cpu)" in out
    assert "prompt: 2 x 5 tokens (seed 3), 4 new tokens per sequence, greedy" in out
    rows = re.findall(r"sequence \d: \[([\d, ]+)\]", out)
    assert len(rows) == 2 and all(len(r.split(",")) == 4 for r in rows), out
    assert "tokens equal the single-device model's greedy tokens: yes" in out
    assert re.search(r"prefill: [\d.]+ ms for 2 x 5 tokens", out), out
    assert re.search(r"decode: 3 steps, [\d.]+ ms per step, [\d.]+ tokens/s \(batch 2\)", out)


@pytest.mark.parametrize("argv,message", [
    (["--new-tokens", "0"], r"argument --new-tokens: expected an integer >= 1, got '0'"),
    (["--prompt-len", "x"], r"argument --prompt-len: expected an integer >= 1, got 'x'"),
    (["--mesh", "dp=2", "--batch", "3"],
     r"python -m fxshard generate: error: ParallelModule.generate: the batch of 3 sequences "
     r"cannot be split over mesh \(dp=2\).*multiple of 2"),
])
def test_generate_bad_argument_is_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--layers", "1", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert re.search(message, err), err
