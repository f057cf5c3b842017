"""Mixed precision: ``parallelize(mixed_precision=MixedPrecisionPolicy(...))`` (torch's FSDP2
class) trains fp32 masters with bf16 compute, and its rank programs move bf16 on fsdp's
gathers and reduce gradients in ``reduce_dtype``. The reference is the policy applied by hand
on one device (tests/mixed_reference.py), both held against float64."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import MixedPrecisionPolicy

import fxshard
from fxshard.explain import collectives_of
from tests.mixed_reference import close_to_float64, mixed_steps_close, PolicyReference
from tests.test_train_grads import _llama, _loss

GRAD = True
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
V = 96


def _ids(batch=4, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (batch, seq), generator=g),
            torch.randint(0, V, (batch, seq), generator=g))


def _mesh(axes: dict):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()),
                                    mesh_dim_names=tuple(axes))


def _dtypes_into(gm, ops: tuple) -> dict:
    """{op name: set of the dtypes of its tensor inputs} over ``gm``'s collectives."""
    out = {}
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in ops:
            xs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            out.setdefault(name, set()).update(x.meta["val"].dtype for x in xs)
    return out


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_fsdp_gathers_bf16_and_reduces_in_reduce_dtype(reduce_dtype):
    """fsdp2.tp2: every parameter all-gather (bucketed per layer or not) moves bf16, in both
    programs; every gradient reduce-scatter / all-reduce runs in ``reduce_dtype`` (None:
    param_dtype, FSDP2's default); the shards, their gradients and the state dict stay fp32;
    the parameters' casts are graph nodes right after the inputs."""
    model, (ids, labels) = _llama(layers=1), _ids()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    pm = fxshard.parallelize(model, _mesh({"fsdp": 2, "tp": 2}), mixed_precision=policy)
    _loss(pm(ids).float(), labels).backward()
    forward, backward = pm.rank_module(0, "forward"), pm.rank_module(0, "backward")
    gathers = ("all_gather", "all_gather_bucket")
    for gm in (forward, backward):
        weights = {n for n in gm.graph.nodes if n.op == "placeholder"
                   and n.meta.get("fxshard_param")}
        assert all(n.meta["val"].dtype == torch.float32 for n in weights)
        for w in (w for w in weights if w.users):   # one cast to bf16, read by the rest
            (cast,) = w.users
            assert cast.target is torch.ops.aten._to_copy.default
            assert cast.kwargs["dtype"] == torch.bfloat16
        fsdp = {n for n in gm.graph.nodes if n.op == "call_function"
                and getattr(n.target, "__name__", "").split(".")[0] in gathers
                and "fsdp" in n.args}
        assert fsdp, gm.code
        assert all(x.meta["val"].dtype == torch.bfloat16 for n in fsdp for x in
                   (n.args[0] if isinstance(n.args[0], list) else [n.args[0]]))
    reduced = _dtypes_into(backward, ("reduce_scatter", "reduce_scatter_bucket"))
    assert reduced and all(d == {reduce_dtype or torch.bfloat16} for d in reduced.values())
    out = next(n for n in backward.graph.nodes if n.op == "output")
    assert all(a.meta["val"].dtype == torch.float32 for a in out.args[0])
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in pm.parameters())
    assert all(v.dtype == torch.float32 for v in pm.state_dict().values())
    # explain's bytes: the fsdp gathers half fp32's, the gradient reductions fp32's or half
    spec = pm.spec

    def fsdp_bytes(gm, ops):
        return sum(c.tensor_bytes for c in collectives_of(gm.graph, spec)
                   if c.op in ops and c.axis == "fsdp")
    numel = sum(p.numel() for p in pm.parameters()) // 4     # rank 0's shards
    assert fsdp_bytes(forward, gathers) == 2 * numel         # bf16: 2 bytes per element
    # memory: fp32 masters, gradients and AdamW state; bf16 copies of one layer at a time
    mem = pm.explain().train_memory[0]
    assert (mem["parameters"], mem["gradients"], mem["adamw_state"]) == \
        (4 * numel, 4 * numel, 8 * numel)
    assert 0 < mem["param_dtype_copies"] < 2 * 2 * numel   # < the whole model gathered
    # each rank hands its tp shard of every gradient, whole on fsdp: twice its fsdp shard
    assert fsdp_bytes(backward, ("reduce_scatter", "reduce_scatter_bucket")) == \
        (4 if reduce_dtype is torch.float32 else 2) * 2 * numel


def _loss_of(ids, labels):
    def run(module, dtype):
        out = module(ids)
        return _loss(out if dtype is torch.float64 else out.float(), labels)
    return run


MESHES = [{"dp": 2, "tp": 2}, {"fsdp": 2, "tp": 2}, {"fsdp": 2, "ulysses_cp": 2},
          {"dp": 2, "ring_cp": 2}, {"fsdp": 4, "tp": 2}, {"tp": 2, "ring_cp": 2},
          {"dp": 2, "fsdp": 2, "tp": 2}]


