"""The runtime on real torch.distributed process groups (gloo, 4 CPU processes, one launch).

One launch of 4 spawned workers runs every check (starting processes and gloo is the slow part);
each worker writes a JSON report and the tests below read them:

1. ``init_device_mesh`` with a shape that does not match the world size raises ValueError
   before any collective;
2. every collective on both axes of a (dp=2, tp=2) mesh, on every rank, equals a reference
   computed locally by a loop over mesh coordinates (every rank can rebuild every rank's input),
   and so does its background form (``all_gather_start``, ...: four in flight at once);
3. send/recv where every rank sends before it receives (a swap along each axis);
4. rank 3 exits; rank 2's all_reduce with it on ``tp`` fails at once (gloo sees the closed
   connection) with an error naming the op and the axis, while ranks 0 and 1 (the other tp
   group) are unaffected;
5. rank 1 stays alive but skips a collective and waits in a recv for a message rank 0 never
   sends: both fail after the axis group's timeout (``GLOO_TIMEOUT_S``), naming op and axis.
"""
import datetime
import json
import os
import time
import traceback

import pytest
import torch

from tests.launch import init_gloo, launch

LAUNCH_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 5
WORLD = 4


def _rank_input(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _coords(rank: int) -> tuple[int, int]:
    return divmod(rank, 2)  # (dp, tp), row-major


def _group(rank: int, axis: str) -> list[int]:
    """Reference group along ``axis``: ranks equal to ``rank`` in the other coordinate."""
    dp, tp = _coords(rank)
    return [2 * k + tp for k in range(2)] if axis == "dp" else [2 * dp + k for k in range(2)]


def _check_collectives(rank: int) -> list[str]:
    ops = torch.ops.fxshard
    failures = []
    for axis in ("dp", "tp"):
        members = _group(rank, axis)
        k = members.index(rank)
        for dim, other in ((0, 1), (1, 0), (1, 1), (2, 0)):
            shape = [4, 6, 2]
            xs = {q: _rank_input(q * 10 + dim, shape) for q in members}
            x = xs[rank]
            total = xs[members[0]] + xs[members[1]]
            checks = {
                "all_gather": (lambda x: ops.all_gather(x, dim, axis, 2),
                               torch.cat([xs[q] for q in members], dim)),
                "all_reduce": (lambda x: ops.all_reduce(x, axis, 2), total),
                "reduce_scatter": (lambda x: ops.reduce_scatter(x, dim, axis, 2),
                                   torch.chunk(total, 2, dim)[k]),
                "all_to_all": (lambda x: ops.all_to_all(x, dim, other, axis, 2),
                               torch.cat([torch.chunk(xs[q], 2, dim)[k] for q in members], other)),
                "local_shard": (lambda x: ops.local_shard(x, dim, axis, 2),
                                torch.chunk(x, 2, dim)[k]),
                "all_gather_bucket": (
                    lambda x: ops.all_gather_bucket([x, 2 * x], [dim, other], axis, 2)[1],
                    torch.cat([2 * xs[q] for q in members], other)),
                "reduce_scatter_bucket": (
                    lambda x: ops.reduce_scatter_bucket([2 * x, x], [other, dim], axis, 2)[1],
                    torch.chunk(total, 2, dim)[k]),
            }
            for name, (call, want) in checks.items():
                got = call(x)
                if got.shape != want.shape or not torch.allclose(got, want, atol=1e-6):
                    failures.append(f"rank {rank}: {name} on {axis} dim={dim} other={other}: "
                                    f"got {list(got.shape)}, want {list(want.shape)}")
                # the layout the op's fake kernel promises (Inductor asserts it on the
                # compiled programs' outputs): strides of the dims longer than one
                fake = call(x.to("meta"))
                if [st for st, n in zip(got.stride(), got.shape) if n > 1] != \
                        [st for st, n in zip(fake.stride(), fake.shape) if n > 1]:
                    failures.append(f"rank {rank}: {name} on {axis} dim={dim} other={other}: "
                                    f"strides {got.stride()}, its fake kernel's "
                                    f"{fake.stride()}")
            # the background forms (``post_emit.prefetch_fsdp_pass``): all four in flight on
            # the group at once, waited for in reverse order, each equal to its op
            from fxshard.ops import collectives as C
            pending = [
                ("all_gather_start", C.all_gather_start(x, dim, axis, 2), None,
                 checks["all_gather"][1]),
                ("all_gather_bucket_start",
                 C.all_gather_bucket_start([x, 2 * x], [dim, other], axis, 2), 1,
                 checks["all_gather_bucket"][1]),
                ("reduce_scatter_start", C.reduce_scatter_start(x, dim, axis, 2), None,
                 checks["reduce_scatter"][1]),
                ("reduce_scatter_bucket_start",
                 C.reduce_scatter_bucket_start([2 * x, x], [other, dim], axis, 2), 1,
                 checks["reduce_scatter_bucket"][1]),
            ]
            for name, p, part, want in reversed(pending):
                got = C.collective_wait(p)
                got = got if part is None else got[part]
                if got.shape != want.shape or not torch.allclose(got, want, atol=1e-6) or \
                        not got.is_contiguous():
                    failures.append(f"rank {rank}: {name} on {axis} dim={dim} other={other}: "
                                    f"got {list(got.shape)} contiguous "
                                    f"{got.is_contiguous()}, want {list(want.shape)}")
        # a block of one on the gathered dim (an [n, 1] shard of an [n, 2] weight): the
        # peers' blocks interleave, and the result must still be contiguous as its fake
        thin = {q: _rank_input(q + 70, [4, 1]) for q in members}
        got = ops.all_gather(thin[rank], 1, axis, 2)
        if not torch.equal(got, torch.cat([thin[q] for q in members], 1)) or \
                not got.is_contiguous():
            failures.append(f"rank {rank}: all_gather of [4, 1] on {axis} dim=1: strides "
                            f"{got.stride()}, contiguous {got.is_contiguous()}")
    ints = ops.all_reduce(torch.full((3,), rank, dtype=torch.int64), "tp", 2)
    if ints.tolist() != [sum(_group(rank, "tp"))] * 3:
        failures.append(f"rank {rank}: int64 all_reduce gave {ints.tolist()}")
    # the eager programs' all_reduce into a dead input: in place when contiguous, else a copy
    from fxshard.ops.collectives import all_reduce_consuming
    members = _group(rank, "tp")
    xs = {q: _rank_input(q + 50, [4, 6]) for q in members}
    for layout in ("contiguous", "transposed"):
        x = xs[rank].clone() if layout == "contiguous" else xs[rank].t().contiguous().t()
        got = all_reduce_consuming(x, "tp", 2)
        inplace = got.data_ptr() == x.data_ptr()
        if not torch.allclose(got, xs[members[0]] + xs[members[1]], atol=1e-6) or \
                inplace != (layout == "contiguous"):
            failures.append(f"rank {rank}: all_reduce_consuming ({layout}) gave a wrong sum "
                            f"or in place={inplace}")
    return failures


def _check_send_recv(rank: int) -> list[str]:
    from fxshard.runtime import current_backend
    ops = torch.ops.fxshard
    backend = current_backend()
    failures = []
    for axis in ("dp", "tp"):
        me = backend.axis_index(axis)
        peer = 1 - me
        ops.send(torch.full((2, 3), float(rank)), axis, peer)  # both send first
        ops.send(torch.full((5,), rank + 0.5), axis, peer)
        a = ops.recv([2, 3], torch.float32, torch.device("cpu"), axis, peer)
        b = ops.recv([5], torch.float32, torch.device("cpu"), axis, peer)
        other = _group(rank, axis)[peer]
        if not (torch.equal(a, torch.full((2, 3), float(other)))
                and torch.equal(b, torch.full((5,), other + 0.5))):
            failures.append(f"rank {rank}: send/recv on {axis} got {a.flatten()[0]}, "
                            f"{b.flatten()[0]} from rank {other}")
    backend.flush()
    return failures


def _timed_all_reduce(backend) -> tuple[str, float]:
    from fxshard.runtime import use_backend
    start = time.monotonic()
    try:
        with use_backend(backend):
            torch.ops.fxshard.all_reduce(torch.ones(4), "tp", 2)
        outcome = "ok"
    except RuntimeError as exc:
        outcome = f"RuntimeError: {exc}"
    return outcome, time.monotonic() - start


def _worker(rank: int, port: int, out_dir: str) -> None:
    report = {"rank": rank, "errors": []}

    def write() -> None:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)

    try:
        import torch.distributed as dist
        init_gloo(rank, port, WORLD, 60)   # the checks: generous (CI runs two test workers)
        from fxshard.mesh import init_device_mesh
        from fxshard.runtime import use_backend
        from fxshard.runtime.distributed import backend_for

        try:
            init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            report["mismatch"] = "no error"
        except ValueError as exc:
            report["mismatch"] = f"ValueError: {exc}"

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        backend = backend_for(mesh)
        report["geometry"] = [backend.rank, backend.axis_index("dp"), backend.axis_index("tp"),
                              backend.axis_size("tp"), backend.axis_size("pp"),
                              backend_for(mesh) is backend]
        with use_backend(backend):
            report["errors"] += _check_collectives(rank)
            report["errors"] += _check_send_recv(rank)
        report["checks_done"] = True
        dist.barrier()
        # the dead and stuck peers below: the axis groups' short timeout (torch made them with
        # gloo's default, 30 min; fxshard reads the group's timeout at each call)
        for axis in ("dp", "tp"):
            dist.distributed_c10d._set_pg_timeout(
                datetime.timedelta(seconds=GLOO_TIMEOUT_S), mesh.get_group(axis))

        if rank == 3:
            write()
            os._exit(0)  # dies without goodbye: sockets close, no destroy_process_group
        time.sleep(0.5)
        report["after_exit"], report["after_exit_s"] = _timed_all_reduce(backend)
        if rank == 0:  # rank 1 is alive but never joins: gloo's timeout must end the wait
            report["stuck_peer"], report["stuck_peer_s"] = _timed_all_reduce(backend)
        if rank == 1:  # ... and itself waits for a message rank 0 never sends
            start = time.monotonic()
            try:
                with use_backend(backend):
                    torch.ops.fxshard.recv([3], torch.float32, torch.device("cpu"), "tp", 0)
                report["stuck_recv"] = "ok"
            except RuntimeError as exc:
                report["stuck_recv"] = f"RuntimeError: {exc}"
            report["stuck_recv_s"] = time.monotonic() - start
            time.sleep(2)
    except BaseException:
        report["errors"].append(traceback.format_exc())
    write()
    os._exit(0)  # skip process-group teardown, which may wait on the dead rank


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch(_worker, WORLD, str(tmp_path_factory.mktemp("gloo")),
                  timeout_s=LAUNCH_TIMEOUT_S)


