"""Text generation on a ParallelModule (``pm.generate``): the loop, token choice, KV caches.

    loop.py       generate: prefill, then decode step by step (sampling on any mesh)
    pipelined.py  greedy on pp: the groups of sequences flow through the stages across steps
    cache.py      every rank's KV caches and the cache positions of each decode step
    sampling.py   greedy / temperature, top-k, top-p, as HuggingFace generate

The programs come from the pass pipeline with a generation key (``fxshard.passes.kv_cache``);
what a program binds and returns beyond the model's own is data on its ``Program``
(``state_inputs``, ``kv_caches``, ``write_pos``, ``token_ids``).
"""
from .cache import CAPACITY_STEP
from .loop import generate

__all__ = ["generate", "CAPACITY_STEP"]
