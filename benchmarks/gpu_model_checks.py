"""The GPU check's model steps (:mod:`benchmarks.gpu_check` runs them): step 2, a Llama on a
simulated mesh on the GPU against the single-device model (:func:`model_check`); step 3,
HuggingFace Llama and Qwen2 as users run them on ``HF_MESHES`` (:func:`hf_checks`), then
``torch.compile`` with ``fxshard.backend`` (:func:`compile_backend_check`) and generation
(:func:`generate_check`); step 7, training through the public contract on simulated meshes
(:func:`training_check`). Each prints PASS/FAIL lines and returns whether everything passed;
``device="cpu"`` runs the same code without a GPU.
"""
from __future__ import annotations

import torch

__all__ = ["model_check", "training_check", "HF_MESHES", "hf_checks", "compile_backend_check",
           "generate_check"]


def model_check() -> bool:
    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=2)).cuda().eval()
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    ok = True
    for names, shape in ((("dp", "tp"), (2, 2)), (("tp", "ring_cp"), (2, 2)),
                         (("ulysses_cp", "pp"), (2, 2))):
        mesh = fxshard.init_device_mesh("cuda", shape, mesh_dim_names=names)
        pm = fxshard.parallelize(model, mesh)
        with torch.no_grad():
            err = (pm(ids) - model(ids)).abs().max().item()
        code = pm.rank_module(0).code
        good = err < 1e-3 and ("fxshard.attention" in code or "ring_attention" in code)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} llama on a simulated cuda mesh {dict(zip(names, shape))}: "
              f"max err {err:.2e}")
        pm.close()
    return ok


def training_check(device: str) -> bool:
    """A Llama trained on a simulated mesh on ``device`` through the public contract
    (``pm(ids)`` with grad enabled, ``loss.backward()``, AdamW over ``pm.parameters()``):
    fsdp=2 x tp=2 (ZeRO-3 + tp), dp=2 x tp=2 and tp=2 with sequence parallelism (a simulated
    mesh runs the background collectives at once: their NCCL path needs two GPUs); gradients and one AdamW step against the
    single-device model in fp32 (TF32 off; parameters to 1e-4 = lr / 10). On CUDA the backward program must call
    ``fxshard::attention_backward`` (the Triton backward)."""
    import copy

    import torch.nn.functional as F

    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=2)).to(device).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 64), generator=g).to(device)
    labels = torch.randint(0, 128, (4, 64), generator=g).to(device)
    ok = True
    for names, shape, sp in ((("fsdp", "tp"), (2, 2), False), (("dp", "tp"), (2, 2), False),
                             (("tp",), (2,), True)):
        ref = copy.deepcopy(model)
        try:
            mesh = fxshard.init_device_mesh(device, shape, mesh_dim_names=names)
            pm = fxshard.parallelize(copy.deepcopy(model), mesh, example_inputs=(ids,),
                                     sequence_parallel=sp)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten()).backward()
            F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten()).backward()
            grads = pm.gradients()
            gerr = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item()
                       for n, p in ref.named_parameters())
            opt.step()
            ref_opt.step()
            state = pm.state_dict()
            perr = max((state[n] - p).abs().max().item() for n, p in ref.named_parameters())
            triton = device != "cuda" or \
                "attention_backward" in pm.rank_module(0, "backward").code
            # perr: AdamW's first step is lr * g / (|g| + eps), ill-conditioned where |g| is
            # near eps; a wrong or missing update is lr = 1e-3 off
            good = gerr < 1e-4 and perr < 1e-4 and triton
            err = f"gradients {gerr:.2e} (relative), parameters after AdamW {perr:.2e}" + \
                ("" if triton else "; the backward does not call fxshard::attention_backward")
            pm.close()
        except Exception as exc:  # noqa: BLE001 - reported
            err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} training a llama on a simulated {device} mesh "
              f"{dict(zip(names, shape))}{' + sequence parallel' if sp else ''}: {err}",
              flush=True)
    return ok


