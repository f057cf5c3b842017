"""Sharded loading from safetensors: each rank reads only the slices it keeps.

``load_safetensors(pm, path)`` takes one ``.safetensors`` file or a directory of shards
(HuggingFace's ``model-00001-of-00004.safetensors`` layout). Where the directory has an index
(``model.safetensors.index.json``), the files its ``weight_map`` lists are the checkpoint, as
for ``from_pretrained``: a consolidated file shipped next to the shards is not read, and a
listed file that is missing is an error naming it and a tensor it holds.
Nothing is read until a rank's module is built; then each rank reads its block of every weight
it holds, so a model built on ``meta`` never materialises a full weight and a rank's peak
memory grows with its slice, not the model.

A block is read (unbuffered ``readinto``) straight into a tensor of its own (contiguous, aligned by
torch's allocator): one read per contiguous run of the block in the file (the whole block for a
row slice), or for short runs (a column slice) whole rows 8 MiB at a time, their columns
copied out. Nothing maps the file: safetensors' own
``get_slice`` hands out views into an ``mmap`` of the whole file (one mapping per open, a
column slice strided, the data at the header's offset, not 64-byte aligned), which a weight
would keep mapped, and whose pages a column slice touches whole (counted in RSS)::

    safe_open(...).get_slice(key)[:, 0:8]   a view: stride (16, 1), data_ptr % 64 == 8,
                                            storage: the whole tensor, in the file's mapping
    SafetensorsSource.block(...)            owned: stride (8, 1), aligned, its 8 columns only
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .mesh import MeshSpec
from .placement import Partial, block_pieces

__all__ = ["load_safetensors", "SafetensorsSource"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass
class SafetensorsSource:
    """A weight in a safetensors file, read block by block on demand."""

    file: str
    key: str
    shape: tuple
    dtype: torch.dtype
    reads: list = field(default_factory=list)   # elements read per block() call, for tests
    start: int | None = None    # the byte where its data begins (None: read from the header)
    #: the file's dtype where it is not ``dtype`` (the blocks are cast to ``dtype``, as
    #: ``load_state_dict`` copies an integer tensor into a floating parameter)
    stored: torch.dtype | None = None
    #: every block() is a new tensor of its own (no caller needs to copy it)
    fresh_blocks: ClassVar[bool] = True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def block(self, spec: tuple, mesh: MeshSpec, rank: int, shape: tuple | None = None
              ) -> torch.Tensor:
        """Rank ``rank``'s block under ``spec`` (Partial: whole on coordinate 0, else zeros).
        ``shape``: the global shape ``spec`` splits, where it pads this tensor's (a vocab
        padded for tp: the rows past the file's read as zeros)."""
        t = self._block(spec, mesh, rank, shape)
        return t if self.stored is None else t.to(self.dtype)

    @property
    def _stored(self) -> torch.dtype:
        return self.stored or self.dtype

    def _block(self, spec: tuple, mesh: MeshSpec, rank: int, shape) -> torch.Tensor:
        if shape is not None and tuple(shape) != tuple(self.shape):
            from .placement import padded_block
            t = padded_block(self._read, self.shape, shape, spec, mesh, rank)
            self.reads.append(t.numel())
            return t
        dim, pieces = block_pieces(self.shape, spec, mesh, rank)
        index = pieces[0]
        coords = mesh.coords(rank)
        if any(isinstance(p, Partial) and n > 1 and c != 0
               for n, c, p in zip(mesh.shape, coords, spec)):
            return torch.zeros([s.stop - s.start for s in index], dtype=self._stored,
                               device=self.device)
        if dim is not None:  # a fused weight: this rank's share of every part
            t = torch.cat([self._read(ix) for ix in pieces], dim)
        else:
            t = self._read(index)
        self.reads.append(t.numel())
        return t

    def _read(self, index: tuple) -> torch.Tensor:
        """The block ``index`` (a slice per dim) of the row-major tensor, read into a new
        contiguous tensor: one read per contiguous run."""
        if self.start is None:     # built by hand: the header says where the data begins
            self.start = _data_start(self.file, self.key)
        shape = list(self.shape)
        index = tuple(index) or tuple(slice(0, n) for n in shape)
        size = [s.stop - s.start for s in index]
        out = torch.empty(size, dtype=self._stored, device="cpu")
        if out.numel() == 0:
            return out
        k = len(shape)             # dims k.. are whole: a run spans dim k-1's slice of them
        while k > 0 and index[k - 1] == slice(0, shape[k - 1]):
            k -= 1
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        item = self._stored.itemsize
        run = (size[k - 1] * strides[k - 1] if k else math.prod(shape)) * item
        first = index[k - 1].start * strides[k - 1] if k else 0
        dest = _buffer(out)
        outer = itertools.product(*(range(s.start, s.stop) for s in index[:max(k - 1, 0)]))
        with open(self.file, "rb", buffering=0) as fh:
            if k == 2 and run < _SHORT_RUN:    # short rows (a column slice): whole rows, then
                return self._read_rows(fh, out, index[0], first, run // item, strides[0])
            for i, idx in enumerate(outer):
                fh.seek(self.start + (first + sum(j * s for j, s in zip(idx, strides))) * item)
                _read_into(fh, dest[i * run:(i + 1) * run], self)
        return out

    def _read_rows(self, fh, out: torch.Tensor, rows: slice, first: int, width: int,
                   row: int) -> torch.Tensor:
        """``out`` (rows ``rows``, each ``width`` elements from ``first`` of a ``row``-element
        row) read as whole rows, ``_CHUNK`` bytes at a time, its columns copied out: one read per
        chunk instead of one per row."""
        item = self._stored.itemsize
        n = max(1, _CHUNK // (row * item))
        bounce = torch.empty(min(n, rows.stop - rows.start), row, dtype=self._stored,
                             device="cpu")
        flat = out.view(rows.stop - rows.start, width)
        for r in range(rows.start, rows.stop, n):
            c = min(n, rows.stop - r)
            fh.seek(self.start + r * row * item)
            _read_into(fh, _buffer(bounce)[:c * row * item], self)
            flat[r - rows.start:r - rows.start + c].copy_(bounce[:c, first:first + width])
        return out


_SHORT_RUN = 64 << 10    # bytes: a block whose runs are shorter is read as whole rows
_CHUNK = 8 << 20         # bytes of whole rows read at a time then


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t``, writable."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def _read_into(fh, buf: memoryview, src: SafetensorsSource) -> None:
    while len(buf):
        n = fh.readinto(buf)
        if not n:
            raise ValueError(f"{_WHERE}: {src.file} ended while reading {src.key!r} (byte "
                             f"{fh.tell()}); the file is truncated: re-download or re-save it")
        buf = buf[n:]


def _data_start(file: str, key: str) -> int:
    """The byte in ``file`` where tensor ``key``'s data begins."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
    return 8 + n + _header(file)[key]["data_offsets"][0]


_WHERE = "fxshard.load_safetensors"
INDEX = "model.safetensors.index.json"


def _files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The files to read and, for a directory with an index, its ``weight_map`` (key -> file):
    as ``from_pretrained`` does, the index decides which files are the checkpoint (a stray
    consolidated file next to the shards is not read)."""
    if os.path.isdir(path):
        index = _index_file(path)
        if index is not None:
            return _indexed_files(path, index)
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{_WHERE}: no .safetensors files in {path}")
        return files, None
    if not os.path.exists(path):
        raise ValueError(f"{_WHERE}: {path} does not exist; pass a "
                         f".safetensors file or a directory of shards")
    if path.endswith(".index.json"):
        return _indexed_files(os.path.dirname(path) or ".", path)
    return [path], None


def _index_file(directory: str) -> str | None:
    names = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors.index.json"))
    if INDEX in names:
        return os.path.join(directory, INDEX)
    if len(names) > 1:
        raise ValueError(f"{_WHERE}: {directory} holds several indexes {names}; pass the one "
                         f"to load (its path) instead of the directory")
    return os.path.join(directory, names[0]) if names else None


def _indexed_files(directory: str, index: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{_WHERE}: cannot read the index {index} ({e}); re-download it, or "
                         f"delete it to load every .safetensors file in {directory}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{_WHERE}: the index {index} has no \"weight_map\" of tensor name -> "
                         f"file name; re-download it")
    files = {k: os.path.join(directory, v) for k, v in weight_map.items()}
    for file in sorted(set(files.values())):
        if not os.path.isfile(file):
            key = next(k for k, v in files.items() if v == file)
            raise ValueError(f"{_WHERE}: {file} is listed in {index} (it holds {key!r} and "
                             f"{sum(v == file for v in files.values()) - 1} more tensors) but "
                             f"does not exist; download it (the checkpoint is incomplete)")
    return sorted(set(files.values())), files


def _header(file: str) -> dict:
    """The JSON header of a safetensors file, checked against the file's size."""
    where = "fxshard.load_safetensors"
    size = os.path.getsize(file)
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{where}: {file} is not a safetensors file or is truncated: its "
                             f"{size} bytes cannot hold the header it announces; re-download "
                             f"or re-save the checkpoint")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {file} has a corrupt header ({e}); re-download or re-save "
                         f"the checkpoint") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: {file} has a header that is not a JSON object; re-download "
                         f"or re-save the checkpoint")
    data = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        bad = _bad_entry(info, data)
        if bad:
            raise ValueError(f"{where}: tensor {key!r} in {file} {bad}; the file is corrupt, "
                             f"truncated or not written by safetensors: re-download or "
                             f"re-save it")
    return header


