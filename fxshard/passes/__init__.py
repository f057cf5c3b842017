"""Graph passes. Each is ``def name_pass(gm, *, ctx: PassCtx) -> GraphModule`` and reports
what it changed through ``ctx.report``; the order is fixed by ``fxshard.api.compile_program``::

    cleanup -> eager_attention -> fold_causal_mask -> unrepeat_kv -> propagate
            -> insert_collectives -> [decode_attention] -> lower_attention -> [prefill_cache]
            -> localize -> split_stages (pp > 1) -> emit

(the bracketed passes build text generation's programs, ``fxshard.passes.kv_cache``).
``propagate`` first runs ``moe_routing`` (it tags the expert-routing regions its rules read).
``split_stages`` runs after ``localize`` (DESIGN.md lists it before): a receive needs the local
shape of what it receives. ``split_stages`` returns one graph per stage and ``emit`` one
``Program`` per graph.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ..mesh import MeshSpec
from ..placement import P, R, Shard

__all__ = ["PassCtx", "PLAN_STYLES"]

# plan style -> placement on the tp axis of (weight, bias)
PLAN_STYLES = {
    "colwise": (Shard(0), Shard(0)),
    "rowwise": (Shard(1), P),
    "vocab": (Shard(0), None),
    "embed_dim": (Shard(1), None),
    "replicate": (R, R),
}


@dataclass
class PassCtx:
    """Options and bookkeeping shared by the passes of one ``parallelize`` call."""

    mesh: MeshSpec
    sequence_parallel: bool = False
    strict: bool = False
    plan: dict = field(default_factory=dict)
    embedding_style: str = "embed_dim"
    input_specs: dict | None = None       # user input index -> spec (default: input_spec)
    keep_output_placement: bool = False   # leave outputs sharded (rule tests read the blocks)
    ring_zigzag: bool = True              # zigzag sequence layout on ring_cp (load balance)
    split_sequence: bool = True           # user inputs' dim 1 on the CP axes (off: decode)
    edits: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    replicated: list = field(default_factory=list)   # (weight FQN, why it stays whole on tp)
    gathered: list = field(default_factory=list)     # (node, why a CP axis gathers around it)

    @property
    def zigzag_axes(self) -> tuple[str, ...]:
        return ("ring_cp",) if self.ring_zigzag and self.mesh.axis_size("ring_cp") > 1 else ()

    def report(self, pass_name: str, message: str) -> None:
        self.edits.append((pass_name, message))

    def plan_for(self, fqn: str) -> tuple | None:
        """(weight, bias) tp placements the user's ``plan`` gives the module owning ``fqn``."""
        module, _, leaf = fqn.rpartition(".")
        for pattern, style in self.plan.items():
            if fnmatch.fnmatchcase(module, pattern):
                w, b = PLAN_STYLES[style]
                return w if leaf == "weight" else (b if b is not None else R)
        return None
