"""Training on dp, tp and dp·tp: every parameter's gradient equals the single-device model's.

The loss is computed by the user on the returned logits (cross-entropy); the gradient of the
logits flows back into every rank's backward program. Sizes are uneven on purpose (hidden 48,
intermediate 72, vocab 96, sequence 6).
"""
import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
from fxshard.training import assemble, clip_grad_norm_, parallelize_for_training

V, B, S = 96, 4, 6


def _llama(layers=2, kv=2, tied=False):
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(num_hidden_layers=layers, vocab_size=V, hidden_size=48,
                           intermediate_size=72, num_attention_heads=4,
                           num_key_value_heads=kv, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def _data(seed=1, batch=B, seq=S):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (batch, seq), generator=g),
            torch.randint(0, V, (batch, seq), generator=g))


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _mesh(dp, tp):
    return fxshard.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _check_grads(model, tm, ids, labels, logits_of=lambda o: o):
    out = tm(ids)
    ref = model(ids)
    torch.testing.assert_close(logits_of(out), logits_of(ref), rtol=1e-4, atol=1e-4)
    _loss(logits_of(out), labels).backward()
    _loss(logits_of(ref), labels).backward()
    grads = tm.gradients()
    worst = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
        worst = max(worst, (grads[name] - p.grad).abs().max().item())
    return worst


def _collectives(tm, which):
    """(op, axis) -> count in rank 0's ``which`` program."""
    out = collections.Counter()
    for n in tm.rank_module(0, which).graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("fxshard."):
            op = str(n.target).split(".")[1]
            axis = next(a for a in n.args if isinstance(a, str))
            out[op, axis] += 1
    return out


