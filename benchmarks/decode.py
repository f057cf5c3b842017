"""Benchmark decode attention: bandwidth of the KV cache read, ours vs torch SDPA.

One decode step: one query per sequence against ``L`` cached keys, GQA 32 query / 8 KV heads,
head dim 128, bf16, batch 1 and 8, ``L`` in 4k, 8k, 16k, 32k (every sequence full). Decode is
bound by memory, so the figure of merit is the bandwidth of the K and V reads,
``2 * B * Hkv * L * D * itemsize`` bytes per call, in GB/s and in % of the H200's 4.8 TB/s.

    python benchmarks/decode.py                 # on a CUDA GPU; writes benchmarks/decode.json
    python benchmarks/decode.py --batch 1 --keys 32768 --sweep   # also other splits / blocks
    python benchmarks/decode.py --device cpu    # the torch path vs SDPA at small sizes

Variants: ``ours`` = ``fxshard.kernels.decode_attention(backend="triton")`` (the split-K
kernel); ``flash`` and ``cudnn`` = ``F.scaled_dot_product_attention(..., enable_gqa=True)``
pinned to that SDPA backend (a row says ``-`` where a backend refuses the shape). On CUDA each
variant is captured in a CUDA graph of ``--inner`` calls (at least one per copy), which rotate
over enough copies of the cache to exceed 4x the L2 cache (so every call reads HBM), and the
graph is replayed ``--reps`` times, each timed with CUDA events; a row reports the median per
call. ``ours eager us`` times
the same calls without a graph (Python launch overhead included). On CPU: the torch path
(``backend="torch"``) vs SDPA, wall-clock medians, float32, small sizes, so the script runs
without a GPU. Each row also gives the largest difference between ours and SDPA's output.
"""
import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxshard.kernels import decode_attention  # noqa: E402

H200_BANDWIDTH = 4.8e12     # bytes/s, HBM3e of an H200 (the issue's reference)
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
GPU_KEYS = (4096, 8192, 16384, 32768)
CPU_KEYS = (512, 2048)
BATCHES = (1, 8)
SWEEP = ((None, 64, 4, 4), (None, 128, 4, 3), (None, 64, 8, 4), (16, 64, 4, 4),
         (64, 64, 4, 4), (128, 64, 4, 4), (None, 32, 4, 6))


def kv_bytes(case) -> int:
    """Bytes of K and V one call reads: every sequence is full."""
    return 2 * case["batch"] * HEADS_KV * case["keys"] * HEAD_DIM * case["itemsize"]


def gbps(case, us):
    return None if us is None else kv_bytes(case) / (us * 1e-6) / 1e9


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return {name: getattr(SDPBackend, attr) for name, attr in names.items()
            if hasattr(SDPBackend, attr)}


def _time_cuda(calls, reps):
    """Median microseconds per call: ``calls`` captured in one CUDA graph, replayed ``reps``
    times; and the same calls launched eagerly."""
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    samples = {"graph": [], "eager": []}
    for _ in range(reps):
        for mode in samples:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if mode == "graph":
                graph.replay()
            else:
                for call in calls:
                    call()
            end.record()
            end.synchronize()
            samples[mode].append(start.elapsed_time(end) * 1e3 / len(calls))
    return {mode: statistics.median(values) for mode, values in samples.items()}


