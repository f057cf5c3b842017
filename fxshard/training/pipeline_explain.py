"""``pm.explain()`` of pipeline training: each stage's training plan and the schedule run.

The schedule is shown in time steps (each action one unit; a simulated mesh runs them in this
order), one row per ``pp`` rank, ``F<mb>``/``B<mb>`` (``F<mb>.<chunk>`` with virtual stages),
``.`` idle; the bubble is the idle share of the rows::

    schedule 1f1b: pp=2, 4 microbatches, bubble 20% (4 of 20 unit steps idle)
      pp 0  F0 F1 B0 F2 B1 F3 B2 .  B3 .
      pp 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .
"""
from __future__ import annotations

from types import SimpleNamespace

__all__ = ["PipelineExplanation", "explain_pipeline"]


class PipelineExplanation:
    """The stages' plans (``stages[k]``: an :class:`fxshard.explain.Explanation` on the mesh
    without ``pp``) and the last step's schedule with its peak saved bytes per rank."""

    def __init__(self, stages: list, schedule: dict | None, pp: int):
        self.stages, self.schedule, self.pp = stages, schedule or {}, pp

    def rows(self) -> list[list[str]]:
        """Per ``pp`` rank, what it runs at each time step (``""``: idle)."""
        steps = self.schedule.get("steps") or []
        v = self.schedule.get("virtual_stages") or 1
        rows = [[""] * len(steps) for _ in range(self.pp)]
        for t, step in enumerate(steps):
            for r, (kind, k, i) in step:
                rows[r][t] = f"{kind}{i}" + (f".{k // self.pp}" if v > 1 else "")
        return rows

    def bubble(self) -> float:
        rows = self.rows()
        total = sum(len(r) for r in rows)
        return sum(1 for r in rows for c in r if not c) / total if total else 0.0

    def __str__(self) -> str:
        s = self.schedule
        lines = []
        if s:
            rows = self.rows()
            idle = sum(1 for r in rows for c in r if not c)
            total = sum(len(r) for r in rows)
            lines.append(f"schedule {s['name']}: pp={s['stages_per_axis']}, "
                         f"{s['microbatches']} microbatches"
                         f", {s.get('virtual_stages') or 1} virtual stage(s) per rank, bubble "
                         f"{100 * self.bubble():.0f}% ({idle} of {total} unit steps idle)")
            width = max([len(c) for r in rows for c in r] + [1])
            for r, row in enumerate(rows):
                lines.append(f"  pp {r}  " + " ".join((c or ".").ljust(width) for c in row))
            peak = s.get("peak_saved") or {}
            if peak:
                lines.append("peak saved activations per rank (bytes alive at once): " +
                             ", ".join(f"rank {r}: {b}" for r, b in sorted(peak.items())))
        for k, ex in enumerate(self.stages):
            lines += ["", f"stage {k} (mesh without pp):", str(ex)]
        return "\n".join(lines)

    def save(self, path: str) -> str:
        """Draw the schedule (one row per ``pp`` rank, forwards and backwards per time step,
        the bubble blank) to ``path``; needs matplotlib."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = self.rows()
        fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(rows[0] if rows else [0])),
                                        0.6 * self.pp + 1))
        for r, row in enumerate(rows):
            for t, c in enumerate(row):
                if c:
                    ax.add_patch(plt.Rectangle((t, r), 1, 0.9, edgecolor="white",
                                               facecolor="#4c72b0" if c[0] == "F"
                                               else "#dd8452"))
                    ax.text(t + 0.5, r + 0.45, c, ha="center", va="center", fontsize=7)
        ax.set_xlim(0, max(len(rows[0]) if rows else 1, 1))
        ax.set_ylim(self.pp, 0)
        ax.set_yticks([r + 0.45 for r in range(self.pp)], [f"pp {r}" for r in range(self.pp)])
        ax.set_xlabel("time step")
        ax.set_title(f"{self.schedule.get('name', '')}: bubble {100 * self.bubble():.0f}%")
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)
        return path


def explain_pipeline(pm, trainer) -> PipelineExplanation:
    from ..explain import explain_training
    view = SimpleNamespace(spec=trainer.sub, model=pm.model,
                           unmatched_plan=getattr(pm, "unmatched_plan", []))
    stages = [explain_training(view, tm) for tm in trainer.stage_modules if tm._last is not None]
    return PipelineExplanation(stages, trainer.schedule, trainer.pp)
