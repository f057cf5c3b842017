"""The whole ``fxshard.parallelize`` path on real torch.distributed process groups (gloo, CPU).

Starting processes and gloo is the slow part, so there are two launches of spawned workers,
each running many cases and writing a JSON report that the tests below read:

* 2 processes: tp=2 on ``fxshard.models.llama`` and HuggingFace ``LlamaForCausalLM``; a
  checkpoint written by rank 0 in two safetensors shards and loaded into a model built on
  ``meta`` (each rank reads only its slices and builds only its own rank module); then rank 1
  raises inside ``pm(x)`` before the first collective (a token outside the vocabulary) and
  stays alive, and rank 0 must fail after the axis group's timeout with an error naming the
  fxshard op and the mesh axis instead of hanging.
* 4 processes: dp2 x tp2 (with and without sequence parallelism), tp2 x pp2 (microbatches 1
  and 2) and dp2 x pp2, each on one of the two models, alternating.

Both launches also run ``pm.generate`` (tp=2; tp=2 x pp=2, microbatches=2) against HF ``generate``
(greedy, and seeded sampling equal on every rank): ``tests/generate_checks.py``.

Every rank passes the same global input and must get the full output back, equal to the
unmodified single-device model (fp32, rtol = atol = 1e-4). A third test runs the README's
``torchrun -m fxshard demo`` on 2 processes.
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import re
import subprocess
import sys
import time
import traceback

import pytest
import torch

from tests.generate_checks import check_greedy, check_sampling, generate_case
from tests.launch import free_port, init_gloo, launch

LAUNCH_TIMEOUT_S = 300
PG_TIMEOUT_S = 120       # default group: generous (ranks trace at different speeds; 2 workers)
FAIL_TIMEOUT_S = 5       # the tp group of the failing-rank case (the last one it runs)
TOL = dict(rtol=1e-4, atol=1e-4)
RSS_SLACK = 0.25         # peak RSS loading + forward add: own slices + this x the full model
BATCH, SEQ, VOCAB = 4, 8, 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, mesh shape, axis names, parallelize kwargs, models): each mesh on one model, the two
# models alternating (both run every mesh on the simulated mesh; here the real groups matter)
FOUR_PROC_CASES = [
    ("dp2_tp2", (2, 2), ("dp", "tp"), {}, ("hf",)),
    ("dp2_tp2_sp", (2, 2), ("dp", "tp"), {"sequence_parallel": True}, ("ours",)),
    ("tp2_pp2", (2, 2), ("tp", "pp"), {}, ("hf",)),
    ("tp2_pp2_mb2", (2, 2), ("tp", "pp"), {"microbatches": 2}, ("ours",)),
    ("pp2_dp2", (2, 2), ("pp", "dp"), {}, ("hf",)),
]
MODELS = ("ours", "hf")


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _model(kind: str, *, layers: int = 2):
    from tests.models import hf_llama, our_llama
    if kind == "hf":
        return hf_llama(layers=layers, vocab=VOCAB)
    return our_llama(num_hidden_layers=layers, vocab_size=VOCAB)


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _compare(got, want) -> str:
    try:
        torch.testing.assert_close(_logits(got), _logits(want), **TOL)
        return "ok"
    except AssertionError as exc:
        return f"mismatch: {exc}"


def _run_case(model_kind: str, shape, names, kwargs) -> tuple[str, str]:
    """(``"ok"`` or what went wrong, the type of ``pm``'s output) on this rank."""
    import torch.distributed as dist

    import fxshard
    model = _model(model_kind)
    ids = _ids()
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = fxshard.parallelize(model, mesh, **kwargs)
    with torch.no_grad():
        got = pm(ids)
        want = model(ids)
    built = sorted(pm.programs.last.modules)
    if built != [dist.get_rank()]:  # a process builds its own rank's module only
        return f"built the modules of ranks {built}", type(got).__name__
    return _compare(got, want), type(got).__name__


# --- a HuggingFace checkpoint directory of a few hundred MB, built empty ----------------------

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0). ``ru_maxrss`` would not do: a spawned
    worker starts with the peak of the pytest process that forked it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not allowed here: VmHWM keeps an older peak, which only overestimates
        pass


