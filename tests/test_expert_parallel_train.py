"""Expert parallelism (``ep``, issue 44) in training: HF Mixtral on ep2 and fsdp2·ep2. The joint
graph's routing region is routed forward and backward: gradients of every parameter (the
router's included) equal one device's to 1e-5, three AdamW steps give its parameters; each
rank's expert weights get their gradient whole on the rank (no reduction over ep), the other
weights' gradients are reduced over ep as on dp; per MoE layer one counts exchange and two
token all-to-alls in the forward, two in the backward."""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.training import parallelize_for_training
from tests.families import mixtral

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
GRAD = True   # training: run with autograd enabled (tests/conftest.py)


@pytest.mark.parametrize("axes", [dict(ep=2), dict(fsdp=2, ep=2)], ids=["ep2", "fsdp2_ep2"])
def test_mixtral_trains_equal_one_device(axes):
    model = mixtral(1).train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 128, (4, 8), generator=g) for _ in range(2))
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
    ours = torch.optim.AdamW(tm.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    for step in range(3):
        ours.zero_grad()
        theirs.zero_grad()
        out, want = tm(ids), ref(ids)
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
        F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()).backward()
        F.cross_entropy(want.logits.flatten(0, 1), labels.flatten()).backward()
        if step == 0:
            grads = tm.gradients()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
        ours.step()
        theirs.step()
    trained = tm.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)
    # each rank trains E/ep experts: its shard is its slice of the experts (fsdp splits it too)
    local = [t for n, t in tm.shards(1).items() if n.endswith(EXPERTS)]
    assert sum(t.numel() for t in local) * 2 * axes.get("fsdp", 1) == \
        sum(p.numel() for n, p in ref.named_parameters() if n.endswith(EXPERTS))
    expert_shapes = {tuple(t.shape) for t in local}
    for which, moved in (("forward", 1), ("backward", 1)):
        cs = tm.collectives(which)
        on_ep = Counter(c.op for c in cs if c.axis == "ep")
        assert on_ep["expert_dispatch"] == on_ep["expert_combine"] == moved, (which, on_ep)
        assert on_ep["expert_counts"] == (which == "forward"), (which, on_ep)
        # nothing of the experts' weights is reduced on ep: their rows all reached this rank
        reduced = [c.shape for c in cs if c.axis == "ep" and c.op == "all_reduce"]
        assert not expert_shapes & set(reduced), (which, reduced)
    # the router's gradient is a partial sum over each rank's tokens, reduced on ep as on dp
    router = [c for c in tm.collectives("backward") if c.shape == (4, 64) and c.axis == "ep"]
    assert [c.op for c in router] == ["all_reduce"], router
