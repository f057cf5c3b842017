"""The ``fsdp`` mesh axis (ZeRO-3 / FSDP2): the batch split as on ``dp``, every parameter stored
as a shard over the axis, all-gathered before use (again in the backward), its gradient
reduce-scattered to the shard. Gradients, AdamW steps and inference equal one device; the rank
programs gather each parameter once in each direction and reduce-scatter its gradient once, a
layer's parameters in one bucket collective each way (the norm and head in one, by position);
at no point are more than one bucket's gathered weights alive; a rank holds 1/(fsdp·tp) of
the parameters, gradients and optimizer state. (On real processes: fsdp2·tp2 in
tests/test_train_distributed.py.)

Sizes: hidden 48, intermediate 72, vocab 96 (every dim a shard can take divides), sequence 5
(odd), batch 4; a tiny MLP whose dim 0 does not divide shards its dim 1, and its bias of odd
length is stored whole on fsdp (gradient all-reduced, as on dp).
"""
import collections
import copy
import math
import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.placement import Shard
from fxshard.training import clip_grad_norm_, parallelize_for_training
from tests.test_train_grads import _check_grads, _llama, _loss

V, B, S = 96, 4, 5
FSDP = "fsdp"


def _data(seed=1, seq=S, batch=B):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (batch, seq), generator=g),
            torch.randint(0, V, (batch, seq), generator=g))


def _mesh(**axes):
    return fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))


def _is(node, op: str, axis: str) -> bool:
    return node.op == "call_function" and node.target is getattr(torch.ops.fxshard, op).default \
        and axis in node.args


def _weight_inputs(node) -> list:
    """The parameters a (bucketed) collective reads."""
    xs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    return [x for x in xs if x.op == "get_attr" or x.op == "placeholder" and
            x.meta.get("fxshard_param")]


def _gathers_per_parameter(gm) -> dict:
    """Parameter (a training program's placeholder, an inference program's attribute) -> how
    many fsdp all-gathers (on its own or in a bucket) read it."""
    count = collections.Counter()
    for n in gm.graph.nodes:
        if _is(n, "all_gather", FSDP) or _is(n, "all_gather_bucket", FSDP):
            count.update(x.name for x in _weight_inputs(n))
    return {p.name: count[p.name] for p in gm.graph.nodes if p.op == "get_attr" or
            p.op == "placeholder" and p.meta.get("fxshard_param")}