HF_MESHES = ((("tp",), (2,)), (("tp", "ring_cp"), (2, 2)),
             (("dp", "tp", "pp", "ulysses_cp"), (2, 2, 2, 2)))   # the seed's 16-rank mesh


def _hf_config(family: str):
    import transformers
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**common)


def hf_checks(device: str) -> bool:
    """HF models as users run them: built on meta from the config, loaded from a
    ``save_pretrained`` directory of shards, on a simulated mesh of ``device``; and with real
    weights on the device. fp32 and bf16 against the same model on one device."""
    import tempfile

    import transformers

    import fxshard
    ok = True
    ids = torch.randint(0, 256, (4, 64), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    for family in ("llama", "qwen2"):
        config = _hf_config(family)
        with tempfile.TemporaryDirectory() as ckpt:
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
                ckpt, max_shard_size="200KB")
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
                ref = transformers.AutoModelForCausalLM.from_pretrained(
                    ckpt, dtype=dtype).to(device).eval()
                with torch.no_grad():
                    want = ref(ids).logits.float()
                scale = want.abs().max().item()
                for names, shape in HF_MESHES:
                    mesh = fxshard.init_device_mesh(device, shape, mesh_dim_names=names)
                    for how in ("meta+safetensors", "weights on device"):
                        if how == "weights on device":
                            pm = fxshard.parallelize(ref, mesh)
                        else:
                            with torch.device("meta"):
                                empty = transformers.AutoModelForCausalLM.from_config(
                                    config, dtype=dtype)
                            pm = fxshard.parallelize(empty, mesh)
                            fxshard.load_safetensors(pm, ckpt)
                        try:
                            with torch.no_grad():
                                got = pm(ids).logits.float()
                            err = (got - want).abs().max().item() / scale
                            good = err < tol
                        except Exception as exc:  # noqa: BLE001 - reported, then next case
                            err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
                        ok &= good
                        print(f"{'PASS' if good else 'FAIL'} HF {family} {dtype} {how} on a "
                              f"simulated {device} mesh {dict(zip(names, shape))}: max err / "
                              f"max |logit| {err if isinstance(err, str) else f'{err:.2e}'}",
                              flush=True)
                        pm.close()
    return ok


def compile_backend_check(device: str) -> bool:
    import transformers

    import fxshard
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config("llama")).to(device).eval()
    ids = torch.randint(0, 256, (4, 32), device=device)
    mesh = fxshard.init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        compiled = torch.compile(model, backend=fxshard.backend(mesh))
        with torch.no_grad():
            err = (compiled(ids).logits - model(ids).logits).abs().max().item()
        good = err < 1e-3
    except Exception as exc:  # noqa: BLE001 - reported
        err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
    print(f"{'PASS' if good else 'FAIL'} torch.compile(HF llama, backend=fxshard.backend(dp=2, "
          f"tp=2)) on {device}: max err {err}", flush=True)
    return good


def generate_check(device: str) -> bool:
    """Text generation on the device: HF Llama greedy tokens (fp32) from pm.generate on a
    simulated tp=2 and tp=2 x ring_cp=2 mesh equal HF generate on one device; the decode
    steps use fxshard.kernels.decode (Triton on CUDA)."""
    import transformers

    import fxshard
    torch.manual_seed(0)
    config = _hf_config("llama")
    model = transformers.AutoModelForCausalLM.from_config(config).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 256, (4, 16), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False)
    ok = True
    for names, shape in ((("tp",), (2,)), (("tp", "ring_cp"), (2, 2))):
        mesh = fxshard.init_device_mesh(device, shape, mesh_dim_names=names)
        pm = fxshard.parallelize(model, mesh)
        try:
            got = pm.generate(ids, max_new_tokens=8)
            good = torch.equal(got, want)
            err = f"{int((got != want).sum())} tokens differ"
        except Exception as exc:  # noqa: BLE001 - reported, then next case
            err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} pm.generate (HF llama, 8 new tokens) on a simulated "
              f"{device} mesh {dict(zip(names, shape))}: {err}", flush=True)
        pm.close()
    return ok
