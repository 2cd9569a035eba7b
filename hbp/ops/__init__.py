"""hbp.ops: memory-efficient operators.

`chunked_cross_entropy(hidden, weight, target, *, bias=None, chunk_size=None,
ignore_index=-100, reduction="mean", label_smoothing=0.0)` is the LM head + cross-entropy
without the [tokens, vocab] logits (see `hbp.ops.chunked_ce`).
"""

from hbp.ops.chunked_ce import DEFAULT_CHUNK_BYTES, chunked_cross_entropy, default_chunk_size

__all__ = ["DEFAULT_CHUNK_BYTES", "chunked_cross_entropy", "default_chunk_size"]
