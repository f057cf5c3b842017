"""The runtime on the simulated mesh: collectives, send/recv, errors, export and DCE.

Every collective result on every rank is compared with a reference built by an
obviously-correct loop over mesh coordinates (no use of MeshSpec.axis_group).
"""
import math
import threading
import time

import pytest
import torch
from hypothesis import given, strategies as st

from fxshard.mesh import SimulatedMesh
from fxshard.runtime import (COLLECTIVE_OPS, SimulatedBackend, SimulatedWorld, current_backend,
                             is_communication, is_point_to_point, use_backend)

ops = torch.ops.fxshard
AXES = ("dp", "tp", "pp", "ulysses_cp", "ring_cp")


# --- reference geometry, written independently of fxshard.mesh ---------------------------------

def all_coords(shape):
    out = [()]
    for n in shape:
        out = [c + (k,) for c in out for k in range(n)]
    return out  # row-major: index in this list == rank


def reference_group(shape, rank, i):
    """Ranks sharing every coordinate with ``rank`` except axis ``i``, by that coordinate."""
    coords = all_coords(shape)
    me = coords[rank]
    members = [r for r, c in enumerate(coords)
               if all(c[j] == me[j] for j in range(len(shape)) if j != i)]
    return sorted(members, key=lambda r: coords[r][i])


@st.composite
def meshes(draw):
    ndim = draw(st.integers(1, 3))
    names = draw(st.permutations(AXES))[:ndim]
    shape = []
    for _ in range(ndim):
        budget = 8 // math.prod(shape)  # at most 8 ranks
        shape.append(draw(st.integers(1, min(4, budget))))
    return SimulatedMesh(tuple(shape), tuple(names))


def rank_inputs(mesh, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=g).to(dtype) for _ in range(mesh.world_size)]
    return [torch.randint(-50, 50, shape, generator=g).to(dtype) for _ in range(mesh.world_size)]


def assert_fresh(out, inputs):
    """A result shares storage with no rank's input."""
    for t in inputs:
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or \
            out.numel() == 0


def seq_sum(ts):
    out = ts[0].clone()
    for t in ts[1:]:
        out = out + t
    return out


@given(mesh=meshes(), data=st.data())
def test_collectives_match_reference(mesh, data):
    axis_i = data.draw(st.integers(0, len(mesh.shape) - 1), label="axis")
    axis, n = mesh.axis_names[axis_i], mesh.shape[axis_i]
    ndim = data.draw(st.integers(1, 3), label="ndim")
    dim = data.draw(st.integers(0, ndim - 1), label="dim")
    other = data.draw(st.integers(0, ndim - 1), label="other_dim")
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] *= n  # divisible along dim: reduce_scatter / local_shard / all_to_all split
    dtype = data.draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16]), label="dtype")
    xs = rank_inputs(mesh, shape, dtype, data.draw(st.integers(0, 2**16), label="seed"))

    def program(rank):
        x = xs[rank]
        return {
            "all_gather": ops.all_gather(x, dim, axis, n),
            "all_reduce": ops.all_reduce(x, axis, n),
            "reduce_scatter": ops.reduce_scatter(x, dim, axis, n),
            "all_to_all": ops.all_to_all(x, dim, other, axis, n),
            "local_shard": ops.local_shard(x, dim, axis, n),
            # fsdp's buckets: one collective, each output as its own op's (mixed dims)
            "all_gather_bucket": ops.all_gather_bucket([x, 2 * x], [dim, other], axis, n),
            "reduce_scatter_bucket": ops.reduce_scatter_bucket([2 * x, x], [dim, dim], axis, n),
        }

    with SimulatedWorld(mesh, timeout=30) as world:
        results = world.run(program)
    for rank, got in enumerate(results):
        members = reference_group(mesh.shape, rank, axis_i)
        k = members.index(rank)
        group_xs = [xs[q] for q in members]
        total = seq_sum(group_xs)
        want = {
            "all_gather": torch.cat(group_xs, dim),
            "all_reduce": total,
            "reduce_scatter": torch.chunk(total, n, dim)[k],
            "all_to_all": torch.cat([torch.chunk(t, n, dim)[k] for t in group_xs], other),
            "local_shard": torch.chunk(xs[rank], n, dim)[k],
        }
        want["all_gather_bucket"] = [want["all_gather"],
                                     torch.cat([2 * t for t in group_xs], other)]
        want["reduce_scatter_bucket"] = [torch.chunk(seq_sum([2 * t for t in group_xs]), n,
                                                     dim)[k], want["reduce_scatter"]]
        for name in ("all_gather_bucket", "reduce_scatter_bucket"):
            for g, w in zip(got.pop(name), want.pop(name)):
                torch.testing.assert_close(g, w, msg=f"{name} on rank {rank} of {mesh}")
                assert g.is_contiguous()
                assert_fresh(g, xs)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, msg=f"{name} on rank {rank} of {mesh}")
            assert got[name].is_contiguous()
            assert_fresh(got[name], xs)
        # every rank of a group holds bit-identical all_reduce results
        assert torch.equal(got["all_reduce"], results[members[0]]["all_reduce"])


