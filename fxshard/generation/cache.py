"""Every rank's KV caches and cache positions: the state the generation programs bind.

A program says which caches it reads (``Program.kv_caches``: key, the rank's shape, dtype; from
:mod:`fxshard.passes.kv_cache`). :class:`Caches` allocates them once per ``generate`` call, one
set per rank this process runs (on a real mesh: its own), with the batch of every microbatch
(``microbatches=m``: ``m`` times the program's), and before each decode step fills the write
position, read lengths and the new token's position (``cache_position``, for a model that
derives positions from the sequence length) in place from
:func:`fxshard.passes.kv_cache.decode_slots` (the one place the ring's write-owner rule is
written).

The capacity per rank is the prompt plus ``max_new_tokens`` (on ``ring_cp``: the most any ring
rank holds), rounded up to a multiple of :data:`CAPACITY_STEP` so prompts of similar length
share the decode program.
"""
from __future__ import annotations

import torch

from ..passes.decode_positions import POSITION
from ..passes.kv_cache import READ_LEN, WRITE_POS, decode_slots
from ..mesh import RING, TP

__all__ = ["Caches", "capacity", "check_same_caches", "prefill_placements", "CAPACITY_STEP"]

_WHERE = "ParallelModule.generate"
CAPACITY_STEP = 64


def capacity(spec, prompt: int, new: int) -> int:
    """Cache slots per rank for a prompt of ``prompt`` tokens and ``new`` new ones."""
    ring = spec.axis_size(RING)
    need = prompt // ring + -(-max(new - 1, 0) // ring)
    return max(CAPACITY_STEP, -(-need // CAPACITY_STEP) * CAPACITY_STEP)


class Caches:
    """Every rank's KV caches and positions for the programs of ``c`` (the prefill's
    ``Compiled``), on the ranks ``executor`` runs; ``state[rank]`` is what a rank binds."""

    def __init__(self, executor, c, prompt: int, capacity: int):
        self.spec = executor.spec
        self.ring = self.spec.axis_size(RING)
        self.capacity = capacity
        self.base = prompt // self.ring           # prompt positions each ring rank holds
        self.prompt = prompt
        self.device = device = executor.device
        m = executor.options.microbatches
        self.state: dict[int, dict] = {}
        for rank in executor.ranks():
            program = c.programs[executor.stage_of(rank)]
            st = {}
            for key, shape, dtype in program.kv_caches:
                st[key] = torch.zeros((shape[0] * m, *shape[1:]), dtype=dtype, device=device)
            st[WRITE_POS] = torch.zeros(1, dtype=torch.int64, device=device)
            st[POSITION] = torch.zeros((), dtype=torch.int64, device=device)
            self.state[rank] = st
        self.batch = {r: next((t.shape[0] for k, t in st.items() if k.startswith("kv.")), 1)
                      for r, st in self.state.items()}
        self.coord = {r: self.spec.axis_index(r, RING) for r in self.state}

    def step(self, t: int, *, ranks=None) -> None:
        """Positions for decode step ``t`` (its new K/V at prompt + t), on ``ranks`` (all)."""
        for rank in self.state if ranks is None else ranks:
            st = self.state[rank]
            write, read = decode_slots(t, self.coord[rank], self.ring, self.base, self.capacity)
            st[WRITE_POS].fill_(write)     # in place: no new tensors per step
            st[POSITION].fill_(self.prompt + t)   # the new token's position
            if READ_LEN in st:
                st[READ_LEN].fill_(read)
            else:
                st[READ_LEN] = torch.full((self.batch[rank],), read, dtype=torch.int64,
                                          device=self.device)


def _cache_shapes(c) -> dict:
    return {k: tuple(shape) for p in c.programs for k, shape, _ in p.kv_caches}


def prefill_placements(prefill, decode) -> tuple:
    """``((fqn, tp placement), ...)`` the decode program must adopt from the prefill's so that
    both keep every KV cache in one layout; ``()`` where they already do.

    The automatic plan places weights by their first consumer, and a one-token step can read
    a projection differently from the prompt: HF DeepSeek-V3's ``kv_b_proj`` is split by heads
    for the prompt (its cache holds each rank's heads) but row-parallel for one token (every
    head on every rank). The prefill wrote the cache first, so its layout stands: every weight
    the two programs place differently on ``tp`` takes the prefill's placement, and the
    decode program is built again with them pinned (``PassCtx.pinned``). What still differs
    after that is :func:`check_same_caches`' error."""
    shapes = _cache_shapes(prefill)
    if all(shapes.get(k, shape) == shape for k, shape in _cache_shapes(decode).items()):
        return ()
    spec = prefill.ctx.mesh
    if TP not in spec.axis_names or spec.axis_size(TP) == 1:
        return ()
    tp = spec.axis_names.index(TP)

    def placements(c) -> dict:
        return {fqn: slot.spec[tp] for p in c.programs for fqn, slot in p.slots.items()
                if slot.kind == "param"}
    before, now = placements(prefill), placements(decode)
    return tuple(sorted(((fqn, p) for fqn, p in before.items() if fqn in now and now[fqn] != p),
                        key=lambda item: item[0]))


def check_same_caches(prefill, decode) -> None:
    """The decode program must read every cache the prefill wrote: an attention the decode
    trace did not recognise would attend only the new token."""
    def keys(c):
        return sorted(k for p in c.programs for k, _, _ in p.kv_caches)
    written, read = keys(prefill), keys(decode)
    if written != read:
        raise NotImplementedError(
            f"{_WHERE}: the prompt's forward has {len(written) // 2} attentions but fxshard "
            f"recognised {len(read) // 2} in the one-token decode step (its attention is "
            f"written in a form fxshard does not lower for a single query, e.g. eager "
            f"attention with a mask built from position_ids); run the model with "
            f"attn_implementation='sdpa'")
    shapes = [{k: shape for k, shape, _ in p.kv_caches} for p in (prefill.program,
                                                                  decode.program)]
    for key, shape in shapes[0].items():
        if shapes[1].get(key, shape) != shape:
            weight = _projection_of(prefill.program.graph, key)
            fix = (f"plan={{{weight!r}: 'colwise'}}" if weight else
                   "plan= naming the projection that makes it 'colwise'")
            raise NotImplementedError(
                f"{_WHERE}: the prompt's program keeps cache {key} as {list(shape)} per rank "
                f"but the one-token decode program computes it as {list(shapes[1][key])}, "
                f"even with the prompt's placement of every weight adopted (an activation "
                f"between the projection and the cache is placed differently for one token). "
                f"Pin the projection with {fix} in fxshard.parallelize")


def _projection_of(graph, key: str) -> str | None:
    """The weight of the nearest matmul above the K or V written into cache ``key``."""
    import torch.fx as fx
    writes = [n for n in graph.nodes if n.op == "call_function" and "cache_write" in
              str(n.target) and n.args[0].meta.get("fxshard_state") == key]
    todo = [writes[0].args[1]] if writes else []
    seen = set()
    while todo:
        node = todo.pop(0)
        if node in seen or not isinstance(node, fx.Node):
            continue
        seen.add(node)
        if str(node.target) in ("aten.linear.default", "aten.mm.default",
                                "aten.matmul.default"):
            for arg in node.args[1:2]:
                name = arg.meta.get("fxshard_param") or (arg.target if arg.op == "get_attr"
                                                         else None)
                if name:     # its module, layer indices as a glob: every layer alike
                    return ".".join("*" if part.isdigit() else part
                                    for part in str(name).split(".")[:-1])
        todo += node.all_input_nodes
    return None
