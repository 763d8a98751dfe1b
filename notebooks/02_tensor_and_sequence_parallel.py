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
# # Megatron's f and g: where tensor parallelism communicates, and what it costs
#
# Megatron tensor parallelism (Shoeybi et al. 2019) splits every matmul of a transformer layer over `t` devices and
# needs only **two** communication operators, placed where a tensor-parallel region begins and ends:
#
# | | forward | backward | where |
# |---|---|---|---|
# | **f** `copy_to_tensor` | identity | all-reduce | a replicated activation enters column-parallel matmuls |
# | **g** `reduce_from_tensor` | all-reduce | identity | partial sums leave a row-parallel matmul |
#
# This notebook takes that one idea in three steps:
#
# 1. f and g written by hand around one MLP, checked against the single-device MLP in value and gradients;
# 2. the collectives of the compiled train step of a whole model, counted from the HLO, beside the analytic formula
#    — with sequence parallelism (SP) off and on;
# 3. what SP buys for that traffic: activation memory per layer divided by `t`.
#
# Everything runs on 8 simulated CPU devices; every claim below is checked by an `assert`.

# %%
import os
import pathlib
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook hint, pulled in by a dependency
import jaxpar  # after the flags: jax reads them on first import

# Work from the repo root so configs/tiny.py resolves: the nearest parent holding pyproject.toml (run from
# notebooks/), else the checkout jaxpar was imported from (a copy of the notebook run elsewhere).
_here = pathlib.Path.cwd()
os.chdir(next((p for p in (_here, *_here.parents) if (p / "pyproject.toml").exists()),
              pathlib.Path(jaxpar.__file__).resolve().parents[1]))
assert pathlib.Path("configs/tiny.py").exists()

import time
import types
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import collectives
from jaxpar.analysis.report import activation_bytes_per_layer, analyze
from jaxpar.config import load_config
from jaxpar.mesh import make_mesh
from jaxpar.parallel.tensor import copy_to_tensor, reduce_from_tensor

START = time.perf_counter()
assert len(jax.devices()) == 8
print(jax.__version__, jax.devices()[0].platform, len(jax.devices()), "devices")

# %% [markdown]
# ## 1. f and g by hand on one MLP
#
# The MLP is $Z = \mathrm{GeLU}(XA)\,B$ with $X: [N, h]$, $A: [h, F]$, $B: [F, h]$. Split $A$ by **columns** and
# $B$ by **rows** over the `t` ranks of the `tensor` axis:
#
# $$A = [A_1 \mid \dots \mid A_t],\quad A_i: [h, F/t] \qquad B = \begin{bmatrix}B_1\\ \vdots\\ B_t\end{bmatrix},
# \quad B_i: [F/t, h]$$
#
# GeLU is elementwise, so it commutes with the column split: rank $i$ computes $Y_i = \mathrm{GeLU}(XA_i)$,
# $[N, F/t]$, with no communication. (A row split of $A$ would need a sum *before* the nonlinearity — one more
# all-reduce; that is why $A$ is split by columns.) Then
#
# $$Z = YB = \sum_{i=1}^t Y_i B_i .$$
#
# **g** is that sum: rank $i$ holds the partial product $Y_iB_i$, $[N, h]$, and all ranks need $Z$ — an all-reduce
# forward. Backward, $\partial Z/\partial(Y_iB_i) = I$, so each rank's cotangent is $dZ$ itself, which every rank
# already holds (every rank computes the same loss of the same replicated $Z$): **identity**.
#
# **f** sits where $X$ enters. Forward, every rank needs all of $X$, which it already has: **identity**. Backward,
# $X$ fed $t$ branches, so its gradient is the sum of their contributions,
#
# $$dX = \sum_{i=1}^t \big(dZ\,B_i^\top \odot \mathrm{GeLU}'(XA_i)\big)\,A_i^\top ,$$
#
# and term $i$ lives on rank $i$: an **all-reduce**.
#
# In one line: f is "copy $x$ to $t$ ranks" and g is "sum $t$ values onto every rank"; the transpose (VJP) of a copy
# is a sum and the transpose of a sum is a copy, so each one's backward is the other's forward. Per MLP the cost is
# one all-reduce of $[N, h]$ forward (g) and one backward (f); the gradients of $A_i$, $B_i$ need none — they are
# local, $dB_i = Y_i^\top dZ$, $dA_i = X^\top(\dots)$.
#
# Below, gradients are taken **inside** the `shard_map` (as `jaxpar`'s train step does), so autodiff sees f and g's
# hand-written VJPs and nothing else.

