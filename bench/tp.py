"""Benchmark: explicit Megatron TP/SP (shard_map) vs the GSPMD-inferred step, side by side in one run.

    python bench/tp.py [--steps 10] [--config configs/tiny.py] [--config.section.field=value ...]

For tensor ∈ {1, 2, 4, 8} and SP off/on (data fills the 8 simulated devices) it prints, per device:
tensor-axis bytes sent per layer (measured from the compiled HLO, loop trip counts applied) against the analytic
Megatron count, the activation memory per layer (jaxpar.analysis.report.activation_bytes_per_layer), the step's
temp memory, and the median step time of our step and of the same model with tensor parallelism left to GSPMD; with
SP also the step with collective matmuls (parallel.overlap=collective_matmul) and its tensor bytes (equal).
On simulated CPU devices every "device" shares the same cores, so times measure overhead, not scaling — nor
overlap, which needs collectives that run beside the compute (GPU/TPU async collective-permutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.analysis import collectives, memory  # noqa: E402
from jaxpar.analysis.report import activation_bytes_per_layer, analyze  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.mesh import make_mesh  # noqa: E402
from jaxpar.train import build_trainer  # noqa: E402

DEFAULTS = ["model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=384", "train.batch_size=16",
            "parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]  # a TP benchmark: no pipeline


def step_time(config, mesh, explicit: bool, steps: int) -> tuple[float, float, float]:
    """(median step seconds, tensor-axis bytes sent per step, temp bytes) for the real step."""
    trainer = build_trainer(config, mesh, explicit=explicit)
    state = trainer.state
    batch = trainer.random_batch(config)
    compiled = trainer.train_step.lower(state, batch).compile()
    sent = sum(c.sent_bytes * c.count for c in collectives(compiled, mesh) if c.axes == ("tensor",))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), sent, memory(compiled)["temp_bytes"]


def collective_matmul(config, mesh, steps: int, plain: float, layers: int) -> tuple[float, float, float]:
    """(ms, its time over the plain SP step's, tensor KB per layer) of the step with collective matmuls."""
    cm = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, overlap="collective_matmul"))
    seconds, sent, _ = step_time(cm, mesh, True, steps)
    return seconds * 1e3, seconds / plain, sent / layers / 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=10)
    args, overrides = parser.parse_known_args()
    base = load_config(args.config, DEFAULTS + [o.removeprefix("--config.") for o in overrides])
    L = base.model.n_layers
    print(f"model: d_model {base.model.d_model}, {L} layers, {base.model.n_heads} heads, batch "
          f"{base.train.batch_size} x seq {base.train.seq_len}, {base.model.dtype}; per device figures\n")
    head = (f"{'t':>2} {'SP':>3} {'data':>4} | {'TP KB/layer':>11} {'analytic':>9} {'ratio':>6} | "
            f"{'act KB/layer':>12} {'temp MB':>8} | {'ours ms':>8} {'GSPMD ms':>9} {'GSPMD/ours':>10} "
            f"{'GSPMD TP KB/layer':>17} | {'cm ms':>7} {'cm/ours':>7} {'cm KB/layer':>11}")
    print(head)
    print("-" * len(head))
    for tensor in (1, 2, 4, 8):
        for sp in (False, True):
            if sp and tensor == 1:
                continue
            parallel = dataclasses.replace(base.parallel, data=8 // tensor, tensor=tensor, sequence_parallel=sp)
            config = dataclasses.replace(base, parallel=parallel)
            mesh = make_mesh(parallel)
            report = analyze(config, activations=False)
            per_layer = report["collectives"]["tensor_sent_bytes"] / L / 1e3
            want = report["expected"]["tensor_sent_bytes"]["total"] / L / 1e3
            act = activation_bytes_per_layer(config, mesh)["per_layer"] / 1e3
            ours, _, temp = step_time(config, mesh, True, args.steps)
            no_sp = dataclasses.replace(config, parallel=dataclasses.replace(parallel, sequence_parallel=False))
            gspmd, gspmd_sent, _ = step_time(no_sp, mesh, False, args.steps)  # GSPMD has no SP (refused if asked)
            ratio = f"{per_layer / want:.3f}" if want else "—"
            cm = "" if not sp else " | {:>7.1f} {:>7.2f} {:>11.1f}".format(*collective_matmul(config, mesh, args.steps,
                                                                                               ours, L))
            print(f"{tensor:>2} {'on' if sp else 'off':>3} {8 // tensor:>4} | {per_layer:>11.1f} {want:>9.1f} "
                  f"{ratio:>6} | {act:>12.1f} {temp / 1e6:>8.2f} | {ours * 1e3:>8.1f} {gspmd * 1e3:>9.1f} "
                  f"{gspmd / ours:>10.2f} {gspmd_sent / L / 1e3:>17.1f}{cm}")
    print("\nTP KB/layer: all tensor-axis bytes of the step (embedding, head and loss included) divided by the "
          "layer count;\nGSPMD TP KB/layer: the same for the GSPMD-inferred step (no sequence parallelism there).")


if __name__ == "__main__":
    main()
