"""No tensor on an implicit device anywhere in fxshard/: users build models on ``meta`` and run
on ``cuda``, so a factory call that forgets ``device=`` lands on the CPU (or on whatever
``torch.set_default_device`` says) and breaks them, while CPU tests pass.

The scan reads every module's source (``ast``) and flags ``torch.<factory>(...)`` calls with no
``device=`` keyword. ``torch.tril``/``torch.triu`` and ``*_like``/``new_*`` take their device
from a tensor argument and are not factories here. A justified exception goes in ``ALLOWED``
with the reason.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fxshard")
FACTORIES = {"ones", "zeros", "full", "empty", "arange", "tensor", "as_tensor", "eye",
             "linspace", "logspace", "rand", "randn", "randint", "randperm", "empty_strided",
             "tril_indices", "triu_indices", "scalar_tensor"}
ALLOWED: dict[tuple[str, str], str] = {
    # (file relative to fxshard/, "torch.<name>") -> why the implicit device is right there
    ("models/llama.py", "torch.ones"): "a model's constructor, like nn.Linear's, builds its "
                                       "parameters on the default device, so that "
                                       "`with torch.device('meta')` builds it without memory",
}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if not (isinstance(func.value, ast.Name) and func.value.id == "torch"
                and func.attr in FACTORIES):
            continue
        if any(k.arg == "device" or k.arg is None for k in node.keywords):  # **kw may carry it
            continue
        out.append((node.lineno, f"torch.{func.attr}"))
    return out


def _sources():
    for base, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                yield os.path.relpath(path, ROOT), path


def test_the_scan_catches_what_it_should():
    bad = "import torch\nx = torch.ones(3)\ny = torch.arange(4, dtype=torch.long)\n" \
          "z = torch.zeros(2, device=w.device)\nq = torch.tril(x)\n"
    assert factory_calls_without_device(bad) == [(2, "torch.ones"), (3, "torch.arange")]


@pytest.mark.parametrize("rel,path", sorted(_sources()))
def test_no_factory_call_on_an_implicit_device(rel, path):
    with open(path) as f:
        found = factory_calls_without_device(f.read())
    bad = [f"{rel}:{line}: {name}(...) without device=" for line, name in found
           if (rel, name) not in ALLOWED]
    assert not bad, "\n".join(bad) + "\nPass device= (from the tensor the value is computed " \
                                     "for), or add a justified entry to ALLOWED"
