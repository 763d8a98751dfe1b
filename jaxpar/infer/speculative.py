"""Self-speculative greedy decoding with the model's own multi-token prediction modules as the draft (DeepSeek-V3
§2.2, `jaxpar.model.MTP`): the output is exactly greedy decoding's tokens, in fewer main-model steps when the draft
is right.

One round, for each row whose main model has processed positions 0 … m (its KV cache and its last hidden states
h⁰ [B, S, D], before the final norm, hold them) and whose next token t_{m+1} is known (the main model's own):

    draft    MTP module k = 1 … D at position m: hᵏ_m from hᵏ⁻¹_m and Emb(t_{m+k}) → d_k = argmax, the guess of
             t_{m+k+1} (t_{m+k} for k ≥ 2 is the previous module's guess d_{k-1});
    verify   one main-model step over [t_{m+1}, d_1, …, d_D] at positions m+1 … m+1+D with the cache → g_j =
             argmax of its logits at position m+1+j, the greedy token for position m+2+j given the D+1 tokens
             before it;
    accept   a = the longest prefix with d_{j+1} = g_j (j < a): the tokens d_1 … d_a are what greedy decoding
             emits (each equals the main model's argmax given exactly the tokens before it), and g_a follows —
             a+1 tokens for one main-model step; the cache's slots past m+1+a hold rejected drafts, past the
             row's length, overwritten by the next round (`KVCache`).

The MTP modules' blocks attend over every earlier position of their depth; this draft recomputes them over the
whole buffer each round (no cache of their own: the draft is D one-layer passes, O(S) each), from the buffered h⁰
and tokens. Single device (no mesh); rows of a batch accept independently.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import GenerateError
from jaxpar.infer.decode import right_pad
from jaxpar.model import KVCache, default_positions, mtp_step


def _rows(B: int) -> jax.Array:
    return jnp.arange(B)[:, None]


def draft(model, h0: jax.Array, tokens: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MTP modules' greedy guesses after position m. h0 [B, S, D] (valid at positions ≤ m[b]), tokens
    [B, S + D + 2] (valid at ≤ m[b]+1), m [B] → (drafts [B, D], tokens with them at m+2 …)."""
    B, S, _ = h0.shape
    pos = default_positions(B, S)
    h, out = h0, []
    for k in range(1, model.cfg.mtp_depth + 1):
        own, layer = model.mtp.depth(k - 1)
        h = mtp_step(own, layer, h, model.embed_tokens(tokens[:, k:k + S], pos), pos, None, model.cfg)
        logits = model.logits(jnp.take_along_axis(h, m[:, None, None], 1), scale=own["head_norm"])  # [B, 1, V]
        d = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        tokens = tokens.at[jnp.arange(B), m + k + 1].set(d)
        out.append(d)
    return jnp.stack(out, 1), tokens


def verify(model, cache: KVCache, h0: jax.Array, tokens: jax.Array, m: jax.Array, drafts: jax.Array):
    """One main-model step over [t_{m+1}, d_1 … d_D] → (cache, h0, tokens, m, accepted [B]): the greedy tokens g
    written at m+2 …, the accepted count a, the new last processed position m + 1 + a."""
    B, D = drafts.shape
    block = jnp.concatenate([jnp.take_along_axis(tokens, (m + 1)[:, None], 1), drafts], 1)  # [B, D+1]
    logits, cache, x = model.decode(block, cache, positions=m + 1, hidden=True)
    g = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, D+1]: g_j for position m+2+j
    a = jnp.cumprod(drafts == g[:, :D], axis=1).sum(1).astype(jnp.int32)  # the matching prefix
    slots = (m + 1)[:, None] + jnp.arange(D + 1)
    h0 = h0.at[_rows(B), slots].set(x, mode="drop")
    tokens = tokens.at[_rows(B), slots + 1].set(g, mode="drop")  # d_1..d_a (= g_0..g_{a-1}), then g_a
    m = m + 1 + a
    return KVCache(cache.arrays, m + 1), h0, tokens, m, a


def speculative_generate(model, input_ids: Sequence[Sequence[int]] | np.ndarray, *, max_new_tokens: int = 20
                         ) -> tuple[np.ndarray, dict]:
    """Greedy generation with the MTP draft: prompts (ragged lists or [B, T] ids) → (int32 [B, max_new_tokens], the
    new tokens — exactly `decode.generate(…, do_sample=False)`'s —, {"acceptance": accepted drafts / proposed,
    "tokens_per_step": new tokens per main-model step (prefill excluded), "rounds": main-model verify steps}).
    No stop tokens: every row runs max_new_tokens."""
    cfg = model.cfg
    D = cfg.mtp_depth
    if not D:
        raise GenerateError("speculative decoding drafts with the MTP modules, and model.mtp_depth = 0")
    tokens, lengths = right_pad(input_ids)
    tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
    B, P = tokens.shape
    S = P + max_new_tokens + D + 1  # slots: the last round may verify D drafts past the end
    if S > cfg.max_seq_len:
        raise GenerateError(f"prompt {P} + max_new_tokens {max_new_tokens} + the draft's {D + 1} exceeds "
                            f"model.max_seq_len = {cfg.max_seq_len}")
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, lengths):
        model = nnx.merge(graphdef, state)
        cache = KVCache.empty(cfg, B, S)
        logits, cache, x = model.decode(tokens, cache, positions=jnp.zeros((B,), jnp.int32), counts=lengths,
                                        hidden=True)
        h0 = jnp.zeros((B, S, cfg.d_model), jnp.float32).at[:, :P].set(x)
        m = lengths - 1
        first = jnp.argmax(jnp.take_along_axis(logits, m[:, None, None], 1)[:, 0], -1).astype(jnp.int32)
        buf = jnp.zeros((B, S + D + 2), jnp.int32).at[:, :P].set(tokens).at[jnp.arange(B), m + 1].set(first)
        return cache, h0, buf, m

    @jax.jit
    def round_(state, cache, h0, buf, m):
        model = nnx.merge(graphdef, state)
        drafts, buf = draft(model, h0, buf, m)
        return verify(model, cache, h0, buf, m, drafts)

    cache, h0, buf, m = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths))
    rounds, accepted = 0, np.zeros(B, np.int64)
    while int(jnp.min(m + 2 - jnp.asarray(lengths))) < max_new_tokens:  # new tokens known: through m+1
        cache, h0, buf, m, a = round_(state, cache, h0, buf, m)
        rounds += 1
        accepted += np.asarray(a)
    buf = np.asarray(buf)
    out = np.stack([buf[b, lengths[b]:lengths[b] + max_new_tokens] for b in range(B)])
    produced = np.asarray(m) + 2 - lengths - 1  # tokens the rounds produced (the prefill gave the first)
    return out, {"acceptance": float(accepted.sum() / max(rounds * D * B, 1)),
                 "tokens_per_step": float(produced.mean() / max(rounds, 1)), "rounds": rounds}
