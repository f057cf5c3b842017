"""The simulated mesh's rank threads: each rank's intra-op thread count is the caller's shared
out, and a run leaves the count of threads started later as the caller had it."""
from __future__ import annotations

import threading

import pytest
import torch

from fxshard.mesh import SimulatedMesh
from fxshard.runtime.rank_threads import RankThreads, intra_op_threads
from fxshard.runtime.simulated import SimulatedWorld


@pytest.fixture
def caller_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _in_a_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.parametrize("caller,ranks,each", [(8, 4, 2), (4, 4, 1), (2, 4, 1), (6, 4, 1),
                                               (3, 1, 3)])
def test_each_rank_gets_the_callers_threads_shared_out(caller_threads, caller, ranks, each):
    caller_threads(caller)
    assert intra_op_threads(ranks) == each
    with SimulatedWorld(SimulatedMesh((ranks,), ("tp",))) as world:
        assert world.run(lambda r: torch.get_num_threads()) == [each] * ranks
        assert torch.get_num_threads() == caller


def test_threads_started_after_a_run_keep_the_callers_count(caller_threads):
    # torch.set_num_threads in a rank thread also sets the default of threads started later
    caller_threads(4)
    with SimulatedWorld(SimulatedMesh((4,), ("tp",))) as world:
        assert world.run(lambda r: torch.get_num_threads()) == [1] * 4
        assert _in_a_new_thread(torch.get_num_threads) == 4
        # a rank whose call raised gives the threads back too
        with pytest.raises(ValueError, match="boom"):
            world.run(lambda r: (_ for _ in ()).throw(ValueError("boom")))
        assert _in_a_new_thread(torch.get_num_threads) == 4
    assert torch.get_num_threads() == 4


def test_rank_threads_run_in_order_on_named_threads_and_stop():
    pool = RankThreads(["a", "b"])
    assert pool.threads == []           # started at the first submit
    futures = [pool.submit(r, lambda: threading.current_thread().name) for r in (1, 0, 1)]
    assert [f.result(timeout=10) for f in futures] == ["b", "a", "b"]
    threads = pool.threads
    failed = pool.submit(0, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    pool.close(timeout=10)
    assert pool.threads == [] and not any(t.is_alive() for t in threads)
