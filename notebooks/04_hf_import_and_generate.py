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
# # Import a Hugging Face model and generate on a (data, tensor) mesh
#
# jaxpar reads a Hugging Face model directory — `config.json`, `*.safetensors` (one file or shards listed by
# `model.safetensors.index.json`) and `tokenizer.json` — for the Llama, Mistral, Qwen2 and GPT-2 architectures, and
# places every weight straight onto the layout you ask for. Generation then runs with a KV cache on that mesh:
# prompts over `data`, each layer's heads (and the cache's kv heads) over `tensor`.
#
# We use the tiny random models in `tests/fixtures/hf/`, written by `transformers` itself together with its logits
# and its greedy continuations, so every claim below is checked against Hugging Face's own implementation.

# %%
import os
import pathlib

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 simulated CPU devices, before jax loads
os.environ["JAX_PLATFORMS"] = "cpu"
import importlib.util

here = pathlib.Path.cwd()
package = pathlib.Path(importlib.util.find_spec("jaxpar").origin).parent  # located, not imported (jax not loaded yet)
root = next((d for d in [here, *here.parents] if (d / "pyproject.toml").exists()), package.parent)
os.chdir(root)

import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jaxpar.infer.text import generate_text, load
from jaxpar.interop import hf

fixture = root / "tests" / "fixtures" / "hf" / "llama"
reference = json.loads((fixture / "reference.json").read_text())
print(sorted(p.name for p in fixture.iterdir()))

# %% [markdown]
# ## 1. The config
#
# `config.json` becomes a jaxpar `ModelConfig`. This Llama has grouped-query attention (4 query heads share 2 kv
# heads), RoPE with theta 5·10⁴ and Llama 3.1's frequency scaling, and an untied LM head; its vocab (515) divides
# neither 2 nor 4, so tensor parallelism pads it (zero rows, masked logits).

# %%
cfg = hf.model_config(hf.read_config(fixture), fixture)
{k: getattr(cfg, k) for k in ("family", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                              "rope_theta", "rope_scaling", "rope_factor", "tie_embeddings")}

# %% [markdown]
# ## 2. Load onto a (data = 2, tensor = 2) mesh
#
# `load` accepts a jaxpar workdir or a Hugging Face directory. Each device's shard is cut from the tensors it
# covers, one layer at a time from the memory-mapped files, so host memory stays near one parameter's shard.

# %%
loaded = load(fixture, data=2, tensor=2)
print(loaded.mesh)
wq = loaded.model.blocks.wq[...]  # [L, D, H, E]: heads split over tensor
print("wq", wq.shape, wq.sharding.spec)
jax.debug.visualize_array_sharding(wq[0, :, :, 0])

# %% [markdown]
# The logits on this layout match `transformers`' (fp32):

# %%
ids = jnp.asarray(reference["input_ids"])
with jax.set_mesh(loaded.mesh):
    logits = jax.jit(lambda m, x: m(x))(loaded.model, ids)
want = load_file(str(fixture / "reference_logits.safetensors"))["logits"]
err = float(np.abs(np.asarray(logits)[..., : want.shape[-1]] - want).max())
print(f"max |jaxpar - transformers| = {err:.2e}")
assert err < 1e-4

# %% [markdown]
# ## 3. Generate with the KV cache
#
# `LoadedModel.generate` is shaped like Hugging Face's `generate`: ragged prompts (right-padded for you), greedy or
# sampled (`do_sample`, `temperature`, `top_k`, `top_p`), `eos_token_id` stop tokens, `max_new_tokens`, a `seed`.
# One prefill writes the prompts into the cache, then a device-side loop adds one token per step.
#
# Two prompts of different lengths in one batch, greedy, 32 tokens — compared with `transformers`' greedy output:

# %%
cases = reference["greedy"]
new = loaded.generate([c["prompt"] for c in cases], max_new_tokens=32, eos_token_id=None, return_prompt=False)
for c, row in zip(cases, new):
    print(repr(c["prompt_text"]), "→", row.tolist()[:12], "…")
    assert row.tolist() == c["new_tokens"]
print("identical to transformers' greedy tokens")

# %% [markdown]
# The same tokens come out on one device and at tensor = 4 (the layout changes where the work happens, not the
# result):

# %%
for data, tensor in [(1, 1), (1, 4)]:
    other = load(fixture, data=data, tensor=tensor)
    same = other.generate([c["prompt"] for c in cases], max_new_tokens=32, eos_token_id=None, return_prompt=False)
    print((data, tensor), bool((same == new).all()))
    assert (same == new).all()

# %% [markdown]
# Text in, text out through the model's `tokenizer.json` (a random model, so the text is noise — the point is the
# plumbing), and sampling with a seed:

# %%
print(generate_text(loaded, ["def main(", "import "], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=0))

# %% [markdown]
# ## 4. Export back to Hugging Face
#
# `jaxpar convert --from-hf DIR --to WORKDIR` makes a jaxpar workdir (train on from it with
# `jaxpar train --init-from-hf DIR`); `--to-hf` writes safetensors that `transformers` loads. The round trip
# reproduces every tensor bit for bit:

# %%
out = pathlib.Path(tempfile.mkdtemp())
hf.import_to_workdir(fixture, out / "workdir")
hf.export_workdir(out / "workdir", out / "exported")


def tensors(d):
    found = {}
    for f in sorted(d.glob("model*.safetensors")):
        found.update(load_file(str(f)))
    return found


a, b = tensors(fixture), tensors(out / "exported")
print(len(a), "tensors; bit-identical:", all(a[k].tobytes() == b[k].tobytes() for k in a) and a.keys() == b.keys())
