# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Balancing experts without an auxiliary loss (DeepSeek-V3)
#
# A mixture of experts left to itself routes most tokens to a few experts: the router's gradient rewards the experts
# that are already good, and they get better because they get the tokens. The classic fix is an auxiliary loss
# (Switch's `X · Σ_e f_e · P_e`) that pulls the router towards uniform use — at the price of a gradient that fights
# the language-modelling one.
#
# DeepSeek-V3 (§2.1.2) balances with no loss at all. Each MoE layer keeps a float32 vector `b` (one entry per
# expert, `e_score_correction_bias`), which is **model state, not a parameter**: no gradient reaches it. The experts
# a token goes to are the top-k of the *biased* scores, but the weights it mixes them with are the *unbiased* ones:
#
# $$s_e = \sigma(h \cdot w_e), \qquad \text{experts} = \operatorname{top-}k_e\,(s_e + b_e), \qquad
#   g_j = \text{routed\_scale} \cdot \frac{s_{e_j}}{\sum_{j'} s_{e_{j'}}}$$
#
# (plus group-limited selection: the experts come from the `topk_group` best of `n_group` groups, the groups ranked by
# the sum of their two best *biased* scores). After every step each layer's bias moves by a fixed amount γ
# (`moe.bias_update_rate`), against the step's global expert load — the assignments per expert counted over every
# row of the step, on every device:
#
# $$b_e \leftarrow b_e + \gamma \cdot \operatorname{sign}(\overline{\text{load}} - \text{load}_e)$$
#
# An overloaded expert's bias falls, so fewer tokens pick it next step; an idle one's rises. The bias only decides
# **which** experts run, never **how much** of each: the output stays a mixture with the router's own weights, and
# the language-modelling gradient is untouched. (jaxpar: `jaxpar.model.bias_update`, `jaxpar.parallel.expert.select`.)

# %%
import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"  # the live cell below runs on one CPU device
import importlib.util
import json

# the repo root: the nearest parent holding pyproject.toml (else the one above the installed package), so that
# configs/ and bench/results/ resolve when the notebook runs from notebooks/
here = pathlib.Path.cwd()
package = pathlib.Path(importlib.util.find_spec("jaxpar").origin).parent  # located, not imported (jax not loaded yet)
root = next((d for d in [here, *here.parents] if (d / "pyproject.toml").exists()), package.parent)
os.chdir(root)

import matplotlib.pyplot as plt
import numpy as np

# %% [markdown]
# ## 1. Two training runs of `deepseek_tiny`
#
# `configs/deepseek_tiny.py`: 4 layers (a dense first one, then 3 MoE layers of 8 routed experts in 4 groups of 2,
# top 2 from the best 2 groups, plus one shared expert), sigmoid scoring, **aux_loss_coef 0**, trained from the
# default corpus on 8 simulated devices (data 2 × expert 2 × tensor 2). Two runs of the config's 600 steps (warmup
# 50, then cosine to step 600), the same in every respect but γ: the bias
# update on (the config's γ = 1e-2) and off (`moe.bias_update_rate=0`, so the bias stays 0 and routing is plain
# group-limited top-k). The curves were recorded with `bench/balance.py` (the exact commands are in the JSON) —
# training takes tens of minutes on a CPU, so the notebook only reads them. (γ = 1e-3, DeepSeek-V3's own rate over
# its ~10^5 steps, is too slow here: the JSON's `exploratory` runs, and bench/RESULTS.md.)
#
# `moe_max_over_mean_load` is the worst MoE layer's busiest expert over the mean expert load at that step (1 is
# perfect balance; 8 would be every assignment on one expert); `moe_imbalance` is the same ratio with the loads
# summed over all MoE layers.

# %%
results = json.loads((root / "bench" / "results" / "deepseek_balance.json").read_text())
runs = results["runs"]
for name, run in runs.items():
    print(f"{name:>4}: {run['command']}")
    c = run["curve"]
    print(f"      step {c['step'][-1]}: max/mean load {c['moe_max_over_mean_load'][-1]:.3f} "
          f"(all layers {c['moe_imbalance'][-1]:.3f}), loss {c['loss'][-1]:.3f}, held-out {run['final_eval_loss']:.3f}")

# %%
fig, (ax_load, ax_loss) = plt.subplots(1, 2, figsize=(11, 3.8))
colors = {"on": "tab:blue", "off": "tab:red"}
for name, run in runs.items():
    c = run["curve"]
    label = f"bias update {name} (γ = {run['bias_update_rate']:g})"
    ax_load.plot(c["step"], c["moe_max_over_mean_load"], color=colors[name], label=label + ", worst layer")
    ax_load.plot(c["step"], c["moe_imbalance"], color=colors[name], ls=":", label=label + ", all layers")
    ax_loss.plot(c["step"], c["loss"], color=colors[name], label=label)
