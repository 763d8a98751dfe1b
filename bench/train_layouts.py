"""Benchmark: train-step time of the tiny model per (data, tensor) layout, side by side in one run.

    python bench/train_layouts.py [--steps 20] [--config configs/tiny.py] [overrides ...]

Prints compile time, median step time, tokens/s and the ratio to the pure data-parallel (8, 1) layout. On simulated
CPU devices all "devices" share the host's cores, so the ratios show the overhead of the collectives each layout adds
(the mesh does not add compute), not a speed-up; on real accelerators run the same script with real devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train import build_trainer  # noqa: E402


def time_layout(config, layout, batches):
    devices = None  # one device, no mesh
    if layout is not None:
        parallel = dataclasses.replace(config.parallel, data=layout[0], tensor=layout[1])
        config = dataclasses.replace(config, parallel=parallel)
        devices = jax.devices()[: layout[0] * layout[1]]
    trainer = build_trainer(config, devices)
    state, step, put = trainer.state, trainer.train_step, trainer.put
    start = time.perf_counter()
    state, m = step(state, put(batches[0]))
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - start
    times = []
    for b in batches[1:]:
        start = time.perf_counter()
        state, m = step(state, put(b))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=20)
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, [o.removeprefix("--config.") for o in overrides])
    t = config.train
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
               for _ in range(args.steps + 1)]
    tokens = t.batch_size * t.seq_len
    layouts = [None, (8, 1), (4, 2), (2, 4), (1, 8)]
    print(f"{'layout (data, tensor)':<24}{'compile s':>10}{'step ms':>10}{'tokens/s':>11}{'vs (8,1)':>10}")
    base = None
    for layout in layouts:
        heads_ok = layout is None or config.model.n_kv_heads % layout[1] == 0
        if not heads_ok:
            print(f"{str(layout):<24}  skipped: n_kv_heads={config.model.n_kv_heads} not divisible by tensor")
            continue
        compile_s, step_s = time_layout(config, layout, batches)
        base = step_s if layout == (8, 1) else base
        ratio = f"{base / step_s:.2f}x" if base and layout is not None else ""
        name = "1 device, no mesh" if layout is None else str(layout)
        print(f"{name:<24}{compile_s:>10.2f}{step_s * 1e3:>10.1f}{tokens / step_s:>11.0f}{ratio:>10}")


if __name__ == "__main__":
    main()