def _buckets(gm, op: str) -> list[list[str]]:
    """The parameter FQNs of each fsdp bucket (``op``: all_gather / reduce_scatter: of the
    gradients), in graph order; a parameter's own collective is a bucket of one."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    grad_of = dict(zip(out_node.args[0], out_node.meta.get("fxshard_gradients", [])))

    def fqn(x, result) -> str:
        if op == "all_gather":
            return x.meta.get("fxshard_param") or x.target
        while result not in grad_of:   # the gradient's chain (dp's all-reduce) to the output
            result, = result.users
        return grad_of[result]
    out = []
    for n in gm.graph.nodes:
        if _is(n, op + "_bucket", FSDP):
            items = sorted(n.users, key=lambda u: u.args[1])
            out.append([fqn(x, u) for x, u in zip(n.args[0], items)])
        elif _is(n, op, FSDP) and (op == "reduce_scatter" or _weight_inputs(n)):
            out.append([fqn(n.args[0], n)])
    return out


def _layer(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["layers"] else "outside"


def _soon(c) -> bool:
    """Whether collective ``c`` comes right after what it reads, or after other collectives
    (and a bucket's unpacking) only."""
    if _is(c, "reduce_scatter_bucket", FSDP):
        return c.prev in c.args[0]
    n = c.prev
    while n is not c.args[0]:
        if not (n.target is operator.getitem or str(n.target).startswith("fxshard.")):
            return False
        n = n.prev
    return True


def _check_structure(tm, n_params: int):
    fwd, bwd = tm.rank_module(0, "forward"), tm.rank_module(0, "backward")
    # every parameter gathered exactly once per program (in its layer's bucket)
    assert set(_gathers_per_parameter(fwd).values()) == {1}
    back = _gathers_per_parameter(bwd)
    # the embedding's gradient does not read the table: nothing to gather for it
    assert back.pop("model_embed_tokens_weight") == 0
    assert set(back.values()) == {1}, back
    # one bucket per layer: each holds one layer's parameters (or those outside the layers)
    for gm in (fwd, bwd):
        for bucket in _buckets(gm, "all_gather"):
            assert len({_layer(f) for f in bucket}) == 1, bucket
    layers = {_layer(f) for f in tm.gradients()} - {"outside"}
    assert sum(b[0] != "outside" and _layer(b[0]) != "outside" for b in
               _buckets(fwd, "all_gather")) == len(layers)
    # gathered weights are redone in the backward, never saved
    saved = [n for n in bwd.graph.nodes if n.op == "placeholder" and n.name.startswith("saved_")]
    assert not any(n.meta.get("fxshard_collective") is not None and
                   n.meta["fxshard_collective"].op == "all_gather" and
                   n.meta["fxshard_collective"].axis == FSDP for n in saved)
    # one reduce-scatter per gradient (on its own or in its layer's bucket), and it is what
    # the backward returns
    outs = next(n for n in bwd.graph.nodes if n.op == "output").args[0]
    scatters = [n for n in bwd.graph.nodes if _is(n, "reduce_scatter", FSDP)
                or _is(n, "reduce_scatter_bucket", FSDP)]
    assert sum(len(n.args[0]) if _is(n, "reduce_scatter_bucket", FSDP) else 1
               for n in scatters) == n_params
    assert len([n for n in scatters if _is(n, "reduce_scatter_bucket", FSDP)]) == len(layers) + 1
    for g in outs:   # (reduced on other axes before or after: the smaller way round)
        chain = [g]
        while chain[-1].meta.get("fxshard_collective") is not None or \
                chain[-1].target is operator.getitem:
            chain.append(chain[-1].args[0])
        assert sum(_is(n, "reduce_scatter", FSDP) or _is(n, "reduce_scatter_bucket", FSDP)
                   for n in chain) == 1, g.name
        # reduced as soon as it is made (a bucket's: as soon as its bucket is)
        assert all(_soon(c) for c in chain[:-1] if c.target is not operator.getitem), g.name
    # each gather (bucket) comes right before the first use of what it gathers
    for gm in (fwd, bwd):
        for n in gm.graph.nodes:
            if _is(n, "all_gather", FSDP) and n.args[0].op == "placeholder":
                first = next(u for u in gm.graph.nodes if u in n.users)
                assert n.next is first, (n.name, first.name)
            if _is(n, "all_gather_bucket", FSDP):
                items = list(n.users)
                after = n.next
                while after in items:
                    after = after.next
                assert any(after in i.users for i in items), (n.name, after.name)


@pytest.mark.parametrize("axes,sp", [
    ({"fsdp": 2}, False),
    ({"fsdp": 2, "tp": 2}, False),
    ({"tp": 2, "fsdp": 2}, False),     # tp outer: fsdp nests inside tp's shard of dim 0
    ({"dp": 2, "fsdp": 2}, False),     # HSDP
    ({"fsdp": 2, "tp": 2}, True),      # 2-D with sequence parallelism
])
def test_gradients_equal_single_device(axes, sp):
    model = _llama(layers=1)
    ids, labels = _data(seq=6 if sp else S)
    tm = parallelize_for_training(model, _mesh(**axes), sequence_parallel=sp)
    _check_grads(model, tm, ids, labels)
    n_params = len(list(model.parameters()))
    _check_structure(tm, n_params)
    if "dp" in axes:   # HSDP: the shard's gradient all-reduced over the replicas too
        c = collections.Counter(str(n.target) for n in tm.rank_module(0, "backward").graph.nodes
                                if _is(n, "all_reduce", "dp"))
        assert sum(c.values()) == n_params
    if "tp" in axes:
        # the column-parallel q_proj: tp shards its dim 0; fsdp dim 1 (fsdp outer) or, when
        # tp is the outer axis, dim 0 again inside tp's shard
        q = tm._specs["model.layers.0.self_attn.q_proj.weight"]
        names = list(axes)
        assert q[names.index("tp")] == Shard(0)
        assert q[names.index("fsdp")] == (Shard(0) if names[0] == "tp" else Shard(1))
        assert tm.shards(0)["model.layers.0.self_attn.q_proj.weight"].numel() == 48 * 48 // 4


MESHES = [{"fsdp": 4}, {"fsdp": 2, "dp": 2}, {"dp": 2, "fsdp": 2, "tp": 2},
          {"tp": 2, "dp": 2, "fsdp": 2}, {"fsdp": 2, "tp": 4}]


@settings(max_examples=3, deadline=None)
@given(axes=st.sampled_from(MESHES), seq=st.integers(3, 6), seed=st.integers(0, 3))
def test_gradients_property(axes, seq, seed):
    """Meshes from {dp, fsdp, tp} (any order, up to 8 ranks; tp 4 > 2 KV heads)."""
    model = _llama(layers=1)
    ids, labels = _data(seed, seq=seq, batch=8)
    tm = parallelize_for_training(model, _mesh(**axes))
    _check_grads(model, tm, ids, labels)
    _check_structure(tm, len(list(model.parameters())))


def test_hf_llama_gradients_fsdp_tp():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=72,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(fsdp=2, tp=2))
    _check_grads(model, tm, ids, labels, logits_of=lambda o: o.logits)
    _check_structure(tm, len(list(model.parameters())))