@given(mesh=meshes(), data=st.data())
def test_gather_and_reduce_scatter_invert_sharding(mesh, data):
    """A global tensor chunked over an axis and all-gathered comes back; all-to-all re-shards."""
    axis_i = data.draw(st.integers(0, len(mesh.shape) - 1))
    axis, n = mesh.axis_names[axis_i], mesh.shape[axis_i]
    g = torch.arange(2 * n * 3 * n, dtype=torch.float32).reshape(2 * n, 3 * n)

    def program(rank):
        k = reference_group(mesh.shape, rank, axis_i).index(rank)
        rows = torch.chunk(g, n, 0)[k]
        cols = ops.all_to_all(rows, 1, 0, axis, n)  # S(0) -> S(1)
        return ops.all_gather(rows, 0, axis, n), cols, k

    with SimulatedWorld(mesh) as world:
        for gathered, cols, k in world.run(program):
            assert torch.equal(gathered, g)
            assert torch.equal(cols, torch.chunk(g, n, 1)[k])


def test_size_one_axis_is_identity_copy():
    mesh = SimulatedMesh((2, 1), ("dp", "tp"))
    x = torch.randn(3, 4)
    with SimulatedWorld(mesh) as world:
        for out in world.run(lambda r: [ops.all_gather(x, 1, "tp", 1), ops.all_reduce(x, "tp", 1),
                                        ops.reduce_scatter(x, 0, "tp", 1),
                                        ops.all_to_all(x, 0, 1, "tp", 1),
                                        ops.local_shard(x, 1, "tp", 1),
                                        ops.all_reduce(x, "pp", 1)]):
            for t in out:
                assert torch.equal(t, x)
                assert t.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("shape", [(4,), (2, 3), (2, 2, 2)])
def test_send_recv_ring_and_far_peer(shape):
    mesh = SimulatedMesh(shape, ("pp", "tp", "dp")[:len(shape)])
    axis, n = mesh.axis_names[0], mesh.shape[0]

    def program(rank):
        me = current_backend().axis_index(axis)
        x = torch.full((2, 3), float(rank))
        ops.send(x, axis, (me + 1) % n)               # every rank sends before it receives
        ops.send(x * 10, axis, (me + 1) % n)          # a second, identical-looking message
        far = (me + 2) % n
        if n >= 3:
            ops.send(x + 0.5, axis, far)
        got = [ops.recv([2, 3], torch.float32, torch.device("cpu"), axis, (me - 1) % n),
               ops.recv([2, 3], torch.float32, torch.device("cpu"), axis, (me - 1) % n)]
        if n >= 3:
            got.append(ops.recv([2, 3], torch.float32, torch.device("cpu"), axis, (me - 2) % n))
        return got

    with SimulatedWorld(mesh, timeout=10) as world:
        results = world.run(program)
    for rank, got in enumerate(results):
        members = reference_group(mesh.shape, rank, 0)
        k = members.index(rank)
        prev = members[(k - 1) % n]
        assert torch.equal(got[0], torch.full((2, 3), float(prev)))
        assert torch.equal(got[1], torch.full((2, 3), float(prev) * 10))  # FIFO, not merged
        if n >= 3:
            assert torch.equal(got[2], torch.full((2, 3), members[(k - 2) % n] + 0.5))


