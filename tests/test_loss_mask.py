"""The per-token loss mask (SFT's "score the assistant's tokens only"): the step's loss is Σ ce·w / Σ w over the
global batch's targets, on every layout, against the plain formula on one device — values and gradients.

The masks are uneven on purpose: each row masks in a different span (one row none at all), so the data shards,
pipeline stages, accumulation chunks and context ranks each hold a different number of targets — a loss averaged
per piece instead of over the whole step would differ from the reference here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, lay_out, on_layout
from jaxpar.config import MoEConfig, ModelConfig, ParallelConfig
from jaxpar.model import Transformer
from jaxpar.plan import make_plan
from jaxpar.sharding import param_specs
from jaxpar.train.step import loss_and_grads, make_eval_step, masked_mean

# 4 MoE layers (4 experts, top 2: the expert layouts route real tokens), odd vocab and widths.
# No aux loss: the objective is then the masked cross-entropy alone, which the plain formula below computes.
CFG = dict(vocab_size=263, d_model=24, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=20, max_seq_len=16,
           init_std=0.2, scan_unroll=1, moe=MoEConfig(n_experts=4, top_k=2, d_ff=12, aux_loss_coef=0.0))
B, T = 16, 16


def uneven_mask(rng, B: int, T: int) -> np.ndarray:
    """int32 [B, T+1]: row r scores tokens [start_r, end_r) (a "completion" after a "prompt"), row 3 none."""
    mask = np.zeros((B, T + 1), np.int32)
    for r in range(B):
        start = int(rng.integers(1, T))
        mask[r, start:int(rng.integers(start + 1, T + 2))] = 1
    mask[3] = 0
    return mask


def plain_masked_loss(model, tokens, mask):
    """The reference, written out: Σ_t nll(t)·mask[t+1] / Σ mask[:, 1:] from one device's logits."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    w = mask[:, 1:].astype(jnp.float32)
    return (nll * w).sum() / w.sum()


@pytest.fixture(scope="module")
def reference():
    cfg = ModelConfig(**CFG)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(11)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32),
             "mask": jnp.asarray(uneven_mask(rng, B, T))}
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: plain_masked_loss(nnx.merge(graphdef, p), batch["tokens"], batch["mask"])))(params)
    return cfg, graphdef, batch, params, loss, grads


def test_single_device_step_is_the_plain_formula(reference):
    cfg, graphdef, batch, params, want_loss, want_grads = reference
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert_grads_match(grads, want_grads)
    # the mask changes the number, and a mask of ones is the plain mean (tokens alone)
    plain, _ = jax.jit(loss_and_grads(graphdef))(params, batch["tokens"])
    ones, _ = jax.jit(loss_and_grads(graphdef))(params, {**batch, "mask": jnp.ones_like(batch["mask"])})
    assert abs(float(plain) - float(want_loss)) > 1e-3
    np.testing.assert_allclose(ones, plain, rtol=1e-6)


LAYOUTS = {
    "(data, pipe, tensor) = (2, 2, 2) circular SP, accumulation 2": (
        dict(data=2, pipe=2, tensor=2, microbatches=2, sequence_parallel=True), 2),
    "(data, pipe, tensor) = (2, 2, 2) 1f1b": (dict(data=2, pipe=2, tensor=2, microbatches=4, schedule="1f1b"), 1),
    "(pipe, expert, tensor) = (2, 2, 2) zbv": (dict(pipe=2, expert=2, tensor=2, repeats=2, microbatches=4,
                                                     schedule="zbv"), 1),
    "(data, context, tensor) = (2, 2, 2) SP ring": (dict(data=2, context=2, tensor=2, sequence_parallel=True,
                                                         context_impl="ring"), 1),
    "(data, context) = (2, 4) all-gather": (dict(data=2, context=4, context_impl="all_gather"), 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_loss_matches_the_plain_formula_on_every_layout(reference, layout):
    cfg, _, batch, params, want_loss, want_grads = reference
    parallel, accumulate = LAYOUTS[layout]
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**parallel), grad_accum=accumulate)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


def test_eval_step_takes_the_mask(reference):
    """The eval step's masked loss at (data, pipe, tensor) = (2, 2, 2) is the formula's."""
    cfg, _, batch, params, want_loss, _ = reference
    plan = make_plan(cfg, ParallelConfig(data=2, pipe=2, tensor=2, microbatches=2), jax.devices())
    graphdef, laid_out = lay_out(cfg, params, plan)
    evaluate = make_eval_step(graphdef, plan, param_specs=param_specs(laid_out, plan.rules, plan.param_zero_data))
    with jax.set_mesh(plan.mesh):
        loss = jax.jit(evaluate)(laid_out, jax.device_put(batch, plan.batch_sharding))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)


def test_a_step_with_no_target_is_zero_not_nan():
    assert float(masked_mean(jnp.ones((2, 3)), jnp.zeros((2, 3)), jnp.float32(0.0))) == 0.0


def test_a_batch_with_unknown_keys_is_refused(reference):
    _, graphdef, batch, params, _, _ = reference
    with pytest.raises(ValueError, match="'weights'"):
        loss_and_grads(graphdef)(params, {**batch, "weights": batch["mask"]})
