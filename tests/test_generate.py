"""Text generation (``pm.generate``) against HuggingFace ``generate`` on one device.

Every mesh of the issue runs HF Llama; every other family (Mistral, Qwen2, Qwen3, the bundled
Llama) runs one of the other meshes in turn (each of them splits heads on tp or ulysses_cp, and
the sequence or the layers)
(``HYPOTHESIS_PROFILE=thorough`` runs every family on every mesh). Structure: the decode
program writes and reads the cache once per layer, ring ranks merge their pieces, the caches
hold each rank's share (and the positions the decode steps wrote), sampling follows HF's
processors with the same generator, eos stops each sequence as in HF. Greedy on ``pp`` runs
the groups of sequences through the stages across steps (``fxshard.generation.pipelined``): its
schedule, the overlap of one step's last group with the next step's first, eos per group.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.generation.pipelined import schedule
from fxshard.passes.kv_cache import READ_LEN, WRITE_POS

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
NEW = 5

MESHES = {
    "tp2": {"tp": 2},
    "dp2tp2": {"dp": 2, "tp": 2},
    "pp2": {"pp": 2},
    "pp2mb2": {"pp": 2, "microbatches": 2},
    "ring2": {"ring_cp": 2},
    "ulysses2": {"ulysses_cp": 2},
    "tp2ring2": {"tp": 2, "ring_cp": 2},
    "seed16": {"dp": 2, "tp": 2, "pp": 2, "ulysses_cp": 2},
}


def _hf(cls_name: str, *, layers: int = 2, **extra):
    import transformers as T
    config_cls = getattr(T, cls_name.replace("ForCausalLM", "Config"))
    cfg = config_cls(vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=None, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(T, cls_name)(cfg).eval()


def _bundled():
    from tests.models import our_llama
    return our_llama()


FAMILIES = {
    "llama": lambda: _hf("LlamaForCausalLM"),
    "mistral": lambda: _hf("MistralForCausalLM", sliding_window=32),
    "qwen2": lambda: _hf("Qwen2ForCausalLM"),
    "qwen3": lambda: _hf("Qwen3ForCausalLM", head_dim=16),
    "bundled": _bundled,
}
_OTHER = ["tp2ring2", "pp2mb2", "ulysses2", "seed16"]
MESHES["tp2ulysses2"] = {"tp": 2, "ulysses_cp": 2}   # 1 KV head per tp rank: picked
MESHES["pp2tp2mb2"] = {"pp": 2, "tp": 2, "microbatches": 2}   # pipelined across steps
MESHES["dp2tp2pp2-sp-mb2"] = {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2,
                              "sequence_parallel": True}   # the seed's "all options" test
CASES = [("llama", m) for m in MESHES] + [
    (f, m) for i, f in enumerate(["mistral", "qwen2", "qwen3", "bundled"])
    for m in ([_OTHER[i]] if not THOROUGH else list(MESHES))]

_models: dict = {}


# the models here are parallelized over many meshes: torch.export runs once per model and
# signature (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")


def family(name):
    if name not in _models:
        _models[name] = FAMILIES[name]()
    return _models[name]


def prompt(batch=4, length=8, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference(model, ids, new, **kwargs):
    """The single-device tokens: HF generate, or for the bundled Llama a loop without cache."""
    with torch.no_grad():
        if hasattr(model, "generate"):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, **kwargs)
        x = ids
        for _ in range(new):
            x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], 1)
        return x


def parallel(model, axes: dict):
    axes = dict(axes)
    microbatches = axes.pop("microbatches", 1)
    sp = axes.pop("sequence_parallel", False)
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh, microbatches=microbatches, sequence_parallel=sp)


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_greedy_tokens_equal_single_device(name, mesh):
    model = family(name)
    ids = prompt()
    want = reference(model, ids, NEW)
    pm = parallel(model, MESHES[mesh])
    got = pm.generate(ids, max_new_tokens=NEW)
    pm.close()
    assert got.shape == (4, 8 + NEW)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _count(code: str, op: str) -> int:
    return len(re.findall(rf"torch\.ops\.fxshard\.{op}\.default\(", code))


def test_decode_program_reads_and_writes_the_cache_per_layer():
    model = family("llama")
    pm = parallel(model, {"tp": 2, "ring_cp": 2})
    pm.generate(prompt(2), max_new_tokens=3)
    code = pm.rank_module(0).code                      # the most recent program: decode
    layers = model.config.num_hidden_layers
    assert _count(code, "cache_write") == 2 * layers   # K and V, in place
    assert _count(code, "decode_attention") == layers
    assert _count(code, "merge_pieces") == layers      # the ring pieces merged by logsumexp
    assert _count(code, "all_reduce") == 2 * layers    # Megatron's two per layer on tp
    assert _count(code, "ring_attention") == _count(code, "attention") == 0
    # the prefill projects only the last position to the vocab (HF's logits_to_keep=1)
    prefill = [c for (gen, _), c in pm.programs.items() if gen and gen[0] == "prefill"]
    out = next(n for n in prefill[0].programs[-1].graph.nodes if n.op == "output")
    logits = [a.meta["val"] for a in torch.utils._pytree.tree_leaves(out.args[0])
              if isinstance(a, torch.fx.Node) and a.meta["val"].dim() == 3]
    assert [tuple(t.shape) for t in logits] == [(2, 1, model.config.vocab_size)]
    pm.close()


def test_decode_step_collectives_and_embedding_bytes_at_tp2():
    """A tp=2 greedy decode step runs Megatron's two all-reduces per layer and, instead of
    gathering the [B, 1, V] logits, one sharded argmax (a [B, 2] exchange); the default
    embedding also gathers its [B, 1, hidden] lookup, embedding='replicate' does not and holds
    the whole table on every rank (explain()'s bytes say so). Sampling needs every logit: its
    decode program gathers them."""
    model = family("llama")
    ids = prompt(2)
    want = reference(model, ids, 3)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    layers = model.config.num_hidden_layers
    table = model.model.embed_tokens.weight
    param_bytes = {}
    for embedding, gathers, share in (("embed_dim", 1, 2), ("replicate", 0, 1)):
        pm = fxshard.parallelize(model, mesh, embedding=embedding)
        torch.testing.assert_close(pm.generate(ids, max_new_tokens=3), want, rtol=0, atol=0)
        code = pm.rank_module(0).code                      # the greedy decode program
        assert _count(code, "all_reduce") == 2 * layers, embedding
        assert _count(code, "all_gather") == gathers, embedding
        assert _count(code, "sharded_argmax") == 1, embedding
        argmax = [c for c in pm.explain().collectives[0] if c.op == "sharded_argmax"]
        assert [(c.axis, c.shape, c.wire_bytes) for c in argmax] == [("tp", (2, 2, 1), 32)]
        held = pm.rank_module(0).state_dict()["model.embed_tokens.weight"]
        assert held.shape == (table.shape[0], table.shape[1] // share)
        ex = pm.explain()
        param_bytes[embedding] = ex.param_bytes[0]
        assert ("embedding='replicate' asks for it" in str(ex)) == (embedding == "replicate")
        if embedding == "embed_dim":
            pm.generate(ids, max_new_tokens=3, do_sample=True)
            code = pm.rank_module(0).code                  # the sampling decode program
            assert _count(code, "all_gather") == gathers + 1
            assert _count(code, "sharded_argmax") == 0
        pm.close()
    assert param_bytes["replicate"] - param_bytes["embed_dim"] == \
        table.numel() * table.element_size() // 2


def _sharded_argmax(rows: torch.Tensor, mesh) -> list[torch.Tensor]:
    """Every rank's ``fxshard::sharded_argmax`` of its tp shard of ``rows`` (last dim)."""
    from fxshard.runtime.simulated import SimulatedWorld
    n = mesh.axis_size("tp")
    with SimulatedWorld(mesh) as world:
        return world.run(lambda r: torch.ops.fxshard.sharded_argmax(
            rows.chunk(n, -1)[mesh.axis_index(r, "tp")], "tp", n))


def test_sharded_argmax_breaks_ties_like_torch_argmax_on_the_whole_row():
    """Ties across ranks go to the lowest global index (the first rank holding the max), ties
    within a rank to its first, a NaN wins wherever it is (torch.argmax's rule), and the
    exchanged pair is exact for values float32 cannot tell apart from their neighbours."""
    from fxshard.mesh import MeshSpec
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1., 7., 3., 2., 7., 0.],          # 7 on rank 0 and rank 1: index 1
                         [0., 1., 2., 9., 9., 9.],          # only rank 1's ties: index 3
                         [-inf, -inf, -inf, -inf, -inf, -inf],   # all -inf: index 0
                         [1., 2., 3., 4., nan, 5.],         # the NaN: index 4
                         [5., nan, 1., nan, 5., 5.],        # the first NaN: index 1
                         [1., 1 + 2 ** -23, 1., 1 + 2 ** -23, 1., 1.]])   # 1 ulp: index 1
    mesh = MeshSpec((2,), ("tp",))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = rows.to(dtype)
        want = x.argmax(-1)
        for got in _sharded_argmax(x, mesh):
            assert torch.equal(got, want), (dtype, got, want)
            assert got.dtype == torch.int64
    x = torch.tensor([[2., 3., 3., 1., 3., 0.], [4., 0., 0., 0., 4., 4.]])   # 3 ranks
    for got in _sharded_argmax(x, MeshSpec((3,), ("tp",))):
        assert torch.equal(got, torch.tensor([1, 0]))


