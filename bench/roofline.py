"""How close a train step comes to the machine's own dense matmul rate: achieved FLOP/s over measured GEMM FLOP/s.

    python -m bench.roofline [--size compute|tiny] [--dtype float32|bfloat16] [--layouts 1x1x1,8x1x1,...]
                             [--remat full|dots|none] [--steps 5] [--format table|json] [overrides ...]

Two numbers per layout, each measured on this machine in its own process (the simulated device count is fixed when
jax starts):

- **The step's FLOP/s**: the useful FLOPs — the dot FLOPs of the same step compiled for one device without a
  mesh (`jaxpar.analysis.hlo.dot_flops` of `compiled.as_text()`: the model's FLOPs plus the recompute of
  `parallel.remat`) — over the layout's step wall time (the median of `--steps` steps after two warm-up steps).
  Beside it, the layout's executed dot FLOPs (its program's, times the device count) over the useful ones: a
  pipeline's bubble iterations run on filler data and count there, not in the roofline.
- **The dense matmul rate** for the same dtype: `jnp.dot` on one device (XLA:CPU's matmuls use all of the host's
  cores; simulated devices share them), at the widths the step multiplies — for every weight matrix [h, n] of a
  layer and the LM head, the forward x·W ([B·s, h]·[h, n]) and both backward products, dx = dy·Wᵀ and dW = xᵀ·dy —
  FLOP-weighted (their FLOPs over their summed times: what a step made of exactly those GEMMs would reach).

roofline = step FLOP/s / matmul rate. On simulated devices the numerator is the whole machine's (all devices
together), so it reads the same way at every layout: 1.0 would be a step that does nothing but its GEMMs at the
machine's GEMM rate. The attention products (batched over heads, head_dim wide), the elementwise work (norms,
softmax, RoPE, the optimizer), collectives and host work are what keep it below.

The sizes are bench/versus.py's (`SIZES`: tiny and compute, global batch 8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.versus import SIZES, VOCAB, jaxpar_overrides

BATCH = 8
# (data, tensor, pipe, repeats, microbatches), the layouts of bench/versus.py.
LAYOUTS = {"1x1x1": (1, 1, 1, 1, 1), "8x1x1": (8, 1, 1, 1, 1), "4x2x1": (4, 2, 1, 1, 1), "2x4x1": (2, 4, 1, 1, 1),
           "4x1x2": (4, 1, 2, 1, 2), "2x2x2": (2, 2, 2, 2, 2)}
ROW = "ROOFLINE-ROW "


def overrides(size: str, dtype: str, layout: str, remat: str, unroll: int) -> list[str]:
    d, t, p, v, m = LAYOUTS[layout]
    o = {**jaxpar_overrides(SIZES[size], dtype), "model.scan_unroll": unroll, "parallel.data": d,
         "parallel.tensor": t, "parallel.pipe": p, "parallel.repeats": v, "parallel.microbatches": m,
         "parallel.remat": remat}
    return [f"{k}={val}" for k, val in o.items()]


def gemm_shapes(size: str) -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM a training step of `size` runs per layer (and the LM head), forward and backward."""
    s = SIZES[size]
    tokens, h, ae = BATCH * s.seq_len, s.d_model, s.n_heads * s.head_dim
    weights = [(h, ae)] * 3 + [(ae, h), (h, s.d_ff), (h, s.d_ff), (s.d_ff, h), (h, VOCAB)]  # q k v o gate up down head
    out = []
    for k, n in weights:
        out += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]  # x·W, dy·Wᵀ, xᵀ·dy
    return out


