"""Attention sinks (`model.attention_sinks`, gpt-oss's mechanism): a learned logit per query head joins its softmax's
denominator. The kernel against a plain float64 formula (GQA, the causal mask with a window, a caller's mask, a row
that sees no key); a sink of −∞ is the kernel without sinks; the model's loss and every gradient (the sinks' own
included) equal the single-device model's at (data, tensor) with SP, (data, pipe, tensor) on the circular pipeline,
a 1F1B schedule table, (context, tensor) with SP by all-gather and by the ring (whose custom backward computes the
sinks' gradient itself), and context 8 by the ring; cached decoding equals cache-free decoding and the
serving engine's paged cache gives `generate`'s tokens; the combinations that cannot work are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, on_layout, single_device
from jaxpar.config import ConfigError, ModelConfig, ParallelConfig
from jaxpar.infer import decode
from jaxpar.infer.sampling import generate_uncached
from jaxpar.model import Transformer, attend
from jaxpar.serve import Engine, EngineConfig, SamplingParams

# 6 query heads over 2 kv heads (3 a group); vocab 263 prime; 4 layers for 2 stages × 2 passes; window 5 < T
CFG = ModelConfig(vocab_size=263, d_model=24, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=4, d_ff=40,
                  max_seq_len=32, init_std=0.2, attention_sinks=True, sliding_window=5)
B, T = 8, 16


def reference(q, k, v, keep, sinks):
    """float64 attention with sinks: per head, softmax over [scores, sink], the sink's share dropped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H, K, E = q.shape[2], k.shape[2], q.shape[3]
    out = np.zeros(q.shape)
    for n in range(H):
        z = np.einsum("bte,bse->bts", q[:, :, n], k[:, :, n // (H // K)]) / np.sqrt(E)
        z = np.where(keep, z, -np.inf)
        s = np.broadcast_to(np.float64(sinks[n]), z.shape[:-1] + (1,))
        full = np.concatenate([z, s], -1)
        w = np.exp(full - full.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("bts,bse->bte", (w / w.sum(-1, keepdims=True))[..., :-1], v[:, :, n // (H // K)])
    return out


def test_the_kernel_matches_the_formula_and_a_sink_of_minus_infinity_is_none():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 7, n, 4)), jnp.float32) for n in (6, 2, 2))
    sinks = jnp.asarray(rng.normal(size=6) * 2, jnp.float32)
    cfg = dataclasses.replace(CFG, sliding_window=3)
    i, j = np.arange(7)[:, None], np.arange(7)[None, :]
    causal = (j <= i) & (i - j < 3)
    np.testing.assert_allclose(attend(q, k, v, None, cfg, sinks), reference(q, k, v, causal, sinks), atol=2e-6)
    mask = np.asarray(rng.random((2, 1, 7, 7)) < 0.6) & (j <= i)
    mask[0, 0, 2] = False  # a query that sees no key: all its weight on the sink, its output 0
    got = attend(q, k, v, jnp.asarray(mask), cfg, sinks)
    np.testing.assert_allclose(got, reference(q, k, v, mask[:, 0], sinks), atol=2e-6)
    assert not np.asarray(got[0, 2]).any()
    none = attend(q, k, v, None, cfg, jnp.full((6,), -1e30))
    np.testing.assert_allclose(none, attend(q, k, v, None, cfg), atol=2e-6)


@pytest.fixture(scope="module")
def ref():
    batch = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (B, T + 1)), jnp.int32)
    params, loss, grads = single_device(CFG, batch)
    return batch, params, loss, grads


@pytest.mark.parametrize("layout", [
    dict(data=4, tensor=2, sequence_parallel=True),
    dict(data=2, pipe=2, tensor=2, repeats=2, microbatches=4),
    dict(data=2, pipe=2, tensor=2, repeats=1, microbatches=4, schedule="1f1b"),
    dict(data=2, context=2, tensor=2, sequence_parallel=True, context_impl="all_gather"),
    dict(data=2, context=2, tensor=2, sequence_parallel=True, context_impl="ring"),
    dict(data=1, context=8, context_impl="ring"),
], ids=["tp-sp", "circular", "1f1b", "context-all-gather", "context-ring", "context-8-ring"])
def test_loss_and_gradients_equal_the_single_device_model(ref, layout):
    batch, params, want_loss, want_grads = ref
    assert np.abs(np.asarray(want_grads["blocks"]["sinks"][...])).max() > 1e-4  # the sinks learn
    loss, grads = on_layout(CFG, params, batch, ParallelConfig(**layout))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


def test_cached_and_paged_decoding_equal_cache_free_decoding():
    """KV-cache decoding (the window of 5 shorter than the text) samples the cache-free loop's tokens; the serving
    engine's paged cache gives `generate`'s greedy tokens."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    prompt = np.asarray([[5, 9, 200, 17, 3, 44]], np.int32)
    kw = dict(temperature=0.8, top_k=30)
    cached = decode.generate(model, prompt, max_new_tokens=12, do_sample=True, seed=2, return_prompt=False, **kw)
    graphdef, params = nnx.split(model)
    logits_fn = jax.jit(lambda t: nnx.merge(graphdef, params)(t))
    free = generate_uncached(logits_fn, prompt, max_new_tokens=12, max_len=prompt.shape[1] + 12,
                             rng=jax.random.key(2), **kw)
    np.testing.assert_array_equal(cached, free)
    greedy = decode.generate(model, prompt, max_new_tokens=12, return_prompt=False)
    engine = Engine(model, EngineConfig(max_batch=2, page_size=4, prefill_chunk=4))
    assert engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=12, ignore_eos=True)) == greedy.tolist()


def test_what_cannot_work_is_refused():
    with pytest.raises(ConfigError, match="model.attention_sinks"):
        ModelConfig(family="gpt2", vocab_size=263, d_model=24, n_layers=2, n_heads=6, attention_sinks=True)
    with pytest.raises(ConfigError, match="model.attention = 'cudnn'"):
        dataclasses.replace(CFG, attention="cudnn", dtype="bfloat16")
    from jaxpar.interop.hf import hf_config

    with pytest.raises(ConfigError, match="model.attention_sinks"):
        hf_config(CFG)
