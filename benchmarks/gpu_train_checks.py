"""The GPU check's training rows (step 8 of :mod:`benchmarks.gpu_check`; issue 42 item 6).

An HF Llama of about 1B parameters (Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads,
8 KV heads, vocab 128256, tied embeddings; random weights, nothing downloaded) trained for
``STEPS`` AdamW steps on a simulated 4-rank mesh (fsdp=2 x tp=2) on one CUDA device, in bf16
mixed precision through the public API::

    pm = fxshard.parallelize(model, mesh, mixed_precision=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))      # fp32 master shards
    loss = pm(ids, labels=ids).loss; loss.backward(); opt.step()      # AdamW(pm.parameters())

eager and ``compile=True``, against the same model on one device under
``torch.autocast("cuda", dtype=torch.bfloat16)`` (fp32 weights and AdamW). A row: the loss at
step 1 and step ``STEPS`` and the largest loss difference from one device over all steps,
tokens/s (median step time over the steps after the first two, which trace and compile), peak
memory (``torch.cuda.max_memory_allocated``, every simulated rank's on the one device), and
whether the backward program calls the Triton attention backward. Each row runs from the same
initial weights (kept on the CPU) and frees its state before the next; a row that fails keeps
its error and the others still run.

PASS: every step's loss within ``LOSS_TOL`` of one device's. Mixed precision is not bitwise
(another order of bf16 roundings); a wrong gradient or a missed reduction moves the loss by
far more within 20 steps at this learning rate. The table is printed and written to
``benchmarks/RESULTS.md`` (the section it owns, replaced on a rerun).

``device="cpu"`` (``gpu_check.py --device cpu``) runs the same code on a tiny config for
``SMOKE_STEPS`` steps under CPU autocast, and writes nothing: a dry run so the GPU call cannot
fail for a silly reason. It runs on torch 2.11 + triton 3.6 and on torch 2.13.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
from pathlib import Path

import torch

__all__ = ["training_rows", "train_rows_check", "ROW_COLUMNS"]

STEPS, SMOKE_STEPS = 20, 3
LR, LOSS_TOL = 1e-4, 5e-2
BATCH, SEQ = 4, 1024                   # 4096 tokens a step; fsdp=2 gives each rank 2 rows
ROW_COLUMNS = ["run", "mesh", "loss_1", "loss_last", "max_dloss", "tokens_s", "step_ms",
               "peak_gib", "triton_bwd"]
_SECTION = "## GPU training rows: HF Llama ~1B, bf16 mixed precision (gpu_check.py step 8)"


def _config(device: str):
    import transformers
    if device == "cuda":     # Llama-3.2-1B's shape
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
            rope_theta=500000.0, tie_word_embeddings=True, use_cache=False,
            attn_implementation="sdpa")
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        use_cache=False, attn_implementation="sdpa")


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None


def _batches(vocab: int, steps: int, batch: int, seq: int, device: str) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(steps)]


def _run(step, batches, device: str) -> tuple[list, list]:
    """Losses and step seconds of ``step(ids)`` over ``batches``."""
    losses, times = [], []
    for ids in batches:
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(ids))
        _sync(device)
        times.append(time.perf_counter() - t0)
    return losses, times


def _reference(model, batches, device: str) -> tuple[list, list]:
    """One device under autocast: fp32 weights and AdamW, bf16 compute."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(ids):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return _run(step, batches, device)


