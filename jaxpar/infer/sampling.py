"""Token sampling and a cache-free generation loop.

`sample_logits` turns one step's logits into token ids: greedy, or temperature sampling optionally truncated by
top-k and/or top-p (nucleus). The order is the one HF's `generate` uses: scale by temperature, keep the k largest,
then keep the nucleus of what remains (its probabilities renormalised over the k survivors).

`generate_uncached` is the cache-free reference decoder (the KV-cache one is `jaxpar.infer.decode.generate`, checked
against it): every step runs the model's full causal forward over a fixed `[B, max_len]` token buffer and reads the
logits at the last filled position. That costs O(max_len) model work per new token instead of O(1) with a KV cache,
but it needs nothing from the model except `logits_fn(tokens) -> logits`, and because the buffer's shape never
changes `logits_fn` compiles exactly once.

The step loop is a Python loop; only the cheap "pick the next token and write it into the buffer" part is a jitted
function of ours (`_next_token`). Positions, step counters and rng keys enter it as traced arrays, so it too
compiles once per (shape, sampling settings).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import GenerateError

# Probability masses within this of `top_p` count as reaching it: softmax and cumsum in float32 round by ~1e-7, and
# a nucleus that should stop exactly at top_p (e.g. 0.5 + 0.3 >= 0.8) must not pick up an extra token from rounding.
_TOP_P_TOL = 1e-6


def check_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    """Raise GenerateError (a ValueError) for settings that have no meaning: a temperature that is negative, NaN
    or infinite, a negative or non-integer top_k, top_p outside (0, 1]."""
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise GenerateError(f"temperature = {temperature!r}: must be a finite number >= 0 (0 means greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise GenerateError(f"top_k = {top_k!r}: must be an integer >= 0 (0 means off)")
    if not (isinstance(top_p, numbers.Real) and 0.0 < top_p <= 1.0):
        raise GenerateError(f"top_p = {top_p!r}: must be in (0, 1] (1.0 means off)")


def _mask_top_k(logits: jax.Array, k: int) -> jax.Array:
    """Keep exactly the k largest logits of each row, set the rest to -inf.  logits [B, V] -> [B, V].

    Scattering the `lax.top_k` survivors into a -inf row (rather than comparing against the k-th value) keeps exactly
    k tokens even when several logits tie with the k-th largest.
    """
    B = logits.shape[0]
    vals, idx = jax.lax.top_k(logits, k)  # [B, k] each
    rows = jnp.arange(B)[:, None]  # [B, 1], broadcasts against idx
    return jnp.full_like(logits, -jnp.inf).at[rows, idx].set(vals)


def _mask_top_p(logits: jax.Array, p: float) -> jax.Array:
    """Keep the nucleus of each row: the fewest most-likely tokens whose probability mass is >= p.  [B, V] -> [B, V].

    Sorting probabilities in descending order, token j (in sorted order) is kept iff the mass strictly before it is
    still short of p:  sum_{i<j} prob_i < p.  The top token (empty sum, 0 < p) is therefore always kept, and the
    first token that lifts the running mass to >= p is the last one kept.
    """
    B = logits.shape[0]
    order = jnp.argsort(-logits, axis=-1)  # [B, V] token ids, most likely first
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
    probs = jax.nn.softmax(sorted_logits, axis=-1)  # [B, V]; -inf entries (top-k losers) have prob 0
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V] exclusive prefix sum
    keep_sorted = mass_before < p - _TOP_P_TOL  # [B, V] in sorted order
    # Undo the sort: keep[b, order[b, j]] = keep_sorted[b, j].
    rows = jnp.arange(B)[:, None]
    keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample_logits(
    logits: jax.Array,
    rng: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """Sample one token per row.  logits [B, V] (any float dtype) -> token ids int32 [B].

    - `temperature == 0`: greedy argmax; `rng`, `top_k` and `top_p` are ignored.
    - otherwise sample from softmax(logits / temperature) after truncation:
      `top_k > 0` keeps the k largest logits (0 = off; k >= V keeps all);
      `top_p < 1` keeps the smallest most-likely set whose probability mass is >= top_p, always at least the top
      token (1.0 = off). With both, top-k runs first and top-p sees the renormalised survivors (HF's order).
      Masked tokens get logit -inf, so they are never drawn.

    All arithmetic is float32 whatever the input dtype (bf16 softmax tails are too coarse for top-p).

    Under `jax.jit`, `temperature`, `top_k` and `top_p` must be static (`static_argnames=("temperature", "top_k",
    "top_p")`): they choose Python branches and `top_k` is a shape. `logits` and `rng` may be traced.
    Raises GenerateError (a ValueError) for temperature < 0 or not finite, top_k < 0, or top_p outside (0, 1].
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.astype(jnp.float32)  # [B, V]
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    V = logits.shape[-1]
    if 0 < top_k < V:
        logits = _mask_top_k(logits, top_k)
    if top_p < 1.0:
        logits = _mask_top_p(logits, top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "eos_id"))
