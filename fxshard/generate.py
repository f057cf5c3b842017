"""Text generation on a ParallelModule: prefill the prompt, then decode token by token.

    pm = fxshard.parallelize(model, mesh)
    out = pm.generate(input_ids, max_new_tokens=32)          # [B, S + new], like HF generate

Two programs per prompt shape (:mod:`fxshard.passes.kv_cache`): *prefill* runs the prompt's
forward with every CP machinery of ``parallelize`` and writes each rank's K/V into its cache;
*decode* takes one token per sequence at ``position_ids = S + t`` and attends the cache. The
caches are allocated here, one set per rank (on a real mesh: this process's rank), sized for the
prompt plus ``max_new_tokens`` (rounded up to a multiple of :data:`CAPACITY_STEP` so prompts of
similar length share the decode program), and written in place.

On ``ring_cp`` the prompt's K/V stays where the prefill put it (rank j holds its sequence
chunks) and decode step ``t``'s new K/V goes to ring coordinate ``t % n``, so the pieces grow
evenly; every rank attends its piece and the pieces merge by logsumexp.

With ``pp``, greedy generation runs :mod:`fxshard.pipelined_decode`: the ``microbatches=m``
groups of sequences flow through the stages across steps (group ``j``'s next step starts as
soon as the last stage has group ``j``'s token, which it sends to the earlier stages), so with
``m >= pp`` no stage idles in steady state, and a group whose sequences have all finished stops
being computed. Sampling on ``pp`` runs the step loop here (one ``torch.multinomial`` over the
whole batch per step, as HF): each step pipelines the ``m`` groups through the stages (GPipe
within a step), the last stage shares the logits, and the step's pipeline fills and drains.

Token choice follows HuggingFace ``generate``: greedy ``argmax``, or temperature, then top-k,
then top-p (nucleus), then ``torch.multinomial`` with ``generator`` (the global RNG when
``None``). After a sequence emits ``eos_token_id`` it gets ``pad_token_id`` (default: the
first eos id) and generation stops when every sequence has finished; as in HF, an
``eos_token_id``/``pad_token_id`` left ``None`` is the model's ``generation_config``'s. On a
real mesh a token sampled on mesh rank 0 is broadcast, so every rank feeds the same ids
whatever its RNG state. Greedy tokens need no broadcast: the greedy decode program returns
the argmax ids themselves, the same on every rank (``fxshard.passes.kv_cache.greedy_tokens_pass``:
on ``tp`` a sharded argmax, one ``(max, index)`` pair per sequence exchanged instead of the
``[B, V]`` logits).
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch
import torch.utils._pytree as pytree

from .checks import inference_only, token_ids
from .mesh import is_simulated
from .passes.kv_cache import READ_LEN, WRITE_POS, cache_keys, greedy_output
from .runtime.agreement import agree
from .runtime.memory import check_kv_cache_fits
from .runtime.runner import run

__all__ = ["generate", "CAPACITY_STEP"]

_WHERE = "ParallelModule.generate"
CAPACITY_STEP = 64


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
    dp = pm.spec.axis_size("dp") * pm.microbatches
    if input_ids.shape[0] % dp:
        raise ValueError(
            f"{_WHERE}: the batch of {input_ids.shape[0]} sequences cannot be split over mesh "
            f"{pm.spec.describe()}: dp={pm.spec.axis_size('dp')} x microbatches="
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
    try:
        params = inspect.signature(pm.model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "position_ids" not in params:
        raise NotImplementedError(
            f"{_WHERE}: {type(pm.model).__name__}.forward takes no position_ids, which a "
            f"decode step needs (the new token sits at position S + t, not 0). Give the "
            f"forward a position_ids argument, as HuggingFace models have")
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


def _sliding_window(model) -> int | None:
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def _logits(pm, c, out, index: int | None = None) -> tuple[torch.Tensor, int | None]:
    """The last position's logits as float, and where they sit in ``out`` (the flat outputs):
    pass that ``index`` back for the next output of the same program to skip rebuilding the
    model's output object (a ``CausalLMOutputWithPast`` per token)."""
    if index is not None:
        return out[index][:, -1].float(), index
    result = pytree.tree_unflatten(inference_only(pm.model, list(out)), c.traced.out_spec)
    logits = getattr(result, "logits", None)
    if logits is None:
        logits = result if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"{_WHERE}: the model returns {type(result).__name__}, whose logits "
                         f"are not a [batch, seq, vocab] tensor; generate needs a causal LM")
    index = next((i for i, x in enumerate(out) if x is logits), None)
    return logits[:, -1].float(), index


