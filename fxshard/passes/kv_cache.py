"""Text generation: bind a static KV cache to every attention of the rank programs.

Generation runs two programs per input signature (``fxshard.generation``): *prefill* (the
prompt, the forward as ``parallelize`` builds it) and *decode* (one new token per sequence, at
its position: :mod:`fxshard.generation.positions`). Both read and write one cache per attention, state of the ParallelModule
that each rank holds in the layout of the K/V it stores: batch on ``dp``, KV heads on ``tp`` /
``ulysses_cp`` (the head each rank's queries use, where an axis exceeds the KV heads), the
sequence on ``ring_cp``; a layer's cache lives on the ``pp`` stage of the layer. The caches are
extra graph inputs (``fxshard_state``, listed on ``Program.state_inputs``) the executor binds
per rank, written in place by ``fxshard::cache_write`` (the mutation is in the op's schema, so
compile functionalises it).

``prefill_cache_pass`` runs after ``lower_attention``: the keys and values each rank attends
are exactly what it must keep::

    before: attention = fxshard.attention(q, k, v, None, True, 0.25, 0, 0)
    after:  fxshard.cache_write(kv_0_k, k, cache_write_pos)
            fxshard.cache_write(kv_0_v, v, cache_write_pos)
            attention = fxshard.attention(q, k, v, None, True, 0.25, 0, 0)

``decode_attention_pass`` runs instead of ``lower_attention`` on the one-token program. The
traced attention sees only the new token (its mask, ``[.., 1, 1]``, lets a token see itself, as
every causal mask does); it becomes the new K/V written into the cache and the query attended
to the cache's valid slots. On ``ulysses_cp`` (the query is not split on the sequence: one
token) the rank takes its heads, as the cache holds them, and the heads are gathered after; on
``ring_cp`` each rank attends its piece of the sequence and the pieces merge by logsumexp
(flash-decoding across ranks); the new K/V goes to one rank of the ring per step, the others
write a scratch slot past the capacity (:func:`decode_slots`, the one place that rule is
written; the runtime fills ``cache_write_pos`` and ``cache_read_len`` from it)::

    before: sdpa = aten.scaled_dot_product_attention(q, k, v, mask, scale=0.25)
    after:  fxshard.cache_write(kv_0_k, k, cache_write_pos); ...(kv_0_v, v, ...)
            attention = fxshard.decode_attention(q, kv_0_k, kv_0_v, cache_read_len, 0.25, False)
            pieces = fxshard.all_gather(unsqueeze(attention[0], 0), 0, 'ring_cp', 2)
            out = fxshard.merge_pieces(pieces, fxshard.all_gather(unsqueeze(attention[1], 0), ...))

Cache shapes are the rank's: ``[B, H, capacity + 1, D]`` (the last slot is the scratch slot;
the V cache has v's head size, which may differ from k's as in MLA);
``capacity`` is ``ctx.cache_capacity``. The pass lists: ``PREFILL`` and ``DECODE`` (greedy:
``DECODE_GREEDY``) of :mod:`fxshard.passes.pipeline`.

``greedy_tokens_pass`` makes the decode program of greedy generation return the chosen token
ids ``[B, 1]`` (int64) in place of the logits (found among the outputs by ``ctx.out_spec``): the caller needs only their argmax. Where the
logits end vocab-sharded on one axis (tp's column-parallel lm_head), the gather of the
``[B, 1, V]`` logits becomes a :func:`fxshard::sharded_argmax
<fxshard.ops.decode.sharded_argmax>` (one ``(max, index)`` pair per row exchanged);
the gathers on other axes (``dp``'s batch) stay and gather the ids; anywhere else the
gathered logits get an ``argmax``::

    before: logits = aten.linear(h, lm_head_w)                       # [B, 1, V/tp] S(2) on tp
            all_gather = fxshard.all_gather(logits, 2, 'tp', 2)       # [B, 1, V]
            return (all_gather,)
    after:  sharded_argmax = fxshard.sharded_argmax(logits, 'tp', 2) # [B, 1] int64
            return (sharded_argmax,)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import fxshard.ops  # noqa: F401  (registers the cache ops)
from ..placement import Replicate, Shard, local_shape
from . import PassCtx
from .insert_collectives import collective_target
from .lower_attention import _pick_kv_heads, _relabel
from .rules.attention import SOFTCAP, sdpa_args
from ..mesh import RING, ULYSSES

aten = torch.ops.aten

__all__ = ["prefill_cache_pass", "decode_attention_pass", "greedy_tokens_pass", "cache_keys",
           "greedy_output", "decode_slots", "WRITE_POS", "READ_LEN"]

WRITE_POS = "cache_write_pos"
READ_LEN = "cache_read_len"
_ATTENTION = ("fxshard.attention.default", "fxshard.ring_attention.default")
_GREEDY = "fxshard_greedy_tokens"   # meta flag of the output node holding the chosen ids


def cache_keys(graph: fx.Graph) -> list[tuple[str, tuple, torch.dtype]]:
    """``(state key, local shape, dtype)`` of every KV-cache input of a program."""
    return [(n.meta["fxshard_state"], tuple(n.meta["val"].shape), n.meta["val"].dtype)
            for n in graph.nodes if n.op == "placeholder"
            and str(n.meta.get("fxshard_state", "")).startswith("kv.")]


def _local(node: fx.Node, ctx: PassCtx) -> tuple:
    return tuple(local_shape(tuple(node.meta["val"].shape), node.meta["fxshard_spec"], ctx.mesh,
                             what=node.name))


class _State:
    """Adds the state placeholders (after the user inputs) as the pass needs them."""

    def __init__(self, graph: fx.Graph, ctx: PassCtx):
        self.graph, self.ctx = graph, ctx
        self.nodes: dict[str, fx.Node] = {}
        self.last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        self.replicated = tuple(torch.distributed.tensor.Replicate() for _ in ctx.mesh.shape)

    def get(self, key: str, shape: tuple, dtype: torch.dtype) -> fx.Node:
        node = self.nodes.get(key)
        if node is None:
            with self.graph.inserting_after(self.last):
                node = self.graph.placeholder(key.replace(".", "_"))
            node.meta.update({"fxshard_state": key, "fxshard_spec": self.replicated,
                              "val": torch.empty(shape, dtype=dtype, device="meta")})
            self.nodes[key] = self.last = node
        assert tuple(node.meta["val"].shape) == tuple(shape), (key, shape)
        return node


def _check_generation_model(node: fx.Node, what: str) -> None:
    raise NotImplementedError(
        f"fxshard.generate: attention {node.name} is {what}; text generation with a KV cache "
        f"needs causal self-attention without an explicit mask in the prompt's forward (the "
        f"decoder-only LMs of HuggingFace, e.g. Llama, Mistral, Qwen). Run the model's forward "
        f"with pm(...) instead")


def prefill_cache_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Write each attention's (rank-local) K/V into its cache (``ctx.cache_capacity`` slots)
    at slot 0 onwards."""
    graph, capacity = gm.graph, ctx.cache_capacity
    state = _State(graph, ctx)
    layers = 0
    for node in list(graph.nodes):
        if str(node.target) not in _ATTENTION:
            continue
        ring = str(node.target) == _ATTENTION[1]
        causal = node.args[3] if ring else node.args[4]
        mask = (node.args[12] if len(node.args) > 12 else None) if ring else node.args[3]
        if mask is not None:
            _check_generation_model(node, "given an explicit mask")
        if not causal:
            _check_generation_model(node, "not causal")
        _write(graph, state, node, node.args[1], node.args[2], layers, capacity, ctx)
        layers += 1
    if layers == 0:
        raise NotImplementedError(
            "fxshard.generate: the model's forward has no attention fxshard recognises "
            "(scaled_dot_product_attention, or matmul-softmax-matmul), so there is no KV cache "
            "to keep; text generation needs a decoder-only attention LM")
    ctx.report("prefill_cache_pass", cached_attentions=layers)
    return gm


