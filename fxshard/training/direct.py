"""A training rank program as ranks call it: without its per-node dispatch frames, and with the
runner's in-place and overlapped collectives (``fxshard.passes.post_emit.TRAINING``) on a copy.

::

    direct(rank_module(r, "backward"))   # -> fn(*args): the graph's code, all_reduce_ in place
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["direct"]


def direct(gm):
    """``gm`` called without its per-node ``OpOverload.__call__`` and ``nn.Module.__call__``
    frames (``fxshard.compile.direct_forward``, as inference's eager stages), made once per
    GraphModule and its code (again after a ``recompile``); ``gm`` itself where it is no
    GraphModule or its code reads attributes of the module. As inference's eager stages, an
    all-reduce of a value nothing else reads (a row-parallel matmul's output, a gradient
    sum) sums in place, without a copy (``fxshard.passes.post_emit.TRAINING`` on a copy of
    the graph: ``gm`` itself, what ``rank_module`` shows, is unchanged); the fsdp axis's
    all-gathers run one ahead and its reduce-scatters in the background
    (``prefetch_fsdp_pass``). Background tp all-reduces (``overlap_collectives_pass``) are
    not in that list: measured, no gain on CPU gloo (``benchmarks/history/train_step.md``)."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    code = gm.code
    made = gm.__dict__.get("_fxshard_direct")
    if made is None or made[0] is not code:
        from ..compile import direct_forward as _direct_forward
        run = None
        if any(n.op == "get_attr" for n in gm.graph.nodes):
            fn = gm
        else:
            from ..passes import post_emit
            from ..passes.pipeline import run_passes
            graph = fx.Graph()
            graph.output(graph.graph_copy(gm.graph, {}))
            run = fx.GraphModule(torch.nn.Module(), graph, class_name=type(gm).__name__)
            fn = _direct_forward(run_passes(run, post_emit.TRAINING, post_emit.PostEmitCtx()))
        made = gm.__dict__["_fxshard_direct"] = (code, fn, run)   # run: the graph fn runs
    return made[1]