def test_vocab_parallel_embedding_gradient():
    model = _llama(layers=1)
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(2, 2), embedding="vocab")
    _check_grads(model, tm, ids, labels)
    assert tm.shards(1)["model.embed_tokens.weight"].shape == (V // 2, 48)
    assert any(n.target is torch.ops.fxshard.vocab_embedding_backward.default
               for n in tm.rank_module(0, "backward").graph.nodes)


@pytest.mark.parametrize("dp,tp,sp", [(2, 1, False), (1, 2, False), (2, 2, False),
                                      (1, 2, True)])
def test_gradients_equal_single_device(dp, tp, sp):
    model = _llama()
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(dp, tp), sequence_parallel=sp)
    _check_grads(model, tm, ids, labels)
    n_params = len(list(model.parameters()))
    c = _collectives(tm, "backward")
    layers = 2
    if dp > 1:   # one all-reduce per parameter gradient: the rank's shards' bytes
        assert c["all_reduce", "dp"] == n_params
        moved = sum(x.tensor_bytes for x in tm.collectives("backward")
                    if x.op == "all_reduce" and x.axis == "dp")
        assert moved == tm.memory(0)["parameters"]
    if tp > 1 and not sp:
        # Megatron: the input gradient of each column-parallel block (attention, MLP) is
        # all-reduced once per layer, and the lm_head's input gradient once
        assert c["all_reduce", "tp"] == 2 * layers + 1
        assert set(k for k in c if k[1] == "tp") <= {("all_reduce", "tp"), ("local_shard", "tp")}
    if tp > 1 and sp:
        # Megatron-SP: the backward of each block's all-gather is a reduce-scatter (and of
        # the lm_head's), of each reduce-scatter an all-gather; the norms' weight gradients
        # (sequence-sharded data) all-reduced; the embedding's a sequence -> hidden exchange
        assert c["reduce_scatter", "tp"] == 2 * layers + 1
        assert c["all_gather", "tp"] == 2 * layers
        assert c["all_reduce", "tp"] == 2 * layers + 1
        assert c["all_to_all", "tp"] == 1
        f = _collectives(tm, "forward")
        # (+1: the lm_head's input; the logits leave as tp blocks, not gathered)
        assert f["all_gather", "tp"] == 2 * layers + 1 and f["reduce_scatter", "tp"] == 2 * layers


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2), (2, 2)])
def test_tied_embedding_gradient_sums_both_uses(dp, tp):
    model = _llama(layers=1, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(dp, tp))
    _check_grads(model, tm, ids, labels)
    assert "lm_head.weight" not in tm.shards(0)    # one shard per rank for the one tensor
    if tp > 1:   # vocab-parallel: both uses' gradients local, Megatron's all-reduces only
        assert tm.shards(0)["model.embed_tokens.weight"].shape == (V // tp, 48)
        c = _collectives(tm, "backward")
        assert c["all_reduce", "tp"] == 2 + 1 and c["all_gather", "tp"] == 0, c


@pytest.mark.parametrize("sp", [False, True])
def test_tied_table_tp_does_not_divide_trains_as_megatron(sp):
    """A tied table whose vocab (97) tp=2 does not divide, split on the hidden dim by
    ``plan=`` (by default it is padded and split on the vocab: tests/test_train_padded_vocab.py);
    the head's input gradient comes out hidden-sharded and is gathered where it is made
    (``refine.mirrored_inputs``), so every layer's backward is Megatron's: no weight changes
    layout (it all-to-all'ed two per linear before), the counts are a layer's."""
    torch.manual_seed(0)
    layers, vocab = 2, 97
    model = LlamaForCausalLM(LlamaConfig.tiny(
        num_hidden_layers=layers, vocab_size=vocab, hidden_size=48, intermediate_size=72,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, vocab, (B, S), generator=g) for _ in range(2))
    tm = parallelize_for_training(model, _mesh(1, 2), sequence_parallel=sp,
                                  plan={"model.embed_tokens": "embed_dim"})
    _check_grads(model, tm, ids, labels)
    assert tm.shards(0)["model.embed_tokens.weight"].shape == (vocab, 24)
    c = _collectives(tm, "backward")
    assert c["all_to_all", "tp"] == 0, c
    if sp:   # per layer: two gathers, two reduce-scatters; the head's gradient; the table's
        assert c["all_gather", "tp"] == 2 * layers + 1, c
        assert c["reduce_scatter", "tp"] == 2 * layers + 1, c
    else:    # per layer: Megatron's two all-reduces; the head's input gradient gathered
        assert c["all_reduce", "tp"] == 2 * layers and c["all_gather", "tp"] == 1, c


class _TransposedProjection(torch.nn.Module):
    """``(w @ x^T)^T``: the weight is the matmul's first operand and the activation a
    transposed second one (autograd computes its gradient as ``t(mm(w^T, t(grad)))``);
    B*S = 24 tokens, as many as the weight's rows."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(torch.randn(24, 16) * 0.1)
        self.head = torch.nn.Linear(24, 32, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        y = (self.proj.weight @ x.reshape(-1, x.shape[-1]).t()).t()
        return self.head(torch.relu(y)).reshape(*ids.shape, -1)


def test_matmul_input_gradients_matched_by_operand_not_shape():
    """``refine.mirrored_inputs`` leaves a matmul whose gradients only share shapes with its
    inputs alone: the backward is the column-parallel one (the embedding's gradient
    reduce-scattered), not all-to-alls into a layout the forward never had."""
    torch.manual_seed(0)
    model, ids = _TransposedProjection(), torch.randint(0, 32, (4, 6))
    tm = parallelize_for_training(model, _mesh(1, 2), plan={"proj": "colwise"})
    out = tm(ids)
    ref = model(ids)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = tm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    c = _collectives(tm, "backward")
    assert {k: v for k, v in c.items() if k[0] != "local_shard"} == \
        {("reduce_scatter", "tp"): 1}, c


def test_rank_programs_are_readable_and_split():
    model = _llama(layers=1)
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(1, 2), example_inputs=(ids,))
    fwd, bwd = tm.rank_module(0, "forward"), tm.rank_module(1, "backward")
    names = [n.name for n in fwd.graph.nodes if n.op == "placeholder"]
    assert names[0] == "model_embed_tokens_weight" and names[-1] == "input_0"
    bnames = [n.name for n in bwd.graph.nodes if n.op == "placeholder"]
    assert bnames[-1] == "grad_output_0" and any(b.startswith("saved_") for b in bnames)
    assert not any(n.meta.get("fxshard_tangent") is not None for n in fwd.graph.nodes)
    # the backward returns one gradient per parameter, shaped like the rank's shard
    out = next(n for n in bwd.graph.nodes if n.op == "output").args[0]
    assert len(out) == len(tm.shards(1))
    _loss(tm(ids), labels).backward()
    for r in range(2):
        for name, p in tm.shards(r).items():
            assert p.grad is not None and p.grad.shape == p.shape, (r, name)
    assert tm.shards(0)["model.layers.0.mlp.up_proj.weight"].shape == (36, 48)
    # parameters, gradients per rank: half the model plus the replicated norms (3 x 48)
    total = sum(p.numel() for p in model.parameters()) * 4
    mem = tm.memory(1)
    assert mem["parameters"] == mem["gradients"] == (total - 3 * 48 * 4) // 2 + 3 * 48 * 4
    assert mem["saved"] > 0
    assert tm.shards(0)["model.layers.0.mlp.down_proj.weight"].shape == (48, 36)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_optimizer_steps_equal_single_device(opt):
    model = _llama(layers=1)
    ids, labels = _data()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tm = parallelize_for_training(model, _mesh(2, 2), example_inputs=(ids,))
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if opt == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6))
    ours = make(tm.parameters())
    norms = []  # the gradient norm before clipping: above 0.5, so every step clips
    for step in range(3):
        ours.zero_grad()
        _loss(tm(ids), labels).backward()
        norms.append(clip_grad_norm_(tm, 0.5))
        ours.step()
    # the model keeps its initial weights: fxshard trains the shards
    for k, v in model.state_dict().items():
        assert torch.equal(v, initial[k]), k
    assert all(n > 0.5 for n in norms), norms
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
    # replicated parameters stay equal on every rank
    norm = "model.layers.0.input_layernorm.weight"
    for r in range(1, 4):
        assert torch.equal(tm.shards(r)[norm], tm.shards(0)[norm])


def test_hf_llama_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=72,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids, labels = _data()
    for dp, tp in [(2, 2), (1, 4)]:     # tp 4 > 2 KV heads: K/V projections replicated
        model.zero_grad()
        tm = parallelize_for_training(model, _mesh(dp, tp))
        _check_grads(model, tm, ids, labels, logits_of=lambda o: o.logits)
    # the loss inside the graph (labels=): vocab-parallel (tests/test_vocab_loss.py), no
    # fallback for the loss's ops; the gradients equal one device's
    model.zero_grad()
    tm = parallelize_for_training(model, _mesh(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tm(ids, labels=labels)
    assert not any("nll_loss" in str(w.message) or "softmax" in str(w.message) for w in caught)
    ref = model(ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    grads = tm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


@settings(max_examples=4)
@given(mesh=st.sampled_from([(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]),
       layers=st.integers(1, 2), batch=st.sampled_from([4, 8]), seq=st.sampled_from([3, 5]),
       seed=st.integers(0, 3))
def test_gradients_property(mesh, layers, batch, seq, seed):
    dp, tp = mesh
    model = _llama(layers=layers)
    ids, labels = _data(seed, batch=batch, seq=seq)
    tm = parallelize_for_training(model, _mesh(dp, tp))
    _check_grads(model, tm, ids, labels)


def test_tp_beyond_unrepeated_kv_heads():
    # the bundled Llama attends with unrepeated KV heads (enable_gqa): on tp=4 its 2 KV heads
    # are repeated in the joint graph and their gradient summed back over each group
    model = _llama(layers=2)
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(1, 4))
    _check_grads(model, tm, ids, labels)
    assert tm.shards(3)["model.layers.0.self_attn.k_proj.weight"].shape == (24, 48)   # whole
    assert tm.shards(3)["model.layers.0.self_attn.q_proj.weight"].shape == (12, 48)


def test_assemble_sums_partial_and_places_shards():
    from fxshard.mesh import mesh_spec
    from fxshard.placement import P, R, Shard, local_block
    spec_mesh = mesh_spec(_mesh(2, 2))
    t = torch.arange(24.0).reshape(4, 6)
    for spec in [(R, Shard(0)), (Shard(1), Shard(0)), (P, Shard(1)), (R, R), (Shard(0), P)]:
        blocks = [local_block(t, spec, spec_mesh, r) for r in range(4)]
        assert torch.equal(assemble(blocks, (4, 6), spec, spec_mesh), t), spec


def test_unsupported_axes_are_errors_dropout_trains():
    model = _llama(layers=1)
    ids, _ = _data()
    mesh = fxshard.init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "tp"))
    with pytest.raises(NotImplementedError, match="'pp' of size 2.*one program per stage"):
        parallelize_for_training(model, mesh, example_inputs=(ids,))

    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return F.dropout(self.lin(x), p=0.1, training=True)

    # dropout trains now (tests/test_train_dropout.py): the same masks as one device
    from fxshard.training.dropout import same_masks
    x, model = torch.randn(2, 8), Drop()
    tm = parallelize_for_training(copy.deepcopy(model), _mesh(2, 1), example_inputs=(x,))
    torch.manual_seed(5)
    tm(x).sum().backward()
    torch.manual_seed(5)
    with same_masks():
        model(x).sum().backward()
    torch.testing.assert_close(tm.gradients()["lin.weight"], model.lin.weight.grad)


class _BackwardOps(torch.nn.Module):
    """A model whose backward holds slice_backward, select_backward, softmax's and
    log-softmax's backward, embedding_dense_backward, threshold/gelu backward and a mean."""

    def __init__(self, vocab=10, e=6, h=12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, e)
        self.up = torch.nn.Linear(e, h)
        self.down = torch.nn.Linear(h, e, bias=False)
        self.norm = torch.nn.LayerNorm(e)

    def forward(self, ids):
        x = self.emb(ids)
        a = F.gelu(self.up(x)) + torch.relu(self.up(x)[..., :1])
        y = self.down(torch.softmax(a, dim=-1) * a)
        z = torch.cat([y[:, :, 2:], y[:, :, :2]], dim=-1) + y.select(-1, 0).unsqueeze(-1)
        return F.log_softmax(self.norm(z + x), dim=-1) + x.mean(dim=1, keepdim=True)


@settings(max_examples=6)
@given(mesh=st.sampled_from([(2, 1), (1, 2), (2, 2), (3, 1), (1, 3)]),
       seq=st.sampled_from([2, 3, 5]), seed=st.integers(0, 5))
def test_backward_op_rules_property(mesh, seq, seed):
    dp, tp = mesh
    torch.manual_seed(seed)
    model = _BackwardOps()
    ids = torch.randint(0, 10, (dp * 2, seq), generator=torch.Generator().manual_seed(seed))
    target = torch.randn(dp * 2, seq, 6, generator=torch.Generator().manual_seed(seed + 1))
    tm = parallelize_for_training(model, _mesh(dp, tp))
    out = tm(ids)
    ref = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    ((out - target) ** 2).mean().backward()
    ((ref - target) ** 2).mean().backward()
    grads = tm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_partial_bias_trains_on_one_coordinate():
    # a row-parallel bias is a Partial parameter (coordinate 0 holds it, the others zeros):
    # its gradient goes to coordinate 0 only, so an elementwise optimizer keeps the zeros
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(num_hidden_layers=1, vocab_size=V, hidden_size=48,
                           intermediate_size=72, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg)
    ids, labels = _data()
    tm = parallelize_for_training(model, _mesh(1, 2), example_inputs=(ids,))
    bias = "model.layers.0.mlp.down_proj.bias"
    assert isinstance(tm._specs[bias][1], torch.distributed.tensor.Partial)
    ours = torch.optim.AdamW(tm.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    for _ in range(2):
        ours.zero_grad()
        theirs.zero_grad()
        _loss(tm(ids), labels).backward()
        _loss(model(ids), labels).backward()
        ours.step()
        theirs.step()
    trained = tm.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert not tm.shards(1)[bias].any() and tm.shards(0)[bias].any()


def test_cross_entropy_on_returned_logits_moves_no_logits():
    # pm(x) returns the logits as the column-parallel lm_head's [B, S, V/tp] blocks
    # (fxshard.training.vocab_output), which read as the whole [B, S, V]; a cross-entropy on
    # them is vocab-parallel, so neither program moves logits (the blocks leave the forward,
    # their gradients enter the backward)
    from fxshard.training.vocab_output import VocabShardedTensor
    torch.manual_seed(0)
    vocab = 80    # V/tp = 40, unlike any other size of the model
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1, vocab_size=vocab,
                                              hidden_size=48, intermediate_size=72,
                                              num_attention_heads=4, num_key_value_heads=2))
    ids, labels = (t % vocab for t in _data())
    tm = parallelize_for_training(model, _mesh(1, 2))
    _check_grads(model, tm, ids, labels)
    out = tm(ids)
    assert isinstance(out, VocabShardedTensor) and out.shape == (B, S, vocab)
    assert [tuple(b.shape) for b in out.blocks] == [(B, S, vocab // 2)] * 2
    moved = [(w, c.op, c.shape, c.wire_bytes) for w in ("forward", "backward")
             for c in tm.collectives(w) if c.shape[-1] in (vocab, vocab // 2)]
    assert moved == [], moved


def test_compiled_training_programs_equal_single_device():
    # compile=True: the forward and backward rank programs are Inductor-compiled once each
    # (every rank calls the same function with its own weights, saved values, gradients);
    # on fsdp2·tp2: fsdp's bucket gathers / reduce-scatters and tp's all-reduces as extern
    # calls in Inductor's code, the logits left as blocks over both axes
    model = _llama(layers=1)
    ids, labels = _data()
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    tm = parallelize_for_training(model, mesh, compile=True)
    _check_grads(model, tm, ids, labels)
    compiled = tm._last.compiled
    assert set(compiled) == {"forward", "backward"}
    assert not any(isinstance(f, torch.fx.GraphModule) for f in compiled.values())
    ours, theirs = (torch.optim.AdamW(ps, lr=1e-3, eps=1e-6) for ps in (tm.parameters(),
                                                              model.parameters()))
    ours.step()
    theirs.step()
    for _ in range(2):
        ours.zero_grad()
        theirs.zero_grad()
        _loss(tm(ids), labels).backward()
        _loss(model(ids), labels).backward()
        ours.step()
        theirs.step()
    assert set(tm._last.compiled) == {"forward", "backward"}    # compiled once, reused
    trained = tm.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
