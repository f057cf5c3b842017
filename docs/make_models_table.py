"""The README's supported-models table, generated from the tests' model lists.

    python docs/make_models_table.py            # print the table
    python docs/make_models_table.py --write    # replace it in README.md
    python docs/make_models_table.py --check    # exit 1 if README.md's table is stale

A model is in the table when a test builds it: the builders of ``tests/families.py`` and
``tests/models.py`` (``hf_llama``, ``our_llama``) and the families of ``tests/test_generate.py``.
For each, the meshes come from the parametrizations of the tests that use it (a mesh dict such
as ``dict(tp=2, ring_cp=2)`` or a key into the test module's ``MESHES``): tests in
``tests/test_generate.py`` check greedy ``pm.generate`` against HuggingFace ``generate`` on one
device, every other test the forward against the single-device model. Run from the repository
root (it imports the test modules; transformers is not needed).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- models-table:start -->", "<!-- models-table:end -->"
AXES = {"dp": "dp", "tp": "tp", "pp": "pp", "ulysses_cp": "ulysses", "ulysess_cp": "ulysses",
        "ring_cp": "ring"}
BUNDLED = "fxshard.models.llama.LlamaForCausalLM"
# the order of the table's rows: Llama first, then by name
FIRST = ["LlamaForCausalLM", BUNDLED]


def _class_of(fn) -> str:
    if getattr(fn, "__name__", "") in ("our_llama", "_bundled"):
        return BUNDLED
    src = inspect.getsource(fn)
    m = re.search(r"T\.(\w+(?:ForCausalLM|LMHeadModel))\b", src) or \
        re.search(r"[\"'](\w+ForCausalLM)[\"']", src)
    if m:
        return m.group(1)
    if "LlamaForCausalLM" in src or "hf_llama" in src:
        return "LlamaForCausalLM"
    raise ValueError(f"docs/make_models_table.py: cannot tell the model class built by {fn}")


def _mesh_text(value) -> str | None:
    """``dict(tp=2, ring_cp=2)`` -> ``tp2·ring2``; anything that is not a mesh -> None."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], bool):
        value, sp = value                       # test_families' (axes, sequence_parallel)
        value = dict(value, sequence_parallel=sp)
    if not isinstance(value, dict) or not any(k in AXES for k in value):
        return None
    extra = {"sequence_parallel", "microbatches"}
    if set(value) - set(AXES) - extra or not all(
            type(v) is int for k, v in value.items() if k in AXES):
        return None
    order = list(dict.fromkeys(AXES.values()))
    axes = sorted(((AXES[k], v) for k, v in value.items() if k in AXES and v > 1),
                  key=lambda a: order.index(a[0]))
    if not axes:
        return None
    text = "·".join(f"{a}{v}" for a, v in axes)
    if value.get("sequence_parallel"):
        text += "+SP"
    if value.get("microbatches", 1) > 1:
        text += f" mb{value['microbatches']}"
    return text


def _params(fn) -> list[dict]:
    """Every combination's ``{argname: value}`` of ``fn``'s parametrize marks (cross product)."""
    combos = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) \
            else list(mark.args[0])
        rows = []
        for value in mark.args[1]:
            if type(value).__name__ == "ParameterSet":   # pytest.param(...)
                value = value.values
            vals = value if len(names) > 1 else (value,)
            if len(names) > 1 and len(vals) == 1 and isinstance(vals[0], tuple):
                vals = vals[0]
            rows.append(dict(zip(names, vals)))
        combos = [dict(c, **r) for c in combos for r in rows]
    return combos


def _meshes_of(module, params: dict) -> list[str]:
    axes = {k: v for k, v in params.items() if k in AXES and isinstance(v, int)}
    if axes:   # parametrized by axis sizes ("dp,tp"), with "sp" as sequence parallelism
        if isinstance(params.get("sp"), bool):
            axes["sequence_parallel"] = params["sp"]
        return [_mesh_text(axes)] if _mesh_text(axes) else []
    out = []
    for name, value in params.items():
        text = _mesh_text(value)
        if text is None and isinstance(value, str) and "mesh" in name:
            text = _mesh_text(getattr(module, "MESHES", {}).get(value))
        if text:
            out.append(text)
    return out


def _expand(module, params: dict) -> dict:
    """A parametrized case named by a key of a module-level table (``USP_MASKED["bloom-u2r2"]
    = ("bloom", dict(ulysses_cp=2, ring_cp=2), ...)``): its entries as more parameters."""
    out = dict(params)
    for name, value in params.items():
        if not isinstance(value, str):
            continue
        for table_name, table in vars(module).items():
            if table_name.isupper() and table_name not in ("MESHES", "FAMILIES") and \
                    isinstance(table, dict) and isinstance(table.get(value), tuple):
                out.update({f"{name}.{i}": v for i, v in enumerate(table[value])})
    return out


def _literal_meshes(fn) -> list[str]:
    """Meshes spelled out in ``fn``'s body: ``dict(tp=2, ring_cp=2)``, ``mesh(tp=2)``,
    ``{"tp": 2}`` or ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``."""
    try:
        tree = ast.parse(inspect.getsource(fn).lstrip())
    except (OSError, TypeError, SyntaxError):
        return []
    out = []
    for node in ast.walk(tree):
        value = None
        try:
            if isinstance(node, ast.Call) and any(k.arg in AXES for k in node.keywords):
                value = {k.arg: ast.literal_eval(k.value) for k in node.keywords
                         if k.arg in AXES or k.arg in ("microbatches", "sequence_parallel")}
            elif isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value in AXES for k in node.keys):
                value = ast.literal_eval(node)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == \
                    "init_device_mesh" and len(node.args) >= 2:
                names = [k.value for k in node.keywords if k.arg == "mesh_dim_names"]
                if names:
                    value = dict(zip(ast.literal_eval(names[0]),
                                     ast.literal_eval(node.args[1])))
        except (ValueError, TypeError, SyntaxError):
            continue
        text = _mesh_text(value) if isinstance(value, dict) else None
        if text:
            out.append(text)
    return out


