"""``fxshard.plan``: every mesh of ``devices`` devices, costed, ranked, and the rest explained.

::

    with fxshard.init_empty_weights():
        model = LlamaForCausalLM(config)
    p = fxshard.plan(model, devices=64, hardware="h100", batch=256, seq=8192,
                     mixed_precision="bf16")
    best = p[0]                    # an Estimate: .mesh, .options, .memory, .step_time, ...
    p.rejected                     # [(mesh, options, why)] for every configuration ruled out
    print(p)

Candidates: every factorization of ``devices`` over ``dp``, ``fsdp``, ``pp``, ``ring_cp`` and
``tp`` (``ulysses_cp`` and larger context-parallel sizes only when ``seq`` is long, see
``max_cp``), with ``pp`` tried at ``microbatches`` = 2 x pp and 4 x pp (1F1B),
``recompute="layers"`` tried when a configuration does not fit without it. Ruled out before any
program is built, with the reason: ``tp`` beyond the KV heads or not dividing the heads, ``tp``
beyond a node (``max_tp`` defaults to ``devices_per_node``), a batch that does not divide over
the data-parallel ranks and microbatches, a sequence that does not divide over the
context-parallel ranks, more stages than layers; after costing: does not fit in memory; and
any configuration fxshard itself refuses (its error).

Fast: the layers of a stack are alike, so each candidate is priced from the programs of a
one-layer copy of the model (:mod:`fxshard.plan.units`); those programs depend only on the tp
and context-parallel sizes, whether dp / fsdp are on, sequence parallelism and recompute, so a
search builds a handful (``Plan.programs_built``) however many meshes it prices.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..mesh import DP, FSDP, PP, RING, TP, ULYSSES
from .estimate import Estimate, _hardware, estimate
from .units import layer_stack

__all__ = ["Plan", "plan"]

_WHERE = "fxshard.plan"
# nesting order of a candidate's axes, outermost first: tp innermost (inside a node), then
# the context-parallel axes, then pp, fsdp, dp across nodes
ORDER = (DP, FSDP, PP, RING, ULYSSES, TP)


@dataclass
class Plan:
    """Candidates ranked by predicted tokens/s per device (best first), and what was ruled
    out (``rejected``: ``(mesh, options, why)``)."""

    candidates: list
    rejected: list = field(default_factory=list)
    programs_built: int = 0
    hardware: str = ""

    def __getitem__(self, i) -> Estimate:
        return self.candidates[i]

    def __len__(self) -> int:
        return len(self.candidates)

    def __str__(self) -> str:
        return self.table()

    def table(self, top: int = 10, rejected: int = 20) -> str:
        gib = 2 ** 30
        lines = [f"fxshard.plan on {self.hardware}: {len(self.candidates)} configurations "
                 f"fit, {len(self.rejected)} ruled out ({self.programs_built} one-layer "
                 f"programs built)", "",
                 f"{'#':>3}  {'mesh':34s} {'options':28s} {'tok/s/dev':>10s} "
                 f"{'step s':>8s} {'comm':>6s} {'bubble':>6s} {'GiB':>6s}  MFU"]
        for i, e in enumerate(self.candidates[:top]):
            mesh = ",".join(f"{a}={n}" for a, n in e.mesh.items() if n > 1) or "(1 device)"
            opts = []
            if e.options.get("sequence_parallel"):
                opts.append("sp")
            if e.options.get("microbatches", 1) > 1:
                opts.append(f"m={e.options['microbatches']}")
            if e.options.get("recompute"):
                opts.append("recompute")
            t = e.step_time
            lines.append(f"{i + 1:>3}  {mesh:34s} {' '.join(opts):28s} "
                         f"{e.tokens_per_second_per_device:>10,.0f} {t['total']:>8.3f} "
                         f"{t.get('exposed_comm', 0):>6.3f} {t.get('bubble', 0):>6.3f} "
                         f"{e.memory['peak'] / gib:>6.1f}  {e.mfu:.1%}")
        if self.rejected:
            lines += ["", f"Ruled out ({len(self.rejected)}; first {min(rejected, len(self.rejected))}):"]
            for mesh, opts, why in self.rejected[:rejected]:
                text = ",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "(1 device)"
                extra = f" {opts}" if opts else ""
                lines.append(f"  {text}{extra}: {why}")
        return "\n".join(lines)


def _factorizations(n: int, k: int):
    """Every ``k``-tuple of positive ints whose product is ``n``."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d, *rest)


