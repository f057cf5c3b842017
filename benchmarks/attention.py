"""Benchmark fxshard's Triton flash-attention forward against torch SDPA (flash and cuDNN).

Reproduce on a CUDA GPU (DESIGN.md section 4's target, for an H200: at or above SDPA flash):

    python benchmarks/attention.py              # all cases; writes benchmarks/attention.json
    python benchmarks/attention.py --json /tmp/a.json --seq 4096 8192 --head-dim 128
    python benchmarks/attention.py --sweep      # also time other block sizes of our kernel

Cases: bf16, sequence 1k, 2k, 4k, 8k, 16k, head dim 64 and 128, causal and not, self-attention
with as many KV heads as query heads. Every case has the same number of q elements,
``B * H * S * D = 2**25`` (``B = 16384 // S`` sequences of ``H = 2048 // D`` heads), so the work
grows linearly with S. Times are medians of ``triton.testing.do_bench`` (CUDA events, L2
flushed between runs); TFLOP/s counts ``4 * B * H * S * S * D`` flops, half of it when causal.
Each case also reports the largest absolute difference between our output and SDPA's.
Without a CUDA GPU the script prints a line saying so and exits 0.
"""
import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxshard.kernels import attention  # noqa: E402

SEQS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048
SWEEP = ((64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
         (128, 128, 8, 2), (128, 64, 8, 4))


def make_cases(seqs=SEQS, head_dims=HEAD_DIMS):
    """One dict per case: seq, head_dim, causal, batch, heads."""
    return [{"seq": s, "head_dim": d, "causal": c, "batch": max(1, TOKENS // s),
             "heads": HIDDEN // d}
            for d in head_dims for s in seqs for c in (False, True)]


def attention_flops(case) -> float:
    flops = 4.0 * case["batch"] * case["heads"] * case["seq"] ** 2 * case["head_dim"]
    return flops / 2 if case["causal"] else flops


def tflops(case, ms):
    return None if ms is None else attention_flops(case) / (ms * 1e-3) / 1e12


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return {name: getattr(SDPBackend, attr) for name, attr in names.items()
            if hasattr(SDPBackend, attr)}


def measure_case(case, *, sweep=False, device="cuda", dtype=torch.bfloat16):
    """Time our kernel and each SDPA backend on one case; returns a result row (dict)."""
    import triton.testing
    from torch.nn.attention import sdpa_kernel
    from fxshard.kernels import triton_attention

    torch.manual_seed(0)
    shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    causal = case["causal"]

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    row = dict(case)
    with torch.no_grad():
        ours, _ = attention(q, k, v, causal=causal, backend="triton")
        row["ours_ms"] = bench(lambda: attention(q, k, v, causal=causal, backend="triton"))
        reference = None
        for name, backend in _sdpa_backends().items():
            try:
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal)
                    row[f"{name}_ms"] = bench(
                        lambda: torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=causal))
            except RuntimeError as err:
                row[f"{name}_ms"] = None
                row[f"{name}_unavailable"] = str(err).splitlines()[0]
                continue
            row[f"{name}_max_err"] = (ours.float() - out.float()).abs().max().item()
            reference = out if reference is None else reference
        if sweep:
            best = None
            for block_m, block_n, warps, stages in SWEEP:
                def run(bm=block_m, bn=block_n, w=warps, s=stages):
                    return triton_attention.attention_fwd(
                        q, k, v, causal=causal, scale=case["head_dim"] ** -0.5, q_offset=0,
                        kv_offset=0, block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                try:
                    ms = bench(run)
                except Exception as err:  # a config may not fit this GPU; report and go on
                    print(f"  config {(block_m, block_n, warps, stages)} failed: {err}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, [block_m, block_n, warps, stages])
            if best is not None:
                row["sweep_best_ms"], row["sweep_best_config"] = best
    for name in ("ours", *_sdpa_backends()):
        row[f"{name}_tflops"] = tflops(case, row.get(f"{name}_ms"))
    row["max_err"] = (None if reference is None
                      else (ours.float() - reference.float()).abs().max().item())
    return row


def _fmt(value, spec):
    """``format(value, spec)``, or a '-' as wide as the spec's width for a missing value."""
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def format_table(rows) -> str:
    """A fixed-width text table of result rows (missing numbers print as '-')."""
    header = (f"{'seq':>6} {'D':>4} {'causal':>6} {'B':>3} {'H':>3} | {'ours ms':>8} "
              f"{'TF/s':>6} | {'flash ms':>8} {'TF/s':>6} | {'cudnn ms':>8} {'TF/s':>6} | "
              f"{'ours/flash':>10} {'max err':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = (r["flash_ms"] / r["ours_ms"]
                 if r.get("flash_ms") and r.get("ours_ms") else None)
        lines.append(
            f"{r['seq']:>6} {r['head_dim']:>4} {str(r['causal']):>6} {r['batch']:>3} "
            f"{r['heads']:>3} | {_fmt(r.get('ours_ms'), '8.3f')} "
            f"{_fmt(r.get('ours_tflops'), '6.1f')} | {_fmt(r.get('flash_ms'), '8.3f')} "
            f"{_fmt(r.get('flash_tflops'), '6.1f')} | {_fmt(r.get('cudnn_ms'), '8.3f')} "
            f"{_fmt(r.get('cudnn_tflops'), '6.1f')} | {_fmt(ratio, '10.2f')} "
            f"{_fmt(r.get('max_err'), '8.1e')}")
    return "\n".join(lines)


def environment() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "dtype": "bfloat16"}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def write_json(path, rows, info) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": info, "results": rows}, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(Path(__file__).with_name("attention.json")),
                        help="where to write the results (default: benchmarks/attention.json)")
    parser.add_argument("--seq", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--sweep", action="store_true",
                        help="also time our kernel with other block sizes and report the best")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py: no CUDA GPU available (torch.cuda.is_available() is "
              "False); nothing to benchmark.")
        return 0
    rows = []
    for case in make_cases(args.seq, args.head_dim):
        rows.append(measure_case(case, sweep=args.sweep))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    write_json(args.json, rows, environment())
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
