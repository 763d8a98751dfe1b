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

**Ring attention** (`impl = "ring"`, Liu et al. 2023). Each rank keeps its queries; the K/V blocks travel around
the ring of context ranks (one `ppermute` a step, c − 1 steps), and each step's partial result — attention of the
local queries over the block that is here, under the mask of the block's global positions — is merged into the
running one with the online-softmax rule (running max m and sum l: o ← o·e^(m−m') + o_i·e^(m_i−m'), the
log-sum-exp rule). Nothing S-long is ever held: per step a [S/c, S/c] score block. The backward (a custom VJP) runs
the ring again from the saved q, k, v, output and log-sum-exp: each step's dK, dV ride with their block and arrive
home after c hops. A block the mask hides entirely (a sliding window far behind, a causal block ahead) is skipped
(`lax.cond`). Bytes per layer and rank: forward (c−1)·2·(S/c)·K·E elements; backward (c−1)·2 for K, V again and c·2
for their gradients (kept in float32 on the wire).

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

from jaxpar.parallel.vma import vary, varying_axes

Array = jax.Array
NEG_INF = -1e30  # finite: a fully masked row gives exp(NEG_INF − NEG_INF) = 1 against p = 0, never nan


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Packed documents as attention's mask under context parallelism: this rank's segment ids [B, S/c] (zigzag
    order), one id per document. The strategy turns them into the mask itself — query and key in the same segment,
    the key not after the query by global slot, within the window — because the mask crosses ranks: the ring
    passes each block's ids with its K/V, the all-gather path gathers them."""

    ids: Array


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Context parallelism over one mesh axis (see the module docstring). degree: c. Each call's layer names its
    sliding window, applied in the mask this strategy writes (a model's full and windowed layers differ)."""

    axis: str = "context"
    degree: int = 2
    impl: str = "all_gather"

    def shard(self, x: Array) -> Array:
        """This rank's zigzag part of a full-sequence array: [B, S, …] → [B, S/c, …] (no communication)."""
        table = jnp.asarray(zigzag(x.shape[1], self.degree))
        return jnp.take(x, table[jax.lax.axis_index(self.axis)], axis=1)

    def attention(self, kernel: Callable[..., Array], q: Array, k: Array, v: Array, mask: Segments | None,
                  sinks: Array | None = None, window: int = 0) -> Array:
        """Local queries q [B, S/c, H, E] over the whole sequence's keys: k, v [B, S/c, K, E] are this rank's.
        mask: None (causal), or packed documents' `Segments` (this rank's ids). sinks [H] (attention sinks) or
        None: the all-gather path hands them to the kernel, the ring adds them to its softmax after the last block.
        window: the layer's sliding window (0: none)."""
        if mask is not None and not isinstance(mask, Segments):
            raise ValueError("context parallelism writes the causal mask from global positions (and packed "
                             "documents' Segments); a mask array of the caller's (a KV cache) is not supported with "
                             "parallel.context > 1")
        ids = None if mask is None else mask.ids
        if self.impl == "ring":
            if sinks is not None:  # typed like the queries: its cotangent is then summed over the ranks' queries
                sinks = _typed(sinks, q, k, v)
            return ring_attention(q, k, v, sinks, ids, self.axis, self.degree, window)
        k_all = jax.lax.all_gather(k, self.axis, axis=1, tiled=True)  # [B, S, K, E], rank r's tokens at r·S/c …
        v_all = jax.lax.all_gather(v, self.axis, axis=1, tiled=True)
        q_pos, table, _ = _positions(q.shape[1], self.axis, self.degree)
        keep = _keep(q_pos, table.reshape(-1), window)[None]  # [1, S/c, S]: keys in the gathered order
        if ids is not None:  # and in the query's document: [B, S/c, S]
            keep = keep & _same(ids, jax.lax.all_gather(ids, self.axis, axis=1, tiled=True))
        keep = keep[:, None]
        return kernel(q, k_all, v_all, keep) if sinks is None else kernel(q, k_all, v_all, keep, sinks=sinks)


# ---------------------------------------------------------------------------------------------------------------------
# Ring attention. Shapes: q [B, T, K, G, E] (H = K·G query heads, head n in kv group n // G), k and v [B, T, K, E],
# T = S/c this rank's tokens; m, l, lse [B, K, G, T] (float32).


def _keep(q_pos: Array, k_pos: Array, window: int) -> Array:
    """[T, T] bool: query position i sees key position j (j ≤ i, within the window)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window:
        keep &= q_pos[:, None] - k_pos[None, :] < window
    return keep


def _same(q_ids: Array, k_ids: Array) -> Array:
    """[B, T, S] bool: query and key in the same packed document."""
    return q_ids[:, :, None] == k_ids[:, None, :]


def _block_keep(q_pos: Array, k_pos: Array, window: int, q_ids: Array | None, k_ids: Array | None) -> Array:
    """A ring block's mask, [1 or B, 1, 1, T, T] to broadcast against the scores [B, K, G, T, T]: `_keep`, and
    with packed documents the same segment."""
    keep = _keep(q_pos, k_pos, window)[None]
    if q_ids is not None:
        keep = keep & _same(q_ids, k_ids)
    return keep[:, None, None]


def _scores(q, k, keep):
    """Masked scaled scores [B, K, G, T, T] in float32."""
    s = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32)
    return jnp.where(keep, s / np.sqrt(q.shape[-1]), NEG_INF)


def _block_forward(q, k, v, keep):
    """One block's (o unnormalised [B, T, K, G, E], running max m, sum l)."""
    s = _scores(q, k, keep)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None]) * keep
    o = jnp.einsum("bkgts,bske->btkge", p, v.astype(jnp.float32))
    return o, m, p.sum(-1)


