"""Training: the joint forward+backward graph through the same passes.

``parallelize_for_training(model, mesh)`` gives a :class:`TrainModule` whose call returns
outputs that backpropagate into every rank's parameter shards; see ``module.py``. The pass
lists (``TRAIN_FORWARD``, ``TRAIN_JOINT``, ``TRAIN_RANK``) are ``pass_lists.py``, built into
rank programs by ``program.py``.
"""
from .module import TrainModule, assemble, parallelize_for_training
from .optim import clip_grad_norm_

__all__ = ["TrainModule", "parallelize_for_training", "assemble", "clip_grad_norm_"]
