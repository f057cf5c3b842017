"""Sharded loading from safetensors: each rank reads only the slices it keeps.

``load_safetensors(pm, path)`` takes one ``.safetensors`` file or a directory of shards
(HuggingFace's ``model-00001-of-00004.safetensors`` layout, with or without its index JSON).
Nothing is read until a rank's module is built; then ``safe_open(...).get_slice(name)[...]``
reads that rank's block of every weight it holds, so a model built on ``meta`` never
materialises a full weight and a rank's peak memory grows with its slice, not the model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from .mesh import MeshSpec
from .placement import Partial, block_pieces

__all__ = ["load_safetensors", "SafetensorsSource"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass
class SafetensorsSource:
    """A weight in a safetensors file, read block by block on demand."""

    file: str
    key: str
    shape: tuple
    dtype: torch.dtype
    reads: list = field(default_factory=list)   # elements read per block() call, for tests

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def block(self, spec: tuple, mesh: MeshSpec, rank: int) -> torch.Tensor:
        """Rank ``rank``'s block under ``spec`` (Partial: whole on coordinate 0, else zeros)."""
        from safetensors import safe_open
        dim, pieces = block_pieces(self.shape, spec, mesh, rank)
        index = pieces[0]
        coords = mesh.coords(rank)
        if any(isinstance(p, Partial) and n > 1 and c != 0
               for n, c, p in zip(mesh.shape, coords, spec)):
            return torch.zeros([s.stop - s.start for s in index], dtype=self.dtype,
                               device=self.device)
        with safe_open(self.file, framework="pt") as f:
            if dim is not None:  # a fused weight: this rank's share of every part
                t = torch.cat([f.get_slice(self.key)[ix] for ix in pieces], dim)
            else:
                t = f.get_slice(self.key)[index] if index else f.get_tensor(self.key)
        self.reads.append(t.numel())
        return t


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"fxshard.load_safetensors: no .safetensors files in {path}")
        return files
    if not os.path.exists(path):
        raise ValueError(f"fxshard.load_safetensors: {path} does not exist; pass a "
                         f".safetensors file or a directory of shards")
    return [path]


def sources(path: str) -> dict[str, SafetensorsSource]:
    """Every tensor of the checkpoint at ``path`` as a lazy source (headers only are read)."""
    out: dict[str, SafetensorsSource] = {}
    for file in _files(path):
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in out:
                raise ValueError(f"fxshard.load_safetensors: {key!r} appears in both "
                                 f"{out[key].file} and {file}")
            out[key] = SafetensorsSource(file, key, tuple(info["shape"]), _DTYPES[info["dtype"]])
    return out


def load_safetensors(pm, path: str) -> None:
    """Load the unsharded checkpoint at ``path`` into ``pm``; every rank reads only its slices.

    Tied weights saved once (``lm_head.weight`` absent while ``model.embed_tokens.weight`` is
    present, as HuggingFace saves tied models) are filled from their twin.
    """
    src = sources(path)
    for name, twins in pm.tied_names().items():
        for t in twins:
            if t not in src and name in src:
                src[t] = src[name]
    pm.load_state_dict(src)
