"""`decode.decode_step` driven from a host loop, rows at different positions: prompts of 3, 7 and 5 tokens with no
left padding decode greedily to the tokens `generate` gives and that each row gives alone, with the logits of the
full-sequence forward at every position; a row restarted at position 0 beside rows that go on reads none of its old
slots."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.infer import decode
from jaxpar.model import KVCache, Transformer

# Prime vocab, GQA (4 query heads on 2 kv heads), odd widths; a sliding window shorter than the longest row.
BASE = dict(vocab_size=263, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=40, max_seq_len=64,
            init_std=0.2)
FAMILIES = {"llama_window": ModelConfig(**BASE, sliding_window=5),
            "gpt2": ModelConfig(**dict(BASE, family="gpt2", n_kv_heads=4, tie_embeddings=True))}
PROMPTS = [[5, 9, 200], [1, 2, 3, 250, 17, 17, 4], [42, 99, 61, 8, 3]]
NEW = 6


def host_greedy(model: Transformer, prompts: list[list[int]], new: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy decoding by a host loop over `decode_step`: one prefill of the right-padded prompts, then one token a
    row a step at each row's own position. → (new tokens [B, new], per row its logits [n_b + new − 1, V] at
    positions 0 … n_b + new − 2, the prompt's included)."""
    tokens, lengths = decode.right_pad(prompts)
    B, V = len(prompts), model.cfg.vocab_size
    cache = KVCache.empty(model.cfg, B, tokens.shape[1] + new)
    logits, cache = decode.decode_step(model, jnp.asarray(tokens), jnp.zeros((B,), jnp.int32), cache,
                                       jnp.asarray(lengths))
    logits = np.asarray(logits)[..., :V]
    seen = [logits[b, :n] for b, n in enumerate(lengths)]
    tok = np.array([seen[b][-1].argmax() for b in range(B)], np.int32)
    out = [tok]
    for _ in range(new - 1):
        np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + len(out) - 1)
        logits, cache = decode.decode_step(model, jnp.asarray(tok)[:, None], cache.lengths, cache)
        step = np.asarray(logits)[:, 0, :V]
        seen = [np.concatenate([s, step[b:b + 1]]) for b, s in enumerate(seen)]
        tok = step.argmax(-1).astype(np.int32)
        out.append(tok)
    return np.stack(out, axis=1), seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_at_different_positions_match_generate_alone_and_the_full_forward(family):
    cfg = FAMILIES[family]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    got, logits = host_greedy(model, PROMPTS, NEW)
    np.testing.assert_array_equal(got, decode.generate(model, PROMPTS, max_new_tokens=NEW, return_prompt=False))
    for b, prompt in enumerate(PROMPTS):
        alone, _ = host_greedy(model, [prompt], NEW)
        np.testing.assert_array_equal(got[b], alone[0])
        row = np.array(prompt + got[b, :-1].tolist(), np.int32)  # every token the loop fed this row
        full = np.asarray(model(jnp.asarray(row)[None]))[0, :, :cfg.vocab_size]  # [n_b + NEW − 1, V]
        np.testing.assert_allclose(logits[b], full, rtol=1e-5, atol=1e-5)


def test_a_row_restarted_at_position_zero_reads_none_of_its_old_slots():
    """Row 1 starts a new sequence at position 0 while rows 0 and 2 go on: its slots past its position still hold
    the old sequence's keys, which its queries must not see (the mask is by position, not by what was written)."""
    cfg = FAMILIES["llama_window"]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, lengths = decode.right_pad(PROMPTS)
    cache = KVCache.empty(cfg, 3, tokens.shape[1] + 8)
    _, cache = decode.decode_step(model, jnp.asarray(tokens), jnp.zeros((3,), jnp.int32), cache, jnp.asarray(lengths))
    fresh = [7, 11, 13, 17]  # row 1's new sequence, fed a token a step; rows 0 and 2 take their prompts' tokens
    others = np.array([[3, 1, 4, 1], [0, 0, 0, 0], [2, 7, 1, 8]], np.int32)
    positions = np.array([lengths[0], 0, lengths[2]], np.int32)
    for i, t in enumerate(fresh):
        tok = others[:, i].copy()
        tok[1] = t
        logits, cache = decode.decode_step(model, jnp.asarray(tok)[:, None], jnp.asarray(positions + i), cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), positions + len(fresh))
    want = np.asarray(model(jnp.asarray([fresh])))[0, -1]
    np.testing.assert_allclose(np.asarray(logits)[1, 0], want, rtol=1e-5, atol=1e-5)
    row0 = np.asarray(model(jnp.asarray([PROMPTS[0] + others[0].tolist()])))[0, -1]
    np.testing.assert_allclose(np.asarray(logits)[0, 0], row0, rtol=1e-5, atol=1e-5)
