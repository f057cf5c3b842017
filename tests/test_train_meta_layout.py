"""A meta-built model loaded from safetensors holds its weights as the plain path does: every
rank's block owned (its storage is exactly its bytes), contiguous, 64-byte aligned, and no view
into the checkpoint's file mapping (safetensors' ``get_slice`` returns views into an ``mmap``
of the whole file: one mapping per block, misaligned, strided for a column slice) — for the
inference rank modules, the training shards, their gradients and AdamW's state."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

import fxshard
from fxshard.checkpoint import SafetensorsSource, sources
from tests.models import our_llama

GRAD = True
SIZES = dict(num_hidden_layers=1, vocab_size=70, hidden_size=40, intermediate_size=56,
             num_attention_heads=4, num_key_value_heads=2)


def _mapped(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((a, b))
    return out


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.stride()


def _check_owned(name: str, t: torch.Tensor, path: str) -> None:
    s = t.untyped_storage()
    assert t.is_contiguous() and t.storage_offset() == 0, (name, t.stride())
    assert s.nbytes() == t.numel() * t.element_size(), (name, s.nbytes())
    assert t.data_ptr() % 64 == 0, (name, t.data_ptr() % 64)
    assert not any(a <= t.data_ptr() < b for a, b in _mapped(path)), name


def test_meta_built_blocks_are_owned_contiguous_aligned(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in our_llama(**SIZES).state_dict().items()}, path)
    mesh = fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 70, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = fxshard.parallelize(our_llama(**SIZES).train(), mesh, example_inputs=(ids,))
    with fxshard.init_empty_weights():
        empty = our_llama(**SIZES)
    meta = fxshard.parallelize(empty.train(), mesh, example_inputs=(ids,))
    fxshard.load_safetensors(meta, path)

    with torch.no_grad():          # inference: the rank modules' blocks
        torch.testing.assert_close(meta(ids), plain(ids), rtol=1e-5, atol=1e-5)
        for r in range(2):
            for name, t in meta.rank_module(r).state_dict().items():
                _check_owned(name, t, path)
    assert not _mapped(path)       # nothing keeps the file mapped

    opts = {}
    for pm in (plain, meta):       # training: shards, gradients, AdamW state
        opts[pm] = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
        for _ in range(2):
            opts[pm].zero_grad(set_to_none=False)
            F.cross_entropy(pm(ids).flatten(0, 1), ids.flatten()).backward()
            opts[pm].step()
    for r in range(2):
        mine, theirs = meta.shards(r), plain.shards(r)
        assert set(mine) == set(theirs)
        for name, p in mine.items():
            state = opts[meta].state[p]
            for what, t in [("param", p), ("grad", p.grad),
                            *((k, v) for k, v in state.items() if v.dim())]:
                _check_owned(f"rank {r} {name} {what}", t, path)
            assert _layout(p) == _layout(theirs[name]), name
            assert _layout(p.grad) == _layout(theirs[name].grad), name
            torch.testing.assert_close(p.detach(), theirs[name].detach(), rtol=1e-5, atol=1e-5)
    assert not _mapped(path)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64,
                                              torch.bool]),
       shape=st.lists(st.integers(1, 5), min_size=0, max_size=4))
def test_blocks_read_by_runs_equal_slices(tmp_path_factory, data, dtype, shape):
    """Any block of any tensor, read run by run from the file, is the tensor's slice."""
    whole = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 9).to(dtype)
    path = str(tmp_path_factory.mktemp("st") / "t.safetensors")
    save_file({"a": torch.ones(3), "t": whole}, path)
    index = []
    for n in shape:
        a = data.draw(st.integers(0, n))
        index.append(slice(a, data.draw(st.integers(a, n))))
    for src in (sources(path)["t"], SafetensorsSource(path, "t", tuple(shape), dtype)):
        got = src._read(tuple(index))
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, whole[tuple(index)]), (shape, index)
