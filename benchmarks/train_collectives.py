"""What training's backward moves over tp, per HF family and mesh: counts and bytes.

For the training models of ``tests/test_train_models.py`` (tiny random configs, no downloads:
GPT-2 with its Conv1D and tied table, also with a vocab of 91 that tp=2 cannot split; Phi-3,
Mixtral, Qwen2, Qwen3, Mistral) and HF Llama with a tied vocab of 97, on tp=2, tp=2 with
sequence parallelism and fsdp=2*tp=2: one forward and backward, then, in rank 0's backward
program, every tp collective by kind, the wire bytes they move per step, and how many of them
move a weight (a weight changing layout in the backward is the sign of a plan that is not
Megatron's: 0 is the expected count). Gradients are checked against one device (max error).

    python benchmarks/train_collectives.py            # ~1 minute on 2 CPU cores
    python benchmarks/train_collectives.py gpt2 qwen3 # only these models
"""
from __future__ import annotations

import collections
import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, format_table, reproduce  # noqa: E402

MESHES = [("tp2", 1, "dp", False), ("tp2+SP", 1, "dp", True), ("fsdp2.tp2", 2, "fsdp", False)]


def _models() -> dict:
    import transformers
    from tests.test_train_models import _MODELS

    def llama_tied_odd():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=32))
    return {**_MODELS, "llama_tied_odd": llama_tied_odd}


def measure(name: str, make, mesh_name: str, batch_size: int, batch: str, sp: bool) -> list:
    from fxshard.training import parallelize_for_training
    from tests.test_train_models import _data, _loss, _mesh
    torch.manual_seed(0)
    model = make().train()
    ref = copy.deepcopy(model)
    ids, labels = (t % model.config.vocab_size for t in _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = parallelize_for_training(model, _mesh(batch_size, 2, batch), example_inputs=(ids,),
                                      sequence_parallel=sp)
        _loss(tm(ids), labels).backward()
    _loss(ref(ids), labels).backward()
    grads = tm.gradients()
    err = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    moved = [c for c in tm.collectives("backward") if c.axis == "tp" and c.op != "local_shard"]
    kinds = collections.Counter(c.op for c in moved)
    nodes = {n.name: n for n in tm.rank_module(0, "backward").graph.nodes}
    weighty = sum(_of_weight(nodes[c.node]) for c in moved)
    counts = " ".join(f"{k}:{v}" for k, v in sorted(kinds.items()))
    return [name, mesh_name, counts, sum(c.wire_bytes for c in moved), weighty, err]


def _of_weight(node) -> bool:
    """The collective moves a weight (a backward input that is neither a saved activation
    nor an output's gradient), possibly through views."""
    views = (torch.ops.aten.t.default, torch.ops.aten.view.default,
             torch.ops.aten.reshape.default, torch.ops.aten.transpose.int,
             torch.ops.aten.permute.default, torch.ops.aten._unsafe_view.default)
    x = node.args[0]
    while getattr(x, "target", None) in views:
        x = x.args[0]
    return getattr(x, "op", None) == "placeholder" and \
        not x.name.startswith(("saved_", "grad_output"))


def main(argv: list[str]) -> None:
    models = _models()
    names = argv or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise SystemExit(f"unknown model {unknown}; choose from {sorted(models)}")
    env = environment()
    print(f"# training backward collectives on tp ({env['date']}, torch {env['torch']})")
    print(f"# reproduce: {reproduce('train_collectives.py')}\n")
    rows = [measure(name, models[name], *mesh) for name in names for mesh in MESHES]
    print(format_table([("model", "<15"), ("mesh", "<10"), ("backward tp collectives", "<82"),
                        ("wire B", ">7"), ("weights moved", ">13"), ("grad err", ">9.1e")],
                       rows))


if __name__ == "__main__":
    main(sys.argv[1:])
