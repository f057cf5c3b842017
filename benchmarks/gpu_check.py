"""The prepared device check for a session that is lent a GPU: correctness first, then speed.

    python benchmarks/gpu_check.py [--out DIR]      # about 3-6 minutes on an H200
    python benchmarks/gpu_check.py --decode-only    # step 4 and the decode table only
    python benchmarks/gpu_check.py --backward-only  # step 6 and its tables only
    python benchmarks/gpu_check.py --training-only  # step 7 only

1. The Triton kernel on CUDA against the float64 torch reference: fp32/fp16/bf16, D in
   {16..256}, MLA's Dv != D, GQA, causal with offsets (fully masked rows included), odd
   lengths; then step 6's correctness part.
2. A Llama on a simulated mesh on the GPU (every rank on the one device, Triton attention in
   every rank's program) against the single-device model.
3. HuggingFace Llama and Qwen2 as users run them (built on meta, loaded from a
   ``save_pretrained`` directory; and with real weights on the GPU), fp32 and bf16, on tp=2,
   tp=2 x ring_cp=2 and the seed's 16-rank dp x tp x pp x ulysses_cp mesh, simulated on the
   GPU; then ``torch.compile`` with ``fxshard.backend`` (dp=2 x tp=2).
4. Run right after step 1: the decode kernel (``decode_attention(backend="triton")``,
   split-K) against the float64 reference and the torch path: fp32/fp16/bf16, GQA groups
   1/3/4/8, 1, 2 and 4 queries, uneven lengths (0, 1, full) in caches up to 20k keys, causal
   and not, D 64/96/128/256, several splits.
5. ``benchmarks/attention.py``'s table against SDPA flash/cuDNN, and ``benchmarks/decode.py``'s
   decode bandwidth table (GB/s of K+V read vs SDPA flash/cuDNN, % of 4.8 TB/s), JSON in
   ``--out``.

6. The attention backward: ``fxshard::attention_backward`` (the Triton backward of
   ``fxshard/kernels/triton_attention_bwd.py``) against float64 autograd (fp32/fp16/bf16, GQA,
   causal with offsets, soft-cap, Dv != D, odd lengths, an lse gradient); then a table of its
   TFLOP/s at bf16 D=128, causal and not, S 1k-8k, against SDPA flash's and cuDNN's backward
   on the same GPU (H100 references: FA2 ~214-322, cuDNN ~305-518, FA3 ~316-561 TFLOP/s), and
   one of the forward kernels at MLA's head sizes (Dv != D) against SDPA; JSON in ``--out``
   (``attention_backward.json``). A row that fails prints its error; the others still run.

7. Training through the public contract on simulated meshes on the GPU (fsdp=2 x tp=2,
   dp=2 x tp=2, tp=2 with sequence parallelism): gradients and one AdamW step against the
   single-device model (fp32, TF32 off); the backward program calls the Triton backward.
   ``--training-only`` runs it alone.

``--device cpu`` runs steps 3, 4, 6's check and 7 on the CPU (4 and 6 with the torch path), to try
the script without a GPU.
Prints PASS/FAIL lines; exits non-zero if a correctness check fails.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference(q, k, v, causal, q_off, kv_off, softcap=0.0):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None] + q_off
        j = torch.arange(k.shape[2], device=q.device)[None, :] + kv_off
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return p @ v, lse


def kernel_checks() -> bool:
    from fxshard.kernels import attention
    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
    # (B, Hq, Hkv, Sq, Skv, D, Dv); the last three: MLA's Dv != D (DeepSeek's 192/128 is
    # run as 256/128, q and k zero-padded: the prefill kernel takes D in {16, ..., 256})
    cases = [(2, 8, 2, 300, 300, 64, 64), (1, 4, 4, 129, 257, 128, 128),
             (2, 6, 3, 64, 200, 32, 32), (1, 2, 1, 1000, 1000, 16, 16),
             (1, 2, 2, 77, 333, 256, 256), (2, 8, 2, 300, 300, 256, 128),
             (1, 4, 1, 129, 257, 64, 128), (1, 4, 2, 200, 311, 128, 64)]
    for dtype in tol:
        for b, hq, hkv, sq, skv, d, dv in cases:
            for causal, q_off, kv_off, cap in ((False, 0, 0, 0.0), (True, 0, 0, 0.0),
                                               (True, 100, 0, 0.0), (True, 0, 150, 0.0),
                                               (True, 0, 0, 2.0), (False, 0, 150, 2.0)):
                q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
                v = torch.randn(b, hkv, skv, dv, device="cuda", dtype=dtype, generator=g)
                if cap:  # scores well beyond the cap, so a lost cap shows
                    q = q * 4
                try:
                    out, lse = attention(q, k, v, causal=causal, q_offset=q_off,
                                         kv_offset=kv_off, softcap=cap or None, backend="triton")
                    want, want_lse = reference(q, k, v, causal, q_off, kv_off, cap)
                    err = (out.double() - want).abs().max().item()
                    fin = torch.isfinite(want_lse)
                    lerr = (lse.double()[fin] - want_lse[fin]).abs().max().item() \
                        if fin.any() else 0
                    same_inf = bool((torch.isneginf(lse) == ~fin).all())
                    good = err < tol[dtype] and lerr < tol[dtype] and same_inf
                    why = f"out err {err:.2e}, lse err {lerr:.2e}, -inf rows match {same_inf}"
                except Exception as exc:  # noqa: BLE001 - reported, then next case
                    good, why = False, f"{type(exc).__name__}: {str(exc)[:300]}"
                ok &= good
                if not good:
                    print(f"FAIL kernel {dtype} {(b, hq, hkv, sq, skv, d, dv)} causal={causal} "
                          f"offsets={(q_off, kv_off)} softcap={cap}: {why}")
    print(("PASS" if ok else "FAIL") + " Triton kernel vs float64 reference (with and without "
          "a soft-cap; MLA's Dv != D included)")
    return ok


def decode_reference(q, k, v, lengths, causal):
    """Float64 decode attention with the contract of fxshard.kernels.decode_attention."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    j = torch.arange(k.shape[2], device=q.device).view(1, 1, -1)
    n = lengths.view(-1, 1, 1)
    last = n - q.shape[2] + torch.arange(q.shape[2], device=q.device).view(1, -1, 1) \
        if causal else n - 1
    s = s.masked_fill(((j >= n) | (j > last)).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return p @ v, lse


def decode_checks(device: str) -> bool:
    """The Triton decode kernel on CUDA (the torch path on CPU) vs the float64 reference, and on
    CUDA vs the torch path too."""
    from fxshard.kernels import decode_attention
    backend = "triton" if device == "cuda" else "torch"
    ok = True
    g = torch.Generator(device=device).manual_seed(0)
    tol = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
    # (B, Hq, Hkv, Sq, L, D, Dv); the last: DeepSeek's MLA heads (192 / 128, padded inside)
    cases = [(3, 32, 8, 1, 20000, 128, 128), (2, 8, 8, 4, 3000, 64, 64),
             (4, 16, 2, 1, 777, 256, 256), (2, 4, 1, 4, 5000, 128, 128),
             (2, 12, 4, 2, 1500, 96, 96), (2, 16, 16, 2, 4000, 192, 128)]
    if device != "cuda":
        cases = [(3, 8, 2, 1, 300, 64, 64), (2, 4, 1, 4, 100, 32, 32), (2, 4, 4, 2, 50, 48, 32)]
    worst = 0.0
    for dtype in tol:
        for b, hq, hkv, sq, cap, d, dv in cases:
            lengths = torch.tensor([cap, 0, 1, cap // 3 + 5][:b], device=device)
            for causal in (True, False):
                q = torch.randn(b, hq, sq, d, device=device, dtype=dtype, generator=g)
                k = torch.randn(b, hkv, cap, d, device=device, dtype=dtype, generator=g)
                v = torch.randn(b, hkv, cap, dv, device=device, dtype=dtype, generator=g)
                try:
                    out, lse = decode_attention(q, k, v, lengths, causal=causal,
                                                backend=backend)
                    want, want_lse = decode_reference(q, k, v, lengths, causal)
                    t_out, t_lse = decode_attention(q, k, v, lengths, causal=causal,
                                                    backend="torch")
                    fin = torch.isfinite(want_lse)
                    err = max((out.double() - want).abs().max().item(),
                              (out.double() - t_out.double()).abs().max().item(),
                              (lse.double()[fin] - want_lse[fin]).abs().max().item(),
                              (lse[fin] - t_lse[fin]).abs().max().item())
                    good = (err < tol[dtype] and bool((torch.isneginf(lse) == ~fin).all())
                            and not torch.isnan(out).any())
                except Exception as exc:  # noqa: BLE001 - reported, then next case
                    err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
                ok &= good
                if isinstance(err, float):
                    worst = max(worst, err / tol[dtype])
                if not good:
                    print(f"FAIL decode {backend} {dtype} {(b, hq, hkv, sq, cap, d, dv)} "
                          f"lengths={lengths.tolist()} causal={causal}: {err}", flush=True)
    print(f"{'PASS' if ok else 'FAIL'} decode_attention(backend={backend!r}) on {device} vs "
          f"float64 reference and torch path (worst error / tolerance {worst:.2f})", flush=True)
    if device == "cuda":
        ok &= decode_graph_check()
    return ok


def decode_graph_check() -> bool:
    """The decode kernel captured in a CUDA graph (no host sync may happen inside), replayed
    after new lengths and queries are written into the captured tensors: it must read them."""
    from fxshard.kernels import decode_attention
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.tensor([4096, 100], device="cuda")
    try:
        decode_attention(q, k, v, lengths)          # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = decode_attention(q, k, v, lengths)
        lengths.copy_(torch.tensor([7, 3000], device="cuda"))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g))
        graph.replay()
        want, want_lse = decode_attention(q, k, v, lengths, backend="torch")
        err = max((out.float() - want.float()).abs().max().item(),
                  (lse - want_lse).abs().max().item())
        good = err < 5e-2
    except Exception as exc:  # noqa: BLE001 - reported
        err, good = f"{type(exc).__name__}: {str(exc)[:300]}", False
    print(f"{'PASS' if good else 'FAIL'} decode kernel in a CUDA graph, replayed with new lengths "
          f"and queries: max err {err}", flush=True)
    return good


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


# ---------------------------------------------------------------- the attention backward

BWD_REFERENCES = ("H100 bf16 D=128 references (TFLOP/s): FA2 ~214-322, cuDNN ~305-518, "
                  "FA3 ~316-561")


def grad_reference(q, k, v, dout, dlse, causal, q_off, kv_off, softcap=0.0):
    """Float64 ``(dq, dk, dv)`` of ``sum(out * dout) + sum(lse * dlse)`` by autograd through
    :func:`reference` (rows that see no key: lse counted as 0)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out, lse = reference(*leaves, causal, q_off, kv_off, softcap)
        loss = (out * dout.double()).sum()
        if dlse is not None:
            loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse.double()).sum()
        return torch.autograd.grad(loss, leaves)


def backward_checks(device: str) -> bool:
    """``fxshard::attention_backward`` (the Triton backward on CUDA, torch on CPU) vs float64
    autograd: fp32/fp16/bf16, GQA, causal with offsets (rows that see no key included), soft-cap,
    MLA's Dv != D, lengths that are not multiples of the blocks, with and without an lse
    gradient; each case's error is printed and the others still run."""
    from fxshard.kernels import attention
    ok, worst = True, 0.0
    g = torch.Generator(device=device).manual_seed(0)
    tol = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
    # (B, Hq, Hkv, Sq, Skv, D, Dv); fp16 on the first two only (each dtype, head-size pair,
    # causal flag and soft-cap is a compilation of both kernels)
    cases = [(2, 8, 2, 300, 300, 64, 64), (1, 4, 4, 129, 257, 128, 128),
             (1, 2, 1, 1000, 1000, 16, 16), (1, 2, 2, 77, 333, 256, 256),
             (1, 8, 2, 250, 250, 256, 128), (1, 4, 1, 129, 257, 64, 128)]
    if device != "cuda":
        cases, tol = [(1, 4, 2, 37, 29, 32, 16), (2, 2, 2, 20, 33, 16, 16)], {torch.float32: 2e-4}
    for dtype in tol:
        for b, hq, hkv, sq, skv, d, dv in (cases[:2] if dtype == torch.float16 else cases):
            for n, (causal, q_off, kv_off, cap) in enumerate(
                    ((False, 0, 0, 0.0), (True, 0, 0, 0.0), (True, 100, 0, 0.0),
                     (True, 0, 150, 0.0), (True, 0, 0, 2.0))):
                q = torch.randn(b, hq, sq, d, device=device, dtype=dtype, generator=g)
                k = torch.randn(b, hkv, skv, d, device=device, dtype=dtype, generator=g)
                v = torch.randn(b, hkv, skv, dv, device=device, dtype=dtype, generator=g)
                if cap:
                    q = q * 4
                dout = torch.randn(b, hq, sq, dv, device=device, dtype=dtype, generator=g)
                dlse = torch.randn(b, hq, sq, device=device, generator=g) if n % 2 else None
                try:
                    with torch.no_grad():
                        out, lse = attention(q, k, v, causal=causal, q_offset=q_off,
                                             kv_offset=kv_off, softcap=cap or None)
                        got = torch.ops.fxshard.attention_backward(
                            q, k, v, None, out, lse, dout, dlse, causal, None, q_off, kv_off, cap)
                    want = grad_reference(q, k, v, dout, dlse, causal, q_off, kv_off, cap)
                    # relative to the largest gradient entry (dk/dv sum over many queries)
                    err = max(((a.double() - w).abs().max() / w.abs().max().clamp_min(1.0)).item()
                              for a, w in zip(got, want))
                    good = err < tol[dtype] and not any(torch.isnan(a).any() for a in got)
                    worst = max(worst, err / tol[dtype])
                    why = f"max err / max |grad| {err:.2e}"
                except Exception as exc:  # noqa: BLE001 - reported, then next case
                    good, why = False, f"{type(exc).__name__}: {str(exc)[:300]}"
                ok &= good
                if not good:
                    print(f"FAIL attention backward {dtype} {(b, hq, hkv, sq, skv, d, dv)} "
                          f"causal={causal} offsets={(q_off, kv_off)} softcap={cap} "
                          f"dlse={dlse is not None}: {why}", flush=True)
    what = "Triton" if device == "cuda" else "torch"
    print(f"{'PASS' if ok else 'FAIL'} fxshard::attention_backward ({what}) on {device} vs "
          f"float64 autograd (worst error / tolerance {worst:.2f})", flush=True)
    return ok


def backward_flops(batch, heads, seq, head_dim, head_dim_v, causal) -> float:
    """Recomputed q k^T, dv, dp, dq, dk: 2 * B * H * S^2 * (3 D + 2 Dv), half when causal
    (2.5x the forward's at Dv = D, FlashAttention's convention)."""
    flops = 2.0 * batch * heads * seq * seq * (3 * head_dim + 2 * head_dim_v)
    return flops / 2 if causal else flops


def forward_flops(batch, heads, seq, head_dim, head_dim_v, causal) -> float:
    flops = 2.0 * batch * heads * seq * seq * (head_dim + head_dim_v)
    return flops / 2 if causal else flops


def format_table(rows: list, columns: list) -> str:
    """A fixed-width table of ``rows`` (dicts); floats with 2 decimals, missing as '-', a
    row's ``error`` after its cells."""
    def cell(value):
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    for r, line in zip(rows, cells):
        text = "  ".join(x.rjust(w) for x, w in zip(line, widths))
        lines.append(text + (f"  {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sdpa_backward_ms(q, k, v, dout, causal, backend) -> tuple[float, tuple]:
    """Milliseconds of SDPA's backward under ``backend`` (the forward recorded once), and its
    gradients."""
    from torch.nn.attention import sdpa_kernel
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad(), sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    ms = _bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return ms, grads


def backward_table(seqs=(1024, 2048, 4096, 8192), tokens=16384, hidden=2048, *,
                   head_dim=128, device="cuda", dtype=torch.bfloat16) -> list:
    """bf16, D=128, causal and not: our backward (preprocess + dK/dV + dQ) vs SDPA flash's and
    cuDNN's backward on this GPU; ``max_err``: our gradients vs SDPA flash's, over the largest
    entry. One row per case; a failing row keeps its error and the others still run."""
    from torch.nn.attention import SDPBackend
    from fxshard.kernels.attention import attention
    from fxshard.kernels.triton_attention_bwd import attention_bwd
    rows = []
    for causal in (False, True):
        for seq in seqs:
            b, h, d = max(1, tokens // seq), hidden // head_dim, head_dim
            row = {"seq": seq, "batch": b, "heads": h, "causal": causal}
            fl = backward_flops(b, h, seq, d, d, causal)
            try:
                torch.manual_seed(0)
                q, k, v, dout = (torch.randn(b, h, seq, d, device=device, dtype=dtype)
                                 for _ in range(4))
                with torch.no_grad():
                    out, lse = attention(q, k, v, causal=causal, backend="triton")
                    ours = attention_bwd(q, k, v, out, dout, lse, causal=causal, grad_dtype=dtype)
                    row["ours_ms"] = _bench(lambda: attention_bwd(
                        q, k, v, out, dout, lse, causal=causal, grad_dtype=dtype))
                row["ours_tflops"] = fl / row["ours_ms"] / 1e9
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                      ("cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None))):
                    if backend is None:
                        continue
                    try:
                        ms, grads = _sdpa_backward_ms(q, k, v, dout, causal, backend)
                    except Exception as exc:  # noqa: BLE001 - a backend this GPU lacks
                        row["error"] = (row.get("error", "") + f" {name}: "
                                        f"{type(exc).__name__}: {str(exc)[:80]}").strip()
                        continue
                    row[f"{name}_ms"], row[f"{name}_tflops"] = ms, fl / ms / 1e9
                    if name == "flash":
                        row["max_err"] = max(
                            ((a.float() - w.float()).abs().max() / w.float().abs().max()).item()
                            for a, w in zip(ours, grads))
            except Exception as exc:  # noqa: BLE001 - reported in the row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


BWD_COLUMNS = ["seq", "batch", "heads", "causal", "ours_ms", "ours_tflops", "flash_ms",
               "flash_tflops", "cudnn_ms", "cudnn_tflops", "max_err"]
MLA_COLUMNS = ["kernel", "dqk", "dv", "seq", "batch", "heads", "causal", "ours_ms",
               "ours_tflops", "sdpa_ms", "sdpa_tflops", "max_err"]


MLA_CASES = ((192, 128, 4096, True), (256, 128, 4096, True), (256, 128, 4096, False),
             (128, 64, 4096, True))


def mla_table(cases=MLA_CASES, *, batch=4, heads=16, device="cuda", dtype=torch.bfloat16
              ) -> list:
    """The forward kernels at MLA's head sizes (Dv != D), bf16: prefill at DeepSeek's 192/128
    (expected to say the prefill kernel needs D in {16..256} powers of two) and padded to
    256/128, against SDPA's default choice (flash needs Dv == D); ``max_err`` vs SDPA."""
    from fxshard.kernels.attention import attention
    rows = []
    for dqk, dv, seq, causal in cases:
        b, h = batch, heads
        row = {"kernel": "prefill", "dqk": dqk, "dv": dv, "seq": seq, "batch": b, "heads": h,
               "causal": causal}
        fl = forward_flops(b, h, seq, dqk, dv, causal)
        try:
            torch.manual_seed(0)
            q = torch.randn(b, h, seq, dqk, device=device, dtype=dtype)
            k = torch.randn(b, h, seq, dqk, device=device, dtype=dtype)
            v = torch.randn(b, h, seq, dv, device=device, dtype=dtype)
            with torch.no_grad():
                sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, is_causal=causal)
                want = sdpa()
                row["sdpa_ms"] = _bench(sdpa)
                row["sdpa_tflops"] = fl / row["sdpa_ms"] / 1e9
                out, _ = attention(q, k, v, causal=causal, backend="triton")
                row["max_err"] = (out.float() - want.float()).abs().max().item()
                row["ours_ms"] = _bench(lambda: attention(q, k, v, causal=causal,
                                                          backend="triton"))
                row["ours_tflops"] = fl / row["ours_ms"] / 1e9
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    return rows


def backward_report(out_dir: Path) -> None:
    """The backward and MLA tables (printed, and JSON in ``out_dir``)."""
    import json
    print(f"\nattention backward, bf16, D=128, on {torch.cuda.get_device_name()}; "
          f"{BWD_REFERENCES}", flush=True)
    bwd = backward_table()
    print(format_table(bwd, BWD_COLUMNS), flush=True)
    print("\nforward kernels at MLA head sizes (Dv != D), bf16", flush=True)
    mla = mla_table()
    print(format_table(mla, MLA_COLUMNS), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_backward.json").write_text(json.dumps(
        {"backward": bwd, "mla_forward": mla, "references": BWD_REFERENCES,
         "device": torch.cuda.get_device_name(), "torch": torch.__version__}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' runs the HF and compile checks here (a dry run of the script)")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode kernel's check and benchmarks/decode.py (~1-2 min)")
    ap.add_argument("--backward-only", action="store_true",
                    help="only the attention backward's check and tables (~1-2 min)")
    ap.add_argument("--training-only", action="store_true",
                    help="only step 7, training on simulated meshes (~1 min)")
    args = ap.parse_args()
    if args.device == "cpu":
        if args.decode_only:
            return 0 if decode_checks("cpu") else 1
        if args.backward_only:
            return 0 if backward_checks("cpu") else 1
        if args.training_only:
            return 0 if training_check("cpu") else 1
        ok = hf_checks("cpu") & compile_backend_check("cpu") & decode_checks("cpu") & \
            generate_check("cpu") & backward_checks("cpu") & training_check("cpu")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("benchmarks/gpu_check.py: no CUDA GPU; nothing to check")
        return 0
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")
    if args.decode_only:
        ok = decode_checks("cuda")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--json",
                        str(Path(args.out) / "decode.json")], check=False)
        return 0 if ok else 1
    if args.training_only:
        return 0 if training_check("cuda") else 1
    if args.backward_only:
        ok = backward_checks("cuda")
        backward_report(Path(args.out))
        return 0 if ok else 1
    ok = kernel_checks()
    ok &= backward_checks("cuda")
    ok &= decode_checks("cuda")
    ok &= model_check()
    ok &= hf_checks("cuda")
    ok &= compile_backend_check("cuda")
    ok &= generate_check("cuda")
    ok &= training_check("cuda")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--json",
                    str(Path(args.out) / "attention.json")], check=False)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--json",
                    str(Path(args.out) / "decode.json")], check=False)
    backward_report(Path(args.out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
