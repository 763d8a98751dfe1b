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
# # Serving: a paged KV cache and continuous batching
#
# Generating for one prompt at a time leaves the machine idle: a decode step reads every weight to produce one token.
# A server batches requests — and the way it batches decides its throughput and its latency.
#
# * **Static batching** takes a batch of requests, runs them until *all* of them finish, then takes the next batch.
#   A request that wants 8 tokens waits for its neighbour that wants 160.
# * **Continuous batching** (Orca; vLLM) decides at *every step* who is in the batch: a finished request leaves, a
#   waiting one joins at once. Long prompts are prefilled in chunks, between decode steps of the running requests.
#
# Continuous batching needs a cache whose memory can move between requests at any step. jaxpar's **paged KV cache**
# (`jaxpar.model.PagedKVCache`, vLLM's PagedAttention layout) keeps every layer's keys and values in a pool of
# fixed-size pages; each running request has a *block table* naming its pages in order. Attention reads a request's
# own pages in order, which is exactly the view a contiguous cache would give it — so every attention kind (GQA,
# sliding windows, DeepSeek's latent attention) runs paged without knowing it.

# %%
import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
import importlib.util

here = pathlib.Path.cwd()
package = pathlib.Path(importlib.util.find_spec("jaxpar").origin).parent
root = next((d for d in [here, *here.parents] if (d / "pyproject.toml").exists()), package.parent)
os.chdir(root)

import json
import sys

import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

sys.path.insert(0, str(root))  # bench/ (the benchmark's workload and driver)
from bench import serve as bench_serve
from jaxpar.config import load_config
from jaxpar.model import Transformer
from jaxpar.serve import Engine, EngineConfig, SamplingParams

# The demo model's architecture (configs/tiny.py) at random weights: serving speed does not depend on the values.
model = Transformer(load_config("configs/tiny.py").model, rngs=nnx.Rngs(0))

# %% [markdown]
# ## 1. Pages and block tables
#
# Four requests of different lengths in an engine with pages of 16 positions. After a few steps, each running
# request's block table lists its pages — scattered over the pool, allocated as the sequence grows. Page 0 is the
# "junk" page that unused table entries point at.

# %%
engine = Engine(model, EngineConfig(max_batch=4, page_size=16, prefill_chunk=32))
rng = np.random.default_rng(0)
requests = [engine.submit(rng.integers(1, 256, n).tolist(), SamplingParams(max_tokens=m, ignore_eos=True))
            for n, m in [(20, 40), (70, 10), (5, 60), (33, 25)]]
for _ in range(6):
    engine.step()
for r in requests:
    print(f"{r.id}: prompt {len(r.prompt):3d}, generated {len(r.tokens):2d}, state {r.state:7s} pages {r.pages}")
print("pages in use:", engine.pool.used, "of", engine.pool.n_pages - 1)
while engine.has_work:
    engine.step()
print("after all finished — in use:", engine.pool.used, "; prompt pages kept for the prefix cache:",
      len(engine.pool.cached))

# %% [markdown]
# ## 2. Batch invariance
#
# Every program runs at one fixed shape, rows never mix, and a masked position contributes exactly zero — so a
# greedy request's tokens do not depend on who else is in the batch. Here each request alone, then all of them
# arriving at different steps:

# %%
alone = [Engine(model, EngineConfig(max_batch=4, page_size=16, prefill_chunk=32)).generate(
    [r.prompt], SamplingParams(max_tokens=r.params.max_tokens, ignore_eos=True))[0] for r in requests]
print("alone == among others:", alone == [r.tokens for r in requests])
assert alone == [r.tokens for r in requests]

# %% [markdown]
# ## 3. Continuous vs static batching under load
#
# The same requests (`bench/serve.py`'s mixed-long workload: prompt and output lengths log-uniform in [8, 120]) arrive
# as a Poisson process at increasing rates, and finally all at once. Both modes use the same engine — rows, pages,
# programs; static batching only waits for its whole batch before admitting the next. A short live sweep first
# (16 requests a point, one repetition):

# %%
workload = bench_serve.workload("mixed-long", 16, seed=0)
modes = {m: Engine(model, EngineConfig(max_batch=8, page_size=16, prefill_chunk=32, static=m == "static"))
         for m in ("continuous", "static")}
for e in modes.values():  # compile both programs first
    e.generate([[1] * 40], SamplingParams(max_tokens=3, ignore_eos=True))
rates = [8.0, 16.0, float("inf")]
live = {m: [bench_serve.run(e, workload, r, seed=1) for r in rates] for m, e in modes.items()}
assert [x["tokens"] for x in live["continuous"]] == [x["tokens"] for x in live["static"]]  # identical tokens

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
labels = [f"{r:g}" if np.isfinite(r) else "all" for r in rates]
for m, runs in live.items():
    ax1.plot(labels, [x["ttft_s"]["p99"] for x in runs], "o-", label=f"{m} p99")
    ax1.plot(labels, [x["ttft_s"]["p50"] for x in runs], "o--", label=f"{m} p50")
    ax2.plot(labels, [x["output_tokens_per_s"] for x in runs], "o-", label=m)
ax1.set(xlabel="arrival rate (requests/s)", ylabel="time to first token (s)", title="TTFT (live, 16 requests)")
ax2.set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s", title="throughput (live)")
ax1.legend(fontsize=8)
ax2.legend(fontsize=8)
plt.tight_layout()

# %% [markdown]
# The recorded benchmark (`bench/serve.py`: 16 rows; 256 requests a saturation point, 64 a Poisson point; 3 interleaved
# repetitions) — below saturation both modes keep up with the arrivals and continuous batching's gain is latency; at
# saturation it is throughput (about 2× on the chat-like mixed workload, `bench/RESULTS.md`).

# %%
recorded = json.loads(pathlib.Path("bench/results/serve.json").read_text())
for run in recorded["runs"]:
    c, s = run["continuous"], run["static"]
    print(f"{run['workload']:10} {str(run['rate']):>11}: continuous {c['output_tokens_per_s']:7.1f} tok/s, TTFT p99 "
          f"{c['ttft_s']['p99']:.2f} s | static {s['output_tokens_per_s']:7.1f} tok/s, TTFT p99 "
          f"{s['ttft_s']['p99']:.2f} s | ratio {run['throughput_ratio']:.2f}x")

# %% [markdown]
# ## 4. The same engine over HTTP
#
# `jaxpar serve --model DIR` puts this engine behind an OpenAI-compatible API (FastAPI on uvicorn, streaming by
# Server-Sent Events, Prometheus `/metrics`). In-process here, with the byte tokenizer:

# %%
import threading
import time

import httpx
import uvicorn

from jaxpar.data.tokenizers import ByteTokenizer
from jaxpar.launch import free_port
from jaxpar.serve.server import EngineThread, build_app

thread = EngineThread(Engine(model, EngineConfig(max_batch=4, page_size=16, prefill_chunk=32)))
port = free_port()
server = uvicorn.Server(uvicorn.Config(build_app(thread, ByteTokenizer(), model_name="tiny"), port=port,
                                       log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"prompt": "def ", "max_tokens": 12, "temperature": 0}, timeout=60).json()
print(json.dumps(reply["choices"][0]), reply["usage"])
print([line for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
       if line.startswith("jaxpar_") and "bucket" not in line and "created" not in line][:8])
server.should_exit = True
thread.close()
