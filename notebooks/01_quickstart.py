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
# # Quickstart: from a config to a sharded training run
#
# One idea: **a config names the degrees of parallelism, the mesh gives them devices, and one rules table places
# every array on that mesh.** We follow a tiny byte-level Llama through the Python API:
#
# 1. **config**: load `configs/tiny.py`, shrink it, resolve it for 8 devices;
# 2. **mesh**: `(data, pipe, tensor) = (2, 2, 2)`;
# 3. **model**: parameters born sharded by the logical rules; look at where they live;
# 4. **train**: 30 steps with `jaxpar.train.fit`, plot the loss, sample a few bytes.
#
# There is no accelerator here: XLA simulates 8 CPU devices. The flag must be set before `jax` is imported, since a
# process picks its device count once.

# %%
import os
import pathlib

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

# Run from the repo root so that configs/tiny.py resolves: the nearest parent of the working directory (the
# notebook may be started from notebooks/) holding pyproject.toml, else the checkout the installed jaxpar lives in.
import importlib.util

candidates = [pathlib.Path.cwd(), *pathlib.Path.cwd().parents,
              pathlib.Path(importlib.util.find_spec("jaxpar").origin).parent.parent]
root = next(d for d in candidates if (d / "pyproject.toml").exists() and (d / "configs" / "tiny.py").exists())
os.chdir(root)

import tempfile
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook probe, from a dependency

import jax
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import data as data_lib
from jaxpar import sharding
from jaxpar.config import load_config
from jaxpar.infer.text import generate_text, load
from jaxpar.train import build_trainer, fit

assert jax.device_count() == 8, jax.devices()
print(jax.device_count(), "devices:", jax.devices())

# %% [markdown]
# ## 1. Config
#
# `load_config` takes the same `section.field=value` overrides as the command line and returns a frozen, validated
# `Config`. We shrink the preset so that it trains in seconds: width 48 (so 4 heads of 12, 2 kv heads, SwiGLU hidden
# width $\lceil \tfrac{8}{3}\cdot 48 / 32\rceil \cdot 32 = 128$), 16 sequences of 64 bytes per step, 30 steps. The
# preset warms the learning rate up over 50 steps; with 30 steps we warm up over 10 so the run reaches its peak rate.
#
# The preset leaves `parallel.data = -1` ("fill the devices left over"); `resolve_for_devices(8)` fills it:
# $8 / (\text{pipe}\cdot\text{tensor}) = 8 / (2\cdot 2) = 2$, and checks the batch arithmetic against it.

# %%
overrides = ["model.d_model=48", "train.steps=30", "train.batch_size=16", "train.seq_len=64",
             "train.warmup_steps=10", "train.log_every=5", "train.eval_every=15"]
config = load_config("configs/tiny.py", overrides)
print("as loaded:  ", config.mesh_shape, "(data, pipe, expert, context, tensor)")
config = config.resolve_for_devices(jax.device_count())
print("for 8 devs: ", config.mesh_shape)
m, par, tr = config.model, config.parallel, config.train
print(f"model: L={m.n_layers} D={m.d_model} heads={m.n_heads} kv_heads={m.n_kv_heads} head_dim={m.head_dim} "
      f"d_ff={m.d_ff} vocab={m.vocab_size}")
print(f"pipeline: stages={par.pipe} repeats={par.repeats} microbatches={par.microbatches}")

