"""The benchmark suite: one command, one table.

    python -m bench [--quick] [--steps N] [--repeats R]      (or: python bench/run.py ...)

Sections (each device count runs in its own subprocess: the simulated device count is fixed when jax starts):
1. single device — jaxpar's train step against a plain hand-written `jax.jit` step of the same math
   (`bench/plain.py`), timed interleaved (R rounds of N steps of each, the same batch, medians). The ratio is
   plain time / jaxpar time (goal ≥ 0.95), by wall clock and, on a CPU, by process CPU seconds (which other
   processes' load barely moves). A last row drives jaxpar's step the way `fit` does (the host reads each step's
   `skipped` flag after the next step is dispatched) to show what that costs.
2. 8 simulated CPU devices — the tiny model's step time per (data, pipe, tensor) layout, with model FLOP/s per
   device (`jaxpar.flops`; a CPU has no peak, so no MFU); beside each, from `jaxpar.analysis.report`:
   tensor-axis bytes against Megatron's analytic count and, with a pipeline, executed/useful FLOPs against
   (v·m + p − 1)/(v·m).
3. compile time against depth (4, 16, 32 layers) at the demo layout (2, 2, 2): layers are scanned, model.scan_unroll
   = 4 per iteration, so it grows until a stage holds 4 layers (k = 1 at 4 layers, 4 at 16) and then stays. Process CPU seconds (lowering and compiling), which other processes' load barely moves; wall beside.
4. whole processes (bench/versus.py) — per layout of the MaxText comparison (the tiny Llama of d_model 128, seq 64,
   batch 8, fp32, on 1 or 8 simulated devices): `jaxpar train`'s per-step time, (wall(160 steps) − wall(10)) / 150,
   beside bench/plain.py's hand-written jax.jit loop (layouts without a pipeline) and, where MaxText 0.2.5 is
   installed beside it (bench/versus.py says how), MaxText's; `--versus-repeats` interleaved rounds (default 1;
   bench/versus.py --repeats 3 is the decisive run), medians, wall and CPU. Each ratio is the other's time over
   jaxpar's (> 1: jaxpar is faster).
5. pipeline schedules (bench/schedules.py) at (2, 2, 2): per schedule, the step's compiled temporaries at m = p and
   m = 4p microbatches of a fixed size (the ratio: GPipe and circular grow with m, 1F1B, ZB-H1 and ZB-V do not),
   and the step time at m = 4 against the circular loop's, interleaved rounds, medians.
6. context parallelism (bench/context.py) at equal devices: all-gather K/V and ring attention at context 2 and 8
   against context 1 — the step's compiled temporaries for one 2048-token sequence per data shard (about 1/c), and
   the step time for 8 such sequences, interleaved rounds, medians (`--quick`: 1024 tokens).
7. mixture of experts (bench/moe.py): the MoE step (8 experts of width 96, top 2, dropless) at expert × tensor
   = 1×1, 2×1, 8×1 and 2×2 against the dense model of equal active parameters (one SwiGLU of width 192) at data 8,
   interleaved rounds, medians: the dispatch's and XLA:CPU's masked ragged_dot's overhead.
Simulated devices share the host's cores: section 2 shows each layout's overhead, not a speed-up. Sections 1–3
take about 1.5 minutes on an idle 2-core machine (3–4 under load), `--quick` a little over 1; section 4 about 6
minutes per round without MaxText and 10 with it (`--versus-repeats 0` or `--quick` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROW = "BENCH-ROW "
NO_PIPE = ["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]
# (data, pipe, tensor) -> overrides of configs/tiny.py (whose own layout is (2, 2, 2), 2 repeats × 4 microbatches).
LAYOUTS = {(8, 1, 1): ["parallel.data=8", "parallel.tensor=1"] + NO_PIPE,
           (4, 1, 2): ["parallel.data=4", "parallel.tensor=2"] + NO_PIPE,
           (2, 2, 2): ["parallel.data=2"],
           (1, 2, 4): ["parallel.data=1", "parallel.tensor=4"]}
SINGLE = ["parallel.data=1", "parallel.tensor=1", "train.batch_size=8"] + NO_PIPE


def emit(section: str, case: str, measured: str, reference: str = "", ratio: float | None = None,
         note: str = "") -> None:
    """A worker's table row, as one line of JSON on stdout."""
    print(ROW + json.dumps({"section": section, "case": case, "measured": measured, "reference": reference,
                            "ratio": ratio, "note": note}), flush=True)