def _greedy(pm, c, out, pick: tuple | None = None) -> tuple[torch.Tensor, tuple]:
    """The argmax ids ``[b]`` of a program's last position, and ``pick`` (pass it back for the
    next output of the same program): a greedy decode program returns the ids
    (``greedy_tokens_pass``: its vocab-sharded logits are never gathered), any other program
    the logits."""
    if pick is None:
        index = greedy_output(c.programs[-1].graph)
        pick = ("ids", index) if index is not None else ("logits", None)
    kind, index = pick
    if kind == "ids":
        return out[index][:, -1], pick
    scores, index = _logits(pm, c, out, index)
    return scores.argmax(-1), ("logits", index)


def _choose(scores: torch.Tensor, do_sample, temperature, top_k, top_p, generator):
    if not do_sample:
        return scores.argmax(-1)
    scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1:
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(-1, index, drop), -math.inf)
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _ranks(pm) -> list[int]:
    if is_simulated(pm.mesh):
        return list(range(pm.spec.world_size))
    from .runtime.distributed import backend_for
    return [backend_for(pm.mesh).rank]


class _Caches:
    """Every rank's KV caches and positions: the state the programs' inputs bind to."""

    def __init__(self, pm, c, prompt: int, capacity: int, device):
        self.spec = pm.spec
        self.ring = pm.spec.axis_size("ring_cp")
        self.capacity = capacity
        self.base = prompt // self.ring           # prompt positions each ring rank holds
        self.device = device
        self.state: dict[int, dict] = {}
        for rank in _ranks(pm):
            program = c.programs[pm.stage_of(rank)]
            st = {}
            for key, shape, dtype in cache_keys(program.graph):
                shape = (shape[0] * pm.microbatches, *shape[1:])
                st[key] = torch.zeros(shape, dtype=dtype, device=device)
            st[WRITE_POS] = torch.zeros(1, dtype=torch.int64, device=device)
            self.state[rank] = st
        self.batch = {r: next((t.shape[0] for k, t in st.items() if k.startswith("kv.")), 1)
                      for r, st in self.state.items()}

    def step(self, t: int, *, ranks=None) -> None:
        """Positions for decode step ``t`` (its new K/V at prompt + t), on ``ranks`` (all)."""
        for rank in self.state if ranks is None else ranks:
            st = self.state[rank]
            if self.ring == 1:
                write, read = self.base + t, self.base + t + 1
            else:
                coord = self.spec.axis_index(rank, "ring_cp")
                held = self.base + (t + self.ring - 1 - coord) // self.ring
                owner = t % self.ring == coord
                write, read = (held, held + 1) if owner else (self.capacity, held)
            st[WRITE_POS].fill_(write)     # in place: no new tensors per step
            if READ_LEN in st:
                st[READ_LEN].fill_(read)
            else:
                st[READ_LEN] = torch.full((self.batch[rank],), read, dtype=torch.int64,
                                          device=self.device)


def _check_same_caches(prefill, decode) -> None:
    """The decode program must read every cache the prefill wrote: an attention the decode
    trace did not recognise would attend only the new token."""
    def keys(c):
        return sorted(k for p in c.programs for k, _, _ in cache_keys(p.graph))
    written, read = keys(prefill), keys(decode)
    if written != read:
        raise NotImplementedError(
            f"{_WHERE}: the prompt's forward has {len(written) // 2} attentions but fxshard "
            f"recognised {len(read) // 2} in the one-token decode step (its attention is "
            f"written in a form fxshard does not lower for a single query, e.g. eager "
            f"attention with a mask built from position_ids); run the model with "
            f"attn_implementation='sdpa'")


