"""Collectives moved behind compute, in an emitted rank program (post-emit passes, run by
:func:`fxshard.passes.pipeline.run_passes` from :mod:`fxshard.passes.post_emit`'s lists).

``overlap_collectives_pass`` runs an all-reduce in the background behind the matmuls that do
not need it; ``prefetch_fsdp_pass`` issues the ``fsdp`` axis's all-gathers one ahead and its
reduce-scatters in the background::

    before:  ag1 = all_gather(w1); mm1 = mm(x, ag1); ag2 = all_gather(w2); mm2 = mm(mm1, ag2)
    after:   h1 = all_gather_start(w1); ag1 = wait(h1); h2 = all_gather_start(w2)
             mm1 = mm(x, ag1); ag2 = wait(h2); mm2 = mm(mm1, ag2)

Each pass's docstring shows its own before and after.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..ops.collectives import all_reduce_consuming

if TYPE_CHECKING:
    from .post_emit import PostEmitCtx

__all__ = ["overlap_collectives_pass", "prefetch_fsdp_pass"]


#: ops worth hiding a collective behind (a matmul's worth of work, not an add)
_COMPUTE = {getattr(torch.ops.aten, name).default for name in
            ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
             "_scaled_dot_product_flash_attention_for_cpu_backward")}


def _compute(node: fx.Node) -> bool:
    return node.target in _COMPUTE or (node.target in _FXSHARD_COMPUTE)


_FXSHARD_COMPUTE = {getattr(torch.ops.fxshard, name).default for name in
                    ("attention", "attention_backward") if hasattr(torch.ops.fxshard, name)}


def _movable(node: fx.Node) -> bool:
    """A pure call (no effect, no random draw) that may run later than it stands."""
    if node.op != "call_function" or node.is_impure():
        return False
    target = node.target
    return not (isinstance(target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in target.tags)


def _is_comm(node: fx.Node) -> bool:
    from ..ops.collectives import all_reduce_start, collective_wait, is_communication
    return is_communication(node) or node.target in (all_reduce_consuming, all_reduce_start,
                                                     collective_wait)


def overlap_collectives_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
    """Run each all-reduce in the background behind the work that does not need it (eager
    programs on a real mesh): a backward's input-gradient all-reduce behind the weight
    gradients of the same layer, which come first in the partitioner's order (Megatron-LM's
    overlap of the tensor-parallel all-reduce with the weight-gradient GEMM). The
    work between the previous collective and the all-reduce that is no input of it moves after
    an ``all_reduce_start``; ``collective_wait`` stands before the sum's first reader or the
    next collective, whichever comes first (one collective in flight: the same order on every
    rank, and no buffer held past the next one). Only where a matmul (or attention) moves;
    random ops and effects never move. On the simulated mesh the start reduces at once::

        before: mm_14 = mm(t_20, saved_view_8)                  # weight gradient
                mm_15 = mm(view_19, t_22);  add_8 = add(view_18, view_20)
                all_reduce = fxshard.all_reduce(add_8, 'tp', 2)
                mul_23 = mul(all_reduce, w)
        after:  mm_15 = mm(view_19, t_22);  add_8 = add(view_18, view_20)
                pending = all_reduce_start(add_8, 'tp', 2, True)
                mm_14 = mm(t_20, saved_view_8)                  # while the sum travels
                all_reduce = collective_wait(pending)
                mul_23 = mul(all_reduce, w)
    """
    from ..ops.collectives import all_reduce_start, collective_wait
    graph = gm.graph
    targets = (torch.ops.fxshard.all_reduce.default, all_reduce_consuming)
    n = moved_total = 0
    barrier = None                     # the last communication node seen (window start)
    for node in list(graph.nodes):
        if not _is_comm(node):
            continue
        window = []
        cur = barrier.next if barrier is not None else next(iter(graph.nodes))
        while cur is not node:
            window.append(cur)
            cur = cur.next
        barrier = node
        if node.target not in targets or not isinstance(node.args[0], fx.Node):
            continue
        needed, stack = set(), [node.args[0]]
        while stack:                   # the all-reduce's inputs, back to the window's start
            a = stack.pop()
            if a not in needed:
                needed.add(a)
                stack.extend(a.all_input_nodes)
        later = [w for w in window if w not in needed and w.op == "call_function"]
        if not any(_compute(w) for w in later) or not all(_movable(w) for w in later):
            continue
        x, axis, size = node.args
        with graph.inserting_before(node):
            start = graph.call_function(all_reduce_start,
                                        (x, axis, size, node.target is all_reduce_consuming))
        at = start
        for w in later:                # same relative order, after the start
            at.append(w)
            at = w
        stop = at.next
        while stop.op != "output" and stop not in node.users and not _is_comm(stop):
            stop = stop.next
        with graph.inserting_before(stop):
            wait = graph.call_function(collective_wait, (start,))
        wait.meta.update(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        barrier = wait
        n += 1
        moved_total += len(later)
    graph.lint()
    gm.recompile()
    ctx.report("overlap_collectives_pass", overlapped_all_reduces=n, moved_nodes=moved_total)
    return gm


def prefetch_fsdp_pass(gm: fx.GraphModule, *, ctx: PostEmitCtx) -> fx.GraphModule:
    """Run the ``fsdp`` axis's all-gathers ahead and its reduce-scatters in the background
    (eager training programs; FSDP2's prefetch and its reduce-scatter stream). Each
    all-gather on ``fsdp`` is issued (``all_gather_start``, ``all_gather_bucket_start``) as
    soon as the previous one has been waited for and its inputs exist (a weight shard: from
    the start), and waited for where it stood: it travels behind the compute up to its
    first use, one all-gather in flight ahead of the one in use. Each reduce-scatter on
    ``fsdp`` is issued where it stood and waited for before the next one is issued, or
    before its first reader (the program's output), whichever comes first: the backward
    goes on while a layer's gradients are summed.
    Memory: one gathered weight or bucket more is alive than without the pass, and one
    reduce-scatter's input (a layer's unsharded gradients, a bucket's flat copy) until the
    next reduce-scatter starts.
    On a real mesh the backend runs them with ``async_op`` (gloo's threads, NCCL's stream);
    on the simulated mesh the start computes at once. Every rank runs the same program, so
    each group sees its collectives in the same order on every rank::

        before: all_gather_bucket = fxshard.all_gather_bucket([w1, w2], [0, 0], 'fsdp', 2)
                getitem = all_gather_bucket[0] ...
                mm = mm(x, t)                                # layer 0's compute
                all_gather_1 = fxshard.all_gather(w3, 0, 'fsdp', 2)
                mm_1 = mm(y, all_gather_1)
        after:  pending = all_gather_bucket_start([w1, w2], [0, 0], 'fsdp', 2)
                all_gather_bucket = collective_wait(pending)
                pending_1 = all_gather_start(w3, 0, 'fsdp', 2)     # travels behind mm
                getitem = all_gather_bucket[0] ...
                mm = mm(x, t)
                all_gather_1 = collective_wait(pending_1)
                mm_1 = mm(y, all_gather_1)
    """
    from ..ops.collectives import START, collective_wait
    from .fsdp import AXIS
    graph = gm.graph
    ops = torch.ops.fxshard
    gathers = (ops.all_gather.default, ops.all_gather_bucket.default)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first_compute = next(n for n in nodes if n.op != "placeholder")
    ours = [n for n in nodes if n.op == "call_function" and n.target in START
            and not n.kwargs and len(n.args) == 4 and n.args[2] == AXIS]
    # (as emitted: x or xs, dim or dims, axis, size; a call spelled otherwise stays sync)
    prefetched = background = 0
    prev_wait = None                   # the previous all-gather's wait
    for node in (n for n in ours if n.target in gathers):
        anchor = max([a for a in node.all_input_nodes if a.op != "placeholder"]
                     + ([prev_wait] if prev_wait is not None else []),
                     key=lambda a: order[a], default=None)
        if anchor is None:             # (first_compute may be ``node`` itself)
            with graph.inserting_before(first_compute):
                start = graph.call_function(START[node.target], node.args)
        else:
            with graph.inserting_after(anchor):
                start = graph.call_function(START[node.target], node.args)
        with graph.inserting_before(node):
            wait = graph.call_function(collective_wait, (start,))
        order[wait] = order[node] - 0.5   # the next all-gather's anchor
        wait.meta.update(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        prefetched += 1
        prev_wait = wait
    scatters = [n for n in ours if n.target not in gathers]
    for k, node in enumerate(scatters):
        with graph.inserting_before(node):
            start = graph.call_function(START[node.target], node.args)
        # a bucket's parts (getitem) move with the wait: the readers are theirs
        parts = [u for u in node.users if u.target is operator.getitem]
        readers = set(node.users).difference(parts).union(*(p.users for p in parts))
        stop = node.next
        nxt = scatters[k + 1] if k + 1 < len(scatters) else None
        while stop.op != "output" and stop not in readers and stop is not nxt:
            stop = stop.next
        with graph.inserting_before(stop):
            wait = graph.call_function(collective_wait, (start,))
        at = wait
        for part in parts:
            at.append(part)
            at = part
        wait.meta.update(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        background += 1
    if prefetched or background:
        graph.lint()
        gm.recompile()
    ctx.report("prefetch_fsdp_pass", prefetched_all_gathers=prefetched,
               background_reduce_scatters=background)
    return gm
