"""Tests for `jaxpar.infer.sampling`: sampling rules on hand-made distributions, and `generate_uncached` on toy models.

Distribution tests draw many samples in one call (one row per draw, a fixed seed) and compare frequencies with a
chi-square statistic, so they are deterministic and fast. The toy models are exact (one-hot logits), so greedy
generation must reproduce a pure-Python reference token for token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.infer import generate_uncached, sample_logits

N_DRAWS = 20_000
# Chi-square critical values at p = 0.001 by degrees of freedom: a fixed-seed test fails only on a real bug.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def _draw(probs, n=N_DRAWS, seed=0, **kw) -> np.ndarray:
    """Sample n tokens from one distribution (given as probabilities) by tiling it over n rows.  -> int32 [n]."""
    logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 1))  # [n, V]
    return np.asarray(sample_logits(logits, jax.random.key(seed), **kw))


def _chi2(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's chi-square of sample counts against expected probabilities (zero-probability cells skipped)."""
    counts = np.bincount(samples, minlength=len(expected_probs))
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token with expected probability 0"
    exp = expected_probs[support] * len(samples)
    return float(((counts[support] - exp) ** 2 / exp).sum())


# --- sample_logits -----------------------------------------------------------------------------------------------

def test_greedy_matches_argmax():
    logits = jax.random.normal(jax.random.key(1), (7, 31), jnp.bfloat16)
    got = sample_logits(logits, jax.random.key(0), temperature=0.0)
    assert got.dtype == jnp.int32 and got.shape == (7,)
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits, np.float32), axis=-1))


def test_temperature_frequencies_match_softmax():
    logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0], np.float32)
    T = 0.7
    probs = np.exp(logits)  # the draw helper takes probabilities; log(exp(x)) == x
    expected = np.exp(logits / T) / np.exp(logits / T).sum()
    samples = _draw(probs, temperature=T)
    assert _chi2(samples, expected) < CHI2_CRIT[4]
    # ...and temperature matters: the T=1 distribution is clearly rejected.
    plain = np.exp(logits) / np.exp(logits).sum()
    assert _chi2(samples, plain) > 10 * CHI2_CRIT[4]


def test_top_k_1_matches_greedy():
    logits = jax.random.normal(jax.random.key(2), (64, 17))
    got = sample_logits(logits, jax.random.key(3), temperature=1.5, top_k=1)
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), axis=-1))


def test_top_k_only_samples_k_largest():
    B, V, k = 256, 23, 4
    logits = jax.random.normal(jax.random.key(4), (B, V))
    got = np.asarray(sample_logits(logits, jax.random.key(5), temperature=2.0, top_k=k))
    allowed = np.argsort(-np.asarray(logits), axis=-1)[:, :k]  # [B, k]
    assert all(got[b] in allowed[b] for b in range(B))


def test_top_k_renormalises_over_survivors():
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    samples = _draw(probs, top_k=2)
    assert _chi2(samples, np.array([0.0, 0.4, 0.0, 0.3]) / 0.7) < CHI2_CRIT[1]