def _fxshard(model, batches, device: str, compile: bool) -> tuple[list, list, bool]:
    import fxshard
    mesh = fxshard.init_device_mesh(device, (2, 2), mesh_dim_names=("fsdp", "tp"))
    pm = fxshard.parallelize(model, mesh, mixed_precision=_policy(), compile=compile)
    try:
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)

        def step(ids):
            loss = pm(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        losses, times = _run(step, batches, device)
        triton = "attention_backward" in pm.rank_module(0, "backward").code
        return losses, times, triton
    finally:
        pm.close()


def training_rows(device: str = "cuda", *, steps: int | None = None) -> list[dict]:
    """The rows (see the module): one device under autocast, fxshard eager, fxshard
    ``compile=True``."""
    import transformers
    smoke = device != "cuda"
    steps = steps or (SMOKE_STEPS if smoke else STEPS)
    batch, seq = (4, 16) if smoke else (BATCH, SEQ)
    config = _config(device)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}   # on the CPU
    batches = _batches(config.vocab_size, steps, batch, seq, device)
    tokens = batch * seq
    rows, ref_losses = [], None
    for run in ("one device, autocast", "fxshard eager", "fxshard compile=True"):
        row = {"run": run, "mesh": "1" if run.startswith("one") else "fsdp2.tp2"}
        _peak_reset(device)
        try:
            model.load_state_dict(initial)
            work = copy.deepcopy(model).to(device)
            if run.startswith("one"):
                losses, times = _reference(work, batches, device)
                ref_losses = losses
            else:
                losses, times, row["triton_bwd"] = _fxshard(
                    work, batches, device, compile=run.endswith("True"))
                if device != "cuda":
                    row["triton_bwd"] = "cpu"
            warm = times[2:] or times
            row.update(loss_1=losses[0], loss_last=losses[-1],
                       step_ms=1e3 * statistics.median(warm),
                       tokens_s=tokens / statistics.median(warm), peak_gib=_peak_gib(device))
            if ref_losses is not losses:
                row["dloss"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
                row["max_dloss"] = f"{row['dloss']:.1e}"
            row["loss_1"], row["loss_last"] = f"{losses[0]:.4f}", f"{losses[-1]:.4f}"
        except Exception as exc:  # noqa: BLE001 - reported in the row, then the next run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            work = None
            _peak_reset(device)
        rows.append(row)
        n = sum(p.numel() for p in model.parameters())
        print(f"  {run}: done ({n / 1e6:.1f}M parameters, {steps} steps)", flush=True)
    return rows


def _good(row: dict, device: str) -> bool:
    if row.get("error"):
        return False
    if row["run"].startswith("one"):
        return True
    return row.get("dloss", float("inf")) <= LOSS_TOL and row.get("triton_bwd") in (True,
                                                                                        "cpu")


def write_results(rows: list, text: str, path: Path) -> None:
    """Replace (or append) this check's section of ``path`` with ``text``."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    start = old.find(_SECTION)
    if start >= 0:
        end = old.find("\n## ", start + len(_SECTION))
        old = old[:start].rstrip("\n") + ("\n" + old[end:] if end >= 0 else "\n")
    path.write_text(old.rstrip("\n") + "\n\n" + text + "\n")


def train_rows_check(device: str, results: Path | None = None) -> bool:
    """Run :func:`training_rows`, print the table and PASS/FAIL; on CUDA write the table to
    ``results`` (``benchmarks/RESULTS.md``)."""
    from benchmarks.gpu_kernel_checks import format_table
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run, tiny config)"
    print(f"\ntraining rows: HF Llama, fsdp=2 x tp=2 simulated on one {where}, bf16 mixed "
          f"precision vs one device's autocast", flush=True)
    rows = training_rows(device)
    table = format_table(rows, ROW_COLUMNS)
    print(table, flush=True)
    ok = all(_good(r, device) for r in rows)
    print(f"{'PASS' if ok else 'FAIL'} training rows on {device}: every step's loss within "
          f"{LOSS_TOL} of one device's autocast run; the backward calls the Triton attention "
          f"backward", flush=True)
    if device == "cuda" and results is not None:
        import triton
        head = (f"{_SECTION}\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}; {STEPS} AdamW steps (lr {LR}) of {BATCH}x{SEQ} "
                f"tokens; loss_1 / loss_last: the first and last step's loss, max_dloss: the "
                f"largest difference from one device's autocast loss over the steps; tokens_s "
                f"and step_ms: median over steps 3-{STEPS}; peak_gib: every simulated rank's "
                f"memory on the one GPU.\n\n")
        write_results(rows, head + "```\n" + table + "\n```", results)
    return ok
