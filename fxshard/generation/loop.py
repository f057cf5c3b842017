"""Text generation on a ParallelModule: prefill the prompt, then decode token by token.

    pm = fxshard.parallelize(model, mesh)
    out = pm.generate(input_ids, max_new_tokens=32)          # [B, S + new], like HF generate

Two programs per prompt shape (:mod:`fxshard.passes.kv_cache`): *prefill* runs the prompt's
forward with every CP machinery of ``parallelize`` and writes each rank's K/V into its cache;
*decode* takes one token per sequence at position ``S + t`` (passed as the model's positions
argument, or derived inside it: :mod:`fxshard.generation.positions`) and attends the cache. Both
come from ``pm.programs`` (a generation key in the signature) and run on ``pm.executor`` with
the caches of :mod:`fxshard.generation.cache` bound as their state inputs; what a program
reads and returns beyond the model's own (its caches, whether it returns token ids) is data on
its ``Program``.

On ``ring_cp`` the prompt's K/V stays where the prefill put it (rank j holds its sequence
chunks) and decode step ``t``'s new K/V goes to ring coordinate ``t % n``, so the pieces grow
evenly; every rank attends its piece and the pieces merge by logsumexp.

With ``pp``, greedy generation runs :mod:`fxshard.generation.pipelined`: the
``microbatches=m`` groups of sequences flow through the stages across steps, so with
``m >= pp`` no stage idles in steady state, and a group whose sequences have all finished stops
being computed. Sampling on ``pp`` runs the step loop here (one ``torch.multinomial`` over the
whole batch per step, as HF): each step pipelines the ``m`` groups through the stages (GPipe
within a step), the last stage shares the logits, and the step's pipeline fills and drains.

Token choice (:mod:`fxshard.generation.sampling`) follows HuggingFace ``generate``. After a
sequence emits ``eos_token_id`` it gets ``pad_token_id`` (default: the first eos id) and
generation stops when every sequence has finished; as in HF, an ``eos_token_id``/
``pad_token_id`` left ``None`` is the model's ``generation_config``'s.
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch

from ..checks import token_ids
from ..mesh import DP, PP, is_simulated
from ..runtime.agreement import agree
from ..runtime.memory import check_kv_cache_fits
from .cache import Caches, capacity, check_same_caches
from .positions import decode_program
from .sampling import broadcast, choose, greedy_ids, last_logits

__all__ = ["generate"]

_WHERE = "ParallelModule.generate"


def _check(pm, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
           eos_token_id, pad_token_id, generator) -> list[int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or \
            0 in input_ids.shape:
        raise ValueError(
            f"{_WHERE}: input_ids must be a non-empty integer tensor [batch, prompt length], "
            f"got {getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
            f"{tuple(getattr(input_ids, 'shape', ()))}; tokenize the prompt first")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 0:
        raise ValueError(f"{_WHERE}: max_new_tokens={max_new_tokens!r} must be an int >= 0, "
                         f"e.g. max_new_tokens=32")
    if not isinstance(do_sample, bool):
        raise ValueError(f"{_WHERE}: do_sample={do_sample!r} must be True or False")
    if do_sample:
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or \
                not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"{_WHERE}: temperature={temperature!r} must be a finite float "
                             f"> 0 (1.0 leaves the distribution as it is); for the most "
                             f"likely token use do_sample=False")
        if top_k is not None and (isinstance(top_k, bool) or
                                  not isinstance(top_k, numbers.Integral) or top_k < 1):
            raise ValueError(f"{_WHERE}: top_k={top_k!r} must be None or an int >= 1")
        if top_p is not None and (isinstance(top_p, bool) or
                                  not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
            raise ValueError(f"{_WHERE}: top_p={top_p!r} must be None or a float in (0, 1]")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"{_WHERE}: generator must be a torch.Generator or None, got "
                             f"{type(generator).__name__}")
    else:
        given = [f"{name}={value!r}" for name, value, default in (
            ("temperature", temperature, 1.0), ("top_k", top_k, None), ("top_p", top_p, None),
            ("generator", generator, None)) if value is not default and value != default]
        if given:
            raise ValueError(f"{_WHERE}: {', '.join(given)} only apply to sampling, but "
                             f"do_sample=False (greedy); pass do_sample=True or drop them")
    eos = [] if eos_token_id is None else \
        [eos_token_id] if isinstance(eos_token_id, numbers.Number) else list(eos_token_id)
    vocab = _vocab_size(pm.model)
    for t in eos + ([] if pad_token_id is None else [pad_token_id]):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or \
                not 0 <= t < (vocab or t + 1):
            raise ValueError(f"{_WHERE}: eos_token_id={eos_token_id!r} / pad_token_id="
                             f"{pad_token_id!r} must be token ids in [0, {vocab})")
    dp = pm.spec.axis_size(DP) * pm.microbatches
    if input_ids.shape[0] % dp:
        raise ValueError(
            f"{_WHERE}: the batch of {input_ids.shape[0]} sequences cannot be split over mesh "
            f"{pm.spec.describe()}: dp={pm.spec.axis_size(DP)} x microbatches="
            f"{pm.microbatches} must divide it; use a batch that is a multiple of {dp}")
    total = input_ids.shape[1] + max_new_tokens
    limit = getattr(getattr(pm.model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and total > limit:
        raise ValueError(
            f"{_WHERE}: the prompt of {input_ids.shape[1]} tokens plus max_new_tokens="
            f"{max_new_tokens} needs {total} positions, more than the model's "
            f"max_position_embeddings={limit} (the KV cache's limit); shorten the prompt or "
            f"ask for fewer tokens")
    window = _sliding_window(pm.model)
    if window is not None and total > window:
        raise NotImplementedError(
            f"{_WHERE}: the model attends a sliding window of {window} tokens, and the prompt "
            f"plus max_new_tokens needs {total}; fxshard's KV cache keeps every position, so it "
            f"would attend tokens the model would not. Keep prompt + new tokens <= {window}")
    if not is_simulated(pm.mesh):
        import torch.distributed as dist
        if dist.get_world_size() != pm.spec.world_size:
            raise ValueError(
                f"{_WHERE}: the mesh {pm.spec.describe()} has {pm.spec.world_size} ranks but "
                f"the process group {dist.get_world_size()}; generate on a mesh of every rank")
    return eos


def _vocab_size(model) -> int | None:
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    return v if isinstance(v, int) else None


_WINDOW_NAMES = ("sliding_window", "sliding_window_size")


def _sliding_window(model) -> int | None:
    """The narrowest sliding window the model declares, on its config or on any submodule
    (``sliding_window`` / ``sliding_window_size``, an int > 0; a config saying
    ``use_sliding_window=False`` declares none). Conservative: a window on some layers only
    counts for all. A prompt that fits the window has a plain causal mask, so the decode
    steps past the window are what this guards."""
    windows = []
    for holder in [getattr(model, "config", None), *model.modules()]:
        if holder is None or getattr(holder, "use_sliding_window", True) is False:
            continue
        for name in _WINDOW_NAMES:
            window = getattr(holder, name, None)
            if isinstance(window, int) and not isinstance(window, bool) and window > 0:
                windows.append(window)
    return min(windows, default=None)


def _last_logits_only(model) -> dict:
    """The prefill's extra keyword arguments: HuggingFace's ``logits_to_keep=1`` where the
    forward takes it (the vocab projection and its gather on the last position only: prefill
    needs no other logits), none otherwise."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


