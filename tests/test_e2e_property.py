"""End to end over random mesh shapes and model configs: any combination of dp, tp, pp and a
context-parallel axis (with sequence parallelism and microbatches) gives the single-device
output, or a ValueError that names what does not divide."""
from __future__ import annotations

import torch
from hypothesis import assume, given, strategies as st

import fxshard
from tests.models import our_llama


@st.composite
def configs(draw):
    dp, tp, pp = (draw(st.sampled_from([1, 2])) for _ in range(3))
    tp = draw(st.sampled_from([1, 2, 4])) if dp * pp == 1 else tp
    cp = draw(st.sampled_from([None, "ulysses_cp", "ring_cp"] +
                              (["usp"] if dp * tp * pp <= 2 else []))) if dp * tp * pp <= 4 else None
    cp_axes = {None: (), "ulysses_cp": ("ulysses_cp",), "ring_cp": ("ring_cp",),
               "usp": ("ulysses_cp", "ring_cp")}[cp]
    assume(dp * tp * pp * 2 ** len(cp_axes) > 1)
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    layers = draw(st.integers(pp, 3))
    mb = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    batch = dp * mb * draw(st.integers(1, 2))
    seq = draw(st.sampled_from([4, 6, 8] if cp is None else [4, 8, 16]))
    sp = draw(st.booleans())
    order = draw(st.permutations(range(3 + len(cp_axes))))  # axes nest in mesh order
    return dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_axes=cp_axes, order=order, kv=kv, heads=heads, head_dim=head_dim, layers=layers,
                mb=mb, batch=batch, seq=seq, sp=sp, tie=draw(st.booleans()),
                hidden=heads * head_dim + draw(st.sampled_from([0, 4])))


@given(configs())
def test_any_combination_matches_single_device(cfg):
    model = our_llama(num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                      num_key_value_heads=cfg["kv"], head_dim=cfg["head_dim"],
                      hidden_size=cfg["hidden"], intermediate_size=3 * cfg["hidden"],
                      tie_word_embeddings=cfg["tie"])
    ids = torch.randint(0, 128, (cfg["batch"], cfg["seq"]),
                        generator=torch.Generator().manual_seed(cfg["seq"]))
    names = ("dp", "tp", "pp") + cfg["cp_axes"]
    shape = (cfg["dp"], cfg["tp"], cfg["pp"]) + (2,) * len(cfg["cp_axes"])
    names, shape = (tuple(x[i] for i in cfg["order"]) for x in (names, shape))
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        pm = fxshard.parallelize(model, mesh, sequence_parallel=cfg["sp"],
                                 microbatches=cfg["mb"])
        out = pm(ids)
    except ValueError as e:
        msg = str(e)
        tp = cfg["tp"]
        # only sizes that do not divide by tp may refuse, and they must say which
        assert ("does not divide" in msg or "cannot be split" in msg
                or "neither split nor replicated" in msg or "zigzag" in msg), msg
        ulysses = 2 if "ulysses_cp" in cfg["cp_axes"] else 1
        # ring_cp's zigzag layout splits the sequence into 2 x its size chunks
        seq_split = (tp if cfg["sp"] else 1) * ulysses * (4 if "ring_cp" in cfg["cp_axes"] else 1)
        assert (cfg["heads"] % (tp * ulysses) or (cfg["kv"] % tp and tp % cfg["kv"])
                or cfg["hidden"] % tp or cfg["seq"] % seq_split
                or 128 % tp or (3 * cfg["hidden"]) % tp), (cfg, msg)
        return
    torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-4)
    pm.close()