def test_send_payload_is_snapshotted():
    mesh = SimulatedMesh((2,), ("pp",))

    def program(rank):
        if rank == 0:
            x = torch.zeros(3)
            ops.send(x, "pp", 1)
            x.add_(7)  # mutating after send must not change the message
            return x
        return ops.recv([3], torch.float32, torch.device("cpu"), "pp", 0)

    with SimulatedWorld(mesh) as world:
        assert torch.equal(world.run(program)[1], torch.zeros(3))


def test_world_threads_persist_across_runs():
    mesh = SimulatedMesh((2, 2), ("dp", "tp"))
    with SimulatedWorld(mesh) as world:
        first = world.run(lambda r: threading.get_ident())
        for _ in range(20):
            assert world.run(lambda r: threading.get_ident()) == first
        assert len(set(first)) == 4
        assert world.run(lambda r: r * 2, ranks=[3, 1]) == [6, 2]


def test_ranks_share_the_callers_intra_op_threads():
    # a fresh thread would start with OpenMP's default count and oversubscribe the cores
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with SimulatedWorld(SimulatedMesh((2,), ("tp",))) as world:
            assert world.run(lambda r: torch.get_num_threads()) == [2, 2]
            assert world.run(lambda r: torch.get_num_threads(), ranks=[1]) == [4]
        with SimulatedWorld(SimulatedMesh((2, 4), ("dp", "tp"))) as world:
            assert world.run(lambda r: torch.get_num_threads()) == [1] * 8
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


# --- errors ----------------------------------------------------------------------------------

def test_timeout_names_rank_op_axis_and_missing_ranks():
    mesh = SimulatedMesh((2, 2), ("dp", "tp"))

    def program(rank):
        if rank == 3:
            return None  # skips the collective
        return ops.all_reduce(torch.ones(2), "tp", 2)

    start = time.monotonic()
    with SimulatedWorld(mesh, timeout=0.5) as world:
        with pytest.raises(TimeoutError) as info:
            world.run(program)
    assert time.monotonic() - start < 5
    text = str(info.value)
    assert "rank 2" in text and "all_reduce" in text and "'tp'" in text
    assert "missing: [3]" in text and "arrived: [2]" in text


def test_recv_timeout_names_sender():
    mesh = SimulatedMesh((2,), ("pp",))

    def program(rank):
        if rank == 1:
            return ops.recv([2], torch.float32, torch.device("cpu"), "pp", 0)

    with SimulatedWorld(mesh, timeout=0.3) as world:
        with pytest.raises(TimeoutError, match=r"rank 1 .*recv on axis 'pp'.*from rank 0"):
            world.run(program)


def test_exception_in_one_rank_wakes_the_others_promptly():
    mesh = SimulatedMesh((2, 2), ("dp", "tp"))

    def program(rank):
        if rank == 2:
            time.sleep(0.1)
            raise KeyError("boom in rank two")
        ops.all_gather(torch.ones(2), 0, "dp", 2)  # ranks 0, 1, 3 block here
        return ops.all_reduce(torch.ones(2), "tp", 2)

    with SimulatedWorld(mesh, timeout=60) as world:
        start = time.monotonic()
        with pytest.raises(KeyError, match="rank 2") as info:
            world.run(program)
        assert time.monotonic() - start < 5, "blocked ranks were not woken"
        assert "boom in rank two" in str(info.value)
        assert isinstance(info.value.__cause__, KeyError)
        # the world stays usable after a failure
        assert world.run(lambda r: r) == [0, 1, 2, 3]


