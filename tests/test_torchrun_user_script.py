"""A user's script under ``torchrun`` gets a real mesh without calling ``init_process_group``,
and ranks that disagree on a call fail with a ValueError on every rank (gloo, 2 processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this build")
    out = tmp_path_factory.mktemp("torchrun_user")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()), os.path.join(ROOT, "tests",
                                                          "torchrun_user_script.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("RANK", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its workers: their own session
        stdout, stderr = proc.communicate()
        pytest.fail(f"the script was still running after {TIMEOUT_S} s (ranks waiting on each "
                    f"other?); stdout: {stdout[-2000:]}\nstderr: {stderr[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


def test_script_without_init_process_group_gets_a_real_mesh(reports):
    for rank, rep in reports.items():
        assert rep["initialized_before"] is False
        assert rep["mesh"] == "DeviceMesh", rep
        assert rep["backend"] == "gloo", rep
        assert rep["built"] == [rank], rep  # each process builds only its own rank
        assert rep["max_err"] < 1e-4, rep


def test_ranks_with_different_batches_fail_on_every_rank(reports):
    for rank, rep in reports.items():
        msg = rep["batch"]
        assert msg is not None, f"rank {rank} raised no ValueError"
        assert "the ranks disagree" in msg and f"this is rank {rank}" in msg, msg
        # both sides shown, and only what differs
        assert "rank 0: inputs=(tensor[4, 6] torch.int64 on cpu)" in msg, msg
        assert "rank 1: inputs=(tensor[2, 6] torch.int64 on cpu)" in msg, msg


def test_ranks_with_different_max_new_tokens_fail_on_every_rank(reports):
    for rank, rep in reports.items():
        msg = rep["generate"]
        assert msg is not None, f"rank {rank} raised no ValueError"
        assert "ParallelModule.generate: the ranks disagree" in msg, msg
        assert "rank 0: max_new_tokens=3; rank 1: max_new_tokens=4." in msg, msg


def test_agreeing_calls_work_after_a_disagreement(reports):
    assert reports[0]["after"] == reports[1]["after"]
    assert torch.tensor(reports[0]["after"]).shape == (4, 9)


def test_world_size_that_disagrees_with_the_mesh_is_an_error(monkeypatch):
    import torch.distributed as dist

    import fxshard
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match=r"mesh_shape \(2,\) holds 2 ranks but the launcher "
                                         r"started WORLD_SIZE=3"):
        fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    assert not dist.is_initialized()  # checked before any group is started
