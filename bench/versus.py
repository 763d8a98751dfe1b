"""jaxpar vs MaxText 0.2.5: whole-process wall time per training step of the same Llama, fair by construction.

    .venv/bin/python bench/versus.py [--size tiny|compute] [--dtype float32|bfloat16] [--layouts 1x1x1,8x1x1,...]
                                     [--pairs full,dots] [--best] [--repeats 3] [--steps-short S --steps-long L]
                                     [--host-malloc tuned|system] [--only jaxpar|maxtext] [--plain]
                                     [--maxtext-python PATH] [--format table|json]

Layouts are DATAxTENSORxPIPE on simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, N the
product; the simulated devices share the host's cores, so a layout's time is its overhead, not a speed-up):

    1x1x1   8x1x1   4x2x1   2x4x1   4x1x2 (1 pass, 2 microbatches)   2x2x2 (2 repeats x 2 microbatches)

**What is compared.** Each framework runs the model under *settings* (remat, loop structure). Two tables come out:

- **Apples-to-apples** (`--pairs`): the same remat and the same loop structure on both sides —
      full   jaxpar remat 'full'  vs MaxText remat_policy 'full'     (each layer's forward recomputed; nothing saved)
      dots   jaxpar remat 'dots'  vs MaxText remat_policy 'minimal'  (the projection and MLP matmul outputs saved)
      full-skip  as full, with jaxpar's parallel.skip_bubble at the pipelined layouts: its stages skip the
             bubble's compute (on simulated devices sharing the host's cores, time the other stages get back),
             where MaxText runs its layers on the bubble's filler — a difference of execution, not of the math
  and the layers scanned one per trip in both (jaxpar model.scan_unroll = 1, MaxText scan_layers = true); with a
  pipeline, a stage's layers run unrolled in both (MaxText's scan_layers_per_stage = false, its default; jaxpar
  scan_unroll = the stage's layers).
- **Best-vs-best** (`--best`): each framework's fastest setting for the model, from the settings this run measured —
  the apples ones plus jaxpar without remat and with dots, all its layers one scan trip (model.scan_unroll = 4, the
  default), and MaxText 'minimal' with its layers unrolled (scan_layers = false). MaxText has no remat 'none': it
  always wraps a layer (pipelined, a pipeline iteration) in jax.checkpoint.

The host allocator is the same for both processes: `--host-malloc tuned` (the default) gives both the environment
GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 — the
settings `jaxpar.perf.retain_host_memory` makes with mallopt (one arena, no mmap'd chunks, no trimming: what
tcmalloc, which MaxText's own setups preload, does by default) — and jaxpar JAXPAR_HOST_MALLOC=system, so that its
mallopt call adds nothing; `--host-malloc system` gives both glibc's defaults.

The parameter count is asserted equal at run time: each jaxpar run prints its count (`jaxpar: N parameters`), each
MaxText run is started through a two-line wrapper that prints the value MaxText's own
`max_utils.calculate_num_params_from_pytree` returns (and changes nothing else), and the script stops when they
differ from each other or from the size's expected count.

**The measurement.** Each run is a whole process, subprocess start to exit, timed here (neither framework's own step
logging is trusted). A framework's per-step time is (wall(L steps) - wall(S steps)) / (L - S), so imports,
startup, initialisation, compilation and the end of the run cancel (tiny: S = 10, L = 160; compute: S = 3, L = 13
by default). The process CPU time (user + system of the child, from getrusage(RUSAGE_CHILDREN) deltas) is
differenced the same way and printed beside it. Throughput ratio = MaxText per-step time / jaxpar per-step time
(> 1: jaxpar is faster). Each of R repetitions runs, per layout, every setting of both frameworks (S then L),
interleaved, with the order of the settings reversed on odd repetitions; per layout the tables show the median over
repetitions of each time and of the per-repetition ratio, and the ratio's spread (min–max over repetitions). Every
process gets a fresh temporary directory as its cwd and workdir, deleted after it exits; a failed run stops the
script with the tail of its output.

The sizes (identical models in both frameworks: Llama with RMSNorm, RoPE theta 10000, SwiGLU, plain multi-head
attention, untied embedding and LM head, vocab 256, global batch 8 sequences, AdamW (b1 0.9, b2 0.95, weight decay
0.1, clip 1.0), peak lr 3e-3 with a linear warmup over 10% of the steps then cosine; synthetic data):

    tiny     d_model 128, 4 layers, 4 heads of 32, MLP 512, seq 64     1,115,264 parameters
    compute  d_model 512, 4 layers, 8 heads of 64, MLP 2048, seq 256   17,043,968 parameters (matmuls large enough
                                                                       to be compute-bound on a CPU)

`--dtype float32` runs weights, activations, logits and loss in fp32; `--dtype bfloat16` computes in bf16 with fp32
weights in both (jaxpar model.dtype=bfloat16, param_dtype=float32; MaxText dtype=bfloat16, weight_dtype=float32).

    jaxpar    sys.executable -m jaxpar.cli train --config configs/tiny.py --workdir TMP --no-progress
              --config.model.{family=llama,d_model,n_heads,n_kv_heads,head_dim,d_ff,n_layers,vocab_size,max_seq_len,
                              dtype,param_dtype=float32,attention=xla,scan_unroll}
              --config.train.{batch_size=8,seq_len,steps=N,lr=0.003,warmup_steps=N/10,eval_every=0}
              --config.checkpoint.every=0 --config.data.{source=synthetic,tokenizer=bytes}
              --config.parallel.{data=D,tensor=T,pipe=P,repeats=V,microbatches=M,remat}
              (PYTHONPATH = this repo; it still evaluates once and saves once at the end: constants that cancel)
    MaxText   $MAXTEXT_PYTHON -c WRAPPER .../maxtext/configs/base.yml    (WRAPPER runs maxtext.trainers.pre_train.train)
              run_name=versus base_output_directory=TMP/out hardware=cpu skip_jax_distributed_system=true
              dataset_type=synthetic packing=false enable_checkpointing=false eval_interval=-1 steps=N
              decoder_block=llama2 base_emb_dim base_num_query_heads base_num_kv_heads head_dim base_mlp_dim
              base_num_decoder_layers vocab_size=256 max_target_length dtype weight_dtype=float32
              matmul_precision=default attention=dot_product enable_dropout=false remat_policy scan_layers
              learning_rate=0.003 warmup_steps_fraction=0.1 per_device_batch_size=8/(D*T*P)
              ici_data_parallelism=D ici_fsdp_parallelism=1 ici_tensor_parallelism=T ici_pipeline_parallelism=P
              [num_pipeline_microbatches=M num_pipeline_repeats=V num_layers_per_pipeline_stage=layers/(P*V)]
              jax_cache_dir= enable_tensorboard=false log_config=false log_period=1000000
              (environment DECOUPLE_GCLOUD=TRUE: MaxText's Google Cloud integrations become no-op stubs)

Both processes also get JAX_PLATFORMS=cpu and the same XLA_FLAGS. Why some MaxText keys:
- hardware=cpu alone makes MaxText call jax.distributed.initialize with a coordinator from XPK's environment
  variables (JOB_INDEX, ...) and crash; skip_jax_distributed_system=true keeps it one local process.
- Batch: MaxText's global batch = per_device_batch_size x the number of ALL devices (data, fsdp, tensor and stage
  alike; configs/types.py calculate_global_batch_sizes), so per_device_batch_size = 8 on 1 device and 1 on 8 devices
  at every 8-device layout, pipelined or not; num_pipeline_microbatches then splits that global batch of 8. The
  script checks its step log's total_weights (8 x seq target tokens).
- ici_fsdp_parallelism defaults to -1 (auto-fill): set to 1 so the data axis is plain data parallelism.
- num_pipeline_repeats defaults to layers / (stages x num_layers_per_pipeline_stage) with 1 layer per stage, i.e.
  2 circular repeats at pipe 2; 4x1x2 asks jaxpar's 1 pass (GPipe), so MaxText gets num_pipeline_repeats=1 and
  num_layers_per_pipeline_stage=2.
- jax_cache_dir defaults to ~/jax_cache, a persistent compilation cache that jaxpar does not use: disabled.
- packing defaults to true, which gives synthetic rows several segments (a segment mask in attention): off, so each
  row is one causal sequence as in jaxpar.
- The script reads MaxText's "Num_devices: N, shape (...)" line and stops unless the mesh has the requested
  data / stage / tensor sizes (mesh_axes of 0.2.5's base.yml; 'stage' is moved before 'data' when pipelining).

Differences that remain (each framework's own way of doing the same model):
- Remat granularity when pipelined: MaxText checkpoints each pipeline iteration
  (set_remat_policy_on_pipeline_iterations, its default), jaxpar each layer.
- Attention: jaxpar 'xla' is jax.nn.dot_product_attention's XLA path; MaxText 'dot_product' is its own einsum
  attention (AttentionOp.apply_attention_dot). Both are plain softmax(QK^T)V with a causal mask.
- bf16: MaxText's logits are computed in the compute dtype (logits_dot_in_fp32=false, its default) and its loss in
  fp32; jaxpar's LM head accumulates in fp32 (preferred_element_type) and so does its loss.
- Data: MaxText's synthetic iterator is one fixed random batch on device, re-sliced by a jitted function each step;
  jaxpar's synthetic source is a host array of 2M tokens from a random lexicon, batched on the host and put on the
  devices every step (its per-step host work is part of what is timed).
- Host syncs: MaxText logs every step's metrics one step late; jaxpar reads each step's `skipped` flag right after
  it and writes metrics.jsonl every 10 steps. jaxpar's non-finite-step guard (a select on the gradient norm and
  loss) has no MaxText counterpart.
- --plain adds bench/plain.py's hand-written jax.jit loop (no remat, its layers scanned one per trip; layouts
  without a pipeline, tiny size): plain/jaxpar is the cost of everything jaxpar's `fit` adds to the bare math.

Reproducing the MaxText environment (MaxText 0.2.5's wheel declares no dependencies; it runs with jax 0.12.0.1,
the same jax as jaxpar's venv, no tensorflow, no torch):

    ~/.pyenv/versions/3.12.1/bin/python -m venv /work/mt-venv
    /work/mt-venv/bin/python -m pip install maxtext==0.2.5 jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12 \\
        optax==0.2.8 orbax-checkpoint==0.12.8 chex==0.1.92 pathwaysutils omegaconf jinja2 aqtp qwix tokamax \\
        huggingface_hub transformers grain drjax pillow tiktoken sentencepiece sympy ml-collections

(the imports of `maxtext.trainers.pre_train.train` and of its input pipeline, found one by one). Point the script
at another interpreter with --maxtext-python or MAXTEXT_PYTHON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MAXTEXT_PYTHON = "/work/mt-venv/bin/python"
GLOBAL_BATCH = 8
VOCAB = 256
LR = 3e-3
# glibc's malloc tunables equal to jaxpar.perf.retain_host_memory's mallopt calls (arena_max 1, mmap_max 0, trim
# threshold 2**31 - 1), given to both processes by --host-malloc tuned.
GLIBC_TUNED = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
# mesh_axes of MaxText 0.2.5's configs/base.yml, in order (the order of the shape it prints).
MAXTEXT_MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
                     "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive")


@dataclasses.dataclass(frozen=True)
class Size:
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    seq_len: int
    steps: tuple[int, int]  # default (short, long) run lengths

    @property
    def params(self) -> int:
        """Parameters of the untied Llama: per layer q, k, v, o (h x a·E each), gate, up, down and two norm scales;
        embedding, LM head and the final norm."""
        h, ae = self.d_model, self.n_heads * self.head_dim
        layer = 4 * h * ae + 3 * h * self.d_ff + 2 * h
        return self.n_layers * layer + 2 * VOCAB * h + h


SIZES = {"tiny": Size(128, 4, 4, 32, 512, 64, (10, 160)),
         "compute": Size(512, 4, 8, 64, 2048, 256, (3, 13))}


@dataclasses.dataclass(frozen=True)
class Layout:
    data: int
    tensor: int
    pipe: int
    repeats: int = 1
    microbatches: int = 1

    @property
    def name(self) -> str:
        return f"{self.data}x{self.tensor}x{self.pipe}"

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipe

    def describe(self) -> str:
        extra = f" v={self.repeats} m={self.microbatches}" if self.pipe > 1 else ""
        return f"({self.data}, {self.tensor}, {self.pipe}){extra}"


LAYOUTS = {lay.name: lay for lay in (
    Layout(1, 1, 1), Layout(8, 1, 1), Layout(4, 2, 1), Layout(2, 4, 1),
    Layout(4, 1, 2, repeats=1, microbatches=2), Layout(2, 2, 2, repeats=2, microbatches=2),
)}


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one framework runs the model: its remat policy and whether its layers are scanned one per trip."""

    framework: str  # "jaxpar", "maxtext" or "plain"
    remat: str  # jaxpar: none | dots | full; MaxText: full | minimal
    scanned: bool  # one layer per scan trip (False: all of a stage's layers one trip / unrolled)
    skip_bubble: bool = False  # jaxpar, pipelined layouts: parallel.skip_bubble (the bubble's compute skipped)

    @property
    def name(self) -> str:
        return f"{self.framework}:{self.remat}:{'scan' if self.scanned else 'unrolled'}" + (
            ":skip" if self.skip_bubble else "")


