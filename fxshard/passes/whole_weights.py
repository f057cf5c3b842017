"""Weights kept whole on ``tp``, and why: propagation's refinement and its report.

A column-parallel weight whose output is gathered back before any row-parallel contraction uses
the shard is wasted work: ``propagate`` replicates it and propagates again. Before that, a fused
projection tries to keep only the parts that are gathered whole (a multi-query ``qkv``: its
one K/V head cannot split, its query heads can)::

    qkv = linear(x, w_qkv[48, 32]); q, k, v = split(qkv, [32, 8, 8], -1); k.view(B, S, 1, 8)
    tp=2: w_qkv S(0|32+R8+R8): every rank holds its 16 query rows and all of K/V (32 rows)

The reason each weight stays whole is the real cause where it can be named (``tp=4 exceeds the
2 KV heads``: a reshape splits the shard into fewer heads than ranks), else the consumer that
gathers it. ``_list_replicated`` lists them for ``explain()``, refuses them under
``strict=True`` and warns once per program about the repeated layers' weights.
"""
from __future__ import annotations

import math
import operator
import warnings

import torch
import torch.fx as fx

from ..placement import Replicate, StridedShard, shard_dim
from . import PassCtx
from .rules import WholeWeightWarning, caller_level, tensor_inputs
from ..mesh import TP

_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.unflatten.int)


def _gathered_before_use(node: fx.Node, tp: int, budget: int = 64) -> fx.Node | None:
    """Some path along which ``node``'s shard on mesh axis index ``tp`` flows reaches a
    consumer that gathers it back (needs Replicate) before a row-parallel contraction turns
    it into a partial sum, or a fused (strided) shard reaches a consumer that wants it in any
    other layout (no collective re-orders the parts). The model's output does not count: it is
    gathered anyway (except a fused shard, which must not reach it), nor does a padded vocab's
    cut back to the model's vocab on its way there (:mod:`fxshard.passes.pad_vocab`)."""
    frontier, seen = [node], {node}
    while frontier and budget > 0:
        cur = frontier.pop()
        budget -= 1
        have = cur.meta.get("fxshard_spec")
        strided = isinstance(have, tuple) and isinstance(have[tp], StridedShard)
        for u in cur.users:
            if not strided and (u.op == "output" or u.meta.get("fxshard_vocab_cut") and
                                all(w.op == "output" for w in u.users)):
                continue
            for t, nd in zip(tensor_inputs(u), u.meta.get("fxshard_need") or []):
                if t is cur and (isinstance(nd[tp], Replicate) or strided and nd[tp] != have[tp]):
                    return u
            outs = u.meta.get("fxshard_spec")
            outs = [outs] if isinstance(outs, tuple) else \
                [g.meta.get("fxshard_spec") for g in u.users] if isinstance(outs, list) else []
            nxt = [u] if isinstance(u.meta.get("fxshard_spec"), tuple) else list(u.users)
            for v, out in zip(nxt, outs):
                if isinstance(out, tuple) and shard_dim(out[tp]) is not None and v not in seen:
                    seen.add(v)
                    frontier.append(v)
    return None



def _why_gathered(u: fx.Node, tp: int, size: int, start: fx.Node | None = None) -> str:
    """Why the column-parallel output of ``start`` is gathered at ``u``: the real cause where it
    can be named (a reshape of the output, or ``u`` itself, splits it into heads that ``tp``
    does not divide: ``tp=4 exceeds the 2 KV heads``; attention holds its KV heads whole),
    else the consumer that needs it whole."""
    for v in ([w for w in start.users if w.target in _RESHAPES] if start is not None else []):
        if (why := _heads_reason(v, tp, size)) is not None:
            return why
    if (why := _heads_reason(u, tp, size)) is not None:
        return why
    if u.target is torch.ops.aten.scaled_dot_product_attention.default and \
            TP in u.meta.get("fxshard_notes", {}).get("kv_heads_replicated", []):
        from .rules.attention import sdpa_args
        hkv = sdpa_args(u)["key"].meta["val"].shape[1]
        return (f"attention {u.name} holds its {hkv} KV heads whole on tp (fewer KV heads per "
                f"rank than the tp={size} ranks that split its query heads)")
    return f"its column-parallel output would be gathered before use (by {u.name}: {u.target})"


