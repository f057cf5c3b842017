"""The ParallelModule's parts (``pm.weights``, ``pm.programs``, ``pm.executor``) and a program's
state contract (``Program.state_inputs``, ``kv_caches``, ``write_pos``, ``token_ids``): what
generation, the backend and tests read instead of ParallelModule's private state."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxshard
from fxshard.passes.kv_cache import READ_LEN, WRITE_POS, decode_slots

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _llama():
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg).eval()


def test_nothing_outside_api_reads_a_parallel_modules_private_state():
    """A private attribute of a ParallelModule read anywhere but api.py (fxshard, tests,
    benchmarks) is a reach past its parts."""
    found = []
    for folder in ("fxshard", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "api.py" and path.parent.name == "fxshard":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\b(pm|region|dynamic|self\.pm)\._[a-z]", line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


def test_parts_hold_the_weights_programs_and_ranks():
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    assert pm.programs.last is None and len(pm.programs) == 0
    x = torch.randn(3, 8)
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    c = pm.programs.last
    assert len(pm.programs) == 1 and sorted(c.modules) == [0, 1] and sorted(c.runners) == [0, 1]
    assert pm.executor.module(c, 1) is pm.rank_module(1)
    assert set(pm.weights.expected) == set(model.state_dict())
    assert pm.weights.values["0.weight"] is model[0].weight
    assert c.program.state_inputs == () and c.program.kv_caches == ()
    assert c.program.write_pos is None and c.program.token_ids is None
    with torch.no_grad():
        model[0].weight.mul_(2)          # an in-place change: re-sliced, not retraced
    torch.testing.assert_close(pm(x), model(x), rtol=1e-4, atol=1e-4)
    assert pm.programs.last is c and len(pm.programs) == 1
    assert pm.microbatches == pm.options.microbatches == 1
    pm.close()
    assert pm.executor.world is None


def test_generation_programs_carry_their_state_contract():
    """The prefill writes every cache at ``cache_write_pos``; the greedy decode program reads
    them with ``cache_read_len`` and returns int64 token ids at ``token_ids``."""
    model = _llama()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("ring_cp",))
    pm = fxshard.parallelize(model, mesh)
    pm.generate(torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1)),
                max_new_tokens=3)
    built = {gen[0]: c for (gen, _), c in pm.programs.items()}
    assert sorted(built) == ["decode", "prefill"]
    prefill, decode = built["prefill"].program, built["decode"].program
    keys = [f"kv.{layer}.{kv}" for layer in range(2) for kv in "kv"]
    assert [k for k, _, _ in prefill.kv_caches] == keys == [k for k, _, _ in decode.kv_caches]
    assert prefill.state_inputs == (WRITE_POS, *keys) and prefill.write_pos == WRITE_POS
    assert decode.write_pos == WRITE_POS and READ_LEN in decode.state_inputs
    placeholders = [n.meta["fxshard_state"] for n in decode.graph.nodes
                    if n.op == "placeholder" and "fxshard_state" in n.meta]
    assert list(decode.state_inputs) == placeholders
    for _, shape, dtype in decode.kv_caches:    # [B, KV heads, capacity + 1, head dim]
        assert shape == (2, 2, 65, 16) and dtype == torch.float32
    assert prefill.token_ids is None
    out = next(n for n in decode.graph.nodes if n.op == "output")
    ids = out.args[0][decode.token_ids]
    assert ids.meta["val"].dtype == torch.int64 and tuple(ids.meta["val"].shape) == (2, 1)
    caches = pm.executor.kv_caches
    assert sorted(caches.state) == [0, 1] and caches.capacity == 64
    pm.close()
    assert pm.executor.kv_caches is None


@settings(max_examples=60, deadline=None)
@given(ring=st.integers(1, 4), prompt_held=st.integers(0, 9), steps=st.integers(1, 12))
def test_each_decode_step_has_one_write_owner(ring, prompt_held, steps):
    """Step t's K/V lands on exactly one ring rank, at the end of its piece; the others write
    the scratch slot; the pieces together hold the prompt and every step so far."""
    capacity = 64
    held = [prompt_held] * ring
    for t in range(steps):
        slots = [decode_slots(t, coord, ring, prompt_held, capacity) for coord in range(ring)]
        owners = [c for c, (write, _) in enumerate(slots) if write != capacity]
        assert owners == [t % ring]
        assert slots[t % ring][0] == held[t % ring]
        held[t % ring] += 1
        assert [read for _, read in slots] == held
        assert sum(held) == ring * prompt_held + t + 1


def test_old_module_paths_are_gone():
    """One home for generation: ``fxshard.generation`` (no ``fxshard.generate`` module)."""
    import importlib
    for name in ("fxshard.generate", "fxshard.pipelined_decode", "fxshard.runtime.runner"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)


def test_axis_names_are_spelled_only_in_the_axis_roles_table():
    """``fxshard.mesh.AXIS_ROLES`` is the one place a mesh axis is named in code: elsewhere the
    constants (``TP``, ``RING``, ...) and role sets; docstrings and messages may say the name."""
    import io
    import tokenize
    from fxshard.mesh import AXIS_NAMES, AXIS_ROLES, BATCH_AXES, SEQUENCE_AXES, TRAINING_AXES
    assert AXIS_NAMES == tuple(AXIS_ROLES) and set(BATCH_AXES) == {"dp", "fsdp", "ep"}
    assert set(SEQUENCE_AXES) == {"ulysses_cp", "ring_cp"}
    assert set(TRAINING_AXES) == {"dp", "fsdp", "tp", "pp", "ulysses_cp", "ring_cp", "ep"}
    literals = {repr(a) for a in AXIS_NAMES} | {f'"{a}"' for a in AXIS_NAMES}
    found = []
    for path in sorted((ROOT / "fxshard").rglob("*.py")):
        if path.name == "mesh.py" and path.parent.name == "fxshard":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.STRING and tok.string in literals:
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    assert not found, found
