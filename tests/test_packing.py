"""Packed documents (several per row, `segments`): attention never crosses a document, positions restart in each,
and no token is scored as the next one of another document — so the packed rows' loss and gradients equal those
of the same documents run one per row, on every layout.

The reference is that unpacked run on one device: each document alone in a row from position 0, padded, the
padding's targets masked out. The packed side puts the same documents several to a row with segment ids (and a
loss mask inside them, as chat data has), and runs at each layout. Sliding-window and full layers alternate, so
the window's mask meets the documents' in both kinds, and the MoE layers route the packed tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, on_layout
from jaxpar.config import MoEConfig, ModelConfig, ParallelConfig
from jaxpar.model import Transformer
from jaxpar.train.step import loss_and_grads, segment_positions

CFG = dict(vocab_size=263, d_model=24, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=20, max_seq_len=16,
           sliding_window=5, full_attention_every=2, init_std=0.2, scan_unroll=1,
           moe=MoEConfig(n_experts=4, top_k=2, d_ff=12, aux_loss_coef=0.0))
B, T = 8, 16  # packed rows of T + 1 tokens


def pack(rng):
    """Documents of 2..11 tokens (with a random loss mask inside each) first-fit into B rows of T + 1 slots →
    (packed {"tokens", "segments", "mask"} [B, T+1], the same documents one a row {"tokens", "mask"} [N, T+1])."""
    tokens = np.zeros((B, T + 1), np.int32)
    segments = np.zeros((B, T + 1), np.int32)
    mask = np.zeros((B, T + 1), np.int32)
    used, docs = [0] * B, []
    while True:
        n = int(rng.integers(2, 12))
        row = next((r for r in range(B) if used[r] + n <= T + 1), None)
        if row is None:
            break
        doc, scored = rng.integers(1, CFG["vocab_size"], n), rng.random(n) < 0.7
        scored[0] = False  # a document's first token is no target of its own document
        at = slice(used[row], used[row] + n)
        tokens[row, at], segments[row, at], mask[row, at] = doc, int(segments[row].max()) + 1, scored
        used[row] += n
        docs.append((doc, scored))
    alone = np.zeros((len(docs), T + 1), np.int32)
    alone_mask = np.zeros((len(docs), T + 1), np.int32)
    for i, (doc, scored) in enumerate(docs):
        alone[i, :len(doc)], alone_mask[i, :len(doc)] = doc, scored
    packed = {"tokens": jnp.asarray(tokens), "segments": jnp.asarray(segments), "mask": jnp.asarray(mask)}
    return packed, {"tokens": jnp.asarray(alone), "mask": jnp.asarray(alone_mask)}, sum(used) / (B * (T + 1))


@pytest.fixture(scope="module")
def reference():
    cfg = ModelConfig(**CFG)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    packed, alone, efficiency = pack(np.random.default_rng(5))
    assert alone["tokens"].shape[0] >= 2 * B and efficiency > 0.85  # several documents a row, few slots wasted
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, alone)
    return cfg, graphdef, packed, params, loss, grads


def test_positions_restart_in_each_document():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_positions(segments), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


def test_packed_rows_are_the_documents_one_a_row(reference):
    cfg, graphdef, packed, params, want_loss, want_grads = reference
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, packed)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)
    # without the segments the documents see each other: a different number
    crossed, _ = jax.jit(loss_and_grads(graphdef))(params, {k: packed[k] for k in ("tokens", "mask")})
    assert abs(float(crossed) - float(want_loss)) > 1e-3


LAYOUTS = {
    "(data, pipe, tensor) = (2, 2, 2) circular v=2 SP, accumulation 2": (
        dict(data=2, pipe=2, tensor=2, repeats=2, microbatches=2, sequence_parallel=True), 2),
    "(pipe, tensor) = (4, 2) circular skipping its bubble, 8 microbatches": (
        dict(pipe=4, tensor=2, microbatches=8, skip_bubble=True), 1),
    "(data, pipe, tensor) = (2, 2, 2) 1f1b": (dict(data=2, pipe=2, tensor=2, microbatches=4, schedule="1f1b"), 1),
    "(pipe, expert, tensor) = (2, 2, 2) zbv": (dict(pipe=2, expert=2, tensor=2, repeats=2, microbatches=4,
                                                     schedule="zbv"), 1),
    "(data, context, tensor) = (2, 2, 2) SP ring": (dict(data=2, context=2, tensor=2, sequence_parallel=True,
                                                         context_impl="ring"), 1),
    "(data, context) = (2, 4) all-gather": (dict(data=2, context=4, context_impl="all_gather"), 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_rows_match_the_documents_one_a_row_on_every_layout(reference, layout):
    cfg, _, packed, params, want_loss, want_grads = reference
    parallel, accumulate = LAYOUTS[layout]
    loss, grads = on_layout(cfg, params, packed, ParallelConfig(**parallel), grad_accum=accumulate)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)