def _referenced(fn, module=None) -> set[str]:
    """The names ``fn``'s source mentions, and those of the module's fixtures it takes."""
    try:
        tree = ast.parse(inspect.getsource(fn).lstrip())
    except (OSError, TypeError, SyntaxError):
        return set()
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for arg in inspect.signature(fn).parameters if module is not None else ():
        fixture = getattr(getattr(module, arg, None), "_get_wrapped_function", None)
        if fixture is not None:
            names |= _referenced(fixture())
    return names


def collect() -> dict[str, dict]:
    """``{model class: {"patterns": [...], "forward": {mesh}, "generate": {mesh}}}``."""
    sys.path.insert(0, str(ROOT))
    families = importlib.import_module("tests.families")
    models = importlib.import_module("tests.models")
    builders = {"hf_llama": models.hf_llama, "our_llama": models.our_llama}
    patterns: dict[str, list[str]] = {}
    for name, fn in vars(families).items():
        if inspect.isfunction(fn) and fn.__module__ == families.__name__ and \
                not name.startswith("_") and name not in ("collectives_by_kind",
                                                          "layer_param_fraction"):
            builders[name] = fn
    table: dict[str, dict] = {}

    def row(cls):
        return table.setdefault(cls, {"patterns": [], "forward": set(), "generate": set()})

    for name, (pattern, fn, *_rest) in families.FAMILIES.items():
        row(_class_of(fn))["patterns"].append(pattern)
    for name, fn in builders.items():
        doc = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        doc = doc.split(". ")[0].rstrip(".")
        if ": " in doc[16:]:   # "Gemma-2 with eager attention: scores ..." -> the part before
            doc = doc[:16 + doc[16:].index(": ")]
        doc = doc.replace("``", "`")
        if doc and name not in families.FAMILIES:
            row(_class_of(fn))["patterns"].append(doc)
    row("LlamaForCausalLM")["patterns"].insert(0, "the reference model: every axis and option")
    row(BUNDLED)["patterns"].insert(0, "plain Llama-3 with HuggingFace parameter names")
    generate_families = importlib.import_module("tests.test_generate").FAMILIES
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        module = importlib.import_module(f"tests.{path.stem}")
        for fname, fn in vars(module).items():
            if not (fname.startswith("test_") and inspect.isfunction(fn)):
                continue
            # generation: test_generate.py, and any test_generate*equal* test elsewhere
            kind = "generate" if path.stem == "test_generate" or (
                fname.startswith("test_generate") and "equal" in fname) else "forward"
            refs = _referenced(fn, module)
            literal = _literal_meshes(fn)
            for params in _params(fn) or [{}]:
                params = _expand(module, params)
                meshes = _meshes_of(module, params) or literal
                if not meshes:
                    continue
                models_here = {_class_of(b) for n, b in builders.items() if n in refs}
                for value in params.values():   # a family named by the parametrization
                    if isinstance(value, str) and kind == "forward" and \
                            value in families.FAMILIES and "FAMILIES" in refs:
                        models_here.add(_class_of(families.FAMILIES[value][1]))
                    if isinstance(value, str) and kind == "generate" and \
                            value in generate_families:
                        models_here.add(_class_of(generate_families[value]))
                    if isinstance(value, str) and value in builders and "getattr" in refs:
                        models_here.add(_class_of(builders[value]))
                    if callable(value) and getattr(value, "__name__", "") in builders:
                        models_here.add(_class_of(value))
                for cls in models_here:
                    row(cls)[kind].update(meshes)
    return table


def _order(mesh: str) -> tuple:
    return (mesh.count("·"), mesh)


def _cell(meshes: set[str]) -> str:
    """Up to 8 meshes in full; more as the single axes, a count and the largest ones."""
    if not meshes:
        return "-"
    ms = sorted(meshes, key=_order)
    if len(ms) <= 8:
        return ", ".join(ms)
    singles = [m for m in ms if "·" not in m]
    combos = [m for m in ms if "·" in m]
    widest = max(m.count("·") for m in combos)
    return (f"{', '.join(singles)} and {len(combos)} combinations, up to "
            f"{', '.join(m for m in combos if m.count('·') == widest)}")


def table() -> str:
    rows = collect()
    lines = ["| model | what it exercises | forward == one device on | greedy `generate` == "
             "HF on |", "|---|---|---|---|"]
    for cls in FIRST + sorted(set(rows) - set(FIRST)):
        if cls not in rows:
            continue
        r = rows[cls]
        name = f"`{cls}` (bundled)" if cls == BUNDLED else f"`{cls}`"
        what = "; ".join(dict.fromkeys(r["patterns"])) or "HuggingFace's default config"
        lines.append(f"| {name} | {what} | {_cell(r['forward'])} | {_cell(r['generate'])} |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"README.md has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str]) -> int:
    new = table()
    if "--write" in argv:
        text = README.read_text()
        head, rest = text.split(START, 1)
        README.write_text(f"{head}{START}\n{new}\n{END}{rest.split(END, 1)[1]}")
        return 0
    if "--check" in argv:
        if readme_table(README.read_text()) != new:
            print("README.md's models table is stale: python docs/make_models_table.py --write")
            return 1
        return 0
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
