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
# # The circular pipeline schedule and its bubble
#
# A pipeline splits the `L` layers over `p` stages (devices on the mesh axis `pipe`) and feeds them `m`
# microbatches. While the first microbatch travels down the stages, the later stages have nothing to do; while the
# last one drains, the earlier ones idle. That idle time is the **bubble**.
#
# The **circular** schedule (Megatron's "interleaved", MaxText's "circular") cuts the layers into `p·v` chunks
# instead of `p`, and deals them out round-robin: stage `s` holds chunks `s, s + p, s + 2p, …`, so each microbatch
# loops `v` times through the stages. GPipe is the case `v = 1`. The fill and drain still take `p − 1` *iterations*,
# but one iteration now runs only `k = L/(p·v)` layers, so the bubble shrinks `v`-fold in wall time.
#
# | symbol | meaning |
# |---|---|
# | `p` | stages (`parallel.pipe`) |
# | `v` | repeats = passes through the stages (`parallel.repeats`; 1 is GPipe) |
# | `m` | microbatches (`parallel.microbatches`, a multiple of `p`) |
# | `k = L/(p·v)` | layers one stage runs in one iteration |
#
# This notebook derives the schedule, draws it, measures the bubble from the table and from the compiled train
# step, and checks that the pipelined model computes the same loss and gradients as the sequential one.

# %%
import os
import pathlib

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 simulated CPU devices, before jax loads
os.environ["JAX_PLATFORMS"] = "cpu"
import importlib.util

# the repo root: the nearest parent holding pyproject.toml (else the one above the installed package), so that
# configs/ and relative paths resolve when the notebook runs from notebooks/
here = pathlib.Path.cwd()
package = pathlib.Path(importlib.util.find_spec("jaxpar").origin).parent  # located, not imported (jax not loaded yet)
root = next((d for d in [here, *here.parents] if (d / "pyproject.toml").exists()), package.parent)
os.chdir(root)

from fractions import Fraction

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.parallel import circular
from jaxpar.parallel.circular import format_schedule, schedule
from jaxpar.parallel.pipeline import bubble_fraction, iterations, pipeline_order

assert len(jax.devices()) == 8
print(jax.__version__, jax.devices()[0].platform, len(jax.devices()), "devices")

# %% [markdown]
# ## Where the layers live
#
# Number the chunks `c = r·p + s` (pass `r`, stage `s`): chunk `c` holds layers `c·k … c·k + k − 1`, so
#
# $$\text{layer } l = (r\cdot p + s)\cdot k + i \quad\text{runs on stage } s \text{ in pass } r,\qquad i < k.$$
#
# The stacked layer axis `[L, …]` is stored *stage-major*: position `(s·v + r)·k + i` holds that layer
# (`pipeline_order`). Then an even split of the axis over `pipe` gives stage `s` exactly its `v·k` layers, and its
# local view reshapes to `[v, k, …]` — one slab of `k` layers per pass.

# %%
L, p, v = 8, 2, 2
k = L // (p * v)
order = pipeline_order(L, p, v)  # order[n] = the model layer stored at position n
print("stored order:", order.tolist())
local = order.reshape(p, v, k)  # [stage, pass, layer-in-chunk]: what each device holds after the split over `pipe`
for s in range(p):
    print(f"stage {s}: " + ",  ".join(f"pass {r} runs layers {local[s, r].tolist()}" for r in range(v)))
    for r in range(v):
        assert local[s, r].tolist() == [(r * p + s) * k + i for i in range(k)]
assert sorted(order.tolist()) == list(range(L))  # a permutation: every layer stored once
assert np.argsort(order).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # and its inverse puts gradients back in model order

