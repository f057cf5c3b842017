"""generate's limits: KV caches checked against the memory at hand before they are allocated,
``eos_token_id`` / ``pad_token_id`` given as tensors (as HuggingFace accepts them)."""
from __future__ import annotations

import re

import pytest
import torch

import fxshard
from fxshard.runtime import memory
from tests.models import our_llama


def _pm(mesh=(2,), names=("tp",), **config):
    model = our_llama(num_hidden_layers=1, **config)
    model.config.max_position_embeddings = None  # nothing else bounds the cache
    return fxshard.parallelize(model, fxshard.init_device_mesh("cpu", mesh,
                                                               mesh_dim_names=names))


def test_a_cache_larger_than_memory_is_an_error_saying_what_fits():
    pm = _pm()
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ValueError, match=r"ParallelModule.generate: the KV caches for "
                                         r"max_new_tokens=1000000000 .* need [\d.]+ [GT]B, but "
                                         r"[\d.]+ [GM]B is available on cpu .*the largest "
                                         r"max_new_tokens that fits is \d+"):
        pm.generate(ids, max_new_tokens=10**9)
    assert pm.executor.kv_caches is None  # nothing was allocated
    pm.close()


@pytest.mark.parametrize("mesh,names", [((2,), ("tp",)), ((2,), ("ring_cp",))])
def test_the_largest_max_new_tokens_said_to_fit_does_fit(monkeypatch, mesh, names):
    pm = _pm(mesh, names)
    ids = torch.randint(0, 128, (2, 8))
    # 2 ranks x 2 caches (K, V) x batch 2 x 1 KV head per rank x head dim 16 x fp32 per
    # position (tp); ring_cp: 2 KV heads per rank
    per_position = 2 * 2 * 2 * (1 if names == ("tp",) else 2) * 16 * 4
    monkeypatch.setattr(memory, "available_bytes",
                        lambda device: (per_position * 200, "test"))
    with pytest.raises(ValueError, match=r"the largest max_new_tokens that fits is (\d+)") as e:
        pm.generate(ids, max_new_tokens=1000)
    largest = int(re.search(r"fits is (\d+)", str(e.value)).group(1))
    assert largest > 1
    out = pm.generate(ids, max_new_tokens=largest)  # fits: no error
    assert out.shape == (2, 8 + largest)
    with pytest.raises(ValueError, match="the largest max_new_tokens"):
        pm.generate(ids, max_new_tokens=largest + 1)
    pm.close()


def test_nothing_fits_says_so(monkeypatch):
    pm = _pm()
    monkeypatch.setattr(memory, "available_bytes", lambda device: (10, "test"))
    with pytest.raises(ValueError, match=r"not even max_new_tokens=1 fits"):
        pm.generate(torch.randint(0, 128, (2, 8)), max_new_tokens=4)
    pm.close()


def test_available_bytes_of_this_machine():
    have, source = memory.available_bytes(torch.device("cpu"))
    assert have > 0 and source


@pytest.mark.parametrize("eos", [torch.tensor(5), torch.tensor([5, 9]), torch.tensor([5])])
def test_eos_token_id_as_a_tensor_is_the_ids_it_holds(eos):
    torch.manual_seed(0)
    model = our_llama(num_hidden_layers=1)
    pm = fxshard.parallelize(model, fxshard.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    ids = torch.randint(0, 128, (2, 6))
    plain = pm.generate(ids, max_new_tokens=6)
    # make the first new token of sequence 0 an eos id, so that eos changes the output
    first = int(plain[0, 6])
    ids_list = [first] + ([9] if eos.numel() > 1 else [])
    eos = torch.tensor(first) if eos.dim() == 0 else torch.tensor(ids_list)
    want = pm.generate(ids, max_new_tokens=6, eos_token_id=eos.tolist(), pad_token_id=0)
    got = pm.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=torch.tensor(0))
    assert torch.equal(got, want)
    assert (want[0, 7:] == 0).all()  # padded after the eos
    with pytest.raises(ValueError, match="must be token ids"):
        pm.generate(ids, max_new_tokens=2, eos_token_id=torch.tensor(0.5))
    pm.close()
