"""The planner's GPU check (issue 20), section 5 of `bench/gpu.sh`: probe this machine, predict the step that section
3 ran from the probe and set it beside what was measured, then let the planner choose the model's layout for these
devices (`parallel.auto` with nothing kept: remat, accumulation, microbatches — whatever fits the device's memory
fastest), compile and time that layout the same way, and report predicted against measured step time, MFU and
memory for both.

A lent GPU is a one-shot run, so this section keeps what it has measured if a later part fails, and skips timing the
planner's layout when it is the layout section 3 already timed or when `deadline` (a `time.perf_counter()` value)
leaves too little time for another compile. With time left it compiles section 3's step once more with a dump, to
read where the temp allocation goes (`jaxpar.analysis.heap`: on XLA:CPU each computation's own peak stacked along its
calls, not the bytes live at once).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Callable


def figures(config, profile, devices: int, measured_s: float, compiled_gb: float, backend: str) -> dict:
    """Predicted (on `profile`) against measured: step seconds, MFU (model FLOPs over the datasheet peak; None
    without one) and GB per device (`predict_memory` against the compiled step's arguments + outputs + temps)."""
    from jaxpar.planner import cost
    from jaxpar.planner.memory import predict_memory

    memory = predict_memory(config, backend)
    t = cost.predict_time(config, profile, devices, memory)
    peak = profile.flops_peak(config.model.dtype)
    return {"predicted_step_s": t.step, "measured_step_s": measured_s, "step_ratio": t.step / measured_s,
            "predicted_mfu": t.mfu(peak), "measured_mfu": t.model_flops / measured_s / peak if peak else None,
            "predicted_gb": memory.total / 1e9, "compiled_gb": compiled_gb}


def planner_check(config, devices: list, measured_s: float, compiled_gb: float,
                  time_steps: Callable, deadline: float) -> dict:
    """{'probe', 'ran', 'planned'} for section 3's `config` (measured `measured_s` a step, `compiled_gb`);
    `time_steps(config) → (compiled step, compile s, median step s, losses)` times a config as section 3 did."""
    from jaxpar.analysis.hlo import memory
    from jaxpar.config import PLANNED, ParallelConfig
    from jaxpar.planner import auto, probe, profile as machine

    backend = "cpu" if devices[0].platform == "cpu" else "gpu"
    start = time.perf_counter()
    profile = probe.measure(devices)
    dtype = config.model.dtype if config.model.dtype in profile.flops else "float32"
    out = {"probe": {"seconds": time.perf_counter() - start, "matmul_tflops": profile.flops[dtype] / 1e12,
                     "dtype": dtype, "memory_gb": profile.memory_gb, "latency_us": profile.latency * 1e6}}
    out["ran"] = figures(config, profile, len(devices), measured_s, compiled_gb, backend)
    print(f"planner: probed {profile.name} in {out['probe']['seconds']:.1f} s ({dtype} matmul "
          f"{out['probe']['matmul_tflops']:.3g} TFLOP/s); section 3's step predicted "
          f"{out['ran']['predicted_step_s'] * 1e3:.1f} ms, measured {measured_s * 1e3:.1f} ms", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        machine.write(profile, path)
        asked = dataclasses.replace(config, parallel=ParallelConfig(auto=True, profile=path),
                                    train=dataclasses.replace(config.train, grad_accum=1))
        chosen = auto.choose(asked, devices, log=print)
    layout = lambda c: (dataclasses.replace(c.parallel, keep=(), profile=""), c.train.grad_accum)  # noqa: E731
    planned = {"parallel": {k: getattr(chosen.parallel, k) for k in PLANNED}, "grad_accum": chosen.train.grad_accum}
    if layout(chosen) == layout(config):
        planned.update(out["ran"], same_as_ran=True)
    elif time.perf_counter() > deadline:
        planned["skipped"] = "no time left on the lent machine for another compile"
    else:
        step, _, step_s, _ = time_steps(chosen)
        planned.update(figures(chosen, profile, len(devices), step_s, memory(step)["peak_bytes"] / 1e9, backend))
        del step
    out["planned"] = planned
    if time.perf_counter() < deadline:
        # Does this backend's buffer assignment, as XLA:CPU's does, stack each loop's and branch's temporaries on
        # its callers' (`analysis.heap`)? Section 3's step compiled again with a dump says: stacked ≈ allocated.
        from jaxpar.analysis.verify import compiled_memory

        heap = compiled_memory(config, heap=True).get("heap")
        out["heap"] = heap or "no buffer assignment or live ranges in the dump"
        if heap:
            print(f"planner: section 3's step, temp by computation: {heap['stacked'] / 1e9:.3f} GB stacked, "
                  f"{heap['allocation'] / 1e9:.3f} allocated, {heap['live'] / 1e9:.3f} live at once", flush=True)
    if "measured_step_s" in planned:
        print(f"planner: chose {planned['parallel']} accum {planned['grad_accum']}: predicted "
              f"{planned['predicted_step_s'] * 1e3:.1f} ms and {planned['predicted_gb']:.2f} GB, measured "
              f"{planned['measured_step_s'] * 1e3:.1f} ms and {planned['compiled_gb']:.2f} GB compiled", flush=True)
    return out
