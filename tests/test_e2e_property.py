"""End to end over random mesh shapes and model configs: any combination of dp, tp, pp and a
context-parallel axis (with sequence parallelism and microbatches) gives the single-device
output, or a ValueError that names what does not divide. Context-parallel cases are drawn with
sizes that divide (so they always compare numbers); the others may be uneven on purpose."""
from __future__ import annotations

import math

import torch
from hypothesis import example, given, strategies as st

import fxshard
from tests.models import our_llama

CP_AXES = {None: (), "ulysses_cp": ("ulysses_cp",), "ring_cp": ("ring_cp",),
           "usp": ("ulysses_cp", "ring_cp")}
# (dp, tp, pp) with at most 8 ranks over the whole mesh
TRIPLES = [(dp, tp, pp) for dp in (1, 2) for tp in (1, 2, 4) for pp in (1, 2)
           if dp * tp * pp <= 8 and (tp < 4 or dp * pp == 1)]


def seq_split(tp, sp, cp_axes) -> int:
    """What the sequence must divide by: tp with sequence parallelism, each CP axis (ring's
    zigzag layout splits the sequence into 2 x its size chunks)."""
    return ((tp if sp else 1) * (2 if "ulysses_cp" in cp_axes else 1)
            * (4 if "ring_cp" in cp_axes else 1))


@st.composite
def configs(draw):
    cp = draw(st.sampled_from(list(CP_AXES)))
    cp_axes = CP_AXES[cp]
    budget = 8 // 2 ** len(cp_axes)
    dp, tp, pp = draw(st.sampled_from([t for t in TRIPLES if math.prod(t) <= budget
                                       and (cp or math.prod(t) > 1)]))
    ulysses = 2 if "ulysses_cp" in cp_axes else 1
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    sp = draw(st.booleans())
    if cp:  # sizes that divide: every CP example compares numbers
        heads = tp * ulysses * draw(st.sampled_from([1, 2]))
        kv = math.gcd(kv, heads)
        seq = seq_split(tp, sp, cp_axes) * draw(st.sampled_from([1, 2]))
    else:
        seq = draw(st.sampled_from([4, 6, 8]))
    layers = draw(st.integers(pp, 3))
    mb = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    order = draw(st.permutations(range(3 + len(cp_axes))))  # axes nest in mesh order
    return dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_axes=cp_axes, order=order, kv=kv, heads=heads,
                head_dim=head_dim, layers=layers, mb=mb,
                batch=dp * mb * draw(st.integers(1, 2)), seq=seq, sp=sp,
                tie=draw(st.booleans()), hidden=heads * head_dim + draw(st.sampled_from([0, 4])))


_RING = dict(dp=1, tp=2, pp=1, cp="ring_cp", cp_axes=("ring_cp",), order=(0, 1, 2, 3), kv=2,
             heads=4, head_dim=8, layers=2, mb=1, batch=2, seq=8, sp=True, tie=False, hidden=36)
_USP_PP = dict(dp=1, tp=1, pp=2, cp="usp", cp_axes=("ulysses_cp", "ring_cp"),
               order=(3, 0, 2, 4, 1), kv=1, heads=2, head_dim=4, layers=2, mb=2, batch=2, seq=16,
               sp=False, tie=True, hidden=8)


# the profile's examples (12 in CI, 200 thorough) besides the two explicit ones: every mesh
# family is also enumerated by tests/test_context_parallel.py, test_pipeline.py,
# test_e2e_dp_tp.py and test_generate.py; this draws the combinations between them
@given(configs())
@example(_RING)
@example(_USP_PP)
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
        assert cfg["cp"] is None, (cfg, msg)  # drawn to divide: must run
        tp = cfg["tp"]
        # only sizes that do not divide by tp may refuse, and they must say which
        assert ("does not divide" in msg or "cannot be split" in msg
                or "neither split nor replicated" in msg), msg
        assert (cfg["heads"] % tp or (cfg["kv"] % tp and tp % cfg["kv"]) or cfg["hidden"] % tp
                or cfg["seq"] % seq_split(tp, cfg["sp"], ()) or (3 * cfg["hidden"]) % tp), \
            (cfg, msg)
        return
    torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-4)
    pm.close()
