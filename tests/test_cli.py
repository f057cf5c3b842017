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


WHOLE_KV = "model.layers.*.self_attn.k_proj=replicate,model.layers.*.self_attn.v_proj=replicate"


def test_whole_weights_are_a_one_line_note_with_the_clis_options(capsys):
    """tp=4 exceeds the tiny Llama's 2 KV heads: a note that gives --plan and --strict (which
    the CLI takes), not parallelize's plan= and strict=True, and no warning location."""
    assert main(["demo", "--mesh", "tp=4", "--sp", "--layers", "2", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert ": PASS" in out
    notes = [ln for ln in err.splitlines() if ln.startswith("python -m fxshard demo: note: ")]
    assert len(notes) == 1 and err.splitlines() == notes, err
    assert "4 weight matrices of repeated layers stay whole on mesh axis 'tp'" in notes[0]
    assert "tp=4 exceeds the 2 KV heads" in notes[0]
    assert f"--plan '{WHOLE_KV}'" in notes[0] and "--strict makes it an error" in notes[0]
    for word in ("WholeWeightWarning", "plan={", "strict=True", "runpy", ".py:"):
        assert word not in err, err


def test_plan_option_accepts_the_whole_weights_and_strict_makes_them_an_error(capsys):
    assert main(["demo", "--mesh", "tp=4", "--layers", "1", "--quiet", "--plan", WHOLE_KV]) == 0
    out, err = capsys.readouterr()
    assert ": PASS" in out and err == "", err
    with pytest.raises(SystemExit) as info:
        main(["explain", "--mesh", "tp=4", "--layers", "1", "--quiet", "--strict"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("python -m fxshard explain: error: --strict: weight "
                          "model.layers.0.self_attn.k_proj.weight"), err
    assert "--plan 'model.layers.0.self_attn.k_proj=replicate' or drop --strict" in err, err


@pytest.mark.parametrize("plan", ["model.layers.*", "x=foo", "=replicate"])
def test_bad_plan_is_a_usage_error(plan, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--plan", plan])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --plan: expected MODULE_GLOB=STYLE pairs" in err


def test_readmes_first_cli_example_prints_no_warning():
    """As the README runs it (python -m, so a warning's location would be runpy's)."""
    import subprocess
    import sys
    from pathlib import Path
    done = subprocess.run([sys.executable, "-m", "fxshard", "demo", "--mesh", "tp=4", "--sp",
                           "--layers", "1"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and ": PASS" in done.stdout, done.stderr[-3000:]
    assert "Warning" not in done.stderr and "runpy" not in done.stderr, done.stderr
    assert "python -m fxshard demo: note: 1 weight matrices" not in done.stderr
    assert "python -m fxshard demo: note: 2 weight matrices of repeated layers" in done.stderr


def test_long_steps_say_what_they_do_on_stderr_and_quiet_silences_them(capsys):
    argv = ["generate", "--mesh", "tp=2", "--layers", "1", "--batch", "2", "--prompt-len", "4",
            "--new-tokens", "3"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == ("tracing LlamaForCausalLM (1 layer) on mesh (tp=2) for generation and "
                        "building its prefill and decode programs (the first pm.generate) ...")
    assert re.fullmatch(r"built 2 ranks' prefill and decode programs and generated 3 tokens in "
                        r"\d+\.\d s", lines[1]), lines
    assert lines[2] == "timing the prefill and the decode steps ..."
    assert any(ln.startswith("the single-device reference: 3 greedy steps") for ln in lines)
    assert "tracing" not in out and "tokens equal the single-device" in out
    assert main(["explain", "--mesh", "tp=2", "--layers", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("tracing LlamaForCausalLM (2 layers) on mesh (tp=2) and building its "
                      "rank programs ...")
    assert re.fullmatch(r"built 2 rank programs in \d+\.\d s", err[1]), err
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_library_calls_print_nothing(capsys):
    import torch

    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1)).eval()
    ids = torch.randint(0, 128, (2, 8))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    try:
        with torch.no_grad():
            pm(ids)
        pm.generate(ids, max_new_tokens=2)
    finally:
        pm.close()
    assert capsys.readouterr() == ("", "")


def test_help_examples_draw_outside_the_working_directory(capsys):
    """Run inside a clone, the help's example leaves no untracked picture."""
    with pytest.raises(SystemExit):
        main(["--help"])
    svgs = re.findall(r"--svg (\S+)", capsys.readouterr().out)
    assert svgs and all(s.startswith("/tmp/") for s in svgs), svgs