# %% [markdown]
# ## The schedule table
#
# Every iteration each stage runs its `k` layers on one microbatch, then passes the activation to the next stage
# (`ppermute` `s → s+1`; the last stage wraps to stage 0 for the next pass). Stage `s` starts `s` iterations after
# stage 0, and a stage runs the `v·m` (microbatch, pass) pairs in the order `u = r·m + j`, so
#
# $$\text{stage } s \text{ at iteration } t \text{ runs microbatch } j = (t - s) \bmod m \text{ in pass }
#   r = \lfloor (t-s)/m \rfloor,\qquad\text{valid when } 0 \le t - s < v\cdot m.$$
#
# The last work is stage `p − 1` at `t = v·m + p − 2`, hence **`v·m + p − 1` iterations**, of which every stage
# idles `p − 1`. Pass `r + 1` of microbatch `j` starts on stage 0 at `t = (r+1)·m + j`; pass `r` left stage `p − 1`
# at `r·m + j + p − 1`. It arrives in time iff `m ≥ p`, and waits `m − p` iterations (the `park` buffer).
#
# `format_schedule` prints the table (cells `j.r` = microbatch.pass, `-` = bubble):

# %%
for p_, v_, m_ in [(4, 1, 4), (4, 2, 4), (2, 2, 4)]:
    print(format_schedule(p_, v_, m_), end="\n\n")


# %%
def check_schedule(p, v, m):
    """Assert every claim of the derivation above on the table `schedule(p, v, m)` ([t][s] → Slot or None)."""
    table = schedule(p, v, m)
    assert len(table) == iterations(p, v, m) == v * m + p - 1
    for s in range(p):
        runs = [(t, row[s]) for t, row in enumerate(table) if row[s] is not None]
        # every (microbatch, pass) exactly once, in the order u = r·m + j, starting at t = s, without gaps
        assert [c for _, c in runs] == [circular.Slot(j, r) for r in range(v) for j in range(m)]
        assert [t for t, _ in runs] == list(range(s, s + v * m))
        assert len(table) - len(runs) == p - 1  # p − 1 idle iterations per stage
    for t in range(1, len(table)):
        for s in range(1, p):  # stage s works on what stage s − 1 produced one iteration earlier
            assert table[t][s] == table[t - 1][s - 1]
    when = {(s, c.microbatch, c.repeat): t for t, row in enumerate(table) for s, c in enumerate(row) if c}
    for r in range(1, v):
        for j in range(m):  # pass r on stage 0 starts m − p iterations after pass r − 1 arrived from stage p − 1
            arrives = when[(p - 1, j, r - 1)] + 1
            assert when[(0, j, r)] - arrives == m - p >= 0


for p_ in (2, 4):
    for v_ in (1, 2, 4):
        for m_ in (p_, 2 * p_, 3 * p_):
            check_schedule(p_, v_, m_)
print("schedule invariants hold for p ∈ {2, 4}, v ∈ {1, 2, 4}, m ∈ {p, 2p, 3p}")

# %% [markdown]
# ## The same work on one clock
#
# Iteration counts hide the point: a circular iteration is `v` times shorter. Measure time in *layer-microbatch
# units* (one layer's forward on one microbatch): an iteration lasts `k = L/(p·v)` units, each stage does
# `m·L/p` units of useful work whatever `v` is, and the step takes
#
# $$(v\cdot m + p - 1)\cdot\frac{L}{p\,v} \;=\; \underbrace{\frac{m L}{p}}_{\text{useful}}
#   + \underbrace{(p-1)\frac{L}{p\,v}}_{\text{bubble}}.$$
#
# Below: `L = 16` layers on `p = 4` stages with `m = 4` microbatches, for GPipe (`v = 1`, `k = 4`) and circular
# `v = 2` (`k = 2`) and `v = 4` (`k = 1`). Colour = microbatch, darker = later pass, grey = bubble.

