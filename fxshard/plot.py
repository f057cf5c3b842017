"""``pm.explain().save("plan.svg")``: the plan as a picture, drawn with matplotlib.

Three panels, top to bottom:

    mesh       one box per rank at its mesh coordinates: rank, coordinates, pipeline stage,
               parameter bytes and the global index of the first weights it holds a slice of
               (``q_proj.weight[0:32, :]``)
    per layer  wire bytes one rank sends per forward, one bar per layer (and for the
               embedding and head), stacked by (op, axis); with pp, each stage's first rank
    schedule   the GPipe schedule: one row per stage, one box per microbatch per time step;
               the empty cells are the pipeline bubbles

matplotlib is an optional dependency (``pip install 'fxshard[plot]'``); text stays text in the
SVG (``svg.fonttype = none``) so the file can be searched. No pyplot: a ``Figure`` is drawn
and saved directly, so nothing global changes.
"""
from __future__ import annotations

import math
import re

__all__ = ["draw_plan", "layer_groups", "gpipe_schedule"]


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "fxshard.Explanation.save draws with matplotlib, which is not installed; "
            "pip install 'fxshard[plot]' (or pip install matplotlib)") from None
    return matplotlib, Figure


def layer_groups(explanation) -> dict[str, dict[tuple, int]]:
    """``{group: {(op, axis): wire bytes per forward}}`` of one rank's collectives, grouped by
    layer (``"layer 3"``) or, outside the layer stack, by module (``"embed_tokens"``); with
    pipeline stages, the first rank of each stage (together: every layer once)."""
    first = {}
    for r, s in sorted(explanation.stages.items()):
        first.setdefault(s, r)
    ranks = list(first.values()) or [0]
    groups: dict[str, dict[tuple, int]] = {}
    for c in (c for r in ranks for c in explanation.collectives[r]):
        if c.wire_bytes == 0:
            continue
        m = re.search(r"\.(\d+)(\.|$)", c.module)
        label = f"layer {m.group(1)}" if m else (c.module.split(".")[-1] or "other")
        key = (c.op, c.axis)
        g = groups.setdefault(label, {})
        g[key] = g.get(key, 0) + c.wire_bytes * explanation.microbatches
    return groups


def gpipe_schedule(stages: int, microbatches: int) -> list[tuple[int, int, int]]:
    """``(stage, microbatch, time step)`` of every forward step of a GPipe schedule: stage s
    runs microbatch i at step ``s + i``, so ``stages - 1`` steps of each row are bubbles."""
    return [(s, i, s + i) for s in range(stages) for i in range(microbatches)]


def _slice_text(fqn: str, index) -> str:
    dims = ", ".join(":" if s.start == 0 and s.stop is None else f"{s.start}:{s.stop}"
                     for s in index)
    return f"{'.'.join(fqn.split('.')[-2:])}[{dims}]"


def _mesh_grid(ex) -> tuple[int, int, list[tuple[int, int]]]:
    """Rows x columns for the rank boxes: the last mesh axis across, the others down."""
    cols = ex.mesh_shape[-1] if ex.mesh_shape else 1
    rows = max(1, ex.ranks // cols)
    return rows, cols, [(r // cols, r % cols) for r in range(ex.ranks)]


def _draw_mesh(ax, ex) -> None:
    rows, cols, cells = _mesh_grid(ex)
    colors = ["#dbe9f6", "#fde2c8", "#d9f0d3", "#eadcf0", "#f6d8dc", "#f0ecd0"]
    for r, (y, x) in enumerate(cells):
        coords = _coords(ex, r)
        stage = ex.stages.get(r, 0)
        ax.add_patch(_rect((x + 0.04, rows - 1 - y + 0.04), 0.92, 0.92,
                           colors[stage % len(colors)]))
        lines = [f"rank {r}", " ".join(f"{a}={c}" for a, c in zip(ex.axis_names, coords)),
                 f"stage {stage}, {ex.param_bytes[r] / 2**20:.2f} MiB params"]
        lines += [_slice_text(fqn, index) for fqn, index in ex.slices.get(r, [])]
        ax.text(x + 0.5, rows - 1 - y + 0.5, "\n".join(lines), ha="center", va="center",
                fontsize=7, family="monospace")
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_axis_off()
    ax.set_title(f"Mesh {ex.mesh}: the weight slices each rank holds", fontsize=10)


def _coords(ex, rank: int) -> tuple[int, ...]:
    out = []
    for n in reversed(ex.mesh_shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def _rect(xy, w, h, color):
    from matplotlib.patches import Rectangle
    return Rectangle(xy, w, h, facecolor=color, edgecolor="#555555", linewidth=0.8)


def _draw_layers(ax, ex) -> None:
    groups = layer_groups(ex)
    labels = list(groups)
    kinds = sorted({k for g in groups.values() for k in g})
    bottom = [0.0] * len(labels)
    for kind in kinds:
        values = [groups[g].get(kind, 0) / 2**10 for g in labels]
        ax.bar(range(len(labels)), values, bottom=bottom, label=f"{kind[0]} {kind[1]}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax.set_ylabel("KiB sent per forward", fontsize=8)
    ax.set_title("Collectives per layer: bytes one rank sends per forward, by op and axis",
                 fontsize=10)
    if kinds:
        ax.legend(fontsize=7, ncols=min(4, len(kinds)))
    else:
        ax.text(0.5, 0.5, "no collectives", ha="center", va="center", transform=ax.transAxes)


def _draw_schedule(ax, ex) -> None:
    stages = max(ex.stages.values(), default=0) + 1
    m = ex.microbatches
    steps = stages + m - 1
    for s, i, t in gpipe_schedule(stages, m):
        ax.add_patch(_rect((t + 0.05, stages - 1 - s + 0.1), 0.9, 0.8,
                           f"C{i % 10}"))
        ax.text(t + 0.5, stages - 1 - s + 0.5, f"mb {i}", ha="center", va="center",
                fontsize=8, color="white")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 1 - s + 0.5 for s in range(stages)],
                  [f"stage {s}" for s in range(stages)], fontsize=8)
    ax.set_xticks([t + 0.5 for t in range(steps)], [str(t) for t in range(steps)], fontsize=7)
    ax.set_xlabel("time step (one microbatch forward per stage)", fontsize=8)
    bubble = (stages - 1) / steps
    ax.set_title(f"GPipe schedule: {stages} stages x {m} microbatches, bubble "
                 f"{bubble:.0%} of each stage's time", fontsize=10)


def draw_plan(ex, path: str) -> str:
    """Draw ``ex`` (an :class:`fxshard.explain.Explanation`) to ``path``; see the module doc."""
    matplotlib, Figure = _matplotlib()
    rows = _mesh_grid(ex)[0]
    stages = max(ex.stages.values(), default=0) + 1
    heights = [max(2.0, 1.3 * rows), 2.6, max(1.2, 0.6 * stages)]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "fxshard"}):
        fig = Figure(figsize=(max(8.0, 2.6 * _mesh_grid(ex)[1]), sum(heights) + 1.5),
                     layout="constrained")
        axes = fig.subplots(3, 1, height_ratios=heights)
        _draw_mesh(axes[0], ex)
        _draw_layers(axes[1], ex)
        _draw_schedule(axes[2], ex)
        fig.suptitle(f"fxshard plan, mesh {ex.mesh}, {ex.ranks} ranks, "
                     f"{ex.total_param_bytes / 2**20:.2f} MiB parameters", fontsize=11)
        fig.savefig(path, metadata={"Date": None} if str(path).endswith(".svg") else None)
    return path
