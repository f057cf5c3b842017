"""``post_emit.overlap_collectives_pass``: training's eager programs issue each all-reduce in
the background and run the matmuls that do not need it before waiting; random draws and
effects never move, and nothing moves where no matmul would (the forward's all-reduces)."""
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxshard
from fxshard.ops.collectives import all_reduce_consuming, all_reduce_start, collective_wait
from fxshard.passes import post_emit
from fxshard.passes.pipeline import run_passes
from tests.test_train_grads import _data, _llama


def _rewritten(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    run = fx.GraphModule(torch.nn.Module(), graph)
    return run_passes(run, [post_emit.consume_dead_inputs_pass, post_emit.overlap_collectives_pass],
                      post_emit.PostEmitCtx())


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_backward_all_reduces_wait_after_the_weight_gradients():
    model = _llama(layers=2)
    ids, labels = _data()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten()).backward()
    backward = pm.rank_module(0, "backward")
    before = sum(n.target is torch.ops.fxshard.all_reduce.default for n in _calls(backward))
    run = _rewritten(backward)
    nodes = _calls(run)
    starts = [n for n in nodes if n.target is all_reduce_start]
    assert before == 2 * 2 + 1 and len(starts) == before          # every one of them
    order = {n: i for i, n in enumerate(run.graph.nodes)}
    for start in starts:
        (wait,) = start.users
        assert wait.target is collective_wait
        between = [n for n in nodes if order[start] < order[n] < order[wait]]
        mms = [n for n in between if n.target is torch.ops.aten.mm.default]
        assert mms, start                                   # a weight gradient in flight
        first = min(order[u] for u in wait.users)
        assert first > order[wait]                          # waited before its first reader
        # no reader of the sum and no other collective before the wait
        assert not any(n in wait.users or n.target in (all_reduce_start, collective_wait)
                       for n in between if n is not wait)
    # the forward's all-reduces have nothing to hide behind: left as they were
    forward = _rewritten(pm.rank_module(0, "forward"))
    assert not any(n.target is all_reduce_start for n in _calls(forward))


def test_random_draws_and_effects_never_move():
    """A window holding a random op (its draw order is the masks') is left alone."""
    graph = fx.Graph()
    x, w, p = (graph.placeholder(n) for n in ("x", "w", "p"))
    grad_w = graph.call_function(torch.ops.aten.mm.default, (x, w))          # independent
    mask = graph.call_function(torch.ops.aten.bernoulli.p, (p, 0.5))        # random
    total = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    summed = graph.call_function(torch.ops.fxshard.all_reduce.default, (total, "tp", 2))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (summed, 2.0)), grad_w, mask))
    gm = _rewritten(fx.GraphModule(torch.nn.Module(), graph))
    assert sum(n.target in (torch.ops.fxshard.all_reduce.default, all_reduce_consuming)
               for n in _calls(gm)) == 1                  # (summing into its dead input)
    assert not any(n.target is all_reduce_start for n in _calls(gm))
    # without the random op the matmul moves behind the start
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    grad_w = graph.call_function(torch.ops.aten.mm.default, (x, w))
    total = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    summed = graph.call_function(torch.ops.fxshard.all_reduce.default, (total, "tp", 2))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (summed, 2.0)), grad_w))
    gm = _rewritten(fx.GraphModule(torch.nn.Module(), graph))
    assert [getattr(n.target, "__name__", str(n.target)) for n in _calls(gm)] == [
        "add.Tensor", "all_reduce_start", "mm.default", "collective_wait", "mul.Tensor"]