@settings(max_examples=2)
@given(mesh=st.sampled_from(MESHES), sp=st.booleans(), layers=st.integers(1, 2))
def test_policy_steps_as_one_device_under_the_policy(mesh, sp, layers):
    """Gradients and three AdamW steps under bf16/fp32 no further from float64 than the
    policy applied by hand on one device (tests/mixed_reference.py), on meshes of dp, fsdp,
    tp (with sequence parallelism or not), ring_cp and ulysses_cp."""
    model, (ids, labels) = _llama(layers=layers), _ids()
    # (tp with ring_cp and sequence_parallel fails without a policy too, in propagation:
    # StridedShard parts of a fused slice; not this test's subject)
    pm = fxshard.parallelize(model, _mesh(mesh), mixed_precision=BF16,
                             sequence_parallel=sp and "tp" in mesh and "ring_cp" not in mesh)
    mixed_steps_close(pm, model, BF16, _loss_of(ids, labels))


def test_inference_under_the_policy_and_its_input_and_output_casts():
    """``pm(x)`` under no_grad computes as the policy's bf16 copies (the hand-made reference),
    its output cast to ``output_dtype``; the masters stay fp32 in the weight store."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model, (ids, _) = _llama(layers=1), _ids()
    pm = fxshard.parallelize(model, _mesh({"fsdp": 2, "tp": 2}), mixed_precision=policy)
    with torch.no_grad():
        got = pm(ids)
        want = PolicyReference(model, policy).working()(ids)
        exact = copy.deepcopy(model).double()(ids)
    assert got.dtype == want.dtype == torch.float32
    close_to_float64(got, want, exact, "logits under the policy")
    gm = pm.rank_module(0)
    slots = pm.programs.last.program.slots
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in slots]
    assert len(attrs) == len(slots) and all(slots[n.target].dtype == torch.float32 and
                                            n.meta["val"].dtype == torch.float32 for n in attrs)
    assert all([u.target for u in n.users] == [torch.ops.aten._to_copy.default]
               for n in attrs)
    bucket = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "").startswith(
        "all_gather_bucket")]
    assert bucket and all(x.meta["val"].dtype == torch.bfloat16 for n in bucket
                          for x in n.args[0])


def test_a_bad_policy_is_a_clear_error():
    model = _llama(layers=1)
    with pytest.raises(TypeError, match=r"mixed_precision=.*torch\.distributed\.fsdp\."
                                        r"MixedPrecisionPolicy"):
        fxshard.parallelize(model, _mesh({"tp": 2}), mixed_precision=torch.bfloat16)
    with pytest.raises(TypeError, match=r"mixed_precision\.param_dtype=torch\.int8"):
        fxshard.parallelize(model, _mesh({"tp": 2}),
                            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(NotImplementedError, match=r"without param_dtype"):
        fxshard.parallelize(model, _mesh({"tp": 2}), mixed_precision=MixedPrecisionPolicy(
            reduce_dtype=torch.float32))



def test_meta_model_loads_bf16_safetensors_into_fp32_masters(tmp_path):
    """A model built on meta in fp32, parallelized under the policy, loads a bf16 safetensors
    file (as HF ships them) into fp32 masters (they were left bf16: the optimizer would step
    bf16 weights), and its first step is the policy's."""
    from safetensors.torch import save_file
    from fxshard.models.llama import LlamaForCausalLM
    model, (ids, labels) = _llama(layers=1), _ids()
    with torch.no_grad():    # values a bf16 file holds exactly
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              path)
    with fxshard.init_empty_weights():
        meta = LlamaForCausalLM(model.config)
    pm = fxshard.parallelize(meta, _mesh({"fsdp": 2, "tp": 2}), mixed_precision=BF16)
    fxshard.load_safetensors(pm, path)
    loss = _loss_of(ids, labels)(pm, None)
    loss.backward()
    assert {p.dtype for p in pm.parameters()} == {torch.float32}
    assert {v.dtype for v in pm.state_dict().values()} == {torch.float32}
    ref = PolicyReference(model, BF16)
    want = _loss_of(ids, labels)(ref.working(), None)
    want.backward()
    ref.grads_to_masters()
    exact = copy.deepcopy(model).double()
    want64 = _loss_of(ids, labels)(exact, torch.float64)
    want64.backward()
    close_to_float64(loss, want, want64, "loss")
    grads = pm.gradients()
    for name, p in exact.named_parameters():
        close_to_float64(grads[name], ref.masters.get_parameter(name).grad, p.grad, name)


def test_policy_checkpoint_resumes_exactly(tmp_path):
    """save_training_state writes the fp32 masters and AdamW state; a fresh pm under the
    policy loaded from it takes the same next step, bit for bit."""
    model, (ids, labels) = _llama(layers=1), _ids()

    def make():
        pm = fxshard.parallelize(copy.deepcopy(model), _mesh({"fsdp": 2, "tp": 2}),
                                 mixed_precision=BF16)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2)

    def step(pm, opt):
        _loss_of(ids, labels)(pm, None).backward()
        opt.step()
        opt.zero_grad()
    pm, opt = make()
    step(pm, opt)
    fxshard.save_training_state(pm, opt, str(tmp_path / "ckpt"))
    step(pm, opt)
    again, opt2 = make()
    fxshard.load_training_state(again, opt2, str(tmp_path / "ckpt"))
    step(again, opt2)
    want, got = pm.state_dict(), again.state_dict()
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name
    assert {v.dtype for s in opt2.state.values() for v in s.values() if v.dim()} == \
        {torch.float32}