def _adam_state_bytes(opt, params) -> int:
    return sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def test_adamw_steps_and_memory_per_rank():
    model = _llama(layers=1)
    ids, labels = _data()
    mesh = _mesh(fsdp=2, tp=2)
    tm = parallelize_for_training(model, mesh, example_inputs=(ids,))
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6)  # noqa: E731
    ours = make(tm.parameters())
    norms = []
    for _ in range(3):
        ours.zero_grad()
        _loss(tm(ids), labels).backward()
        norms.append(clip_grad_norm_(tm, 0.5))
        ours.step()
    trained = tm.state_dict()
    theirs = make(model.parameters())
    for step in range(3):
        theirs.zero_grad()
        _loss(model(ids), labels).backward()
        torch.testing.assert_close(norms[step],
                                   torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
                                   rtol=1e-5, atol=1e-6)
        theirs.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    # memory: parameters + gradients + AdamW's two moments, measured from the shard tensors
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    total += _adam_state_bytes(theirs, list(model.parameters()))
    for rank in range(4):
        mine = list(tm.shards(rank).values())
        held = sum(p.numel() * p.element_size() for p in mine)
        held += sum(p.grad.numel() * p.grad.element_size() for p in mine)
        held += _adam_state_bytes(ours, mine)
        # the norms are split on fsdp only (replicated on tp): a little above a quarter
        assert total / 4 <= held <= 1.02 * total / 4, (rank, held, total)
        assert tm.memory(rank)["parameters"] == sum(p.numel() * 4 for p in mine)


@pytest.mark.parametrize("entry", [parallelize_for_training, fxshard.parallelize])
def test_reshard_after_forward_false_keeps_the_gathered_weights(entry):
    model = _llama(layers=1)
    ids, labels = _data()
    tm = entry(model, _mesh(fsdp=2), fsdp_reshard_after_forward=False)
    _check_grads(model, tm, ids, labels)
    bwd = tm.rank_module(0, "backward")
    assert set(_gathers_per_parameter(bwd).values()) == {0}
    saved = [n for n in bwd.graph.nodes if n.op == "placeholder" and n.name.startswith("saved_")
             and n.meta.get("fxshard_collective") is not None
             and n.meta["fxshard_collective"].op == "all_gather"]
    # every weight but the embedding's (its gradient does not read it) comes saved, whole
    assert len(saved) == len(list(model.parameters())) - 1
    assert sum(map(len, _buckets(bwd, "reduce_scatter"))) == len(list(model.parameters()))
    # the forward's gathers are bucketed all the same (one per layer, one for norm + head)
    assert len(_buckets(tm.rank_module(0, "forward"), "all_gather")) == 3


