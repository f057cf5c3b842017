"""fxshard.ops: every ``torch.library`` op of fxshard, ``torch.ops.fxshard.*`` (schema, fake impl,
dispatch to a kernel of ``fxshard.kernels`` or to the current runtime backend).

Importing this package registers them all (``import fxshard`` does): one module per family::

    library.py      define_op / Op / direct_kernel: the thin dispatcher registration every op uses
    collectives.py  all_gather, all_reduce, reduce_scatter, all_to_all, local_shard, send, recv
                    (+ all_reduce_consuming, COLLECTIVE_OPS, is_communication, ...)
    collective_args.py  their argument checks and the buckets' flat layout
    experts.py      expert_counts, expert_dispatch, expert_combine (expert parallelism's exchanges)
    local.py        vocab_embedding, partial_from_replicate, zigzag_shard, zigzag_gather
    attention.py    attention (with its autograd kernel), attention_out
    ring.py         ring_attention (K/V around a ring_cp axis, merged by logsumexp)
    cache.py        cache_write (the KV cache, in place)
    decode.py       decode_attention, merge_pieces, sharded_argmax
    training.py     vocab_embedding_backward (training programs: the rank's rows of the gradient)
    loss.py         vocab_nll_loss_forward / _backward (the vocab-parallel loss's own targets)
    dropout.py      dropout_mask (training's dropout: a site's mask, the same on every mesh)

Imports flow one way: the graph passes, the compiler and the runtime's runners import this
package; it imports ``fxshard.kernels`` (pure math) and ``fxshard.runtime.context`` (the
current backend); neither imports it back.
"""
from fxshard.ops import (attention, cache, collectives, decode, dropout, experts, library, local,
                         loss, ring, training)
from fxshard.ops.collectives import (COLLECTIVE_OPS, POINT_TO_POINT_OPS, all_reduce_consuming,
                                     is_communication, is_point_to_point)
from fxshard.ops.library import define_op, direct_kernel

__all__ = ["COLLECTIVE_OPS", "POINT_TO_POINT_OPS", "all_reduce_consuming", "define_op",
           "direct_kernel", "is_communication", "is_point_to_point", "attention", "cache",
           "collectives", "decode", "experts", "library", "local", "loss", "ring", "training"]
