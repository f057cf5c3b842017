"""The prepared device check for a session that is lent a GPU: correctness first, then speed.

    python benchmarks/gpu_check.py [--out DIR]      # about 3-6 minutes on an H200
    python benchmarks/gpu_check.py --decode-only    # step 4 and the decode table only

1. The Triton kernel on CUDA against the float64 torch reference: fp32/fp16/bf16, D in
   {16..256}, GQA, causal with offsets (fully masked rows included), odd lengths.
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

``--device cpu`` runs steps 3 and 4 on the CPU (step 4 with the torch path), to try the script
without a GPU.
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
    cases = [(2, 8, 2, 300, 300, 64), (1, 4, 4, 129, 257, 128), (2, 6, 3, 64, 200, 32),
             (1, 2, 1, 1000, 1000, 16), (1, 2, 2, 77, 333, 256)]
    for dtype in tol:
        for b, hq, hkv, sq, skv, d in cases:
            for causal, q_off, kv_off, cap in ((False, 0, 0, 0.0), (True, 0, 0, 0.0),
                                               (True, 100, 0, 0.0), (True, 0, 150, 0.0),
                                               (True, 0, 0, 2.0), (False, 0, 150, 2.0)):
                q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
                v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
                if cap:  # scores well beyond the cap, so a lost cap shows
                    q = q * 4
                out, lse = attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off,
                                     softcap=cap or None, backend="triton")
                want, want_lse = reference(q, k, v, causal, q_off, kv_off, cap)
                err = (out.double() - want).abs().max().item()
                fin = torch.isfinite(want_lse)
                lerr = (lse.double()[fin] - want_lse[fin]).abs().max().item() if fin.any() else 0
                same_inf = bool((torch.isneginf(lse) == ~fin).all())
                good = err < tol[dtype] and lerr < tol[dtype] and same_inf
                ok &= good
                if not good:
                    print(f"FAIL kernel {dtype} {(b, hq, hkv, sq, skv, d)} causal={causal} "
                          f"offsets={(q_off, kv_off)} softcap={cap}: out err {err:.2e}, lse err {lerr:.2e}, "
                          f"-inf rows match {same_inf}")
    print(("PASS" if ok else "FAIL") + " Triton kernel vs float64 reference (with and without "
          "a soft-cap)")
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
    # (B, Hq, Hkv, Sq, L, D)
    cases = [(3, 32, 8, 1, 20000, 128), (2, 8, 8, 4, 3000, 64), (4, 16, 2, 1, 777, 256),
             (2, 4, 1, 4, 5000, 128), (2, 12, 4, 2, 1500, 96)]
    if device != "cuda":
        cases = [(3, 8, 2, 1, 300, 64), (2, 4, 1, 4, 100, 32)]
    worst = 0.0
    for dtype in tol:
        for b, hq, hkv, sq, cap, d in cases:
            lengths = torch.tensor([cap, 0, 1, cap // 3 + 5][:b], device=device)
            for causal in (True, False):
                q = torch.randn(b, hq, sq, d, device=device, dtype=dtype, generator=g)
                k = torch.randn(b, hkv, cap, d, device=device, dtype=dtype, generator=g)
                v = torch.randn(b, hkv, cap, d, device=device, dtype=dtype, generator=g)
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
                    print(f"FAIL decode {backend} {dtype} {(b, hq, hkv, sq, cap, d)} "
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' runs the HF and compile checks here (a dry run of the script)")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode kernel's check and benchmarks/decode.py (~1-2 min)")
    args = ap.parse_args()
    if args.device == "cpu":
        if args.decode_only:
            return 0 if decode_checks("cpu") else 1
        ok = hf_checks("cpu") & compile_backend_check("cpu") & decode_checks("cpu") & \
            generate_check("cpu")
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
    ok = kernel_checks()
    ok &= decode_checks("cuda")
    ok &= model_check()
    ok &= hf_checks("cuda")
    ok &= compile_backend_check("cuda")
    ok &= generate_check("cuda")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--json",
                    str(Path(args.out) / "attention.json")], check=False)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--json",
                    str(Path(args.out) / "decode.json")], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