@pytest.mark.parametrize("entry", [parallelize_for_training, fxshard.parallelize])
def test_reshard_after_forward_layers_keeps_what_is_outside_the_layers(entry):
    """``"layers"`` (FSDP2's root): the final norm's and the head's gathers are saved for the
    backward, every layer's parameter is gathered again; gradients as on one device."""
    model = _llama(layers=2)
    ids, labels = _data()
    tm = entry(model, _mesh(fsdp=2, tp=2), fsdp_reshard_after_forward="layers")
    _check_grads(model, tm, ids, labels)
    back = _gathers_per_parameter(tm.rank_module(0, "backward"))
    outside = {"model_norm_weight", "lm_head_weight", "model_embed_tokens_weight"}
    assert {k: v for k, v in back.items() if k in outside} == dict.fromkeys(outside, 0)
    inside = {k: v for k, v in back.items() if k not in outside}
    assert len(inside) == len(list(model.parameters())) - 3 and set(inside.values()) == {1}
    saved = [n for n in tm.rank_module(0, "backward").graph.nodes
             if n.op == "placeholder" and n.name.startswith("saved_") and
             n.meta.get("fxshard_collective") is not None and
             n.meta["fxshard_collective"].op == "all_gather" and
             n.meta["fxshard_collective"].axis == FSDP]
    assert len(saved) == 2, saved     # the final norm's and the head's gathered weights
    # the head's whole [V/tp, H] weight is held from forward to backward: more saved bytes
    kept = tm if entry is parallelize_for_training else tm.trainer
    again = parallelize_for_training(model, _mesh(fsdp=2, tp=2))
    again(ids)
    assert kept.memory(0)["saved"] - again.memory(0)["saved"] >= V // 2 * 48 * 4


class _MLP(torch.nn.Module):
    def __init__(self, dims=(6, 5, 4), bias=False):
        super().__init__()
        self.a = torch.nn.Linear(dims[0], dims[1], bias=bias)
        self.b = torch.nn.Linear(dims[1], dims[2], bias=bias)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _steps_equal(pm, ref, x, steps=3):
    """``pm`` and the single-device ``ref`` through ``steps`` AdamW steps on
    ``(model(x) ** 2).sum()``: outputs, the first step's gradients and the final parameters
    equal (``ref`` is trained in place)."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6)  # noqa: E731
    ours, theirs = make(pm.parameters()), make(ref.parameters())
    named = dict(ref.named_parameters())
    for step in range(steps):
        ours.zero_grad()
        theirs.zero_grad()
        out, want = pm(x), ref(x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        out.square().sum().backward()
        want.square().sum().backward()
        if step == 0:
            for name, g in pm.gradients().items():
                torch.testing.assert_close(g, named[name].grad, rtol=1e-5, atol=1e-5, msg=name)
        ours.step()
        theirs.step()
    for name, p in pm.state_dict().items():
        torch.testing.assert_close(p, named[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_the_dim_that_divides_and_whole_when_none_does():
    """[5, 6]: dim 0 odd, dim 1 split; a.bias (5,): no dim divides, stored whole on fsdp (as
    on dp): read without a gather, its gradient all-reduced once; gradients and 3 AdamW steps
    equal one device, inference too, and explain() lists it and counts it whole."""
    torch.manual_seed(0)
    model = _MLP(bias=True)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    pm = fxshard.parallelize(model, _mesh(fsdp=2), example_inputs=(x,))
    _steps_equal(pm, ref, x)
    assert pm.shards(1)["a.weight"].shape == (5, 3)     # [5, 6]: dim 0 is odd, dim 1 split
    assert pm.shards(1)["b.weight"].shape == (2, 5)     # [4, 5]: dim 0
    assert pm.shards(1)["b.bias"].shape == (2,)
    assert pm.shards(1)["a.bias"].shape == (5,)         # whole
    fwd, bwd = pm.rank_module(0, "forward"), pm.rank_module(0, "backward")
    assert _gathers_per_parameter(fwd) == {"a_weight": 1, "a_bias": 0, "b_weight": 1,
                                           "b_bias": 1}
    out = next(n for n in bwd.graph.nodes if n.op == "output").args[0]
    assert [sum(_is(n, op, FSDP) for n in bwd.graph.nodes)
            for op in ("all_reduce", "reduce_scatter")] == [1, 3]
    (reduced,) = [g for g in out if _is(g, "all_reduce", FSDP)]
    assert tuple(reduced.meta["val"].shape) == (5,)
    ex = pm.explain()
    assert ex.fsdp_whole == [("a.bias", (5,), 20, "dim 0 has 5 per shard, not divisible by 2")]
    assert "Parameters kept whole on fsdp (no dim takes a shard; gradient all-reduced): 1, " \
        "20 bytes per rank\n  a.bias (5,): 20 bytes per rank; dim 0 has 5 per shard" in str(ex)
    held = 4 * (5 * 3 + 2 * 5 + 2 + 5)
    assert ex.param_bytes[1] == ex.train_memory[1]["parameters"] == held == \
        sum(p.numel() * 4 for p in pm.shards(1).values())
    with torch.no_grad():   # inference: equal; the bias read without a gather
        inf = fxshard.parallelize(ref, _mesh(fsdp=2))
        torch.testing.assert_close(inf(x), ref(x), rtol=1e-4, atol=1e-4)
    assert _gathers_per_parameter(inf.rank_module(0)) == {"a_weight": 1, "a_bias": 0,
                                                         "b_weight": 1, "b_bias": 1}
    ex = inf.explain()
    assert [f for f, *_ in ex.fsdp_whole] == ["a.bias"] and ex.param_bytes[0] == held


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"fsdp": 2, "tp": 2}])
def test_inference_forward_on_fsdp(axes):
    model = _llama()
    ids, _ = _data()
    pm = fxshard.parallelize(model, _mesh(**axes))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    gm = pm.rank_module(0)
    assert set(_gathers_per_parameter(gm).values()) == {1}
    # one all-gather per layer (2), one for the norm and the head, the embedding's own
    buckets = _buckets(gm, "all_gather")
    assert [len(b) for b in buckets] == [1, 9, 9, 2], buckets
    per_rank = sum(p.numel() for p in gm.parameters())
    total = sum(p.numel() for p in model.parameters())
    ways = axes["fsdp"] * axes.get("tp", 1)
    assert total / ways <= per_rank <= 1.02 * total / ways


def _per_layer(gm, op: str) -> collections.Counter:
    """How many fsdp collectives ``op`` (own or bucketed) each layer's parameters take."""
    return collections.Counter(frozenset(_layer(f) for f in b) for b in _buckets(gm, op))


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"fsdp": 2, "tp": 2}, {"dp": 2, "fsdp": 2}])
def test_one_collective_per_layer_in_each_rank_program(axes):
    """A 2-layer Llama: each layer's 9 parameters are gathered by one collective in the
    forward and one in the backward, their gradients reduce-scattered by one (FSDP2's per
    layer grouping); the final norm and the head share one; the embedding is on its own
    (its backward reads no weight). 22 + 20 + 21 fsdp collectives per step become 4 + 3 + 4."""
    model = _llama(layers=2)
    ids, _ = _data()
    tm = parallelize_for_training(model, _mesh(**axes), example_inputs=(ids,))
    fwd, bwd = tm.rank_module(0, "forward"), tm.rank_module(0, "backward")
    layers = [frozenset({f"model.layers.{i}"}) for i in range(2)]
    outside = frozenset({"outside"})
    want = collections.Counter({layers[0]: 1, layers[1]: 1, outside: 2})
    assert _per_layer(fwd, "all_gather") == want
    assert _per_layer(bwd, "all_gather") == want - collections.Counter({outside: 1})
    assert _per_layer(bwd, "reduce_scatter") == want
    assert [len(b) for b in _buckets(bwd, "reduce_scatter")] == [2, 9, 9, 1]
    _check_structure(tm, len(list(model.parameters())))


