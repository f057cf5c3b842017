"""Packaging: what pyproject.toml promises (runtime dependencies, optional triton, SPDX
license) and that fxshard imports and runs without triton."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_dependencies_license_and_extras():
    project = _project()
    deps = project["dependencies"]
    assert any(d.startswith("safetensors") for d in deps)
    assert not any(d.startswith(("numpy", "triton")) for d in deps), deps
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    extras = project["optional-dependencies"]
    assert extras["plot"] == ["matplotlib"] and "matplotlib" in extras["test"]
    # triton only in gpu, and only where its wheels exist; test installs without it
    triton = [d for d in extras["gpu"] if d.startswith("triton")]
    assert triton and "sys_platform == 'linux'" in triton[0], extras["gpu"]
    assert not any(d.startswith("triton") for d in extras["test"]), extras["test"]
    assert not any(d.startswith("triton") for d in extras["plot"]), extras["plot"]


def test_ci_installs_triton_for_the_interpreter_tests():
    """CI runs the Triton-interpreter tests: its install names the gpu extra and it checks
    triton imports before the README's test command."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[test,gpu]"' in ci and 'import triton' in ci, ci
    assert "python -m pytest -q" in ci


def test_fxshard_imports_no_numpy_and_triton_lazily():
    for path in (ROOT / "fxshard").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "numpy" for n in names), path
            if any(n.split(".")[0] == "triton" for n in names):
                # the kernel modules, imported on first use only
                assert path.name in ("triton_attention.py", "triton_attention_bwd.py",
                                     "triton_decode.py", "triton_softmax.py"), path


def test_runs_without_triton():
    code = ("import sys\nsys.modules['triton'] = None\n"
            "import torch, fxshard\nfrom tests.models import our_llama\n"
            "torch.set_grad_enabled(False)\n"   # inference (with grad enabled pm(x) trains)
            "model = our_llama(num_hidden_layers=1)\n"
            "mesh = fxshard.init_device_mesh('cpu', (2,), mesh_dim_names=('ring_cp',))\n"
            "ids = torch.randint(0, 128, (1, 8))\n"
            "pm = fxshard.parallelize(model, mesh)\n"
            "torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
