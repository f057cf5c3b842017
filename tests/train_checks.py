"""Structure checks shared by the training tests (no test functions here)."""
from __future__ import annotations

from fxshard.placement import local_shape


def expert_rows(tm, which: str) -> list[int]:
    """Rows of each expert grouped matmul's input in rank 0's ``which`` program ("forward" /
    "backward") of the TrainModule ``tm``: on a batch axis, the rank's own routed rows."""
    out = []
    for n in tm.rank_module(0, which).graph.nodes:
        if n.op == "call_function" and "grouped_mm" in str(n.target):
            x = n.args[0]
            out.append(local_shape(tuple(x.meta["val"].shape), x.meta["fxshard_spec"],
                                   tm.mesh)[0])
    return out