class _Block(torch.nn.Module):
    """Uneven sizes: ``a``'s dim 0 (5) does not divide by 2 (stored split on dim 1), ``b``'s
    weight and bias on dim 0, a scale of 6."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5, bias=False)
        self.b = torch.nn.Linear(5, 6)
        self.scale = torch.nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        return x + self.scale * self.b(torch.tanh(self.a(x)))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale_in = torch.nn.Parameter(torch.rand(6) + 0.5)
        self.layers = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.head = torch.nn.Linear(6, 4, bias=False)
        self.scale_out = torch.nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        x = x * self.scale_in
        for layer in self.layers:
            x = layer(x)
        return self.head(x * self.scale_out)


def _peak_bytes(gm, mesh, spans) -> int:
    """The most bytes alive at once in ``gm`` of ``spans``' values: ``(issue, value)`` node
    pairs, each value alive from its issue to its last use."""
    from fxshard.placement import local_shape
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    live = [0] * len(nodes)
    for issue, g in spans:
        v = g.meta["val"]
        nbytes = math.prod(local_shape(tuple(v.shape), g.meta["fxshard_spec"], mesh)) * \
            v.element_size()
        for i in range(pos[issue], max(pos[u] for u in g.users) + 1):
            live[i] += nbytes
    return max(live)


def _live_gathered_peak(gm, mesh) -> int:
    """The most bytes of gathered fsdp weights alive at once in ``gm`` (each from its
    collective to its last use)."""
    spans = []
    for n in gm.graph.nodes:
        gathered = [u for u in n.users] if _is(n, "all_gather_bucket", FSDP) else \
            [n] if _is(n, "all_gather", FSDP) and _weight_inputs(n) else []
        spans += [(g, g) for g in gathered]
    return _peak_bytes(gm, mesh, spans)


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"dp": 2, "fsdp": 2}])
def test_uneven_buckets_train_as_one_device_within_one_layer_of_memory(axes):
    """Buckets mixing dims (0 and 1) and sizes: gradients and 3 AdamW steps equal one
    device; at no point of either program are more gathered weights alive than one bucket's
    (a layer's, or the head's with its scale)."""
    model = _Stack()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    mesh = _mesh(**axes)
    tm = parallelize_for_training(model, mesh, example_inputs=(x,))
    assert tm.shards(0)["layers.0.a.weight"].shape == (5, 3)
    fwd, bwd = tm.rank_module(0, "forward"), tm.rank_module(0, "backward")
    assert [len(b) for b in _buckets(fwd, "all_gather")] == [1, 4, 4, 4, 2]
    assert [len(b) for b in _buckets(bwd, "reduce_scatter")] == [2, 4, 4, 4, 1]
    _steps_equal(tm, model, x)
    spec = tm.spec
    layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    for gm in (fwd, bwd):
        assert 0 < _live_gathered_peak(gm, spec) <= layer


def _run_graph(gm):
    """The graph training's eager runner executes for rank program ``gm``
    (``post_emit.TRAINING`` on a copy; ``gm``, what ``rank_module`` shows, is unchanged)."""
    from fxshard.training.module import direct
    direct(gm)
    return gm.__dict__["_fxshard_direct"][2]


def _background(run):
    """``(start, wait)`` of every fsdp collective ``run`` issues in the background, in order,
    split into all-gathers and reduce-scatters."""
    from fxshard.ops import collectives as C
    gathers, scatters = [], []
    for n in run.graph.nodes:
        if n.op == "call_function" and n.target in C.START.values():
            assert n.args[2] == FSDP, n.format_node()
            (wait,) = n.users
            assert wait.target is C.collective_wait
            kind = gathers if n.target in (C.all_gather_start, C.all_gather_bucket_start) \
                else scatters
            kind.append((n, wait))
    return gathers, scatters


def _live_prefetched_peak(run, mesh) -> int:
    """``_live_gathered_peak`` of a run graph: a gathered weight is alive from the issue of
    its all-gather to its last use."""
    return _peak_bytes(run, mesh, [
        (start, g) for start, wait in _background(run)[0]
        for g in [u for u in wait.users if u.target is operator.getitem] or [wait]])


def test_fsdp_collectives_run_ahead_and_in_the_background():
    """``post_emit.prefetch_fsdp_pass`` on the programs training runs: every fsdp all-gather
    is issued as soon as the one before it was waited for (one ahead: the next layer's
    bucket travels behind this layer's matmuls), every reduce-scatter is waited for only
    before the next one (the backward's matmuls go on meanwhile); no fsdp collective is
    left synchronous; gathered weights alive at once: more than without the pass, at most
    twice. Gradients equal one device (as every test of this file, through these programs;
    on gloo: tests/test_train_distributed.py)."""
    model = _llama(layers=2)
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(fsdp=2, tp=2), example_inputs=(ids,))
    _check_grads(model, tm, ids, labels)
    mm = torch.ops.aten.mm.default

    def matmuls_between(run, a, b) -> int:
        nodes = list(run.graph.nodes)
        return sum(n.target is mm for n in nodes[nodes.index(a):nodes.index(b)])

    def layer(start) -> str:
        xs = start.args[0] if isinstance(start.args[0], (list, tuple)) else [start.args[0]]
        names = {x.meta.get("fxshard_param", "").split(".self_attn")[0].split(".mlp")[0]
                 .split(".input")[0].split(".post")[0] for x in xs}
        return "|".join(sorted(names))

    for kind in ("forward", "backward"):
        gm = tm.rank_module(0, kind)
        n_gathers = sum(_is(n, "all_gather", FSDP) or _is(n, "all_gather_bucket", FSDP)
                        for n in gm.graph.nodes)
        n_scatters = sum(_is(n, "reduce_scatter", FSDP) or _is(n, "reduce_scatter_bucket", FSDP)
                         for n in gm.graph.nodes)
        run = _run_graph(gm)
        gathers, scatters = _background(run)
        assert (len(gathers), len(scatters)) == (n_gathers, n_scatters), kind
        assert not any(_is(n, op, FSDP) for n in run.graph.nodes
                       for op in ("all_gather", "all_gather_bucket", "reduce_scatter",
                                  "reduce_scatter_bucket")), kind
        nodes = list(run.graph.nodes)
        for (s0, w0), (s1, w1) in zip(gathers, gathers[1:]):
            assert nodes.index(w0) < nodes.index(s1) < nodes.index(w1), (kind, s1.name)
        ahead = [layer(s) for s, w in gathers if matmuls_between(run, s, w)]
        for (s0, w0), (s1, w1) in zip(scatters, scatters[1:]):
            assert nodes.index(w0) < nodes.index(s1), (kind, s1.name)
        behind = [k for k, (s, w) in enumerate(scatters) if matmuls_between(run, s, w)]
        if kind == "forward":
            assert ahead == ["model.layers.1", "lm_head.weight|model.norm.weight"], ahead
            assert scatters == []
        else:   # the head's and layer 1's gradients travel behind layer 1's / layer 0's matmuls
            assert ahead == ["lm_head.weight|model.norm.weight", "model.layers.1",
                             "model.layers.0"], ahead
            assert behind == [0, 1], behind
        plain, prefetched = _live_gathered_peak(gm, tm.spec), _live_prefetched_peak(run, tm.spec)
        assert plain < prefetched <= 2 * plain, (kind, plain, prefetched)


def test_prefetch_on_a_hand_built_program():
    """``prefetch_fsdp_pass`` where the first node is itself an fsdp all-gather (its start
    must still come before its wait), a second all-gather of a computed value (issued right
    after that value exists) and a reduce-scatter (waited for before its reader): the
    rewritten program lints, and on a simulated fsdp=2 mesh gives what the plain one gives."""
    from fxshard.mesh import MeshSpec
    from fxshard.ops.collectives import START, collective_wait
    from fxshard.passes.post_emit import PostEmitCtx, prefetch_fsdp_pass
    from fxshard.runtime.simulated import SimulatedWorld
    ops = torch.ops.fxshard

    def program():
        graph = fx.Graph()
        w, x = graph.placeholder("w"), graph.placeholder("x")
        gw = graph.call_function(ops.all_gather.default, (w, 0, FSDP, 2))       # [4, 3]
        y = graph.call_function(torch.ops.aten.mm.default, (x, gw))             # [2, 3]
        t = graph.call_function(torch.ops.aten.tanh.default, (y,))
        gt = graph.call_function(ops.all_gather.default, (t, 0, FSDP, 2))       # [4, 3]
        z = graph.call_function(torch.ops.aten.mul.Tensor, (gt, 2.0))
        rs = graph.call_function(ops.reduce_scatter.default, (z, 0, FSDP, 2))   # [2, 3]
        graph.output((graph.call_function(torch.ops.aten.add.Tensor, (rs, 1.0)), y))
        return fx.GraphModule(torch.nn.Module(), graph)

    gm = prefetch_fsdp_pass(program(), ctx=PostEmitCtx())
    gm.graph.lint()
    names = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
             if n.op == "call_function"]
    assert names == ["all_gather_start", "collective_wait", "mm.default", "tanh.default",
                     "all_gather_start", "collective_wait", "mul.Tensor",
                     "reduce_scatter_start", "collective_wait", "add.Tensor"], names
    assert sum(n.target in START.values() for n in gm.graph.nodes) == 3
    assert all(n.target is not collective_wait or n.args[0].target in START.values()
               for n in gm.graph.nodes)
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(2, 3, generator=g) for _ in range(2)]
    xs = [torch.randn(2, 4, generator=g) for _ in range(2)]
    plain = program()
    with SimulatedWorld(MeshSpec((2,), (FSDP,))) as world:
        want = world.run(lambda r: plain(ws[r], xs[r]))
        got = world.run(lambda r: gm(ws[r], xs[r]))
    for a, b in zip(got, want):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
