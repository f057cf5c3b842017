"""The hand-written Megatron baseline the benchmarks compare fxshard with.

:class:`MegatronTP` holds the collectives (with Megatron-LM's f/g backward as autograd
functions when trainable); :class:`MegatronLlama` is the bundled or HuggingFace Llama on weight
slices (column/row-parallel linears, its own KV cache for decoding, a vocab-parallel
cross-entropy), :func:`megatron_step` one forward + backward + optimizer step (data parallel over
a second group), and :class:`MegatronBlocks` the seed lesson's TransformerBlocks.
:func:`shard_rows` / :func:`shard_cols` cut a weight for a rank; :func:`wait_collective` waits
for a functional collective's result. Scripts import them through :mod:`benchmarks.common`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.timing_tables import now

__all__ = ["MegatronTP", "MegatronLlama", "MegatronBlocks", "megatron_step", "shard_rows",
           "shard_cols", "wait_collective"]


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    """``t``, waited for where it is a functional collective's pending result."""
    import torch.distributed._functional_collectives as funcol
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _even(w: torch.Tensor, dim: int, tp: int) -> int:
    if w.shape[dim] % tp:
        raise ValueError(f"hand-written baseline: a weight of shape {list(w.shape)} does not "
                         f"split evenly on dim {dim} over tp={tp}; pick sizes divisible by tp")
    return w.shape[dim] // tp


def shard_rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Column-parallel Linear (output features) or vocab-parallel Embedding: weight dim 0."""
    n = _even(w, 0, tp)
    return w[rank * n:(rank + 1) * n].clone()  # a copy: a dim-0 slice is a view otherwise


def shard_cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Row-parallel Linear (input features) or embedding-dim-sharded Embedding: weight dim 1."""
    n = _even(w, 1, tp)
    return w[:, rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, gradient all-reduced backward (before column-parallel)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (after row-parallel), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLast(torch.autograd.Function):
    """All-gather on the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.rank, ctx.n = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits [N, V/tp]`` (this rank's vocab slice, first id ``first``)
    against ``labels [N]`` without gathering the logits: the max, the sum of exponentials and
    the target's logit are all-reduced (Megatron-LM's vocab-parallel loss)."""

    @staticmethod
    def forward(ctx, logits, labels, first, group):
        logits = logits.float()
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        local = labels - first
        mine = (local >= 0) & (local < logits.shape[-1])
        idx = local.clamp(0, logits.shape[-1] - 1)
        target = shifted.gather(1, idx[:, None])[:, 0].masked_fill(~mine, 0.0)
        exp = shifted.exp()
        total = exp.sum(-1)
        both = torch.stack([total, target])
        dist.all_reduce(both, group=group)
        total, target = both[0], both[1]
        ctx.save_for_backward(exp.div_(total[:, None]), idx, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0]), idx] -= mine.to(grad.dtype)
        return grad.mul_(g / grad.shape[0]), None, None, None


class MegatronTP:
    """What every hand-written tensor-parallel baseline shares: this process is ``rank`` of
    ``tp`` in ``group``; the collectives, forward semantics (in-place ``dist.*``; torch's
    functional collectives with ``funcol``, a diagnostic), and with ``trainable`` Megatron-LM's
    backward as autograd functions: ``_f`` (identity forward, all-reduce backward) before a
    column-parallel block, ``_all_reduce`` (g: identity backward) after a row-parallel one,
    ``_gather_last`` (this rank's slice backward)."""

    def __init__(self, rank: int, tp: int, group=None, *, funcol: bool = False,
                 trainable: bool = False):
        self.rank, self.tp, self.group = rank, tp, group
        self.use_funcol, self.trainable = funcol, trainable

    def _f(self, x):
        return _CopyToTP.apply(x, self.group) if self.trainable else x

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            return _ReduceFromTP.apply(x, self.group)
        if self.use_funcol:
            import torch.distributed._functional_collectives as funcol
            return wait_collective(
                funcol.all_reduce(x, "sum", group=self.group or dist.group.WORLD))
        dist.all_reduce(x, group=self.group)
        return x

    def _gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            return _GatherLast.apply(x, self.group, self.rank, self.tp)
        if self.use_funcol:
            import torch.distributed._functional_collectives as funcol
            return wait_collective(funcol.all_gather_tensor(x.contiguous(), gather_dim=x.dim() - 1,
                                                  group=self.group or dist.group.WORLD))
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _params(self, tensors: list) -> list:
        return [torch.nn.Parameter(t) for t in tensors] if self.trainable else tensors


