"""Why torch.export could not trace a model, in a few lines: what, where in the user's code,
and what to do, instead of torch's report (hundreds of lines of graph and guard details).

    before: GuardOnDataDependentSymNode: Could not guard on data-dependent expression
            Eq(u0, 1) ... (graph dumps, hints about TORCH_LOGS) ...
    after:  NotImplementedError: fxshard.parallelize: torch.export could not trace M: its
            forward branches on a tensor's value (data-dependent control flow) at
            model.py:12 in forward: `if y.sum() > 0:`. ...
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import sysconfig
import traceback

import torch

from .flex_export import flex_traceable

__all__ = ["export_quietly", "summarise_export_error"]

_NOT_USER = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib)) + (
    os.path.dirname(os.path.dirname(__file__)) + os.sep + "fxshard" + os.sep,
    sysconfig.get_paths()["purelib"] + os.sep)


def _user_frame(exc: BaseException):
    """The innermost frame of the traceback in the user's code (not torch, fxshard, the
    standard library or installed packages other than the model's own)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not f.filename.startswith(_NOT_USER)]
    if frames:
        return frames[-1]
    # models from installed packages (transformers): the innermost frame outside torch
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not f.filename.startswith(_NOT_USER[:3])]
    return frames[-1] if frames else None


def summarise_export_error(model: torch.nn.Module, exc: BaseException, *,
                           where: str = "fxshard.parallelize") -> NotImplementedError:
    """A short error for an exception raised inside ``torch.export.export(model, ...)``."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    frame = _user_frame(exc)
    at = (f" at {frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
          if frame else "")
    name = type(model).__name__
    if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in str(exc):
        what = (f"its forward branches on a tensor's value (data-dependent control flow){at}. "
                f"fxshard traces one graph per input shape, so Python control flow may depend "
                f"on shapes only: write the branch with torch.where (or torch.cond), or move it "
                f"out of forward")
    elif "BlockMask" in str(exc) and "Unsupported input type" in str(exc):
        what = ("a FlexAttention BlockMask is passed to forward (torchtitan's attention_masks); "
                "its mask_mod closes over this batch's tensors (document ids), which a traced "
                "program would keep as constants. Build the mask in forward instead: pass the "
                "tensors it reads (positions or document ids) as inputs and call "
                "create_block_mask there (see docs/flex_attention.md)")
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        what = (f"{type(exc).__name__}{at}: {first[:300]}. Check that the model runs eagerly "
                f"on these inputs; fxshard needs a forward torch.export can trace "
                f"(non-strict)")
    return NotImplementedError(
        f"{where}: torch.export could not trace {name}: {what}. (torch's full report: "
        f"torch.export.export(model, args, kwargs, strict=False))")


@contextlib.contextmanager
def export_quietly():
    """Hold back what torch prints while exporting (its symbolic-shapes warnings, and the
    partial graph it prints to stderr on failure): replayed on success, dropped on failure,
    which :func:`summarise_export_error` reports instead."""
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held), flex_traceable():
            yield
        sys.stderr.write(held.getvalue())
    finally:
        log.setLevel(level)
