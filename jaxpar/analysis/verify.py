"""`jaxpar plan --verify`: compile a layout ahead of time on this machine's CPU and set its memory beside the
planner's prediction — at any scale, since nothing is allocated.

The train step is lowered from abstract state and batch (shapes and shardings only) on `devices` simulated CPU
devices and compiled; `memory_analysis()` gives the bytes per device. The device count of a process is fixed when
jax starts, so the compile runs in a child interpreter (`python -m jaxpar.analysis.verify`, the config as JSON on
stdin) started with `--xla_force_host_platform_device_count=devices`.

What is compared: XLA:CPU's program, so the prediction is `predict_memory(config, "cpu")` with the attention kernel
that CPU runs (XLA's, which keeps the [s, s] scores; cuDNN's flash attention would not). Parameters, optimizer state
and the batch are the same on any backend — the resident bytes must match exactly —, and the activations follow
the same trace, so a verified layout's error is the model's error, not the GPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from jaxpar.config import Config, config_from_dict
from jaxpar.errors import PlanError

# The child's answer is the last stdout line, after this mark (jax may print warnings before it).
_MARK = "jaxpar-verify:"


def abstract_step(config: Config):
    """(train step, abstract state, abstract batch) of `config` on all devices: what lowers and compiles it with
    nothing allocated or run."""
    import jax
    import jax.numpy as jnp

    from jaxpar.train import build_trainer

    config = config.resolve_for_devices(len(jax.devices()))
    trainer = build_trainer(config, jax.devices(), abstract=True)
    t = config.train
    batch = jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jnp.int32, sharding=trainer.plan.batch_sharding)
    return trainer.train_step, trainer.state, batch


def compiled_memory(config: Config, heap: bool = False) -> dict:
    """`memory_analysis()` of the train step of `config` on this process's devices (bytes per device), and the
    seconds the lowering and compile took; with `heap`, also where the temp allocation goes (`heap.heap_chain`, from
    the compile's dump, written to a temporary directory)."""
    from jaxpar.analysis.heap import heap_chain
    from jaxpar.analysis.hlo import memory

    step, state, batch = abstract_step(config)
    with tempfile.TemporaryDirectory(prefix="jaxpar-heap-") if heap else contextlib.nullcontext() as dump:
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if heap else None
        start = time.perf_counter()
        out = memory(step.lower(state, batch).compile(compiler_options=options))
        out["compile_s"] = time.perf_counter() - start
        if heap:
            out["heap"] = heap_chain(dump)
    return out


def on_cpu(config: Config) -> Config:
    """`config` with the attention kernel XLA:CPU compiles."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, attention="xla"))


def verify(config: Config, devices: int, timeout_s: float = 3600) -> dict:
    """Compile `config` (resolved for `devices`) on `devices` simulated CPU devices in a child process and compare
    with the prediction: {'predicted', 'compiled', 'error' (total / compiled peak − 1), 'resident_exact'}."""
    from jaxpar.planner.memory import predict_memory

    config = on_cpu(config)
    predicted = predict_memory(config, "cpu")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        child = subprocess.run([sys.executable, "-m", "jaxpar.analysis.verify"], input=config.to_json(), env=env,
                               capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PlanError(f"--verify: compiling the layout on {devices} simulated CPU devices took over "
                        f"{timeout_s:g} s; verify a smaller layout, or on a larger machine") from None
    answer = [line for line in child.stdout.splitlines() if line.startswith(_MARK)]
    if child.returncode or not answer:
        lines = child.stderr.strip().splitlines()
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)]
        tail = (errors or lines or [f"exit status {child.returncode}"])[-1][:400]
        raise PlanError(f"--verify: the compile on {devices} simulated CPU devices failed ({tail}); host memory "
                        "may be too small for the compiler at this scale")
    compiled = json.loads(answer[-1][len(_MARK):])
    return {"predicted": predicted.as_dict(), "compiled": compiled,
            "error": predicted.total / compiled["peak_bytes"] - 1,
            "resident_exact": predicted.resident == compiled["argument_bytes"]}


def format_verify(result: dict, devices: int, budget_gb: float) -> str:
    """One paragraph: compiled peak vs predicted, the resident bytes, and the budget."""
    from jaxpar.analysis.heap import format_chain

    c, p = result["compiled"], result["predicted"]
    fits = "within" if c["peak_bytes"] <= budget_gb * 1e9 else "OVER"
    line = (f"verify: compiled on {devices} simulated CPU devices in {c['compile_s']:.1f} s: peak "
            f"{c['peak_bytes'] / 1e9:.3f} GB per device ({fits} the {budget_gb:g} GB budget), predicted "
            f"{p['total'] / 1e9:.3f} GB ({result['error'] * 100:+.1f} %); resident {c['argument_bytes'] / 1e9:.3f} "
            f"GB, predicted {'exactly' if result['resident_exact'] else p['resident'] / 1e9}")
    return line + (f"\n{format_chain(c['heap'])}" if c.get("heap") else "")


def _main() -> int:
    config = config_from_dict(json.loads(sys.stdin.read()))
    print(_MARK + json.dumps(compiled_memory(config, heap=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