@torch.no_grad()
def generate(pm, input_ids: torch.Tensor, *, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id=None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None,
             _step_synchronous: bool = False, _stage_hook=None) -> torch.Tensor:
    """See :meth:`fxshard.ParallelModule.generate`. For benchmarks and tests: with
    ``_step_synchronous`` greedy on ``pp`` runs the step loop below too, not
    :mod:`fxshard.generation.pipelined`; ``_stage_hook(rank, stage, step, group)`` is called
    there before each stage run."""
    config = getattr(pm.model, "generation_config", None)  # HF: the model's defaults
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    eos_token_id, pad_token_id = token_ids(eos_token_id), token_ids(pad_token_id)  # tensors too
    eos = _check(pm, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                 eos_token_id, pad_token_id, generator)
    agree(pm.mesh, pm.programs.agreed, _WHERE,
          dict(input_ids=input_ids, max_new_tokens=max_new_tokens, sample=do_sample,
               temperature=temperature, top_k=top_k, top_p=top_p, eos=eos_token_id,
               pad=pad_token_id))
    if max_new_tokens == 0:
        return input_ids.clone()
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    batch, prompt = input_ids.shape
    slots = capacity(pm.spec, prompt, max_new_tokens)
    programs, executor, model = pm.programs, pm.executor, pm.model
    c, micro = programs.prepare((input_ids,), _last_logits_only(model),
                                generation=("prefill", slots))
    prefill = c
    src = None if is_simulated(pm.mesh) else int(pm.mesh.mesh.flatten()[0])  # mesh rank 0
    check_kv_cache_fits(pm, c, executor.ranks(), slots,
                        lambda n: capacity(pm.spec, prompt, n), max_new_tokens)
    caches = executor.kv_caches = Caches(executor, c, prompt, slots)  # kept for inspection
    if not do_sample and pm.spec.axis_size(PP) > 1 and not _step_synchronous:
        return _pipelined(pm, input_ids, prefill, micro, caches, slots, max_new_tokens,
                          eos, pad, _stage_hook)
    out = executor.run(c, micro, state=lambda r: caches.state[r])
    nxt = choose(last_logits(model, c, out)[0], do_sample, temperature, top_k, top_p,
                 generator)
    decode = ("decode", slots) if do_sample else ("decode", slots, "greedy")
    pick = None   # where the decode program's flat outputs hold the logits or ids
    way = None    # how the decode program takes its position (fxshard.generation.positions)
    tokens = [input_ids]
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    eos_t = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    for t in range(max_new_tokens):
        nxt = nxt.to(device=input_ids.device, dtype=input_ids.dtype)
        if do_sample:  # greedy: every rank holds the same argmax of the same logits
            nxt = broadcast(pm.spec, nxt, src)
        if eos:
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
            unfinished = unfinished & ~torch.isin(nxt, eos_t)
        tokens.append(nxt[:, None])
        if t == max_new_tokens - 1 or (eos and not bool(unfinished.any())):
            break
        if way is None:   # the first step finds how the model takes its position
            c, micro, way = decode_program(pm, nxt[:, None], prompt + t, decode, {},
                                           prefill)
        else:
            c, micro = way.program(pm, nxt[:, None], prompt + t, decode, {})
        if not c.loaded:
            check_same_caches(prefill, c)
            programs.check_loaded(c)
        caches.step(t)
        out = executor.run(c, micro, state=lambda r: caches.state[r])
        if do_sample:
            scores, pick = last_logits(model, c, out, pick)
            nxt = choose(scores, do_sample, temperature, top_k, top_p, generator)
        else:
            nxt, pick = greedy_ids(model, c, out, pick)
    return torch.cat(tokens, dim=1)


def _pipelined(pm, input_ids, prefill, micro, caches, slots, new, eos, pad, hook):
    """Greedy on ``pp``: the groups flow through the stages across steps."""
    from .pipelined import pipelined_greedy
    decode = way = None
    if new > 1:
        decode, _, way = decode_program(pm, input_ids[:, :1], input_ids.shape[1],
                                        ("decode", slots, "greedy"), {}, prefill)
        if not decode.loaded:
            check_same_caches(prefill, decode)
            pm.programs.check_loaded(decode)
    tokens = pipelined_greedy(pm, input_ids, prefill, micro, decode, caches,
                              greedy=lambda c, out: greedy_ids(pm.model, c, out)[0], new=new,
                              eos=eos, pad=pad, hook=hook, positions=way)
    return torch.cat([input_ids, tokens], dim=1)