@given(st.integers(2, 4), st.integers(1, 3), st.integers(1, 5), st.data())
def test_sharded_argmax_equals_argmax_of_the_gathered_row(n, batch, per_rank, data):
    """Small integer logits (many ties, within and across ranks) on 2-4 ranks."""
    from fxshard.mesh import MeshSpec
    values = data.draw(st.lists(st.integers(-2, 2), min_size=batch * n * per_rank,
                                max_size=batch * n * per_rank))
    x = torch.tensor(values, dtype=torch.float32).view(batch, 1, n * per_rank)
    for got in _sharded_argmax(x, MeshSpec((n,), ("tp",))):
        assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("axes,share", [({"tp": 2}, 2), ({"dp": 2, "tp": 2}, 4),
                                        ({"ring_cp": 2}, 1), ({"pp": 2}, 2)])
def test_each_rank_holds_its_share_of_the_cache(axes, share):
    model = family("llama")
    ids = prompt(4, 8)
    pm = parallel(model, axes)
    pm.generate(ids, max_new_tokens=NEW)
    state = pm.executor.kv_caches
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    whole = 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * head_dim * 4  # per slot
    for rank, st in state.state.items():
        caches = [t for k, t in st.items() if k.startswith("kv.")]
        per_slot = sum(t[:, :, 0].numel() * t.element_size() for t in caches)
        assert per_slot * share == whole, (rank, per_slot)  # ring: the slots are split
        assert pm.explain().kv_cache_bytes[rank] == per_slot
        # what was written: the prompt's positions and the decode steps', nothing after
        n_ring = axes.get("ring_cp", 1)
        coord = pm.spec.axis_index(rank, "ring_cp")
        held = 8 // n_ring + sum(1 for t in range(NEW - 1) if t % n_ring == coord)
        k = caches[0]
        assert bool((k[:, :, :held] != 0).all()), rank
        assert bool((k[:, :, held:state.capacity] == 0).all()), rank
    pm.close()