# %%
L, p, m = 16, 4, 4
colours = plt.get_cmap("tab10")
fig, axes = plt.subplots(3, 1, figsize=(10, 6.2), sharex=True)
for ax, v in zip(axes, (1, 2, 4)):
    k = L // (p * v)
    table = schedule(p, v, m)
    for t, row in enumerate(table):
        for s, slot in enumerate(row):
            if slot is None:
                ax.add_patch(plt.Rectangle((t * k, s), k, 1, facecolor="0.93", edgecolor="0.75", hatch="//", lw=0.5))
                continue
            shade = 1.0 - 0.5 * slot.repeat / max(v - 1, 1)
            r_, g_, b_, _ = colours(slot.microbatch)
            ax.add_patch(plt.Rectangle((t * k, s), k, 1, facecolor=(r_ * shade, g_ * shade, b_ * shade),
                                       edgecolor="white"))
            ax.text(t * k + k / 2, s + 0.5, f"{slot.microbatch}.{slot.repeat}", ha="center", va="center",
                    fontsize=7, color="white" if slot.repeat else "black")
    total, bubble = len(table) * k, (p - 1) * k
    assert total == m * L // p + bubble  # useful + bubble time per stage, as derived above
    ax.axvline(total, color="k", lw=1)
    ax.set_ylim(p, 0)
    ax.set_yticks([s + 0.5 for s in range(p)], [f"stage {s}" for s in range(p)])
    name = "GPipe" if v == 1 else "circular"
    ax.set_title(f"{name} v={v}, k={k}: {len(table)} iterations × {k} = {total} units, bubble {bubble} units "
                 f"({bubble_fraction(p, v, m):.3f})", fontsize=9)
axes[-1].set_xlim(0, iterations(p, 1, m) * L // p)
axes[-1].set_xlabel("time (layer-microbatch units); cells: microbatch.pass")
fig.tight_layout()
plt.show()

times = {v: iterations(p, v, m) * L // (p * v) for v in (1, 2, 4)}
print("step time per v:", times)
assert times == {1: 28, 2: 22, 4: 19}  # 16 useful units + 12, 6, 3 units of bubble

# %% [markdown]
# ## Bubble fraction against microbatches
#
# Each stage is busy `v·m` of the `v·m + p − 1` iterations, so the idle fraction of the table is
#
# $$\beta = \frac{p - 1}{v\cdot m + p - 1}.$$
#
# It depends on `v·m` only: `v` passes buy the same bubble as `v` times more microbatches, without making each
# microbatch smaller (small microbatches run matmuls inefficiently). The price is `v` times more activation
# hand-offs (`ppermute`s) per microbatch. Measured here as the fraction of `-` cells in the table, exactly:

# %%
p, ms = 4, (4, 8, 12, 16)
measured = {}
for v in (1, 2):
    for m in ms:
        table = schedule(p, v, m)
        idle = sum(slot is None for row in table for slot in row)
        measured[v, m] = Fraction(idle, p * len(table))
        assert measured[v, m] == Fraction(p - 1, v * m + p - 1)  # exact, not approximate
        assert float(measured[v, m]) == bubble_fraction(p, v, m)
    print(f"v={v}: " + "  ".join(f"m={m}: {measured[v, m]} = {float(measured[v, m]):.3f}" for m in ms))
assert all(measured[2, m] == measured[1, 2 * m] for m in (4, 8))  # only v·m matters

grid = np.linspace(4, 16, 200)
fig, ax = plt.subplots(figsize=(6, 3.5))
for v, c in ((1, "C0"), (2, "C1")):
    ax.plot(grid, (p - 1) / (v * grid + p - 1), color=c, lw=1, label=f"(p−1)/(v·m+p−1), v={v}")
    ax.plot(ms, [float(measured[v, m]) for m in ms], "o", color=c, label=f"idle cells / all cells, v={v}")
ax.set_xlabel("microbatches m")
ax.set_ylabel("bubble fraction")
ax.set_xticks(ms)
ax.set_title(f"p = {p}: measured from the schedule table vs formula", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What the compiled step executes
#
# The bubble is not idle silicon in this implementation: the loop runs `v·m + p − 1` iterations on every stage
# and bubble iterations compute on zeros (their results are discarded by `where`). So the layers' matmul FLOPs
# executed over those useful are `(v·m + p − 1)/(v·m)`. `jaxpar.analysis.report.analyze` compiles the train step
# and counts the matmul FLOPs in the HLO with loop trip counts applied. Embedding, LM head and loss run outside
# the loop on each stage's own rows (no bubble there), so the whole step's ratio sits a little *below* the layers'
# formula; `expected.step_flops` accounts for that dilution, and the measurement must match it.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook check, pulled in by the trainer
from jaxpar.analysis.report import analyze
from jaxpar.config import load_config

SMALL = ["model.vocab_size=263", "model.d_model=20", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=6", "model.d_ff=28", "model.max_seq_len=8", "train.seq_len=8", "train.batch_size=32",
         "parallel.tensor=1"]
for p, v, m in [(4, 1, 4), (4, 2, 4)]:  # same p and m: GPipe, then 2 passes (k = 2, then 1)
    config = load_config(None, SMALL + [f"parallel.pipe={p}", f"parallel.repeats={v}", f"parallel.microbatches={m}"])
    report = analyze(config, activations=False)  # (data, pipe, tensor) = (2, 4, 1)
    pp, want = report["pipeline"], report["expected"]["flops"]
    formula = (v * m + p - 1) / (v * m)
    print(f"p={p} v={v} m={m}: iterations {pp['iterations']}, executed/useful FLOPs measured "
          f"{pp['executed_over_useful_flops']:.4f}, with head dilution {want['executed'] / want['useful']:.4f}, "
          f"layers' formula {formula:.4f}")
    assert pp["iterations"] == iterations(p, v, m)
    assert pp["executed_over_useful_flops_layers_formula"] == formula
    assert 1 < pp["executed_over_useful_flops"] <= formula * 1.02
    assert abs(pp["executed_over_useful_flops"] / (want["executed"] / want["useful"]) - 1) < 5e-3

# %% [markdown]
# ## Same loss, same gradients as the sequential model
#
# The schedule only reorders work, so a pipelined step must compute what the plain model computes. The reference
# is `loss_and_grads` on one device (layers in model order, scanned). The pipelined run is the full composition at
# `(data, pipe, tensor) = (2, 2, 2)`, `v = 2`, `m = 4`, on 8 layers (`k = 2`), under one `shard_map`:
#
# 1. `make_plan` builds the mesh and gives the rules table, the vocab padded to a multiple of `tensor` (263 → 264)
#    and the layer order;
# 2. `plan.from_canonical` puts the reference parameters in that layout, `param_shardings` places them;
# 3. `sharded_loss_and_grads` runs the step; `plan.to_canonical` puts its gradients back in model order, unpadded.
#
# Batch `[16, 9]` tokens (8 inputs + 1 target shift): 8 rows per data shard, microbatches of 2 rows, each stage
# embeds and finally holds `m/p = 2` of them. Gradients are compared with `rtol = 1e-5` and an absolute floor of
# `1e-6 ×` the largest gradient (entries near zero carry only float32 rounding).

# %%
from jaxpar.config import ModelConfig, ParallelConfig
from jaxpar.model import Transformer
from jaxpar.plan import make_plan
from jaxpar.sharding import param_shardings, param_specs
from jaxpar.train.step import loss_and_grads, sharded_loss_and_grads

cfg = ModelConfig(vocab_size=263, d_model=20, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=28,
                  max_seq_len=8)
batch = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 9)), jnp.int32)  # [B, T + 1]