@pytest.mark.parametrize(
    "top_p, support",
    [(0.8, {0, 1}), (0.81, {0, 1, 2}), (0.1, {0}), (0.5, {0}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_nucleus(top_p, support):
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    samples = _draw(probs, top_p=top_p)
    assert set(np.unique(samples).tolist()) == support
    kept = np.array([p if i in support else 0.0 for i, p in enumerate(probs)])
    if len(support) > 1:
        assert _chi2(samples, kept / kept.sum()) < CHI2_CRIT[len(support) - 1]


def test_top_p_works_in_any_token_order():
    # Same distribution as above, permuted: the nucleus follows probability, not token id.
    probs = np.array([0.05, 0.3, 0.5, 0.15])
    assert set(np.unique(_draw(probs, top_p=0.8)).tolist()) == {1, 2}


def test_top_k_then_top_p():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # top_p alone: mass before each token is [0, .4, .7, .9] -> keeps {0, 1, 2}.
    assert set(np.unique(_draw(probs, top_p=0.75)).tolist()) == {0, 1, 2}
    # top_k=3 first renormalises to [.444, .333, .222]: mass before is [0, .444, .778] -> top_p=0.75 keeps {0, 1}.
    samples = _draw(probs, top_k=3, top_p=0.75)
    assert _chi2(samples, np.array([0.4, 0.3, 0.0, 0.0]) / 0.7) < CHI2_CRIT[1]


def test_seed_reproduces_and_varies():
    logits = jnp.zeros((512, 11))
    a = sample_logits(logits, jax.random.key(7), top_k=5, top_p=0.9)
    b = sample_logits(logits, jax.random.key(7), top_k=5, top_p=0.9)
    c = sample_logits(logits, jax.random.key(8), top_k=5, top_p=0.9)
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


def test_jit_with_static_settings():
    f = jax.jit(sample_logits, static_argnames=("temperature", "top_k", "top_p"))
    logits = jax.random.normal(jax.random.key(9), (8, 13), jnp.bfloat16)
    rng = jax.random.key(10)
    np.testing.assert_array_equal(
        f(logits, rng, temperature=0.8, top_k=3, top_p=0.9),
        sample_logits(logits, rng, temperature=0.8, top_k=3, top_p=0.9),
    )


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings_raise(kw):
    with pytest.raises(ValueError):
        sample_logits(jnp.zeros((1, 4)), jax.random.key(0), **kw)


# --- generate ----------------------------------------------------------------------------------------------------

V = 7  # prime vocabulary


def _counted(fn):
    """jit `fn` and count how many times it is traced (the Python body runs once per trace)."""
    traces = []

    def body(tokens):
        traces.append(tokens.shape)
        return fn(tokens)

    return jax.jit(body), traces


def _bigram(tokens):
    """Next token = (this token + 1) % V, as one-hot logits.  [B, L] -> [B, L, V]."""
    return 10.0 * jax.nn.one_hot((tokens + 1) % V, V)


def _first_of_window(tokens):
    """Every position predicts the buffer's first token.  [B, L] -> [B, L, V]. Causal: position 0 <= every i.

    Generation then reveals which token the window starts at, so it pins down the sliding behaviour.
    """
    return 10.0 * jnp.broadcast_to(jax.nn.one_hot(tokens[:, :1], V), (*tokens.shape, V))


def _reference_first_of_window(prompt_row, max_new_tokens, max_len):
    """Pure-Python greedy decode of `_first_of_window` with a sliding window of the last max_len tokens."""
    seq = list(prompt_row)
    for _ in range(max_new_tokens):
        seq.append(seq[-max_len:][0])
    return seq[len(prompt_row):]


def test_generate_greedy_bigram():
    fn, traces = _counted(_bigram)
    prompt = np.array([[3, 4], [0, 6]], np.int32)
    got = generate_uncached(fn, prompt, max_new_tokens=5, max_len=8, rng=jax.random.key(0), temperature=0.0)
    assert got.dtype == np.int32 and got.shape == (2, 5)
    np.testing.assert_array_equal(got, [[5, 6, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert len(traces) == 1


@pytest.mark.parametrize("P, max_new_tokens, max_len", [(3, 9, 5), (6, 4, 4), (2, 3, 5)])
def test_generate_sliding_window_matches_reference(P, max_new_tokens, max_len):
    # (3, 9, 5): the window fills mid-generation; (6, 4, 4): the prompt alone overflows; (2, 3, 5): never full.
    fn, traces = _counted(_first_of_window)
    prompt = (np.arange(2 * P, dtype=np.int32).reshape(2, P) + np.array([[1], [4]])) % V
    got = generate_uncached(fn, prompt, max_new_tokens=max_new_tokens, max_len=max_len, rng=jax.random.key(0),
                            temperature=0.0)
    want = [_reference_first_of_window(row.tolist(), max_new_tokens, max_len) for row in prompt]
    np.testing.assert_array_equal(got, want)
    assert len(traces) == 1  # same buffer shape every step, sliding included


def test_generate_eos_pads_and_stops_early():
    fn, _ = _counted(_bigram)
    prompt = np.array([[1], [4]], np.int32)
    eos = 5
    # Row 0: 2 3 4 5(eos) -> pads; row 1: 5(eos) at once. All done after step 4, so 4 tokens, not 10.
    got = generate_uncached(fn, prompt, max_new_tokens=10, max_len=16, rng=jax.random.key(0), temperature=0.0,
                            eos_id=eos)
    np.testing.assert_array_equal(got, [[2, 3, 4, 5], [5, 5, 5, 5]])


def test_generate_eos_unreached_runs_to_max():
    fn, _ = _counted(_bigram)
    got = generate_uncached(fn, np.array([[0]]), max_new_tokens=3, max_len=4, rng=jax.random.key(0), temperature=0.0,
                            eos_id=6)
    np.testing.assert_array_equal(got, [[1, 2, 3]])


def test_generate_sampling_reproducible_per_seed():
    def uniform(tokens):  # [B, L] -> [B, L, V], every token equally likely
        return jnp.zeros((*tokens.shape, V))

    prompt = np.zeros((4, 2), np.int32)
    run = lambda seed: generate_uncached(uniform, prompt, max_new_tokens=12, max_len=8, rng=jax.random.key(seed))
    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert (a[:, 0] != a[:, 1]).any()  # fold_in gives each step its own key


def test_generate_zero_new_tokens():
    got = generate_uncached(_bigram, np.array([[1, 2]]), max_new_tokens=0, max_len=4, rng=jax.random.key(0))
    assert got.shape == (1, 0) and got.dtype == np.int32