def _last_logits_only(model) -> dict:
    """The prefill's extra keyword arguments: HuggingFace's ``logits_to_keep=1`` where the
    forward takes it (the vocab projection and its gather on the last position only: prefill
    needs no other logits), none otherwise."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _capacity(pm, prompt: int, new: int) -> int:
    ring = pm.spec.axis_size("ring_cp")
    need = prompt // ring + -(-max(new - 1, 0) // ring)
    return max(CAPACITY_STEP, -(-need // CAPACITY_STEP) * CAPACITY_STEP)


def _broadcast(pm, tokens: torch.Tensor, src: int | None) -> torch.Tensor:
    if src is None:
        return tokens
    import torch.distributed as dist
    on_mesh = tokens.to(torch.device(pm.spec.device_type))   # NCCL sends device tensors
    dist.broadcast(on_mesh, src=src)
    return on_mesh.to(tokens.device)


@torch.no_grad()
def generate(pm, input_ids: torch.Tensor, *, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id=None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None,
             _step_synchronous: bool = False, _stage_hook=None) -> torch.Tensor:
    """See :meth:`fxshard.ParallelModule.generate`. For benchmarks and tests: with
    ``_step_synchronous`` greedy on ``pp`` runs the step loop below too, not
    :mod:`fxshard.pipelined_decode`; ``_stage_hook(rank, stage, step, group)`` is called there
    before each stage run."""
    config = getattr(pm.model, "generation_config", None)  # HF: the model's defaults
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    eos_token_id, pad_token_id = token_ids(eos_token_id), token_ids(pad_token_id)  # tensors too
    agree(pm, _WHERE, dict(input_ids=input_ids, max_new_tokens=max_new_tokens, sample=do_sample,
          temperature=temperature, top_k=top_k, top_p=top_p, eos=eos_token_id, pad=pad_token_id))
    eos = _check(pm, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                 eos_token_id, pad_token_id, generator)
    if max_new_tokens == 0:
        return input_ids.clone()
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    batch, prompt = input_ids.shape
    capacity = _capacity(pm, prompt, max_new_tokens)
    device = torch.device(pm.spec.device_type)
    pm._sync_weights()
    c, micro = pm._get((input_ids,), _last_logits_only(pm.model),
                       generation=("prefill", capacity))
    if not c.loaded:
        pm._check_loaded(c)
    prefill = c
    src = None if is_simulated(pm.mesh) else int(pm.mesh.mesh.flatten()[0])  # mesh rank 0
    check_kv_cache_fits(pm, c, _ranks(pm), capacity, lambda n: _capacity(pm, prompt, n),
                        max_new_tokens)
    caches = pm._kv_state = _Caches(pm, c, prompt, capacity, device)  # kept for inspection
    if not do_sample and pm.spec.axis_size("pp") > 1 and not _step_synchronous:
        return _pipelined(pm, input_ids, prefill, micro, caches, capacity, max_new_tokens,
                          eos, pad, _stage_hook)
    out = run(pm, c, micro, state=lambda r: caches.state[r])
    nxt = _choose(_logits(pm, c, out)[0], do_sample, temperature, top_k, top_p, generator)
    decode = ("decode", capacity) if do_sample else ("decode", capacity, "greedy")
    pick = None   # where the decode program's flat outputs hold the logits or ids
    tokens = [input_ids]
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    eos_t = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
    for t in range(max_new_tokens):
        nxt = nxt.to(device=input_ids.device, dtype=input_ids.dtype)
        if do_sample:  # greedy: every rank holds the same argmax of the same logits
            nxt = _broadcast(pm, nxt, src)
        if eos:
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
            unfinished = unfinished & ~torch.isin(nxt, eos_t)
        tokens.append(nxt[:, None])
        if t == max_new_tokens - 1 or (eos and not bool(unfinished.any())):
            break
        positions = torch.full((batch, 1), prompt + t, dtype=torch.int64,
                               device=input_ids.device)
        c, micro = pm._get((nxt[:, None],), {"position_ids": positions}, generation=decode)
        if not c.loaded:
            _check_same_caches(prefill, c)
            pm._check_loaded(c)
        caches.step(t)
        out = run(pm, c, micro, state=lambda r: caches.state[r])
        if do_sample:
            scores, pick = _logits(pm, c, out, pick)
            nxt = _choose(scores, do_sample, temperature, top_k, top_p, generator)
        else:
            nxt, pick = _greedy(pm, c, out, pick)
    return torch.cat(tokens, dim=1)


def _pipelined(pm, input_ids, prefill, micro, caches, capacity, new, eos, pad, hook):
    """Greedy on ``pp``: the groups flow through the stages across steps."""
    from .pipelined_decode import decode_example, pipelined_greedy
    decode = None
    if new > 1:
        args, kwargs = decode_example(input_ids, input_ids.shape[1])
        decode, _ = pm._get(args, kwargs, generation=("decode", capacity, "greedy"))
        if not decode.loaded:
            _check_same_caches(prefill, decode)
            pm._check_loaded(decode)
    tokens = pipelined_greedy(pm, input_ids, prefill, micro, decode, caches,
                              greedy=lambda c, out: _greedy(pm, c, out)[0], new=new, eos=eos,
                              pad=pad, hook=hook)
    return torch.cat([input_ids, tokens], dim=1)