def _hf_sample(model, ids, new, generator, temperature, top_k, top_p):
    """One device, HF's own logits processors and torch.multinomial with ``generator``."""
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                TopPLogitsWarper(top_p)])
    x = ids
    with torch.no_grad():
        for _ in range(new):
            scores = warp(x, model(x).logits[:, -1].float())
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=generator)
            x = torch.cat([x, nxt], 1)
    return x


@pytest.mark.parametrize("axes", [{"tp": 2}, {"ring_cp": 2, "tp": 2},
                                  {"pp": 2, "microbatches": 2}])   # pp: the step loop
def test_seeded_sampling_equals_single_device(axes):
    model = family("llama")
    ids = prompt(4, 8, seed=5)
    options = dict(temperature=0.7, top_k=40, top_p=0.9)
    want = _hf_sample(model, ids, 6, torch.Generator().manual_seed(11), **options)
    pm = parallel(model, axes)
    got = pm.generate(ids, max_new_tokens=6, do_sample=True,
                      generator=torch.Generator().manual_seed(11), **options)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    greedy = pm.generate(ids, max_new_tokens=6)
    assert not torch.equal(got, greedy)   # the sampling really sampled
    pm.close()


def test_eos_stops_each_sequence_like_hf():
    model = family("qwen2")
    ids = prompt(4, 8, seed=2)
    free = reference(model, ids, 6)
    eos = int(free[0, 8 + 1])              # sequence 0 emits it as its second new token
    want = reference(model, ids, 6, eos_token_id=eos, pad_token_id=0)
    pm = parallel(model, {"tp": 2})
    got = pm.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    pm.close()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(got[0, 8 + 1]) == eos and bool((got[0, 8 + 2:] == 0).all())


