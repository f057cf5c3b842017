"""What the training rank programs run eagerly copies no more than hand-written Megatron does.

Every all-reduce of a value nothing else reads (a row-parallel matmul's output in the forward,
a summed input gradient in the backward, also behind a reshape) sums in place
(``all_reduce_consuming``) instead of into a copy; the readable programs (``rank_module``)
are unchanged, and the gradients still equal the single-device model's.
"""
import torch
import torch.nn.functional as F

import fxshard
from fxshard.ops.collectives import all_reduce_consuming
from fxshard.training.module import direct
from tests.models import our_llama

_AR = torch.ops.fxshard.all_reduce.default


def _run_graph(gm):
    direct(gm)
    return gm.__dict__["_fxshard_direct"][2].graph


def test_training_all_reduces_sum_in_place_and_gradients_equal_one_device():
    model = our_llama(num_hidden_layers=2, vocab_size=96, hidden_size=48,
                      intermediate_size=72)
    ref = our_llama(num_hidden_layers=2, vocab_size=96, hidden_size=48, intermediate_size=72)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 96, (2, 6), generator=g), torch.randint(0, 96, (2, 6),
                                                                            generator=g)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model.train(), mesh)
    F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(ref.train()(ids).flatten(0, 1), labels.flatten()).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for name, got in pm.gradients().items():
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
    counts = {}
    for which in ("forward", "backward"):
        readable = pm.rank_module(0, which).graph
        run = _run_graph(pm.rank_module(0, which))
        n_ar = sum(n.target is _AR for n in readable.nodes)
        consuming = sum(n.target is all_reduce_consuming for n in run.nodes)
        copying = [n for n in run.nodes if n.target is _AR]
        counts[which] = (n_ar, consuming, len(copying))
        assert not any(n.target is all_reduce_consuming for n in readable.nodes)
        assert consuming + len(copying) == n_ar
    # forward: o_proj and down_proj of 2 layers, every one in place (Megatron clones them)
    assert counts["forward"] == (4, 4, 0), counts
    # backward: the input gradient of each layer's q/k/v and gate/up and the lm_head's (a
    # reshape of its matmul): in place, none copied
    assert counts["backward"] == (5, 5, 0), counts
    pm.close()