def _hf_checkpoint_case(rank: int, ckpt_dir: str, shape, names) -> dict:
    """The user's path for a big model, run first in the process so the peak RSS it adds is
    measured from a clean high-water mark: build from the config with no weights, parallelize,
    ``load_safetensors`` (each rank reads only its slices), run; then the single-device
    reference from ``from_pretrained``."""
    import transformers

    import fxshard
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(5))
    with fxshard.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(ckpt_dir))
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = fxshard.parallelize(model, mesh)
    _reset_peak_rss()
    before = _status_bytes("VmRSS")
    fxshard.load_safetensors(pm, ckpt_dir)
    with torch.no_grad():
        got = pm(ids)
    added = _status_bytes("VmHWM") - before  # the peak that loading and the forward added
    own = sum(t.numel() * t.element_size() for t in pm.rank_module(rank).state_dict().values())
    from fxshard.runtime.distributed import _BACKENDS
    had_backend = id(mesh) in _BACKENDS
    pm.close()  # drops this process's backend and its process-group references
    released = had_backend and id(mesh) not in _BACKENDS
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir).eval()
    with torch.no_grad():
        want = ref(ids)
    return {"compare": _compare(got, want), "added_peak_rss": added, "own_bytes": own,
            "released": released,
            "full_bytes": sum(p.numel() * p.element_size() for p in ref.parameters())}


# --- the 2-process launch -----------------------------------------------------------------

def _safetensors_case(rank: int, ckpt_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import save_file

    import fxshard
    from fxshard.checkpoint import SafetensorsSource

    ref = _model("ours")
    if rank == 0:
        sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
        keys = sorted(sd)
        half = len(keys) // 2
        save_file({k: sd[k] for k in keys[:half]},
                  os.path.join(ckpt_dir, "model-00001-of-00002.safetensors"))
        save_file({k: sd[k] for k in keys[half:]},
                  os.path.join(ckpt_dir, "model-00002-of-00002.safetensors"))
    dist.barrier()
    with torch.device("meta"):
        meta = _model("ours")
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(meta, mesh)
    fxshard.load_safetensors(pm, ckpt_dir)
    ids = _ids()
    with torch.no_grad():
        got = pm(ids)
        want = ref(ids)
    sources = {id(v): v for v in pm.weights.values.values() if isinstance(v, SafetensorsSource)}
    own = pm.rank_module(rank).state_dict()
    return {
        "compare": _compare(got, want),
        "read": sum(sum(s.reads) for s in sources.values()),
        "own_numel": sum(t.numel() for t in own.values()),
        "total_params": sum(p.numel() for p in ref.parameters()),
        "modules_built": sorted(pm.programs.last.modules),
        "all_values_lazy": all(isinstance(v, SafetensorsSource) for k, v in pm.weights.values.items()
                               if k in pm.weights.expected),
    }


def _failing_rank_case(rank: int, out_dir: str) -> dict:
    """Rank 1 raises inside pm(x) before the first collective and stays alive (as a rank that
    hangs in its error handling would): rank 0's first collective must time out."""
    import torch.distributed as dist

    import fxshard
    model = _model("ours", layers=1)
    ids = _ids()
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(model, mesh, example_inputs=(ids,))
    with torch.no_grad():
        pm(ids)  # every rank module built, the backend made, collectives work
    dist.barrier()
    # set after the backend exists: it must read the group's timeout when it waits
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=FAIL_TIMEOUT_S),
                                         mesh.get_group("tp"))
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = VOCAB + 5  # the embedding lookup raises before its all_gather
    start = time.monotonic()
    try:
        with torch.no_grad():
            pm(bad)
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - the report carries the type
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    if rank == 1:  # alive, but never joins rank 0's collective: wait for rank 0's report
        deadline = time.monotonic() + FAIL_TIMEOUT_S + 15
        while time.monotonic() < deadline and \
                not os.path.exists(os.path.join(out_dir, "rank0.json")):
            time.sleep(0.1)
    return {"outcome": outcome, "seconds": seconds}