def _write(graph, state, before, k, v, layer, capacity, ctx) -> tuple[fx.Node, fx.Node]:
    pos = state.get(WRITE_POS, (1,), torch.int64)
    caches = []
    for name, t in (("k", k), ("v", v)):   # v's head size may differ from k's (MLA)
        shape = _local(t, ctx)
        cache_shape = (shape[0], shape[1], capacity + 1, shape[3])
        cache = state.get(f"kv.{layer}.{name}", cache_shape, t.meta["val"].dtype)
        with graph.inserting_before(before):
            w = graph.call_function(torch.ops.fxshard.cache_write.default, (cache, t, pos))
        w.meta.update({key: before.meta[key] for key in ("nn_module_stack", "fxshard_stage")
                       if key in before.meta})
        caches.append(cache)
    return caches[0], caches[1]


def _spec_with(node: fx.Node, axis: str, placement, ctx: PassCtx) -> tuple:
    spec = list(node.meta["fxshard_spec"])
    spec[ctx.mesh.axis_names.index(axis)] = placement
    return tuple(spec)


def _call(graph, target, args, val, spec, like: fx.Node) -> fx.Node:
    n = graph.call_function(target, args)
    n.meta.update({key: like.meta[key] for key in ("nn_module_stack", "fxshard_stage")
                   if key in like.meta})
    n.meta["val"], n.meta["fxshard_spec"] = val, spec
    return n


