"""The paged KV cache (`jaxpar.model.PagedKVCache`): rows whose positions live in scattered pages of one pool, written
and read through block tables, give the logits of the full-sequence forward — for GQA, a sliding window and
multi-head latent attention (no attention kind knows pages exist) — with prompts prefilled in chunks whose
boundaries fall inside pages, rows of different lengths sharing each step, and the unused table entries of every
row pointing at one junk page that the padding of all rows writes into."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.infer import decode
from jaxpar.model import PagedKVCache, Transformer, read_pages, write_pages

BASE = dict(vocab_size=263, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=40, max_seq_len=64,
            init_std=0.2)
MLA = dict(BASE, family="deepseek", n_kv_heads=0, head_dim=0, kv_lora_rank=7, qk_rope_head_dim=4,
           qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10, rope_interleave=True)
KINDS = {"gqa": ModelConfig(**BASE), "window": ModelConfig(**BASE, sliding_window=5), "mla": ModelConfig(**MLA)}
PROMPTS = [[5, 9, 200], [1, 2, 3, 250, 17, 17, 4, 8, 19, 100, 7], [42, 99, 61, 8, 3]]
PAGE, PER_ROW, CHUNK, NEW = 4, 6, 5, 6  # 24 positions a row; chunks of 5 cross the pages of 4


def paged_greedy(model: Transformer, prompts: list[list[int]], new: int, seed: int = 0):
    """Chunked prefill, then greedy decoding, of all rows at once in a paged cache whose block tables are a random
    permutation of the pool's pages 1…B·n (page 0 the junk page every entry past a row's pages names) → (new tokens
    [B, new], per row its logits at positions 0 … n_b + new − 2)."""
    B, V = len(prompts), model.cfg.vocab_size
    lengths = np.array([len(p) for p in prompts])
    owned = -(-(lengths + new) // PAGE)  # the pages each row needs
    perm = np.random.default_rng(seed).permutation(np.arange(1, 1 + owned.sum()))
    table = np.zeros((B, PER_ROW), np.int32)
    for b, start in enumerate(np.concatenate([[0], np.cumsum(owned)[:-1]])):
        table[b, :owned[b]] = perm[start:start + owned[b]]
    cache = PagedKVCache.empty(model.cfg, B, 1 + owned.sum(), PAGE, PER_ROW)
    cache = PagedKVCache(cache.arrays, jnp.asarray(table), cache.lengths)
    tokens, _ = decode.right_pad(prompts, multiple=CHUNK)
    seen = [[] for _ in range(B)]
    for c in range(0, tokens.shape[1], CHUNK):
        logits, cache = decode.decode_step(model, jnp.asarray(tokens[:, c:c + CHUNK]), jnp.full((B,), c, jnp.int32),
                                           cache)
        for b in range(B):
            seen[b] += list(np.asarray(logits)[b, :max(0, min(CHUNK, lengths[b] - c)), :V])
    tok = np.array([seen[b][-1].argmax() for b in range(B)], np.int32)
    out, positions = [tok], lengths.copy()
    for _ in range(new - 1):
        logits, cache = decode.decode_step(model, jnp.asarray(tok)[:, None], jnp.asarray(positions, jnp.int32),
                                           cache)
        step = np.asarray(logits)[:, 0, :V]
        for b in range(B):
            seen[b].append(step[b])
        tok, positions = step.argmax(-1).astype(np.int32), positions + 1
        out.append(tok)
    return np.stack(out, axis=1), [np.stack(s) for s in seen]


@pytest.mark.parametrize("kind", list(KINDS))
def test_paged_rows_match_the_full_forward_and_generate(kind):
    cfg = KINDS[kind]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    got, logits = paged_greedy(model, PROMPTS, NEW)
    np.testing.assert_array_equal(got, decode.generate(model, PROMPTS, max_new_tokens=NEW, return_prompt=False))
    np.testing.assert_array_equal(got, paged_greedy(model, PROMPTS, NEW, seed=1)[0])  # another page placement
    for b, prompt in enumerate(PROMPTS):
        row = np.array(prompt + got[b, :-1].tolist(), np.int32)  # every token this row was fed
        full = np.asarray(model(jnp.asarray(row)[None]))[0, :, :cfg.vocab_size]
        np.testing.assert_allclose(logits[b], full, rtol=1e-5, atol=1e-5)


def test_pages_are_written_where_the_table_says_and_past_the_table_dropped():
    """Row 0 (pages 3, 1) writes positions 2…5: page 3 offsets 2, 3 then page 1 offsets 0, 1; row 1 (one page, 2)
    writes positions 3…6, of which only position 3 lies in its pages — the rest are dropped, not wrapped."""
    pool = jnp.zeros((1, 4, 4, 1))
    new = jnp.arange(1, 9, dtype=jnp.float32).reshape(2, 4, 1)
    pages = jnp.asarray([[3, 1], [2, 2]])
    out = np.asarray(write_pages(pool, new, jnp.asarray([2, 3]), 0, jnp.asarray([[3, 1], [2, 9]])))[0, ..., 0]
    np.testing.assert_array_equal(out[3], [0, 0, 1, 2])
    np.testing.assert_array_equal(out[1], [3, 4, 0, 0])
    np.testing.assert_array_equal(out[2], [0, 0, 0, 5])
    np.testing.assert_array_equal(out[0], 0)
    view = np.asarray(read_pages(jnp.asarray(out)[None, ..., None], 0, pages))[..., 0]
    np.testing.assert_array_equal(view[0], [0, 0, 1, 2, 3, 4, 0, 0])
    assert jax.eval_shape(lambda: read_pages(pool, 0, pages)).shape == (2, 8, 1)
