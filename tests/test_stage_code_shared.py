"""Ranks of one pipeline stage run one program: its code is generated and compiled once per
stage and bound to each rank's own weights (``fxshard.passes.emit.build_rank_module``)."""
from __future__ import annotations

import torch
import torch.fx as fx

import fxshard
from fxshard.placement import local_block
from tests.models import our_llama


def test_every_rank_module_built_with_one_code_generation_per_stage(monkeypatch):
    model = our_llama(num_hidden_layers=2)
    mesh = fxshard.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "pp"))
    ids = torch.randint(0, 128, (4, 8))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    calls = []
    real = fx.Graph.python_code

    def counted(graph, *args, **kwargs):
        calls.append(graph)
        return real(graph, *args, **kwargs)
    monkeypatch.setattr(fx.Graph, "python_code", counted)
    mods = [pm.rank_module(r) for r in range(8)]
    assert len(calls) == 2 and calls[0] is not calls[1]       # one per stage, not per rank
    stage = {r: pm.stage_of(r) for r in range(8)}
    for r in range(8):
        first = mods[next(q for q in range(8) if stage[q] == stage[r])]
        assert mods[r].code is first.code                      # the same code object
        assert type(mods[r]).forward is type(first).forward
        assert type(mods[r]).__name__ == f"Rank{r}Stage{stage[r]}"
    assert mods[0].code != mods[1].code                        # ranks 0, 1: stages 0, 1
    # each rank holds its own slices: tp coordinate 0 and 1 of stage 0's q_proj
    spec = pm.spec
    full = model.model.layers[0].self_attn.q_proj.weight
    slot = pm.programs.last.programs[0].slots["model.layers.0.self_attn.q_proj.weight"]
    for r in (0, 2):
        got = mods[r].get_parameter("model.layers.0.self_attn.q_proj.weight")
        assert torch.equal(got, local_block(full, slot.spec, spec, r))
    assert not torch.equal(mods[0].get_parameter("model.layers.0.self_attn.q_proj.weight"),
                           mods[2].get_parameter("model.layers.0.self_attn.q_proj.weight"))
    assert "torch.ops.fxshard" in mods[0].code and "def forward" in mods[0].code
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    # an explicit recompile (after editing the graph) generates code afresh
    calls.clear()
    mods[2].recompile()
    assert len(calls) == 1 and mods[2].code == mods[0].code and mods[2].code is not mods[0].code
    pm.close()