ax_load.axhline(1.3, color="gray", ls="--", lw=1, label="1.3")
ax_load.set(xlabel="step", ylabel="max / mean expert load", title="expert load (1 = balanced)", yscale="log")
ax_load.legend(fontsize=7)
ax_loss.set(xlabel="step", ylabel="train loss (nats/byte)", title="language-modelling loss", ylim=(None, 3.0))
ax_loss.legend(fontsize=7)
fig.tight_layout()
plt.show()

on, off = runs["on"]["curve"], runs["off"]["curve"]
assert on["moe_max_over_mean_load"][-1] <= 1.3, on["moe_max_over_mean_load"][-1]
assert off["moe_max_over_mean_load"][-1] > on["moe_max_over_mean_load"][-1]

# %% [markdown]
# ## 2. The bias picks the experts, never the gates (live)
#
# One of `deepseek_tiny`'s MoE routers, freshly initialised, routes a batch of 4 × 128 bytes (their embeddings,
# RMS-normalised, stand in for the layer's input) through `jaxpar.parallel.expert.route` twice: with a zero bias and
# with the bias one update step at the config's γ would set from that routing's loads (`jaxpar.model.bias_update`). The
# expert loads move towards the mean and many tokens change experts; the gates are the chosen experts' *unbiased*
# scores either way, and a token whose experts did not change has exactly the same gates.

# %%
import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import load_config
from jaxpar.model import Transformer, bias_update
from jaxpar.parallel.expert import route

config = load_config("configs/deepseek_tiny.py", [])
m, moe = config.model, config.moe
model = Transformer(m, rngs=nnx.Rngs(0))
router = model.blocks.router[...][0].astype(jnp.float32)  # [D, X]: the first MoE layer's

text = (root / "README.md").read_bytes()[:4 * 128]
tokens = jnp.asarray(np.frombuffer(text, np.uint8).astype(np.int32).reshape(4, 128))
h = model.embed[...][tokens].astype(jnp.float32)  # [B, T, D]
h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6)
logits = jnp.einsum("btd,dx->btx", h, router)  # [B, T, X]
scores = jax.nn.sigmoid(logits)


def routing(bias):
    return route(logits, moe.top_k, moe.norm_topk_prob, moe.capacity_factor, scoring=moe.scoring,
                 n_group=moe.n_group, topk_group=moe.topk_group, routed_scale=moe.routed_scale, bias=bias)


def expected_gates(r):
    """The gates from the unbiased scores of the chosen experts, renormalised, × routed_scale (V3)."""
    s = jnp.take_along_axis(scores, r.experts, axis=-1)
    return s / (s.sum(-1, keepdims=True) + 1e-20) * moe.routed_scale


plain = routing(jnp.zeros(moe.n_experts, jnp.float32))
load = plain.load.sum(0)  # [X] assignments per expert
bias = bias_update(jnp.zeros((1, moe.n_experts)), load[None], moe.bias_update_rate, False)[0]  # γ = 1e-2
biased = routing(bias)
new_load = biased.load.sum(0)
print("bias            ", np.round(np.asarray(bias), 3))
print("load, bias 0    ", np.asarray(load), f"max/mean {float(load.max() / load.mean()):.3f}")
print("load, biased    ", np.asarray(new_load), f"max/mean {float(new_load.max() / new_load.mean()):.3f}")
same = (jnp.sort(plain.experts, -1) == jnp.sort(biased.experts, -1)).all(-1)  # [B, T]: the same set of experts
print(f"tokens whose experts changed: {float(1 - same.mean()):.1%}")
for name, r in (("bias 0", plain), ("biased", biased)):
    error = float(jnp.abs(r.gates - expected_gates(r)).max())
    print(f"{name}: max |gate − unbiased renormalised score| = {error:.1e}")


def gate_of(r):
    """[B, T, X]: each token's gate per expert (0 where not chosen) — the order of a token's k choices follows the
    biased ranking, so gates are compared expert by expert."""
    B, T, _ = scores.shape
    return jnp.zeros(scores.shape).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], r.experts].set(
        r.gates)


# the same experts → the same gates, bit for bit
assert float(1 - same.mean()) > 0.1
assert float(jnp.abs(new_load - load.mean()).max()) < float(jnp.abs(load - load.mean()).max())
assert float(jnp.abs(biased.gates - expected_gates(biased)).max()) == 0.0
assert bool((jnp.where(same[..., None], gate_of(plain) == gate_of(biased), True)).all())
