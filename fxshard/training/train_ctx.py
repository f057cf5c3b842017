"""The context training's joint-graph passes share (:mod:`fxshard.training.pass_lists`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..passes import PassCtx

__all__ = ["TrainCtx"]


@dataclass
class TrainCtx(PassCtx):
    """A :class:`PassCtx` with what the joint graph's passes read and leave."""

    joint: object = None          # fxshard.training.joint.Joint: the graph's calling convention
    specs: dict = field(default_factory=dict)   # weight FQN -> the forward's placement
    vocab_outputs: bool = False   # keep a tp-sharded last-dim output (the logits) as blocks
    block_outputs: dict = field(default_factory=dict)   # left: output index -> block spec
    reshard_after_forward: bool | str = True    # fsdp: redo the all-gathers in the backward
    recompute: object = None      # "layers" or saved bytes per rank (training.recompute)
    model_name: str = "the model"
    split: object = None          # left by partition_pass: fxshard.training.partition.Split
