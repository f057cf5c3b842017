"""A vocab ``tp`` does not divide (``fxshard.passes.pad_vocab``): GPT-2 with 91 rows (tied) and
a Llama with 101 (untied head) hold ``ceil(V / tp)`` rows per rank, the last rank's tail rows
zeros. Inference, training (loss on ``pm(ids)``'s blocks and ``labels=`` in the graph, AdamW
steps with clipping), generation and checkpoints (HF safetensors both ways, the training state
across meshes, real gloo ranks) equal the single device's, and neither the forward nor the
backward program moves the ``[B, S, V]`` logits over ``tp``.
"""
import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

import fxshard
from tests.launch import gloo_job
from tests.test_train_models import TV, _data, _loss, _mesh, _model, _train_equal
from tests.train_checks import loss_and_grads_equal

GRAD = True   # autograd on (tests/conftest.py)
V = TV + 1    # 91 rows: no tp > 1 divides them
TABLE = "transformer.wte.weight"


def _padded(tp: int) -> int:
    return -(-V // tp) * tp


def test_padded_rows():
    """A multiple of tp; a large vocab's rows per rank a multiple of 64 too (an odd matmul
    width is slow: benchmarks/padded_vocab.py)."""
    from fxshard.passes.pad_vocab import padded_rows
    assert [padded_rows(91, n) for n in (2, 3, 4, 8)] == [92, 93, 92, 96]
    assert padded_rows(32001, 2) == 32128 and padded_rows(50257, 2) == 50304
    assert padded_rows(50257, 8) == 50688 and padded_rows(8191, 2) == 8192   # (4096 a rank)
    assert padded_rows(8189, 2) == 8190                     # (4095 a rank: not aligned)


def _logits_moves(tm, which: str, tp: int) -> list:
    """Collectives of ``which`` program that move a logits-sized tensor (last dim the vocab,
    padded or not, or its per-rank block) over tp."""
    widths = {V, _padded(tp), _padded(tp) // tp}
    return [(c.op, c.shape) for c in tm.collectives(which)
            if c.axis == "tp" and c.shape and len(c.shape) >= 2 and c.shape[-1] in widths]


@pytest.mark.parametrize("dp,tp,batch,sp", [(1, 2, "dp", False), (2, 2, "fsdp", True),
                                            (1, 4, "dp", False)],
                         ids=["tp2", "fsdp2tp2-sp", "tp4"])
def test_tied_vocab_tp_does_not_divide_trains_vocab_parallel(dp, tp, batch, sp):
    """Gradients, clipping, three AdamW steps and the state dict equal one device's
    (``_train_equal``); the table is split on its rows (``ceil(91 / tp)`` each), the padded
    rows stay zero with a zero gradient, and the logits never move over tp."""
    tm = _train_equal("gpt2_odd", dp, tp, steps=3, lr=1e-3, batch=batch, sequence_parallel=sp)
    spec = tm._specs[TABLE]
    assert spec[1] == fxshard.Shard(0), spec
    rows = _padded(tp) // tp
    last = [r for r in range(dp * tp) if r % tp == tp - 1]
    for r in range(dp * tp):
        shard = tm.shards(r)[TABLE]
        assert shard.shape[0] == rows, shard.shape
        if r in last:      # its rows past 91: padding, never trained
            pad = _padded(tp) - V
            assert shard[-pad:].abs().max() == 0 and shard.grad[-pad:].abs().max() == 0
    assert tm.gradients()[TABLE].shape == (V, 48)
    assert tm.state_dict()["lm_head.weight"].shape == (V, 48)
    for which in ("forward", "backward"):
        assert _logits_moves(tm, which, tp) == [], which


def test_labels_loss_in_the_graph_is_vocab_parallel():
    """HF's ``labels=`` loss on the padded logits: the padded classes masked to -inf before the
    log-softmax; loss and gradients equal one device, only per-row maxima and sums move."""
    model = _model("gpt2_odd")
    ref = copy.deepcopy(model)
    ids, labels = (t % V for t in _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(2, 2), example_inputs=(ids,))
        loss_and_grads_equal(pm, ref, lambda m: m(ids, labels=labels).loss)
    text = str(pm.explain())
    assert "weight: 91 -> 92 rows" in text
    assert "pad_vocab_pass: 1 padded tables, 1 masked, 0 cut" in text, text
    for which in ("forward", "backward"):
        assert _logits_moves(pm.trainer, which, 2) == [], which


def _untied_llama(layers: int):
    """An HF Llama with an untied head of 101 rows, its copy, and a batch of ids and labels."""
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    return model, copy.deepcopy(model), torch.randint(0, 101, (2, 12), generator=g), \
        torch.randint(0, 101, (2, 12), generator=g)


def test_untied_head_tp_does_not_divide_is_padded():
    """An untied lm_head with 101 rows (a Llama): padded and column-parallel on tp (it was
    kept whole on every rank); the embedding keeps its hidden-dim split."""
    model, ref, ids, labels = _untied_llama(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, 2), example_inputs=(ids,))
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
        # column-parallel in inference too (the cut for the output gathers its logits only)
        assert dict(pm.rank_module(1).named_parameters())["lm_head.weight"].shape == (51, 64)
        loss_and_grads_equal(pm, ref, lambda m: m(ids, labels=labels).loss)
    shards = pm.shards(1)
    assert shards["lm_head.weight"].shape == (51, 64)
    assert shards["model.embed_tokens.weight"].shape == (101, 32)


def test_untied_head_on_pp_tp():
    """pp2·tp2: the pipeline's stages train the padded head (the last stage's) as one device
    does; inference after the step reads the trained shards, column-parallel."""
    model, ref, ids, labels = _untied_llama(layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
        loss_and_grads_equal(pm, ref, lambda m: _loss(m(ids), labels))
        for params in (pm.parameters(), ref.parameters()):
            torch.optim.SGD(params, lr=0.1).step()
        with torch.no_grad():
            torch.testing.assert_close(pm(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    text = str(pm.explain())
    line = next(x for x in text.splitlines() if x.strip().startswith("lm_head.weight "))
    assert "tp:S(0)" in line and "(51, 64)" in line, line


def test_padded_vocab_inference_and_generation():
    """Inference returns the model's 91 columns; greedy generation equals HF's; the plan shows
    the table split on its rows."""
    model = _model("gpt2_odd").eval()
    ids = _data()[0] % V
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, 2))
        with torch.no_grad():
            out = pm(ids).logits
            torch.testing.assert_close(out, model(ids).logits, rtol=1e-4, atol=1e-4)
            assert out.shape[-1] == V
            got = pm.generate(ids[:, :3], max_new_tokens=5)
            want = model.generate(ids[:, :3], max_new_tokens=5, do_sample=False,
                                  pad_token_id=0, attention_mask=torch.ones_like(ids[:, :3]))
    assert torch.equal(got, want)
    text = str(pm.explain())
    assert "pad_vocab_pass: 1 padded tables" in text, text
    assert re.search(r"Vocab padded for tp .*: 1\n  (lm_head|transformer\.wte)\.weight: "
                     r"91 -> 92 rows", text), text
    line = next(x for x in text.splitlines() if x.strip().startswith(("lm_head.weight",
                                                                       TABLE)))
    assert "tp:S(0)" in line and "(46, 48)" in line, line


def test_inference_without_the_lookup_after_training():
    """Trained with the table padded (the lookup and the head), then a forward on
    ``inputs_embeds`` (no lookup: that program does not pad the head): its slot takes the
    trained table cut back to the model's 91 rows."""
    model = _model("gpt2_odd")
    ref = copy.deepcopy(model)
    ids, labels = (t % V for t in _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, 2), example_inputs=(ids,))
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        _loss(pm(ids), labels).backward()
        opt.step()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        _loss(ref(ids), labels).backward()
        ref_opt.step()
        embeds = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got, want = pm(inputs_embeds=embeds).logits, ref(inputs_embeds=embeds).logits
    assert got.shape == want.shape == (2, 5, V)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_padded_vocab_checkpoints_across_meshes(tmp_path):
    """Trained on fsdp2·tp2: ``save_safetensors`` writes 91 rows (``from_pretrained`` equal),
    a meta-built model loads them on tp4 (inference) and on tp2 (training: loss and
    gradients); the training state resumes on tp4 and two more steps equal the uninterrupted
    single-device run."""
    model = _model("gpt2_odd")
    ref = copy.deepcopy(model)
    ids, labels = (t % V for t in _data())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    def step(call, opt):
        opt.zero_grad()
        _loss(call(ids), labels).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(2, 2, "fsdp"), example_inputs=(ids,))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
        for _ in range(2):
            step(pm, opt)
            step(ref, opt_ref)
        fxshard.save_safetensors(pm, str(tmp_path / "hf"))
        fxshard.save_training_state(pm, opt, str(tmp_path / "state"))
        back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
        assert back.transformer.wte.weight.shape == (V, 48)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(back.get_parameter(name), p.detach(), rtol=1e-5,
                                       atol=1e-5, msg=name)
        with fxshard.init_empty_weights():
            empty = transformers.GPT2LMHeadModel(ref.config)
        pm4 = fxshard.parallelize(empty.eval(), _mesh(1, 4), example_inputs=(ids,))
        fxshard.load_safetensors(pm4, str(tmp_path / "hf"))
        with torch.no_grad():
            torch.testing.assert_close(pm4(ids).logits, ref.eval()(ids).logits, rtol=1e-4,
                                       atol=1e-4)
        ref.train()
        with fxshard.init_empty_weights():      # trained on from the checkpoint, meta-built
            empty = transformers.GPT2LMHeadModel(ref.config)
        pm5 = fxshard.parallelize(empty.train(), _mesh(1, 2), example_inputs=(ids,))
        fxshard.load_safetensors(pm5, str(tmp_path / "hf"))
        loss_and_grads_equal(pm5, copy.deepcopy(ref), lambda m: _loss(m(ids), labels))
        pm2 = fxshard.parallelize(_model("gpt2_odd"), _mesh(1, 4), example_inputs=(ids,))
        _loss(pm2(ids), labels).backward()   # (places the shards)
        opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-3, eps=1e-6)
        fxshard.load_training_state(pm2, opt2, str(tmp_path / "state"))
        for _ in range(2):
            step(pm2, opt2)
            step(ref, opt_ref)
    trained = pm2.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert pm2.shards(3)[TABLE].shape == (23, 48)


