"""Context parallelism (jaxpar.parallel.context_parallel): the zigzag layout's balance, counted; loss and every
gradient against the single-device reference at context 2, 4, 8 × tensor 1, 2 × SP, both families, GQA, a sliding
window, and mixed with the pipeline, data parallelism, ZeRO, remat and gradient accumulation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, load_config
from jaxpar.parallel.context_parallel import contiguous, unmasked_pairs, zigzag

from _parity import assert_grads_match, exactly_zero, on_layout, single_device

# Sizes that hide nothing: 263-token vocab, width 20, 6-wide heads, GQA 4:2 (llama), a 48-token sequence cut into
# 2c chunks of 12, 6 or 3 tokens, and a 7-token sliding window that crosses chunk boundaries.
LLAMA = dict(vocab_size=263, d_model=20, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=28, max_seq_len=48,
             scan_unroll=1, init_std=0.1)
GPT2 = dict(LLAMA, family="gpt2", n_kv_heads=4, tie_embeddings=True)
B, T = 8, 48


def test_zigzag_balances_the_causal_pairs():
    """Every rank computes the same unmasked (query, key) pairs with zigzag chunks; contiguous shards give the last
    rank ((2c−1)·n + 1)/(n + 1) ≈ 2c − 1 times the first's (n = S/c tokens a rank)."""
    for c in (2, 4, 8):
        for S in (16 * c, 1024 * c):
            layout = zigzag(S, c)
            assert sorted(layout.ravel()) == list(range(S))  # a permutation: every token on exactly one rank
            pairs = unmasked_pairs(layout)
            assert pairs.max() == pairs.min() and pairs.sum() == S * (S + 1) // 2
            flat = unmasked_pairs(contiguous(S, c))
            n = S // c
            assert flat.max() / flat.min() == pytest.approx(((2 * c - 1) * n + 1) / (n + 1))
        assert flat.max() / flat.min() > 2 * c - 1.05  # at S = 1024·c: all but 2c − 1
    # a sliding window W: every query sees W keys but the first W − 1, whose ramp (W(W−1)/2 pairs fewer) is rank 0's
    pairs = unmasked_pairs(zigzag(1024, 4), window=100)
    assert pairs.max() - pairs.min() == 100 * 99 // 2 and (pairs[1:] == 100 * 256).all()


@pytest.fixture(scope="module", params=["llama", "gpt2", "llama_window"])
def reference(request):
    # llama_window: Qwen3-like (a window and the q/k norm), with full layers among the windowed ones (each other
    # layer: the ring's and the all-gather's masks are written per layer) and the windowed layers' own RoPE base
    window = dict(sliding_window=7, full_attention_every=2, local_rope_theta=500.0, qk_norm=True)
    fields = GPT2 if request.param == "gpt2" else dict(LLAMA, **(window if "window" in request.param else {}))
    cfg = ModelConfig(**fields)
    batch = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    return (request.param, cfg, batch, *single_device(cfg, batch))


LAYOUTS = [  # (context, tensor, sequence_parallel); data fills the 8 devices
    (2, 1, False), (2, 2, False), (2, 2, True), (4, 1, False), (4, 2, False), (4, 2, True), (8, 1, False)]


@pytest.mark.parametrize("impl", ["all_gather", "ring"])
@pytest.mark.parametrize("context,tensor,sequence", LAYOUTS, ids=lambda x: str(x))
def test_context_parallel_matches_reference(reference, impl, context, tensor, sequence):
    name, cfg, batch, params, want_loss, want_grads = reference
    if name == "llama_window" and (context, tensor, sequence) not in [(4, 2, True), (8, 1, False)]:
        pytest.skip("the sliding window runs at two layouts")
    if name == "gpt2" and (context, tensor, sequence) not in ([(4, 2, True)] if impl == "ring" else
                                                              [(2, 2, False), (4, 2, True), (8, 1, False)]):
        pytest.skip("gpt2 (learned positions, tied head, LayerNorm) runs three layouts, the ring one")
    parallel = ParallelConfig(data=8 // (context * tensor), context=context, tensor=tensor,
                              sequence_parallel=sequence, context_impl=impl)
    loss, grads = on_layout(cfg, params, batch, parallel)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