# reference: one device, model order
graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
want_loss, want_grads = jax.jit(loss_and_grads(graphdef))(params, batch)

# pipelined: the same parameters, laid out for the mesh
parallel = ParallelConfig(data=2, pipe=2, tensor=2, repeats=2, microbatches=4)
plan = make_plan(cfg, parallel, jax.devices())
mesh = plan.mesh
print("mesh", dict(mesh.shape), "| padded vocab", plan.padded_vocab, "| stored layer order", plan.layer_order.tolist())
assert plan.padded_vocab == 264 and plan.layer_order.tolist() == pipeline_order(8, 2, 2).tolist()

pipe_graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0), padded_vocab=plan.padded_vocab))
laid_out = plan.from_canonical(params)
laid_out = jax.device_put(laid_out, param_shardings(laid_out, mesh, plan.rules))
wq = laid_out["blocks"]["wq"][...]
print("wq", wq.shape, wq.sharding.spec, "→ per device", wq.addressable_shards[0].data.shape)
assert wq.addressable_shards[0].data.shape == (4, 20, 2, 6)  # [v·k layers of this stage, D, heads/t, head_dim]

fn = sharded_loss_and_grads(pipe_graphdef, plan, param_specs=param_specs(laid_out, plan.rules))
loss, grads = jax.jit(fn)(laid_out, jax.device_put(batch, plan.batch_sharding))
grads = plan.to_canonical(grads)  # back to model order