class _WideTable(torch.nn.Module):
    """A tied table of 8193 rows (tp=2: 4097 a rank, rounded up to 4160)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(8193, 8)

    def forward(self, ids):
        return F.linear(self.embed(ids), self.embed.weight)


def _gloo_body(rank: int, report: dict, out_dir: str) -> None:
    """dp2·tp2 on 4 gloo ranks: the loss on ``pm(ids)``'s blocks (a padded last block), two
    AdamW steps; the whole gradients and parameters on every rank; each rank's writes of the
    HF checkpoint and the training state (DCP: a padded table gathered whole, the model's
    rows; also one whose rows per rank are rounded up to 64)."""
    import torch.distributed as dist
    from tests.launch import mesh
    model = _model("gpt2_odd")
    ref = copy.deepcopy(model)
    ids, labels = (t % V for t in _data())
    pm = fxshard.parallelize(model, mesh(dp=2, tp=2), example_inputs=(ids,))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    for k in range(2):
        for call, o in ((pm, opt), (ref, opt_ref)):
            o.zero_grad()
            _loss(call(ids), labels).backward()
        if k == 0:
            grads = pm.gradients()
            report["grads"] = max((grads[n] - p.grad).abs().max().item()
                                  for n, p in ref.named_parameters())
        opt.step()
        opt_ref.step()
    trained = pm.state_dict()
    report["params"] = max((trained[n] - p.detach()).abs().max().item()
                           for n, p in ref.named_parameters())
    report["rows"] = list(pm.shards(rank)[TABLE].shape)
    fxshard.save_safetensors(pm, out_dir + "/hf")
    fxshard.save_training_state(pm, opt, out_dir + "/state")
    # a table whose rows per rank are rounded up to 64 (8193 -> 4160 a rank, not DTensor's
    # 4097 / 4096): its training state too
    wide = _WideTable()
    pm2 = fxshard.parallelize(wide, mesh(dp=2, tp=2), example_inputs=(ids,))
    opt2 = torch.optim.SGD(pm2.parameters(), lr=0.1)
    pm2(ids).square().mean().backward()
    opt2.step()
    report["wide_rows"] = list(pm2.shards(rank)["embed.weight"].shape)
    table = pm2.state_dict()["embed.weight"]      # (a collective: every rank)
    if rank == 0:
        torch.save(table, out_dir + "/wide.pt")
    fxshard.save_training_state(pm2, opt2, out_dir + "/wide")
    dist.barrier()
    pm.close()
    pm2.close()


def test_padded_vocab_on_gloo_ranks(tmp_path):
    reports = gloo_job(_gloo_body, 4, str(tmp_path), str(tmp_path), timeout_s=600, grad=True)
    for r, rep in reports.items():
        assert rep["grads"] < 1e-5 and rep["params"] < 1e-5, rep
        assert rep["rows"] == [46, 48] and rep["wide_rows"] == [4160, 8], rep
    # the wide table's training state: the model's 8193 rows, as trained, loaded on tp=4
    wide = _WideTable()
    ids = _data()[0] % V
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(wide, _mesh(1, 4), example_inputs=(ids,))
        pm(ids).square().mean().backward()
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        fxshard.load_training_state(pm, opt, str(tmp_path / "wide"))
    torch.testing.assert_close(pm.state_dict()["embed.weight"],
                               torch.load(str(tmp_path / "wide.pt")), rtol=0, atol=0)
    # what the ranks wrote, read here: the single-device run's weights after two steps, and
    # a training state that resumes on another (simulated) mesh
    model = _model("gpt2_odd")
    ref = copy.deepcopy(model)
    ids, labels = (t % V for t in _data())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    def step():
        opt_ref.zero_grad()
        _loss(ref(ids), labels).backward()
        opt_ref.step()
    step()
    step()
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(back.get_parameter(name), p.detach(), rtol=1e-5, atol=1e-5,
                                   msg=name)
    step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = fxshard.parallelize(model, _mesh(1, 4), example_inputs=(ids,))
        _loss(pm(ids), labels).backward()
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
        fxshard.load_training_state(pm, opt, str(tmp_path / "state"))
        opt.zero_grad()
        _loss(pm(ids), labels).backward()
        opt.step()
    trained = pm.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)


class _TiedToy(torch.nn.Module):
    """A tied table of 91 rows whose logits meet what the pass handles: a soft cap (tanh of
    a scaled value: the padded columns are masked after it, where -inf would not survive),
    a log-softmax, an argmax, a view that merges the vocab with another dim and one that
    moves it (both read on the model's rows), and the logits returned."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids):
        logits = torch.nn.functional.linear(self.norm(self.embed(ids)), self.embed.weight)
        capped = torch.tanh(logits / 3.0) * 3.0
        logp = capped.log_softmax(-1)
        picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        merged = logits.reshape(-1)[::7].sum()
        moved = logits[:2, :1].reshape(V, 2)[:, 0].sum()    # [2, 1, V] read as [V, 2]
        best = capped.argmax(-1).float()
        return logits, picked.mean() + 0.01 * (merged + moved) + 1e-3 * best.sum()


@pytest.mark.parametrize("grad", [False, True])
def test_padded_columns_never_reach_a_result(grad):
    """The toy's outputs (and gradients) equal one device's on tp=2 in inference and
    training: every read of the padded logits is masked or cut."""
    torch.manual_seed(0)
    model = _TiedToy()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    pm = fxshard.parallelize(model, _mesh(1, 2), example_inputs=(ids,))
    with torch.set_grad_enabled(grad):
        logits, loss = pm(ids)
        want_logits, want = ref(ids)
    torch.testing.assert_close(logits, want_logits.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    if grad:
        (loss + logits.square().mean()).backward()
        (want + want_logits.square().mean()).backward()
        grads = pm.gradients()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
        assert pm.shards(1)["embed.weight"].shape == (46, 16)
    else:
        assert dict(pm.rank_module(1).named_parameters())["embed.weight"].shape == (46, 16)
    # one mask (the capped logits, before the log-softmax and the argmax), two cuts (the
    # logits, for the merging view and the output; their slice, for the moving view)
    assert "pad_vocab_pass: 1 padded tables, 1 masked, 2 cut" in str(pm.explain())
