"""Atomic checkpoints on real processes (gloo, 2 ranks): a rank whose write fails (ENOSPC on
the second safetensors shard, which rank 1 writes, the blocks of a trained tp2 module sent to
it; rank 1's ``.distcp``) makes every rank raise an ordinary exception naming the file, the
previous checkpoint is left as it was, and the process group still works (the next save
succeeds). A collective call that not every rank makes (``save_safetensors`` on rank 0 only,
or a different call on each rank) raises fxshard's message on every rank that made one,
instead of a gloo abort or a hang."""
import os
import time

import torch

from tests.launch import gloo_job, mesh
from tests.test_checkpoint_save_distributed import _data, _model, _step

WORLD = 2


def _listing(d) -> dict:
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def _raised(report, key, fn):
    try:
        fn()
        report[key] = None
    except BaseException as e:   # noqa: BLE001 - what each rank raised is the test
        report[key] = {"type": type(e).__name__, "exception": isinstance(e, Exception),
                       "errno": getattr(e, "errno", None), "text": str(e)}


def _failing_body(rank: int, report: dict, tmp: str) -> None:
    import builtins
    import io
    import torch.distributed as dist
    import fxshard
    from fxshard.training import parallelize_for_training
    from tests.test_checkpoint_atomic import _fail_on
    ids, labels = _data()
    tm = parallelize_for_training(_model(), mesh(tp=WORLD), example_inputs=(ids,))
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    st, dc = os.path.join(tmp, "st"), os.path.join(tmp, "dcp")
    fxshard.save_safetensors(tm, st, max_shard_size="20KB")
    fxshard.save_training_state(tm, opt, dc)
    dist.barrier()
    before = {"st": _listing(st), "dcp": _listing(dc)}
    _step(tm.parameters(), lambda: tm(ids), labels)   # new weights: a save would differ

    class Patch:      # pytest's monkeypatch, by hand: rank 1's writes fail
        def __init__(self):
            self.undo = []

        def setattr(self, obj, name, value):
            self.undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    patch = Patch()
    if rank == 1:
        _fail_on(patch, builtins, "model-00002-of-")
        _fail_on(patch, io, ".distcp")
    _raised(report, "st", lambda: fxshard.save_safetensors(tm, st, max_shard_size="20KB"))
    _raised(report, "dcp", lambda: fxshard.save_training_state(tm, opt, dc))
    for obj, name, value in reversed(patch.undo):
        setattr(obj, name, value)
    dist.barrier()
    report["siblings"] = sorted(n for n in os.listdir(tmp) if "fxshard-" in n)
    if rank == 0:
        report["after"] = {k: _listing(d) == before[k] for k, d in (("st", st), ("dcp", dc))}
    dist.barrier()
    fxshard.save_safetensors(tm, st, max_shard_size="20KB")   # the group still works
    report["saved"] = {k: v.tolist() for k, v in tm.state_dict().items()
                       if k == "model.norm.weight"}


def test_gloo_a_rank_failing_midway_makes_every_rank_raise_old_checkpoint_kept(tmp_path):
    from safetensors.torch import load_file
    reports = gloo_job(_failing_body, WORLD, str(tmp_path), str(tmp_path),
                       timeout_s=240, grad=True, pg_timeout_s=30)
    for rank, r in reports.items():
        for key, file in (("st", "model-00002-of-"), ("dcp", "__1_0.distcp")):
            err = r[key]
            assert err is not None and err["exception"], (rank, key, r)
            assert file in err["text"] and "No space left" in err["text"], (rank, key, err)
            assert (err["errno"] == 28) if rank == 1 else ("rank 1" in err["text"]), err
        assert r["siblings"] == [], r
    assert reports[0]["after"] == {"st": True, "dcp": True}, reports[0]
    got = {k: v for f in os.listdir(tmp_path / "st") if f.endswith(".safetensors")
           for k, v in load_file(str(tmp_path / "st" / f)).items()}
    torch.testing.assert_close(got["model.norm.weight"].tolist(),
                               reports[0]["saved"]["model.norm.weight"])


# the agreement's timeout in this test: long enough for two busy ranks to reach a call made
# right after a barrier, short enough that the rank left alone reports within seconds
TIMEOUT_S = 5


def _mismatch_body(rank: int, report: dict, tmp: str) -> None:
    import torch.distributed as dist
    import fxshard
    os.environ["FXSHARD_CALL_TIMEOUT_S"] = str(TIMEOUT_S)
    ids, _ = _data()
    with torch.no_grad():
        pm = fxshard.parallelize(_model(), mesh(tp=WORLD), example_inputs=(ids,))
    dist.barrier()     # tracing took the ranks unequal times: start the calls together
    start = time.monotonic()
    if rank == 0:      # rank 1 makes another collective call at that point
        _raised(report, "other", lambda: fxshard.save_safetensors(pm, os.path.join(tmp, "a")))
    else:
        _raised(report, "other", lambda: _together_call(pm))
    report["other_s"] = time.monotonic() - start
    dist.barrier()
    start = time.monotonic()
    if rank == 0:      # on rank 0 only; rank 1 comes after rank 0 gave up
        _raised(report, "alone", lambda: fxshard.save_safetensors(pm, os.path.join(tmp, "b")))
    else:
        time.sleep(2 * TIMEOUT_S)
        _raised(report, "alone", lambda: fxshard.save_safetensors(pm, os.path.join(tmp, "b")))
    report["alone_s"] = time.monotonic() - start
    report["b_exists"] = os.path.exists(os.path.join(tmp, "b"))
    # once trained, pm.state_dict() gathers the shards: on rank 0 only it hung (SIGABRT in gloo)
    ids, labels = _data()
    trained = fxshard.parallelize(_model().requires_grad_(True), mesh(tp=WORLD))
    import torch.nn.functional as F
    with torch.enable_grad():
        F.cross_entropy(trained(ids).flatten(0, 1), labels.flatten()).backward()
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        _raised(report, "state_dict", trained.state_dict)
    else:
        time.sleep(2 * TIMEOUT_S)
        _raised(report, "state_dict", trained.state_dict)
    report["state_dict_s"] = time.monotonic() - start


def _together_call(pm):
    from fxshard.runtime.agreement import together
    together(pm.mesh, "ParallelModule.state_dict", "state_dict()")


def test_gloo_a_collective_call_not_every_rank_makes_raises_on_every_rank(tmp_path):
    reports = gloo_job(_mismatch_body, WORLD, str(tmp_path), str(tmp_path), timeout_s=150,
                       pg_timeout_s=30)
    for rank, r in reports.items():
        err = r["other"]
        assert err is not None and err["type"] == "ValueError", (rank, r)
        assert "save_safetensors" in err["text"] and "state_dict()" in err["text"], err
        assert r["other_s"] < 3 * TIMEOUT_S, r
        err = r["alone"]
        assert err is not None and err["type"] == "RuntimeError", (rank, r)
        assert "every rank" in err["text"] and "FXSHARD_CALL_TIMEOUT_S" in err["text"], err
        assert ("did not make it" in err["text"]) is (rank == 0), err
        assert r["b_exists"] is False, r
    assert reports[0]["alone_s"] < 3 * TIMEOUT_S, reports[0]
    for rank, r in reports.items():
        err = r["state_dict"]
        assert err is not None and err["type"] == "RuntimeError", (rank, r)
        assert "state_dict() is a collective call" in err["text"], err
    assert reports[0]["state_dict_s"] < 3 * TIMEOUT_S, reports[0]
