"""Graph passes. Each is ``def name_pass(gm, *, ctx: PassCtx) -> GraphModule``: what it needs
beyond the graph (constants, cache capacity, the layer stages) is on ``ctx``, and it says what
it changed as counts, ``ctx.report(pass_name, folded_masks=2)``. The order is data, the pass
lists of :mod:`fxshard.passes.pipeline`, run by its ``run_passes`` (which owns the "if
changed: eliminate dead code, lint, recompile" ending)::

    FORWARD: cleanup -> eager_attention -> fold_causal_mask -> unrepeat_kv -> moe_routing
             -> propagate -> insert_collectives -> lower_attention -> localize
             -> split_stages -> fsdp_buckets -> emit (per stage)
    PREFILL: FORWARD with prefill_cache after lower_attention
    DECODE:  FORWARD with decode_attention before lower_attention (and, greedy,
             greedy_tokens before decode_attention)

(the generation passes are :mod:`fxshard.passes.kv_cache`; ``fsdp_buckets`` groups fsdp's
collectives by layer, :mod:`fxshard.passes.fsdp_buckets`). ``moe_routing`` tags the
expert-routing regions ``propagate``'s rules read. ``split_stages`` runs after ``localize``
(DESIGN.md lists it before): a receive needs the local shape of what it receives; it leaves
one graph per stage on ``ctx.stage_graphs`` and the driver runs ``emit`` on each, which
appends one ``Program`` to ``ctx.programs``. After emit, the runners' rewrites are passes of
the same shape (:mod:`fxshard.passes.post_emit`, with their own small ``PostEmitCtx``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ..mesh import MeshSpec, RING
from ..placement import P, R, Shard

__all__ = ["PassCtx", "PassReports", "PLAN_STYLES"]

# plan style -> placement on the tp axis of (weight, bias)
PLAN_STYLES = {
    "colwise": (Shard(0), Shard(0)),
    "rowwise": (Shard(1), P),
    "vocab": (Shard(0), None),
    "embed_dim": (Shard(1), None),
    "replicate": (R, R),
}


class PassReports:
    """What each pass changed, as counts: ``reports["fold_causal_mask_pass"] ==
    {"folded_masks": 2, "meta_buffer_masks": 0}``. A pass that runs more than once (emit, per
    stage) adds to its counts. ``changed`` says whether the pass now running edited the graph
    (the driver then eliminates dead code, lints and recompiles)."""

    def __init__(self):
        self.reports: dict[str, dict[str, int]] = {}
        self.changed = False

    def report(self, pass_name: str, *, changed: bool | None = None, **counts: int) -> None:
        """Add ``counts`` to ``pass_name``'s report. ``changed``: whether the graph was edited
        (default: any count is nonzero; say ``False`` for counts of what was only looked at
        or annotated)."""
        mine = self.reports.setdefault(pass_name, {})
        for key, n in counts.items():
            assert isinstance(n, int), (pass_name, key, n)
            mine[key] = mine.get(key, 0) + n
        self.changed |= any(counts.values()) if changed is None else changed


@dataclass
class PassCtx(PassReports):
    """Options and bookkeeping shared by the passes of one ``parallelize`` call."""

    mesh: MeshSpec
    sequence_parallel: bool = False
    strict: bool = False
    plan: dict = field(default_factory=dict)
    # parameter FQN -> the tp placement it must take (before ``plan``): a decode program
    # adopts its prefill's where they would keep a KV cache in two layouts (fxshard.generation)
    pinned: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)   # tied parameter FQN -> its other names
    embedding_style: str = "embed_dim"
    input_specs: dict | None = None       # user input index -> spec (default: input_spec)
    keep_output_placement: bool = False   # leave outputs sharded (rule tests read the blocks)
    ring_zigzag: bool = True              # zigzag sequence layout on ring_cp (load balance)
    split_sequence: bool = True           # user inputs' dim 1 on the CP axes (off: decode)
    fallbacks: list = field(default_factory=list)
    replicated: list = field(default_factory=list)   # (weight FQN, why it stays whole on tp)
    gathered: list = field(default_factory=list)     # (node, why a CP axis gathers around it)
    partly_whole: dict = field(default_factory=dict)  # fused weight FQN -> its parts kept whole
    padded: dict = field(default_factory=dict)   # vocab-padded table FQN -> the model's shape
    padded_outputs: dict | None = None   # training: output index -> vocab, left padded
    fsdp_whole: list = field(default_factory=list)   # (FQN, shape, bytes per rank, why) of the
    #                                                  parameters stored whole on fsdp
    # what the passes read beyond the graph (``fxshard.passes.pipeline.build_programs`` sets them)
    constants: dict = field(default_factory=dict)    # FQN -> value the mask folds evaluate
    out_spec: object = None                          # the traced output's pytree spec (greedy)
    cache_capacity: int = 0                          # KV-cache slots per rank (generation)
    layer_stack: str | None = None                   # FQN of the layer container (pp > 1)
    layer_names: tuple | None = None                 # its blocks' names, in order (pp > 1)
    layer_stages: list | None = None                 # the stage of each layer (pp > 1)
    # what the last passes leave (split_stages: one graph per stage; emit: their programs)
    stage: int = 0                                   # the stage emit is emitting
    stage_graphs: list | None = None
    programs: list = field(default_factory=list)

    def __post_init__(self):
        PassReports.__init__(self)

    @property
    def zigzag_axes(self) -> tuple[str, ...]:
        return (RING,) if self.ring_zigzag and self.mesh.axis_size(RING) > 1 else ()

    def plan_for(self, fqn: str) -> tuple | None:
        """(weight, bias) tp placements the user's ``plan`` gives the module owning ``fqn``,
        or, for a tied parameter, owning another of its names (``aliases``: the trace keeps
        one name per tensor, not always the same one in every program). Two names of one
        tied tensor planned two ways is a ValueError."""
        found = []
        for name in (fqn, *self.aliases.get(fqn, ())):
            if name in self.pinned:
                return self.pinned[name]
            module, _, leaf = name.rpartition(".")
            for pattern, style in self.plan.items():
                if fnmatch.fnmatchcase(module, pattern):
                    w, b = PLAN_STYLES[style]
                    found.append((w if leaf == "weight" else (b if b is not None else R),
                                  name, pattern, style))
                    break
        if len({p for p, *_ in found}) > 1:
            ways = "; ".join(f"{name} by {pattern!r}: {style!r}" for _, name, pattern, style
                             in found)
            raise ValueError(
                f"fxshard.parallelize: plan= places the tied parameter "
                f"{' = '.join(n for _, n, _, _ in found)} (one tensor) two ways on mesh "
                f"{self.mesh.describe()}: {ways}. Give its names one style, or plan only one "
                f"of them")
        return found[0][0] if found else None