def _time_cpu(call, reps):
    call()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure_case(case, *, device, reps, inner, sweep=False):
    """Time ours and each SDPA backend on one case; returns a result row (dict)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, keys = case["batch"], case["keys"]
    copies = 1
    if device == "cuda":
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        copies = max(2, math.ceil(4 * l2_bytes / kv_bytes(case)))
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, device=device, dtype=dtype)
    caches = [(torch.randn(batch, HEADS_KV, keys, HEAD_DIM, device=device, dtype=dtype),
               torch.randn(batch, HEADS_KV, keys, HEAD_DIM, device=device, dtype=dtype))
              for _ in range(copies)]
    lengths = torch.full((batch,), keys, device=device, dtype=torch.int64)
    inner = max(inner, copies)      # every copy once per graph, or the L2 holds the rest
    row = dict(case, device=device, dtype=str(dtype).removeprefix("torch."), copies=copies)
    backend = "triton" if device == "cuda" else "torch"

    def ours(k, v, **options):
        if options:
            from fxshard.kernels.triton_decode import decode_fwd
            return decode_fwd(q, k, v, lengths, scale=HEAD_DIM ** -0.5, causal=True,
                              **options)
        return decode_attention(q, k, v, lengths, causal=True, backend=backend)

    with torch.no_grad():
        want = ours(*caches[0])[0]
        if device == "cuda":
            from torch.nn.attention import sdpa_kernel
            calls = [lambda i=i: ours(*caches[i % copies]) for i in range(inner)]
            timed = _time_cuda(calls, reps)
            row["ours_us"], row["ours_eager_us"] = timed["graph"], timed["eager"]
            for name, sdpa_backend in _sdpa_backends().items():
                try:
                    with sdpa_kernel(sdpa_backend):
                        got = _sdpa(q, *caches[0])
                        calls = [lambda i=i: _sdpa(q, *caches[i % copies]) for i in range(inner)]
                        row[f"{name}_us"] = _time_cuda(calls, reps)["graph"]
                except RuntimeError as err:
                    row[f"{name}_us"] = None
                    row[f"{name}_unavailable"] = str(err).splitlines()[0][:200]
                    continue
                row[f"{name}_max_err"] = (want.float() - got.float()).abs().max().item()
            if sweep:
                row["sweep"] = []
                for splits, block_n, warps, stages in SWEEP:
                    options = {"n_splits": splits, "block_n": block_n, "num_warps": warps,
                               "num_stages": stages}
                    try:
                        calls = [lambda i=i: ours(*caches[i % copies], **options)
                                 for i in range(inner)]
                        us = _time_cuda(calls, reps)["graph"]
                    except Exception as err:  # a config may not fit this GPU; report, go on
                        print(f"  config {options} failed: {str(err)[:200]}")
                        continue
                    row["sweep"].append(dict(options, us=us, gbps=gbps(case, us)))
        else:
            row["ours_us"] = _time_cpu(lambda: ours(*caches[0]), reps)
            row["sdpa_us"] = _time_cpu(lambda: _sdpa(q, *caches[0]), reps)
            row["sdpa_max_err"] = (want - _sdpa(q, *caches[0])).abs().max().item()
    for name in ("ours", "flash", "cudnn", "sdpa"):
        if f"{name}_us" in row:
            row[f"{name}_gbps"] = gbps(case, row[f"{name}_us"])
    row["ours_pct_h200"] = (None if row.get("ours_gbps") is None or device != "cuda"
                            else 100 * row["ours_gbps"] * 1e9 / H200_BANDWIDTH)
    return row


def _fmt(value, spec):
    """``format(value, spec)``, or a '-' as wide as the spec's width for a missing value."""
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def format_table(rows) -> str:
    """A fixed-width text table of result rows (missing numbers print as '-')."""
    others = ("flash", "cudnn") if any("flash_us" in r or "cudnn_us" in r for r in rows) \
        else ("sdpa",)
    header = (f"{'B':>2} {'keys':>6} {'MiB K+V':>7} | {'ours us':>8} {'GB/s':>7} "
              f"{'%4.8TB/s':>8} {'eager us':>8} |"
              + "".join(f" {name + ' us':>9} {'GB/s':>7} |" for name in others)
              + f" {'max err':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        err = max((r[f"{name}_max_err"] for name in others if r.get(f"{name}_max_err")
                   is not None), default=None)
        lines.append(
            f"{r['batch']:>2} {r['keys']:>6} {kv_bytes(r) / 2**20:>7.1f} | "
            f"{_fmt(r.get('ours_us'), '8.1f')} {_fmt(r.get('ours_gbps'), '7.1f')} "
            f"{_fmt(r.get('ours_pct_h200'), '8.1f')} {_fmt(r.get('ours_eager_us'), '8.1f')} |"
            + "".join(f" {_fmt(r.get(f'{name}_us'), '9.1f')} "
                      f"{_fmt(r.get(f'{name}_gbps'), '7.1f')} |" for name in others)
            + f" {_fmt(err, '8.1e')}")
    return "\n".join(lines)


def environment(device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
            "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
            platform.machine(), "cpu_threads": torch.get_num_threads()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(Path(__file__).with_name("decode.json")),
                        help="where to write the results (default: benchmarks/decode.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--keys", type=int, nargs="+", default=None,
                        help=f"cached keys (default {GPU_KEYS} on cuda, {CPU_KEYS} on cpu)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions (default 50 on cuda, 10 on cpu)")
    parser.add_argument("--inner", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--sweep", action="store_true",
                        help="also time our kernel with other splits / block sizes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/decode.py: no CUDA GPU available (torch.cuda.is_available() is "
              "False); nothing to benchmark (--device cpu runs the torch path).")
        return 0
    keys = args.keys or list(GPU_KEYS if args.device == "cuda" else CPU_KEYS)
    reps = args.reps or (50 if args.device == "cuda" else 10)
    itemsize = 2 if args.device == "cuda" else 4
    rows = []
    for batch in args.batch:
        for n_keys in keys:
            case = {"batch": batch, "keys": n_keys, "itemsize": itemsize}
            rows.append(measure_case(case, device=args.device, reps=reps, inner=args.inner,
                                     sweep=args.sweep))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
            for entry in rows[-1].get("sweep", []):
                print(f"    sweep {entry}")
    print()
    print(format_table(rows))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(args.device), "results": rows},
                               indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
