"""Training HF models with fused projections and experts: GPT-2 (``Conv1D`` ``c_attn``, tied
embeddings), Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``), Mixtral (MoE), Qwen2 with tied
embeddings. On tp the fused weights are strided shards (each rank its share of every part) and
so are their gradients: the backward of the forward's split is a local cat / a pad into the
fused layout, never a gather. A tied table is vocab-sharded for both uses (the lookup and the
column-parallel lm_head): each rank's gradient is its ``[V/tp, H]`` rows, both uses' added
locally. Every parameter's gradient and three AdamW steps with ``clip_grad_norm_`` equal one
device's."""
import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.placement import local_shape
from fxshard.training import clip_grad_norm_, parallelize_for_training
from tests.train_checks import adamw_steps_equal, expert_rows

transformers = pytest.importorskip("transformers")

V, B, S = 96, 4, 6
TV = 90     # the tied models' vocab: 45 rows per tp rank, unlike any other size


def _gpt2(vocab=TV):
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=48, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _phi3(kv_heads=2):
    cfg = transformers.Phi3Config(vocab_size=V, hidden_size=48, intermediate_size=72,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=kv_heads, max_position_embeddings=32,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.Phi3ForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=48, intermediate_size=40,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.MixtralForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=TV, hidden_size=48, intermediate_size=72,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, pad_token_id=0, bos_token_id=0,
                                   eos_token_id=0)
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3():     # q/k norms over each head's width
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=48, intermediate_size=72,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=12, max_position_embeddings=32,
                                   pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.Qwen3ForCausalLM(cfg)


def _mistral():
    cfg = transformers.MistralConfig(vocab_size=V, hidden_size=48, intermediate_size=72,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=1, max_position_embeddings=32,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.MistralForCausalLM(cfg)


def _bloom():     # ALiBi: baddbmm over a merged [B*H] dim, heads on tp
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=48, n_layer=2, n_head=4,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.BloomForCausalLM(cfg)


def _deepseek_v2():   # MLA (expand_kv writes into a fresh tensor: aten.copy) and MoE
    cfg = transformers.DeepseekV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=24,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.DeepseekV2ForCausalLM(cfg)


_MODELS = {"gpt2": _gpt2, "bloom": _bloom, "deepseek_v2": _deepseek_v2, "phi3": _phi3, "mixtral": _mixtral, "qwen2": _qwen2,
           "qwen3": _qwen3, "mistral": _mistral,
           "gpt2_odd": lambda: _gpt2(vocab=TV + 1),    # 91 rows: tp=2 cannot split them
           "phi3_mqa": lambda: _phi3(kv_heads=1)}      # tp=2 > 1 KV head: K/V kept whole


def _model(name):
    torch.manual_seed(0)
    return _MODELS[name]().train()


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (B, S), generator=g),
            torch.randint(0, V, (B, S), generator=g))


def _mesh(dp, tp, batch="dp"):
    return fxshard.init_device_mesh("cpu", (dp, tp), mesh_dim_names=(batch, "tp"))


def _loss(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _collectives(tm, which):
    out = collections.Counter()
    for n in tm.rank_module(0, which).graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("fxshard."):
            out[str(n.target).split(".")[1], next(a for a in n.args if isinstance(a, str))] += 1
    return out


def _train_equal(name, dp, tp, steps=3, lr=1e-2, batch="dp", sequence_parallel=False,
                 plan=None):
    """Gradients of the first step, then ``steps`` AdamW steps with clipping: equal one
    device's. Returns the TrainModule."""
    model = _model(name)
    ref = copy.deepcopy(model)
    ids, labels = (t % model.config.vocab_size for t in _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = parallelize_for_training(model, _mesh(dp, tp, batch), example_inputs=(ids,),
                                      sequence_parallel=sequence_parallel, plan=plan)
    # eps 1e-6: GPT-2's key bias has a gradient of zero in exact arithmetic (softmax is
    # shift-invariant), rounding noise of ~1e-10 on one device and on ours; Adam's
    # m / (sqrt(v) + eps) with the default eps 1e-8 turns that noise into an update of
    # arbitrary sign, with 1e-6 into one below 1e-4 * lr
    # (the same goes for any element whose gradient is near eps: GPT-2 with vocab 90 has a
    # c_proj element of 3.5e-7 whose 1.5e-8 of fp32 rounding (on one device as on ours) moves
    # Adam's first update by 0.3%, 2.6e-5 at lr 1e-2: the tied models step at lr 1e-3)
    ours = torch.optim.AdamW(tm.parameters(), lr=lr, eps=1e-6, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-6, weight_decay=0.1)
    for step in range(steps):
        ours.zero_grad()
        theirs.zero_grad()
        out, want = tm(ids), ref(ids)
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
        _loss(out, labels).backward()
        _loss(want, labels).backward()
        if step == 0:
            grads = tm.gradients()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
        norm = clip_grad_norm_(tm, 0.5)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5),
                                   rtol=1e-5, atol=1e-6)
        ours.step()
        theirs.step()
    trained = tm.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)
    return tm