# %%
print(f"loss: sequential {float(want_loss):.7f}, pipelined {float(loss):.7f}")
np.testing.assert_allclose(loss, want_loss, rtol=1e-5)

flat_want = dict(nnx.to_flat_state(want_grads))
floor = 1e-6 * max(np.abs(np.asarray(g[...])).max() for g in flat_want.values())
flat_got = dict(nnx.to_flat_state(grads))
assert flat_got.keys() == flat_want.keys()
for path, g in flat_got.items():
    got, ref = np.asarray(g[...]), np.asarray(flat_want[path][...])
    assert got.shape == ref.shape, path
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=floor, err_msg=str(path))
    print(f"{'/'.join(path):18s} {str(got.shape):14s} max |Δ| {np.abs(got - ref).max():.1e}  "
          f"(max |g| {np.abs(ref).max():.1e})")
print(f"all {len(flat_got)} gradients agree (rtol 1e-5, atol {floor:.1e})")

# %% [markdown]
# ## Schedules that own the backward pass: 1F1B, interleaved, zero-bubble
#
# Above, autodiff writes the backward: one reversed loop after the whole forward, so every microbatch's activations
# are alive at the peak and nothing fills the bubble. `parallel.schedule` swaps that for a **table**
# (`jaxpar.parallel.schedule`): per tick and stage one action on a (microbatch, chunk) — `F` forward, `B` input
# gradient (sent on at once), `W` weight gradient (nothing waits for it) — and `executor.execute` runs any table
# under the same `shard_map` with an explicit `jax.vjp` per chunk: `F` stashes the vjp residuals and each matmul's
# input, `B` derives the input gradient and each matmul's output gradient `dy`, `W` only the weight gradients
# `Σ xᵀ·dy` (`jaxpar.parallel.weightgrad` splits the backward at the model's matmul groups, so neither half repeats the
# other), and a `lax.switch` per tick runs only the stage's own action (an idle tick computes nothing).
#
# | schedule | chunks per stage | bubble (F = B = W) | in flight per stage |
# |---|---|---|---|
# | `gpipe` | 1 | `2(p−1)/(3m+2(p−1))` | all `m` |
# | `circular` (the table of the loop above) | `v` | `2(p−1)/(3vm+2(p−1))` | all `v·m` |
# | `1f1b` | 1 | `2(p−1)/(3m+2(p−1))` | `p − s` |
# | `interleaved_1f1b` | `v` | `2(p−1)/(3vm+2(p−1))` | bounded in `m` |
# | `zb_h1` | 1 | `(p−1)/(3m+p−1)` | `≤ p` |
# | `zbv` (V: chunks `s` and `2p−1−s`) | 2 | `(p−1)/(6m+p−1)` | `≤ 2p` half-stage chunks |
#
# (Megatron's 1F1B bubble `(p−1)/(m+p−1)` counts B and W as one action sent after both; here `B` sends first.)

# %%
import matplotlib.pyplot as plt

from jaxpar.parallel import schedule as sched

tables = [sched.build("1f1b", 4, 1, 8), sched.build("zb_h1", 4, 1, 8), sched.build("zbv", 4, 2, 8)]
fig, axes = plt.subplots(len(tables), 1, figsize=(14, 2.2 * len(tables)))
for table, ax in zip(tables, axes):
    sched.validate(table)
    sched.draw(table, ax=ax)
fig.tight_layout()
plt.show()
print(f"{'schedule':17s} {'m':>3} {'ticks':>5} {'bubble':>7} {'formula':>7}  in flight per stage")
for name, v in [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]:
    for m in (4, 16):
        table = sched.build(name, 4, v, m)
        f = sched.formula_bubble(name, 4, v, m)
        assert abs(table.bubble - f) < 1e-12
        print(f"{name:17s} {m:3d} {table.n_ticks:5d} {table.bubble:7.3f} {f:7.3f}  {table.in_flight()}")

