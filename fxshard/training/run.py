"""One pipeline training step in progress: what each action reads, makes and hands on.

``F(k, i)`` runs stage ``k``'s forward on microbatch ``i`` with the values it receives (a
simulated mesh: the producer's output itself; a real one: ``irecv`` from the producer's ``pp``
rank, tagged by value, microbatch and direction, so messages between two ranks match whatever
order the schedule runs them in) and keeps the saved activations until ``B(k, i)``; the last
stage's output goes to the loss (``train_step``) or to the caller (``pm(x)``). ``B(k, i)``
takes the summed gradients of the values stage ``k`` sent (from every consumer) and hands the
gradients of the values it received back to their producers. Saved bytes alive per rank are
counted at every action: ``peak`` is the most at once.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..mesh import PP
from .rank_blocks import storage_bytes

__all__ = ["StepRun"]

_WHERE = "fxshard.training.pipeline"
_MODEL_LOSS = "labels"                           # train_step(labels=) without a loss_fn
_OUT_TAG, _LOSS_TAG = 1 << 24, (1 << 24) - 1    # above every activation's and gradient's


class StepRun:
    def __init__(self, trainer, staged, flats: list):
        self.t, self.staged, self.flats = trainer, staged, flats
        self.m = len(flats)
        self.n_stages = len(staged.forwards)
        self.last = self.n_stages - 1
        self.values = [{} for _ in flats]     # mb -> value name -> tensor
        self.grads = [{} for _ in flats]      # mb -> (value name, consumer stage) -> gradient
        self.saved: dict = {}                 # (stage, mb) -> rank -> saved tensors
        self.bytes: dict = {}                 # (stage, mb) -> global rank -> bytes
        self.alive: dict = {}
        self.peak: dict = {}
        self.outs: list = [None] * self.m
        self.out_grads: list = [None] * self.m
        self.losses: list = []
        self.loss_fn, self.targets = None, None
        self.producer = {n: k for k, sf in enumerate(staged.forwards) for n in sf.sends}
        self.consumers = {n: [k for k, sf in enumerate(staged.forwards) if n in sf.receives]
                          for n in self.producer}
        self.index = {n: j for j, n in enumerate(self.producer)}
        self._pending = []

    # -- messages (a real mesh) -------------------------------------------------------------
    def _local(self, k: int) -> bool:
        return self.t._mine(k)

    def _tag(self, name, mb, consumer, backward) -> int:
        return 2 * ((mb * self.n_stages + consumer) * len(self.index) + self.index[name]) + \
            int(backward) + 1

    def _group(self):
        return self.t.mesh.get_group(PP)

    def _send(self, x, stage, tag):
        import torch.distributed as dist
        payload = x.detach().contiguous()
        work = dist.isend(payload, group=self._group(), group_dst=stage % self.t.pp, tag=tag)
        self._pending.append((work, payload))

    def _recv(self, shape, dtype, stage, tag):
        import torch.distributed as dist
        out = torch.empty(shape, dtype=dtype, device=torch.device(self.t.spec.device_type))
        dist.irecv(out, group=self._group(), group_src=stage % self.t.pp, tag=tag).wait()
        return out

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    # -- actions ------------------------------------------------------------------------
    def do(self, act) -> None:
        kind, k, i = act
        (self._forward if kind == "F" else self._backward)(k, i)

    def _forward(self, k: int, i: int) -> None:
        sf = self.staged.forwards[k]
        vals = self.values[i]
        for name, (shape, dtype) in zip(sf.receives, sf.received):
            if name not in vals:
                vals[name] = self._recv(shape, dtype, self.producer[name],
                                        self._tag(name, i, k, False))
        outs, saved = self.t._stage_forward(k, self.staged, self.flats[i], vals)
        self.saved[(k, i)] = saved
        self._count(k, i, saved)
        if k < self.last:
            for name, v in zip(sf.sends, outs):
                vals[name] = v
                for c in self.consumers[name]:
                    if not self._local(c):
                        self._send(v, c, self._tag(name, i, c, False))
            return
        self.outs[i] = outs
        if self.loss_fn is not None:
            self._loss(i, outs)

    def _loss(self, i: int, outs) -> None:
        leaves = [o.detach().requires_grad_(True) if isinstance(o, torch.Tensor) and
                  o.is_floating_point() else o for o in outs]
        with torch.enable_grad():
            out = pytree.tree_unflatten(list(leaves), self.staged.traced.out_spec)
            target = self.targets[i] if self.targets is not None else None
            # the microbatch's share of the whole batch's loss (training/microbatch_loss)
            if self.loss_fn is _MODEL_LOSS:     # HF's labels=: the model's own loss
                loss = out["loss"] * self.weights[i]
            else:
                loss = (self.loss_fn(out, target) if target is not None else
                        self.loss_fn(out)) * self.weights[i]
            diff = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            got = iter(torch.autograd.grad(loss, diff, allow_unused=True))
        self.out_grads[i] = [next(got) if isinstance(x, torch.Tensor) and x.requires_grad
                             else None for x in leaves]
        self.losses.append(loss.detach())

    def _backward(self, k: int, i: int) -> None:
        sf, program = self.staged.forwards[k], self.staged.programs[k]
        outs_meta = self._out_meta(k)
        tangents = []
        for idx in program.split.tangents:
            if k == self.last:
                g = self.out_grads[i][idx]
            else:
                name = sf.sends[idx]
                g = None
                for c in self.consumers[name]:
                    part = self.grads[i].pop((name, c), None)
                    if part is None and not self._local(c):
                        shape, dtype = outs_meta[idx]
                        part = self._recv(shape, dtype, c, self._tag(name, i, c, True))
                    if part is not None:
                        g = part if g is None else g + part
            if g is None:
                shape, dtype = outs_meta[idx]
                g = torch.zeros(shape, dtype=dtype, device=torch.device(self.t.spec.device_type))
            tangents.append(g)
        saved = self.saved.pop((k, i))
        got = self.t._stage_backward(k, self.staged, saved, tangents)
        self._uncount(k, i)
        for name, g in got.items():
            if g is None:
                continue
            p = self.producer[name]
            if self._local(p):
                self.grads[i][(name, k)] = g
            else:
                self._send(g, p, self._tag(name, i, k, True))

    def probe_output(self, g: torch.Generator, device) -> object:
        """One microbatch's output with random floating leaves from ``g`` (fp32), zeros for
        the others: what :func:`fxshard.training.microbatch_loss.microbatch_weights`
        evaluates the loss on."""
        leaves = []
        for meta in self._out_meta(self.last):
            if meta is None:
                leaves.append(None)
                continue
            shape, dtype = meta
            leaves.append(torch.randn(shape, generator=g, device=device)
                          if dtype.is_floating_point else
                          torch.zeros(shape, dtype=dtype, device=device))
        return pytree.tree_unflatten(leaves, self.staged.traced.out_spec)

    def _out_meta(self, k: int) -> list:
        out = next(n for n in reversed(self.staged.forwards[k].traced.gm.graph.nodes)
                   if n.op == "output")
        return [(tuple(a.meta["val"].shape), a.meta["val"].dtype)
                if isinstance(a, torch.fx.Node) else None for a in pytree.tree_leaves(out.args[0])]

    # -- memory -------------------------------------------------------------------------
    def _global(self, k: int, sub_rank: int) -> int:
        c = list(self.t.sub.coords(sub_rank))
        c[self.t.spec.axis_names.index(PP)] = k % self.t.pp
        return self.t.spec.rank_of(c)

    def _count(self, k, i, saved) -> None:
        self.bytes[(k, i)] = {self._global(k, r): storage_bytes(s) for r, s in saved.items()}
        for g, b in self.bytes[(k, i)].items():
            self.alive[g] = self.alive.get(g, 0) + b
            self.peak[g] = max(self.peak.get(g, 0), self.alive[g])

    def _uncount(self, k, i) -> None:
        for g, b in self.bytes.pop((k, i)).items():
            self.alive[g] -= b

    # -- results ------------------------------------------------------------------------
    def assembled_outputs(self) -> list:
        """The last stage's outputs, microbatches joined on dim 0 (a real mesh: sent from the
        last stage's ranks to every other ``pp`` rank)."""
        if not self._local(self.last):
            meta = self._out_meta(self.last)
            self.outs = [[self._recv(*mt, self.last, _OUT_TAG + i * len(meta) + j)
                          if mt is not None else None for j, mt in enumerate(meta)]
                         for i in range(self.m)]
        elif not self.t._simulated:
            for r in range(self.t.pp - 1):
                for i, outs in enumerate(self.outs):
                    for j, o in enumerate(outs):
                        if isinstance(o, torch.Tensor):
                            self._send(o, r, _OUT_TAG + i * len(outs) + j)
            self.flush()
        if self.m == 1:
            return list(self.outs[0])
        joined = []
        for parts in zip(*self.outs):
            x = parts[0]
            if isinstance(x, torch.Tensor) and x.dim() == 0:
                raise NotImplementedError(
                    f"{_WHERE}: pm(x) with microbatches={self.m} returns a scalar output "
                    f"(HF's loss from labels=) per microbatch; compute the loss on the "
                    f"logits, or use pm.train_step(..., loss_fn=)")
            joined.append(torch.cat(parts, 0) if isinstance(x, torch.Tensor) else x)
        return joined

    def cut_outputs(self, grads: list) -> list:
        """The gradient of the whole output cut into the microbatches'."""
        if self.m == 1:
            return [list(grads)]
        return [[g.chunk(self.m, 0)[i] if isinstance(g, torch.Tensor) else None
                 for g in grads] for i in range(self.m)]

    def total_loss(self) -> torch.Tensor:
        """The step's loss: the sum of the microbatches' (each times its weight);
        a real mesh: computed on the last stage, sent to the others."""
        if self._local(self.last):
            total = torch.stack(self.losses).sum()
            if not self.t._simulated:
                for r in range(self.t.pp - 1):
                    self._send(total.float(), r, _LOSS_TAG)
                self.flush()
            return total
        return self._recv((), torch.float32, self.last, _LOSS_TAG)