@pytest.mark.parametrize("name,dp", [("gpt2", 1), ("gpt2", 2), ("phi3", 1), ("phi3", 2)])
def test_fused_projections_train_on_tp(name, dp):
    tm = _train_equal(name, dp, 2, lr=1e-3 if name == "gpt2" else 1e-2)
    fused = "transformer.h.0.attn.c_attn.weight" if name == "gpt2" else \
        "model.layers.0.self_attn.qkv_proj.weight"
    assert type(tm._specs[fused][1]).__name__ == "StridedShard", tm._specs[fused]
    # no gather of a fused tensor in either program: q, k, v (gate, up) and their gradients
    # stay split per rank (the fused dim is 144 = 3 x 48 whole, 72 per rank)
    for which in ("forward", "backward"):
        for c in tm.collectives(which):
            assert c.op in ("all_reduce", "all_gather", "local_shard", "partial_from_replicate")
            assert c.op != "all_gather" or c.shape[-1] not in (72, 144), (which, c)
    if name == "gpt2":
        _assert_vocab_parallel(tm, "transformer.wte.weight", dp)
    # Megatron: one all-reduce per block's input gradient, and the lm_head's (GPT-2's
    # LayerNorm backward takes it reduced: its weight and bias gradients need no more)
    c = _collectives(tm, "backward")
    assert c["all_reduce", "tp"] == 2 * 2 + 1 and c["all_gather", "tp"] == 0, c


