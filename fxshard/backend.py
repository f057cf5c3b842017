"""``torch.compile(model, backend=fxshard.backend(mesh))``: the same passes behind compile.

Dynamo hands a backend one FX graph per captured region, with the model's parameters and
buffers *lifted* to graph inputs. The backend maps those inputs back to the model's FQNs (from
dynamo's input sources) and wraps the graph in a module that holds them again as parameters
and buffers under those names, so ``fxshard.parallelize`` plans it exactly as it plans the model:
same tensor-parallel plan, same collectives, each rank holding only its slices; ``dp``/CP split
only the user's inputs::

    before (dynamo):  forward(l_self_modules_lm_head_parameters_weight_, l_input_ids_, ...)
    after (wrapper):  forward(input_ids)      # self.lm_head.weight = that Parameter

A new input shape retraces: dynamo's dynamic graph (``SymInt`` inputs) is parallelized per
concrete input signature at call time, as ``parallelize`` does without example inputs. Graph
breaks give one parallelized program per region. ``compile=True`` (the default here) compiles
each stage's rank program with Inductor.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
from .mesh import PP

__all__ = ["backend"]

_WHERE = "fxshard.backend"
# L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight'], or with
# the module reached through an argument list (HF's decorated forward): L['args'][0]._modules...
_STATE_SOURCE = re.compile(r"^[LG]\['[^']+'\](?:\[\d+\]|\['[^']+'\])*((?:\._modules\['[^']+'\]|\.[A-Za-z_]\w*)*)"
                           r"\._(parameters|buffers)\['([^']+)'\]$")
_PART = re.compile(r"\._modules\['([^']+)'\]|\.([A-Za-z_]\w*)")


def _state_fqn(node: fx.Node, value) -> tuple[str, str] | None:
    """``(kind, fqn)`` of a lifted parameter or buffer placeholder, else ``None`` (an input)."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = source.name if isinstance(getattr(source, "name", None), str) else \
        (source.name() if source is not None else "")
    m = _STATE_SOURCE.match(name)
    if m:
        path = [a or b for a, b in _PART.findall(m.group(1))]
        kind = "param" if m.group(2) == "parameters" else "buffer"
        return kind, ".".join([*path, m.group(3)])
    if isinstance(value, torch.nn.Parameter):
        # a parameter reached some other way (a closure, a global): keep it a parameter
        return "param", node.name.removeprefix("l_").rstrip("_") or node.name
    return None


class _Region(torch.nn.Module):
    """One dynamo graph with its lifted state held again as parameters/buffers under the
    model's FQNs; ``forward`` takes only the user's inputs (tensors and ints)."""

    def __init__(self, gm: fx.GraphModule, layout: list, state: dict):
        super().__init__()
        object.__setattr__(self, "_graph", gm)   # not a submodule: keeps the FQNs clean
        self._layout = layout                    # per graph input: ("state", fqn) | ("input", i)
        for fqn, (kind, value) in state.items():
            owner_path, _, leaf = fqn.rpartition(".")
            owner = self
            for part in owner_path.split(".") if owner_path else []:
                if part not in owner._modules:
                    owner.add_module(part, torch.nn.Module())
                owner = owner._modules[part]
            if kind == "param":
                owner.register_parameter(leaf, value if isinstance(value, torch.nn.Parameter)
                                         else torch.nn.Parameter(value, requires_grad=False))
            else:
                owner.register_buffer(leaf, value)
        self._state = {fqn: kind for fqn, (kind, _) in state.items()}

    def forward(self, *inputs):
        values = dict(self.named_parameters(remove_duplicate=False))
        values.update(self.named_buffers(remove_duplicate=False))
        args = [values[ref] if kind == "state" else inputs[ref] for kind, ref in self._layout]
        return self._graph(*args)


def _scalars_as_numbers(gm: fx.GraphModule) -> set[int]:
    """Positions (among the placeholders) of the Python numbers dynamo passes as 0-d tensors
    (``dynamic=True`` does so for float attributes: ``config.rope_theta``, an RMSNorm's
    epsilon, attention's ``scaling``) and reads back with ``.item()``. Each takes the number
    itself instead (its ``.item()`` calls go): export specialises a number, so the program is
    one per value (as per shape), where a traced ``.item()`` would be data-dependent."""
    out = set()
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        arg = node.meta.get("grapharg")
        if not getattr(arg, "pass_arg_as_tensor", False) or not node.users or not all(
                u.op == "call_method" and u.target == "item" for u in node.users):
            continue
        for use in list(node.users):
            use.replace_all_uses_with(node)
            gm.graph.erase_node(use)
        out.add(i)
    if out:
        gm.recompile()
    return out


