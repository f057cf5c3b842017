"""Adversarial inputs: every bad input is a clear error or the single-device answer, never a
silent wrong one (out-of-range token ids, NaN weights, zero queries, bad API arguments)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import fxshard
from fxshard.kernels import attention
from tests.models import our_llama


@pytest.mark.parametrize("bad_id", [128, -1])
def test_out_of_range_token_id_with_vocab_embedding_is_an_index_error(bad_id):
    model = our_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (2, 8))
    ids[1, 3] = bad_id
    with pytest.raises(IndexError):
        model(ids)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, embedding="vocab")
    with pytest.raises(IndexError, match=rf"token id {bad_id} is outside the vocabulary "
                                         rf"\[0, 128\).*'tp'"):
        pm(ids)
    ids[1, 3] = 5  # the mesh recovers
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)
    pm.close()


@pytest.mark.parametrize("where", ["q_proj", "first_token"])
@pytest.mark.parametrize("axis", ["ring_cp", "ulysses_cp", "tp"])
def test_nan_weight_gives_nan_where_single_device_does(axis, where):
    model = our_llama(num_hidden_layers=2)
    ids = torch.randint(8, 128, (2, 8))
    with torch.no_grad():
        if where == "q_proj":  # every query of one head is NaN: the whole output is NaN
            model.model.layers[1].self_attn.q_proj.weight[3, 5] = math.nan
        else:  # sample 1 is NaN from its first token on, sample 0 stays finite
            model.model.embed_tokens.weight[7, 5] = math.nan
            ids[1, 0] = 7
    want = model(ids)
    assert want.isnan().any() and (where == "q_proj" or not want[0].isnan().any())
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    pm = fxshard.parallelize(model, mesh)
    got = pm(ids)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    pm.close()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nan_in", ["q", "k", "v"])
def test_attention_fast_path_agrees_with_plain_path_on_nan(causal, nan_in):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    dict(q=q, k=k, v=v)[nan_in][0, 1, 2, 3] = math.nan
    # the reference in float64: torch's fused float32 CPU kernel gives 0 for a NaN query row
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal).float()
    out, lse = attention(q, k, v, causal=causal)
    # the mask argument forces the plain path
    out_plain, lse_plain = attention(q, k, v, causal=causal,
                                     mask=torch.ones(5, 5, dtype=torch.bool))
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(out, out_plain, equal_nan=True)
    torch.testing.assert_close(lse, lse_plain, equal_nan=True)


def test_zero_queries_do_not_crash_the_process():
    code = ("import torch\nfrom fxshard.kernels import attention\n"
            "k = torch.randn(1, 2, 4, 8)\n"
            "for backend in ('auto', 'torch'):\n"
            "    for causal in (True, False):\n"
            "        out, lse = attention(torch.randn(1, 2, 0, 8), k, k, causal=causal,"
            " backend=backend)\n"
            "        assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0), out.shape\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