def _typed(outputs, *inputs):
    """outputs typed as varying over every axis any of `inputs` varies over (both branches of a block's `cond` must
    return the same types, and the skipping one computes from none of them)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs))
    return jax.tree.map(lambda x: vary(x, tuple(axes)), outputs)


def _ring(x, axis: str, c: int):
    """Send to the next rank of the ring (r → r+1): what arrives is the previous rank's."""
    return jax.lax.ppermute(x, axis, [(r, (r + 1) % c) for r in range(c)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention(q: Array, k: Array, v: Array, sinks: Array | None, ids: Array | None, axis: str, c: int,
                   window: int) -> Array:
    """softmax(q·kᵀ/√E under the causal zigzag mask) v over the whole sequence, K/V passed around the ring.
    q [B, T, H, E], k, v [B, T, K, E] (this rank's T = S/c tokens, zigzag order) → [B, T, H, E] in q's dtype.
    ids [B, T] or None: packed documents' segment ids of this rank's tokens; each block's travel with its K/V (and
    its gradients in the backward), and a query sees only keys of its own segment.
    sinks [H] or None: attention sinks — each head's softmax also counts e^{sink}, which no value receives. It joins
    the running (m, l) after the last block, so lse includes it: the backward's probabilities then exclude the
    sink's share by themselves, and d sink = −Σ_t p_sink(t)·Δ(t) (Δ = Σ dO·O, the sink's value being zero)."""
    return _ring_forward(q, k, v, sinks, ids, axis, c, window)[0]


def _positions(T: int, axis: str, c: int):
    """(this rank's positions [T], table [c, T] of every rank's, this rank's index)."""
    table = jnp.asarray(zigzag(T * c, c))
    r = jax.lax.axis_index(axis)
    return table[r], table, r


def _ring_forward(q, k, v, sinks, ids, axis, c, window):
    B, T, H, E = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, E)
    q_pos, table, r = _positions(T, axis, c)
    o = jnp.zeros(qg.shape, jnp.float32)
    m = jnp.full((B, K, H // K, T), NEG_INF, jnp.float32)
    l = jnp.zeros((B, K, H // K, T), jnp.float32)
    kv, k_ids = (k, v), ids
    for i in range(c):  # at step i this rank holds the block of rank r − i
        keep = _block_keep(q_pos, table[(r - i) % c], window, ids, k_ids)

        def attend(kv, keep=keep):
            return _typed(_block_forward(qg, kv[0], kv[1], keep), qg, *kv)

        def skip(kv):
            return _typed((jnp.zeros_like(o), jnp.full_like(m, NEG_INF), jnp.zeros_like(l)), qg, *kv)

        o_i, m_i, l_i = jax.lax.cond(keep.any(), attend, skip, kv)
        m_new = jnp.maximum(m, m_i)
        a, b = jnp.exp(m - m_new), jnp.exp(m_i - m_new)
        o = o * jnp.moveaxis(a, 3, 1)[..., None] + o_i * jnp.moveaxis(b, 3, 1)[..., None]
        l, m = l * a + l_i * b, m_new
        if i < c - 1:
            kv = _ring(kv, axis, c)
            k_ids = None if ids is None else _ring(k_ids, axis, c)
    if sinks is not None:  # one more logit per head: rescale (o, l) to the new max and add e^{sink} to l
        s = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, H // K, 1), m.shape)
        m_new = jnp.maximum(m, s)
        a = jnp.exp(m - m_new)
        o, l, m = o * jnp.moveaxis(a, 3, 1)[..., None], l * a + jnp.exp(s - m_new), m_new
    out = (o / jnp.moveaxis(l, 3, 1)[..., None]).reshape(B, T, H, E)
    return out.astype(q.dtype), (q, k, v, out, m + jnp.log(l))


def _ring_fwd(q, k, v, sinks, ids, axis, c, window):
    out, residuals = _ring_forward(q, k, v, sinks, ids, axis, c, window)
    return out, (*residuals, sinks, ids)


def _ring_bwd(axis, c, window, residuals, d_out):
    q, k, v, out, lse, sinks, ids = residuals
    B, T, H, E = q.shape
    K = k.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, E)
    do = d_out.astype(jnp.float32).reshape(B, T, K, G, E)
    delta = jnp.einsum("btkge,btkge->bkgt", do, out.reshape(B, T, K, G, E))  # Σ_e dO·O per query
    q_pos, table, r = _positions(T, axis, c)
    dq = jnp.zeros(qg.shape, jnp.float32)
    # Without the barrier XLA's CSE sees the forward's K/V rotations again here and keeps every block the forward
    # passed alive until the backward (the whole sequence's K/V per layer: the memory the ring exists to save).
    k, v = jax.lax.optimization_barrier((k, v))
    carry = (k, v, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    k_ids = ids
    for i in range(c):
        keep = _block_keep(q_pos, table[(r - i) % c], window, ids, k_ids)

        def grads(carry, keep=keep):
            k_i, v_i = carry[0], carry[1]
            p = jnp.exp(_scores(qg, k_i, keep) - lse[..., None]) * keep  # [B, K, G, T, S]
            dv = jnp.einsum("bkgts,btkge->bske", p, do)
            dp = jnp.einsum("btkge,bske->bkgts", do, v_i.astype(jnp.float32))
            ds = p * (dp - delta[..., None]) / np.sqrt(E)
            dq_i = jnp.einsum("bkgts,bske->btkge", ds, k_i.astype(jnp.float32))
            dk = jnp.einsum("bkgts,btkge->bske", ds, qg.astype(jnp.float32))
            return _typed((dq_i, dk, dv), qg, do, *carry)

        def skip(carry):
            return _typed((jnp.zeros_like(dq), jnp.zeros_like(carry[2]), jnp.zeros_like(carry[3])), qg, do, *carry)

        dq_i, dk, dv = jax.lax.cond(keep.any(), grads, skip, carry)
        dq = dq + dq_i
        carry = (carry[0], carry[1], carry[2] + dk, carry[3] + dv)
        # K, V move on for the next step; their gradients move every step, so after c hops they are home
        carry = (*_ring(carry[:2], axis, c), *_ring(carry[2:], axis, c)) if i < c - 1 else \
            (carry[0], carry[1], *_ring(carry[2:], axis, c))
        if i < c - 1 and ids is not None:
            k_ids = _ring(k_ids, axis, c)
    dk, dv = carry[2], carry[3]
    d_sinks = None
    if sinks is not None:  # the sink's probability per query times its score gradient, 0 − Δ
        p_sink = jnp.exp(sinks.astype(jnp.float32).reshape(1, K, G, 1) - lse)  # [B, K, G, T]
        d_sinks = (-(p_sink * delta).sum((0, 3))).reshape(H).astype(sinks.dtype)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
