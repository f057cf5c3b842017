"""Dropout in training: masks that do not depend on the mesh.

Every random site of the forward export (``aten.dropout`` with ``p > 0`` in train mode, and
the probabilities of an ``aten.scaled_dot_product_attention`` with ``dropout_p > 0``, written
out as matmul / softmax / matmul) gets a fixed *site index* (its place in the whole model's
forward order) and draws its keep-mask with ``fxshard::dropout_mask``, from one *step seed*
that is a user input of the program::

    before: dropout = dropout(add_1, 0.1, True)
    after:  dropout_mask = fxshard.dropout_mask(dropout_seed, 0, [4, 6, 48], 0.1, cpu)
            mul = mul(add_1, dropout_mask); dropout = mul(mul, 1.1111111111111112)

The mask is drawn with the *global* shape (the whole batch, every head, the whole sequence)
from a private ``torch.Generator`` on the value's device seeded from (step seed, site); it is
a Replicate value, so the propagation slices it like any replicated operand to the placement
of the value it multiplies (tp's heads, dp/fsdp's batch rows, CP's sequence blocks, zigzag
included). Masks thus agree wherever a value is replicated and differ where it is sharded,
and every mesh computes what one device computes with the same masks
(:func:`same_masks` runs the single-device model so). A pipeline stage's program draws the
whole batch's mask and keeps its microbatch's rows of dim 0 (the seed carries the
microbatch). ``recompute="layers"`` redraws the same mask from the saved seed.

Cost: each site draws a full-shape ``rand`` on every rank (transient; the saved value is the
rank's bool slice): ``world`` times the random numbers of one device, no communication.
One step seed per forward call comes from torch's default generator; on a real mesh it is
broadcast from global rank 0 (one 8-byte collective per step), so every process agrees.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ops.dropout import draw_mask, dropout_mask, pack_seed  # noqa: F401 (re-exported)
from ..passes.rules import Decision, rule
from ..placement import R

aten = torch.ops.aten

__all__ = ["add_dropout_sites", "check_dropout_mesh", "draw_mask", "dropout_mask", "same_masks", "step_seed",
           "pack_seed", "seeded"]

_WHERE = "fxshard.training"
_SDPA = aten.scaled_dot_product_attention.default
_RANDOM = ("bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randperm",
           "normal", "uniform", "exponential", "multinomial", "native_dropout")


def step_seed(mesh=None) -> int:
    """One step seed from torch's default generator; on a real (torch.distributed) mesh the
    global rank 0's, broadcast to every process."""
    seed = torch.randint(0, 1 << 38, (1,), dtype=torch.int64, device="cpu")  # the default CPU generator
    if mesh is not None:
        import torch.distributed as dist
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        seed = seed.to(device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


def seeded(flats: list, mesh=None) -> list:
    """A pipeline step's microbatches' flat inputs, each with the seed input: one step seed
    for them all, each told its microbatch (its rows of the whole batch's masks)."""
    step = step_seed(mesh)
    return [[*f, pack_seed(step, i, len(flats))] for i, f in enumerate(flats)]


@rule(torch.ops.fxshard.dropout_mask.default)
def dropout_mask_rule(node: fx.Node, ins: list, ctx) -> Decision:
    """Drawn whole on every rank (the same numbers): Replicate; its users slice it."""
    return Decision(ins=[R] * len(ins), out=R)


# -- the rewrite of the forward export ----------------------------------------------------
def _args(node: fx.Node, names: list, defaults: dict) -> dict:
    out = dict(defaults)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


class _Emit:
    """Insert aten nodes before ``at`` with ``val`` computed in the export's fake mode and
    ``at``'s module stack (so recompute finds the layer)."""

    def __init__(self, graph: fx.Graph, at: fx.Node):
        from torch._guards import detect_fake_mode
        self.graph, self.at = graph, at
        self.mode = detect_fake_mode([a.meta.get("val") for a in at.all_input_nodes])

    def __call__(self, op, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(op, args, kwargs)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.at.meta:
                node.meta[key] = self.at.meta[key]
        val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a   # noqa: E731
        with self.mode or contextlib.nullcontext():
            node.meta["val"] = op(*[val(a) if not isinstance(a, (list, tuple)) else
                                    type(a)(val(x) for x in a) for a in args],
                                  **{k: val(v) for k, v in kwargs.items()})
        return node


def _apply(emit: _Emit, x: fx.Node, seed: fx.Node, site: int, p: float) -> fx.Node:
    val = x.meta["val"]
    mask = emit(torch.ops.fxshard.dropout_mask.default, seed, site, list(val.shape), float(p),
                val.device)
    if p >= 1:
        return emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, mask), 0.0)
    return emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, mask), 1.0 / (1.0 - p))


def _sdpa(emit: _Emit, node: fx.Node, seed: fx.Node, site: int, where: str) -> fx.Node:
    """SDPA with ``dropout_p``: its math with the probabilities' mask drawn as a site."""
    a = _args(node, ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"],
              dict(attn_mask=None, is_causal=False, scale=None, enable_gqa=False))
    q, k, v = a["query"], a["key"], a["value"]
    qv, kv = q.meta["val"], k.meta["val"]
    if qv.dim() < 2 or qv.shape[:-2] != kv.shape[:-2] and not a["enable_gqa"]:
        raise NotImplementedError(f"{where}: attention {node.name} with dropout_p has "
                                  f"query {tuple(qv.shape)} and key {tuple(kv.shape)}")
    if a["enable_gqa"] and qv.shape[-3] != kv.shape[-3]:
        rep = qv.shape[-3] // kv.shape[-3]
        k = emit(aten.repeat_interleave.self_int, k, rep, -3)
        v = emit(aten.repeat_interleave.self_int, v, rep, -3)
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qv.shape[-1])
    s = emit(aten.mul.Tensor, emit(aten.matmul.default, q,
                                   emit(aten.transpose.int, k, -2, -1)), scale)
    mask = a["attn_mask"]
    if a["is_causal"]:
        ones = emit(aten.ones.default, [qv.shape[-2], kv.shape[-2]], dtype=torch.bool,
                    device=qv.device)
        mask = emit(aten.tril.default, ones)
    if mask is not None and mask.meta["val"].dtype == torch.bool:
        s = emit(aten.masked_fill.Scalar, s, emit(aten.logical_not.default, mask),
                 float("-inf"))
    elif mask is not None:
        s = emit(aten.add.Tensor, s, mask)
    probs = emit(aten.softmax.int, s, -1)
    return emit(aten.matmul.default, _apply(emit, probs, seed, site, a["dropout_p"]), v)


def sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, *, keep=None):
    """The single-device math :func:`add_dropout_sites` writes for SDPA with dropout
    (``keep``: the probabilities' mask)."""
    q, k, v = query, key, value
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                               device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        s = s.masked_fill(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:
        s = s + attn_mask
    probs = s.softmax(-1)
    factor = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
    return torch.matmul(probs * keep * factor, v)


def _active(node: fx.Node) -> float:
    """The node's dropout probability when it draws random numbers (else 0)."""
    if node.target is aten.dropout.default:
        a = _args(node, ["input", "p", "train"], dict(p=0.5, train=True))
        return float(a["p"]) if a["train"] else 0.0
    if node.target is _SDPA:
        return float(_args(node, ["query", "key", "value", "attn_mask", "dropout_p"],
                           dict(dropout_p=0.0))["dropout_p"])
    return 0.0


def add_dropout_sites(gm: fx.GraphModule, n_flat: int, where: str = _WHERE) -> int | None:
    """Rewrite the forward export's random sites (module docstring). Returns the seed's user
    input index (``n_flat``: after the user's flat inputs) or None without any site."""
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and _active(n) > 0]
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if n.op == "call_function" and name in _RANDOM:
            raise NotImplementedError(
                f"{where}: the forward draws random numbers with {n.target} at {n.name}; "
                f"only dropout (aten.dropout, SDPA's dropout_p) has masks that agree across "
                f"ranks. Draw them outside the model or call model.eval()")
    if not sites:
        return None
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        seed = gm.graph.placeholder("dropout_seed")
    seed.meta.update(fxshard_input=n_flat, fxshard_seed=True)
    mode = _Emit(gm.graph, sites[0]).mode
    with mode or contextlib.nullcontext():
        seed.meta["val"] = torch.empty((), dtype=torch.int64, device="cpu")
    for site, node in enumerate(sites):
        emit = _Emit(gm.graph, node)
        if node.target is _SDPA:
            out = _sdpa(emit, node, seed, site, where)
        else:
            out = _apply(emit, node.args[0], seed, site, _active(node))
        if node.target is _SDPA:
            out.meta["fxshard_dropout_attention"] = node.name
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return n_flat


def check_dropout_mesh(gm: fx.GraphModule, mesh, where: str = _WHERE) -> None:
    """SDPA with ``dropout_p`` is written out as matmul / softmax / matmul: on a CP axis that
    would gather the whole sequence's keys where ring / Ulysses attention moves blocks; a
    clear error instead."""
    from ..mesh import RING, ULYSSES
    cp = [(a, n) for a, n in zip(mesh.axis_names, mesh.shape) if n > 1 and a in (RING, ULYSSES)]
    att = next((n.meta["fxshard_dropout_attention"] for n in gm.graph.nodes
                if n.meta.get("fxshard_dropout_attention")), None)
    if cp and att is not None:
        raise NotImplementedError(
            f"{where}: attention {att} (aten.scaled_dot_product_attention) has dropout_p > 0 "
            f"on mesh {mesh.describe()} (axis {cp[0][0]!r} of size {cp[0][1]}); ring and "
            f"Ulysses attention have no dropout on their probabilities. Set the attention "
            f"dropout to 0 (e.g. attn_pdrop=0.0 / attention_dropout=0.0; other dropouts may "
            f"stay) or train without {cp[0][0]}")


# -- the single-device reference ------------------------------------------------------------
class same_masks(TorchFunctionMode):
    """Run the single-device model with the masks fxshard draws: ``torch.manual_seed(s);
    with same_masks(): model(x)`` equals ``torch.manual_seed(s); pm(x)`` on any mesh
    (``F.dropout`` and SDPA's ``dropout_p`` in call order are the sites). One step seed per
    ``with`` block, as one forward call of ``pm``; ``step=`` gives it instead."""

    def __init__(self, step: int | None = None):
        super().__init__()
        self.step = step_seed() if step is None else step
        self.site = 0

    def _keep(self, shape, p, device):
        keep = draw_mask(self.step, self.site, shape, p, device)
        self.site += 1
        return keep

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.dropout:
            a = dict(zip(["input", "p", "training", "inplace"], args), **kwargs)
            p, x = a.get("p", 0.5), a["input"]
            if a.get("training", True) and p > 0:
                factor = 0.0 if p >= 1 else 1.0 / (1.0 - p)
                return x * self._keep(x.shape, p, x.device) * factor
        if func is F.scaled_dot_product_attention:
            names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
            a = dict(zip(names, args), **kwargs)
            if a.get("dropout_p", 0.0) > 0:
                q, k = a["query"], a["key"]
                shape = (*q.shape[:-1], k.shape[-2])
                keep = self._keep(shape, a["dropout_p"], q.device)
                return sdpa_reference(**a, keep=keep)
        return func(*args, **kwargs)
