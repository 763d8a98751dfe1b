"""jaxpar vs MaxText 0.2.5: whole-process wall time per training step of the same tiny Llama, side by side.

    .venv/bin/python bench/versus.py [--layouts 1x1x1,8x1x1,...] [--repeats 3] [--steps-short 10 --steps-long 160]
                                     [--only jaxpar|maxtext] [--plain] [--maxtext-python PATH]
                                     [--remat native|full|dots] [--format table|json]

Layouts are DATAxTENSORxPIPE on simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, N the
product; the simulated devices share the host's cores, so a layout's time is its overhead, not a speed-up):

    1x1x1   8x1x1   4x2x1   2x4x1   4x1x2 (1 pass, 2 microbatches)   2x2x2 (2 repeats x 2 microbatches)

The measurement. Each run is a whole process, subprocess start to exit, timed here (neither framework's own step
logging is trusted). A framework's per-step time at a layout is (wall(L steps) - wall(S steps)) / (L - S), with
S = 10 and L = 160 by default, so imports, startup, initialisation, compilation and the end of the run cancel.
The process CPU time (user + system of the child, from getrusage(RUSAGE_CHILDREN) deltas) is differenced the same
way and printed beside it: on a shared machine it moves less with other jobs' load than wall time does.
Throughput ratio = MaxText per-step time / jaxpar per-step time (> 1: jaxpar is faster). Each of R repetitions
runs, per layout, jaxpar S, jaxpar L, MaxText S, MaxText L (MaxText first on odd repetitions); the table shows per
layout the median over repetitions of each framework's per-step time and of the ratio. Every process gets a fresh
temporary directory as its cwd and workdir / base_output_directory, deleted after it exits; a failed run stops the
script with the tail of its output. The default (6 layouts x 2 frameworks x 2 lengths x 3 repetitions = 72
processes of 12-60 s each) takes on the order of an hour on a 2-core machine; --repeats 1 --steps-long 40 and a
layout or two make a quick check.

The model, identical in both (1,115,264 parameters in each, counted in both frameworks): Llama (RMSNorm, RoPE theta
10000, SwiGLU), d_model 128, 4 layers, 4 query heads and 4 kv heads of head_dim 32 (plain multi-head attention),
MLP hidden 512, vocab 256, untied embedding and LM head, seq_len 64, global batch 8 sequences, fp32 weights,
activations, logits and loss, AdamW (b1 0.9, b2 0.95, weight decay 0.1, clip 1.0), peak lr 3e-3 with a linear
warmup over 10% of the steps then cosine to 0.1 x peak (the schedule does not change the speed), synthetic data.

    jaxpar    sys.executable -m jaxpar.cli train --config configs/tiny.py --workdir TMP --no-progress
              --config.model.{d_model=128,n_heads=4,n_kv_heads=4,head_dim=32,d_ff=512,n_layers=4,vocab_size=256,
                              max_seq_len=64,dtype=float32,param_dtype=float32,attention=xla}
              --config.train.{batch_size=8,seq_len=64,steps=N,lr=0.003,warmup_steps=N/10,eval_every=0}
              --config.checkpoint.every=0 --config.data.{source=synthetic,tokenizer=bytes}
              --config.parallel.{data=D,tensor=T,pipe=P,repeats=V,microbatches=M,remat=full}
              (PYTHONPATH = this repo; it still evaluates once and saves once at the end: constants that cancel)
    MaxText   $MAXTEXT_PYTHON -m maxtext.trainers.pre_train.train .../maxtext/configs/base.yml
              run_name=versus base_output_directory=TMP/out hardware=cpu skip_jax_distributed_system=true
              dataset_type=synthetic packing=false enable_checkpointing=false eval_interval=-1 steps=N
              decoder_block=llama2 base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=4 head_dim=32
              base_mlp_dim=512 base_num_decoder_layers=4 vocab_size=256 max_target_length=64 dtype=float32
              weight_dtype=float32 matmul_precision=default attention=dot_product enable_dropout=false
              remat_policy=full learning_rate=0.003 warmup_steps_fraction=0.1 per_device_batch_size=8/(D*T*P)
              ici_data_parallelism=D ici_fsdp_parallelism=1 ici_tensor_parallelism=T ici_pipeline_parallelism=P
              [num_pipeline_microbatches=M num_pipeline_repeats=V num_layers_per_pipeline_stage=4/(P*V)]
              jax_cache_dir= enable_tensorboard=false log_config=false log_period=1000000
              (environment DECOUPLE_GCLOUD=TRUE: MaxText's Google Cloud integrations become no-op stubs)

Both processes also get JAX_PLATFORMS=cpu. Why some MaxText keys:
- hardware=cpu alone makes MaxText call jax.distributed.initialize with a coordinator from XPK's environment
  variables (JOB_INDEX, ...) and crash; skip_jax_distributed_system=true keeps it one local process.
- Batch: MaxText's global batch = per_device_batch_size x the number of ALL devices (data, fsdp, tensor and stage
  alike; configs/types.py calculate_global_batch_sizes: int(num_devices * per_device_batch_size) x
  gradient_accumulation_steps), so per_device_batch_size = 8 on 1 device and 1 on 8 devices at every 8-device
  layout, pipelined or not; num_pipeline_microbatches then splits that global batch of 8. Its step log's
  total_weights (512 = 8 x 64 target tokens) confirms it.
- ici_fsdp_parallelism defaults to -1 (auto-fill): set to 1 so the data axis is plain data parallelism. MaxText's
  pipeline does not need FSDP.
- num_pipeline_repeats defaults to layers / (stages x num_layers_per_pipeline_stage) with 1 layer per stage, i.e.
  2 circular repeats at pipe 2; 4x1x2 asks jaxpar's 1 pass (GPipe), so MaxText gets num_pipeline_repeats=1 and
  num_layers_per_pipeline_stage=2.
- jax_cache_dir defaults to ~/jax_cache, a persistent compilation cache that jaxpar does not use: disabled.
- packing defaults to true, which gives synthetic rows several segments (a segment mask in attention): off, so each
  row is one causal sequence as in jaxpar.
- The script reads MaxText's "Num_devices: N, shape (...)" line and stops unless the mesh has the requested
  data / stage / tensor sizes (mesh_axes of 0.2.5's base.yml; 'stage' is moved before 'data' when pipelining).

Differences that remain (each framework's own way of doing the same model):
- Remat: MaxText always wraps each layer (or, pipelined, each pipeline iteration) in jax.checkpoint; its default
  remat_policy 'full' saves nothing, and it has no 'none'. jaxpar's default is no remat. --remat native (the
  default: what a user of either gets) runs each at its default (jaxpar none, MaxText full: MaxText recomputes
  the forward pass, jaxpar does not); --remat full runs both with full per-layer remat (identical
  recomputation); --remat dots pairs jaxpar 'dots' (dots_with_no_batch_dims_saveable: projection/MLP matmul
  outputs kept) with MaxText 'minimal' (q/k/v/out projections and MLP wi_0/wi_1/wo kept).
- Attention: jaxpar 'xla' is jax.nn.dot_product_attention's XLA path; MaxText 'dot_product' is its own einsum
  attention (AttentionOp.apply_attention_dot). Both are plain softmax(QK^T)V with a causal mask, in fp32.
- Layers: both scan the layers with lax.scan (MaxText scan_layers=true, its default; jaxpar's scan runs
  model.scan_unroll = 4 layers per iteration, so these 4 layers are one trip). Pipelined, MaxText scans the
  pipeline iterations and loops over a stage's layers unrolled (scan_layers_per_stage=false, its default); so
  does jaxpar (a stage's <= 4 layers are one trip of its scan).
- --plain adds bench/plain.py's hand-written jax.jit loop (`python -m bench.plain`: its own init, a host batch
  placed every step, GSPMD on a (data, tensor) mesh) at the layouts without a pipeline: plain/jaxpar is the cost
  of everything jaxpar's `fit` adds to the bare math.
- Data: MaxText's synthetic iterator is one fixed random batch on device, re-sliced by a jitted function each step;
  jaxpar's synthetic source is a host array of 2M tokens from a random lexicon, batched on the host and put on the
  devices every step (its per-step host work is part of what is timed).
- Host syncs: MaxText logs every step's metrics one step late (step k's loss is read after step k+1 is
  dispatched); jaxpar reads each step's `skipped` flag right after it (the next step is not dispatched while one
  runs) and writes metrics.jsonl every 10 steps. jaxpar's non-finite-step guard (a norm of the new parameters and a
  select) has no MaxText counterpart.

Reproducing the MaxText environment (MaxText 0.2.5's wheel declares no dependencies; it ran with jax 0.12.0.1,
the same jax as jaxpar's venv, no tensorflow, no torch):

    ~/.pyenv/versions/3.12.1/bin/python -m venv /work/mt-venv
    /work/mt-venv/bin/python -m pip install maxtext==0.2.5 jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12 \\
        optax==0.2.8 orbax-checkpoint==0.12.8 chex==0.1.92 pathwaysutils omegaconf jinja2 aqtp qwix tokamax \\
        huggingface_hub transformers grain drjax pillow tiktoken sentencepiece sympy ml-collections

(the imports of `maxtext.trainers.pre_train.train` and of its input pipeline, found one by one; what they resolved
to here: pathwaysutils 0.1.13, aqtp 0.9.0, qwix 0.1.8, tokamax 0.0.17, transformers 5.24.0, grain 0.2.18,
drjax 0.2.1). Point the script at another interpreter with --maxtext-python or MAXTEXT_PYTHON.
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
SEQ_LEN = 64
LR = 3e-3
# mesh_axes of MaxText 0.2.5's configs/base.yml, in order (the order of the shape it prints).
MAXTEXT_MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
                     "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive")
# MaxText's remat_policy paired with each jaxpar parallel.remat (see the docstring).
REMAT = {"full": ("full", "full"), "dots": ("dots", "minimal"), "native": ("none", "full")}


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


class RunFailed(RuntimeError):
    pass


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


# The compared model as jaxpar config overrides (of configs/tiny.py); bench/ops.py profiles the same one.
JAXPAR_MODEL = {
    "model.family": "llama", "model.d_model": 128, "model.n_heads": 4, "model.n_kv_heads": 4,
    "model.head_dim": 32, "model.d_ff": 512, "model.n_layers": 4, "model.vocab_size": 256,
    "model.max_seq_len": SEQ_LEN, "model.dtype": "float32", "model.param_dtype": "float32",
    "model.attention": "xla", "train.batch_size": GLOBAL_BATCH, "train.seq_len": SEQ_LEN,
}


def jaxpar_cmd(layout: Layout, steps: int, workdir: str, remat: str) -> list[str]:
    o = {
        **JAXPAR_MODEL, "train.steps": steps, "train.lr": LR,
        "train.warmup_steps": max(1, steps // 10), "train.eval_every": 0,
        "checkpoint.every": 0, "data.source": "synthetic", "data.tokenizer": "bytes",
        "parallel.data": layout.data, "parallel.tensor": layout.tensor, "parallel.pipe": layout.pipe,
        "parallel.repeats": layout.repeats, "parallel.microbatches": layout.microbatches,
        "parallel.remat": REMAT[remat][0],
    }
    return [sys.executable, "-m", "jaxpar.cli", "train", "--config", str(REPO / "configs" / "tiny.py"),
            "--workdir", workdir, "--no-progress", *(f"--config.{k}={v}" for k, v in o.items())]


def maxtext_cmd(python: str, base_yml: str, layout: Layout, steps: int, outdir: str, remat: str) -> list[str]:
    o = {
        "run_name": "versus", "base_output_directory": outdir, "hardware": "cpu",
        "skip_jax_distributed_system": "true", "dataset_type": "synthetic", "packing": "false",
        "enable_checkpointing": "false", "eval_interval": -1, "steps": steps,
        "decoder_block": "llama2", "base_emb_dim": 128, "base_num_query_heads": 4, "base_num_kv_heads": 4,
        "head_dim": 32, "base_mlp_dim": 512, "base_num_decoder_layers": 4, "vocab_size": 256,
        "max_target_length": SEQ_LEN, "dtype": "float32", "weight_dtype": "float32", "matmul_precision": "default",
        "attention": "dot_product", "enable_dropout": "false", "remat_policy": REMAT[remat][1],
        "learning_rate": LR, "warmup_steps_fraction": 0.1,
        "per_device_batch_size": f"{GLOBAL_BATCH / layout.devices:g}",
        "ici_data_parallelism": layout.data, "ici_fsdp_parallelism": 1,
        "ici_tensor_parallelism": layout.tensor, "ici_pipeline_parallelism": layout.pipe,
    }
    if layout.pipe > 1:
        o.update(num_pipeline_microbatches=layout.microbatches, num_pipeline_repeats=layout.repeats,
                 num_layers_per_pipeline_stage=4 // (layout.pipe * layout.repeats))
    o.update(jax_cache_dir="", enable_tensorboard="false", log_config="false", log_period=1000000)
    return [python, "-m", "maxtext.trainers.pre_train.train", base_yml, *(f"{k}={v}" for k, v in o.items())]


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


def run_jaxpar(layout: Layout, steps: int, remat: str) -> tuple[float, float]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-jaxpar-"))
    try:
        workdir = tmp / "workdir"
        cmd = jaxpar_cmd(layout, steps, str(workdir), remat)
        wall, cpu, out = run_timed(cmd, _env(layout.devices, PYTHONPATH=str(REPO)), tmp)
        done = re.search(r"^done: .*'step': (\d+)", out, re.M)
        if not done or int(done.group(1)) != steps:
            raise RunFailed(f"jaxpar did not report step {steps}: {shlex.join(cmd)}\n{out[-3000:]}")
        par = json.loads((workdir / "config.json").read_text())["parallel"]
        want = {"data": layout.data, "tensor": layout.tensor, "pipe": layout.pipe, "repeats": layout.repeats,
                "microbatches": layout.microbatches}
        if any(par[k] != v for k, v in want.items()):
            raise RunFailed(f"jaxpar ran parallel={par}, not {want}")
        return wall, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_maxtext(python: str, base_yml: str, layout: Layout, steps: int, remat: str) -> tuple[float, float]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-maxtext-"))
    try:
        cmd = maxtext_cmd(python, base_yml, layout, steps, str(tmp / "out"), remat)
        wall, cpu, out = run_timed(cmd, _env(layout.devices, DECOUPLE_GCLOUD="TRUE"), tmp)
        mesh = re.search(r"Num_devices: (\d+), shape \(([\d, ]+)\)", out)
        want = expected_maxtext_shape(layout)
        got = tuple(int(s) for s in mesh.group(2).split(",") if s.strip()) if mesh else None
        if got != want:
            raise RunFailed(f"MaxText's mesh is {got}, not {want} over {MAXTEXT_MESH_AXES}: {shlex.join(cmd)}")
        if not re.search(rf"completed step: {steps - 1},.*total_weights: {GLOBAL_BATCH * SEQ_LEN},", out):
            raise RunFailed(f"MaxText did not complete step {steps - 1} on {GLOBAL_BATCH}x{SEQ_LEN} tokens: "
                            f"{shlex.join(cmd)}\n{_tail(tmp / 'output.log')}")
        return wall, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_plain(layout: Layout, steps: int, remat: str) -> tuple[float, float]:
    """bench/plain.py's own loop (no remat, as jaxpar's default); (data, tensor) layouts only: it has no pipeline."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="versus-plain-"))
    try:
        cmd = [sys.executable, "-m", "bench.plain", "--steps", str(steps), "--data", str(layout.data), "--tensor",
               str(layout.tensor), "--batch", str(GLOBAL_BATCH), "--seq", str(SEQ_LEN)]
        wall, cpu, out = run_timed(cmd, _env(layout.devices, PYTHONPATH=str(REPO)), tmp)
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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], layouts: list[Layout], frameworks: list[str], short: int, long: int) -> list[dict]:
    rows = []
    for lay in layouts:
        row = {"layout": lay.name, "mesh": lay.describe(), "devices": lay.devices}
        per_rep: dict[str, dict[int, tuple[float, float]]] = {}
        for fw in frameworks:
            steps = {}
            for rep in sorted({r["repeat"] for r in runs}):
                got = {r["steps"]: r for r in runs if (r["layout"], r["framework"], r["repeat"]) == (lay.name, fw, rep)}
                if short in got and long in got:
                    steps[rep] = ((got[long]["wall_s"] - got[short]["wall_s"]) / (long - short),
                                  (got[long]["cpu_s"] - got[short]["cpu_s"]) / (long - short))
            per_rep[fw] = steps
            shorts = [r["wall_s"] for r in runs if (r["layout"], r["framework"], r["steps"]) == (lay.name, fw, short)]
            row[fw] = {"step_wall_s": _med([w for w, _ in steps.values()]),
                       "step_cpu_s": _med([c for _, c in steps.values()]),
                       "step_wall_s_each": [w for w, _ in steps.values()],
                       "short_run_wall_s": _med(shorts)}
        for fw in frameworks:
            if fw != "jaxpar" and "jaxpar" in frameworks:  # fw time / jaxpar time: > 1 means jaxpar is faster
                reps = set(per_rep["jaxpar"]) & set(per_rep[fw])
                row[f"ratio_{fw}_wall"] = _med([per_rep[fw][r][0] / per_rep["jaxpar"][r][0] for r in reps])
                row[f"ratio_{fw}_cpu"] = _med([per_rep[fw][r][1] / per_rep["jaxpar"][r][1] for r in reps])
        rows.append(row)
    return rows