def decode_attention_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """Attention of the one-token program against the cache of ``ctx.cache_capacity`` slots
    (see the module doc)."""
    graph, capacity = gm.graph, ctx.cache_capacity
    state = _State(graph, ctx)
    mesh = ctx.mesh
    layers = 0
    for node in list(graph.nodes):
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        a = sdpa_args(node)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if q.meta["val"].dim() != 4 or q.meta["val"].shape[2] != 1 or \
                k.meta["val"].shape[2] != 1:
            raise NotImplementedError(
                f"fxshard.generate: the decode step's attention {node.name} has query/key "
                f"shapes {tuple(q.meta['val'].shape)} / {tuple(k.meta['val'].shape)}; a decode "
                f"step attends one new token [B, H, 1, D]")
        if isinstance(mask, fx.Node) and tuple(mask.meta["val"].shape[-2:]) != (1, 1):
            _check_generation_model(node, f"given a mask of shape "
                                          f"{tuple(mask.meta['val'].shape)}")
        with graph.inserting_before(node):
            notes = node.meta.get("fxshard_notes", {})
            for axis in sorted(notes.get("kv_heads_replicated", ()), key=mesh.axis_names.index):
                k, v = (_pick_kv_heads(graph, t, axis, mesh.axis_size(axis), mesh)
                        for t in (k, v))
            n_u = mesh.axis_size(ULYSSES)
            if n_u > 1:
                q = _relabel(_call(graph, collective_target("local_shard"),
                                   (q, 1, ULYSSES, n_u), None, None, node),
                             q, ULYSSES, Shard(1), mesh)
                if _local(k, ctx)[1] % n_u == 0:
                    k, v = (_relabel(_call(graph, collective_target("local_shard"),
                                           (t, 1, ULYSSES, n_u), None, None, node),
                                     t, ULYSSES, Shard(1), mesh) for t in (k, v))
                else:
                    k, v = (_pick_kv_heads(graph, t, ULYSSES, n_u, mesh) for t in (k, v))
            k_cache, v_cache = _write(graph, state, node, k, v, layers, capacity, ctx)
            batch = _local(q, ctx)[0]
            lengths = state.get(READ_LEN, (batch,), torch.int64)
            n_r = mesh.axis_size(RING)
            softcap = float(node.meta.get(SOFTCAP, 0.0))
            capped = (softcap,) if softcap else ()   # uncapped calls keep the short signature
            att = _call(graph, torch.ops.fxshard.decode_attention.default,
                        (q, k_cache, v_cache, lengths, a["scale"], n_r == 1, *capped),
                        (node.meta["val"], None), None, node)
            out_spec = q.meta["fxshard_spec"]
            out = _call(graph, operator.getitem, (att, 0), node.meta["val"], out_spec, node)
            if n_r > 1:
                out = _merge_ring(graph, att, out, node, n_r, ctx)
            if n_u > 1:
                out = _call(graph, collective_target("all_gather"), (out, 1, ULYSSES, n_u),
                            node.meta["val"], node.meta["fxshard_spec"], node)
        out.meta.update({key: val for key, val in node.meta.items()
                         if key not in ("val", "fxshard_spec")})
        assert out.meta["fxshard_spec"] == node.meta["fxshard_spec"], node.format_node()
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        layers += 1
    ctx.report("decode_attention_pass", cached_attentions=layers)
    return gm


def _merge_ring(graph, att, out, node, n, ctx) -> fx.Node:
    """Every ``ring_cp`` rank attended its piece of the cache: gather the pieces' outputs and
    logsumexps (stacked on a new dim 0) and merge them."""
    mesh = ctx.mesh
    out_spec = out.meta["fxshard_spec"]
    val = out.meta["val"]
    shifted = tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in out_spec)
    ring = mesh.axis_names.index(RING)
    stacked_spec = shifted[:ring] + (Shard(0),) + shifted[ring + 1:]
    gathered_spec = shifted[:ring] + (out_spec[ring],) + shifted[ring + 1:]
    lse = _call(graph, operator.getitem, (att, 1), val.new_empty(val.shape[:3],
                                                                 dtype=torch.float32),
                out_spec, node)
    parts = []
    for t in (out, lse):
        tv = t.meta["val"]
        whole = tv.new_empty((n, *tv.shape))
        s = _call(graph, aten.unsqueeze.default, (t, 0), whole, stacked_spec, node)
        parts.append(_call(graph, collective_target("all_gather"), (s, 0, RING, n), whole,
                           gathered_spec, node))
    return _call(graph, torch.ops.fxshard.merge_pieces.default, tuple(parts), val, out_spec,
                 node)