def test_the_models_generation_config_eos_applies_like_hf():
    model = family("qwen2")
    ids = prompt(4, 8, seed=2)
    free = reference(model, ids, 6)
    model.generation_config.eos_token_id = int(free[1, 8 + 2])
    try:
        want = reference(model, ids, 6)
        pm = parallel(model, {"tp": 2})
        got = pm.generate(ids, max_new_tokens=6)
        pm.close()
    finally:
        model.generation_config.eos_token_id = None
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(want, free[:, :want.shape[1]])    # eos changed the output


def test_all_sequences_finished_stops_early():
    model = family("llama")
    ids = prompt(2, 8, seed=3)
    free = reference(model, ids, 4)
    eos = [int(free[0, 8]), int(free[1, 8])]      # both finish at their first token
    pm = parallel(model, {"tp": 2})
    got = pm.generate(ids, max_new_tokens=4, eos_token_id=eos)
    pm.close()
    assert got.shape == (2, 9)
    torch.testing.assert_close(got, free[:, :9], rtol=0, atol=0)


def test_zero_new_tokens_returns_the_prompt():
    pm = parallel(family("llama"), {"tp": 2})
    ids = prompt(2, 8)
    assert torch.equal(pm.generate(ids, max_new_tokens=0), ids)
    pm.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be an int >= 0"),
    (dict(max_new_tokens=60), r"needs 68 positions, more than the model's "
                              r"max_position_embeddings=64"),
    (dict(max_new_tokens=2, temperature=0.5), r"temperature=0.5 only apply to sampling"),
    (dict(max_new_tokens=2, do_sample=True, temperature=0.0), r"temperature=0.0 must be"),
    (dict(max_new_tokens=2, do_sample=True, top_p=1.5), r"top_p=1.5 must be None or a float"),
    (dict(max_new_tokens=2, do_sample=True, top_k=0), r"top_k=0 must be None or an int"),
    (dict(max_new_tokens=2, eos_token_id=500), r"must be token ids in \[0, 128\)"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    pm = parallel(family("llama"), {"tp": 2})
    with pytest.raises(ValueError, match=match):
        pm.generate(prompt(2, 8), **kwargs)


def test_batch_not_divisible_by_dp():
    pm = parallel(family("llama"), {"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"batch of 3 sequences cannot be split over mesh .*"
                                         r"dp=2 x microbatches=1 must divide it"):
        pm.generate(prompt(3, 8), max_new_tokens=2)


def test_sliding_window_longer_than_the_cache_is_refused():
    model = family("mistral")           # sliding_window=32
    pm = parallel(model, {"tp": 2})
    with pytest.raises(NotImplementedError, match=r"sliding window of 32 tokens.*needs 36"):
        pm.generate(prompt(2, 30), max_new_tokens=6)


def test_forward_without_position_ids_derives_them():
    """No positions argument: the decode step's positions come from the cache position."""
    class NoPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _bundled()

        def forward(self, input_ids):
            return self.inner(input_ids)

    model = NoPositions().eval()
    pm = parallel(model, {"tp": 2})
    ids = prompt(2, 8)
    got = pm.generate(ids, max_new_tokens=3)
    assert pm.programs.last.ctx.reports["decode_positions_pass"]["rewritten"] >= 1
    pm.close()
    torch.testing.assert_close(got, reference(model, ids, 3), rtol=0, atol=0)


def test_state_inputs_are_bound_per_rank():
    """The decode program's state inputs come after the user's, and the positions the runner
    gives a ring rank say where its piece ends."""
    model = family("llama")
    pm = parallel(model, {"ring_cp": 2})
    pm.generate(prompt(2, 8), max_new_tokens=4)
    placeholders = [n for n in pm.rank_module(1).graph.nodes if n.op == "placeholder"]
    names = [n.name for n in placeholders]
    assert names[:2] == ["input_ids", "position_ids"]
    assert WRITE_POS in names and READ_LEN in names
    st = pm.executor.kv_caches.state
    # after step t=2 (the last decode step of 3): coordinate 0 wrote steps 0 and 2
    assert int(st[0][READ_LEN][0]) == 4 + 2 and int(st[1][READ_LEN][0]) == 4 + 1
    pm.close()


def test_generate_on_a_model_built_empty_and_loaded_from_shards(tmp_path):
    """What users run: the config built under init_empty_weights, the checkpoint loaded shard
    by shard into each rank's slices, then generate."""
    import transformers
    model = family("llama")
    ids = prompt(2, 8)
    want = reference(model, ids, 4)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    with fxshard.init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(model.config)
    pm = parallel(empty, {"tp": 2, "ring_cp": 2})
    fxshard.load_safetensors(pm, str(tmp_path))
    torch.testing.assert_close(pm.generate(ids, max_new_tokens=4), want, rtol=0, atol=0)
    pm.close()


# --- greedy on pp: the groups flow through the stages across steps ------------------------

def _generate(pm, ids, **kwargs):
    """``fxshard.generation.loop.generate``, with its private options."""
    from fxshard.generation.loop import generate
    return generate(pm, ids, **kwargs)


@settings(max_examples=30 if not THOROUGH else 300)
@given(stages=st.integers(1, 4), groups=st.integers(1, 5), steps=st.integers(1, 4))
def test_pipelined_schedule_has_no_per_step_bubble(stages, groups, steps):
    ticks = schedule(stages, groups, steps)
    at = {(s, unit): k for k, row in enumerate(ticks) for s, unit in enumerate(row) if unit}
    units = [(t, j) for t in range(-1, steps - 1) for j in range(groups)]
    assert sorted(at) == sorted((s, u) for s in range(stages) for u in units)
    for s in range(stages):                  # each stage walks the units in order
        assert [at[(s, u)] for u in units] == sorted(at[(s, u)] for u in units)
    for t, j in units:                       # activations, then the token, before a unit
        for s in range(1, stages):
            assert at[(s, (t, j))] > at[(s - 1, (t, j))]
        if t >= 0:
            assert at[(0, (t, j))] > at[(stages - 1, (t - 1, j))]
    # fill and drain once, not once per step: with groups >= stages no stage idles between
    # its first and its last unit (GPipe per step would idle stages - 1 ticks per step)
    assert len(ticks) == steps * max(groups, stages) + min(groups, stages) - 1
    if groups >= stages:
        for s in range(stages):
            busy = [k for k, row in enumerate(ticks) if row[s] is not None]
            assert busy == list(range(s, s + len(units)))


def test_pipelined_schedule_two_stages_two_groups():
    assert schedule(2, 2, 3) == [
        [(-1, 0), None], [(-1, 1), (-1, 0)], [(0, 0), (-1, 1)], [(0, 1), (0, 0)],
        [(1, 0), (0, 1)], [(1, 1), (1, 0)], [None, (1, 1)]]
    assert schedule(2, 1, 2) == [[(-1, 0), None], [None, (-1, 0)], [(0, 0), None],
                                 [None, (0, 0)]]


def test_the_next_step_starts_before_the_last_group_of_this_one():
    """Stage 1 waits, before the last group of step 0, until stage 0 has started group 0 of
    step 1: a schedule with a per-step barrier (stage 0 needs every group's token of step 0)
    never gets there and the wait times out."""
    import threading
    model = family("llama")
    ids = prompt(4, 8)
    pm = parallel(model, {"pp": 2, "microbatches": 2})
    started = {unit: threading.Event() for unit in [(0, 1, 0), (1, 0, 1)]}
    order, overlapped = [], []

    def hook(rank, stage, step, group):
        order.append((stage, step, group))
        if (stage, step, group) == (1, 0, 1):
            overlapped.append(started[(0, 1, 0)].wait(timeout=30))
        if (stage, step, group) in started:
            started[(stage, step, group)].set()

    got = _generate(pm, ids, max_new_tokens=4, _stage_hook=hook)
    pm.close()
    assert overlapped == [True]
    torch.testing.assert_close(got, reference(model, ids, 4), rtol=0, atol=0)
    units = [(t, j) for t in range(-1, 3) for j in range(2)]
    for stage in (0, 1):
        assert [(t, j) for s, t, j in order if s == stage] == units


def test_uneven_groups_on_pp():
    """Three groups of one sequence on two stages, a prompt of 7."""
    model = family("llama")
    ids = prompt(3, 7, seed=4)
    pm = parallel(model, {"pp": 2, "microbatches": 3})
    got = pm.generate(ids, max_new_tokens=NEW)
    pm.close()
    torch.testing.assert_close(got, reference(model, ids, NEW), rtol=0, atol=0)


def test_a_finished_group_stops_being_computed():
    """Group 0 (sequences 0, 1) emits eos at its third token, group 1 never: group 0's units
    stop on both stages, group 1 runs on, the output is HF's (pad after eos)."""
    model = family("llama")
    ids = prompt(4, 8, seed=1)
    free = reference(model, ids, 6)
    eos = [int(free[0, 8 + 1]), int(free[1, 8 + 2])]
    assert not bool(torch.isin(free[2:, 8:], torch.tensor(eos)).any())
    want = reference(model, ids, 6, eos_token_id=eos, pad_token_id=0)
    pm = parallel(model, {"pp": 2, "microbatches": 2})
    order = []
    got = _generate(pm, ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0,
                    _stage_hook=lambda rank, stage, step, group: order.append(
                        (stage, step, group)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool((got[1, 8 + 3:] == 0).all()) and not bool((got[2:, 8 + 3:] == 0).any())
    for stage in (0, 1):
        assert [t for s, t, j in order if (s, j) == (stage, 0)] == [-1, 0, 1]
        assert [t for s, t, j in order if (s, j) == (stage, 1)] == [-1, 0, 1, 2, 3, 4]
    # every group finished: generation ends at the last group's eos
    eos.append(int(free[2, 8 + 3]))
    eos.append(int(free[3, 8]))
    want = reference(model, ids, 6, eos_token_id=eos, pad_token_id=0)
    got = pm.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    pm.close()
    assert got.shape == want.shape == (4, 8 + 4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _deep():
    """A 4-layer Llama: up to 4 stages."""
    if "deep" not in _models:
        _models["deep"] = _hf("LlamaForCausalLM", layers=4)
    return _models["deep"]


@settings(max_examples=20, phases=tuple(Phase) if THOROUGH else (Phase.explicit,))
@given(stages=st.integers(2, 4), groups=st.integers(1, 4), per=st.integers(1, 2),
       length=st.integers(3, 9), new=st.integers(1, 6),
       picks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=3))
@example(stages=4, groups=2, per=2, length=7, new=6, picks=[(0, 1), (1, 3)])
def test_pipelined_greedy_any_stages_groups_and_eos(stages, groups, per, length, new, picks):
    """Fewer groups than stages, more, one; eos ids taken from the free run's tokens, so some
    groups finish early (CI: the example, fewer groups than stages; thorough: random)."""
    model = _deep()
    batch = groups * per
    ids = prompt(batch, length, seed=length)
    free = reference(model, ids, new)
    eos = sorted({int(free[r % batch, length + c % new]) for r, c in picks})
    kwargs = dict(eos_token_id=eos, pad_token_id=0) if eos else {}
    want = reference(model, ids, new, **kwargs)
    pm = parallel(model, {"pp": stages, "microbatches": groups})
    got = pm.generate(ids, max_new_tokens=new, **kwargs)
    pm.close()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