def _assert_vocab_parallel(tm, table, dp, vocab=TV):
    """The tied ``table`` [vocab, 48] vocab-sharded on tp (padded to an even V where tp does
    not divide ``vocab``), both uses' gradients the rank's rows: no op of the backward names
    V (the whole table's gradient, its slice), no collective moves vocab-sized data; the
    lookup's backward and the lm_head's gradient matmul have V/2 rows, and the table's
    gradient is their local sum."""
    V = -(-vocab // 2) * 2
    assert tm._specs[table][1] == fxshard.Shard(0) and tm.shards(1)[table].shape == (V // 2, 48)
    g = tm.rank_module(0, "backward").graph
    for n in g.nodes:
        ints = [a for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
                if isinstance(a, int)]
        assert V not in ints and vocab not in ints, n.format_node()
    for which in ("forward", "backward"):
        moved = [c for c in tm.collectives(which)
                 if c.axis == "tp" and (V in c.shape or V // 2 in c.shape)]
        # the returned logits are the ranks' [B, S, V/2] blocks (fxshard.training.vocab_output):
        # neither program moves them over tp
        assert moved == [], (which, moved)
    lookup = [n for n in g.nodes if n.target is torch.ops.fxshard.vocab_embedding_backward.default]
    assert len(lookup) == 1 and lookup[0].args[2] == V // 2, lookup
    (tied_sum,) = lookup[0].users
    assert tied_sum.target is torch.ops.aten.add.Tensor
    # the lm_head's gradient: t(mm(t(grad [B*S, V/2]), x)) -> [V/2, H]
    mm = next(a for a in tied_sum.args if a is not lookup[0])
    while mm.target is torch.ops.aten.t.default:
        mm = mm.args[0]
    assert mm.target is torch.ops.aten.mm.default, mm.format_node()
    grad_view = mm.args[0].args[0]
    assert list(grad_view.args[1]) == [B // dp * S, V // 2], grad_view.format_node()


@pytest.mark.parametrize("name,sp", [("qwen2", False), ("gpt2_odd", False), ("gpt2_odd", True)])
def test_tied_embeddings_train_on_dp_tp(name, sp):
    # dp2·tp2: a tied Qwen2 vocab-parallel; GPT-2 with 91 rows too, padded to 92
    # (fxshard.passes.pad_vocab), also with sequence parallelism
    tm = _train_equal(name, 2, 2, steps=2, lr=1e-3, sequence_parallel=sp)
    table = "model.embed_tokens.weight" if name == "qwen2" else "transformer.wte.weight"
    assert "lm_head.weight" not in tm.shards(0)
    if not sp:
        _assert_vocab_parallel(tm, table, 2, vocab=TV if name == "qwen2" else TV + 1)
    else:
        assert tm._specs[table][1] == fxshard.Shard(0) and tm.shards(3)[table].shape == (46, 48)
        # the lookup's gradient: the tokens' [B, S, H] gradient gathered from the sequence
        # shards, each rank its own rows (a partial [92, 48] from the rank's tokens,
        # reduce-scattered, moved the whole table's size: more, with 92 rows > 24 tokens)
        moved = [(c.op, c.shape) for c in tm.collectives("backward")
                 if c.axis == "tp" and c.shape and c.shape[0] in (TV + 1, TV + 2)]
        assert moved == [], moved
        gathered = [c.shape for c in tm.collectives("backward")
                    if c.axis == "tp" and c.op == "all_gather" and len(c.shape) == 3]
        assert gathered == [(B // 2, S // 2, 48)], gathered


def test_tied_table_split_on_hidden_dim_with_sequence_parallel():
    """GPT-2 with 91 rows on dp2·tp2 with sequence parallelism, the table split on its hidden
    dim by ``plan=`` (Megatron-SP's layout): trains equal, with Megatron-SP's collectives."""
    tm = _train_equal("gpt2_odd", 2, 2, steps=2, lr=1e-3, sequence_parallel=True,
                      plan={"transformer.wte": "embed_dim"})
    table = "transformer.wte.weight"
    assert tm._specs[table][1] == fxshard.Shard(1), tm._specs[table]
    assert tm.shards(3)[table].shape == (TV + 1, 24)
    # the lm_head's weight gradient contracts the sequence-sharded tokens: the logits'
    # gradient [TV+1, B/dp*S] (replicated on tp) is sliced locally into the flattened
    # tokens' fused layout, each batch row's sequence half (B/dp = 2 parts of S = 6),
    # with no communication; the partial [TV+1, 48] is reduce-scattered to the rank's half
    shards = [n for n in tm.rank_module(0, "backward").graph.nodes
              if getattr(n.meta.get("fxshard_collective"), "op", None) == "fused_shard"]
    fused = [n for n in shards if n.args[1] == 1]
    assert [(str(n.target), n.args[1:]) for n in fused] == \
        [("fxshard.local_shard.default", (1, "tp", 2))] * (B // 2), shards
    # and the head's input gradient [B/dp*S, H], gathered where it is made
    # (training/refine.py::mirrored_inputs), is sliced into the same token layout
    assert [n.args[1:] for n in shards if n not in fused] == [(0, "tp", 2)] * (B // 2)
    mesh = fxshard.mesh.MeshSpec((2, 2), ("dp", "tp"))
    assert [local_shape(n.args[0].meta["val"].shape, n.args[0].meta["fxshard_spec"], mesh)
            for n in fused] == [(TV + 1, S)] * 2
    # Megatron-SP's backward: each block's (2 layers, attention and MLP) input gradient
    # reduce-scattered onto the LayerNorm's tokens and gathered for the block below; the
    # table's gradient reduce-scattered, the head's input gradient gathered once; on tp
    # only the LayerNorms' [48] weight and bias gradients are all-reduced (the blocks'
    # [B, S, H] input gradients were all-reduced whole, x gathered for the norm)
    c = _collectives(tm, "backward")
    assert c["reduce_scatter", "tp"] == 2 * 2 + 1 and c["all_gather", "tp"] == 2 * 2 + 1, c
    assert {x.shape for x in tm.collectives("backward")
            if x.op == "all_reduce" and x.axis == "tp"} == {(48,)}


class _SideBlock(torch.nn.Module):
    """A block whose ``side`` projection (kept whole on tp by the plan) reads the norm's
    output beside q's gather and is only added into the residual."""

    def __init__(self, d=32):
        super().__init__()
        self.norm, self.q, self.o = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), \
            torch.nn.Linear(2 * d, d)
        self.side = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.o(torch.relu(self.q(h))) + self.side(h)


def test_whole_weight_matmul_beside_a_gather_keeps_the_shard_when_nothing_moves():
    """Under sequence parallelism a whole-weight matmul reads the token shard unless its own
    result is moved further down (the K/V case above): added into the residual, it stays on
    the rank's tokens (tp times less compute), though a collective (the next block's gather)
    lies further down the residual stream."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), _SideBlock(), _SideBlock(),
                                torch.nn.Linear(32, 64, bias=False))
    ids = torch.randint(0, 64, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, 2, "dp"), example_inputs=(ids,),
                                 sequence_parallel=True, plan={"*.side": "replicate"})
        with torch.no_grad():
            torch.testing.assert_close(pm(ids), model(ids), rtol=0, atol=1e-5)
    assert "0 gathered for whole weights" in str(pm.explain())
    sides = [n for n in pm.rank_module(0).graph.nodes if n.target is torch.ops.aten.linear.default
             and n.meta["val"].shape[-1] == 32 and "side" in str(n.args[1])]
    assert len(sides) == 2 and all(n.args[0].meta["fxshard_spec"] == (
        fxshard.Replicate(), fxshard.Shard(1)) for n in sides), \
        [(n.name, n.args[0].format_node(), n.args[0].meta.get("fxshard_spec")) for n in sides]


def test_a_plan_places_a_tied_table_alike_in_both_programs():
    """GPT-2 with 91 rows on tp=2: padded and vocab-parallel by default
    (tests/test_train_padded_vocab.py); a plan naming either of the tied names places the
    table on its hidden dim in inference and training alike (the trace keeps
    ``lm_head.weight`` in one program, ``transformer.wte.weight`` in the other: a plan on
    ``lm_head`` used to miss the training program)."""
    ids, labels = (t % (TV + 1) for t in _data())
    mesh = _mesh(1, 2, "dp")
    for plan in ({"transformer.wte": "embed_dim"}, {"lm_head": "embed_dim"}):
        pm = fxshard.parallelize(_model("gpt2_odd"), mesh, example_inputs=(ids,), plan=plan)
        with torch.no_grad():
            pm(ids)
            held = dict(pm.rank_module(1).named_parameters())
            table = held.get("lm_head.weight", held.get("transformer.wte.weight"))
            assert table.shape == (TV + 1, 24), (plan, table.shape)
        _loss(pm(ids), labels).backward()
        assert pm.shards(1)["transformer.wte.weight"].shape == (TV + 1, 24), plan
    with pytest.raises(ValueError, match=r"plan= places the tied parameter .*two ways.*"
                                         r"lm_head\.weight by 'lm_head': 'colwise'"):
        pm = fxshard.parallelize(_model("gpt2"), mesh, example_inputs=(ids % TV,),
                                 plan={"lm_head": "colwise", "transformer.*": "replicate"})
        with torch.no_grad():
            pm(ids % TV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(_model("gpt2"), mesh, example_inputs=(ids % TV,),
                                 plan={"lm_head": "replicate"})
        with torch.no_grad():
            pm(ids % TV)
            held = dict(pm.rank_module(1).named_parameters())
            table = held.get("lm_head.weight", held.get("transformer.wte.weight"))
            assert table.shape == (TV, 48), table.shape   # whole in inference too
        _loss(pm(ids % TV), labels % TV).backward()
    assert pm.trainer._specs["transformer.wte.weight"] == (fxshard.Replicate(),) * 2
    assert pm.shards(1)["transformer.wte.weight"].shape == (TV, 48)


def test_replicated_kv_heads_read_the_sequence_gather():
    """Mistral with 1 KV head on dp2·tp2 with sequence parallelism: k_proj and v_proj stay
    whole on tp and read the norm's output from the gather q_proj needs anyway (Megatron's
    replicated KV heads), not from the rank's tokens. Computed on the token shard, K and V
    were all-to-all'ed to the heads in the forward (4 all-to-alls, 2 layers) and their weight
    gradients, partial sums over the tokens, all-reduced in the backward (4 [12, 48])."""
    tm = _train_equal("mistral", 2, 2, steps=2, lr=1e-3, sequence_parallel=True)
    fwd, bwd = _collectives(tm, "forward"), _collectives(tm, "backward")
    assert fwd["all_to_all", "tp"] == 1, fwd   # the embedding's output onto the tokens
    assert fwd["all_gather", "tp"] == 2 * 2 + 1 and fwd["reduce_scatter", "tp"] == 2 * 2, fwd
    reduced = collections.Counter(x.shape for x in tm.collectives("backward")
                                  if x.op == "all_reduce" and x.axis == "tp")
    # each layer's 2 norm weights, the final norm; K's and V's [B/dp*S, 12] gradients
    assert reduced == {(48,): 2 * 2 + 1, (B // 2 * S, 12): 2 * 2}, reduced
    model = _model("mistral").eval()
    ids = _data()[0] % model.config.vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(2, 2, "dp"), example_inputs=(ids,),
                                 sequence_parallel=True)
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    kinds = collections.Counter(str(n.target).split(".")[1] for n in
                                pm.rank_module(0).graph.nodes if "tp" in n.args)
    assert kinds["all_to_all"] == 1 and kinds["all_gather"] == 2 * 2 + 2, kinds


@pytest.mark.parametrize("name", ["gpt2", "gpt2_odd"])
def test_fused_bias_kept_whole_on_fsdp_tp(name):
    """fsdp2·tp2: GPT-2's fused ``c_attn.bias`` (144 = 48+48+48, split part by part on tp)
    has no dim fsdp can shard: it is stored whole on fsdp (as on dp), never all-gathered, its
    gradient all-reduced over fsdp once; every other parameter is an fsdp shard."""
    from fxshard.explain import explain_training
    tm = _train_equal(name, 2, 2, batch="fsdp", lr=1e-3)
    biases = [f"transformer.h.{i}.attn.c_attn.bias" for i in range(2)]
    for b in biases:
        assert tm._specs[b][0] == fxshard.Replicate(), tm._specs[b]
        assert type(tm._specs[b][1]).__name__ == "StridedShard", tm._specs[b]
        assert tm.shards(3)[b].shape == (72,)
    whole = {f for f, spec in tm._specs.items() if spec[0] == fxshard.Replicate()}
    assert whole == set(biases), whole
    fwd, bwd = (tm.rank_module(0, w).graph for w in ("forward", "backward"))
    mesh = fxshard.mesh.MeshSpec((2, 2), ("fsdp", "tp"))
    for g in (fwd, bwd):
        for p in g.nodes:
            if p.op == "placeholder" and p.meta.get("fxshard_param") in biases:
                assert not [u for u in p.users if "all_gather" in str(u.target)], p.users
    out = next(n for n in bwd.nodes if n.op == "output")
    reduced = [a for a in out.args[0] if isinstance(a, torch.fx.Node) and
               a.target is torch.ops.fxshard.all_reduce.default and "fsdp" in a.args]
    assert [local_shape(a.args[0].meta["val"].shape, a.args[0].meta["fxshard_spec"], mesh)
            for a in reduced] == [(72,)] * 2, reduced
    for a in reduced:   # the one fsdp collective on the bias's gradient
        chain = [a.args[0]]
        while chain[-1].meta.get("fxshard_collective") is not None:
            chain.append(chain[-1].args[0])
        assert not any("fsdp" in n.args for n in chain if n.op == "call_function"), chain
    if name == "gpt2":   # the 2 other all-reduces: c_fc.bias [192], fsdp nested in tp's shard
        c = _collectives(tm, "backward")   # of its dim 0 (gathered on tp, reduced, sliced)
        bucket = torch.ops.fxshard.reduce_scatter_bucket.default
        scattered = sum(len(n.args[0]) if n.target is bucket else 1 for n in bwd.nodes
                        if n.op == "call_function" and "fsdp" in n.args
                        and "reduce_scatter" in str(n.target))
        assert c["all_reduce", "fsdp"] == 4 and scattered == 24, (c, scattered)  # the others
        assert c["reduce_scatter_bucket", "fsdp"] >= 2, c     # at least one per layer
    text = str(explain_training(tm, tm))
    assert "Parameters kept whole on fsdp (no dim takes a shard; gradient all-reduced): 2, " \
        "576 bytes per rank" in text, text
    assert "transformer.h.1.attn.c_attn.bias (144,): 288 bytes per rank; dim 0 is split part " \
        "by part on tp (S(0|48+48+48))" in text, text
    # inference on the same mesh: equal, the bias an attribute read without a gather
    model = _model(name).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(2, 2, "fsdp"))
        ids = _data()[0] % model.config.vocab_size
        torch.testing.assert_close(pm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    gm = pm.rank_module(0)
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in biases]
    assert len(attrs) == 2 and not [u for a in attrs for u in a.users
                                    if "all_gather" in str(u.target)], attrs
    assert "Parameters kept whole on fsdp" in str(pm.explain())


@pytest.mark.parametrize("dp,tp,batch", [(1, 2, "dp"), (2, 1, "dp"), (2, 2, "dp"),
                                         (2, 1, "fsdp")])
def test_moe_trains(dp, tp, batch):
    """Mixtral (2 layers, T = 24 tokens, top-2, H = 48): on a batch axis each rank sorts,
    multiplies and adds back its own T*k/dp routed rows in forward and backward (no gather
    of the tokens); on tp the experts' partial output is reduced once per layer on [T, H]
    (after the un-permute and the sum over top-k), its gradient on [T, H] and the router's
    [T, k] gradient, never on the [T*k, H] rows."""
    tm = _train_equal("mixtral", dp, tp, steps=2, batch=batch)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"   # [E, 2I, H]: gate|up fused
    router = [c for c in tm.collectives("backward") if c.shape == (4, 48)]   # [E, H]
    if tp > 1:
        assert type(tm._specs[gate_up][1]).__name__ == "StridedShard", tm._specs[gate_up]
        assert tm.shards(1)[gate_up].shape == (4, 40, 48)
        # every tp rank routes every token: the router's gradient whole on tp
        assert all(c.axis != "tp" for c in router), router
    if batch == "dp" and dp > 1:   # the router's gradient is a partial sum over each rank's tokens
        assert [(c.op, c.axis) for c in router] == [("all_reduce", "dp")] * 2, router
    T, k, H = B * S, 2, 48
    rows = {"forward": expert_rows(tm, "forward"), "backward": expert_rows(tm, "backward")}
    assert rows == {w: [T * k // dp] * 4 for w in rows}, rows   # 2 layers x (gate_up, down)
    for which in ("forward", "backward"):
        cs = tm.collectives(which)
        if dp > 1:   # nothing gathered on the batch axis but fsdp's weights and, without tp,
            # the logits (with tp they stay blocks over both axes: training/vocab_output.py)
            gathers = [n.args[0] for n in tm.rank_module(0, which).graph.nodes
                       if "all_gather" in str(n.target) and batch in n.args and
                       "bucket" not in str(n.target) and n.args[0].meta.get("fxshard_param") is None]
            assert [tuple(x.meta["val"].shape) for x in gathers] == \
                [(B, S, V)][:which == "forward" and tp == 1], (which, gathers)
        if tp > 1:
            reduced = collections.Counter(c.shape for c in cs if c.axis == "tp" and
                                          c.op == "all_reduce")
            t = T // dp   # a rank's tokens (shapes per rank)
            assert (t * k, H) not in reduced, (which, reduced)
            if which == "forward":   # o_proj and the experts, per layer, on [B, S, H]
                assert reduced == {(B // dp, S, H): 4}, reduced
            else:   # + each MoE layer's [T, H] input gradient and [T, k] router gradient
                assert reduced[t, H] == reduced[t, k] == 2, reduced


@pytest.mark.parametrize("dp,batch,sp", [(1, "dp", False), (2, "fsdp", True)])
def test_a_fused_projection_with_whole_parts_trains(dp, batch, sp):
    """Phi-3's fused qkv_proj with 1 KV head on tp=2: the query part is split, the K/V parts
    every rank holds whole (``S(0|48+R12+R12)``), as inference places it. Training runs the
    projection part by part (``fxshard.training.joint._Differentiable``), so the K/V weight
    gradients are partial sums reduced like a replicated weight's and the query rows stay
    the rank's shard (no gather). It was a NotImplementedError; pm.gradients() and
    pm.state_dict() counted the whole parts once per rank (twice the values)."""
    tm = _train_equal("phi3_mqa", dp, 2, batch=batch, sequence_parallel=sp)
    fqn = "model.layers.0.self_attn.qkv_proj.weight"
    spec = tm._specs[fqn][1]
    assert (type(spec).__name__, spec.parts, spec.whole) == \
        ("StridedShard", (48, 12, 12), frozenset({1, 2})), spec
    held = [tm.shards(r)[fqn] for r in (0, 1)]      # tp coordinates 0 and 1
    # q's 48 rows split, K's and V's 12 whole; fsdp shards the other dim
    assert held[0].shape == (24 + 12 + 12, 48 // (2 if batch == "fsdp" else 1)), held[0].shape
    # every tp rank holds the same K/V rows and the same (reduced) gradient of them
    torch.testing.assert_close(held[0].grad[24:], held[1].grad[24:], rtol=0, atol=0)
    # per layer: K's and V's input gradients [tokens, 12] all-reduced (their weight
    # gradients then whole on each rank), Megatron's two block-input all-reduces (a
    # reduce-scatter each under sp); no weight gathered over tp (sp: token gathers only)
    c = _collectives(tm, "backward")
    kv = [x for x in tm.collectives("backward")
          if (x.op, x.axis, x.shape) == ("all_reduce", "tp", (B // dp * S, 12))]
    assert len(kv) == 2 * 2, tm.collectives("backward")
    assert c["all_gather", "tp"] == (4 if sp else 0), c
    if sp:
        assert c["reduce_scatter", "tp"] == 2 * 2 + 1, c
    else:   # + the head's input gradient; + the K/V ones above
        assert c["all_reduce", "tp"] == 2 * 2 + 1 + 4, c


def _gpt_bigcode():
    cfg = transformers.GPTBigCodeConfig(vocab_size=V, n_positions=16, n_embd=48, n_layer=2,
                                        n_head=4, multi_query=True, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                        eos_token_id=0)
    return transformers.GPTBigCodeForCausalLM(cfg), "transformer.h.0.attn.c_attn.weight"


def _falcon():
    cfg = transformers.FalconConfig(vocab_size=V, hidden_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, multi_query=True,
                                    new_decoder_architecture=False, parallel_attn=True,
                                    bias=False, alibi=False, hidden_dropout=0.0,
                                    attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return (transformers.FalconForCausalLM(cfg),
            "transformer.h.0.self_attention.query_key_value.weight")


@pytest.mark.parametrize("family", ["gpt_bigcode", "falcon"])
@pytest.mark.parametrize("dp,batch,sp", [(1, "dp", False), (2, "fsdp", True)])
def test_hf_multi_query_attention_splits_on_tp(family, dp, batch, sp):
    """Multi-query attention cut out of a fused projection already head-shaped: GPTBigCode
    (StarCoder) splits ``c_attn(x).unsqueeze(1)``, HF Falcon views ``x @ w.T`` into
    ``heads + 2`` heads and splits those. tp held the whole attention on every rank (a
    WholeWeightWarning). Now the query heads split and the one K/V head is kept whole
    (``S(0|48+R12+R12)``), in inference and training (the projection trained part by
    part), equal to one device."""
    from fxshard.passes.rules import WholeWeightWarning
    torch.manual_seed(0)
    model, fqn = {"gpt_bigcode": _gpt_bigcode, "falcon": _falcon}[family]()
    ref = copy.deepcopy(model)
    ids, labels = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", WholeWeightWarning)
        pm = fxshard.parallelize(model, _mesh(dp, 2, batch), sequence_parallel=sp,
                                 example_inputs=(ids,))
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert pm.shards(0)[fqn].shape == (24 + 12 + 12, 48 // dp), pm.shards(0)[fqn].shape
        adamw_steps_equal(pm, ref, lambda m: _loss(m(ids), labels), lr=1e-3)


@pytest.mark.parametrize("step,reads", [(1, True), (2, False)])
def test_only_slices_at_the_parts_bounds_read_a_part(step, reads):
    """``_reads_parts`` (which uses of a fused output the part-by-part training may hand the
    part itself): slices at the parts' bounds with step 1 do; a strided slice at the same
    bounds takes every other element of the part, not the part."""
    from fxshard.training.joint import _reads_parts

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 16)

        def forward(self, x):
            y = self.qkv(x)
            return y[..., 0:8] * 2, y[..., 8:12:step], y[..., 12:16]

    gm = torch.export.export(Fused(), (torch.randn(2, 8),)).run_decompositions({}).graph_module
    lin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert _reads_parts(lin, [8, 4, 4]) is reads
    assert _reads_parts(lin, [8, 8]) is False    # bounds that are not the slices'


@pytest.mark.parametrize("name,tp", [("litgpt_falcon", 2), ("litgpt_llama3", 4)])
def test_litgpt_fused_qkv_with_more_tp_ranks_than_kv_groups_trains(name, tp):
    """litgpt's one ``qkv`` Linear with fewer KV groups than tp ranks (Falcon's multi-query
    attention on tp=2; Llama-3's 2 groups on tp=4): trained part by part, gradients and
    three AdamW steps equal one device's (a NotImplementedError until now)."""
    pytest.importorskip("litgpt")
    from tests.external_models import EXTERNAL
    torch.manual_seed(0)
    model = EXTERNAL[name][2](1).train()
    ref = copy.deepcopy(model)
    vocab = model.get_parameter("transformer.wte.weight").shape[0]
    ids, labels = (t % vocab for t in _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, tp), example_inputs=(ids,))
    loss = lambda m: F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())  # noqa: E731
    # lr 1e-3: Falcon's qkv has a gradient element of 3e-6, near Adam's eps (1e-6), where
    # the update's slope turns fp32's 6e-8 (another summation order) into 1e-5 at lr 1e-2
    adamw_steps_equal(pm, ref, loss, lr=1e-3)
    # the rank's qkv rows: its share of the query heads, the K and V groups whole
    cfg = ref.config
    q, kv = cfg.n_head * cfg.head_size, cfg.n_query_groups * cfg.head_size
    assert pm.shards(0)["transformer.h.0.attn.qkv.weight"].shape[0] == q // tp + 2 * kv


def test_deepseek_attention_is_split_on_tp():
    """SDPA's math path (DeepSeek-V2's attention) calls ``_safe_softmax``, which had no rule:
    the attention ran replicated (a FallbackWarning). Now it is split on the heads, in
    inference and training, equal to one device."""
    torch.manual_seed(0)
    model = _deepseek_v2()
    ref = copy.deepcopy(model)
    ids, labels = _data()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = fxshard.parallelize(model, _mesh(1, 2))
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        _loss(pm(ids), labels).backward()
    assert not [str(w.message) for w in seen if "safe_softmax" in str(w.message)]
    full = dict(ref.named_parameters())
    for name in ("q_proj.weight", "kv_b_proj.weight", "o_proj.weight"):   # heads on tp
        fqn = f"model.layers.0.self_attn.{name}"
        assert pm.shards(0)[fqn].numel() * 2 == full[fqn].numel(), fqn
    _loss(ref(ids), labels).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(pm.gradients()[name], p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,axes,sp", [
    ("qwen3", ("fsdp", "tp"), False),
    ("mistral", ("dp", "tp"), True),       # 1 KV head: replicated on tp, its gradient reduced
    ("gpt2", ("fsdp", "tp"), False),
    ("mixtral", ("fsdp", "tp"), False),
    ("bloom", ("fsdp", "tp"), True),       # ALiBi's [B*H, 1, S] bias strided like the heads
    ("deepseek_v2", ("dp", "tp"), True),   # MLA's aten.copy replayed differentiably
])
def test_labels_loss_trains_through_parallelize(name, axes, sp):
    """HF's ``pm(ids, labels=labels).loss`` (the loss inside the model, vocab-parallel on tp)
    through ``fxshard.parallelize``: gradients, then three AdamW steps with
    ``fxshard.clip_grad_norm_``, equal one device's."""
    model = _model(name)
    ref = copy.deepcopy(model)
    ids, labels = (t % model.config.vocab_size for t in _data())
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=axes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, mesh, sequence_parallel=sp,
                                 example_inputs=(ids,), example_kwargs={"labels": labels})

    def no_logits_gather(pm):   # the loss is vocab-parallel: no tp gather of [B, S, V]
        gathers = [n for n in pm.rank_module(0).graph.nodes
                   if n.op == "call_function" and "all_gather" in str(n.target)
                   and "tp" in n.args and n.meta["val"].shape[-1] == V]
        assert not gathers, [n.name for n in gathers]
    adamw_steps_equal(pm, ref, lambda m: m(ids, labels=labels).loss, lr=1e-3,
                      on_first=no_logits_gather)
    if name == "bloom":   # the fused qkv (and with it the ALiBi heads) split on tp
        fqn = "transformer.h.0.self_attention.query_key_value.weight"
        assert pm.shards(0)[fqn].shape[0] * 2 == ref.get_parameter(fqn).shape[0]
