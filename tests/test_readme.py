"""The README stays a true front page: CI runs its install and test command, its first example
and its training example run and match one device, the supported-models table equals what the
tests check (docs/make_models_table.py), the performance figures are quoted from
benchmarks/RESULTS.md, no dated change note, the minimum Python is pyproject's, and every
picture and page it links exists. The details moved to docs/ stay true too (docs/training.md's
second backward, its examples compile)."""
from __future__ import annotations

import copy
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TRAINING = (ROOT / "docs" / "training.md").read_text()
DOCS = ("README.md", "docs/training.md", "docs/api.md", "docs/models.md", "docs/runtime.md")
CI = (ROOT / ".ci" / "run").read_text()


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _table_script():
    spec = importlib.util.spec_from_file_location("make_models_table",
                                                  ROOT / "docs" / "make_models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands(text: str, start: str) -> list[list[str]]:
    """The lines starting with ``start`` as words, without a comment or a ``||`` tail."""
    return [shlex.split(line.split("#")[0].split("||")[0]) for line in text.splitlines()
            if line.startswith(start)]


def test_ci_runs_the_readmes_install_and_test_command():
    """.ci/run's first environment installs what the README's test set-up installs (plus the
    constraints) and runs its test command; its second runs the same command on everything.
    CI adds only report flags, and in the first run the files it names."""
    readme = [c for b in _blocks("bash") for c in _commands(b, "python -m pytest -q -n")]
    ci = _commands(CI, "python -m pytest")
    assert len(readme) == 1 and len(ci) == 2, (readme, ci)
    report = {"-p", "no:cacheprovider"}
    flags = [[w for w in c if w not in report and not w.startswith(("--durations", "tests/"))
              and w != "${readme_files[@]}"] for c in ci]
    assert flags == [readme[0], readme[0]], (readme, ci)
    assert ci[0][-1] == "${readme_files[@]}" and "tests/" not in " ".join(ci[1])
    # the install the README gives for the tests, then CI's for the README path (first)
    want = [c for b in _blocks("bash") for c in _commands(b, "pip install -e")
            if any("test" in w for w in c)]
    assert want == [["pip", "install", "-e", ".[test]"]], want
    installs = [c for c in _commands(CI, "python -m pip install -q -c constraints.txt -e")]
    assert [c[-1] for c in installs] == [".[test]", ".[test,gpu]"], installs
    assert CI.index('-e ".[test]"') < CI.index("python -m pytest") < CI.index(
        '-e ".[test,gpu]"')


def test_ci_readme_path_names_existing_files_and_fails_on_no_tests():
    files = re.search(r"readme_files=\((.*?)\)", CI, re.S).group(1).split()
    assert "tests/test_readme.py" in files and "tests/test_ops_layout.py" in files, files
    assert all((ROOT / f).is_file() for f in files), files
    assert 'if [ "$status" -eq 5 ]' in CI and "exit 1" in CI


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


@pytest.mark.grad
def test_training_example_runs_and_equals_training_on_one_device():
    """The README's training block as written: its three clipped AdamW steps on fsdp2·tp2
    give the weights that the same steps on one device give."""
    code = next(b for b in _blocks("python") if "opt.step()" in b)
    assert len(code.strip().splitlines()) <= 16, code
    scope: dict = {}
    torch.manual_seed(0)
    exec(compile(code, "README.md", "exec"), scope)   # noqa: S102 - the README's own example
    model, ids, labels, full = scope["model"], scope["ids"], scope["labels"], scope["full"]
    try:
        ref = copy.deepcopy(model)   # the model object keeps its initial weights
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        want = ref.state_dict()
        assert full.keys() == want.keys()
        for name, value in want.items():
            assert not torch.equal(value, model.state_dict()[name]) or value.dim() < 2, name
            torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        scope["pm"].close()


def test_every_python_block_compiles():
    for doc in DOCS:
        for code in _blocks("python", (ROOT / doc).read_text()):
            compile(code, doc, "exec")


@pytest.mark.grad
def test_training_docs_state_what_a_second_backward_raises():
    """docs/training.md says which error a second backward through one output is; it is."""
    text = " ".join(TRAINING.split())
    said = re.search(r"A second backward through one output \(`retain_graph=True`\) is a "
                     r"`(\w+)`", text)
    assert said, "docs/training.md no longer says what a second backward raises"
    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    try:
        loss = pm(torch.randint(0, 128, (2, 8))).float().pow(2).mean()
        loss.backward(retain_graph=True)
        with pytest.raises(Exception) as info:
            loss.backward()
    finally:
        pm.close()
    assert type(info.value).__name__ == said.group(1), info.value
    assert "second backward" in str(info.value)


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
    assert "(benchmarks/RESULTS.md)" in perf
    figures = re.findall(r"\d\.\d{2,3}(?:-\d\.\d{2,3})?x", perf)
    assert len(figures) >= 10, perf
    for figure in figures:
        assert figure in results, figure
    rows = [ln for ln in perf.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert 6 <= len(rows) - 1 <= 9, rows   # one row per figure, the latest: not a run log


def test_front_page_is_short_and_holds_no_dated_change_notes():
    assert len(README.splitlines()) <= 230
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", README)
    assert dates == [], dates
    assert re.search(r"\buntil 20\d\d", TRAINING) is None
    for heading in ("## Set up", "## Command line", "## Training", "## Supported models",
                    "## Performance", "## More"):
        assert heading in README, heading
    # the old run log and the dated notes are kept, in the history
    history = (ROOT / "benchmarks" / "history" / "readme_performance.md").read_text()
    assert "until 2026-12-06" in history and "0.926x" in history


def test_readmes_pictures_are_written_outside_the_clone_or_ignored():
    """Running the README's commands inside the clone leaves no untracked file."""
    svgs = [w for b in _blocks("bash") for c in _commands(b, "python -m fxshard")
            for i, w in enumerate(c) if i and c[i - 1] == "--svg"]
    assert svgs and all(w.startswith("/tmp/") for w in svgs), svgs
    saved = re.findall(r"\.save\(\"([^\"]+)\"\)", _blocks("python")[0])
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert saved and all(f"/{name}" in ignored for name in saved), (saved, ignored)


def test_minimum_python_and_links():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = project["requires-python"].removeprefix(">=")
    assert f"Python {minimum} or newer" in README
    assert "](docs/plan.png)" in README
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert ((ROOT / doc).parent / link).exists(), (doc, link)
    for page in ("docs/training.md", "docs/api.md", "docs/models.md"):
        assert f"]({page})" in README, page