def _two_proc_cases(rank: int, report: dict, out_dir: str) -> None:
    report["hf_checkpoint"] = _hf_checkpoint_case(rank, os.path.join(out_dir, "hf"), (2,),
                                                  ("tp",))
    for kind in MODELS:
        start = time.monotonic()
        report["cases"][f"tp2/{kind}"], report["types"][kind] = \
            _run_case(kind, (2,), ("tp",), {})
        report["seconds"][f"tp2/{kind}"] = round(time.monotonic() - start, 2)
    report["safetensors"] = _safetensors_case(rank, os.path.join(out_dir, "ckpt"))
    report["generate"] = generate_case(rank, (2,), ("tp",))
    report["cases_done"] = True
    import torch.distributed as dist
    dist.barrier()
    report["failing"] = _failing_rank_case(rank, out_dir)


def _four_proc_cases(rank: int, report: dict, out_dir: str) -> None:
    report["hf_checkpoint"] = _hf_checkpoint_case(rank, os.path.join(out_dir, "hf"), (2, 2),
                                                  ("tp", "pp"))
    for name, shape, names, kwargs, models in FOUR_PROC_CASES:
        for kind in models:
            start = time.monotonic()
            report["cases"][f"{name}/{kind}"], _ = _run_case(kind, shape, names, kwargs)
            report["seconds"][f"{name}/{kind}"] = round(time.monotonic() - start, 2)
    report["generate"] = generate_case(rank, (2, 2), ("tp", "pp"))
    report["cases_done"] = True


def _worker(rank: int, port: int, out_dir: str, world: int, job: str) -> None:
    report = {"rank": rank, "cases": {}, "types": {}, "errors": [], "seconds": {}}
    start = time.monotonic()

    def write() -> None:  # atomically: rank 1 of the failing case waits for rank 0's file
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)

    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(LAUNCH_TIMEOUT_S - 15, file=log)  # where a hang sits
    try:
        import warnings
        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        import torch.distributed as dist  # noqa: F401 - timed with the imports
        import fxshard  # noqa: F401 - imports first, to time them apart
        import transformers  # noqa: F401
        report["seconds"]["imports"] = round(time.monotonic() - start, 2)
        init_gloo(rank, port, world, PG_TIMEOUT_S)
        cases = _two_proc_cases if job == "two" else _four_proc_cases
        cases(rank, report, out_dir)
    except BaseException:  # noqa: BLE001 - reported to the test process
        report["errors"].append(traceback.format_exc())
    write()
    os._exit(0)  # skip process-group teardown, which may wait on a dead rank


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> str:
    """A random HF Llama of ~450 MB (fp32), saved as HF saves big models: shards + index."""
    import transformers
    path = str(tmp_path_factory.mktemp("hf_big"))
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024,
                                      intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    with torch.no_grad():
        transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100MB")
    return path