# %%
T = 4  # tensor degree
N, H, F = 8, 16, 32  # tokens, d_model, d_ff: A_i [16, 8], B_i [8, 16] per rank
mesh = jax.make_mesh((1, 1, T), ("data", "pipe", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                     devices=jax.devices()[:T])

k = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(k[0], (N, H))
A = jax.random.normal(k[1], (H, F)) / np.sqrt(H)
B = jax.random.normal(k[2], (F, H)) / np.sqrt(F)


def mlp_loss(x, a, b):
    """The single-device reference: L = ½‖GeLU(x·a)·b‖²."""
    z = jax.nn.gelu(x @ a) @ b  # [N, h]
    return 0.5 * jnp.sum(z**2)


def tp_mlp_loss(x, a_i, b_i, f=True):
    """The same loss on one rank: x [N, h] replicated, a_i [h, F/t] its columns, b_i [F/t, h] its rows."""
    if f:
        x = copy_to_tensor(x, "tensor")  # f: identity forward, all-reduce of dX backward
    partial = jax.nn.gelu(x @ a_i) @ b_i  # [N, h], this rank's term Y_i·B_i
    z = reduce_from_tensor(partial, "tensor")  # g: all-reduce forward, identity backward → Z on every rank
    return 0.5 * jnp.sum(z**2)


def tp_step(x, a_i, b_i):
    """Loss and gradients inside the shard_map, like the train step: (loss, dX, dA_i, dB_i)."""
    loss, grads = jax.value_and_grad(tp_mlp_loss, argnums=(0, 1, 2))(x, a_i, b_i)
    return loss, *grads


tp_fn = jax.jit(jax.shard_map(
    tp_step, mesh=mesh,
    in_specs=(P(), P(None, "tensor"), P("tensor", None)),  # X replicated, A column-split, B row-split
    out_specs=(P(), P(), P(None, "tensor"), P("tensor", None)),  # loss, dX replicated; dA, dB split like A, B
    check_vma=True))  # JAX checks that what leaves as replicated is replicated: f and g state their types

loss, dX, dA, dB = tp_fn(X, A, B)
ref_loss, (ref_dX, ref_dA, ref_dB) = jax.value_and_grad(mlp_loss, argnums=(0, 1, 2))(X, A, B)

for name, got, want in [("loss", loss, ref_loss), ("dX", dX, ref_dX), ("dA", dA, ref_dA), ("dB", dB, ref_dB)]:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    print(f"{name:<5}{got.shape!s:<10} max |tp − ref| = {np.abs(np.asarray(got) - np.asarray(want)).max():.1e}")

# %% [markdown]
# What f's all-reduce adds: drop f and return every rank's own $dX$ (stacked on a new leading dim). Each is only its
# branch's term of the sum above — none of them is $dX$ — and their sum is. (This one runs with `check_vma=False`:
# with the check on, JAX would see the replicated X meet rank-varying weights and insert f's all-reduce itself —
# the very mistake this cell shows is then impossible to make.)

# %%
no_f = jax.jit(jax.shard_map(
    lambda x, a, b: jax.grad(tp_mlp_loss)(x, a, b, f=False)[None], mesh=mesh,
    in_specs=(P(), P(None, "tensor"), P("tensor", None)), out_specs=P("tensor"), check_vma=False))
per_rank_dX = np.asarray(no_f(X, A, B))  # [t, N, h]: rank i's term
assert per_rank_dX.shape == (T, N, H)
assert all(not np.allclose(d, ref_dX, rtol=1e-2) for d in per_rank_dX)
np.testing.assert_allclose(per_rank_dX.sum(0), ref_dX, rtol=1e-5, atol=1e-6 * np.abs(ref_dX).max())
print("rank terms |dX_i| :", np.round(np.abs(per_rank_dX).mean((1, 2)), 4), " Σ_i dX_i = dX ✓")

# %% [markdown]
# The compiled program of the loss-and-gradients holds exactly the two all-reduces derived above, each of one
# $[N, h]$ float32 array. A ring all-reduce over `t` devices sends $2(t-1)/t$ of the array per device
# (a reduce-scatter then an all-gather, each $(t-1)/t$).

# %%
compiled = tp_fn.lower(X, A, B).compile()
mlp_cols = collectives(compiled, mesh)
for c in mlp_cols:
    print(f"{c.kind}@{','.join(c.axes)}  shape {c.shape}  ×{c.count}  sent {c.sent_bytes:.0f} B/device")
assert [(c.kind, c.axes, c.elements) for c in mlp_cols] == [("all-reduce", ("tensor",), N * H)] * 2
assert all(c.sent_bytes == 2 * (T - 1) / T * N * H * 4 for c in mlp_cols)

# %% [markdown]
# ## 2. The compiled collectives of a train step, beside the formula
#
# A transformer layer is two such regions: attention (QKV column-parallel by heads, output projection
# row-parallel) and the MLP. So per layer: forward g, g; backward f, f — **4 all-reduces** of the residual stream,
# $N = b\cdot s\cdot h\cdot\beta$ bytes each ($b$ rows per data shard, $s$ tokens, $h$ d_model, $\beta$ bytes per
# element):
#
# $$\text{TP: } 4 \cdot 2\tfrac{t-1}{t} N = 8\tfrac{t-1}{t}N \text{ per layer}.$$
#
# **Sequence parallelism** (Korthikanti et al. 2022) keeps activations *outside* the regions sharded on the
# sequence, $[b, s/t, h]$. An all-reduce is a reduce-scatter followed by an all-gather, so f becomes
# "all-gather forward, reduce-scatter backward" and g "reduce-scatter forward, all-gather backward": the same bytes.
# One extra cost (§4.2.2): the column-parallel matmul needs its *gathered* input again for $dW = X^\top dY$; keeping
# it would keep a full $[b, s, h]$ alive, so it is gathered again in the backward pass — 2 more all-gathers per layer:
#
# $$\text{TP+SP: } (4 + 4 + 2)\cdot\tfrac{t-1}{t}N = 10\tfrac{t-1}{t}N \text{ per layer}.$$
#
# Outside the layers: the vocab-parallel embedding exits through one g, the LM head enters through one f, and the
# vocab-parallel cross-entropy all-reduces three per-token scalars (max, $\sum e^z$, target logit) — never the logits.
# `jaxpar.analysis.report.analyze` compiles the real train step for a layout, reads every collective from the HLO
# (loop trip counts applied), and sets the total beside `jaxpar.planner.expected.tensor_bytes`.
#
# Layout: `configs/tiny.py` shrunk, no pipeline, (data, pipe, tensor) = (2, 1, 4) on the 8 devices.

# %%
SMALL = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=128", "model.n_layers=2",
         "model.max_seq_len=64", "train.batch_size=8", "train.seq_len=32",
         "parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]


def small_config(tensor, data, sp):
    return load_config("configs/tiny.py", SMALL + [f"parallel.tensor={tensor}", f"parallel.data={data}",
                                                   f"parallel.sequence_parallel={str(sp).lower()}"])


# The two compilations are independent; XLA compiles outside the GIL, so two threads use both cores.
with ThreadPoolExecutor(2) as pool:
    reports = dict(zip((False, True), pool.map(lambda sp: analyze(small_config(4, 2, sp), activations=False),
                                               (False, True))))
cfg = reports[False]["config"]
print(f"mesh {cfg['mesh']}, b = {cfg['batch_per_data_shard']} rows/data shard, s = {cfg['seq_len']}, "
      f"h = {cfg['d_model']}, L = {cfg['n_layers']}, {cfg['dtype']}")

# %%
def row(name, off, on):
    """One line: a name, then (count, KB) for SP off and for SP on; None prints a dash."""
    cell = lambda v: "".join(f"{'—' if x is None else x:>{w}}" for x, w in zip(v, (8, 12)))
    return f"{name:<24}{cell(off)}   {cell(on)}"


def kb(x):
    return f"{x / 1e3:.1f}"


coll = {sp: reports[sp]["collectives"] for sp in (False, True)}
want = {sp: reports[sp]["expected"]["tensor_sent_bytes"] for sp in (False, True)}
rows = [row("", ("SP off", ""), ("SP on", "")), row("compiled collective", ("count", "KB/dev"), ("count", "KB/dev"))]
for key in sorted(set(coll[False]["by_kind_and_axes"]) | set(coll[True]["by_kind_and_axes"])):
    v = [coll[sp]["by_kind_and_axes"].get(key) for sp in (False, True)]
    rows.append(row(key, *[(x["count"], kb(x["sent_bytes"])) if x else (None, None) for x in v]))
rows += ["", row("expected, tensor axis", ("", "KB/dev"), ("", "KB/dev"))]
for part in ("layers", "embedding", "head", "loss", "param_grads", "total"):
    rows.append(row(part, ("", kb(want[False][part])), ("", kb(want[True][part]))))
rows += ["", row("measured, tensor axis", ("", kb(coll[False]["tensor_sent_bytes"])),
                 ("", kb(coll[True]["tensor_sent_bytes"]))),
         row("measured / expected", *[("", f"{reports[sp]['ratio']['tensor_sent_bytes']:.4f}") for sp in (False, True)])]
print("\n".join(rows))

# %% [markdown]
# Reading the table (L = 2 layers here):
#
# - **SP off**: `all-reduce@tensor` = 4 per layer + 1 (embedding g) + 1 (head f) + 3 (loss scalars) + 1 — the last
#   is the optimizer's global gradient norm, a scalar sum of squares of tensor-sharded gradients that the compiler
#   inserts outside the `shard_map`; it is a few bytes and not Megatron's, so `tensor_sent_bytes` leaves it out.
# - **SP on**: the layer all-reduces are gone. `all-gather` = 6 per layer (2 forward entries, 2 backward exits,
#   2 re-gathers) + 1 (embedding backward) + 1 (head forward; XLA reuses that gather in the head's backward);
#   `reduce-scatter` = 4 per layer + 1 (embedding forward) + 1 (head backward). The remaining small all-reduces are
#   the loss scalars, the gradient norm, and f on the norm scales: under SP each rank applies a replicated norm to
#   its own tokens only, so its gradient is partial and must be summed (`param_grads`).
# - The layer traffic grows by exactly $10/8$ with SP; what SP buys for it is section 3.

# %%
b, s, h, beta = cfg["batch_per_data_shard"], cfg["seq_len"], cfg["d_model"], 4
L, t = cfg["n_layers"], cfg["mesh"]["tensor"]
N_bytes = b * s * h * beta  # one [b, s, h] float32 activation
for sp, per_layer in ((False, 8), (True, 10)):
    r = reports[sp]
    assert r["expected"]["tensor_sent_bytes"]["layers"] == L * per_layer * (t - 1) / t * N_bytes
    assert abs(r["ratio"]["tensor_sent_bytes"] - 1) < 0.02, r["ratio"]
    assert r["collectives"]["exact"]  # every loop's trip count was known
    print(f"SP {'on ' if sp else 'off'}: layers {L}·{per_layer}·(t−1)/t·N = "
          f"{L * per_layer * (t - 1) / t * N_bytes / 1e3:.1f} KB;  measured/expected total = "
          f"{r['ratio']['tensor_sent_bytes']:.4f}")

off, on = (reports[sp]["collectives"]["by_kind_and_axes"] for sp in (False, True))
assert off["all-reduce@tensor"]["count"] == 4 * L + 1 + 1 + 3 + 1 and "all-gather@tensor" not in off
assert on["all-gather@tensor"]["count"] == 6 * L + 2 and on["reduce-scatter@tensor"]["count"] == 4 * L + 2
assert off["all-reduce@data"] == on["all-reduce@data"]  # the data axis sees one gradient all-reduce either way
sp_layers, tp_layers = (reports[sp]["expected"]["tensor_sent_bytes"]["layers"] for sp in (True, False))
assert sp_layers / tp_layers == 10 / 8

# %% [markdown]
# ## 3. What SP buys: activation memory per layer divided by `t`
#
# Without SP, tensor parallelism splits only what lives *inside* the regions (QKV, attention scores, the MLP's
# hidden $[b, s, F/t]$). The residual stream, the norms and the inputs of the column-parallel matmuls stay
# replicated $[b, s, h]$ on every rank — Korthikanti's $s b h\,(10 + 24/t + 5as/(ht))$: the 10 never shrinks.
# With SP those are $[b, s/t, h]$ and the column-parallel input is re-gathered instead of saved, so *everything*
# per layer divides by $t$: $s b h\,(34/t + 5as/(ht))$.
#
# `activation_bytes_per_layer` measures it from the compiler: it compiles loss-and-gradients (parameters are
# arguments, gradients outputs, so XLA's temp bytes are the saved activations plus workspace) at $L$ and $2L$
# layers and divides the difference by $L$ — embedding, head, loss and workspace cancel. One data shard
# (data = 1) so the per-device batch stays the same as $t$ grows.

# %%
def act_per_layer(tensor, sp):
    one_shard = types.SimpleNamespace(data=1, pipe=1, expert=1, context=1, tensor=tensor)
    mesh_t = make_mesh(one_shard, jax.devices()[:tensor])
    return activation_bytes_per_layer(small_config(tensor, 1, sp), mesh_t)["per_layer"]


TS = (1, 2, 4)
# t = 1 has no tensor group, so SP off and on are the same program: measured once. Two compiles each, two threads.
runs = [(1, False)] + [(tt, sp) for tt in TS[1:] for sp in (False, True)]
with ThreadPoolExecutor(2) as pool:
    act = dict(zip(runs, pool.map(lambda r: act_per_layer(*r), runs)))
act[(1, True)] = act[(1, False)]
base = act[(1, False)]

print(f"{'t':>2}{'SP off KB':>12}{'SP on KB':>11}{'t=1 / t KB':>12}{'on·t / t=1':>12}")
for tt in TS:
    print(f"{tt:>2}{act[(tt, False)] / 1e3:>12.1f}{act[(tt, True)] / 1e3:>11.1f}{base / tt / 1e3:>12.1f}"
          f"{act[(tt, True)] * tt / base:>12.3f}")

fig, ax = plt.subplots(figsize=(5.5, 3.6))
ax.plot(TS, [act[(tt, False)] / 1e3 for tt in TS], "o-", label="TP (SP off)")
ax.plot(TS, [act[(tt, True)] / 1e3 for tt in TS], "s-", label="TP + SP")
ax.plot(TS, [base / tt / 1e3 for tt in TS], "k--", label="t = 1 value / t")
ax.set(xscale="log", yscale="log", xlabel="tensor degree t", ylabel="activation KB per layer per device",
       title="measured from the compiled program (float32)")
ax.minorticks_off()  # log-log: 1/t is a straight line; label the ticks plainly
ax.set(xticks=TS, xticklabels=TS, yticks=[400, 800, 1600], yticklabels=[400, 800, 1600])
ax.legend()
plt.show()

# %%
for tt in TS[1:]:
    assert act[(tt, True)] <= 1.1 * base / tt, (tt, act[(tt, True)], base / tt)  # SP: ≈ 1/t
    assert act[(tt, False)] > 1.1 * base / tt  # without SP the replicated part does not shrink
    assert act[(tt, True)] < act[(tt, False)]
print(f"t=4: SP off keeps {act[(4, False)] / base:.2f} of t=1's activations per layer, SP on "
      f"{act[(4, True)] / base:.2f} (1/t = 0.25)")
# within 10 % of 1/t, the margin above: XLA's buffer assignment moves the figure by a few per mille between
# releases (0.250 on jax 0.11, 0.24 on jax 0.12.1)
assert 0.35 < act[(4, False)] / base < 0.5 and abs(act[(4, True)] / base - 0.25) < 0.025

# %% [markdown]
# ## What the trade is
#
# Sequence parallelism costs $10/8 = 1.25\times$ the tensor-axis bytes per layer here (the two re-gathers; the f/g
# traffic itself is only re-cut into reduce-scatter + all-gather halves) and buys activation memory per layer
# $\approx 1/t$ instead of a replicated part that never shrinks with $t$ (at $t = 4$ above: 0.25 of $t = 1$'s
# instead of about 0.4). That memory is room for a longer sequence or a larger batch per device, or for less
# activation recomputation — Korthikanti et al.'s reason to pair SP with tensor parallelism.

# %%
elapsed = time.perf_counter() - START
print(f"notebook ran in {elapsed:.0f} s")
