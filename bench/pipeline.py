"""Benchmark: the circular pipeline over (pipe, repeats, microbatches), side by side in one run.

    python bench/pipeline.py [--steps 6] [--config configs/tiny.py] [--config.section.field=value ...]

For each (p, v, m) with tensor 1 (data fills the 8 simulated devices) it prints the schedule's iterations and bubble
fraction, executed/useful matmul FLOPs measured from the compiled step (loop trip counts applied) against the
formula (v·m + p − 1)/(v·m) for the layers, collective-permute bytes per iteration, compile time, and the median step
time with its ratio to the no-pipeline step. Then compile time against depth at the demo layout.
On simulated CPU devices all stages share the same cores: step times show overheads, not pipeline speed-ups.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.analysis.report import analyze  # noqa: E402
from jaxpar.analysis.verify import abstract_step  # noqa: E402  (re-exported: bench.plan and the tests use it)
from jaxpar.config import load_config  # noqa: E402
from jaxpar.train import build_trainer  # noqa: E402

SWEEP = [(1, 1, 1), (2, 1, 2), (2, 1, 4), (2, 2, 4), (2, 4, 4), (4, 1, 4), (4, 1, 8), (4, 2, 8)]
DEFAULTS = ["model.n_layers=8", "model.d_model=64", "train.batch_size=32", "parallel.tensor=1"]


def with_pipeline(config, p, v, m):
    parallel = dataclasses.replace(config.parallel, data=8 // p, pipe=p, repeats=v, microbatches=m)
    return dataclasses.replace(config, parallel=parallel)


def timed_steps(config, steps: int, *, keep=None) -> tuple[float, float]:
    """(compile seconds, median step seconds) of the real step. keep: a dict that receives the compiled step
    under "compiled" (to analyse it without compiling it again)."""
    config = config.resolve_for_devices(8)
    trainer = build_trainer(config, jax.devices())
    batch = trainer.random_batch(config)
    start = time.perf_counter()
    step = trainer.train_step.lower(trainer.state, batch).compile()
    compile_s = time.perf_counter() - start
    if keep is not None:
        keep["compiled"] = step
    state, times = trainer.state, []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times[1:])


def compile_seconds(config) -> float:
    """Seconds to lower and compile the train step of `config` on all devices, from abstract state (nothing is
    allocated or run)."""
    step, state, batch = abstract_step(config)
    start = time.perf_counter()
    step.lower(state, batch).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=6)
    args, overrides = parser.parse_known_args()
    base = load_config(args.config, DEFAULTS + ["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]
                       + [o.removeprefix("--config.") for o in overrides])
    print(f"model: d_model {base.model.d_model}, {base.model.n_layers} layers, batch {base.train.batch_size} x "
          f"seq {base.train.seq_len}; tensor 1, data = 8/p\n")
    head = (f"{'p':>2} {'v':>2} {'m':>2} | {'iters':>5} {'bubble':>6} | {'exec/useful':>11} {'formula':>7} | "
            f"{'permute KB/it':>13} | {'compile s':>9} {'step ms':>8} {'vs no-pp':>8}")
    print(head)
    print("-" * len(head))
    baseline = None
    for p, v, m in SWEEP:
        config = with_pipeline(base, p, v, m) if p > 1 else base
        report = analyze(config, activations=False)
        compile_s, step_s = timed_steps(config, args.steps)
        baseline = baseline or step_s
        if p > 1:
            pp = report["pipeline"]
            cols = (f"{pp['iterations']:>5} {pp['bubble_fraction']:>6.3f} | {pp['executed_over_useful_flops']:>11.3f} "
                    f"{pp['executed_over_useful_flops_layers_formula']:>7.3f} | "
                    f"{pp['permute_bytes_per_iteration'] / 1e3:>13.1f}")
        else:
            cols = f"{'—':>5} {'—':>6} | {1.0:>11.3f} {1.0:>7.3f} | {'—':>13}"
        print(f"{p:>2} {v:>2} {m:>2} | {cols} | {compile_s:>9.2f} {step_s * 1e3:>8.1f} {step_s / baseline:>8.2f}")

    print("\ncompile time vs depth at the demo layout (data, pipe, tensor) = (2, 2, 2), 2 repeats, 4 microbatches:")
    demo = load_config(args.config, ["model.d_model=64"])
    for layers in (4, 16, 32):
        compile_s = compile_seconds(dataclasses.replace(demo, model=dataclasses.replace(demo.model, n_layers=layers)))
        print(f"  n_layers {layers:>2}: {compile_s:.2f} s")


if __name__ == "__main__":
    main()