def _launch(tmp_path_factory, hf_checkpoint: str, world: int, job: str) -> dict:
    out_dir = str(tmp_path_factory.mktemp(f"e2e_{job}"))
    os.makedirs(os.path.join(out_dir, "ckpt"))
    os.symlink(hf_checkpoint, os.path.join(out_dir, "hf"))
    return launch(_worker, world, out_dir, world, job, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def two(tmp_path_factory, hf_checkpoint):
    return _launch(tmp_path_factory, hf_checkpoint, 2, "two")


@pytest.fixture(scope="module")
def four(tmp_path_factory, hf_checkpoint):
    return _launch(tmp_path_factory, hf_checkpoint, 4, "four")


def _tail(errors: list[str]) -> str:
    return errors[-1][-1500:] if errors else "(no error recorded)"


def _check_case(reports: dict, key: str) -> None:
    for r, rep in reports.items():
        assert key in rep["cases"], f"rank {r} stopped before {key}: {_tail(rep['errors'])}"
        assert rep["cases"][key] == "ok", f"rank {r} {key}: {rep['cases'][key]}"


def test_tp2_both_models_every_rank_gets_full_output(two):
    for kind in MODELS:
        _check_case(two, f"tp2/{kind}")
    for rep in two.values():  # HF's output structure survives, not just a tensor
        assert rep["types"] == {"ours": "Tensor", "hf": "CausalLMOutputWithPast"}, rep["types"]


def test_safetensors_meta_model_each_rank_reads_only_its_slices(two):
    for r, rep in two.items():
        assert "safetensors" in rep, f"rank {r} stopped before it: {_tail(rep['errors'])}"
        st = rep["safetensors"]
        assert st["compare"] == "ok", f"rank {r}: {st['compare']}"
        assert st["all_values_lazy"], st
        assert st["modules_built"] == [r], st  # only this process's own rank module
        assert st["read"] == st["own_numel"], st
        assert st["read"] < 0.6 * st["total_params"], st


@pytest.mark.parametrize("job,share", [("two", 1 / 2), ("four", 1 / 4)])
def test_hf_checkpoint_built_empty_loads_only_each_ranks_share(request, job, share):
    """tp=2 on 2 processes, tp=2 x pp=2 on 4: the output equals ``from_pretrained`` on one
    device, each rank holds its share of the weights (plus the replicated norms), and loading
    plus the forward raise a process's peak RSS by less than the full model (by its own slices
    plus a quarter of the model: one weight's mapped pages while it is sliced, activations):
    the weights are never materialised whole in any process. Measured here: tp=2 adds
    266-275 MB for 225 MB of slices, tp2 x pp2 122-195 MB for 113 MB, of a 451 MB model."""
    for r, rep in request.getfixturevalue(job).items():
        assert "hf_checkpoint" in rep, f"rank {r} stopped before it: {_tail(rep['errors'])}"
        hf = rep["hf_checkpoint"]
        assert hf["compare"] == "ok", f"rank {r}: {hf['compare']}"
        assert hf["released"], hf  # pm.close() released the backend
        assert hf["full_bytes"] > 400e6, hf
        assert hf["own_bytes"] < (share + 0.02) * hf["full_bytes"], (r, hf)
        assert hf["added_peak_rss"] < hf["own_bytes"] + RSS_SLACK * hf["full_bytes"], (r, hf)
        assert hf["added_peak_rss"] < hf["full_bytes"], (r, hf)


def test_failing_rank_makes_peer_fail_fast_naming_op_and_axis(two):
    for r, rep in two.items():
        assert "failing" in rep, f"rank {r} stopped before it: {_tail(rep['errors'])}"
    failed = two[1]["failing"]["outcome"]
    assert failed.startswith("IndexError"), failed  # rank 1's own error, before any collective
    peer = two[0]["failing"]
    text = peer["outcome"]
    assert text.startswith("RuntimeError"), text
    assert re.search(r"torch\.ops\.fxshard\.\w+ on mesh axis 'tp'", text), text
    # the group's timeout when it failed (set after the backend was made)
    assert f"({datetime.timedelta(seconds=FAIL_TIMEOUT_S)})" in text, text
    assert FAIL_TIMEOUT_S - 1 < peer["seconds"] < FAIL_TIMEOUT_S + 10, peer


@pytest.mark.parametrize("name,models", [(c[0], c[4]) for c in FOUR_PROC_CASES])
def test_four_ranks(four, name, models):
    for kind in models:
        _check_case(four, f"{name}/{kind}")


@pytest.mark.parametrize("job", ["two", "four"])
def test_generate_greedy_equals_hf_generate_on_every_rank(request, job):
    reports = request.getfixturevalue(job)
    for r, rep in reports.items():
        assert "generate" in rep, f"rank {r} stopped before it: {_tail(rep['errors'])}"
    check_greedy(reports, job)


@pytest.mark.parametrize("job", ["two", "four"])
def test_generate_sampling_equal_on_every_rank_and_to_hf(request, job):
    reports = request.getfixturevalue(job)
    for r, rep in reports.items():
        assert "generate" in rep, f"rank {r} stopped before it: {_tail(rep['errors'])}"
    check_sampling(reports, job)


@pytest.mark.parametrize("job", ["two", "four"])
def test_launch_finished_without_errors(request, job):
    for r, rep in request.getfixturevalue(job).items():
        assert rep["errors"] == [], f"rank {r}: {rep['errors']}"
        assert rep.get("cases_done"), f"rank {r} did not finish: {rep}"


def test_torchrun_demo_tp2():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()), "-m", "fxshard", "demo", "--mesh", "tp=2",
           "--layers", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its workers: their own session
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun demo still running after {LAUNCH_TIMEOUT_S} s; stdout: "
                    f"{stdout[-2000:]}\nstderr: {stderr[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr}"
    m = re.search(r"max \|parallel - single device\| = (\S+) on mesh \(tp=2\)", stdout)
    assert m, stdout
    assert float(m.group(1)) < 1e-4, m.group(0)
    assert "ran on: torch.distributed (gloo), 2 processes, mesh (tp=2)" in stdout, stdout