# Apples-to-apples pairs (jaxpar setting, MaxText setting): the same recomputation, the same loop.
PAIRS = {"full": (Setting("jaxpar", "full", True), Setting("maxtext", "full", True)),
         "dots": (Setting("jaxpar", "dots", True), Setting("maxtext", "minimal", True)),
         # the same, with jaxpar's pipeline skipping its bubble's compute (MaxText computes it on filler): only the
         # pipelined layouts differ from "full"
         "full-skip": (Setting("jaxpar", "full", True, skip_bubble=True), Setting("maxtext", "full", True))}
# Extra candidates for best-vs-best: each framework's other fast settings.
BEST_EXTRA = (Setting("jaxpar", "none", False), Setting("jaxpar", "dots", False), Setting("maxtext", "minimal", False))
PLAIN = Setting("plain", "none", True)
# With a pipeline the unrolled settings are not run: jaxpar's is its scanned one (a stage's layers are one trip either
# way), and MaxText 0.2.5 fails with scan_layers=false and a pipeline (pipeline.py _shift_left: "where requires
# ndarray or scalar arguments, got <class 'tuple'>").
UNROLLED_PIPELINE = "pipelined layouts run the scanned settings only (jaxpar's unrolled one is the same program there; " \
                    "MaxText 0.2.5 fails with scan_layers=false and a pipeline)"



