"""Where a train step's time goes: a `jax.profiler` trace of jaxpar's step, summed per compiled HLO op.

    python -m bench.ops [--size tiny|compute] [--dtype float32|bfloat16] [--layout DxTxP] [--repeats V] [--microbatches M] [--steps 10] [--top 25] [overrides ...]

The model is bench/versus.py's tiny Llama (d_model 128, 4 layers, 4 heads of 32, MLP 512, vocab 256, seq 64,
batch 8, fp32; `--size compute`: its compute-bound one; `--dtype bfloat16`: bf16 compute) unless overrides (`model.n_layers=8`, …) say otherwise; the layout runs on D·T·P simulated CPU
devices (set before jax starts, so the script re-executes itself with XLA_FLAGS). It prints the bare step's time
(wall and process CPU), then the traced steps' op time summed over every device — by op kind (fusions, dots,
all-reduce, collective-permute, while, …) and the top ops with their HLO line. Collective ops include the time a
device waits for the others at the rendezvous, and a `while` op's time includes its body's; on simulated devices
the devices share the host's cores, so the sum exceeds the wall time.

This is how the step's own overheads of issue 15 were found: the [B, T]-token weight-gradient transposes
(`copy_bitcast_fusion` in the SwiGLU backward), the page faults of freshly allocated temporaries (see
`jaxpar.perf.retain_host_memory`), the one-device all-reduces at tensor = 1, and the pipeline's two permutes
per iteration.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="1x1x1", help="DATAxTENSORxPIPE (default 1x1x1)")
    parser.add_argument("--repeats", type=int, default=1, help="pipeline passes (pipe > 1)")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: pipe)")
    parser.add_argument("--steps", type=int, default=10, help="steps timed, and traced")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--size", choices=("tiny", "compute"), default="tiny", help="bench/versus.py's sizes")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args, overrides = parser.parse_known_args(argv)
    d, t, p = (int(x) for x in args.layout.split("x"))
    n = d * t * p
    flag = f"--xla_force_host_platform_device_count={n}"
    if n > 1 and flag not in os.environ.get("XLA_FLAGS", ""):  # the device count is fixed when jax starts
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(), JAX_PLATFORMS="cpu")
        os.execve(sys.executable, [sys.executable, "-m", "bench.ops", *(argv or sys.argv[1:])], env)

    from bench.versus import SIZES, jaxpar_overrides
    from jaxpar import perf

    perf.retain_host_memory()  # as `jaxpar train` does, before the backend starts
    import jax

    from jaxpar.config import load_config
    from jaxpar.train import build_trainer

    m = args.microbatches or (p if p > 1 else 1)
    layout = [f"parallel.data={d}", f"parallel.tensor={t}", f"parallel.pipe={p}",
              f"parallel.repeats={args.repeats if p > 1 else 1}", f"parallel.microbatches={m}"]
    model = [f"{k}={v}" for k, v in jaxpar_overrides(SIZES[args.size], args.dtype).items()]
    config = load_config("configs/tiny.py", model + layout + [o.removeprefix("--config.") for o in overrides])
    config = config.resolve_for_devices(n)
    trainer = build_trainer(config, jax.devices()[:n] if n > 1 else None)
    batch, box = trainer.random_batch(config), [trainer.state]

    def run(steps: int):
        state = box[0]
        for _ in range(steps):
            state, metrics = trainer.train_step(state, batch)
        box[0] = state
        return metrics["loss"]

    jax.block_until_ready(run(3))  # compile and warm up
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(run(args.steps))
    wall, cpu = (time.perf_counter() - wall) / args.steps, (time.process_time() - cpu) / args.steps
    print(f"{args.layout} ({config.parallel.repeats} repeats, {m} microbatches): step {wall * 1e3:.1f} ms wall, "
          f"{cpu * 1e3:.1f} ms process CPU")
    trace_dir = tempfile.mkdtemp(prefix="bench-ops-")
    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(run(args.steps))
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    total, count = collections.Counter(), collections.Counter()
    for event in json.load(gzip.open(path))["traceEvents"]:
        if event.get("ph") == "X" and "hlo_op" in event.get("args", {}):
            total[event["name"]] += event["dur"]  # microseconds
            count[event["name"]] += 1
    hlo = trainer.train_step.lower(box[0], batch).compile().as_text()
    per_step = lambda us: us / 1e3 / args.steps  # noqa: E731  (µs over the traced steps → ms per step)
    kinds = collections.Counter()
    for name, us in total.items():
        kinds[re.sub(r"\.\d+$", "", name)] += us
    print(f"op time {per_step(sum(total.values())):.1f} ms per step, summed over {n} device(s); by kind:")
    print("  " + ", ".join(f"{k} {per_step(us):.1f}" for k, us in kinds.most_common(12)))
    print(f"{'ms/step':>8} {'runs/step':>9}  op")
    for name, us in total.most_common(args.top):
        line = re.search(rf"^\s*(?:ROOT )?%?{re.escape(name)} = (.*)$", hlo, re.M)
        text = line.group(1)[:110] if line else ""
        print(f"{per_step(us):8.2f} {count[name] / args.steps:9.0f}  {name}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