# %% [markdown]
# The memory that buys, from the compiled step (`memory_analysis`, nothing runs): GPipe keeps every microbatch until
# its backward, 1F1B at most `p − s`. At a fixed microbatch size, 4× the microbatches: GPipe's temporaries grow,
# 1F1B's stay. (`python -m bench.schedules` from the repository root has the whole table, every schedule at m = p … 8p.) And the executor
# is exact: ZB-V at `(2, 2, 2)` against the sequential reference of the section above.

# %%
from jaxpar.config import load_config
from jaxpar.train import build_trainer


def temp_bytes(name: str, m: int) -> int:
    """Compiled temporaries of the train step at (2, 2, 2), m microbatches of 2 rows x 64 tokens per data shard."""
    config = load_config(None, ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                                "model.head_dim=16", "model.d_ff=192", "model.max_seq_len=64", "train.seq_len=64",
                                "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.repeats=1",
                                f"parallel.schedule={name}", f"parallel.microbatches={m}",
                                f"train.batch_size={4 * m}"]).resolve_for_devices(8)
    trainer = build_trainer(config, jax.devices(), abstract=True)
    rows = jax.ShapeDtypeStruct((4 * m, 65), jnp.int32, sharding=trainer.plan.batch_sharding)
    return trainer.train_step.lower(trainer.state, rows).compile().memory_analysis().temp_size_in_bytes


temp = {(name, m): temp_bytes(name, m) for name in ("gpipe", "1f1b") for m in (2, 8)}
for name in ("gpipe", "1f1b"):
    print(f"{name:6s} temp MB at m=2: {temp[(name, 2)] / 2**20:6.2f}, at m=8: {temp[(name, 8)] / 2**20:6.2f} "
          f"(x{temp[(name, 8)] / temp[(name, 2)]:.2f})")
assert temp[("gpipe", 8)] > 1.5 * temp[("gpipe", 2)] and temp[("1f1b", 8)] < 1.1 * temp[("1f1b", 2)]

zbv_plan = make_plan(cfg, ParallelConfig(data=2, pipe=2, tensor=2, repeats=2, microbatches=4, schedule="zbv"),
                     jax.devices())
zbv_params = zbv_plan.from_canonical(params)
zbv_params = jax.device_put(zbv_params, param_shardings(zbv_params, zbv_plan.mesh, zbv_plan.rules))
zbv_fn = sharded_loss_and_grads(pipe_graphdef, zbv_plan, param_specs=param_specs(zbv_params, zbv_plan.rules))
zbv_loss, zbv_grads = jax.jit(zbv_fn)(zbv_params, jax.device_put(batch, zbv_plan.batch_sharding))
zbv_grads = dict(nnx.to_flat_state(zbv_plan.to_canonical(zbv_grads)))
np.testing.assert_allclose(zbv_loss, want_loss, rtol=1e-5)
for path, g in zbv_grads.items():
    np.testing.assert_allclose(np.asarray(g[...]), np.asarray(flat_want[path][...]), rtol=1e-5, atol=floor)
print(f"zbv: loss {float(zbv_loss):.7f} (sequential {float(want_loss):.7f}); all {len(zbv_grads)} gradients agree")

# %% [markdown]
# ## Summary
#
# * Stage `s` at iteration `t` runs microbatch `(t − s) mod m` in pass `⌊(t − s)/m⌋`; the step takes
#   `v·m + p − 1` iterations of `k = L/(p·v)` layers, and `m ≥ p` lets a microbatch wrap around in time.
# * Bubble fraction `(p − 1)/(v·m + p − 1)`, exactly the idle share of the table; in wall time the bubble is
#   `(p − 1)·L/(p·v)` layer-units, `v` times smaller than GPipe's at the same `m`.
# * The compiled step executes bubble iterations as real (discarded) work: executed/useful FLOPs stay within
#   `(v·m + p − 1)/(v·m)`.
# * Reordering the work changes nothing numerically: loss and every gradient match the sequential model at
#   `(data, pipe, tensor) = (2, 2, 2)`, `v = 2`, `m = 4`.
# * `parallel.schedule` runs a table instead (1F1B, interleaved, ZB-H1, ZB-V): the schedule, not autodiff, decides
#   when each backward runs, so at most `p` microbatches are in flight whatever `m` is — and still the same loss and
#   gradients.
