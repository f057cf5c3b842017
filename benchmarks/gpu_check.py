"""The prepared device check for a session that is lent a GPU: correctness first, then speed.

    python benchmarks/gpu_check.py [--out DIR]      # about 3-6 minutes on an H200

1. The Triton kernel on CUDA against the float64 torch reference: fp32/fp16/bf16, D in
   {16..256}, GQA, causal with offsets (fully masked rows included), odd lengths.
2. A Llama on a simulated mesh on the GPU (every rank on the one device, Triton attention in
   every rank's program) against the single-device model.
3. ``benchmarks/attention.py``'s table against SDPA flash/cuDNN, JSON in ``--out``.
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


def reference(q, k, v, causal, q_off, kv_off):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
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
            for causal, q_off, kv_off in ((False, 0, 0), (True, 0, 0), (True, 100, 0),
                                          (True, 0, 150)):
                q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
                v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
                out, lse = attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off,
                                     backend="triton")
                want, want_lse = reference(q, k, v, causal, q_off, kv_off)
                err = (out.double() - want).abs().max().item()
                fin = torch.isfinite(want_lse)
                lerr = (lse.double()[fin] - want_lse[fin]).abs().max().item() if fin.any() else 0
                same_inf = bool((torch.isneginf(lse) == ~fin).all())
                good = err < tol[dtype] and lerr < tol[dtype] and same_inf
                ok &= good
                if not good:
                    print(f"FAIL kernel {dtype} {(b, hq, hkv, sq, skv, d)} causal={causal} "
                          f"offsets={(q_off, kv_off)}: out err {err:.2e}, lse err {lerr:.2e}, "
                          f"-inf rows match {same_inf}")
    print(("PASS" if ok else "FAIL") + " Triton kernel vs float64 reference")
    return ok


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_check.py: no CUDA GPU; nothing to check")
        return 0
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")
    ok = kernel_checks()
    ok &= model_check()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--json",
                    str(Path(args.out) / "attention.json")], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