def matmul_rate(size: str, dtype: str, repeats: int = 20) -> dict:
    """FLOP-weighted dense GEMM FLOP/s of `gemm_shapes(size)` on this process's first device."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    total_flops, total_s, each = 0.0, 0.0, []
    for m, k, n in gemm_shapes(size):
        a = jax.random.normal(jax.random.key(0), (m, k), dt)
        b = jax.random.normal(jax.random.key(1), (k, n), dt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        sec = min(times)  # the rate the machine reaches: the best of the repeats
        flops = 2.0 * m * k * n
        total_flops, total_s = total_flops + flops, total_s + sec
        each.append({"mkn": [m, k, n], "gflops": flops / sec / 1e9})
    return {"flops_per_s": total_flops / total_s, "each": each}


def useful_flops(args, extra: list[str]) -> float:
    """Dot FLOPs of the same step on one device, no mesh: the model's FLOPs plus the recompute of the remat policy
    (the work every layout must do; a pipeline's bubble iterations are not in it)."""
    from jaxpar.analysis.hlo import dot_flops
    from jaxpar.config import load_config
    from jaxpar.train import build_trainer

    model = [o for o in extra if not o.removeprefix("--config.").startswith("parallel.")]  # no layout on one device
    config = load_config("configs/tiny.py", overrides(args.size, args.dtype, "1x1x1", args.remat, args.unroll)
                         + model).resolve_for_devices(1)
    trainer = build_trainer(config, None)
    return dot_flops(trainer.train_step.lower(trainer.state, trainer.random_batch(config)).compile().as_text())


def child(args, extra: list[str]) -> dict:
    from jaxpar import perf

    perf.retain_host_memory()  # as `jaxpar train` does, before the backend starts
    import jax

    from jaxpar.analysis.hlo import dot_flops
    from jaxpar.config import load_config
    from jaxpar.train import build_trainer

    d, t, p, _, _ = LAYOUTS[args.layouts]
    n = d * t * p
    config = load_config("configs/tiny.py", overrides(args.size, args.dtype, args.layouts, args.remat, args.unroll)
                         + extra).resolve_for_devices(n)
    trainer = build_trainer(config, jax.devices()[:n] if n > 1 else None)
    batch, state = trainer.random_batch(config), trainer.state
    compiled = trainer.train_step.lower(state, batch).compile()
    flops = dot_flops(compiled.as_text()) * n
    for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    step = statistics.median(times)
    return {"layout": args.layouts, "devices": n, "step_s": step, "step_s_each": times,
            "cpu_s": statistics.median(cpu), "executed_flops": flops}


def _run_child(argv: list[str], devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    out = subprocess.run([sys.executable, "-m", "bench.roofline", "--child", *argv], env=env, capture_output=True,
                         text=True)
    rows = [line[len(ROW):] for line in out.stdout.splitlines() if line.startswith(ROW)]
    if out.returncode != 0 or not rows:
        raise SystemExit(f"bench.roofline: a child failed ({' '.join(argv)}):\n{out.stderr[-3000:]}")
    return json.loads(rows[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="compute")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    parser.add_argument("--unroll", type=int, default=1, help="model.scan_unroll (layers per scan trip)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", action="store_true", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    if args.rate:
        rate = matmul_rate(args.size, args.dtype)
        rate["useful_flops"] = useful_flops(args, extra)
        print(ROW + json.dumps(rate), flush=True)
        return 0
    if args.child:
        print(ROW + json.dumps(child(args, extra)), flush=True)
        return 0
    layouts = [x for x in args.layouts.split(",") if x]
    for lay in layouts:
        if lay not in LAYOUTS:
            parser.error(f"unknown layout {lay!r}: use some of {', '.join(LAYOUTS)}")
    common = ["--size", args.size, "--dtype", args.dtype, "--remat", args.remat, "--unroll", str(args.unroll),
              "--steps", str(args.steps), *extra]
    rate = _run_child(["--rate", *common, "--layouts", "1x1x1"], 1)
    rows = []
    for lay in layouts:
        d, t, p, _, _ = LAYOUTS[lay]
        row = _run_child([*common, "--layouts", lay], d * t * p)
        row["flops_per_s"] = rate["useful_flops"] / row["step_s"]
        row["roofline"] = row["flops_per_s"] / rate["flops_per_s"]
        row["executed_over_useful"] = row["executed_flops"] / rate["useful_flops"]
        rows.append(row)
        if args.format == "table":
            print(f"{lay:>6}  step {row['step_s'] * 1e3:8.1f} ms ({row['cpu_s'] * 1e3:6.0f} ms CPU)  "
                  f"{row['flops_per_s'] / 1e9:6.1f} GFLOP/s  roofline {row['roofline']:.3f}  "
                  f"executed/useful FLOPs {row['executed_over_useful']:.3f}", flush=True)
    if args.format == "json":
        json.dump({"size": args.size, "dtype": args.dtype, "remat": args.remat, "unroll": args.unroll,
                   "matmul_rate": rate, "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print(f"useful FLOPs {rate['useful_flops'] / 1e9:.1f} G per step (the one-device program's dots: model + "
              f"recompute); dense matmul rate ({args.dtype}, the step's GEMM widths, one device, all cores): "
              f"{rate['flops_per_s'] / 1e9:.1f} GFLOP/s; size {args.size}, remat {args.remat}, "
              f"scan_unroll {args.unroll}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
