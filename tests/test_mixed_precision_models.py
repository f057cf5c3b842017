"""HuggingFace families under ``torch.autocast`` and a mixed-precision policy: inference and
greedy generation as one device's autocast, training with ``labels=`` no further from
float64 than one device's autocast; pipeline training under the policy."""
from __future__ import annotations

import copy

import pytest
import torch

import fxshard
from tests.families import gpt2, mixtral
from tests.mixed_reference import PolicyReference, close_to_float64
from tests.models import hf_llama
from tests.test_mixed_precision import BF16, _loss_of, _mesh

GRAD = True


def qwen2(layers: int):
    import transformers as T
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return T.Qwen2ForCausalLM(cfg).eval()


def _prompt(batch=2, seq=8, vocab=128):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family,axes", [
    ("llama", {"tp": 2}), ("qwen2", {"dp": 2, "tp": 2}), ("gpt2", {"tp": 2}),
    ("mixtral", {"dp": 2})])
def test_hf_under_autocast(family, axes):
    """Under ``torch.autocast(cpu, bf16)``: logits no further from float64 than one device's
    autocast logits, the same greedy tokens as HF's ``generate`` under it, and (grad on)
    the ``labels=`` loss and its gradients no further from float64; fp32 again outside."""
    build = {"llama": lambda n: hf_llama(layers=n), "qwen2": qwen2, "gpt2": gpt2,
             "mixtral": mixtral}[family]
    model, ids = build(1), _prompt()
    # Mixtral's experts run torch._grouped_mm, which has no float64: its fp32 run stands for
    # the exact one (bf16's rounding is 2**16 times fp32's)
    exact = copy.deepcopy(model).to(torch.float32 if family == "mixtral" else torch.float64)
    pm = fxshard.parallelize(model, _mesh(axes))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = pm(ids).logits, model(ids).logits
            tokens = pm.generate(ids, max_new_tokens=4)
            greedy = model.generate(ids, max_new_tokens=4, do_sample=False,
                                    pad_token_id=0, use_cache=True)
        assert got.dtype == want.dtype == torch.bfloat16
        close_to_float64(got, want, exact(ids).logits, f"{family} logits")
        assert torch.equal(tokens, greedy), (tokens, greedy)
        assert pm(ids).logits.dtype == torch.float32
    if family == "mixtral":
        return
    model.train(), pm.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, want = pm(ids, labels=ids).loss, model(ids, labels=ids).loss
    loss.backward()
    want.backward()
    want64 = exact.train()(ids, labels=ids).loss
    want64.backward()
    close_to_float64(loss, want, want64, f"{family} loss")
    grads = pm.gradients()
    for name, p in exact.named_parameters():
        close_to_float64(grads[name], model.get_parameter(name).grad, p.grad, name)


def test_pipeline_under_the_policy():
    """pp2.tp2, 1F1B over 2 microbatches under bf16/fp32: the loss and every gradient no
    further from float64 than the policy applied by hand; fp32 gradients on the shards."""
    from tests.test_train_grads import _llama, _loss
    from tests.test_mixed_precision import _ids
    model, (ids, labels) = _llama(layers=2), _ids()
    pm = fxshard.parallelize(copy.deepcopy(model), _mesh({"pp": 2, "tp": 2}),
                             mixed_precision=BF16, microbatches=2)
    loss = pm.train_step(ids, loss_fn=lambda o, t: _loss(o.float(), t), target=labels,
                         schedule="1f1b")
    ref = PolicyReference(model, BF16)
    want = _loss_of(ids, labels)(ref.working(), None)
    want.backward()
    ref.grads_to_masters()
    exact = copy.deepcopy(model).double()
    want64 = _loss_of(ids, labels)(exact, torch.float64)
    want64.backward()
    close_to_float64(loss, want, want64, "pp loss")
    grads = pm.gradients()
    for name, p in exact.named_parameters():
        assert grads[name].dtype == torch.float32, name
        close_to_float64(grads[name], ref.masters.get_parameter(name).grad, p.grad, name)