def _batch(config, put):
    import numpy as np

    t = config.train
    rows = np.random.default_rng(0).integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1))
    return put(rows.astype(np.int32))


def single_device(steps: int, repeats: int) -> None:
    """Section 1 (run with one device)."""
    import jax

    from bench import plain
    from jaxpar import flops
    from jaxpar.config import load_config
    from jaxpar.train import build_trainer

    config = load_config(str(ROOT / "configs/tiny.py"), SINGLE)
    trainer = build_trainer(config, None)
    batch = _batch(config, jax.device_put)
    plain_step, tx = plain.make_step(config.model, config.train)
    params = plain.params_from_jaxpar(trainer.state.params)
    box = {"jaxpar": trainer.state, "plain": (params, tx.init(params))}

    def run_jaxpar(n: int, sync: bool = False):
        state, pending = box["jaxpar"], None
        for _ in range(n):
            state, metrics = trainer.train_step(state, batch)
            if sync and pending is not None:
                int(pending["skipped"])  # what fit does: the previous step's flag, after this one is dispatched
            pending = metrics
        if sync:
            int(pending["skipped"])
        box["jaxpar"] = state
        return metrics["loss"]

    def run_plain(n: int):
        params, opt_state = box["plain"]
        for _ in range(n):
            params, opt_state, loss = plain_step(params, opt_state, batch)
        box["plain"] = (params, opt_state)
        return loss

    contenders = {"jaxpar": run_jaxpar, "plain": run_plain, "fit-driven": lambda n: run_jaxpar(n, sync=True)}
    losses = {k: float(fn(1)) for k, fn in list(contenders.items())[:2]}  # compile both; first step's loss
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):  # interleaved rounds: machine load hits every contender alike
        for name, fn in contenders.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(steps))
            wall[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - cpu_start) / steps)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    t = config.train
    rate = flops.train_flops_per_token(config.model, t.seq_len) * t.batch_size * t.seq_len / med["jaxpar"] / 1e9
    same = "same first loss" if abs(losses["jaxpar"] - losses["plain"]) < 1e-5 * abs(losses["plain"]) else \
        f"first losses differ: {losses}"
    emit("1 device", f"jaxpar step vs plain jit (tiny, {t.batch_size}x{t.seq_len})", f"{med['jaxpar'] * 1e3:.1f} ms",
         f"{med['plain'] * 1e3:.1f} ms", med["plain"] / med["jaxpar"],
         f"plain/jaxpar wall time, goal >= 0.95; {same}; {rate:.2f} GFLOP/s; medians of {repeats}x{steps}")
    if jax.default_backend() == "cpu":  # a host-run step's CPU seconds barely move with other processes' load
        emit("1 device", "  the same, in process CPU seconds", f"{med_cpu['jaxpar'] * 1e3:.1f} ms",
             f"{med_cpu['plain'] * 1e3:.1f} ms", med_cpu["plain"] / med_cpu["jaxpar"],
             "plain/jaxpar CPU time: the load-independent figure on a shared machine")
    emit("1 device", "jaxpar step driven like fit (reads one late)", f"{med['fit-driven'] * 1e3:.1f} ms",
         f"{med['plain'] * 1e3:.1f} ms", med["plain"] / med["fit-driven"], "plain/fit-driven wall time")


