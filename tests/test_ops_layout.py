"""The layout of ops and kernels: every ``torch.library`` op of fxshard is defined in
``fxshard/ops/``, ``fxshard/kernels/`` imports nothing else of fxshard, and ``fxshard/ops/``
imports only kernels, the runtime's backend context and itself (no import runs back up)."""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxshard
from fxshard.ops.library import direct_kernel

PACKAGE = Path(fxshard.__file__).resolve().parent
ROOT = PACKAGE.parent


def _fxshard_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, name)`` of every fxshard name ``path`` imports (relative imports resolved;
    ``from m import x`` gives ``m.x``), at any depth (imports inside functions included)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "fxshard"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.split(".")[0] == "fxshard":
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return sorted(found)


def _violations(folder: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / folder).glob("*.py")):
        for line, module in _fxshard_imports(path):
            if not any(module == a or module.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_kernels_import_nothing_of_fxshard_outside_kernels():
    assert _violations("kernels", ("fxshard.kernels",)) == []


def test_ops_import_only_kernels_the_backend_context_and_ops():
    assert _violations("ops", ("fxshard.ops", "fxshard.kernels", "fxshard.runtime.context")) == []


def test_the_import_scan_sees_relative_and_lazy_imports(tmp_path):
    kernels = tmp_path / "fxshard" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "bad.py").write_text("from ..runtime.library import define_op\n"
                                    "def f():\n    from fxshard import ops\n"
                                    "from . import triton_attention\n")
    assert _fxshard_imports(kernels / "bad.py", tmp_path) == [
        (1, "fxshard.runtime.library.define_op"), (3, "fxshard.ops"),
        (4, "fxshard.kernels.triton_attention")]


KERNELS = sorted(p.stem for p in (PACKAGE / "kernels").glob("*.py") if p.stem != "__init__")
TRITON_KERNELS = [name for name in KERNELS if name.startswith("triton_")]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _import_with_the_rest_blocked(modules: list[str], *, block_triton: bool) -> list[str]:
    """In a fresh interpreter where every fxshard module outside ``fxshard.kernels`` fails to
    import (``fxshard`` itself a bare namespace; ``triton`` too with ``block_triton``), import
    ``fxshard.kernels.<m>`` for each of ``modules`` and run the torch paths; the fxshard
    modules then loaded."""
    code = f"""
import importlib, importlib.abc, sys, types
import torch

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("fxshard.") and not name.startswith("fxshard.kernels"):
            raise ImportError("blocked: " + name)
        return None

if {block_triton!r}:
    sys.modules["triton"] = None
package = types.ModuleType("fxshard")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["fxshard"] = package
sys.meta_path.insert(0, Block())
for name in {modules!r}:
    importlib.import_module("fxshard.kernels." + name)
from fxshard.kernels import attention, decode_attention
q = torch.randn(1, 2, 3, 16)
out, lse = attention(q, q, q, causal=True, backend="torch")
out, lse = decode_attention(q, q, q, torch.tensor([3]), backend="torch")
assert not hasattr(torch.ops.fxshard, "attention_out")   # no op was registered
print("ok", sorted(m for m in sys.modules if m.startswith("fxshard")))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = eval(proc.stdout.split("ok", 1)[1])
    assert all(m == "fxshard" or m.startswith("fxshard.kernels") for m in loaded), loaded
    return loaded


def test_kernel_modules_import_with_the_rest_of_fxshard_and_triton_blocked():
    """Every kernels module but the Triton ones imports, and the torch paths run, with the
    rest of fxshard and triton itself unimportable (installed or not)."""
    torch_only = [name for name in KERNELS if name not in TRITON_KERNELS]
    assert {"attention", "decode"} <= set(torch_only) and TRITON_KERNELS, KERNELS
    loaded = _import_with_the_rest_blocked(torch_only, block_triton=True)
    assert {f"fxshard.kernels.{name}" for name in torch_only} <= set(loaded)
    assert not any(m.startswith("fxshard.kernels.triton_") for m in loaded), loaded


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the gpu extra: "
                                           "pip install -e '.[test,gpu]', as .ci/run does)")
def test_triton_kernel_modules_import_with_the_rest_of_fxshard_blocked():
    loaded = _import_with_the_rest_blocked(TRITON_KERNELS, block_triton=False)
    assert {f"fxshard.kernels.{name}" for name in TRITON_KERNELS} <= set(loaded), loaded


def test_every_op_is_defined_in_ops():
    """No module outside ``fxshard/ops/`` defines or registers a ``torch.library`` op."""
    markers = ("define_op(", "torch.library.Library(", "register_fake", "custom_op(",
               "register_kernel(", "_register_effectful_op(")
    bad = [f"{path.relative_to(ROOT)}: {marker}" for path in sorted(PACKAGE.rglob("*.py"))
           if path.relative_to(PACKAGE).parts[0] != "ops"
           for marker in markers if marker in path.read_text()]
    assert bad == []


def test_importing_fxshard_registers_every_op_with_a_fake_and_a_direct_kernel():
    names = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "local_shard", "send",
             "recv", "vocab_embedding", "partial_from_replicate", "zigzag_shard",
             "zigzag_gather", "attention", "attention_out", "ring_attention", "cache_write",
             "decode_attention", "merge_pieces", "sharded_argmax"}
    for name in names:
        op = getattr(torch.ops.fxshard, name).default
        assert callable(direct_kernel(op)), name
        assert torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel, name