def test_non_builtin_exception_becomes_runtime_error_chained():
    class Custom(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    mesh = SimulatedMesh((2,), ("tp",))

    def program(rank):
        if rank == 1:
            raise Custom(1, 2)
        return ops.all_reduce(torch.ones(1), "tp", 2)

    with SimulatedWorld(mesh) as world:
        with pytest.raises(RuntimeError, match="rank 1") as info:
            world.run(program)
    assert isinstance(info.value.__cause__, Custom)


@pytest.mark.parametrize("second, differs", [
    (lambda x: ops.all_gather(x, 1, "tp", 2), "dim"),
    (lambda x: ops.all_reduce(x, "tp", 2), "the op"),
    (lambda x: ops.all_gather(x[:1], 0, "tp", 2), "the shape"),
    (lambda x: ops.all_gather(x.double(), 0, "tp", 2), "the dtype"),
])
def test_mismatched_collectives_raise(second, differs):
    mesh = SimulatedMesh((2,), ("tp",))

    def program(rank):
        x = torch.ones(2, 2)
        if rank == 0:
            return ops.all_gather(x, 0, "tp", 2)
        time.sleep(0.05)  # rank 0 arrives first
        return second(x)

    with SimulatedWorld(mesh, timeout=10) as world:
        with pytest.raises(RuntimeError) as info:
            world.run(program)
    text = str(info.value)
    assert "rank 0" in text and "rank 1" in text and differs in text and "diverged" in text


def test_unreceived_message_is_an_error():
    mesh = SimulatedMesh((2,), ("pp",))

    def program(rank):
        if rank == 0:
            ops.send(torch.ones(1), "pp", 1)

    with SimulatedWorld(mesh) as world:
        with pytest.raises(RuntimeError, match="never received"):
            world.run(program)


def test_recv_shape_mismatch_raises():
    mesh = SimulatedMesh((2,), ("pp",))

    def program(rank):
        if rank == 0:
            ops.send(torch.ones(3), "pp", 1)
        else:
            ops.recv([4], torch.float32, torch.device("cpu"), "pp", 0)

    with SimulatedWorld(mesh) as world:
        with pytest.raises(RuntimeError, match=r"rank 1 .*float32\[4\].*rank 0.*float32\[3\]"):
            world.run(program)


def test_op_outside_backend_raises():
    with pytest.raises(RuntimeError, match="ParallelModule or fxshard.runtime.SimulatedWorld.run"):
        ops.all_reduce(torch.ones(2), "tp", 2)
    with pytest.raises(RuntimeError, match="SimulatedWorld.run"):
        ops.send(torch.ones(2), "pp", 1)


def test_wrong_size_argument_raises():
    mesh = SimulatedMesh((2, 2), ("dp", "tp"))
    with SimulatedWorld(mesh) as world:
        with pytest.raises(ValueError, match=r"all_gather.*'tp'.*size 4.*size 2"):
            world.run(lambda r: ops.all_gather(torch.ones(2), 0, "tp", 4))


def test_indivisible_and_bad_peer_raise_value_error():
    mesh = SimulatedMesh((2,), ("tp",))
    with SimulatedWorld(mesh) as world:
        with pytest.raises(ValueError, match=r"reduce_scatter.*size 3.*'tp'"):
            world.run(lambda r: ops.reduce_scatter(torch.ones(3), 0, "tp", 2))
        with pytest.raises(ValueError, match="peer=5"):
            world.run(lambda r: ops.send(torch.ones(3), "tp", 5))
        with pytest.raises(ValueError, match=r"reduce_scatter_bucket.*size 3.*'tp'"):
            world.run(lambda r: ops.reduce_scatter_bucket([torch.ones(4), torch.ones(3)],
                                                          [0, 0], "tp", 2))
        with pytest.raises(ValueError, match=r"all_gather_bucket.*share a dtype.*by dtype"):
            world.run(lambda r: ops.all_gather_bucket([torch.ones(2), torch.ones(2).double()],
                                                      [0, 0], "tp", 2))


def test_run_argument_errors():
    mesh = SimulatedMesh((2,), ("tp",))
    with pytest.raises(ValueError, match="timeout"):
        SimulatedWorld(mesh, timeout=0)
    world = SimulatedWorld(mesh)
    with pytest.raises(ValueError, match="outside the mesh"):
        world.run(lambda r: r, ranks=[2])
    world.close()
    with pytest.raises(RuntimeError, match="closed"):
        world.run(lambda r: r)


def test_use_backend_restores_previous():
    mesh = SimulatedMesh((1,), ("tp",))
    world = SimulatedWorld(mesh)
    b1, b2 = SimulatedBackend(world, 0), SimulatedBackend(world, 0)
    with use_backend(b1):
        with use_backend(b2):
            assert current_backend() is b2
        assert current_backend() is b1
    with pytest.raises(RuntimeError):
        current_backend()


# --- graphs: export, DCE, CSE ------------------------------------------------------------------

class Tiny(torch.nn.Module):
    """Every op once; exchanges a message with coordinate ``peer`` of ``tp``."""

    def __init__(self, peer=1):
        super().__init__()
        self.peer = peer

    def forward(self, x):
        a = torch.ops.fxshard.all_gather(x, 1, "tp", 2)
        b = torch.ops.fxshard.all_reduce(a, "tp", 2)
        c = torch.ops.fxshard.reduce_scatter(b, 0, "tp", 2)
        d = torch.ops.fxshard.all_to_all(c, 1, 0, "tp", 2)
        e = torch.ops.fxshard.local_shard(d, 0, "tp", 2)
        torch.ops.fxshard.send(e * 2, "tp", self.peer)
        r = torch.ops.fxshard.recv([2, 4], torch.float32, torch.device("cpu"), "tp", self.peer)
        return e + r


def test_ops_export_with_fake_impls():
    ep = torch.export.export(Tiny(), (torch.randn(4, 4),), strict=False)
    calls = {n.target: n for n in ep.graph.nodes if n.op == "call_function"}
    shapes = {t._name: list(n.meta["val"].shape) for t, n in calls.items()
              if t in COLLECTIVE_OPS | {ops.recv.default, ops.local_shard.default}}
    assert shapes == {"fxshard::all_gather": [4, 8], "fxshard::all_reduce": [4, 8],
                      "fxshard::reduce_scatter": [2, 8], "fxshard::all_to_all": [4, 4],
                      "fxshard::local_shard": [2, 4], "fxshard::recv": [2, 4]}
    assert ops.send.default in calls
    assert "torch.ops.fxshard.all_gather.default(x, 1, 'tp', 2)" in ep.graph_module.code


def test_export_graph_runs_on_simulated_ranks():
    mesh = SimulatedMesh((2,), ("tp",))
    x = [torch.randn(4, 4) for _ in range(2)]
    exported = [torch.export.export(Tiny(peer=1 - r), (x[r],), strict=False).module()
                for r in range(2)]
    with SimulatedWorld(mesh) as world:
        got = world.run(lambda r: exported[r](x[r]))
        want = world.run(lambda r: Tiny(peer=1 - r)(x[r]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _graph_with_p2p():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    g.call_function(ops.send.default, (y, "pp", 1))
    g.call_function(ops.all_reduce.default, (x, "tp", 2))  # unused collective
    g.call_function(ops.recv.default, ([2], torch.float32, torch.device("cpu"), "pp", 1))
    a = g.call_function(ops.recv.default, ([2], torch.float32, torch.device("cpu"), "pp", 1))
    b = g.call_function(ops.recv.default, ([2], torch.float32, torch.device("cpu"), "pp", 1))
    g.output(g.call_function(torch.ops.aten.sub.Tensor, (a, b)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_dce_keeps_send_and_recv_drops_unused_collective():
    gm = _graph_with_p2p()
    assert sum(is_communication(n) for n in gm.graph.nodes) == 5
    assert gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.send.default) == 1
    assert targets.count(ops.recv.default) == 3  # an unused recv still consumes its message
    assert ops.all_reduce.default not in targets  # collectives are pure
    assert sum(is_point_to_point(n) for n in gm.graph.nodes) == 4


def test_identical_recvs_are_not_merged_under_compile():
    """torch.compile (AOTAutograd's CSE) keeps two identical recv calls two messages."""
    mesh = SimulatedMesh((2,), ("pp",))
    gm = _graph_with_p2p()
    gm.graph.eliminate_dead_code()  # drops the unused all_reduce
    gm.recompile()
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)

    def program(rank):
        if rank == 1:
            for v in (1.0, 5.0, 2.0):
                ops.send(torch.full((2,), v), "pp", 0)
            return ops.recv([2], torch.float32, torch.device("cpu"), "pp", 0)
        return compiled(torch.ones(2))

    with SimulatedWorld(mesh, timeout=20) as world:
        out0, out1 = world.run(program)
    # rank 0 runs three recvs: the unused one takes 1.0, then a=5.0, b=2.0. Merged recvs would
    # return 0 and leave messages unreceived (an error at the end of run).
    assert torch.equal(out0, torch.full((2,), 3.0))
    assert torch.equal(out1, torch.full((2,), 2.0))
