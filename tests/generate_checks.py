"""``pm.generate`` on real ranks against HuggingFace ``generate``: the case each rank runs
inside the multi-process launches of ``tests/test_e2e_distributed.py`` (2 processes: tp=2;
4 processes: tp=2 x pp=2 with ``microbatches=2``, where greedy decode pipelines the two groups
of sequences across steps and the last stage sends each group's tokens back, and sampling
shares the logits back once per step), and the checks on the ranks' reports. Riding on those launches costs only
the generation itself, not another process start, gloo rendezvous and transformers import.

Every rank builds the same tiny HuggingFace Llama and prompt and runs, in order:

* greedy: ``pm.generate(ids, max_new_tokens=NEW)`` must equal HF's
  ``model.generate(ids, do_sample=False, max_new_tokens=NEW)`` in the same process, token for
  token (HF's eos id and its pad default given to both);
* sampling with a generator, ``generator=torch.Generator().manual_seed(SEED)``: the tokens
  must be the same on every rank (the test compares the ranks' reports);
* sampling from the global RNG, seeded differently on every rank: the token chosen on mesh
  rank 0 is broadcast, so every rank must return rank 0's tokens - which equal HF's
  ``generate(do_sample=True, top_k=TOP_K)`` after the same ``torch.manual_seed`` as rank 0's
  (the same processors in the same order, the same ``torch.multinomial`` draw).
"""
from __future__ import annotations

import time

import torch

BATCH, PROMPT, NEW, VOCAB = 4, 7, 6, 128   # a prompt of 7: not a multiple of any axis size
SEED, TOP_K = 11, 20


def generate_case(rank: int, shape, names) -> dict:
    """This rank's tokens for the three runs above, and HF's, as lists."""
    import fxshard
    from tests.models import hf_llama
    start = time.monotonic()
    model = hf_llama(layers=2, vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    microbatches = 2 if "pp" in names else 1
    pm = fxshard.parallelize(model, mesh, microbatches=microbatches)
    eos = model.generation_config.eos_token_id
    ones = torch.ones_like(ids)
    out = {}
    with torch.no_grad():
        out["greedy"] = pm.generate(ids, max_new_tokens=NEW, eos_token_id=eos).tolist()
        out["greedy_hf"] = model.generate(ids, do_sample=False, max_new_tokens=NEW,
                                          attention_mask=ones).tolist()
        out["seeded"] = pm.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=TOP_K,
                                    generator=torch.Generator().manual_seed(SEED)).tolist()
        torch.manual_seed(100 + rank)   # every rank's global RNG differs
        out["global_rng"] = pm.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=TOP_K,
                                        eos_token_id=eos).tolist()
        torch.manual_seed(100)          # rank 0's seed: the tokens every rank must return
        out["global_rng_hf"] = model.generate(ids, do_sample=True, top_k=TOP_K, top_p=1.0,
                                              temperature=1.0, max_new_tokens=NEW,
                                              attention_mask=ones).tolist()
    out["modules_built"] = sorted(pm.programs.last.modules)
    out["microbatches"] = microbatches
    out["seconds"] = round(time.monotonic() - start, 2)
    pm.close()
    return out


def check_greedy(reports: dict, job: str) -> None:
    for r, rep in reports.items():
        case = rep["generate"]
        assert case["modules_built"] == [r], (job, r, case["modules_built"])
        assert case["microbatches"] == (2 if job == "four" else 1), (job, r)
        assert torch.tensor(case["greedy"]).shape == (BATCH, PROMPT + NEW)
        assert case["greedy"] == case["greedy_hf"], (job, r, case["greedy"], case["greedy_hf"])


def check_sampling(reports: dict, job: str) -> None:
    seeded = {r: rep["generate"]["seeded"] for r, rep in reports.items()}
    assert all(s == seeded[0] for s in seeded.values()), (job, seeded)
    assert torch.tensor(seeded[0]).shape == (BATCH, PROMPT + NEW)
    assert seeded[0] != reports[0]["generate"]["greedy"], job  # sampled, not greedy
    want = reports[0]["generate"]["global_rng_hf"]
    for r, rep in reports.items():
        assert rep["generate"]["global_rng"] == want, (job, r, rep["generate"]["global_rng"],
                                                       want)