def _bad_entry(info, data: int) -> str | None:
    """Why a header entry cannot be read from a data section of ``data`` bytes, or None."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return "lacks one of dtype, shape, data_offsets"
    if info["dtype"] not in _DTYPES:
        return (f"has dtype {info['dtype']!r}, which fxshard cannot read (supported: "
                f"{', '.join(_DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    nbytes = math.prod(shape) * _DTYPES[info["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        return (f"takes {offsets[1] - offsets[0]} bytes but shape {shape} of "
                f"{info['dtype']} needs {nbytes}")
    if offsets[1] > data:
        return f"ends at byte {offsets[1]} of a data section of {data} bytes"
    return None


def sources(path: str) -> dict[str, SafetensorsSource]:
    """Every tensor of the checkpoint at ``path`` as a lazy source (headers only are read;
    each is checked against its file's size, so a corrupt or truncated file fails here,
    naming the file and the tensor, not at the first forward)."""
    out: dict[str, SafetensorsSource] = {}
    files, weight_map = _files(path)
    for file in files:
        header = _header(file)
        with open(file, "rb") as fh:
            data = 8 + int.from_bytes(fh.read(8), "little")
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in out:
                raise ValueError(f"{_WHERE}: {key!r} appears in both "
                                 f"{out[key].file} and {file}")
            out[key] = SafetensorsSource(file, key, tuple(info["shape"]), _DTYPES[info["dtype"]],
                                         start=data + info["data_offsets"][0])
    for key, file in (weight_map or {}).items():
        if key not in out or out[key].file != file:
            where = "that file does not hold it" if key not in out else f"it is in {out[key].file}"
            raise ValueError(f"{_WHERE}: the index lists {key!r} in {file}, but {where}; the "
                             f"index and the files disagree: re-download the checkpoint")
    return out


def load_safetensors(pm, path: str) -> None:
    """Load the unsharded checkpoint at ``path`` into ``pm``; every rank reads only its slices.

    A tensor stored as an integer for a floating parameter (or the other way round) is cast to
    the parameter's dtype, as ``model.load_state_dict`` does. Tied weights saved once (``lm_head.weight`` absent while ``model.embed_tokens.weight`` is
    present, as HuggingFace saves tied models) are filled from their twin.
    """
    src = sources(path)
    for name, twins in pm.tied_names().items():
        for t in twins:
            if t not in src and name in src:
                src[t] = src[name]
    # under a mixed-precision policy the masters keep the model's dtype (bf16 files too)
    masters = getattr(getattr(pm, "options", None), "mixed_precision", None) is not None
    _cast_as_parameters(src, getattr(getattr(pm, "weights", None), "expected", {}), masters)
    pm.load_state_dict(src)


def _cast_as_parameters(src: dict, expected: dict, masters: bool = False) -> None:
    """A tensor stored as an integer (or bool) for a floating weight, or the other way round,
    is read as the model's dtype: what ``model.load_state_dict`` does on one device (it copies
    into the parameter). Floating dtypes are left as stored, as before, except for the
    ``masters`` of a mixed-precision policy: read as the model's dtype (fp32 from bf16)."""
    for name, s in src.items():
        want = expected.get(name, (None, None))[1]
        if want is not None and s.stored is None and s.dtype != want and \
                (s.dtype.is_floating_point != want.is_floating_point or
                 masters and s.dtype.is_floating_point):
            src[name] = dataclasses.replace(s, dtype=want, stored=s.dtype, reads=[])
