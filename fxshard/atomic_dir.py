"""Checkpoint directories replaced whole: the new one written beside the old, then switched.

::

    with replacing(directory, where="fxshard.save_safetensors", owned=is_weights,
                   rank=None) as stage:            # rank: None (one process), else its rank
        with stage.file("model-00001-of-00002.safetensors") as fh:  # in the temporary sibling
            fh.write(data)                         # a failed write is kept, not raised here
    # here ``directory`` is the new checkpoint; before, the old one, untouched

On disk, saving to ``out/ckpt``::

    out/.ckpt.fxshard-new/   the new checkpoint, written by every rank (made empty first)
    out/ckpt/                the old one: read, never written, until the new one is complete

The switch (one process: rank 0, after every rank reported its part written): the files of
the old directory that are not checkpoint files (``owned`` says which are: a tokenizer or a
README is not) are hard-linked (else copied) into the new one, unless the new save wrote
them; then the two directories are exchanged (``renameat2(RENAME_EXCHANGE)`` on Linux: one
step; elsewhere two renames, the old one parked at ``out/.ckpt.fxshard-old`` until the new
one is in place, put back by the next save if a crash fell between them) and the old one is
removed. So no checkpoint file of an older save survives beside the new one (an HF
``model.safetensors`` beside a new sharded index, ``__3_0.distcp`` of a save on more ranks).

A write that fails (``ENOSPC`` on the second shard) is kept by ``stage`` and the rank goes on
with the save's collectives without writing (its peers are not left waiting); at the end the
ranks exchange what failed (one object all-gather), the temporary directory is removed, the
old checkpoint is left as it was, and every rank raises an ordinary exception: the failing
rank an ``OSError`` (same errno) or ``RuntimeError`` naming the file, chained to the cause;
the others a ``RuntimeError`` naming that rank and its error.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys

__all__ = ["replacing", "Stage"]


class Stage:
    """The temporary directory of a save in progress, and the first write that failed."""

    def __init__(self, where: str, final: str, path: str):
        self.where, self.final, self.path = where, final, path
        self.error: BaseException | None = None
        self.failed_file: str | None = None
        self.doing = "writing"

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def fail(self, exc: BaseException, name: str, doing: str = "writing") -> None:
        """Keep the first failure (the file ``name`` of the checkpoint it was writing)."""
        if self.error is None:
            self.error, self.failed_file, self.doing = exc, name, doing

    @contextlib.contextmanager
    def file(self, name: str):
        """An open binary file ``name`` in the temporary directory, whose failures are kept
        (yields a sink that discards writes once anything failed)."""
        sink = _Sink(self, name)
        try:
            if self.error is None:
                try:
                    sink.fh = open(self.join(name), "wb")
                except OSError as e:     # kept too: the rank goes on with the collectives
                    self.fail(e, name)
            yield sink
        finally:
            sink.close()

    def message(self) -> str:
        return (f"{self.where}: {self.doing} {self.failed_file} of the checkpoint {self.final} "
                f"failed ({type(self.error).__name__}: {self.error}); nothing was replaced: "
                f"{self.final} holds what it held before the save. Free space or fix the "
                f"cause, then save again")


class _Sink:
    def __init__(self, stage: Stage, name: str):
        self.stage, self.name, self.fh = stage, name, None

    def write(self, data) -> None:
        if self.fh is None:
            return
        try:
            self.fh.write(data)
        except Exception as e:     # noqa: BLE001 - kept, raised once every rank is done
            self.stage.fail(e, self.name)
            self.close()

    def close(self) -> None:
        fh, self.fh = self.fh, None
        if fh is not None:
            try:
                fh.close()
            except Exception as e:   # noqa: BLE001 - a flush that fails (ENOSPC) is a failure
                self.stage.fail(e, self.name)


def _sibling(final: str, kind: str) -> str:
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}.fxshard-{kind}")


def _check_target(final: str, where: str) -> None:
    cwd = os.getcwd()
    if cwd == final or cwd.startswith(final + os.sep):
        raise ValueError(f"{where}: the checkpoint directory {final} is (or holds) the working "
                         f"directory; a checkpoint directory is replaced whole when saved. "
                         f"Pass a subdirectory, e.g. {os.path.join(final, 'checkpoint')!r}")
    if os.path.exists(final) and not os.path.isdir(final):
        raise ValueError(f"{where}: {final} exists and is not a directory; pass a directory "
                         f"path (the checkpoint is a directory of files)")


def _prepare(final: str, new: str) -> None:
    """Rank 0: an empty temporary directory; a switch that a crash interrupted undone."""
    old = _sibling(final, "old")
    if os.path.isdir(old):
        if os.path.exists(final):
            shutil.rmtree(old)
        else:                        # crashed between the two renames: the old one back
            os.rename(old, final)
    if os.path.lexists(new):
        shutil.rmtree(new) if os.path.isdir(new) and not os.path.islink(new) else os.remove(new)
    os.makedirs(new)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _switch(final: str, new: str, owned) -> None:
    """Rank 0: ``new`` (complete) becomes ``final``; the old one's other files carried over."""
    if not os.path.exists(final):
        os.rename(new, final)
        return
    for name in os.listdir(final):
        if not owned(name) and not os.path.lexists(os.path.join(new, name)):
            _carry(os.path.join(final, name), os.path.join(new, name))
    if _exchange(new, final):
        shutil.rmtree(new, ignore_errors=True)   # (the old checkpoint, at the temporary name)
        return
    old = _sibling(final, "old")
    os.rename(final, old)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _gather(rank, value) -> list:
    """Every rank's ``value`` (one process: just its own)."""
    if rank is None:
        return [value]
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _settle(stage: Stage, rank, what: str) -> None:
    """Every rank raises if any failed (the failing one its own error, chained)."""
    mine = None if stage.error is None else stage.message()
    told = _gather(rank, mine)
    if mine is not None:
        cls = OSError if isinstance(stage.error, OSError) else RuntimeError
        err = cls(stage.error.errno, mine) if cls is OSError and stage.error.errno else cls(mine)
        raise err from stage.error
    for rank, text in enumerate(told):
        if text is not None:
            raise RuntimeError(f"{stage.where}: rank {rank} failed {what}, so no rank replaced "
                               f"the checkpoint: {text}")


@contextlib.contextmanager
def replacing(directory: str, *, where: str, owned, rank: int | None = None):
    """Write a checkpoint into a temporary sibling of ``directory`` (the yielded
    :class:`Stage`), then switch it in (see the module docstring). ``owned(name)``: whether a
    file of the old directory is a checkpoint file (left out of the new one). ``rank``:
    None on one process; otherwise this process's rank in the default process group, every
    rank of which calls this (rank 0 prepares and switches)."""
    final = os.path.realpath(directory)
    _check_target(final, where)
    new = _sibling(final, "new")
    stage = Stage(where, final, new)
    lead = rank is None or rank == 0
    if lead:
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            _prepare(final, new)
        except OSError as e:
            stage.fail(e, os.path.basename(new), "making the temporary directory")
    _settle(stage, rank, "to make the temporary directory")
    try:
        yield stage
    except Exception as e:     # a failure that did not stop the other ranks' collectives
        stage.fail(e, stage.failed_file or "?")
    try:
        _settle(stage, rank, "to write its part")
    except Exception:
        if lead:
            shutil.rmtree(new, ignore_errors=True)
        raise
    if lead:
        try:
            _switch(final, new, owned)
        except OSError as e:
            stage.fail(e, os.path.basename(final), "switching in the new")
    _settle(stage, rank, "to switch the new checkpoint in")
