"""Direct preference optimisation (Rafailov et al., 2023): the loss of chosen/rejected pairs against a reference model.

A pair is one row of the batch holding two documents (jaxpar.data.pairs): the prompt with the chosen answer
(segment 1), then the prompt with the rejected one (segment 2), then padding (segment 0); the loss mask marks the
answers' tokens. Packing the pair into one row keeps both halves on the same data shard, pipeline microbatch and
accumulation chunk, so the loss — nonlinear in each half's summed log-probability — never needs a row that another
rank holds; only context parallelism splits a row, and its ranks' partial sums are added before the nonlinearity.

For pair i, with log π(y|x) the summed log-probability of an answer's tokens under the policy and π_ref under the
reference (the model the run started from, its sums computed by a forward pass before each step and carried in
the batch as "ref" [B, 2]: `jaxpar.train.step.make_reference_step`):

    r_i^c = β · (log π(y_c|x) − log π_ref(y_c|x)),   r_i^r = β · (log π(y_r|x) − log π_ref(y_r|x))   (the rewards)
    sigmoid (DPO):   ℓ_i = −log σ(r_i^c − r_i^r)
    ipo (Azar et al., 2023): the log-probabilities are means over each answer's tokens, and
                     ℓ_i = ((r_i^c − r_i^r)/β − 1/(2β))²
    loss = mean_i ℓ_i

train.dpo_reference = "none" is the reference-free variant (π_ref ≡ 1: "ref" holds zeros). The step reports the
mean rewards of the chosen and rejected answers, their margin, and the share of pairs whose chosen reward is the
higher ("accuracy"), as TRL's DPOTrainer does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.parallel.context import Parallel

LOSSES = ("sigmoid", "ipo")
CHOSEN, REJECTED = 1, 2  # the segment ids of a pair's two documents


class DPO(NamedTuple):
    """The preference objective: β and the loss kind (`LOSSES`)."""

    beta: float = 0.1
    loss: str = "sigmoid"


def completion_logps(ce: jax.Array, weights: jax.Array, segments: jax.Array, par: Parallel,
                     differentiable: bool = True) -> tuple[jax.Array, jax.Array]:
    """Per pair, the answers' summed log-probabilities and their token counts: ce [R, T_local] (nats per target),
    weights [R, T_local] (the scored targets: the answers' tokens), segments [R, T_local] (the tokens' documents,
    `CHOSEN` / `REJECTED`) → (log-probs [R, 2], counts [R, 2]), columns (chosen, rejected), summed over the whole row.

    Under context parallelism each rank holds part of every row: the partial sums are added over `context`
    (`Parallel.sequence_sum`; differentiable=False: a plain psum, for the reference pass, which takes no gradient)."""
    sides = jnp.stack([segments == CHOSEN, segments == REJECTED], axis=-1).astype(jnp.float32)  # [R, T, 2]
    logps = jnp.einsum("rt,rtk->rk", -ce * weights, sides)
    counts = jnp.einsum("rt,rtk->rk", weights, sides)
    if differentiable:
        return par.sequence_sum(logps), par.sequence_sum(counts)
    return par.sequence_total(logps), par.sequence_total(counts)


def pair_loss(logps: jax.Array, counts: jax.Array, ref: jax.Array, dpo: DPO, shares: int = 1
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of R pairs: logps, counts [R, 2] (`completion_logps`), ref [R, 2] the reference's summed
    log-probabilities (zeros: reference-free) → (mean over the pairs of ℓ_i (module docstring), the sums the step
    reports: {"chosen", "rejected": Σ_i r_i (the rewards), "correct": Σ_i [r_i^c > r_i^r]}).

    shares: how many ranks hold these same pairs (context parallelism's degree): each rank's sums are divided by it,
    so that adding every rank's sums counts each pair once."""
    ratios = logps - ref.astype(jnp.float32)  # [R, 2]
    if dpo.loss == "ipo":
        ratios = ratios / jnp.maximum(counts, 1.0)
    rewards = dpo.beta * ratios
    margin = rewards[:, 0] - rewards[:, 1]  # [R]
    if dpo.loss == "sigmoid":
        per_pair = -jax.nn.log_sigmoid(margin)
    elif dpo.loss == "ipo":
        per_pair = jnp.square(margin / dpo.beta - 1.0 / (2.0 * dpo.beta))
    else:
        raise ValueError(f"unknown DPO loss {dpo.loss!r}; use one of {LOSSES}")
    rewards = jax.lax.stop_gradient(rewards)
    sums = {"chosen": rewards[:, 0].sum(), "rejected": rewards[:, 1].sum(),
            "correct": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32).sum()}
    return per_pair.mean(), jax.tree.map(lambda a: a / shares, sums)


def metrics(sums: dict[str, jax.Array], pairs: int) -> dict[str, jax.Array]:
    """The step's sums over its `pairs` pairs (`pair_loss`) as metrics: the mean rewards of the chosen and the
    rejected answers, their mean margin, and the share of pairs ranked right."""
    chosen, rejected = sums["chosen"] / pairs, sums["rejected"] / pairs
    return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
            "reward_accuracy": sums["correct"] / pairs}