class RunFailed(RuntimeError):
    pass


def _env(devices: int, host_malloc: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTHONPATH", None)
    env.pop("GLIBC_TUNABLES", None)
    if host_malloc == "tuned":
        env["GLIBC_TUNABLES"] = GLIBC_TUNED
    env["JAXPAR_HOST_MALLOC"] = "system"  # jaxpar's own mallopt adds nothing: the environment decides for both
    env.update(extra)
    return env


def _unroll(size: Size, layout: Layout, scanned: bool) -> int:
    """jaxpar's model.scan_unroll for a setting: 1 (one layer per trip) or all of a stage's layers in one trip; with
    a pipeline always a stage's layers, as MaxText's scan_layers_per_stage=false runs them."""
    per_stage = size.n_layers // (layout.pipe * layout.repeats)
    return per_stage if (layout.pipe > 1 or not scanned) else 1


def jaxpar_overrides(size: Size, dtype: str) -> dict:
    """The compared model as jaxpar config overrides (of configs/tiny.py); bench/roofline.py runs the same ones."""
    return {"model.family": "llama", "model.d_model": size.d_model, "model.n_heads": size.n_heads,
            "model.n_kv_heads": size.n_heads, "model.head_dim": size.head_dim, "model.d_ff": size.d_ff,
            "model.n_layers": size.n_layers, "model.vocab_size": VOCAB, "model.max_seq_len": size.seq_len,
            "model.dtype": dtype, "model.param_dtype": "float32", "model.attention": "xla",
            "train.batch_size": GLOBAL_BATCH, "train.seq_len": size.seq_len}


def jaxpar_cmd(size: Size, dtype: str, layout: Layout, setting: Setting, steps: int, workdir: str) -> list[str]:
    o = {
        **jaxpar_overrides(size, dtype), "model.scan_unroll": _unroll(size, layout, setting.scanned),
        "train.steps": steps, "train.lr": LR, "train.warmup_steps": max(1, steps // 10), "train.eval_every": 0,
        "checkpoint.every": 0, "data.source": "synthetic", "data.tokenizer": "bytes",
        "parallel.data": layout.data, "parallel.tensor": layout.tensor, "parallel.pipe": layout.pipe,
        "parallel.repeats": layout.repeats, "parallel.microbatches": layout.microbatches,
        "parallel.remat": setting.remat,
    }
    if setting.skip_bubble and layout.pipe > 1:
        o["parallel.skip_bubble"] = "true"
    return [sys.executable, "-m", "jaxpar.cli", "train", "--config", str(REPO / "configs" / "tiny.py"),
            "--workdir", workdir, "--no-progress", *(f"--config.{k}={v}" for k, v in o.items())]


# Runs MaxText's trainer as `python -m maxtext.trainers.pre_train.train` would, after making MaxText's own parameter
# counter print what it returns (it is called once, at setup).
MAXTEXT_WRAPPER = """\
import runpy, sys
from maxtext.utils import max_utils
_count = max_utils.calculate_num_params_from_pytree
def _print_count(params):
    n = _count(params)
    print(f"VERSUS-PARAMS {int(n)}", flush=True)
    return n
max_utils.calculate_num_params_from_pytree = _print_count
sys.argv = ["maxtext-train", *sys.argv[1:]]
runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__", alter_sys=True)
"""


def maxtext_cmd(python: str, base_yml: str, size: Size, dtype: str, layout: Layout, setting: Setting, steps: int,
                outdir: str) -> list[str]:
    o = {
        "run_name": "versus", "base_output_directory": outdir, "hardware": "cpu",
        "skip_jax_distributed_system": "true", "dataset_type": "synthetic", "packing": "false",
        "enable_checkpointing": "false", "eval_interval": -1, "steps": steps,
        "decoder_block": "llama2", "base_emb_dim": size.d_model, "base_num_query_heads": size.n_heads,
        "base_num_kv_heads": size.n_heads, "head_dim": size.head_dim, "base_mlp_dim": size.d_ff,
        "base_num_decoder_layers": size.n_layers, "vocab_size": VOCAB, "max_target_length": size.seq_len,
        "dtype": dtype, "weight_dtype": "float32", "matmul_precision": "default",
        "attention": "dot_product", "enable_dropout": "false", "remat_policy": setting.remat,
        "scan_layers": str(setting.scanned).lower(),
        "learning_rate": LR, "warmup_steps_fraction": 0.1,
        "per_device_batch_size": f"{GLOBAL_BATCH / layout.devices:g}",
        "ici_data_parallelism": layout.data, "ici_fsdp_parallelism": 1,
        "ici_tensor_parallelism": layout.tensor, "ici_pipeline_parallelism": layout.pipe,
    }
    if layout.pipe > 1:
        o.update(num_pipeline_microbatches=layout.microbatches, num_pipeline_repeats=layout.repeats,
                 num_layers_per_pipeline_stage=size.n_layers // (layout.pipe * layout.repeats))
    o.update(jax_cache_dir="", enable_tensorboard="false", log_config="false", log_period=1000000)
    return [python, "-c", MAXTEXT_WRAPPER, base_yml, *(f"{k}={v}" for k, v in o.items())]


def expected_maxtext_shape(layout: Layout) -> tuple[int, ...]:
    axes = list(MAXTEXT_MESH_AXES)
    if layout.pipe > 1:  # configs/types.py puts 'stage' before 'data' when pipelining
        i, j = axes.index("stage"), axes.index("data")
        axes[i], axes[j] = axes[j], axes[i]
    sizes = {"data": layout.data, "tensor": layout.tensor, "stage": layout.pipe}
    return tuple(sizes.get(a, 1) for a in axes)


def _tail(path: pathlib.Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def run_timed(cmd: list[str], env: dict[str, str], cwd: pathlib.Path) -> tuple[float, float, str]:
    """Run `cmd` to completion; (wall s, child CPU s, its stdout+stderr). Raise RunFailed on a non-zero exit."""
    log = cwd / "output.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "wb") as f:
        rc = subprocess.call(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        raise RunFailed(f"exit status {rc}: {shlex.join(cmd)}\n--- last lines of its output ---\n{_tail(log)}")
    return wall, cpu, log.read_text(errors="replace")


def _check_params(who: str, out: str, pattern: str, size: Size, cmd: list[str]) -> int:
    got = re.search(pattern, out, re.M)
    if not got or int(got.group(1).replace(",", "")) != size.params:
        raise RunFailed(f"{who} reported {got.group(1) if got else 'no'} parameters, not the {size.params:,} of "
                        f"this size: {shlex.join(cmd)}")
    return size.params


def run_jaxpar(size: Size, dtype: str, layout: Layout, setting: Setting, steps: int, host_malloc: str):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-jaxpar-"))
    try:
        workdir = tmp / "workdir"
        cmd = jaxpar_cmd(size, dtype, layout, setting, steps, str(workdir))
        wall, cpu, out = run_timed(cmd, _env(layout.devices, host_malloc, PYTHONPATH=str(REPO)), tmp)
        done = re.search(r"^done: .*'step': (\d+)", out, re.M)
        if not done or int(done.group(1)) != steps:
            raise RunFailed(f"jaxpar did not report step {steps}: {shlex.join(cmd)}\n{out[-3000:]}")
        _check_params("jaxpar", out, r"^jaxpar: ([\d,]+) parameters", size, cmd)
        cfg = json.loads((workdir / "config.json").read_text())
        want = {"data": layout.data, "tensor": layout.tensor, "pipe": layout.pipe, "repeats": layout.repeats,
                "microbatches": layout.microbatches, "remat": setting.remat}
        if any(cfg["parallel"][k] != v for k, v in want.items()):
            raise RunFailed(f"jaxpar ran parallel={cfg['parallel']}, not {want}")
        return wall, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_maxtext(python: str, base_yml: str, size: Size, dtype: str, layout: Layout, setting: Setting, steps: int,
                host_malloc: str):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-maxtext-"))
    try:
        cmd = maxtext_cmd(python, base_yml, size, dtype, layout, setting, steps, str(tmp / "out"))
        wall, cpu, out = run_timed(cmd, _env(layout.devices, host_malloc, DECOUPLE_GCLOUD="TRUE"), tmp)
        mesh = re.search(r"Num_devices: (\d+), shape \(([\d, ]+)\)", out)
        want = expected_maxtext_shape(layout)
        got = tuple(int(s) for s in mesh.group(2).split(",") if s.strip()) if mesh else None
        if got != want:
            raise RunFailed(f"MaxText's mesh is {got}, not {want} over {MAXTEXT_MESH_AXES}: {shlex.join(cmd)}")
        tokens = GLOBAL_BATCH * size.seq_len
        if not re.search(rf"completed step: {steps - 1},.*total_weights: {tokens},", out):
            raise RunFailed(f"MaxText did not complete step {steps - 1} on {GLOBAL_BATCH}x{size.seq_len} tokens: "
                            f"{shlex.join(cmd)}\n{_tail(tmp / 'output.log')}")
        _check_params("MaxText", out, r"^VERSUS-PARAMS (\d+)", size, cmd)
        return wall, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_plain(size: Size, dtype: str, layout: Layout, setting: Setting, steps: int, host_malloc: str):
    """bench/plain.py's own loop (no remat); (data, tensor) layouts only: it has no pipeline."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-plain-"))
    try:
        cmd = [sys.executable, "-m", "bench.plain", "--steps", str(steps), "--data", str(layout.data), "--tensor",
               str(layout.tensor), "--batch", str(GLOBAL_BATCH), "--seq", str(size.seq_len), "--vocab", str(VOCAB),
               "--d-model", str(size.d_model), "--layers", str(size.n_layers), "--heads", str(size.n_heads),
               "--kv-heads", str(size.n_heads), "--head-dim", str(size.head_dim), "--d-ff", str(size.d_ff)]
        env = _env(layout.devices, host_malloc, PYTHONPATH=str(REPO))
        env.pop("JAXPAR_HOST_MALLOC")
        wall, cpu, out = run_timed(cmd, env, tmp)
        if f"done: {steps} steps" not in out:
            raise RunFailed(f"bench.plain did not report {steps} steps: {shlex.join(cmd)}\n{out[-3000:]}")
        return wall, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def find_maxtext(python: str | None) -> tuple[str, str] | None:
    """(interpreter, path of maxtext/configs/base.yml), or None when there is no MaxText to run."""
    if not python or not os.path.exists(python):
        return None
    probe = "import importlib.util as u; s = u.find_spec('maxtext'); print(s.submodule_search_locations[0])"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    base = pathlib.Path(out.stdout.strip()) / "configs" / "base.yml"
    return (python, str(base)) if base.exists() else None


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def per_step(runs: list[dict], layout: str, setting: str, short: int, long: int) -> dict[int, tuple[float, float]]:
    """{repetition: (wall s per step, CPU s per step)} of one setting at one layout."""
    out = {}
    for rep in sorted({r["repeat"] for r in runs}):
        got = {r["steps"]: r for r in runs if (r["layout"], r["setting"], r["repeat"]) == (layout, setting, rep)}
        if short in got and long in got:
            out[rep] = ((got[long]["wall_s"] - got[short]["wall_s"]) / (long - short),
                        (got[long]["cpu_s"] - got[short]["cpu_s"]) / (long - short))
    return out


def compare(runs: list[dict], layout: str, jaxpar: list[str], other: list[str], short: int, long: int) -> dict | None:
    """The per-repetition comparison of jaxpar's fastest of `jaxpar` settings against the other side's fastest of
    `other` (one each for apples-to-apples): medians of the times, median and spread of the ratio other / jaxpar."""
    def best(settings):
        steps = {s: per_step(runs, layout, s, short, long) for s in settings}
        reps = set.intersection(*(set(v) for v in steps.values())) if steps else set()
        return {rep: min((steps[s][rep][0], steps[s][rep][1], s) for s in settings) for rep in reps}

    j, o = best(jaxpar), best(other)
    reps = sorted(set(j) & set(o))
    if not reps:
        return None
    ratios = [o[r][0] / j[r][0] for r in reps]
    return {"jaxpar_ms": _med([j[r][0] for r in reps]) * 1e3, "other_ms": _med([o[r][0] for r in reps]) * 1e3,
            "jaxpar_cpu_ms": _med([j[r][1] for r in reps]) * 1e3, "other_cpu_ms": _med([o[r][1] for r in reps]) * 1e3,
            "ratio": _med(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_cpu": _med([o[r][1] / j[r][1] for r in reps]), "repetitions": len(reps),
            "jaxpar_setting": sorted({j[r][2] for r in reps}), "other_setting": sorted({o[r][2] for r in reps})}


def summarize(runs, layouts, pairs, best, plain, frameworks, short, long) -> dict[str, list[dict]]:
    tables: dict[str, list[dict]] = {}
    both = {"jaxpar", "maxtext"} <= set(frameworks)
    for pair in pairs:
        j, m = PAIRS[pair]
        rows = []
        for lay in layouts:
            row = {"layout": lay.name, "mesh": lay.describe()}
            if both:
                row.update(compare(runs, lay.name, [j.name], [m.name], short, long) or {})
            else:
                for s in (j, m):
                    steps = per_step(runs, lay.name, s.name, short, long)
                    if steps:
                        row[f"{s.framework}_ms"] = _med([w for w, _ in steps.values()]) * 1e3
            rows.append(row)
        skip = ", jaxpar's pipeline skipping its bubble (parallel.skip_bubble)" if j.skip_bubble else ""
        tables[f"apples-to-apples, remat {j.remat} vs MaxText {m.remat}, one layer per scan trip{skip}"] = rows
    if best and both:
        settings = [s for s in settings_for(pairs, best, frameworks)]
        js, ms = [s.name for s in settings if s.framework == "jaxpar"], [s.name for s in settings
                                                                          if s.framework == "maxtext"]
        tables["best-vs-best (each side's fastest setting measured here)"] = [
            {"layout": lay.name, "mesh": lay.describe(), **(compare(runs, lay.name, js, ms, short, long) or {})}
            for lay in layouts]
    if plain and "jaxpar" in frameworks:
        js = [s.name for s in settings_for(pairs, best, frameworks) if s.framework == "jaxpar"]
        tables["plain jax.jit loop (bench/plain.py, no remat) vs jaxpar's fastest"] = [
            {"layout": lay.name, "mesh": lay.describe(), **(compare(runs, lay.name, js, [PLAIN.name], short, long)
                                                           or {})}
            for lay in layouts if lay.pipe == 1]
    return tables


def settings_for(pairs: list[str], best: bool, frameworks: list[str]) -> list[Setting]:
    out = [s for pair in pairs for s in PAIRS[pair]]
    if best:
        out += list(BEST_EXTRA)
    out = [s for s in dict.fromkeys(out) if s.framework in frameworks]
    return out


def render(tables: dict[str, list[dict]]) -> str:
    lines = []
    for title, rows in tables.items():
        lines += ["", title]
        head = f"{'layout (d, t, p)':<20}{'jaxpar ms':>11}{'other ms':>11}{'other/jaxpar':>14}{'spread':>15}" \
               f"{'by CPU':>8}  settings"
        lines += [head, "-" * len(head)]
        for r in rows:
            if "ratio" not in r:
                j, o = r.get("jaxpar_ms"), r.get("maxtext_ms")
                lines.append(f"{r['mesh']:<20}{'-' if j is None else f'{j:.1f}':>11}"
                             f"{'-' if o is None else f'{o:.1f}':>11}")
                continue
            spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
            sets = f"{','.join(r['jaxpar_setting'])} | {','.join(r['other_setting'])}"
            lines.append(f"{r['mesh']:<20}{r['jaxpar_ms']:>11.1f}{r['other_ms']:>11.1f}{r['ratio']:>14.3f}"
                         f"{spread:>15}{r['ratio_cpu']:>8.3f}  {sets}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated subset of {', '.join(LAYOUTS)} (DATAxTENSORxPIPE; default: all)")
    p.add_argument("--pairs", default="full", help="apples-to-apples remat pairs: some of full, dots, full-skip "
                   "(full with jaxpar's parallel.skip_bubble at the pipelined layouts)")
    p.add_argument("--best", action="store_true", help="also run each side's other fast settings: best-vs-best")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians are reported)")
    p.add_argument("--steps-short", type=int, default=None, help="default: tiny 10, compute 3")
    p.add_argument("--steps-long", type=int, default=None, help="default: tiny 160, compute 13")
    p.add_argument("--host-malloc", choices=("tuned", "system"), default="tuned",
                   help="both processes' glibc malloc: tuned (GLIBC_TUNABLES as jaxpar's retain_host_memory) or "
                        "system (glibc's defaults)")
    p.add_argument("--only", choices=("jaxpar", "maxtext"), help="run one framework alone")
    p.add_argument("--plain", action="store_true", help="also run bench/plain.py's hand-written jax.jit loop "
                   "(layouts without a pipeline)")
    p.add_argument("--maxtext-python", default=None,
                   help=f"interpreter with maxtext 0.2.5 installed (default: {DEFAULT_MAXTEXT_PYTHON} if it exists, "
                        "else $MAXTEXT_PYTHON)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    args = p.parse_args(argv)
    cmdline = shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable,
                          *(sys.argv if argv is None else ["bench/versus.py", *argv])])
    size = SIZES[args.size]
    short, long = args.steps_short or size.steps[0], args.steps_long or size.steps[1]
    try:
        layouts = [LAYOUTS[name] for name in args.layouts.split(",") if name]
    except KeyError as e:
        p.error(f"unknown layout {e.args[0]!r}: use some of {', '.join(LAYOUTS)}")
    pairs = [x for x in args.pairs.split(",") if x]
    if not pairs or any(x not in PAIRS for x in pairs):
        p.error(f"--pairs {args.pairs!r}: use some of {', '.join(PAIRS)}")
    if not 0 < short < long:
        p.error("need 0 < --steps-short < --steps-long")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    def say(msg: str):
        print(msg, file=sys.stderr if args.format == "json" else sys.stdout, flush=True)

    frameworks = ["jaxpar", "maxtext"] if args.only is None else [args.only]
    maxtext, notes = None, []
    if "maxtext" in frameworks:
        python = args.maxtext_python or (DEFAULT_MAXTEXT_PYTHON if os.path.exists(DEFAULT_MAXTEXT_PYTHON)
                                         else os.environ.get("MAXTEXT_PYTHON"))
        maxtext = find_maxtext(python)
        if maxtext is None:
            if args.only == "maxtext":
                p.error(f"MaxText was not found (interpreter {python!r}); see the install line in {__file__}")
            notes.append(f"MaxText was not found (interpreter {python!r} has no maxtext package): jaxpar alone. "
                         "Install it as this script's docstring says, or pass --maxtext-python / MAXTEXT_PYTHON.")
            say(notes[-1])
            frameworks = ["jaxpar"]
    settings = settings_for(pairs, args.best, frameworks)
    if args.plain:
        settings.append(PLAIN)
    if args.best and any(lay.pipe > 1 for lay in layouts):
        notes.append(UNROLLED_PIPELINE)
    runners = {"jaxpar": run_jaxpar, "plain": run_plain,
               "maxtext": lambda *a: run_maxtext(*maxtext, *a)}
    runs: list[dict] = []
    started = time.time()
    say(f"versus: size {args.size} ({size.params:,} parameters), {args.dtype}, {len(layouts)} layouts x "
        f"{len(settings)} settings ({', '.join(s.name for s in settings)}) x steps {short}/{long} x {args.repeats} "
        f"repetitions; host malloc {args.host_malloc}; load average {os.getloadavg()[0]:.2f}")
    try:
        for rep in range(args.repeats):
            order = settings if rep % 2 == 0 else settings[::-1]
            for lay in layouts:
                for s in order:
                    if lay.pipe > 1 and (s.framework == "plain" or not s.scanned):
                        continue  # no pipeline in plain; see UNROLLED_PIPELINE
                    for steps in (short, long):
                        wall, cpu = runners[s.framework](size, args.dtype, lay, s, steps, args.host_malloc)
                        runs.append({"repeat": rep, "layout": lay.name, "setting": s.name, "steps": steps,
                                     "wall_s": wall, "cpu_s": cpu})
                        say(f"  rep {rep + 1}/{args.repeats} {lay.describe():<18} {s.name:<24} {steps:>4} steps: "
                            f"{wall:7.2f} s wall, {cpu:7.2f} s CPU")
    except RunFailed as e:
        print(f"versus: a run failed: {e}", file=sys.stderr)
        return 1
    tables = summarize(runs, layouts, pairs, args.best, args.plain, frameworks, short, long)
    elapsed = time.time() - started
    if args.format == "json":
        json.dump({"command": cmdline, "size": args.size, "params": size.params, "dtype": args.dtype,
                   "host_malloc": args.host_malloc, "settings": [s.name for s in settings], "steps_short": short,
                   "steps_long": long, "repeats": args.repeats,
                   "maxtext": maxtext and {"python": maxtext[0], "base_yml": maxtext[1]}, "notes": notes,
                   "elapsed_s": elapsed, "load_average_end": os.getloadavg()[0], "tables": tables, "runs": runs},
                  sys.stdout, indent=1)
        print()
    else:
        print(render(tables))
        print()
        for note in notes:
            print(note)
        print(f"per step = (wall({long}) - wall({short})) / {long - short} of whole processes; medians of "
              f"{args.repeats} interleaved repetitions; spread = min-max of the per-repetition ratio; other/jaxpar "
              f"> 1: jaxpar is faster; by CPU = the same ratio of the processes' user+system time")
        print(f"{elapsed:.0f} s; load average {os.getloadavg()[0]:.2f}; {cmdline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
