"""Context parallelism over the mesh axis `context`: the whole model's sequence split over c ranks.

Every activation holds S/c of the sequence on each rank — embedding, every block, final norm, head and loss — so
activation memory, attention's included, divides by c. Only attention mixes tokens; everything else is per token.

**Load balance (zigzag).** Under a causal mask query i attends to i + 1 keys, so contiguous shards would give the
last rank about 2c − 1 times the first one's (query, key) pairs. The sequence is cut into 2c chunks of n = S/(2c)
and rank r holds chunks r and 2c−1−r (a cheap early chunk with a costly late one), so every rank has the same
number of unmasked pairs (`unmasked_pairs`). The reordering is internal: tokens, targets and positions are taken
from the natural-order rows with `shard` (every context rank holds the whole rows: 4 bytes a token), positions stay
the global ones (RoPE and learned embeddings see the true position), and the loss is a mean over tokens, which the
order does not change.

**All-gather K/V** (the Llama 3 recipe, `impl = "all_gather"`). Each layer gathers the keys and values of the
whole sequence over `context`, [B, S/c, K, E] → [B, S, K, E] in rank order (rank r's zigzag chunks at rows
r·S/c …), and attends its local queries to them under the causal (and sliding-window) mask written from the global
positions. Autodiff transposes the all-gather into the reduce-scatter of dK and dV. Bytes per layer and rank: the
forward gathers (c−1)/c · 2·S·K·E elements, the backward reduce-scatters as many — kv heads only (GQA's saving).
The score matrix per rank is [S/c, S]: 1/c of the unsharded one.

Runs inside `jax.shard_map` with `axis` bound, composed with tensor parallelism (heads over `tensor`, so K/V of
the local kv heads are gathered) and sequence parallelism (which splits each rank's S/c tokens further over
`tensor` outside the tensor-parallel regions; attention sees the rank's S/c after the SP gather).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
IMPLS = ("all_gather",)


@functools.lru_cache(maxsize=None)
def zigzag(seq_len: int, ranks: int) -> np.ndarray:
    """int32 [c, S/c]: the global positions rank r holds, chunks r then 2c−1−r of n = S/(2c)."""
    n = seq_len // (2 * ranks)
    if n * 2 * ranks != seq_len:
        raise ValueError(f"zigzag needs the sequence length {seq_len} divisible by 2 × {ranks} ranks")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * ranks, n)
    return np.stack([np.concatenate([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)])


def contiguous(seq_len: int, ranks: int) -> np.ndarray:
    """int32 [c, S/c]: rank r holds positions r·S/c … (r+1)·S/c − 1 (the unbalanced layout, for comparison)."""
    return np.arange(seq_len, dtype=np.int32).reshape(ranks, seq_len // ranks)


def unmasked_pairs(layout: np.ndarray, window: int = 0) -> np.ndarray:
    """Per rank, the (query, key) pairs the causal mask (within `window` keys, 0: none) keeps for its queries
    against the whole sequence: query i sees keys max(0, i − W + 1) … i, min(i + 1, W) of them. → int [c]."""
    seen = layout + 1 if not window else np.minimum(layout + 1, window)
    return seen.sum(axis=1)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Context parallelism over one mesh axis (see the module docstring). degree: c; window: the model's sliding
    window (0: none), applied in the mask this strategy writes."""

    axis: str = "context"
    degree: int = 2
    impl: str = "all_gather"
    window: int = 0

    def shard(self, x: Array) -> Array:
        """This rank's zigzag part of a full-sequence array: [B, S, …] → [B, S/c, …] (no communication)."""
        table = jnp.asarray(zigzag(x.shape[1], self.degree))
        return jnp.take(x, table[jax.lax.axis_index(self.axis)], axis=1)

    def attention(self, kernel: Callable[[Array, Array, Array, Array | None], Array], q: Array, k: Array, v: Array,
                  mask: Array | None) -> Array:
        """Local queries q [B, S/c, H, E] over the whole sequence's keys: k, v [B, S/c, K, E] are this rank's."""
        if mask is not None:
            raise ValueError("context parallelism writes the causal mask from global positions; a mask of the "
                             "caller's (packed segments, a KV cache) is not supported with parallel.context > 1")
        seq_len = q.shape[1] * self.degree
        layout = zigzag(seq_len, self.degree)
        k_all = jax.lax.all_gather(k, self.axis, axis=1, tiled=True)  # [B, S, K, E], rank r's tokens at r·S/c …
        v_all = jax.lax.all_gather(v, self.axis, axis=1, tiled=True)
        q_pos = jnp.asarray(layout)[jax.lax.axis_index(self.axis)][:, None]  # [S/c, 1]
        k_pos = jnp.asarray(layout.reshape(-1))[None, :]  # [1, S]: the gathered order
        keep = k_pos <= q_pos
        if self.window:
            keep &= q_pos - k_pos < self.window
        return kernel(q, k_all, v_all, keep[None, None])
