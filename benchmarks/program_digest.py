"""A sha256 of every rank program fxshard builds, per (family, mesh, mode): the check that a
refactor changed no program (run it on two trees, compare the lines).

::

    PYTHONPATH=/tmp/base python benchmarks/program_digest.py > before.txt
    python benchmarks/program_digest.py > after.txt && diff before.txt after.txt

Inference hashes ``pm.rank_module(r).code`` of every rank; training (``pm(x)`` with grad;
on a Llama also ``labels=`` and ``pm.train_step(loss_fn=)``, the loss inside) hashes the ``"forward"`` and ``"backward"``
programs of every rank. A combination fxshard refuses prints the error's type and a hash of
its message instead, so a changed refusal shows too. Tiny random models (hidden 64, vocab 128,
2 layers); the first line names the fxshard package imported.
"""
from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))   # after PYTHONPATH: a base tree wins
import fxshard  # noqa: E402

VOCAB, B, S = 128, 2, 8


def _hf(cls_name: str, cfg_name: str, **kw):
    import transformers as T
    cfg = getattr(T, cfg_name)(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(T, cls_name)(cfg).eval()


def _common(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)


FAMILIES = {
    "llama": lambda: _hf("LlamaForCausalLM", "LlamaConfig", intermediate_size=96,
                         num_key_value_heads=2, **_common()),
    "llama_tied": lambda: _hf("LlamaForCausalLM", "LlamaConfig", intermediate_size=96,
                              num_key_value_heads=2, tie_word_embeddings=True, **_common()),
    "gpt2": lambda: _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=64,
                        n_layer=2, n_head=4, n_positions=64, use_cache=False, bos_token_id=1,
                        eos_token_id=2),
    "mixtral": lambda: _hf("MixtralForCausalLM", "MixtralConfig", intermediate_size=64,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           **_common()),
}

# name -> (axes, parallelize options)
MESHES = {
    "tp2": ({"tp": 2}, {}),
    "fsdp2.tp2+sp": ({"fsdp": 2, "tp": 2}, {"sequence_parallel": True}),
    "pp2": ({"pp": 2}, {"microbatches": 2}),
    "dp2.ring_cp2": ({"dp": 2, "ring_cp": 2}, {}),
    "ulysses_cp2": ({"ulysses_cp": 2}, {}),
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _parallelize(model, axes: dict, options: dict):
    mesh = fxshard.init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    return fxshard.parallelize(model, mesh, **options), mesh.world_size


def _inference(model, ids, axes, options) -> str:
    pm, world = _parallelize(model, axes, options)
    try:
        with torch.no_grad():
            pm(ids)
        return " ".join(_sha(pm.rank_module(r).code) for r in range(world))
    finally:
        pm.close()


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _training(model, ids, axes, options, how: str) -> str:
    pm, world = _parallelize(model, axes, options)
    try:
        with torch.enable_grad():
            if how == "labels":
                pm(ids, labels=ids)
            elif how == "train_step":
                pm.train_step(ids, loss_fn=lambda out, t: _loss(out.logits, t), target=ids)
            else:
                pm(ids)
        return " ".join(f"{which[0]}{r}={_sha(pm.rank_module(r, which).code)}"
                        for which in ("forward", "backward") for r in range(world))
    finally:
        pm.close()


def _line(fn, *args) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except Exception as e:  # noqa: BLE001  (a refusal is a result too)
        print(f"refused: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return f"refused {type(e).__name__} {_sha(str(e))}"


def main() -> None:
    torch.set_num_threads(1)
    print(f"# fxshard from {Path(fxshard.__file__).resolve().parent}", flush=True)
    ids = torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    for family, build in FAMILIES.items():
        for mesh_name, (axes, options) in MESHES.items():
            modes = {"infer": lambda: _inference(build(), ids, axes, options),
                     "train": lambda: _training(build().train(), ids, axes, options, "")}
            if family == "llama":
                for how in ("labels", "train_step"):
                    modes[f"train_{how}"] = lambda how=how: _training(build().train(), ids, axes,
                                                                      options, how)
            for mode, fn in modes.items():
                print(f"{family} {mesh_name} {mode} {_line(fn)}", flush=True)


if __name__ == "__main__":
    main()
