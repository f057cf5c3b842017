"""``pm.explain().save("plan.svg")``: the plan as a picture, drawn with matplotlib.

Three panels, top to bottom:

    mesh       one box per rank at its mesh coordinates: rank, coordinates, pipeline stage and
               its layers, parameter bytes, the global index of the first weights it holds a
               slice of (``layer 0 q_proj.weight[0:32, :]``) and ``+N more weights``; the box's
               colour is its stage (``STAGE_COLORS``)
    per layer  wire bytes per forward, one group per layer (and per embedding, head, pipeline
               transfer ``pp 0->1`` and the output gather), two bars each: what one rank sends
               and what it receives, stacked by collective; the colour is the collective's
               (``OP_COLORS``, the same in every picture), the hatch the mesh axis
               (``AXIS_HATCHES``); with pp, each stage's first rank (together: every layer once)
    schedule   (with pp) the GPipe schedule: one row per stage, one box per microbatch per time step in
               the stage's colour; the empty, hatched cells are the pipeline bubbles

matplotlib is an optional dependency (``pip install 'fxshard[plot]'``); text stays text in the
SVG (``svg.fonttype = none``) so the file can be searched. No pyplot: a ``Figure`` is drawn
and saved directly, so nothing global changes.
"""
from __future__ import annotations

import re
from .mesh import DP, FSDP, PP, RING, TP, ULYSSES

__all__ = ["draw_plan", "layer_groups", "gpipe_schedule", "OP_COLORS", "AXIS_HATCHES",
           "STAGE_COLORS"]

# one colour per collective in every picture (saturated; the stages' pastels are not among them)
OP_COLORS = {
    "all_reduce": "#2e7d32",      # green
    "all_gather": "#1565c0",      # blue
    "reduce_scatter": "#ef6c00",  # orange
    "all_to_all": "#6a1b9a",      # purple
    "send": "#c62828",            # red
    "recv": "#ad1457",            # magenta
    "ring_attention": "#00838f",  # teal
    "zigzag_gather": "#9e9d24",   # olive
    "sharded_argmax": "#5d4037",  # brown
}
AXIS_HATCHES = {TP: "", DP: "///", FSDP: "ooo", PP: "...", ULYSSES: "xxx", RING: "\\\\\\"}
# pipeline stages: the mesh boxes and the schedule's rows (pastel: never a collective's colour)
STAGE_COLORS = ["#dbe9f6", "#fde2c8", "#d9f0d3", "#eadcf0", "#f6d8dc", "#f0ecd0", "#d0ecec",
                "#e6e6e6"]
_GATHERS = ("all_gather", "zigzag_gather")


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "fxshard.Explanation.save draws with matplotlib, which is not installed; "
            "pip install 'fxshard[plot]' (or pip install matplotlib)") from None
    return matplotlib, Figure


def _group_of(c, stage: int) -> str:
    """The x-axis group of one collective: its layer, its module, the pipeline transfer it
    belongs to, or the gather of the model's output (the only collective outside modules)."""
    if c.op in ("send", "recv") and c.peer >= 0:
        src, dst = (stage, c.peer) if c.op == "send" else (c.peer, stage)
        return f"pp {src}->{dst}"
    m = re.search(r"\.(\d+)(\.|$)", c.module)
    if m:
        return f"layer {m.group(1)}"
    if c.module:
        return c.module.split(".")[-1]
    return "output gather" if c.op in _GATHERS else f"{c.op} outside modules"


def layer_groups(explanation, direction: str = "sent") -> dict[str, dict[tuple, int]]:
    """``{group: {(op, axis): wire bytes per forward}}`` that one rank sends (``direction=
    "sent"``) or receives (``"received"``), grouped by layer (``"layer 3"``), by module outside
    the layer stack (``"embed_tokens"``), by pipeline transfer (``"pp 0->1"``) or as the
    ``"output gather"``; with pipeline stages, the first rank of each stage (together: every
    layer once). A ring collective receives what it sends; ``send`` only sends, ``recv`` only
    receives."""
    if direction not in ("sent", "received"):
        raise ValueError(f"fxshard.plot.layer_groups: direction={direction!r}; expected "
                         f"'sent' or 'received'")
    first = {}
    for r, s in sorted(explanation.stages.items()):
        first.setdefault(s, r)
    ranks = list(first.values()) or [0]
    skip = "recv" if direction == "sent" else "send"
    groups: dict[str, dict[tuple, int]] = {}
    for r in ranks:
        for c in explanation.collectives[r]:
            if c.wire_bytes == 0 or c.op == skip:
                continue
            g = groups.setdefault(_group_of(c, explanation.stages.get(r, 0)), {})
            key = (c.op, c.axis)
            g[key] = g.get(key, 0) + c.wire_bytes * explanation.microbatches
    return groups