def table(rows: list[dict], frameworks: list[str], short: int) -> str:
    names = {"jaxpar": "jaxpar", "maxtext": "MaxText", "plain": "plain"}
    others = [fw for fw in frameworks if fw != "jaxpar"] if "jaxpar" in frameworks else []
    head = [("layout (d, t, p)", 22)]
    for fw in frameworks:
        head += [(f"{names[fw]} ms/step", 18), (f"{names[fw]} CPU ms", 16), (f"{names[fw]} {short}-step s", 18)]
    for fw in others:
        head += [(f"{names[fw]}/jaxpar", 16), ("by CPU", 9)]
    lines = ["".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(head))]
    lines.append("-" * len(lines[0]))
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for row in rows:
        cells = [row["mesh"]]
        for fw in frameworks:
            f = row[fw]
            cells += [_ms(f["step_wall_s"]), _ms(f["step_cpu_s"]),
                      "-" if f["short_run_wall_s"] is None else f"{f['short_run_wall_s']:.1f}"]
        for fw in others:
            cells += [fmt(row.get(f"ratio_{fw}_wall")), fmt(row.get(f"ratio_{fw}_cpu"))]
        lines.append("".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, head))))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated subset of {', '.join(LAYOUTS)} (DATAxTENSORxPIPE; default: all)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians are reported)")
    p.add_argument("--steps-short", type=int, default=10)
    p.add_argument("--steps-long", type=int, default=160)
    p.add_argument("--only", choices=("jaxpar", "maxtext"), help="run one framework alone")
    p.add_argument("--plain", action="store_true", help="also run bench/plain.py's hand-written jax.jit loop "
                   "(layouts without a pipeline)")
    p.add_argument("--maxtext-python", default=None,
                   help=f"interpreter with maxtext 0.2.5 installed (default: {DEFAULT_MAXTEXT_PYTHON} if it exists, "
                        "else $MAXTEXT_PYTHON)")
    p.add_argument("--remat", choices=tuple(REMAT), default="native",
                   help="native: each framework's default (jaxpar none, MaxText full; the default); full: both full "
                        "per-layer remat; dots: jaxpar 'dots' vs MaxText 'minimal'")
    p.add_argument("--format", choices=("table", "json"), default="table")
    args = p.parse_args(argv)
    cmdline = shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable,
                          *sys.argv])
    try:
        layouts = [LAYOUTS[name] for name in args.layouts.split(",") if name]
    except KeyError as e:
        p.error(f"unknown layout {e.args[0]!r}: use some of {', '.join(LAYOUTS)}")
    if not 0 < args.steps_short < args.steps_long:
        p.error("need 0 < --steps-short < --steps-long")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    def say(msg: str):
        print(msg, file=sys.stderr if args.format == "json" else sys.stdout, flush=True)

    frameworks = ["jaxpar", "maxtext"] if args.only is None else [args.only]
    maxtext = None
    notes = []
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

    if args.plain:
        frameworks.append("plain")
    runs: list[dict] = []
    started = time.time()
    say(f"versus: {len(layouts)} layouts x {len(frameworks)} frameworks x steps {args.steps_short}/{args.steps_long} "
        f"x {args.repeats} repetitions; remat {args.remat}; load average {os.getloadavg()[0]:.2f}")
    try:
        for rep in range(args.repeats):
            order = frameworks if rep % 2 == 0 else frameworks[::-1]
            for lay in layouts:
                for fw in order:
                    if fw == "plain" and lay.pipe > 1:
                        continue
                    for steps in (args.steps_short, args.steps_long):
                        if fw == "jaxpar":
                            wall, cpu = run_jaxpar(lay, steps, args.remat)
                        elif fw == "plain":
                            wall, cpu = run_plain(lay, steps, args.remat)
                        else:
                            wall, cpu = run_maxtext(*maxtext, lay, steps, args.remat)
                        runs.append({"repeat": rep, "layout": lay.name, "framework": fw, "steps": steps,
                                     "wall_s": wall, "cpu_s": cpu})
                        say(f"  rep {rep + 1}/{args.repeats} {lay.describe():<18} {fw:<8} {steps:>4} steps: "
                            f"{wall:7.2f} s wall, {cpu:7.2f} s CPU")
    except RunFailed as e:
        print(f"versus: a run failed: {e}", file=sys.stderr)
        return 1
    rows = summarize(runs, layouts, frameworks, args.steps_short, args.steps_long)
    elapsed = time.time() - started
    if args.format == "json":
        json.dump({"command": cmdline, "frameworks": frameworks, "remat": args.remat,
                   "steps_short": args.steps_short, "steps_long": args.steps_long, "repeats": args.repeats,
                   "maxtext": maxtext and {"python": maxtext[0], "base_yml": maxtext[1]}, "notes": notes,
                   "elapsed_s": elapsed, "load_average_end": os.getloadavg()[0], "rows": rows, "runs": runs},
                  sys.stdout, indent=1)
        print()
    else:
        print()
        print(table(rows, frameworks, args.steps_short))
        print()
        for note in notes:
            print(note)
        print(f"per step = (wall({args.steps_long}) - wall({args.steps_short})) / {args.steps_long - args.steps_short}"
              f" of whole processes, medians of {args.repeats}; CPU ms = the same over the child's user+system time"
              + ("; X/jaxpar > 1: jaxpar is faster" if len(frameworks) > 1 else ""))
        print(f"{elapsed:.0f} s; load average {os.getloadavg()[0]:.2f}; {cmdline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