@pytest.mark.parametrize("layout,schedule,extra", [
    (dict(data=1, pipe=2, context=2, tensor=2, repeats=2, microbatches=2), "circular", {}),
    (dict(data=1, pipe=2, context=2, tensor=2, repeats=2, microbatches=2, context_impl="ring"), "circular", {}),
    (dict(data=1, pipe=2, context=2, tensor=2, sequence_parallel=True, microbatches=2), "1f1b", {}),
    (dict(data=2, pipe=1, context=2, tensor=2, zero=3), "circular", dict(remat="full", grad_accum=2)),
], ids=["pipe-circular", "pipe-circular-ring", "pipe-1f1b-sp", "zero3-remat-accum"])
def test_context_parallel_composes(reference, layout, schedule, extra):
    """(data, pipe, context, tensor) mixes: the pipelines move sequence shards; ZeRO-3, remat and accumulation."""
    name, cfg, batch, params, want_loss, want_grads = reference
    if name != "llama":
        pytest.skip("composition does not depend on the family")
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(schedule=schedule, **layout), **extra)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


@pytest.mark.parametrize("fields,match", [
    (["parallel.context=4", "train.seq_len=36"], r"train.seq_len = 36: .*2 × parallel.context = 2 × 4 = 8.*Fix"),
    (["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.seq_len=12"],
     r"train.seq_len = 12: .*Fix"),
    (["parallel.context=2", "parallel.context_impl=striped"], r"parallel.context_impl = 'striped'.*Fix"),
    (["parallel.context=2", "parallel.context_impl=ring", "parallel.pipe=2", "parallel.schedule=1f1b",
      "parallel.microbatches=2", "model.n_layers=4"], r"parallel.context_impl = 'ring': .*branches.*Fix: use "
     r"parallel.context_impl=all_gather"),
])
def test_context_parallel_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.max_seq_len=64", "train.seq_len=64", "train.batch_size=8"] + fields)


@pytest.mark.parametrize("layout", ["parallel.data=2 parallel.context=2 parallel.tensor=2",
                                    "parallel.data=1 parallel.context=4 parallel.tensor=2 parallel.sequence_parallel=true",
                                    "parallel.data=2 parallel.context=4 parallel.context_impl=ring"])
def test_context_bytes_and_flops_follow_the_formulas(layout):
    """From the compiled step: context-axis bytes (K/V all-gathers forward, their gradients' reduce-scatters
    backward) = `expected.context_bytes`; tensor-axis bytes and matmul FLOPs on each device's S/c tokens = theirs;
    the zigzag layout's causal pairs are equal across ranks (`jaxpar analyze` reports the same section)."""
    from jaxpar.analysis.report import analyze

    fields = [f"model.{k}={v}" for k, v in LLAMA.items() if k not in ("scan_unroll", "init_std")]
    config = load_config(None, fields + ["train.seq_len=48", "train.batch_size=8", "parallel.pipe=1",
                                         "parallel.repeats=1", "parallel.microbatches=1"] + layout.split())
    report = analyze(config, activations=False)
    ctx = report["context"]
    kinds = {"collective-permute@context"} if "ring" in layout else {"all-gather@context", "reduce-scatter@context"}
    assert set(ctx["by_kind"]) >= kinds
    assert ctx["sent_bytes"] == ctx["expected_sent_bytes"] > 0
    if "ring" in layout:  # its backward recomputes each block's q·kᵀ (2·a·E FLOPs a query-key pair, forward's half)
        tokens = config.train.batch_size // 2 * config.train.seq_len // 4  # this device's: 4 rows of S/c = 12
        extra = config.model.n_layers * tokens * 2 * config.model.n_heads * config.model.head_dim * 48
        assert report["flops"]["dot_flops"] == pytest.approx(report["expected"]["flops"]["executed"] + extra)
    else:
        assert report["ratio"]["flops"] == pytest.approx(1.0)
    if config.parallel.tensor > 1:
        assert report["ratio"]["tensor_sent_bytes"] == pytest.approx(1.0)
    assert ctx["pairs_max_over_min"] == 1.0 and ctx["contiguous_pairs_max_over_min"] > 2
