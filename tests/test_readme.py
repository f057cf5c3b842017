"""The README stays true: CI's test command, the first-screen example runs and matches one
device, the supported-models table equals what the tests check (docs/make_models_table.py),
the performance figures are quoted from benchmarks/RESULTS.md, the minimum Python is
pyproject's, and every picture and page it links exists."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _table_script():
    spec = importlib.util.spec_from_file_location("make_models_table",
                                                  ROOT / "docs" / "make_models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_test_command_is_in_a_bash_block():
    """The README's test command is CI's: the same runner and the same workers (CI adds only
    its report flags)."""
    readme = [line.split("#")[0].split() for b in _blocks("bash") for line in b.splitlines()
              if line.startswith("python -m pytest -q -n")]
    ci = [line.split("#")[0].split() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python -m pytest")]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    report_flags = {"-p", "no:cacheprovider"}
    assert [w for w in ci[0] if w not in report_flags and not w.startswith("--durations")] \
        == readme[0], (readme, ci)


def test_first_example_runs_and_matches_one_device(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    code = _blocks("python")[0]
    assert len(code.strip().splitlines()) <= 13, code
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    torch.manual_seed(0)   # fixed weights and prompt: no near-tie can flip a greedy token
    exec(compile(code, "README.md", "exec"), scope)   # noqa: S102 - the README's own example
    model, ids = scope["model"], scope["ids"]
    with torch.no_grad():
        torch.testing.assert_close(scope["out"], model(ids), rtol=1e-4, atol=1e-4)
    x = ids
    for _ in range(8):   # greedy on one device, no cache
        with torch.no_grad():
            x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(scope["tokens"], x)
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_every_python_block_compiles():
    for code in _blocks("python"):
        compile(code, "README.md", "exec")


def test_models_table_is_the_tests_list():
    script = _table_script()
    assert script.readme_table(README) == script.table(), \
        "README.md's models table is stale: python docs/make_models_table.py --write"
    for family in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM",
                   "GPT2LMHeadModel"):
        assert f"`{family}`" in script.readme_table(README)


def test_performance_figures_are_quoted_from_results():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    perf = README.split("## Performance")[1].split("\n## ")[0]
    figures = re.findall(r"\d\.\d\d(?:-\d\.\d\d)?x", perf)
    assert len(figures) >= 6, perf
    for figure in figures:
        assert figure in results, figure


def test_minimum_python_and_links():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = project["requires-python"].removeprefix(">=")
    assert f"Python {minimum} or newer" in README
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)\)", README):
        assert (ROOT / link).is_file(), link
    assert "docs/plan.png" in README
