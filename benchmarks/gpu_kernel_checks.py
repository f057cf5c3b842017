"""The GPU check's kernel steps (:mod:`benchmarks.gpu_check` runs them): step 1, the Triton
attention kernel on CUDA against the float64 torch reference (:func:`reference`; fp32/fp16/bf16,
D in {16..256}, MLA's Dv != D, GQA, causal with offsets, odd lengths), and step 4, the decode
kernel (``decode_attention(backend="triton")``, split-K) against the float64 reference
(:func:`decode_reference`) and the torch path, with :func:`decode_graph_check`. Each prints
PASS/FAIL lines and returns whether everything passed.
"""
from __future__ import annotations

import torch

__all__ = ["reference", "kernel_checks", "decode_reference", "decode_checks",
           "decode_graph_check"]


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