def layouts(steps: int, depths: tuple[int, ...]) -> None:
    """Sections 2 and 3 (run with 8 devices)."""
    from bench.pipeline import compile_seconds, timed_steps
    from jaxpar import flops
    from jaxpar.analysis.report import analyze
    from jaxpar.config import load_config

    tiny = str(ROOT / "configs/tiny.py")
    base = None
    for layout, overrides in LAYOUTS.items():
        config = load_config(tiny, overrides).resolve_for_devices(8)
        t, p = config.train, config.parallel
        keep: dict = {}
        compile_s, step_s = timed_steps(config, steps, keep=keep)
        report = analyze(config, activations=False, compiled=keep["compiled"])  # the timed program itself
        base = base or step_s
        rate = flops.train_flops_per_token(config.model, t.seq_len) * t.batch_size * t.seq_len / step_s / 8 / 1e9
        name = f"{layout}" + (f" v={p.repeats} m={p.microbatches}" if p.pipe > 1 else "")
        emit("8 devices", f"step {name}", f"{step_s * 1e3:.1f} ms", f"{base * 1e3:.1f} ms", step_s / base,
             f"vs (8, 1, 1); compile {compile_s:.1f} s; {rate:.2f} GFLOP/s/dev")
        if p.tensor > 1:
            got, want = report["collectives"]["tensor_sent_bytes"], report["expected"]["tensor_sent_bytes"]["total"]
            emit("8 devices", f"TP bytes {name}", f"{got / 1e6:.3f} MB/dev", f"{want / 1e6:.3f} MB analytic",
                 got / want, "tensor-axis bytes sent per device per step")
        if p.pipe > 1:
            pp = report["pipeline"]
            emit("8 devices", f"pipeline FLOPs {name}", f"{pp['executed_over_useful_flops']:.3f} exec/useful",
                 f"{pp['executed_over_useful_flops_layers_formula']:.3f} (v·m+p−1)/(v·m)",
                 pp["executed_over_useful_flops"] / pp["executed_over_useful_flops_layers_formula"],
                 f"{pp['iterations']} iterations, bubble {pp['bubble_fraction']:.3f}; head/loss are bubble-free, "
                 "so the whole step sits a little under the layers' formula")
    demo = load_config(tiny, ["model.d_model=64"])
    wall: dict[int, list[float]] = {n: [] for n in depths}
    cpu: dict[int, list[float]] = {n: [] for n in depths}
    for n in depths + depths[::-1]:  # there and back: one-time costs and drifting load fall on every depth
        start = time.process_time()
        wall[n].append(compile_seconds(dataclasses.replace(demo, model=dataclasses.replace(demo.model, n_layers=n))))
        cpu[n].append(time.process_time() - start)
    first = min(cpu[depths[0]])
    for n in depths:
        k = n // 4  # layers per stage per pass at p = 2, v = 2
        emit("compile vs depth", f"{n} layers at (2, 2, 2) v=2", f"{min(cpu[n]):.2f} CPU s", f"{first:.2f} CPU s",
             min(cpu[n]) / first, f"wall {min(wall[n]):.2f} s; k = {k} layer{'s' * (k > 1)} per stage scanned"
             + ("; at k = 1 XLA drops the one-trip loop" if k == 1 else ""))


def schedules(rounds: int) -> None:
    """Section 5 (8 devices)."""
    from bench.schedules import memory_rows, time_rows

    mem = {(r["schedule"], r["microbatches"]): r for r in memory_rows([1, 4])}
    times = {r["schedule"]: r for r in time_rows(steps=4, rounds=rounds)}
    for name, t in times.items():
        small, big = mem[(name, 2)], mem[(name, 8)]
        emit("schedules", f"{name} (2, 2, 2) m=4", f"{t['step_ms']:.1f} ms", f"{times['circular']['step_ms']:.1f} ms",
             t["circular_over_this"], f"circular/this; temp {small['temp_bytes'] / 2**20:.2f} MB at m=2, "
             f"{big['temp_bytes'] / 2**20:.2f} MB at m=8 (x{big['temp_bytes'] / small['temp_bytes']:.2f}); "
             f"bubble {small['bubble']:.3f} at m=2")


def context(rounds: int, seq_len: int) -> None:
    """Section 6 (8 devices)."""
    from bench.context import memory_rows, time_rows

    degrees, impls = [1, 2, 8], ["all_gather", "ring"]
    mem = {(r["context"], r["impl"]): r for r in memory_rows(degrees, impls, seq_len)}
    times = time_rows(degrees, impls, seq_len, steps=2, rounds=rounds)
    base = times[0]
    for t in times:
        m = mem[(t["context"], t["impl"])]
        emit("context", f"context {t['context']} {t['impl']}", f"{t['step_ms']:.1f} ms", f"{base['step_ms']:.1f} ms",
             1 / t["vs_first"], f"context-1 time / this; temp {m['temp_bytes'] / 2**20:.2f} MB for one "
             f"{seq_len}-token sequence per shard ({m['vs_first']:.3f} of context 1, 1/c = {m['ideal']:.3f})")


def moe(rounds: int) -> None:
    """Section 7 (8 devices)."""
    from bench.moe import time_rows

    rows = time_rows([(1, 1), (2, 1), (8, 1), (2, 2)], steps=2, rounds=rounds, capacity=0.0)
    dense = rows[0]
    for r in rows[1:]:
        emit("moe", f"MoE {r['layout']} (data {r['data']})", f"{r['step_ms']:.1f} ms", f"{dense['step_ms']:.1f} ms",
             r["dense_over_this"], f"dense step / this, equal active parameters; {r['tokens_per_s']:.0f} tokens/s "
             f"against dense data 8's {dense['tokens_per_s']:.0f}")