def _heads_reason(u: fx.Node, tp: int, size: int) -> str | None:
    """``tp=4 exceeds the 2 KV heads (...)`` when reshape ``u`` splits its input's dim sharded on
    ``tp`` into a number of heads that ``size`` does not divide, else None."""
    x = u.args[0] if u.args else None
    have = x.meta.get("fxshard_spec") if isinstance(x, fx.Node) else None
    d = shard_dim(have[tp]) if isinstance(have, tuple) else None
    if u.target not in _RESHAPES or d is None or not isinstance(u.meta.get("val"), torch.Tensor):
        return None
    in_shape, out_shape = tuple(x.meta["val"].shape), tuple(u.meta["val"].shape)
    before = math.prod(in_shape[:d])
    heads = next((n for e, n in enumerate(out_shape) if math.prod(out_shape[:e]) == before
                  and (n != 1 or e + 1 < len(out_shape) and math.prod(out_shape[e:e + 2]) ==
                       in_shape[d])), None)
    if heads is None or heads == in_shape[d] or heads % size == 0:
        return None
    kind = _heads_kind(u)
    kind = kind if heads > 1 else kind[:-1]
    split = f"({u.name} splits it into {heads} head{'s' * (heads > 1)} of {in_shape[d] // heads})"
    if heads < size:
        return f"tp={size} exceeds the {heads} {kind} {split}"
    return f"the {heads} {kind} do not divide by tp={size} {split}"



def _part_nodes(lin: fx.Node, tp: int) -> list[tuple[int, fx.Node]] | None:
    """``(part index, node)`` for each value cut out of the fused output of ``lin`` (strided on
    mesh axis index ``tp``) by a slice/split into exactly one part, or None when a cut takes
    several parts."""
    from .rules.linear import split_intervals
    out, frontier, seen = [], [lin], {lin}
    while frontier:
        cur = frontier.pop()
        p = cur.meta.get("fxshard_spec")
        if not isinstance(p, tuple) or not isinstance(p[tp], StridedShard):
            continue
        p = p[tp]
        bounds = [0]
        for k in p.parts:
            bounds.append(bounds[-1] + k)
        for u in cur.users:
            iv = split_intervals(u, p.dim) if u.op == "call_function" and u.args and \
                u.args[0] is cur else None
            if iv is None:
                if u not in seen and isinstance(u.meta.get("fxshard_spec"), tuple):
                    seen.add(u)
                    frontier.append(u)
                continue
            pieces = [u] if u.target is torch.ops.aten.slice.Tensor else \
                [g for i in range(len(iv)) for g in u.users
                 if g.target is operator.getitem and g.args[1] == i]
            if len(pieces) != len(iv):
                return None
            for (a, b), g in zip(iv, pieces):
                if a not in bounds or bounds.index(a) + 1 >= len(bounds) or \
                        bounds[bounds.index(a) + 1] != b:
                    return None
                out.append((bounds.index(a), g))
    return out



def _parts_to_keep_whole(lin: fx.Node, tp: int, size: int, have: frozenset
                         ) -> tuple[frozenset, str] | None:
    """The parts of the fused projection ``lin`` to hold whole on ``tp`` (``have`` and those
    gathered before use because their heads do not split), with the reason, when some part
    still splits; else None (the whole weight is replicated)."""
    spec = lin.meta.get("fxshard_spec")
    if not isinstance(spec, tuple) or not isinstance(spec[tp], StridedShard):
        return None
    pieces = _part_nodes(lin, tp)
    if not pieces:
        return None
    gathered = {}
    for j, g in pieces:
        u = _gathered_before_use(g, tp)
        if u is not None and j not in have:
            views = [v for v in g.users if v.target in _RESHAPES]
            why = next((r for v in views if (r := _heads_reason(v, tp, size))), None) or \
                _kv_heads_reason(g, size)
            if why is None:
                # only heads that tp cannot split are kept whole: another gathered part (MLA's
                # rotary key) would leave the rest of the part's path partly sharded
                return None
            gathered[j] = why
    whole = have | frozenset(gathered)
    if not gathered or len(whole) >= len(spec[tp].parts):
        return None
    return whole, "; ".join(f"part {j}: {why}" for j, why in sorted(gathered.items()))



def _attention_role(node: fx.Node, budget: int = 32) -> tuple[fx.Node, str] | None:
    """The first attention ``node``'s value reaches (through views and elementwise ops) and
    as which of its ``"query"``, ``"key"``, ``"value"``, else None."""
    from .rules.attention import sdpa_args
    frontier, seen = [node], {node}
    while frontier and budget > 0:
        cur = frontier.pop(0)
        budget -= 1
        for u in cur.users:
            if u.target is torch.ops.aten.scaled_dot_product_attention.default:
                a = sdpa_args(u)
                role = next((r for r in ("key", "value", "query") if cur is a[r]), None)
                if role is not None:
                    return u, role
            elif u not in seen and u.op == "call_function":
                seen.add(u)
                frontier.append(u)
    return None


