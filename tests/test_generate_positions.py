"""Generation for causal LMs that are not HuggingFace's: the positions argument under any name,
or positions derived inside the model (arange, a RoPE table sliced [:T], learned positions),
against a greedy single-device loop (a full re-forward each step, no cache)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.generation.positions import position_candidates
from fxshard.passes.decode_positions import POSITION
from tests.plain_lms import TinyLM, greedy_reference
from tests.models import model_cache

MESHES = {"tp2": dict(tp=2), "tp2ring2": dict(tp=2, ring_cp=2)}
SOURCES = ["input_pos", "arange", "wpe", "table"]
NEW = 5


# each model is parallelized over several meshes: built and exported once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("export_once")
built = model_cache()   # each model built once for this module


def parallel(model, axes):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh)


def prompt(batch=2, length=8):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(3))


def _decode_program(pm):
    return pm.programs.last


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("source", SOURCES)
def test_generate_equals_a_greedy_loop(source, mesh):
    model = built(TinyLM, positions=source).eval()
    ids = prompt()
    want = greedy_reference(model, ids, NEW)
    pm = parallel(model, MESHES[mesh])
    got = pm.generate(ids, max_new_tokens=NEW)
    c = _decode_program(pm)
    pm.close()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    found = c.ctx.reports["decode_positions_pass"]
    if source == "input_pos":   # the argument, found by what the graph does with it
        assert found == {"position_inputs": 1, "rewritten": 0}
    else:                       # the forward's input_pos is unused: derived, rewritten
        assert found["position_inputs"] == 0 and found["rewritten"] >= 1
        assert POSITION in c.program.state_inputs


def test_positions_argument_is_found_under_any_name():
    class Named(TinyLM):
        def forward(self, tokens, positions=None):
            return super().forward(tokens, positions)

    assert position_candidates(Named()) == ["positions"]
    model = Named(positions="input_pos").eval()
    ids = prompt()
    pm = parallel(model, dict(tp=2))
    got = pm.generate(ids, max_new_tokens=3)
    assert _decode_program(pm).ctx.reports["decode_positions_pass"]["position_inputs"] == 1
    pm.close()
    torch.testing.assert_close(got, greedy_reference(model, ids, 3), rtol=0, atol=0)


def test_a_position_source_that_cannot_move_is_a_clear_error():
    class Offset(TinyLM):
        """Positions from a fixed offset the model keeps (as a start_pos attribute)."""

        def forward(self, idx):
            t = idx.shape[1]
            cos, sin = self.cos[3:3 + t], self.sin[3:3 + t]
            x = self.wte(idx)
            for block in self.layers:
                x = block(x, cos, sin)
            return self.head(self.norm(x))

    pm = parallel(Offset().eval(), dict(tp=2))
    with pytest.raises(NotImplementedError, match=r"Offset.*token ids alone.*slice of a "
                                                  r"constant table from 3.*position_ids"):
        pm.generate(prompt(), max_new_tokens=2)
    pm.close()


@pytest.mark.parametrize("source", ["table", "input_pos"])
def test_pipelined_generate_on_a_module_dict_stack(source):
    """pp=2 with microbatches=2 on a ModuleDict stack (torchtitan's layout): the derived
    positions reach the stage that uses them."""
    model = TinyLM(layers=4, container="dict", positions=source).eval()
    ids = prompt(batch=4)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = fxshard.parallelize(model, mesh, microbatches=2)
    got = pm.generate(ids, max_new_tokens=4)
    pm.close()
    torch.testing.assert_close(got, greedy_reference(model, ids, 4), rtol=0, atol=0)


def test_prompt_positions_without_a_decode_source_are_refused():
    """The prompt's forward derives positions from its length but the one-token step takes
    them some other way fxshard cannot see (here: a constant): refused, not decoded at 0."""
    class OneTokenSpecialCase(TinyLM):
        def forward(self, idx):
            t = idx.shape[1]
            pos = torch.arange(t) if t > 1 else torch.zeros(1, dtype=torch.long)
            cos, sin = self.cos[pos], self.sin[pos]
            x = self.wte(idx)
            for block in self.layers:
                x = block(x, cos, sin)
            return self.head(self.norm(x))

    pm = parallel(OneTokenSpecialCase().eval(), dict(tp=2))
    with pytest.raises(NotImplementedError, match=r"derives positions from the prompt's length "
                                                  r"\(arange.*would sit at position 0"):
        pm.generate(prompt(), max_new_tokens=2)
    pm.close()
