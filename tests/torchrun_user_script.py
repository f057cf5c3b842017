"""A user's own script run by ``tests/test_torchrun_user_script.py`` under ``torchrun``: it
never calls ``init_process_group`` (``fxshard.init_device_mesh`` must), then makes calls on
which the two ranks disagree, each of which must be a ValueError on both ranks.

Usage: torchrun --nproc_per_node=2 tests/torchrun_user_script.py OUT_DIR
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import fxshard
from fxshard.models.llama import LlamaConfig, LlamaForCausalLM


def error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    report = {"initialized_before": dist.is_initialized()}
    torch.set_grad_enabled(False)   # inference: pm(x) with grad enabled trains
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    report["mesh"] = type(mesh).__name__
    report["backend"] = dist.get_backend() if dist.is_initialized() else None
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=1, vocab_size=64)).eval()
    pm = fxshard.parallelize(model, mesh)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(3))
    # the ranks disagree (each on a call new to it): a batch of 4 against 2, then
    # max_new_tokens=3 against 4
    report["batch"] = error_of(lambda: pm(ids[:4 - 2 * rank]))
    report["generate"] = error_of(lambda: pm.generate(ids, max_new_tokens=3 + rank))
    # agreeing calls work afterwards
    with torch.no_grad():
        report["max_err"] = (pm(ids) - model(ids)).abs().max().item()
    report["built"] = sorted(pm.programs.last.modules)
    report["after"] = pm.generate(ids, max_new_tokens=3).tolist()
    pm.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
