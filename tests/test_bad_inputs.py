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


@pytest.mark.parametrize("mesh,embedding", [((2,), "embed_dim"), ((2,), "replicate"),
                                            ((1,), "embed_dim")])
@pytest.mark.parametrize("model_kind", ["ours", "hf"])
def test_out_of_range_token_id_names_the_id_and_the_vocabulary(model_kind, mesh, embedding):
    from tests.models import hf_llama
    model = our_llama(num_hidden_layers=1) if model_kind == "ours" else \
        hf_llama(layers=1, vocab=128)
    ids = torch.randint(0, 128, (2, 8))
    ids[1, 3] = 500
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", mesh,
                                                             mesh_dim_names=("tp",)),
                             embedding=embedding)
    with pytest.raises(IndexError, match=r"token id 500 at input_ids\[1, 3\] is outside the "
                                         r"vocabulary \[0, 128\) of the embedding "
                                         r"'model.embed_tokens.weight'"):
        pm(ids)
    pm.close()


def test_use_cache_points_to_generate():
    from tests.models import hf_llama
    model = hf_llama(layers=1, vocab=128)
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    with pytest.raises(NotImplementedError, match=r"use_cache=True.*use pm\.generate\(input_ids, "
                                                  r"max_new_tokens=\.\.\.\)"):
        pm(torch.randint(0, 128, (2, 8)), use_cache=True)


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
    # what one device gives on this CPU: for the NaN query row of q_proj, torch's SDPA gives
    # NaN on some CPUs and 0 on others (AVX-512); fxshard must give the same, NaN or not
    want = model(ids)
    if where == "first_token":
        assert want[1].isnan().all() and not want[0].isnan().any()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    pm = fxshard.parallelize(model, mesh)
    got = pm(ids)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    pm.close()


def _sdpa_like_other_cpu(monkeypatch, zero_below: int) -> None:
    """Make torch's CPU SDPA behave, for a query row of NaN, as on a CPU whose vector width
    is ``zero_below`` keys: without a mask it gives 0 for fewer keys and NaN from that many on
    (AVX-512: 16 in float32, AVX2: 8; 0 stands for the plain definition, NaN always); with a
    mask, NaN. For the single-device model and for fxshard's probe of it alike; not while
    torch.export traces the model (the graph must hold torch's SDPA, not this stand-in's fill,
    or fxshard would copy the fill of the traced shape into every rank's program)."""
    import importlib
    kernel = importlib.import_module("fxshard.kernels.attention")
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        out = real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                   scale=scale, **kw)
        if torch.compiler.is_compiling():
            return out
        nan_row = q.isnan().any(-1, keepdim=True)
        zeroes = attn_mask is None and k.shape[-2] < zero_below
        return out.masked_fill(nan_row, 0.0 if zeroes else math.nan)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    kernel._sdpa_zeroes_nan_rows.cache_clear()
    monkeypatch.setattr(kernel, "_sdpa_zeroes_nan_rows",
                        kernel._sdpa_zeroes_nan_rows.__wrapped__)


# 8 keys in one device's call, 4 in each ring step's: 5 is a CPU on which the ring's pieces
# alone would give 0 where the single-device call gives NaN (seen on an AVX2 CPU, 2026-12-02)
@pytest.mark.parametrize("zero_below", [0, 5, 9, 1000])
def test_nan_query_row_agrees_with_one_device_on_either_kind_of_cpu(monkeypatch, zero_below):
    """ring_cp runs fxshard's own attention kernel on pieces of the keys (tp and ulysses_cp run
    torch's SDPA op on whole heads and sequences, so they follow this CPU by construction)."""
    _sdpa_like_other_cpu(monkeypatch, zero_below)
    model = our_llama(num_hidden_layers=1)
    ids = torch.randint(8, 128, (2, 8))
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[3, 5] = math.nan
    want = model(ids)
    assert want.isnan().any() == (zero_below <= 8)  # the simulated CPU's behaviour took effect
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", (2,),
                                                             mesh_dim_names=("ring_cp",)))
    got = pm(ids)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    pm.close()


def test_nan_row_probe_follows_key_count_and_mask_kind(monkeypatch):
    from fxshard.kernels.attention import sdpa_zeroes_nan_rows, single_device_keys
    _sdpa_like_other_cpu(monkeypatch, 16)
    f32 = torch.float32
    assert sdpa_zeroes_nan_rows(f32, 15, None) and not sdpa_zeroes_nan_rows(f32, 16, None)
    assert not sdpa_zeroes_nan_rows(f32, 4, torch.ones(4, dtype=torch.bool))
    assert not sdpa_zeroes_nan_rows(f32, 4, torch.zeros(4))
    assert not sdpa_zeroes_nan_rows(f32, 10**6, None)  # probed with one key block, not 10**6
    with single_device_keys(32):  # a ring step's 4 keys of one call's 32
        assert not sdpa_zeroes_nan_rows(f32, 4, None)
    assert sdpa_zeroes_nan_rows(f32, 4, None)
    assert not sdpa_zeroes_nan_rows(torch.int64, 4, None)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nan_in", ["q", "k", "v", "q+inf,k-inf"])