def greedy_output(graph: fx.Graph) -> int | None:
    """Where a greedy decode program's flat outputs hold the token ids ``[B, 1]`` (None: the
    program returns logits)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return next((i for i, a in enumerate(out.args[0])
                 if isinstance(a, fx.Node) and a.meta.get(_GREEDY)), None)


def _logits_index(flat: list, out_spec) -> int:
    """Which flat output the model's logits are (as ``fxshard.generate`` reads them)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
    result = pytree.tree_unflatten(vals, out_spec)
    logits = getattr(result, "logits", None)
    if logits is None:
        logits = result if isinstance(result, torch.Tensor) else pytree.tree_leaves(result)[0]
    index = next((i for i, v in enumerate(vals) if v is logits), None)
    if index is None or logits.dim() != 3:
        raise ValueError(f"fxshard.generate: the model returns {type(result).__name__}, whose "
                         f"logits are not a [batch, seq, vocab] tensor; generate needs a "
                         f"causal LM")
    return index


def greedy_tokens_pass(gm: fx.GraphModule, *, ctx: PassCtx) -> fx.GraphModule:
    """The decode program returns the argmax of its logits (see the module doc), found in
    the outputs by ``ctx.out_spec``; runs right after ``insert_collectives_pass`` (global
    shapes, the output's gathers in place)."""
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = list(out.args[0])
    index = _logits_index(flat, ctx.out_spec)
    gather = collective_target("all_gather")
    chain, x = [], flat[index]                     # the output's gathers, outermost first
    while x.op == "call_function" and x.target is gather:
        chain.append(x)
        x = x.args[0]
    last = flat[index].meta["val"].dim() - 1
    vocab = [g for g in chain if g.args[1] % (last + 1) == last]
    logits = flat[index]
    v = logits.meta["val"]
    ids = v.new_empty(v.shape[:-1], dtype=torch.int64)
    if len(vocab) == 1:   # the argmax where the vocab is sharded, then the other gathers
        top = chain[-1].args[0]
        spec = list(top.meta["fxshard_spec"])
        for g in [vocab[0]] + [g for g in reversed(chain) if g is not vocab[0]]:
            _, dim, axis, size = g.args
            spec[ctx.mesh.axis_names.index(axis)] = Replicate()
            target, args = (torch.ops.fxshard.sharded_argmax.default, (top, axis, size)) \
                if g is vocab[0] else (gather, (top, dim, axis, size))
            with graph.inserting_before(out):
                top = _call(graph, target, args, ids, tuple(spec), logits)
        sharded = 1   # the vocab-sharded gather of the logits became a sharded argmax
    else:
        with graph.inserting_before(out):
            top = _call(graph, aten.argmax.default, (logits, -1), ids,
                        logits.meta.get("fxshard_spec"), logits)
        sharded = 0   # an argmax of the gathered logits
    flat[index] = top
    out.args = (type(out.args[0])(flat), *out.args[1:])
    top.meta[_GREEDY] = True
    ctx.report("greedy_tokens_pass", changed=True, token_outputs=1, sharded_argmaxes=sharded)
    return gm


def decode_slots(step: int, coord: int, ring: int, prompt_held: int, capacity: int
                 ) -> tuple[int, int]:
    """``(cache_write_pos, cache_read_len)`` of decode step ``step`` (its new K/V at prompt +
    ``step``) on the rank at ring coordinate ``coord`` of ``ring`` that holds ``prompt_held``
    of the prompt's positions. The write owner of step ``t`` is ring coordinate ``t % ring``
    (the pieces grow evenly); the other ranks write the scratch slot ``capacity`` (every cache
    has ``capacity + 1`` slots) and read only their piece."""
    if ring == 1:
        return prompt_held + step, prompt_held + step + 1
    held = prompt_held + (step + ring - 1 - coord) // ring
    return (held, held + 1) if step % ring == coord else (capacity, held)
