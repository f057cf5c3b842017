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
    ("dp=2,tq=2", r"argument --mesh: unknown axis 'tq'; use dp, fsdp, tp, pp, ulysses_cp, ring_cp"),
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
    # the CLI takes no plan=: the fix it suggests is one the CLI can do
    assert "plan={" not in err and "--mesh tp=2" in err, err


@pytest.mark.parametrize("command", ["demo", "explain", "generate"])
def test_help_has_no_markup_and_every_option_a_help_text(command, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    top = capsys.readouterr().out
    assert info.value.code == 0 and "`" not in top and command in top
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])  # the command's own help, not the top-level one
    out = capsys.readouterr().out
    assert info.value.code == 0 and "`" not in out
    assert out.startswith(f"usage: python -m fxshard {command} "), out
    lines = out.split("options:")[1].splitlines()
    own = {"demo": ("--seq", "--lines", "--svg"), "explain": ("--seq", "--svg"),
           "generate": ("--prompt-len", "--new-tokens", "--seed")}[command]
    for opt in ("--mesh", "--sp", "--layers", "--microbatches", "--batch", *own):
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(opt + " ")
                 or ln.strip() == opt)
        # help sits on the option's line or, for long options, on the next one
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert len(lines[i].split()) > 2 or (nxt.startswith(" " * 8)
                                             and not nxt.strip().startswith("-")), lines[i]


@pytest.mark.parametrize("argv,option", [
    (["demo", "--batch", "-2"], "--batch"), (["explain", "--seq", "0"], "--seq"),
    (["demo", "--layers", "0"], "--layers"), (["explain", "--microbatches", "-1"],
                                              "--microbatches"),
    (["demo", "--lines", "x"], "--lines"), (["generate", "--seed", "1.5"], "--seed"),
    (["generate", "--batch", "0"], "--batch"),
])
def test_bad_numbers_are_usage_errors_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"argument {option}: expected an integer" in err, err


def test_unwritable_svg_is_a_usage_error_before_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--layers", "1", "--svg", str(tmp_path / "no" / "plan.svg")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "argument --svg: the folder" in err and "does not exist" in err, err
    with pytest.raises(SystemExit) as info:
        main(["explain", "--layers", "1", "--svg", str(tmp_path)])
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("error,code,message", [
    (OSError(28, "No space left on device"), 1, r"error: \[Errno 28\] No space left"),
    (MemoryError(), 1, r"error: out of memory \(MemoryError\); use a smaller --batch"),
])
def test_os_and_memory_errors_are_one_line(monkeypatch, capsys, error, code, message):
    import fxshard.__main__ as cli

    def fail(args):
        raise error
    monkeypatch.setattr(cli, "_run", fail)
    with pytest.raises(SystemExit) as info:
        cli.main(["demo"])
    err = capsys.readouterr().err
    assert info.value.code == code and "Traceback" not in err and len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_default_batch_fits_the_mesh(capsys):
    assert main(["explain", "--mesh", "dp=2,tp=2,pp=2", "--microbatches", "4",
                 "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "fxshard plan on mesh (dp=2, tp=2, pp=2)" in out and "4 microbatches" in out
    # the sequence fits ring_cp's zigzag (2 x 3 chunks): 18, not 16
    assert main(["demo", "--mesh", "ring_cp=3", "--layers", "1"]) == 0
    assert ": PASS" in capsys.readouterr().out


def test_demo_prints_the_verdict_first_then_one_layer_and_the_backend(capsys):
    assert main(["demo", "--mesh", "tp=2", "--layers", "3", "--lines", "200"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "ran on: simulated mesh (tp=2), 2 ranks as threads of this process (cpu)"
    assert re.fullmatch(r"max \|parallel - single device\| = \S+ on mesh \(tp=2\): PASS "
                        r"\(tolerance 0.0001, fp32\)", lines[1]), lines[1]
    assert out.index("max |parallel") < out.index("fxshard plan on mesh")
    excerpt = out.split("One layer of rank 0's program")[1]
    # layer 1: both row-parallel all-reduces, no weight fetches, no other layer's weights
    assert excerpt.count("torch.ops.fxshard.all_reduce") == 2, excerpt
    assert "model_layers_1_mlp_down_proj_weight" in excerpt
    assert "model_layers_0_" not in excerpt and "model_layers_2_" not in excerpt
    assert "= self.model" not in excerpt and "getattr(self" not in excerpt


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
