"""fxshard: run one unmodified PyTorch model in parallel over a device mesh.

The model is traced with torch.export into an ATen FX graph; graph passes annotate every node
with its placement on each mesh axis (dp, fsdp, tp, pp, ulysses_cp, ring_cp), insert the
collectives and emit one readable ``torch.fx.GraphModule`` per rank.
"""
from torch.distributed.tensor import Partial, Replicate, Shard

from . import ops  # noqa: F401  (registers every torch.ops.fxshard op)
from .api import ParallelModule, parallelize
from .backend import backend
from .checkpoint import load_safetensors
from .checkpoint_save import save_safetensors
from .mesh import SimulatedMesh, init_device_mesh
from .plan import Estimate, Hardware, Plan, calibrate, estimate, plan
from .training.grad_scaler import GradScaler
from .training.optim import clip_grad_norm_
from .training.resume import load_training_state, save_training_state
from .weights import init_empty_weights

__all__ = ["init_device_mesh", "parallelize", "backend", "load_safetensors", "save_safetensors",
           "init_empty_weights", "ParallelModule", "SimulatedMesh", "clip_grad_norm_", "Shard",
           "Replicate", "Partial", "save_training_state", "load_training_state", "GradScaler"]
