"""Clean exits under torchrun: run ``torchrun -m fxshard demo`` many times, count bad exits.

A gloo process group still referenced at interpreter shutdown can abort a run that already
printed a correct result ("terminate called without an active exception", SIGABRT, about one
run in four before ``ParallelModule.close`` released fxshard's backends). This loops the
README's command and prints every non-zero exit with the tail of its stderr.

    python benchmarks/torchrun_exit.py --runs 50                  # tp=2 demo, 2 processes
    python benchmarks/torchrun_exit.py --runs 20 --mesh dp=2,tp=2 --command explain
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--mesh", default="tp=2")
    ap.add_argument("--command", default="demo", choices=["demo", "explain"])
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    nproc = math.prod(int(p.split("=")[1]) for p in args.mesh.split(","))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    bad, times = [], []
    for i in range(args.runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_port", str(free_port()), "-m", "fxshard", args.command,
               "--mesh", args.mesh, "--layers", str(args.layers)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            bad.append(i)
            print(f"run {i}: exit {proc.returncode}\n{proc.stderr[-1500:]}", flush=True)
    times.sort()
    print(f"torchrun --nproc_per_node={nproc} -m fxshard {args.command} --mesh {args.mesh}: "
          f"{args.runs - len(bad)}/{args.runs} runs exited 0; median {times[len(times) // 2]:.1f}"
          f" s per run")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