def gpipe_schedule(stages: int, microbatches: int) -> list[tuple[int, int, int]]:
    """``(stage, microbatch, time step)`` of every forward step of a GPipe schedule: stage s
    runs microbatch i at step ``s + i``, so ``stages - 1`` steps of each row are bubbles."""
    return [(s, i, s + i) for s in range(stages) for i in range(microbatches)]


def _slice_text(fqn: str, index) -> str:
    dims = ", ".join(":" if s.start == 0 and s.stop is None else f"{s.start}:{s.stop}"
                     for s in index)
    m = re.search(r"\.(\d+)\.", fqn)
    where = f"layer {m.group(1)} " if m else ""
    return f"{where}{'.'.join(fqn.split('.')[-2:])}[{dims}]"


def _mesh_grid(ex) -> tuple[int, int, list[tuple[int, int]]]:
    """Rows x columns for the rank boxes: the last mesh axis across, the others down."""
    cols = ex.mesh_shape[-1] if ex.mesh_shape else 1
    rows = max(1, ex.ranks // cols)
    return rows, cols, [(r // cols, r % cols) for r in range(ex.ranks)]


def _stage_text(ex, stage: int) -> str:
    lo, hi = ex.stage_layers().get(stage, (None, None))
    layers = "" if lo is None else f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
    if max(ex.stages.values(), default=0) == 0:
        return layers
    return f"stage {stage}: {layers}" if layers else f"stage {stage}"


def _draw_mesh(ax, ex) -> None:
    rows, cols, cells = _mesh_grid(ex)
    for r, (y, x) in enumerate(cells):
        stage = ex.stages.get(r, 0)
        ax.add_patch(_rect((x + 0.04, rows - 1 - y + 0.04), 0.92, 0.92,
                           STAGE_COLORS[stage % len(STAGE_COLORS)]))
        lines = [f"rank {r}", " ".join(f"{a}={c}" for a, c in zip(ex.axis_names, _coords(ex, r))),
                 f"{_stage_text(ex, stage)}, {ex.param_bytes[r] / 2**20:.2f} MiB weights"
                 .lstrip(", ")]
        shown = ex.slices.get(r, [])
        lines += [_slice_text(fqn, index) for fqn, index in shown]
        more = ex.sliced.get(r, len(shown)) - len(shown)
        if more > 0:
            lines.append(f"+{more} more sliced weights")
        elif not shown:
            lines.append("every weight whole (no slices)")
        ax.text(x + 0.5, rows - 1 - y + 0.5, "\n".join(lines), ha="center", va="center",
                fontsize=7, family="monospace")
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_axis_off()
    colour = ", box colour = pipeline stage" if max(ex.stages.values(), default=0) else ""
    ax.set_title(f"Mesh {ex.mesh}: the weight slices each rank holds (global index){colour}",
                 fontsize=10)


def _coords(ex, rank: int) -> tuple[int, ...]:
    out = []
    for n in reversed(ex.mesh_shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def _rect(xy, w, h, color, **kw):
    from matplotlib.patches import Rectangle
    return Rectangle(xy, w, h, facecolor=color, edgecolor=kw.pop("edgecolor", "#555555"),
                     linewidth=0.8, **kw)


def _order(ex):
    """Groups in model order: modules before the stack, layers by number with each pipeline
    transfer after its sending stage's last layer, then modules after the stack (the head),
    the output gather last."""
    last = {s: hi for s, (_lo, hi) in ex.stage_layers().items()}

    def key(label: str) -> tuple:
        m = re.match(r"(layer|pp) (\d+)", label)
        if m and m.group(1) == "layer":
            return (1, int(m.group(2)))
        if m:
            return (1, last.get(int(m.group(2)), -1) + 0.5)
        if label == "output gather":
            return (3, 0)
        if "norm" in label:       # the final norm, then the head
            return (2, 0)
        return (2, 1) if "head" in label else (0, label != "embed_tokens")
    return key


def _draw_layers(ax, ex) -> None:
    from matplotlib.patches import Patch
    sent, received = layer_groups(ex, "sent"), layer_groups(ex, "received")
    labels = sorted(set(sent) | set(received), key=_order(ex))
    kinds = sorted({k for g in (*sent.values(), *received.values()) for k in g},
                   key=lambda k: (list(OP_COLORS).index(k[0]) if k[0] in OP_COLORS else 99, k))
    width, top = 0.36, 0.0
    for side, groups, dx in (("sent", sent, -0.2), ("recv", received, 0.2)):
        bottom = [0.0] * len(labels)
        for op, axis in kinds:
            values = [groups.get(g, {}).get((op, axis), 0) / 2**10 for g in labels]
            ax.bar([i + dx for i in range(len(labels))], values, width, bottom=bottom,
                   color=OP_COLORS.get(op, "#777777"), hatch=AXIS_HATCHES.get(axis, "++"),
                   edgecolor="white", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, height in enumerate(bottom):
            if height:
                ax.text(i + dx, height, side, ha="center", va="bottom", fontsize=6)
        top = max([top, *bottom])
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax.set_ylabel("KiB per forward", fontsize=8)
    ax.set_ylim(0, 1.12 * top or 1)
    who = "the first rank of each stage" if max(ex.stages.values(), default=0) else "one rank"
    ax.set_title(f"Collectives per layer: wire bytes {who} sends (left bar) and receives "
                 f"(right bar) per forward", fontsize=10)
    if not kinds:
        ax.text(0.5, 0.5, "no collectives", ha="center", va="center", transform=ax.transAxes)
        return
    handles = [Patch(facecolor=OP_COLORS.get(op, "#777777"), label=op)
               for op in dict.fromkeys(k[0] for k in kinds)]
    handles += [Patch(facecolor="white", edgecolor="#333333", hatch=AXIS_HATCHES.get(a, "++"),
                      label=f"axis {a}") for a in dict.fromkeys(k[1] for k in kinds)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0),
              title="colour: collective\nhatch: mesh axis", title_fontsize=7)


def _draw_schedule(ax, ex) -> None:
    stages = max(ex.stages.values(), default=0) + 1
    m = ex.microbatches
    steps = stages + m - 1
    busy = set()
    for s, i, t in gpipe_schedule(stages, m):
        busy.add((s, t))
        ax.add_patch(_rect((t + 0.05, stages - 1 - s + 0.1), 0.9, 0.8,
                           STAGE_COLORS[s % len(STAGE_COLORS)]))
        ax.text(t + 0.5, stages - 1 - s + 0.5, f"mb {i}", ha="center", va="center", fontsize=8)
    for s in range(stages):
        for t in range(steps):
            if (s, t) not in busy:
                ax.add_patch(_rect((t + 0.05, stages - 1 - s + 0.1), 0.9, 0.8, "white",
                                   hatch="//", edgecolor="#bbbbbb"))
                ax.text(t + 0.5, stages - 1 - s + 0.5, "bubble", ha="center", va="center",
                        fontsize=7, color="#888888")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 1 - s + 0.5 for s in range(stages)],
                  [_stage_text(ex, s) or f"stage {s}" for s in range(stages)], fontsize=8)
    ax.set_xticks([t + 0.5 for t in range(steps)], [str(t) for t in range(steps)], fontsize=7)
    ax.set_xlabel("time step (one microbatch forward per stage)", fontsize=8)
    bubble = (stages - 1) / steps
    ax.set_title(f"GPipe schedule: {stages} stages x {m} microbatches, bubble "
                 f"{bubble:.0%} of each stage's time", fontsize=10)


def draw_plan(ex, path: str) -> str:
    """Draw ``ex`` (an :class:`fxshard.explain.Explanation`) to ``path``; see the module doc."""
    matplotlib, Figure = _matplotlib()
    rows, cols, _ = _mesh_grid(ex)
    stages = max(ex.stages.values(), default=0) + 1
    heights = [max(2.0, 1.4 * rows), 3.0] + ([max(1.2, 0.6 * stages)] if stages > 1 else [])
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "fxshard",
                                "hatch.linewidth": 0.6}):
        fig = Figure(figsize=(max(9.0, 2.8 * cols), sum(heights) + 1.5), layout="constrained")
        axes = fig.subplots(len(heights), 1, height_ratios=heights)
        _draw_mesh(axes[0], ex)
        _draw_layers(axes[1], ex)
        if stages > 1:  # one stage: no schedule to show
            _draw_schedule(axes[2], ex)
        fig.suptitle(f"fxshard plan, mesh {ex.mesh}, {ex.ranks} ranks, "
                     f"{ex.total_param_bytes / 2**20:.2f} MiB parameters", fontsize=11)
        fig.savefig(path, metadata={"Date": None} if str(path).endswith(".svg") else None)
    return path
