"""What :func:`fxshard.estimate` returns: one configuration's predicted memory, step time and
throughput, printable as a short report."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Estimate"]


@dataclass
class Estimate:
    """One configuration's prediction (see :func:`estimate`)."""

    mesh: dict
    options: dict
    memory: dict                      # bytes per device: peak and its parts
    step_time: dict                   # seconds: total, compute, exposed_comm, bubble, ...
    tokens_per_second: float          # the whole mesh
    tokens_per_second_per_device: float
    fits: bool
    hardware: str
    training: bool = True
    flops_per_step: float = 0.0       # counted FLOPs per device per step
    mfu: float = 0.0                  # model FLOPs / (step time * bf16 or fp32 peak)
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        mesh = ", ".join(f"{a}={n}" for a, n in self.mesh.items())
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        gib = 2 ** 30
        m, t = self.memory, self.step_time
        lines = [f"fxshard.estimate on {self.hardware}: mesh ({mesh}); {opts}",
                 f"  memory per device: {m['peak'] / gib:.2f} GiB peak "
                 f"({'fits' if self.fits else 'DOES NOT FIT'} in "
                 f"{m['capacity'] / gib:.1f} GiB usable)",
                 "    " + ", ".join(f"{k} {v / gib:.2f}" for k, v in m.items()
                                    if k not in ("peak", "capacity"))]
        if self.training:
            lines.append(f"  step time: {t['total'] * 1e3:.1f} ms = compute "
                         f"{t['compute'] * 1e3:.1f} + exposed communication "
                         f"{t['exposed_comm'] * 1e3:.1f} + pipeline bubble "
                         f"{t['bubble'] * 1e3:.1f} (communication in all "
                         f"{t['comm'] * 1e3:.1f})")
        else:
            lines.append(f"  prefill: {t['prefill'] * 1e3:.1f} ms, decode step: "
                         f"{t['decode'] * 1e3:.2f} ms")
        lines.append(f"  tokens/s: {self.tokens_per_second:,.0f} "
                     f"({self.tokens_per_second_per_device:,.1f} per device)"
                     + (f", MFU {self.mfu:.1%}" if self.training else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