class MegatronLlama(MegatronTP):
    """A Llama (``fxshard.models.llama`` or HuggingFace's: the same state-dict names) written
    by hand for tensor parallelism over ``group`` (this process = ``rank`` of ``tp``), on
    contiguous copies of slices of ``model``'s weights (training them leaves ``model`` as it
    was): column-parallel q/k/v/gate/up (weight dim 0),
    row-parallel o/down (weight dim 1) followed by an all-reduce, ``F.scaled_dot_product_
    attention`` on the local heads, norms whole, lm_head column-parallel.

    ``embedding``: ``"embed_dim"`` (each rank holds ``hidden/tp`` columns; lookup, then an
    all-gather: what fxshard does by default), ``"vocab"`` (Megatron-LM's
    VocabParallelEmbedding: ``vocab/tp`` rows, masked lookup, all-reduce) or ``"replicate"``
    (the whole table, no collective). ``funcol``: torch's functional collectives instead of
    in-place ``dist.*`` (a diagnostic; forward only).

    - ``m(ids)``: logits ``[B, S, V]`` (all-gathered on the last dim);
    - ``m.generate(ids, new, stamps)``: greedy decoding with a static KV cache
      ``[B, kv_heads/tp, capacity, head_dim]`` per layer (written in place with
      ``index_copy_``), the last position's logits gathered; appends :func:`now` at the start,
      after the prefill and after each step to ``stamps``;
    - ``trainable=True``: the slices are ``nn.Parameter``\\s (``m.parameters()``) and the
      collectives autograd functions: Megatron-LM's f (identity forward, all-reduce backward)
      before each column-parallel block, g (all-reduce forward, identity backward) after each
      row-parallel one, the embedding's gather (slice backward); ``m.loss(ids, labels)`` is
      the vocab-parallel cross-entropy on the local logits (they are never gathered).
    """

    def __init__(self, model, rank: int, tp: int, group=None, *, embedding: str = "embed_dim",
                 funcol: bool = False, trainable: bool = False):
        if embedding not in ("embed_dim", "vocab", "replicate"):
            raise ValueError(f"MegatronLlama: embedding={embedding!r}; use 'embed_dim', "
                             f"'vocab' or 'replicate'")
        super().__init__(rank, tp, group, funcol=funcol, trainable=trainable)
        cfg = model.config
        self.cfg, self.embedding = cfg, embedding
        self.eps = cfg.rms_norm_eps
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // \
            cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.gqa = cfg.num_key_value_heads != cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads // tp
        self.hf = hasattr(model.model, "rotary_emb")  # HF's rope module; ours is a function
        if self.hf:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
            self._rotary = model.model.rotary_emb
        else:
            from fxshard.models.llama import apply_rotary_pos_emb
        self._apply_rope = apply_rotary_pos_emb
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        biases = [k for k in sd if k.endswith(".bias")]
        if biases:
            raise ValueError(f"MegatronLlama: the model has biases ({biases[0]}, ...), which "
                             f"this baseline does not apply; use a config without biases")
        if trainable and getattr(cfg, "tie_word_embeddings", False):
            raise NotImplementedError("MegatronLlama(trainable=True): tied embeddings would "
                                      "train as two parameters; use tie_word_embeddings=False")
        if cfg.num_key_value_heads % tp:
            raise ValueError(f"MegatronLlama: {cfg.num_key_value_heads} key/value heads do not "
                             f"split over tp={tp}")

        table = sd["model.embed_tokens.weight"]
        self.vocab = table.shape[0] // tp           # this rank's rows of the vocabulary
        self.first = rank * self.vocab
        self.embed = {"embed_dim": shard_cols, "vocab": shard_rows,
                      "replicate": lambda w, r, t: w.clone()}[embedding](table, rank, tp)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                wq=shard_rows(sd[p + "self_attn.q_proj.weight"], rank, tp),
                wk=shard_rows(sd[p + "self_attn.k_proj.weight"], rank, tp),
                wv=shard_rows(sd[p + "self_attn.v_proj.weight"], rank, tp),
                wo=shard_cols(sd[p + "self_attn.o_proj.weight"], rank, tp),
                wg=shard_rows(sd[p + "mlp.gate_proj.weight"], rank, tp),
                wu=shard_rows(sd[p + "mlp.up_proj.weight"], rank, tp),
                wd=shard_cols(sd[p + "mlp.down_proj.weight"], rank, tp),
                ln1=sd[p + "input_layernorm.weight"].clone(),
                ln2=sd[p + "post_attention_layernorm.weight"].clone()))
        self.norm = sd["model.norm.weight"].clone()
        self.lm_head = shard_rows(sd["lm_head.weight"], rank, tp)
        if trainable:
            P = torch.nn.Parameter
            self.embed, self.norm, self.lm_head = P(self.embed), P(self.norm), P(self.lm_head)
            self.layers = [{k: P(v) for k, v in L.items()} for L in self.layers]

    def parameters(self) -> list:
        return [self.embed, *(w for L in self.layers for w in L.values()), self.norm,
                self.lm_head]

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients over the tp group: sharded ones summed over
        ranks, replicated ones (norms; a replicated table) counted once."""
        whole = {id(self.norm), *(id(L[k]) for L in self.layers for k in ("ln1", "ln2"))}
        if self.embedding == "replicate":
            whole.add(id(self.embed))
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.parameters():
            if p.grad is not None and (id(p) not in whole or self.rank == 0):
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt().item()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _embed(self, ids):
        if self.embedding == "embed_dim":
            return self._gather_last(F.embedding(ids, self.embed))
        if self.embedding == "replicate":
            return F.embedding(ids, self.embed)
        local = ids - self.first                     # Megatron-LM's VocabParallelEmbedding
        outside = (local < 0) | (local >= self.vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        x = x.masked_fill(outside[..., None], 0.0) if self.trainable else \
            x.masked_fill_(outside[..., None], 0.0)
        return self._all_reduce(x)

    def _rope(self, x, pos: int, seq: int):
        if self.hf:
            return self._rotary(x, torch.arange(pos, pos + seq, device="cpu")[None])
        from fxshard.models.llama import rope_cos_sin
        positions = None if pos == 0 else torch.arange(pos, pos + seq, device="cpu")[None]
        return rope_cos_sin(seq, self.head_dim, self.cfg.rope_theta, device=x.device,
                            dtype=x.dtype, position_ids=positions)

    def hidden(self, ids, pos: int = 0, caches=None) -> torch.Tensor:
        """The last norm's input ``[B, S, hidden]`` (replicated); ``caches``: per layer a
        ``(k, v)`` pair written at positions ``pos ..`` and attended to up to there."""
        bsz, seq = ids.shape
        d = self.head_dim
        x = self._embed(ids)
        cos, sin = self._rope(x, pos, seq)
        where = torch.arange(pos, pos + seq, device="cpu") if caches is not None else None
        for i, L in enumerate(self.layers):
            h = self._f(self._rms(x, L["ln1"]))
            q = F.linear(h, L["wq"]).view(bsz, seq, -1, d).transpose(1, 2)
            k = F.linear(h, L["wk"]).view(bsz, seq, -1, d).transpose(1, 2)
            v = F.linear(h, L["wv"]).view(bsz, seq, -1, d).transpose(1, 2)
            q, k = self._apply_rope(q, k, cos, sin)
            if caches is not None:
                kc, vc = caches[i]
                kc.index_copy_(2, where, k)
                vc.index_copy_(2, where, v)
                k, v = kc[:, :, :pos + seq], vc[:, :, :pos + seq]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, scale=self.scale,
                                               enable_gqa=self.gqa)
            o = F.linear(a.transpose(1, 2).reshape(bsz, seq, -1), L["wo"])
            x = x + self._all_reduce(o)
            h = self._f(self._rms(x, L["ln2"]))
            m = F.linear(F.silu(F.linear(h, L["wg"])) * F.linear(h, L["wu"]), L["wd"])
            x = x + self._all_reduce(m)
        return x

    def local_logits(self, x) -> torch.Tensor:
        """This rank's vocab slice of the logits of hidden states ``x``."""
        return F.linear(self._f(self._rms(x, self.norm)), self.lm_head)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self._gather_last(self.local_logits(self.hidden(ids)))

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, vocab-parallel (``labels [B, S]`` already shifted)."""
        logits = self.local_logits(self.hidden(ids))
        return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                                labels.reshape(-1), self.first, self.group)

    def _next(self, ids, pos, caches):
        x = self.hidden(ids, pos, caches)
        return self._gather_last(self.local_logits(x[:, -1])).argmax(-1)

    def generate(self, ids, new: int, stamps: list):
        bsz, prompt = ids.shape
        caches = [(torch.zeros(bsz, self.kv_heads, prompt + new, self.head_dim, device="cpu"),
                   torch.zeros(bsz, self.kv_heads, prompt + new, self.head_dim, device="cpu"))
                  for _ in self.layers]
        stamps.append(now())
        tokens = [ids]
        nxt = self._next(ids, 0, caches)
        for t in range(new - 1):
            tokens.append(nxt[:, None])
            stamps.append(now())
            nxt = self._next(nxt[:, None], prompt + t, caches)
        tokens.append(nxt[:, None])
        stamps.append(now())
        return torch.cat(tokens, 1)


class MegatronBlocks(MegatronTP):
    """:func:`tutorial_blocks` written by hand for tensor parallelism: per block, wq/wk/wv
    column-parallel (this rank's rows of each weight and bias), their sum local, wo row-parallel
    then an all-reduce and wo's whole bias; w1 column-parallel, GELU, w2 row-parallel, an
    all-reduce, w2's bias (Megatron-LM's RowParallelLinear adds the bias after the reduce): two
    all-reduces a block. ``m(x)``: ``[B, S, hidden]``, replicated."""

    def __init__(self, model, rank: int, tp: int, group=None, *, trainable: bool = False):
        super().__init__(rank, tp, group, trainable=trainable)
        self.blocks = []
        for blk in model:
            att, mlp = blk.attention, blk.mlp
            w = [shard_rows(att.wq.weight.detach(), rank, tp),
                 shard_rows(att.wk.weight.detach(), rank, tp),
                 shard_rows(att.wv.weight.detach(), rank, tp),
                 shard_rows(att.wq.bias.detach(), rank, tp),
                 shard_rows(att.wk.bias.detach(), rank, tp),
                 shard_rows(att.wv.bias.detach(), rank, tp),
                 shard_cols(att.wo.weight.detach(), rank, tp), att.wo.bias.detach().clone(),
                 shard_rows(mlp.w1.weight.detach(), rank, tp),
                 shard_rows(mlp.w1.bias.detach(), rank, tp),
                 shard_cols(mlp.w2.weight.detach(), rank, tp), mlp.w2.bias.detach().clone()]
            self.blocks.append(self._params(w))

    def parameters(self) -> list:
        return [t for b in self.blocks for t in b]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for wq, wk, wv, bq, bk, bv, wo, bo, w1, b1, w2, b2 in self.blocks:
            h = self._f(x)
            a = F.linear(h, wq, bq) + F.linear(h, wk, bk) + F.linear(h, wv, bv)
            x = self._all_reduce(F.linear(a, wo)) + bo
            h = self._f(x)
            x = self._all_reduce(F.linear(F.gelu(F.linear(h, w1, b1)), w2)) + b2
        return x


def megatron_step(m: MegatronLlama, opt, ids, labels, dp_group=None,
                  norms: list | None = None) -> float:
    """One forward + backward + optimizer step of a trainable :class:`MegatronLlama` on this
    rank's batch. With ``dp_group`` (data parallel: each dp rank holds a slice of the batch),
    the gradients are averaged over it in one flattened all-reduce (DDP's single bucket)
    before the step. With a list ``norms``, appends the global gradient norm (before the
    step). Returns this rank's loss."""
    loss = m.loss(ids, labels)
    loss.backward()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        grads = [p.grad for p in m.parameters()]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat /= dist.get_world_size(dp_group)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)
    if norms is not None:
        norms.append(m.grad_norm())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