def test_attention_fast_path_agrees_with_plain_path_on_nan(causal, nan_in):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    if nan_in == "q+inf,k-inf":  # no NaN anywhere, and the sums of q and k cancel to NaN
        q[0, 1, 2, 3], k[0, 0, 4, 1] = math.inf, -math.inf
    else:
        dict(q=q, k=k, v=v)[nan_in][0, 1, 2, 3] = math.nan
    # the reference: torch's SDPA on this CPU in float64 (for a NaN query row it gives NaN on
    # some CPUs, 0 on AVX-512 ones: fxshard follows this CPU's torch, NaN or not)
    # (and a CPU may differ by dtype: one seen 2026-12-02 zeroes the row in float32 but not in
    # float64; the values are float64's, the non-finite pattern the inputs' dtype's)
    ref64 = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal).float()
    ref32 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref = torch.where(ref64.isnan() | ref32.isnan(), ref32, ref64)
    out, lse = attention(q, k, v, causal=causal)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out.isnan().any() or (nan_in == "q" and not ref.isnan().any())
    torch.testing.assert_close(out, ref, equal_nan=True)
    # a mask forces the plain path; with a mask torch's SDPA may treat a NaN query row
    # otherwise (NaN on the AVX-512 CPU that zeroes it without one), and fxshard follows it
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask = mask.tril() if causal else mask
    ref_masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out_plain, lse_plain = attention(q, k, v, causal=False, mask=mask)  # the mask is causal
    assert torch.equal(out_plain.isnan(), ref_masked.isnan())
    rows = ~(out.isnan() | out_plain.isnan()).any(-1)  # rows both paths leave finite
    assert rows.any()
    torch.testing.assert_close(out[rows], out_plain[rows])
    torch.testing.assert_close(lse[rows], lse_plain[rows])
    torch.testing.assert_close(out_plain, ref_masked, equal_nan=True)


def test_attention_finite_check_is_sums_that_never_miss_a_non_finite_value():
    from fxshard.kernels.attention import _all_finite
    x = torch.randn(3, 4)
    assert _all_finite(x, x.double())
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[2, 1] = bad
        assert not _all_finite(x, y)
    # finite values whose float32 sum overflows: reported non-finite, so the exact plain path
    # runs, and its result is the float64 reference's
    q, k, v = torch.full((1, 1, 4, 2), 3e38), torch.zeros(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    assert not _all_finite(q)
    out, _ = attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True).float()
    torch.testing.assert_close(out, ref)


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


@pytest.mark.parametrize("call,error,message", [
    (lambda: fxshard.init_device_mesh("cpu", (2.7,), mesh_dim_names=("tp",)), TypeError,
     r"init_device_mesh: mesh_shape=\(2.7,\) holds 2.7 \(float\).*must be an int"),
    (lambda: fxshard.init_device_mesh("cpu", ("two",), mesh_dim_names=("tp",)), TypeError,
     r"mesh_shape=\('two',\) holds 'two' \(str\)"),
    (lambda: fxshard.init_device_mesh("cpu", 4, mesh_dim_names=("tp",)), TypeError,
     r"mesh_shape=4 must be a tuple of ints.*\(2, 2\)"),
    (lambda: fxshard.init_device_mesh("cpu", (2,), mesh_dim_names="tp"), TypeError,
     r"mesh_dim_names='tp' must be a tuple of axis names.*\(\"tp\",\)"),
    (lambda: fxshard.init_device_mesh("gpu", (2,), mesh_dim_names=("tp",)), ValueError,
     r"device_type='gpu' is not a torch device type; use \"cpu\" or \"cuda\""),
    (lambda: fxshard.init_device_mesh("cpu:1", (2,), mesh_dim_names=("tp",)), ValueError,
     r"device_type='cpu:1' names one device; give the type only \(\"cpu\"\)"),
    (lambda: fxshard.init_device_mesh(0, (2,), mesh_dim_names=("tp",)), TypeError,
     r"device_type=0 must be a string"),
], ids=["float_size", "str_size", "int_shape", "str_names", "gpu", "indexed", "int_device"])
def test_bad_mesh_arguments_name_the_argument_and_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_mesh_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match=r"device_type='cuda' but this machine has no cuda "
                                         r"device.*use \"cpu\""):
        fxshard.init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))


