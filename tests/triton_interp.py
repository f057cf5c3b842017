"""Run a test file's ``triton_interp`` tests under Triton's CPU interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is imported), and check its tally."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BF16_DOT_BUG = pytest.mark.xfail(
    strict=True, reason="Triton's interpreter multiplies the raw bit patterns of bfloat16 tl.dot "
                        "operands (triton-lang/triton#11584, unsupported upstream); bf16 is "
                        "checked on the GPU by benchmarks/gpu_check.py and benchmarks/attention.py")


def run_interpreter_tests(test_file: str, *, min_passed: int, xfailed: int) -> None:
    """All of ``test_file``'s ``triton_interp`` tests pass (``xfailed`` of them are expected
    failures of the interpreter itself): at least ``min_passed`` pass, none fails or skips."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process already interprets Triton; the interpreter tests run here")
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-o", "addopts=", "-q", "-p",
         "no:cacheprovider", "-k", "triton_interp"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    counts = {word: int(n) for n, word in
              re.findall(r"(\d+) (\w+)", proc.stdout.strip().splitlines()[-1])}
    assert counts.get("passed", 0) >= min_passed and counts.get("xfailed") == xfailed, report
    assert not {"failed", "error", "errors", "skipped"} & counts.keys(), report