assert config.mesh_shape == (2, 2, 1, 1, 2)
assert (m.head_dim, m.d_ff) == (48 // 4, 128)
# Batch arithmetic: 16 rows / 2 data shards = 8 rows per shard, cut into 4 microbatches of 2 rows.
assert tr.batch_size // par.data // par.microbatches == 2

# %% [markdown]
# What each axis means for this run:
#
# - **`data` = 2**: data parallelism. The two data groups see different rows of the batch and hold identical
#   parameters; their gradients are averaged with one all-reduce per step.
# - **`pipe` = 2**: a *circular* pipeline. The 4 layers are split over 2 stages and the activations go round the
#   stages `repeats = 2` times (stage 0 runs layers 0 and 2, stage 1 runs 1 and 3), microbatch by microbatch; the
#   bubble is $(p-1)/(v\,m+p-1) = 1/(2\cdot4+1) = 1/9$ of the iterations.
# - **`expert` = 1, `context` = 1**: axes reserved for mixture-of-experts and context parallelism. They are in the
#   mesh at size 1 (which costs nothing) so that every layout already speaks all five axes; nothing splits over them
#   yet, and the config refuses a degree above 1.
# - **`tensor` = 2**: Megatron tensor parallelism. Each layer's heads and MLP columns (and the vocabulary) are split
#   over a pair of devices that exchange partial sums inside every layer, so it is the innermost axis: a tensor pair
#   is two neighbouring devices (on a GPU host, NVLink peers).

# %% [markdown]
# ## 2. Mesh
#
# `build_trainer(config, devices)` starts from one *plan* (`jaxpar.plan.make_plan`): it checks the layout
# against the devices once and lays the 8 devices out as a `2 × 2 × 1 × 1 × 2` array with the axes of
# `jaxpar/parallel/axes.py`, `("data", "pipe", "expert", "context", "tensor")`. Tensor is innermost (fastest
# varying), so device $i$ sits at $(d, p, t)$ with $i = 4d + 2p + t$ (the size-1 axes add nothing to the index).
#
# `build_trainer` also creates the optimizer, the train/eval steps and the state. The state is *born sharded*: the
# parameter shapes come from `nnx.eval_shape`, the rules turn their logical axes into `PartitionSpec`s, and
# `jit(init, out_shardings=...)` creates each shard directly on its device, so no device ever holds a full copy.

# %%
trainer = build_trainer(config, jax.devices())
mesh = trainer.mesh
print(mesh)
grid = mesh.devices[:, :, 0, 0, :]  # [data, pipe, tensor]: expert and context have size 1
print(np.vectorize(lambda d: d.id)(grid))

ids = np.vectorize(lambda d: d.id)(grid)
assert dict(mesh.shape) == {"data": 2, "pipe": 2, "expert": 1, "context": 1, "tensor": 2}
assert all(ids[d, p, t] == 4 * d + 2 * p + t for d in range(2) for p in range(2) for t in range(2))

# %% [markdown]
# ## 3. Model: the rules table and born-sharded parameters
#
# The model never names a mesh axis. Each parameter carries *logical* axes (`wq: ("layers", "embed", "heads",
# "head_dim")`), and one table maps logical names to mesh axes (anything mapped to `None` is replicated). It is
# derived from the mesh-axis table of `jaxpar/parallel/axes.py`, where each axis lists the logical names it splits:

# %%
for logical, mesh_axes in sharding.RULES:
    print(f"{logical:9s} -> {mesh_axes}")

# %% [markdown]
# Reading a spec: entry $k$ names the mesh axis that dim $k$ is split over. For `wq [L, D, H, E]`:
# `layers → pipe`, `heads → tensor`, the rest replicated, so each device holds
# $[L/2, D, H/2, E] = [2, 48, 2, 12]$.

# %%
params = trainer.state.params

print(f"{'param':8s} {'shape':16s} {'logical axes':42s} spec -> per-device shard")
for name in ["wq", "wk", "wo", "w_up", "w_down", "attn_norm"]:
    var = params["blocks"][name]
    arr = var[...]
    axes = var.get_metadata()["logical_axes"]
    shard = arr.addressable_shards[0].data.shape
    print(f"{name:8s} {str(arr.shape):16s} {str(axes):42s} {arr.sharding.spec} -> {shard}")
    assert arr.sharding.spec == sharding.logical_to_spec(axes)  # the table, applied

wq, w_up = params["blocks"]["wq"][...], params["blocks"]["w_up"][...]
assert wq.sharding.spec == P("pipe", None, "tensor", None)
assert wq.addressable_shards[0].data.shape == (2, 48, 2, 12)
assert w_up.addressable_shards[0].data.shape == (2, 48, 64)

# %% [markdown]
# Pictures. `jax.debug.visualize_array_sharding` draws a 2-D array's blocks with the devices that hold each.
#
# - **Embedding `[V, D] = [256, 48]`**, logical `("vocab", "embed")` → `P("tensor", None)`: vocab-parallel, rows
#   0–127 on tensor rank 0, rows 128–255 on rank 1, each half replicated over the 4 `(data, pipe)` groups.
# - **One layer of `w_up`, `[D, F] = [48, 128]`**: column-parallel, the hidden columns split over `tensor`.
#   Indexing `w_up[0]` makes a new array: a layer lives on one pipeline stage only, and the slice comes back
#   replicated over `data` and `pipe` with the `tensor` split kept.
# - **The whole stack of `w_up`** viewed as `[L·D, F] = [192, 128]` (a reshape of the outermost dim, so the layout
#   carries over): rows split by stage, columns by tensor rank. The stacked layer axis is kept in *pipeline order*
#   (stage-major), so stage 0's two slots hold model layers 0 and 2 (`trainer.plan.layer_order`).
#
# `visualize_array_sharding` needs `rich`; if it cannot draw we print each device's block of indices instead.

# %%
def show_sharding(arr: jax.Array, title: str) -> None:
    """Draw which devices hold which block of a 1-D/2-D array (fallback: the per-device index map)."""
    print(f"{title}: shape {arr.shape}, spec {arr.sharding.spec}")
    try:
        jax.debug.visualize_array_sharding(arr)
    except Exception as err:  # no rich / no terminal: print the same information as text
        print(f"  (visualize unavailable: {type(err).__name__}); device -> index block:")
        for device, index in sorted(arr.sharding.devices_indices_map(arr.shape).items(), key=lambda kv: kv[0].id):
            print(f"  {device}: {index}")


embed = params["embed"][...]
show_sharding(embed, "embed [V, D]")

layer0 = w_up[0]
show_sharding(layer0, "w_up[0] [D, F]")

L, D, F = w_up.shape
stack = jax.jit(lambda w: w.reshape(L * D, F), out_shardings=jax.NamedSharding(mesh, P("pipe", "tensor")))(w_up)
show_sharding(stack, "w_up as [L*D, F]")
print("layer_order (model layer at each slot of the stacked axis):", trainer.plan.layer_order)

# Who holds what, checked from the device index maps (device at mesh position (d, p, t) → its block).
def blocks_of(arr):
    index = arr.sharding.devices_indices_map(arr.shape)
    return {(d, p, t): index[grid[d, p, t]] for d in range(2) for p in range(2) for t in range(2)}


half = lambda t, n: slice(n // 2 * t, n // 2 * (t + 1))  # tensor rank t's half of n
assert all(b == (half(t, 256), slice(None)) for (d, p, t), b in blocks_of(embed).items())  # vocab rows by tensor
assert all(b == (slice(None), half(t, 128)) for (d, p, t), b in blocks_of(layer0).items())  # slice: on all stages
assert all(b[:2] == (slice(2 * p, 2 * p + 2), slice(None)) and b[2] == half(t, 128)  # stage p: slots 2p, 2p+1
           for (d, p, t), b in blocks_of(w_up).items())
for a, b in zip(w_up.addressable_shards, stack.addressable_shards):  # the [L*D, F] view moved no data
    assert a.device == b.device and np.array_equal(np.asarray(a.data).reshape(-1, 64), np.asarray(b.data))
assert list(trainer.plan.layer_order) == [0, 2, 1, 3]


# %% [markdown]
# Memory per device. The layer matrices are split 4 ways (2 stages × 2 tensor ranks), the per-layer norms 2 ways
# (stages only), embedding and LM head 2 ways (`tensor` only: embedding and loss run on every stage), the final norm
# not at all:
#
# $$\text{per device} = \tfrac{1}{4}\,\text{layer matrices} + \tfrac{1}{2}\,(\text{layer norms} + \text{embed} +
# \text{head}) + \text{final norm}.$$
#
# AdamW's two moments are created with the same shardings, so optimizer memory divides the same way.

# %%
leaves = jax.tree.leaves(params)
total = sum(x.size for x in leaves)
per_device = sum(x.addressable_shards[0].data.size for x in leaves)
blocks = params["blocks"]
matrices = sum(blocks[k][...].size for k in ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"])
norms = blocks["attn_norm"][...].size + blocks["mlp_norm"][...].size
vocab_tables = params["embed"][...].size + params["lm_head"][...].size
print(f"parameters: {total:,} in all, {per_device:,} on device 0 ({per_device / total:.2f})")
assert total == matrices + norms + vocab_tables + m.d_model
assert per_device == matrices // 4 + (norms + vocab_tables) // 2 + m.d_model

# Adam's first and second moments (every non-scalar optimizer leaf, in parameter order) carry the params' shardings.
moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim]
assert [x.sharding for x in moments] == [x.sharding for x in leaves] * 2

# %% [markdown]
# ## Activations: the batch
#
# A training batch is `int32 [B, T + 1]`: each row is a window of $T+1$ bytes, inputs `row[:-1]`, targets
# `row[1:]`. Its logical axes are `("batch", None)`, and the rule `batch → ("data", "pipe", "expert")` splits the
# $B = 16$ rows 4 ways (`expert` has size 1): over `data` (data parallelism) and over `pipe`, because embedding, final norm, LM head and loss run
# *outside* the pipeline loop on each stage's own rows. Tensor ranks get the same rows. `trainer.put` places a host
# batch this way (here, the first batch of the default corpus, this Python's standard-library sources).

# %%
tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
tokens = data_lib.load_tokens(config.data, tokenizer, "train", seq_len=tr.seq_len, seed=tr.seed)
loader = data_lib.make_loader(tokens, batch_size=tr.batch_size, seq_len=tr.seq_len, seed=tr.seed)
rows = next(loader)  # int32 [16, 65]
print("rows", rows.shape, rows.dtype, "| row 0:", repr(tokenizer.decode(rows[0].tolist())))

batch = trainer.put(rows)
show_sharding(batch, "batch [B, T+1]")

assert rows.shape == (tr.batch_size, tr.seq_len + 1)
assert batch.sharding.spec == P(("data", "pipe", "expert"), None)
for shard in batch.addressable_shards:
    d, p, t = map(int, np.argwhere(ids == shard.device.id)[0])
    assert shard.data.shape == (4, 65)
    np.testing.assert_array_equal(np.asarray(shard.data), rows[4 * (2 * d + p): 4 * (2 * d + p) + 4])

# %% [markdown]
# ## 4. Train
#
# `fit(config, workdir)` is the whole loop as a library function: it builds the same mesh and trainer, streams
# batches, and writes `config.json`, `metrics.jsonl` and a checkpoint under `workdir`. Each step runs the loss and
# gradients under one `shard_map` over `(data, pipe, tensor)` (pipeline sends, tensor all-reduces and the data
# gradient all-reduce are explicit collectives), then clips and applies AdamW.
#
# Loss is the mean next-byte cross-entropy in nats. Two reference levels: an untrained model predicts uniformly over
# 256 bytes, $\ln 256 \approx 5.55$; a model that knows only byte frequencies $p_b$ (no context) reaches the unigram
# entropy $H = -\sum_b p_b \ln p_b$ of the corpus. Thirty steps get about that far.

# %%
workdir = tempfile.mkdtemp(prefix="jaxpar_quickstart_")
result = fit(config, workdir, progress=False)

for rec in result.history:
    print(f"step {rec['step']:3d}  loss {rec['loss']:.3f}  lr {rec['lr']:.5f}  "
          + (f"eval_loss {rec['eval_loss']:.3f}" if "eval_loss" in rec else ""))
print("workdir:", sorted(p.name for p in pathlib.Path(workdir).iterdir()))

freq = np.bincount(tokens, minlength=256) / len(tokens)
unigram = -np.sum(freq[freq > 0] * np.log(freq[freq > 0]))
print(f"uniform ln 256 = {np.log(256):.2f}, unigram entropy H = {unigram:.2f} nats/byte")

first, last = result.history[0], result.history[-1]
assert last["step"] == tr.steps
assert abs(first["loss"] - np.log(256)) < 0.05  # starts at chance
assert last["loss"] < first["loss"] - 0.5  # and falls
assert last["eval_loss"] < np.log(256) - 0.5  # on held-out bytes too
assert abs(last["eval_loss"] - unigram) < 0.3  # ... to about the unigram level
assert result.state.params["blocks"]["wq"][...].sharding.spec == wq.sharding.spec  # trained where it was born

# %%
steps = [r["step"] for r in result.history]
evals = [(r["step"], r["eval_loss"]) for r in result.history if "eval_loss" in r]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, [r["loss"] for r in result.history], "o-", label="train loss")
ax.plot(*zip(*evals), "s--", label="held-out loss")
ax.axhline(np.log(256), color="gray", lw=0.8, ls=":", label="uniform: ln 256")
ax.axhline(unigram, color="gray", lw=0.8, ls="-.", label="unigram entropy H")
ax.set(xlabel="step", ylabel="nats / byte", title="tiny Llama, (data, pipe, tensor) = (2, 2, 2)")
ax.legend()
plt.show()

# %% [markdown]
# ## Sample
#
# `load` restores the checkpoint onto a tensor-parallel mesh (checkpoints are layout-free, so this is a
# different layout from training: `data = pipe = 1`), and `generate_text` continues a prompt; `temperature=0` is
# greedy argmax. At a loss near the corpus's byte unigram entropy the model knows little more than
# which bytes are common, so greedy decoding repeats the most common ones (indentation spaces); `make demo`'s 600
# steps get to recognisable Python.

# %%
loaded = load(workdir)
print("restored step", loaded.step, "onto", loaded.mesh)
text = generate_text(loaded, ["def "], max_new_tokens=32, temperature=0.0)[0]
print("greedy:", repr(text))

common = np.argsort(np.bincount(tokens, minlength=256))[::-1][:4]  # the corpus's 4 most frequent bytes
print("most frequent bytes:", [chr(b) for b in common])
assert loaded.step == tr.steps
assert dict(loaded.mesh.shape) == {"data": 1, "pipe": 1, "expert": 1, "context": 1, "tensor": 2}
assert len(text.encode()) == 32 and set(text.encode()) <= set(common.tolist())
assert text == generate_text(loaded, ["def "], max_new_tokens=32, temperature=0.0)[0]  # greedy is deterministic
