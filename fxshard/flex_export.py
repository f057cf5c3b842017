"""Let ``torch.export`` trace FlexAttention in a model that will be trained.

PyTorch's ``flex_attention`` refuses, on CPU, query/key/value that require grad ("FlexAttention
does not support backward on CPU"), and ``torch.export`` traces with the parameters' real
``requires_grad``: a model whose forward calls it could not be traced for training on a CPU
machine. fxshard never runs PyTorch's flex backward: :mod:`fxshard.passes.lower_flex` replaces
the traced op by ordinary attention before any program is built. :func:`flex_traceable`
therefore lifts only that one CPU check while an export runs (every other check of
``flex_attention`` stays; outside the export nothing changes).

It also turns off the fake-tensor dispatch cache while exporting: ``create_block_mask`` vmaps
the ``mask_mod``, and a ``mask_mod`` that indexes a captured tensor by the batch index
(``doc[b, q_idx]``) leaves a cache entry with symbolic strides there (PyTorch 2.13, a batch
of 1), which makes that export and every later one in the process fail ("... is not tracked
with proxy"). Turning it off only around the vmapped calls does not avoid it; the export
takes somewhat longer (measured 6.0-7.5 s -> 8.1-8.5 s for a 4-layer tiny Llama on a loaded
2-core CPU).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["flex_traceable"]


@contextlib.contextmanager
def flex_traceable():
    """Within: ``flex_attention`` on CPU accepts inputs that require grad (for tracing)."""
    try:
        from torch.nn.attention import flex_attention as flex
    except ImportError:       # a torch without FlexAttention
        yield
        return
    check = getattr(flex, "_validate_device", None)
    if check is None:
        yield
        return

    def validate(query, key, value):
        if query.device.type != "cpu":    # (CPU passes every other part of the check)
            check(query, key, value)

    flex._validate_device = validate
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            yield
    finally:
        flex._validate_device = check