_PARALLELIZE_ERRORS = [
    (dict(microbatches=2.0), TypeError, r"microbatches=2.0 \(float\) must be an int >= 1"),
    (dict(microbatches=0), ValueError, r"microbatches=0 must be >= 1"),
    (dict(example_inputs=torch.zeros(1, 4, dtype=torch.long)), TypeError,
     r"example_inputs must be a tuple.*got Tensor; pass example_inputs=\(x,\)"),
    (dict(example_kwargs=[1]), TypeError, r"example_kwargs must be a dict.*got list"),
    (dict(plan=[("model.*", "colwise")]), TypeError, r"plan must be a dict.*got list"),
    (dict(plan={"model.layers.*.mlp.up_proj": ["colwise"]}), TypeError,
     r"plan\['model.layers.\*.mlp.up_proj'\] = \['colwise'\] is not a style; use one of "
     r"colwise, rowwise"),
    (dict(plan={"model.layers.*.mlp.up_proj": "column"}), ValueError,
     r"plan\['model.layers.\*.mlp.up_proj'\] = 'column' is not a style"),
    (dict(plan={3: "colwise"}), TypeError, r"plan key 3 \(int\) must be a module-name glob"),
    (dict(sequence_parallel="yes"), TypeError, r"sequence_parallel='yes' \(str\) must be True"),
    (dict(embedding="rows"), ValueError,
     r"embedding='rows'; use 'embed_dim', 'vocab' or 'replicate'"),
    (dict(stages="01"), TypeError, r"stages='01' must be a list of ints"),
    (dict(fsdp_reshard_after_forward="no"), TypeError,
     r"fsdp_reshard_after_forward='no'; pass True \(gather fsdp parameters again"),
    (dict(fsdp_reshard_after_forward="root"), TypeError,
     r"fsdp_reshard_after_forward='root'; .* or 'layers' \(gather again only the layer stack"),
]


@pytest.mark.parametrize("kwargs,error,message", _PARALLELIZE_ERRORS,
                         ids=[f"{next(iter(k))}-{i}" for i, (k, _, _) in
                              enumerate(_PARALLELIZE_ERRORS)])
def test_bad_parallelize_arguments_name_the_argument_and_the_fix(kwargs, error, message):
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(error, match=r"fxshard.parallelize: " + message):
        fxshard.parallelize(model, mesh, **kwargs)


def test_bad_model_and_mesh_types():
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got function"):
        fxshard.parallelize(lambda x: x, mesh)
    with pytest.raises(TypeError, match=r"expected a mesh from fxshard.init_device_mesh.*"
                                        r"got tuple"):
        fxshard.parallelize(our_llama(num_hidden_layers=1), (2,))


def test_plan_glob_that_matches_nothing_warns_and_shows_in_explain():
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 128, (1, 8))
    with pytest.warns(UserWarning, match=r"plan pattern 'model.layer.\*.mlp.up_proj' matches no "
                                         r"module of LlamaForCausalLM.*model.layers.0.mlp.up_proj"):
        pm = fxshard.parallelize(model, mesh, example_inputs=(ids,),
                                 plan={"model.layer.*.mlp.up_proj": "replicate",
                                       "model.layers.*.mlp.down_proj": "replicate"})
    text = str(pm.explain())
    assert "Plan patterns that match no module (ignored): 'model.layer.*.mlp.up_proj'" in text
    assert "down_proj" not in text.split("match no module")[1]
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value,message", [
    (None, r"'model.norm.weight' is NoneType, not a torch.Tensor"),
    ("w", r"'model.norm.weight' is str, not a torch.Tensor"),
], ids=["none", "str"])
def test_state_dict_values_must_be_tensors(value, message):
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = value
    with pytest.raises(TypeError, match="ParallelModule.load_state_dict: " + message):
        pm.load_state_dict(sd)
    with pytest.raises(TypeError, match=r"expected a dict of parameter name -> tensor.*got list"):
        pm.load_state_dict(list(sd.values()))


def test_numpy_state_dict_value_says_how_to_convert():
    np = pytest.importorskip("numpy")
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = np.ones(64, dtype=np.float32)
    with pytest.raises(TypeError, match=r"is ndarray, not a torch.Tensor \(torch.from_numpy"):
        pm.load_state_dict(sd)


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_attention_scale_must_be_finite(scale):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=rf"scale={scale} is not finite"):
        attention(q, q, q, scale=scale)


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_data_dependent_control_flow_is_a_short_error_naming_the_line(capfd):
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(_DataDependent(), mesh)
    with pytest.raises(NotImplementedError) as info:
        pm(torch.randn(2, 8))
    msg = str(info.value)
    assert msg.startswith("fxshard.parallelize: torch.export could not trace _DataDependent: "
                          "its forward branches on a tensor's value"), msg
    assert f"{__file__}:" in msg and "in forward: `if y.sum() > 0:`" in msg
    assert "torch.where" in msg and len(msg.splitlines()) == 1
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "def forward" not in capfd.readouterr().err  # torch's partial graph held back


@pytest.mark.grad
def test_backward_through_the_output_trains():
    # pm(x) with grad enabled trains (fxshard.training); under no_grad it is inference
    model = our_llama(num_hidden_layers=1)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh)
    ids = torch.randint(0, 128, (2, 8))
    out = pm(ids)
    out.sum().backward()
    model(ids).sum().backward()
    grads = pm.gradients()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():
        assert not pm(ids).requires_grad
    torch.testing.assert_close(out.detach(), model(ids).detach(), rtol=1e-4, atol=1e-4)