def _lift(gm: fx.GraphModule, example_inputs) -> tuple[_Region, list[int]]:
    """The region module and, per user input, its position among the graph's inputs."""
    if next(gm.parameters(), None) is not None:
        raise NotImplementedError(
            f"{_WHERE}: the graph handed to the backend holds parameters as attributes "
            f"({next(n for n, _ in gm.named_parameters())!r} ...); fxshard shards parameters "
            f"that dynamo lifted to graph inputs (what torch.compile does). For a GraphModule "
            f"of your own use fxshard.parallelize(gm, mesh)")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(f"{_WHERE}: dynamo gave {len(example_inputs)} example inputs for a "
                         f"graph with {len(placeholders)} placeholders")
    layout, state, user = [], {}, []
    for node, value in zip(placeholders, example_inputs):
        found = _state_fqn(node, value) if isinstance(value, torch.Tensor) else None
        if found is None:
            layout.append(("input", len(user)))
            user.append(len(layout) - 1)
            continue
        kind, fqn = found
        state.setdefault(fqn, (kind, value))
        layout.append(("state", fqn))
    return _Region(gm, layout, state), user


def _is_symbolic(x) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)


def backend(mesh, **options):
    """A ``torch.compile`` backend that parallelizes each captured graph over ``mesh``.

    ``options`` are those of :func:`fxshard.parallelize` (``plan``, ``sequence_parallel``,
    ``compile`` ...); ``compile`` defaults to ``True`` here (Inductor compiles each rank
    program). The returned callable of each region has ``.parallel_module``, the
    :class:`~fxshard.ParallelModule` that runs it (``explain()``, ``rank_module(r)``).
    A ``pp`` axis is not supported behind dynamo (the captured graph has no layer modules to
    cut into stages): a ``NotImplementedError`` says to use :func:`fxshard.parallelize`.
    """
    from .api import parallelize
    from .mesh import mesh_spec
    spec = mesh_spec(mesh, where=_WHERE)
    if "example_inputs" in options or "example_kwargs" in options:
        raise TypeError(f"{_WHERE}: example_inputs/example_kwargs come from torch.compile; "
                        f"do not pass them")
    options.setdefault("compile", True)
    _check_options(options)

    def compile_fn(gm: fx.GraphModule, example_inputs):
        if spec.axis_size(PP) > 1:
            raise NotImplementedError(
                f"{_WHERE}: mesh {spec.describe()} has a pp axis of size "
                f"{spec.axis_size(PP)}; pipeline stages need the model's layer modules, which "
                f"a torch.compile graph no longer has: use fxshard.parallelize(model, mesh)")
        scalars = _scalars_as_numbers(gm)
        region, user = _lift(gm, list(example_inputs))
        example = [example_inputs[i] for i in user]
        static = not scalars and not any(_is_symbolic(x) for x in example)
        pm = parallelize(region, mesh, example_inputs=tuple(example) if static else None,
                         **options)

        def run(*args):
            # inference: a dynamo graph's backward does not come through here
            out = pm.infer(*[args[i].item() if i in scalars else args[i] for i in user])
            return out if isinstance(out, (tuple, list)) else (out,)
        run.parallel_module = pm
        return run

    return compile_fn


def _check_options(options: dict) -> None:
    """The options' names and values, now rather than at the first call inside dynamo."""
    import inspect

    from .api import parallelize
    from .checks import check_parallelize_args
    from .passes import PLAN_STYLES
    params = inspect.signature(parallelize).parameters
    valid = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY
             and n not in ("example_inputs", "example_kwargs")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"{_WHERE}: unknown option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(unknown)}; the options are fxshard.parallelize's: "
                        f"{', '.join(valid)}")
    values = {n: params[n].default for n in valid} | options
    if not isinstance(values["compile"], bool):
        raise TypeError(f"{_WHERE}: compile={values['compile']!r}; pass True (Inductor-compiled "
                        f"rank programs, the default here) or False")
    from .mixed_precision import check_policy
    check_policy(_WHERE, values["mixed_precision"])
    check_parallelize_args(_WHERE, model=torch.nn.Module(), example_inputs=None,
                           example_kwargs=None, styles=PLAN_STYLES,
                           **{n: v for n, v in values.items()
                              if n not in ("compile", "mixed_precision")})