def versus_rows(repeats: int) -> list[dict]:
    """Section 4: bench/versus.py's table as rows (it runs its own processes, one per measurement)."""
    cmd = [sys.executable, str(ROOT / "bench" / "versus.py"), "--repeats", str(repeats), "--plain", "--format",
           "json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return [{"section": "whole process", "case": "FAILED", "measured": f"exit {proc.returncode}",
                 "reference": "", "ratio": None, "note": tail}]
    result = json.loads(proc.stdout)
    rows = []
    for r in result["rows"]:
        j = r["jaxpar"]
        for fw, name in (("plain", "plain jit"), ("maxtext", "MaxText")):
            if fw not in r or r[fw]["step_wall_s"] is None:
                continue
            o = r[fw]
            rows.append({"section": "whole process", "case": f"jaxpar train vs {name} {r['mesh']}",
                         "measured": f"{j['step_wall_s'] * 1e3:.1f} ms", "reference": f"{o['step_wall_s'] * 1e3:.1f} ms",
                         "ratio": r[f"ratio_{fw}_wall"],
                         "note": f"{name}/jaxpar wall; by CPU {r[f'ratio_{fw}_cpu']:.3f} ({j['step_cpu_s'] * 1e3:.1f} vs "
                                 f"{o['step_cpu_s'] * 1e3:.1f} ms); medians of {result['repeats']}"})
    rows += [{"section": "whole process", "case": "note", "measured": "", "reference": "", "ratio": None,
              "note": n} for n in result["notes"]]
    return rows


def _env(devices: int | None) -> dict[str, str]:
    """The environment for a worker: the caller's XLA_FLAGS without any device count, plus `devices` simulated
    CPU devices (None: leave the platform alone, one device)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if devices:
        flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = flags
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _worker(section: str, devices: int | None, args) -> list[dict]:
    cmd = [sys.executable, "-m", "bench.run", "--worker", section, "--steps", str(args.steps), "--repeats",
           str(args.repeats)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(devices), capture_output=True, text=True, check=False)
    rows = [json.loads(line[len(ROW):]) for line in proc.stdout.splitlines() if line.startswith(ROW)]
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        rows.append({"section": section, "case": "FAILED", "measured": f"exit {proc.returncode}", "reference": "",
                     "ratio": None, "note": tail})
    return rows


def format_table(rows: list[dict]) -> str:
    """Rows as one aligned text table."""
    head = ("section", "case", "measured", "reference", "ratio", "note")
    cells = [head] + [(r["section"], r["case"], r["measured"], r["reference"],
                       "" if r["ratio"] is None else f"{r['ratio']:.3f}", r["note"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(c[i].ljust(widths[i]) if i != 4 else c[i].rjust(widths[i]) for i in range(5)) + "  " + c[5]
             for c in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds; depths 4 and 16 only")
    parser.add_argument("--steps", type=int, default=None, help="steps per timing round, section 1 (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds, section 1 (default 15, quick 5)")
    parser.add_argument("--versus-repeats", type=int, default=1,
                        help="rounds of section 4, whole processes against plain jit and MaxText (0: skip)")
    parser.add_argument("--worker", choices=("single", "layouts", "schedules", "context", "moe"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or 2
    args.repeats = args.repeats or (5 if args.quick else 15)
    if args.worker == "single":
        single_device(args.steps, args.repeats)
        return 0
    if args.worker == "layouts":
        layouts(2 if args.quick else 4, (4, 16) if args.quick else (4, 16, 32))
        return 0
    if args.worker == "schedules":
        schedules(2 if args.quick else 3)
        return 0
    if args.worker == "context":
        context(2 if args.quick else 3, 1024 if args.quick else 2048)
        return 0
    if args.worker == "moe":
        moe(2 if args.quick else 3)
        return 0
    start = time.perf_counter()
    rows = _worker("single", None, args) + _worker("layouts", 8, args) + _worker("schedules", 8, args) \
        + _worker("context", 8, args) + _worker("moe", 8, args)
    if args.versus_repeats > 0 and not args.quick:
        rows += versus_rows(args.versus_repeats)
    print(format_table(rows))
    print(f"\n{time.perf_counter() - start:.0f} s; python -m bench{' --quick' if args.quick else ''} "
          f"--steps {args.steps} --repeats {args.repeats}")
    return 1 if any(r["case"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
