"""Per-layer attention kinds — full layers among sliding-window ones, each kind with its own RoPE
(`model.full_attention_every`, `model.local_rope_theta`: Gemma 3, gpt-oss) — and the Gemma family's layer (pre- and
post-norms of 1 + w, √d embeddings, GeGLU, query_pre_attn_scalar): against a plain per-layer reference written here,
through the KV cache, and on every layout kind (data, pipe, tensor with SP; the circular pipeline and a schedule
table; tensor with collective matmul; context parallelism, both paths) against the single-device model, loss and
every gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import model as M
from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, load_config

from jaxpar.train.step import loss_and_grads

from _parity import assert_grads_match, on_layout

# Prime-ish sizes; the window (3) is far shorter than the sequences, the full layers' RoPE is linearly scaled and
# the windowed layers' base differs, so a layer run under the other kind's mask or RoPE changes every logit.
PATTERN = dict(vocab_size=61, d_model=24, n_layers=5, n_heads=3, n_kv_heads=1, head_dim=8, d_ff=40, max_seq_len=32,
               sliding_window=3, full_attention_every=2, local_rope_theta=100.0, rope_scaling="linear",
               rope_factor=2.0, init_std=0.2)


def per_layer_reference(model, cfg, tokens, positions=None, segments=None):
    """The plain computation: each layer's parameters sliced from the stack, its config and mask written out from
    the layer index (full when (l + 1) % every == 0; a windowed layer with the local RoPE base, unscaled)."""
    B, T = tokens.shape
    positions = M.default_positions(B, T) if positions is None else positions
    x = model.embed_tokens(tokens, positions)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    same = np.ones((B, T, T), bool) if segments is None else np.asarray(segments)[:, :, None] == np.asarray(
        segments)[:, None, :]
    for layer in range(cfg.n_layers):
        full = (layer + 1) % cfg.full_attention_every == 0
        plain = dataclasses.replace(cfg, full_attention_every=0, local_rope_theta=0.0,
                                    sliding_window=0 if full else cfg.sliding_window,
                                    **({} if full else dict(rope_theta=cfg.local_rope_theta, rope_scaling="none")))
        keep = (s <= t) & (full | (t - s < cfg.sliding_window))
        mask = jnp.asarray(keep[None] & same)[:, None]
        params = jax.tree.map(lambda a: a[layer], model.stacks()["blocks"])
        x, _, _ = M.block(params, x, positions, mask, plain)
    return model.logits(x)


@pytest.fixture(scope="module")
def patterned():
    cfg = ModelConfig(**PATTERN)
    return cfg, M.Transformer(cfg, rngs=nnx.Rngs(0))


def test_layer_kinds_follow_the_pattern_and_the_program_holds_one_period(patterned):
    cfg, _ = patterned
    assert cfg.layer_windows == (3, 0, 3, 0, 3)
    assert cfg.layer_config(0).sliding_window == 0 and cfg.layer_config(0).rope_theta == cfg.rope_theta
    local = cfg.layer_config(3)
    assert (local.sliding_window, local.rope_theta, local.rope_scaling) == (3, 100.0, "none")
    # (blocks, window) kinds cut into periods: a windowed layer alone and two (full, windowed) periods — 3 layers
    # in the program, not 5, and not 2 (one period cannot hold an odd count)
    kinds = tuple(zip(cfg.layer_pattern, cfg.layer_windows))
    groups = M.layer_groups(kinds)
    assert sum((period * count for period, count in groups), ()) == kinds and sum(len(p) for p, _ in groups) == 3
    uniform = ModelConfig(**dict(PATTERN, full_attention_every=0, local_rope_theta=0.0))
    assert uniform.layer_config(3) is uniform  # a uniform model runs under its own config


def test_pattern_matches_the_per_layer_reference(patterned):
    """Logits equal the per-layer reference's (fp32), with the kernels' causal masks and with packed segments (the
    masks per window); the pattern matters: the same weights with every layer windowed give other logits."""
    cfg, model = patterned
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, cfg.vocab_size)
    got = model(tokens)
    np.testing.assert_allclose(got, per_layer_reference(model, cfg, tokens), rtol=1e-5, atol=1e-5)
    segments = jnp.asarray([[0] * 5 + [1] * 6, [0] * 8 + [1] * 3])
    positions = jnp.asarray([list(range(5)) + list(range(6)), list(range(8)) + list(range(3))])
    packed = model(tokens, positions=positions, segment_ids=segments)
    np.testing.assert_allclose(packed, per_layer_reference(model, cfg, tokens, positions, segments), rtol=1e-5,
                               atol=1e-5)
    uniform = dataclasses.replace(cfg, full_attention_every=0, local_rope_theta=0.0)
    other = nnx.merge(nnx.graphdef(M.Transformer(uniform, rngs=nnx.Rngs(0))), nnx.state(model))(tokens)
    assert np.abs(np.asarray(other) - np.asarray(got)).max() > 1e-2


def test_pattern_decodes_as_it_trains(patterned):
    """Prefill of 4 tokens then one token a step through the contiguous cache gives the full forward's logits:
    each layer masks the cache by its own window."""
    cfg, model = patterned
    tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, cfg.vocab_size)
    cache = M.KVCache.empty(cfg, 2, 16)
    logits, cache = model.decode(tokens[:, :4], cache)
    steps = [logits]
    for i in range(4, 13):
        logits, cache = model.decode(tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), model(tokens), rtol=1e-5, atol=1e-5)


def test_pattern_config_errors():
    with pytest.raises(ConfigError, match=r"model.full_attention_every = 2.*model.sliding_window is 0"):
        ModelConfig(full_attention_every=2)
    with pytest.raises(ConfigError, match=r"model.local_rope_theta = 100.0.*family's positions are learned"):
        ModelConfig(family="gpt2", sliding_window=4, local_rope_theta=100.0)
    with pytest.raises(ConfigError, match=r"model.mtp_depth = 1.*does not say which kind"):
        ModelConfig(sliding_window=4, full_attention_every=2, mtp_depth=1)
    # 6 layers over pipe 2 × repeats 2: chunks of 1 or of 3 layers — (S, F, S) and (F, S, F) — do not repeat
    with pytest.raises(ConfigError, match=r"model.full_attention_every = 2: the pipeline cuts the 6 layers into "
                                          r"pipe\*repeats = 2 chunks.*full: \[1, 3, 5\].*use pipe\*repeats among "
                                          r"\[3\]"):
        load_config(None, ["model.n_layers=6", "model.sliding_window=4", "model.full_attention_every=2",
                           "parallel.pipe=2", "parallel.microbatches=2"])


# ---------------------------------------------------------------------------------------------------------------------
# Gemma on every layout kind

# 8 layers in (windowed, full) pairs: every pipeline chunk of 2 or 4 layers holds the same kinds. 6 query heads over
# 2 kv heads (tensor 2 splits them, 4 would not divide 6: tensor stays 2); seq 24 cuts into 2c chunks for context 2
# and 4, and the window of 5 crosses chunk boundaries.
GEMMA = dict(family="gemma", vocab_size=263, d_model=36, n_layers=8, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=44,
             max_seq_len=24, sliding_window=5, full_attention_every=2, local_rope_theta=100.0, rope_theta=5000.0,
             rope_scaling="linear", rope_factor=2.0, query_pre_attn_scalar=11.0, qk_norm=True, tie_embeddings=True,
             init_std=0.1, scan_unroll=1)
B, T = 16, 24


@pytest.fixture(scope="module")
def gemma_reference():
    cfg = ModelConfig(**GEMMA)
    # the norms' w (born zero: 1 + w = 1) drawn at random, so no norm is an identity its gradient could hide behind
    graphdef, params = nnx.split(M.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(5)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.2 * rng.standard_normal(a.shape, np.float32) if "norm" in jax.tree_util.keystr(path)
        else a, params)
    batch = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    return cfg, batch, params, loss, grads


GEMMA_LAYOUTS = {
    "(data, pipe, tensor) = (2, 2, 2) circular v=2 SP": dict(data=2, pipe=2, tensor=2, repeats=2, microbatches=4,
                                                             sequence_parallel=True),
    "(data, pipe, tensor) = (2, 2, 2) zbv": dict(data=2, pipe=2, tensor=2, repeats=2, microbatches=4,
                                                schedule="zbv"),
    "(data, tensor) = (4, 2) SP collective matmul": dict(data=4, tensor=2, sequence_parallel=True,
                                                         overlap="collective_matmul"),
    "(data, context, tensor) = (1, 4, 2) SP ring": dict(data=1, context=4, tensor=2, sequence_parallel=True,
                                                       context_impl="ring"),
    "(data, context) = (2, 4) all-gather": dict(data=2, context=4, context_impl="all_gather"),
}


@pytest.mark.parametrize("layout", GEMMA_LAYOUTS)
def test_gemma_matches_the_single_device_model(gemma_reference, layout):
    cfg, batch, params, want_loss, want_grads = gemma_reference
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**GEMMA_LAYOUTS[layout]))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


def test_gemma_reference_uses_every_mechanism(gemma_reference):
    """The reference is not a Llama in disguise: each Gemma mechanism, turned off, changes the loss."""
    cfg, batch, params, want_loss, _ = gemma_reference
    for change in (dict(query_pre_attn_scalar=0.0), dict(full_attention_every=0), dict(local_rope_theta=0.0)):
        other = dataclasses.replace(cfg, **change)
        graphdef = nnx.graphdef(M.Transformer(other, rngs=nnx.Rngs(0)))
        loss, _ = jax.jit(loss_and_grads(graphdef))(params, batch)
        assert abs(float(loss) - float(want_loss)) > 1e-4, change