def test_world_size_mismatch_raises_before_any_collective(reports):
    for r, rep in reports.items():
        assert rep["mismatch"].startswith("ValueError"), rep
        assert "world size 4" in rep["mismatch"], rep


def test_collectives_and_send_recv_on_gloo(reports):
    for r, rep in reports.items():
        assert rep.get("checks_done"), f"rank {r} did not finish: {rep['errors']}"
        assert rep["errors"] == [], f"rank {r}: {rep['errors']}"
        dp, tp = _coords(r)
        assert rep["geometry"] == [r, dp, tp, 2, 1, True]


def test_dead_peer_fails_collective_naming_op_and_axis(reports):
    assert reports[0]["after_exit"] == "ok" and reports[1]["after_exit"] == "ok"
    text = reports[2]["after_exit"]
    assert text.startswith("RuntimeError"), text
    assert "fxshard.all_reduce" in text and "'tp'" in text, text
    assert reports[2]["after_exit_s"] < GLOO_TIMEOUT_S + 5, reports[2]


def test_stuck_peer_times_out_naming_op_and_axis(reports):
    text = reports[0]["stuck_peer"]
    assert text.startswith("RuntimeError"), text
    assert "fxshard.all_reduce" in text and "'tp'" in text, text
    assert GLOO_TIMEOUT_S - 1 < reports[0]["stuck_peer_s"] < GLOO_TIMEOUT_S + 5, reports[0]


def test_unmatched_recv_times_out_naming_op_and_axis(reports):
    text = reports[1]["stuck_recv"]
    assert text.startswith("RuntimeError"), text
    assert "fxshard.recv" in text and "'tp'" in text and "from coordinate 0" in text, text
    assert reports[1]["stuck_recv_s"] < GLOO_TIMEOUT_S + 5, reports[1]