def _next_token(
    logits: jax.Array,  # [B, L, V] full forward over the buffer
    tokens: jax.Array,  # [B, L] int32 buffer; the first `n` positions hold the context window
    n: jax.Array,  # int32 scalar: filled length of the buffer, 1 <= n <= L
    done: jax.Array,  # [B] bool: rows that already emitted eos
    rng: jax.Array,  # this step's key
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_id: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step: sample from the logits at position n-1, write the token at position n (sliding if full).

    Returns (token int32 [B], new tokens buffer [B, L], new done [B]). The written position is a traced index, so
    one compilation serves every step.
    """
    L = tokens.shape[1]
    last = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False)  # [B, V]
    tok = sample_logits(last, rng, temperature=temperature, top_k=top_k, top_p=top_p)  # [B]
    if eos_id is not None:
        tok = jnp.where(done, eos_id, tok)  # finished rows emit eos as padding
        done = done | (tok == eos_id)
    # A full buffer drops its oldest token: shift left by one, then write at the last slot (n - 1 == L - 1).
    full = n == L
    tokens = jnp.where(full, jnp.roll(tokens, -1, axis=1), tokens)
    write_at = jnp.where(full, L - 1, n)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok[:, None], write_at, axis=1)
    return tok, tokens, done


def generate_uncached(
    logits_fn: Callable[[jax.Array], jax.Array],
    prompt: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    max_len: int,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
) -> np.ndarray:
    """Autoregressively extend `prompt` by up to `max_new_tokens` tokens, without a KV cache.

    logits_fn: tokens int32 [B, max_len] -> logits [B, max_len, V], a full *causal* forward pass (jitted and sharded
        by the caller). It is always called with the same shape, so it compiles once. Positions past the filled
        length hold 0s; causality makes them invisible to the position we read.
    prompt: int32 [B, P], P >= 1. Every row has the same length P (ragged prompts: the cached `generate`).
    max_len: the buffer length, at most the model's longest sequence.
    rng: a key; step t samples with `jax.random.fold_in(rng, t)`, so one seed reproduces one output.
    temperature, top_k, top_p: as in `sample_logits` (temperature 0 is greedy).
    eos_id: if given, a row that samples eos_id emits eos_id at every later step, and the loop stops as soon as all
        rows have emitted it. Checking that needs a device-to-host sync per step; with eos_id=None there is none.

    Context window: the buffer holds the last min(P + t, max_len) tokens. At step t the filled length is
    n = min(P + t, max_len); the logits at position n-1 are sampled and the token is written at position n, or, when
    the buffer is full, every token shifts left one slot (the oldest drops out) and it is written at max_len-1.
    The model has no positions beyond max_len, so longer sequences see a sliding window of the most recent max_len
    tokens (and a prompt longer than max_len keeps only its last max_len tokens).

    Returns the new tokens only: int32 numpy [B, n_new], n_new == max_new_tokens unless every row hit eos first
    (then n_new is the step at which the last row did, inclusive).
    """
    check_sampling_args(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens = {max_new_tokens!r}: must be >= 0")
    if max_len < 1:
        raise GenerateError(f"max_len = {max_len!r}: must be >= 1")
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise GenerateError(f"prompt shape = {prompt.shape}: must be [B, P] with P >= 1 (one equal-length row per sample)")
    B, P = prompt.shape

    window = prompt[:, -max_len:].astype(np.int32)  # [B, min(P, max_len)]
    n = window.shape[1]
    tokens = np.zeros((B, max_len), np.int32)
    tokens[:, :n] = window
    tokens = jnp.asarray(tokens)  # [B, max_len]
    done = jnp.zeros((B,), jnp.bool_)
    out = []  # max_new_tokens arrays of [B]; kept on device so steps dispatch without waiting

    for t in range(max_new_tokens):
        logits = logits_fn(tokens)  # [B, max_len, V]
        tok, tokens, done = _next_token(
            logits, tokens, jnp.int32(n), done, jax.random.fold_in(rng, t),
            temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
        )
        out.append(tok)
        n = min(n + 1, max_len)
        if eos_id is not None and bool(done.all()):
            break

    if not out:
        return np.zeros((B, 0), np.int32)
    return np.asarray(jnp.stack(out, axis=1))  # [B, n_new]


# ---------------------------------------------------------------------------------------------------------------------
# The vocab-parallel sampler: each tensor rank holds V/t of a row's logits, and only per-row scalars (or the t·k
# top-k candidates) cross the tensor group — never the full-vocab logits.

_BISECT_STEPS = 48  # float32 has a 24-bit mantissa: enough halvings to reach adjacent logits from any range


def _reduce(x: jax.Array, op, axis: str | None) -> jax.Array:
    return x if axis is None else op(x, axis)


def _global_argmax(scores: jax.Array, ids: jax.Array, axis: str | None) -> jax.Array:
    """The id of the largest score of each row over every rank (ties: the smallest id, as jnp.argmax).
    scores [B, n] float32, ids [B, n] or [n] int32 (their global ids) → int32 [B]. Two all-reduces of [B]."""
    best = _reduce(scores.max(-1), jax.lax.pmax, axis)  # [B]
    ids = jnp.broadcast_to(ids, scores.shape)
    mine = jnp.where(scores == best[:, None], ids, jnp.iinfo(jnp.int32).max).min(-1)
    return _reduce(mine, jax.lax.pmin, axis).astype(jnp.int32)


def sample_sharded(logits: jax.Array, rng: jax.Array, *, vocab_size: int, axis: str | None = None,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, first_row=0) -> jax.Array:
    """`sample_logits` for vocab-parallel logits, inside shard_map: logits [B, V_local] float32, this rank's columns
    r·V_local … of the (padded) vocab, padding at ids ≥ vocab_size; axis the tensor axis (None: one device holds
    the whole row); first_row: the global index of row 0 (rows split over `data`). → token ids int32 [B], the same
    on every rank of the group, and the same for every layout (row i's noise is drawn from fold_in(rng, i) for the
    whole true vocab, and each rank takes its columns).

    - greedy: the global argmax (a pmax of the row maxima, a pmin of the ids that reach it).
    - sampling is Gumbel-max — argmax(z/T + g), g ~ Gumbel(0, 1) per token — which draws from softmax(z/T):
      without truncation that is the global argmax again; top_k gathers each rank's k best (t·k candidates a row,
      not V) and keeps the k best of them, then top-p on those k as `sample_logits` does; top_p alone finds the
      nucleus threshold θ — the largest logit whose tokens at or above it hold ≥ top_p of the mass — by bisection,
      each step one all-reduce of [B] masses, and keeps z ≥ θ (HF's nucleus, ties at θ included).
    """
    check_sampling_args(temperature, top_k, top_p)
    B, Vl = logits.shape
    r = 0 if axis is None else jax.lax.axis_index(axis)
    ids = r * Vl + jnp.arange(Vl, dtype=jnp.int32)  # [Vl] global ids of this rank's columns
    z = jnp.where(ids < vocab_size, logits.astype(jnp.float32), -jnp.inf)
    if temperature == 0:
        return _global_argmax(z, ids, axis)
    z = z / temperature
    t = 1 if axis is None else jax.lax.axis_size(axis)
    rows = first_row + jnp.arange(B)  # the whole row's noise, drawn alike on every rank
    noise = jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(rng, i), (vocab_size,), jnp.float32))(rows)
    noise = jnp.pad(noise, ((0, 0), (0, Vl * t - vocab_size)))
    if 0 < top_k < vocab_size:
        k = min(top_k, Vl)
        vals, local = jax.lax.top_k(z, k)  # [B, k] each: this rank's best
        cand, cand_ids = vals, ids[local]
        if axis is not None:
            cand = jax.lax.all_gather(vals, axis, axis=1, tiled=True)  # [B, t·k]
            cand_ids = jax.lax.all_gather(cand_ids, axis, axis=1, tiled=True)
        vals, pick = jax.lax.top_k(cand, top_k)  # the k best of the row; ties: the lower rank's first
        kept_ids = jnp.take_along_axis(cand_ids, pick, axis=-1)  # [B, top_k]
        if top_p < 1.0:
            vals = _mask_top_p(vals, top_p)
        scores = vals + jnp.take_along_axis(noise, kept_ids, axis=-1)
        token = jnp.take_along_axis(kept_ids, jnp.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
        # Every rank picked the same token from the same candidates, but an all-gather's result is typed as
        # varying over the axis: a pmax of equal values (one all-reduce of [B]) makes it invariant.
        return _reduce(token, jax.lax.pmax, axis)
    if top_p < 1.0:
        z = jnp.where(z >= _nucleus_threshold(z, top_p, axis)[:, None], z, -jnp.inf)
    return _global_argmax(z + jax.lax.dynamic_slice_in_dim(noise, r * Vl, Vl, axis=1), ids, axis)


def _nucleus_threshold(z: jax.Array, p: float, axis: str | None) -> jax.Array:
    """θ [B]: the largest logit such that the tokens with z ≥ θ hold ≥ p of the row's probability mass (within
    `_TOP_P_TOL`), by bisection on [min z, max z]; the mass above a threshold is a psum of [B] partial sums."""
    finite = jnp.isfinite(z)
    m = _reduce(jnp.where(finite, z, -jnp.inf).max(-1), jax.lax.pmax, axis)  # [B]
    e = jnp.where(finite, jnp.exp(z - m[:, None]), 0.0)
    total = _reduce(e.sum(-1), jax.lax.psum, axis)

    def mass(theta):
        return _reduce(jnp.where(z >= theta[:, None], e, 0.0).sum(-1), jax.lax.psum, axis) / total

    lo = _reduce(jnp.where(finite, z, jnp.inf).min(-1), jax.lax.pmin, axis)  # mass(lo) = 1 ≥ p
    hi = m

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) / 2
        enough = mass(mid) >= p - _TOP_P_TOL
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
    top_enough = mass(m) >= p - _TOP_P_TOL  # the top token(s) alone reach p
    # lo is just below the logit of the last token kept: snap to it (the smallest logit ≥ lo), so a token whose
    # logit equals θ is in.
    snapped = _reduce(jnp.where(z >= lo[:, None], z, jnp.inf).min(-1), jax.lax.pmin, axis)
    return jnp.where(top_enough, m, snapped)