def _kv_heads_reason(node: fx.Node, size: int) -> str | None:
    """``tp=2 exceeds the 1 KV head (...)`` when ``node``'s value reaches attention as its key
    or value with a number of heads ``size`` does not divide: a part cut out of a fused
    projection already head-shaped (GPTBigCode's ``c_attn(x).unsqueeze(1).split(..)``, HF
    Falcon's ``view(.., heads + 2, d).split(..)``), where no later reshape names the heads;
    else None."""
    from .rules.attention import sdpa_args
    found = _attention_role(node)
    if found is None or found[1] == "query":
        return None
    u, role = found
    hkv = sdpa_args(u)["key"].meta["val"].shape[1]
    if hkv % size == 0:
        return None
    heads = f"{hkv} KV head{'s' * (hkv > 1)}"
    if hkv < size:
        return f"tp={size} exceeds the {heads} ({node.name} reaches {u.name} as its {role})"
    return f"the {heads} do not divide by tp={size} ({node.name} reaches {u.name})"


def _heads_kind(node: fx.Node) -> str:
    """"KV heads" or "query heads" when ``node``'s value reaches attention as its key/value or
    its query (through views and elementwise ops), else "heads"."""
    found = _attention_role(node)
    if found is None:
        return "heads"
    return "query heads" if found[1] == "query" else "KV heads"



def _list_replicated(gm: fx.GraphModule, ctx: PassCtx, tp: int, why: dict) -> None:
    """Every weight matrix left whole on ``tp``, with the reason (``explain()`` lists them);
    under ``strict=True`` each one the user's plan did not ask for is an error."""
    ctx.replicated.clear()
    layered: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxshard_param")
        val = node.meta.get("val")
        if fqn is None or val is None or val.dim() < 2 or not node.users or \
                not isinstance(node.meta["fxshard_spec"][tp], Replicate):
            continue
        if ctx.plan_for(fqn) is not None:
            ctx.replicated.append((fqn, "plan= asks for it"))
            continue
        u = next(iter(node.users))
        if ctx.embedding_style == "replicate" and all(
                v.target is torch.ops.aten.embedding.default and v.args[0] is node
                for v in node.users):
            ctx.replicated.append((fqn, "embedding='replicate' asks for it"))
            continue
        reason = why.get(fqn, f"its consumer {u.name} ({u.target}) needs it whole")
        if val.dim() == 3 and u.target is torch.ops.aten.index.Tensor and u.args[0] is node:
            reason += (" (whole expert matrices picked per token, HuggingFace's "
                       "experts_implementation='batched_mm'; the default 'grouped_mm' shards "
                       "each expert's intermediate dim)")
        ctx.replicated.append((fqn, reason))
        if _in_layer(fqn):
            layered.append((fqn, reason))
        if ctx.strict:
            module = fqn.rpartition(".")[0]
            raise NotImplementedError(
                f"fxshard.parallelize(strict=True): weight {fqn} {tuple(val.shape)} stays whole "
                f"on mesh axis 'tp' of size {ctx.mesh.axis_size(TP)} (mesh "
                f"{ctx.mesh.describe()}): {reason}. Accept it with "
                f"plan={{{module!r}: 'replicate'}} or drop strict=True.")
    _warn_whole(layered, ctx, ctx.mesh.axis_size(TP))



def _in_layer(fqn: str) -> bool:
    """``fqn`` is inside one of several repeated blocks (a numbered module: ``layers.3.``)."""
    return any(part.isdigit() for part in fqn.split(".")[:-1])



def _warn_whole(layered: list, ctx: PassCtx, size: int) -> None:
    """One warning per program listing the repeated layers' weight matrices kept whole on tp
    (grouped by layer pattern), each with its reason, and the fixes."""
    if not layered:
        return
    groups: dict[str, list] = {}
    for fqn, reason in layered:
        pattern = ".".join("*" if p.isdigit() else p for p in fqn.split("."))
        groups.setdefault(pattern, []).append(reason)
    lines = [f"  {pat} ({len(rs)} layer{'s' * (len(rs) > 1)}): {rs[0]}"
             for pat, rs in groups.items()]
    modules = {pat.rpartition(".")[0]: "replicate" for pat in groups}
    warnings.warn(
        f"fxshard: {len(layered)} weight matrices of repeated layers stay whole on mesh axis "
        f"'tp' of size {size} (mesh {ctx.mesh.describe()}): every tp rank holds and computes "
        f"them in full.\n" + "\n".join(lines) + "\n"
        f"Shard them with plan= or a sharding rule (fxshard.passes.rules.rule) for the op "
        f"named; accept them with plan={modules!r} (silences this); strict=True makes it an "
        f"error.", WholeWeightWarning, stacklevel=caller_level())
