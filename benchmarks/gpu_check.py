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

8. Training rows (:mod:`benchmarks.gpu_train_checks`): an HF Llama of ~1B parameters on a
   simulated fsdp=2 x tp=2 mesh on the GPU in bf16 mixed precision, eager and
   ``compile=True``, 20 steps against one device's autocast: loss, tokens/s, peak memory; the
   table is written to ``benchmarks/RESULTS.md``. ``--train-rows-only`` runs it alone (~5-8 min).

``--device cpu`` runs steps 3, 4, 6's check, 7 and 8 (a tiny config) on the CPU (4 and 6 with the torch path), to try
the script without a GPU.
Prints PASS/FAIL lines; exits non-zero if a correctness check fails. Steps 1 and 4 are
:mod:`benchmarks.gpu_kernel_checks`, steps 2, 3 and 7 :mod:`benchmarks.gpu_model_checks`; step 6
and the driver are here.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_kernel_checks import (decode_checks, decode_reference,  # noqa: E402,F401
                                          format_table, kernel_checks, reference)
from benchmarks.gpu_model_checks import (compile_backend_check, generate_check,  # noqa: E402
                                         hf_checks, model_check, training_check)
from benchmarks.gpu_train_checks import train_rows_check  # noqa: E402


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
    ap.add_argument("--train-rows-only", action="store_true",
                    help="only step 8, the ~1B Llama bf16 training rows (~5-8 min on a GPU)")
    args = ap.parse_args()
    results = ROOT / "benchmarks" / "RESULTS.md"
    if args.device == "cpu" and args.train_rows_only:
        return 0 if train_rows_check("cpu") else 1
    if args.device == "cpu":
        if args.decode_only:
            return 0 if decode_checks("cpu") else 1
        if args.backward_only:
            return 0 if backward_checks("cpu") else 1
        if args.training_only:
            return 0 if training_check("cpu") else 1
        ok = hf_checks("cpu") & compile_backend_check("cpu") & decode_checks("cpu") & \
            generate_check("cpu") & backward_checks("cpu") & training_check("cpu") & \
            train_rows_check("cpu")
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
    if args.train_rows_only:
        return 0 if train_rows_check("cuda", results) else 1
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
    ok &= train_rows_check("cuda", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
