"""Published GPU training results of Llama-class models, and fxshard's prediction beside each.

Each row: where the figure comes from, the hardware, the configuration as published, the
published tokens/s per device (and memory per device where given). The hardware model's
efficiency factors were set before this table was made and are not fitted to it.
"""
from __future__ import annotations

ROWS = []   # filled below: (source, hardware, model config, mesh, options, tok/s/dev, GiB)


def published_table() -> str:
    raise NotImplementedError(
        "benchmarks/plan_published.py: no published rows are filled in yet; the sources "
        "must be read and cited before any row is added (see the report of issue 45)")