def plan(model, *, devices: int, hardware="h100", batch: int, seq: int, training: bool = True,
         mixed_precision=None, optimizer: str = "adamw", max_tp: int | None = None,
         max_pp: int | None = None, max_cp: int | None = None, axes: tuple | None = None,
         recompute: bool = True) -> Plan:
    """Rank every configuration of ``devices`` devices for ``model`` (built on ``meta``) by
    predicted tokens/s per device (module docstring). Constraints: ``max_tp`` (default: a
    node's devices), ``max_pp``, ``max_cp`` (context-parallel ranks; default 1 below 32k
    tokens, else 8), ``axes`` (the axes to consider; default dp, fsdp, pp, ring_cp, tp),
    ``recompute`` (try ``recompute="layers"`` for configurations that do not fit)."""
    hw = _hardware(hardware)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"{_WHERE}: devices={devices!r}; use an int >= 1")
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    _, n_layers = layer_stack(model)
    max_tp = max_tp or hw.devices_per_node
    max_pp = max_pp or n_layers
    max_cp = max_cp if max_cp is not None else (1 if seq < 32768 else 8)
    names = tuple(a for a in ORDER if a in (axes or (DP, FSDP, PP, RING, TP)))
    units: dict = {}
    fits, rejected = [], []
    for sizes in _factorizations(devices, len(names)):
        mesh = dict(zip(names, sizes))
        tp, pp = mesh.get(TP, 1), mesh.get(PP, 1)
        cp = mesh.get(RING, 1) * mesh.get(ULYSSES, 1)
        why = None
        if tp > max_tp:
            why = f"tp={tp} > max_tp={max_tp} (tp beyond a node's {hw.devices_per_node} devices)"
        elif heads and heads % tp:
            why = f"tp={tp} does not divide the {heads} attention heads"
        elif kv_heads and tp > kv_heads:
            why = f"tp={tp} beyond the {kv_heads} KV heads (each KV head would be replicated)"
        elif pp > max_pp:
            why = f"pp={pp} > max_pp={max_pp}" + (f" ({n_layers} layers)" if pp > n_layers
                                                   else "")
        elif cp > max_cp:
            why = f"context-parallel {cp} > max_cp={max_cp} (seq={seq})"
        if why:
            rejected.append((mesh, {}, why))
            continue
        for m in ([2 * pp, 4 * pp] if pp > 1 else [1]) if training else [1]:
            opts = {"microbatches": m} if pp > 1 else {}
            data = mesh.get(DP, 1) * mesh.get(FSDP, 1)
            if batch % (data * m):
                rejected.append((mesh, opts, f"batch={batch} does not divide over dp x fsdp x "
                                             f"microbatches = {data * m}"))
                continue
            tries = [None, "layers"] if (recompute and training) else [None]
            for rc in tries:
                o = dict(opts, recompute=rc) if rc else opts
                try:
                    e = estimate(model, mesh, hardware=hw, batch=batch, seq=seq,
                                 training=training, mixed_precision=mixed_precision,
                                 optimizer=optimizer, microbatches=m, recompute=rc,
                                 _units=units)
                except (ValueError, NotImplementedError) as err:
                    rejected.append((mesh, o, str(err).splitlines()[0][:300]))
                    break
                if e.fits:
                    fits.append(e)
                    break
                gib = 2 ** 30
                rejected.append((mesh, o, f"does not fit: {e.memory['peak'] / gib:.1f} GiB "
                                          f"peak > {e.memory['capacity'] / gib:.1f} GiB usable"))
    fits.sort(key=lambda e: -e.tokens_per_second_per_device)
    return Plan(fits, rejected, programs_built=sum(not isinstance(u, Exception) for u in
                                                 units.values()), hardware=hw.name)
