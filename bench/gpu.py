"""The one-shot GPU check that `bench/gpu.sh` runs (see there for usage).

1. XLA's GPU flags (`jaxpar.perf.configure_gpu_flags`), then: does JAX see the GPU(s)?
2. The matmul ceiling: the best TFLOP/s of a large bf16 matmul (n = 8192: 2n³ FLOPs per call), the realistic
   upper bound for a transformer step on this device, beside the datasheet peak.
3. A ~1B Llama (d_model 2048, 16 layers, 16 heads of 128, 8 kv heads, d_ff 8192, vocab 128256 tied, seq 2048, bf16
   compute, fp32 master weights and AdamW state; `configs/llama_1b.py` with 16 heads) trained for `--steps` steps on
   random tokens, data-parallel over the local GPUs; per-step wall times after the compiling step. Printed:
   tokens/s, model TFLOP/s per device (`jaxpar.flops`, causal attention pairs, no recomputation), MFU
   against the datasheet peak and against the measured ceiling, HFU, and peak device memory.
3b. The `configs/llama_1b.py` preset itself (32 heads of 64, 1.24B parameters, bf16 compute) at the layout one GPU
   allows, data = tensor = pipe = 1, with remat none, dots and full, then FP8 (model.matmul=fp8_rowwise, remat none:
   its compiled step's FP8 GEMMs counted — XLA's rewrite of the quantize-dequantize form), each compiled once and
   timed for up to 10
   steps at section 3's sequences per device: the same figures per row (MFU against the datasheet and against the
   ceiling, HFU with the recompute counted, the compiled step's peak memory). Run right after section 3; a row is
   skipped, with the reason, when the time the previous row took would run into the sections still to come, or
   when it does not fit; a cuDNN attention failure retries with `model.attention=xla` as section 3 does.
4. Decoding the same model's shape (random bf16 weights, one device): 8 prompts of 128 tokens + 128 greedy tokens
   with the explicit path (`decode.generate(..., plan=)`), the layers' matrices bf16, int8 and int4 (groups of 128):
   tokens/s and the parameter GB each holds. One GPU has no tensor axis, so collective-matmul overlap cannot show
   here (it needs tensor > 1 on several GPUs).
5. The planner (`bench/gpu_plan.py`, issue 20): `jaxpar probe` of this machine, the time and memory model's
   prediction of section 3's step on that profile beside what was measured, then `parallel.auto`'s own layout for
   the model on these devices, compiled and timed the same way: predicted vs measured step time, MFU and memory.
`--dry-run`: the same path on CPU with a tiny model and a 512 matmul (a CI test runs it), so the script cannot rot.
The last line is `GPU-RESULT {json}` with every figure, for bench/RESULTS.md. Being a one-shot run on lent time, it
retries rather than stops: out of memory halves the sequences per device, a cuDNN attention failure falls back to
`model.attention=xla`. Time is set against `GPU_BENCH_TIMEOUT_S` (gpu.sh's `timeout`, 470 s): a later section is
skipped with its reason when too little is left, and 10 s before the limit a watchdog prints the `GPU-RESULT` line
with what was measured so far ("stopped": the section it was in) and exits 3, so the figures survive a slow compile.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

from bench.gpu_plan import planner_check
from jaxpar import perf

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUDGET_S = float(os.environ.get("GPU_BENCH_TIMEOUT_S", 470))  # gpu.sh's `timeout`: every deadline is set from it
# Seconds that must remain when each later section starts; the planner compiles its own layout only while more than
# PLAN_LEFT_S remain (at 470 s: rows end by 270 s, decoding starts by 320 s, the planner compiles until 330 s).
ROWS_LEFT_S, DECODE_LEFT_S, PLAN_LEFT_S, PROBE_LEFT_S, WATCHDOG_LEFT_S = 200, 150, 140, 60, 10
REMATS = ("none", "dots", "full")  # section 3b's float rows, in order of value: no recompute first
# section 3b's rows: (remat, model.matmul) — the float rows, then FP8 (jaxpar.fp8) at the first remat
ROWS = tuple((remat, "float") for remat in REMATS) + (("none", "fp8_rowwise"),)
ONE_B = ["model.n_heads=16", "model.head_dim=128", "model.n_kv_heads=8", "parallel.data=-1", "parallel.tensor=1",
         "train.grad_accum=1", "train.warmup_steps=10", "data.source=synthetic"]
PRESET = ["train.grad_accum=1", "train.warmup_steps=10", "data.source=synthetic"]  # section 3b: llama_1b as it is
ONE_GPU = ["parallel.data=1", "parallel.tensor=1", "parallel.pipe=1"]  # the one layout a single device allows
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.head_dim=16",
        "model.n_kv_heads=2", "model.d_ff=128", "model.max_seq_len=64", "model.dtype=float32", "train.seq_len=64",
        "parallel.data=-1", "parallel.tensor=1", "train.grad_accum=1", "data.source=synthetic"]


def matmul_ceiling(n: int, dtype, rounds: int = 3, calls: int = 10) -> float:
    """Best FLOP/s over `rounds` of `calls` back-to-back n×n @ n×n matmuls (2n³ FLOPs each)."""
    import jax

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        out = [f(a, b) for _ in range(calls)]
        jax.block_until_ready(out)
        best = max(best, 2 * n**3 * calls / (time.perf_counter() - start))
    return best


def decode_speed(model, devices, dry: bool) -> dict:
    """Table 4 of the docstring: {format: {tokens_per_s, param_gb, same_as_bf16}} for bf16, int8 and int4 weights."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpar.config import ParallelConfig
    from jaxpar.infer import decode
    from jaxpar.model import Transformer, abstract_model, quantize_state
    from jaxpar.plan import make_plan

    cfg = dataclasses.replace(model, dtype="bfloat16", param_dtype="bfloat16", attention="xla")  # masked decoding
    B, P, N = (2, 16, 8) if dry else (8, 128, 128)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, P)).astype(np.int32)
    weights = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param))()
    out, reference = {}, None
    for fmt in ("bf16", "int8", "int4"):
        fcfg = cfg if fmt == "bf16" else dataclasses.replace(cfg, weights=fmt, weight_group=16 if dry else 128)
        plan = make_plan(fcfg, ParallelConfig(data=1, tensor=1), devices[:1])
        state = weights if fmt == "bf16" else quantize_state(weights, fcfg)
        graphdef, _ = abstract_model(plan.model, plan.padded_vocab)
        model_f = nnx.merge(graphdef, plan.from_canonical(state))
        tokens = decode.generate(model_f, prompts, max_new_tokens=N, plan=plan, return_prompt=False)  # compiles
        start = time.perf_counter()
        tokens = decode.generate(model_f, prompts, max_new_tokens=N, plan=plan, return_prompt=False)
        seconds = time.perf_counter() - start
        reference = tokens if reference is None else reference
        bits = lambda a: (jnp.iinfo if jnp.issubdtype(a.dtype, jnp.integer) else jnp.finfo)(a.dtype).bits  # noqa
        gb = sum(a.size * bits(a) // 8 for a in jax.tree.leaves(state)) / 1e9
        out[fmt] = {"tokens_per_s": B * N / seconds, "param_gb": gb,
                    "same_as_bf16": float((np.asarray(tokens) == np.asarray(reference)).mean())}
        del state, model_f
        print(f"decode {fmt}: {out[fmt]['tokens_per_s']:,.0f} tokens/s ({B} rows x {N} new after {P}), "
              f"params {gb:.2f} GB, tokens equal to bf16's {out[fmt]['same_as_bf16']:.0%}", flush=True)
    return out


def watchdog(result: dict, section: list, seconds: float):
    """A started timer that, `seconds` from now, prints `result` as the `GPU-RESULT` line with "stopped" naming
    `section[0]` and ends the process with status 3 (a thread: it fires while the main one waits in XLA)."""
    import threading

    def fire():
        print("\nGPU-RESULT " + json.dumps({**result, "stopped": f"time limit reached during {section[0]}"},
                                           default=str), flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def step_figures(config, n_devices: int, device, step_s: float, ceiling: float) -> dict:
    """Throughput and utilisation of one timed step of `config` on `n_devices`: model FLOPs (no recompute) for
    TFLOP/s and MFU, matmul FLOPs with the remat recompute for HFU; None for the ratios without a datasheet peak."""
    from jaxpar import flops
    from jaxpar.config import resolve_attention

    m, t = config.model, config.train
    tokens = t.batch_size * t.seq_len
    attention = resolve_attention(m, device).attention  # the kernel the run used ('auto' resolved)
    peak = flops.training_peak(m, t.seq_len, device)  # (FP8 rows: the mix of FP8 and bf16 peaks their FLOPs run at)
    util = flops.utilisation(flops.train_flops_per_token(m, t.seq_len) * tokens, step_s, n_devices, peak)
    full = attention != "cudnn"  # XLA computes the whole score square; cuDNN flash attention skips masked tiles
    hw = flops.hardware_flops_per_token(m, t.seq_len, remat=config.parallel.remat, full_attention=full) * tokens
    return {"attention": attention, "peak_tflops": peak / 1e12 if peak else None, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "tflops_per_device": util["tflops_per_device"], "mfu": util.get("mfu"),
            "mfu_vs_ceiling": util["tflops_per_device"] * 1e12 / ceiling,
            "hfu": hw / step_s / n_devices / peak if peak else None}


def pct(x) -> str:
    return "n/a (no datasheet peak for this device)" if x is None else f"{100 * x:.1f}%"


def one_gpu_rows(name: str, load, time_steps, device, ceiling: float, estimate_s: float, left) -> dict:
    """Section 3b: {'model': name, its shape, 'rows': [one per (remat, matmul) in ROWS]}. `load(remat, more)` gives
    the config with the overrides `more` added,
    `time_steps(config)` its (compiled step, compile s, median step s, losses) on `device` alone. A row starts only
    while `left()` less `estimate_s` (the last build-compile-and-time's wall) keeps ROWS_LEFT_S; a row skipped for
    time, or that does not fit or fails, holds 'skipped' with the reason."""
    from jaxpar.analysis.hlo import memory
    from jaxpar.model import count_params

    short = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    out, rows, more = {"model": name}, [], []
    for remat, matmul in ROWS:
        label, kind = f"remat {remat}" + ("" if matmul == "float" else f", {matmul}"), [f"model.matmul={matmul}"]
        if left() - estimate_s < ROWS_LEFT_S:
            rows.append({"remat": remat, "matmul": matmul,
                         "skipped": f"{left():.0f} s left, a row takes ~{estimate_s:.0f} s and "
                                    f"{ROWS_LEFT_S} s are kept for decoding and the planner"})
            print(f"one GPU, {label}: skipped ({rows[-1]['skipped']})", flush=True)
            continue
        start = time.perf_counter()
        config = load(remat, more + kind)
        if "params" not in out:
            m, t = config.model, config.train
            out.update(params=count_params(m), heads=[m.n_heads, m.head_dim], seq_len=t.seq_len,
                       batch_per_device=t.batch_size, dtype=m.dtype, layout=dict(data=1, tensor=1, pipe=1))
            print(f"one GPU (data=1 tensor=1 pipe=1), {name}: {out['params'] / 1e6:,.1f}M params, {m.n_heads} "
                  f"heads of {m.head_dim}, seq {t.seq_len}, {t.batch_size} sequences, {m.dtype}", flush=True)
        try:
            try:
                step, compile_s, step_s, losses = time_steps(config)
            except Exception as e:
                if "cudnn" not in str(e).lower() or more:
                    raise
                print(f"cuDNN attention failed ({str(e).splitlines()[0][:200]}); retrying with model.attention=xla",
                      flush=True)
                more.append("model.attention=xla")
                config = load(remat, more + kind)
                step, compile_s, step_s, losses = time_steps(config)
        except Exception as e:  # noqa: BLE001 — a row that does not fit is a result; the next remat may
            why = (f"out of memory at {config.train.batch_size} sequences" if is_oom(e)
                   else f"failed: {' '.join(str(e).split())[:300]}")
            rows.append({"remat": remat, "matmul": matmul, "skipped": why})
            print(f"one GPU, {label}: {why}", flush=True)
            estimate_s = max(estimate_s, time.perf_counter() - start)
            continue
        row = {"remat": remat, "matmul": matmul, "compile_s": compile_s,
               **step_figures(config, 1, device, step_s, ceiling),
               "step_memory_gb": memory(step)["peak_bytes"] / 1e9,  # arguments + outputs + temps, compiled
               "loss_first_last": [losses[0], losses[-1]], "fp8_gemms": fp8_gemms(step.as_text())}
        del step
        rows.append(row)
        estimate_s = time.perf_counter() - start
        print(f"one GPU, {label}: compile {compile_s:.1f} s; step {step_s * 1e3:.1f} ms; "
              f"{row['tokens_per_s']:,.0f} tokens/s; {row['tflops_per_device']:.3g} TFLOP/s (model FLOPs); "
              f"MFU {short(row['mfu'])} of the datasheet peak, {short(row['mfu_vs_ceiling'])} of the ceiling; "
              f"HFU {short(row['hfu'])}; peak memory {row['step_memory_gb']:.2f} GB (compiled step); "
              f"attention {row['attention']}; FP8 GEMMs {row['fp8_gemms']}", flush=True)
    return {**out, "rows": rows}


def fp8_gemms(hlo: str) -> int:
    """The matmuls of a compiled program that read float8 operands: dots and (cuBLASLt) custom calls with an
    f8e4m3fn / f8e5m2 operand — what XLA's GPU compiler makes of the quantize–dequantize form; 0 on a CPU, where
    the FP8 recipe is emulated (dequantized operands, float dots)."""
    return sum(1 for line in hlo.splitlines()
               if (" dot(" in line or "custom-call(" in line) and ("f8e4m3fn[" in line or "f8e5m2[" in line))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu.sh")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script end to end")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; dry run 4)")
    parser.add_argument("--batch-per-device", type=int, default=None, help="sequences per device (default 4)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, section.field=value")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    left = lambda: BUDGET_S - (time.perf_counter() - started)  # noqa: E731 — seconds before gpu.sh's timeout
    added = perf.configure_gpu_flags()  # before any backend starts

    import jax
    import jax.numpy as jnp

    from jaxpar import flops
    from jaxpar.analysis.hlo import memory
    from jaxpar.config import load_config
    from jaxpar.train import build_trainer
    from jaxpar.model import count_params

    devices = jax.devices()
    kind = devices[0].device_kind
    print(f"jax {jax.__version__}: {len(devices)} x {kind} ({devices[0].platform}); XLA flags added: "
          f"{' '.join(added) or 'none'}", flush=True)
    if not args.dry_run and devices[0].platform != "gpu":
        print("no GPU visible to JAX: install jax[cuda12] (or carry its wheels, see bench/gpu.sh), or use --dry-run")
        return 2
    result = {"device": kind, "devices": len(devices), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    section = ["the matmul ceiling"]  # what the watchdog names if the time limit comes first
    timer = watchdog(result, section, max(left() - WATCHDOG_LEFT_S, 1.0))

    n, mm_dtype = (512, jnp.float32) if args.dry_run else (8192, jnp.bfloat16)
    ceiling = matmul_ceiling(n, mm_dtype)
    mm_peak = flops.device_peak(devices[0], jnp.dtype(mm_dtype).name)
    result["matmul_ceiling_tflops"] = ceiling / 1e12
    print(f"matmul ceiling: {ceiling / 1e12:.3g} TFLOP/s ({n}^3 {jnp.dtype(mm_dtype).name}); datasheet peak: "
          + (f"{mm_peak / 1e12:.1f} TFLOP/s" if mm_peak else f"none for {kind!r}"), flush=True)

    steps = args.steps or (4 if args.dry_run else 30)
    per_device = args.batch_per_device or (2 if args.dry_run else 4)
    preset = None if args.dry_run else str(ROOT / "configs/llama_1b.py")

    extra = list(args.overrides)

    def time_steps(config, devs=devices, n_steps=steps):
        """(compiled step, compile s, median step s, losses) of `config`'s train step on random tokens."""
        trainer = build_trainer(config, devs)
        batch = trainer.random_batch(config)
        start = time.perf_counter()
        step = trainer.train_step.lower(trainer.state, batch).compile()
        compile_s = time.perf_counter() - start
        state, times, losses = trainer.state, [], []
        for _ in range(n_steps + 1):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - start)
        return step, compile_s, statistics.median(times[1:]), losses  # step 1 may carry one-time work

    def train(per_device: int):
        """(config, compiled step, compile s, median step s, losses) for `per_device` sequences per device."""
        overrides = (TINY if args.dry_run else ONE_B) + [f"train.batch_size={per_device * len(devices)}",
                                                          f"train.steps={steps + 1}"] + extra
        config = load_config(preset, overrides).resolve_for_devices(len(devices))
        return (config, *time_steps(config))

    section[0] = "section 3 (training the ~1B Llama)"
    while True:
        attempt = time.perf_counter()  # section 3b's first estimate: this attempt's build, compile and steps
        try:
            config, step, compile_s, step_s, losses = train(per_device)
            break
        except Exception as e:  # one shot on a lent GPU: retry what can be retried instead of ending the run
            text = str(e)
            if "cudnn" in text.lower() and "model.attention=xla" not in extra:
                print(f"cuDNN attention failed ({text.splitlines()[0][:200]}); retrying with model.attention=xla",
                      flush=True)
                extra.append("model.attention=xla")
            elif is_oom(e) and per_device > 1:
                print(f"out of memory at {per_device} sequences per device; retrying with {per_device // 2}",
                      flush=True)
                per_device //= 2
            else:
                raise
    section_3 = time.perf_counter() - attempt
    m, t = config.model, config.train
    stats = devices[0].memory_stats() or {}
    result.update({
        "params": count_params(m), "seq_len": t.seq_len, "batch_per_device": per_device, "dtype": m.dtype,
        "remat": config.parallel.remat, "compile_s": compile_s,
        **step_figures(config, len(devices), devices[0], step_s, ceiling),
        "loss_first_last": [losses[0], losses[-1]],
        "step_memory_gb": memory(step)["peak_bytes"] / 1e9,  # the compiled step's arguments + outputs + temps
        "peak_memory_gb": stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None,
        "memory_limit_gb": stats["bytes_limit"] / 1e9 if "bytes_limit" in stats else None,
    })
    print(f"model: {result['params'] / 1e6:,.1f}M params, d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
          f"seq {t.seq_len}, {per_device} seq/device, {m.dtype}, attention {result['attention']}\n"
          f"compile {compile_s:.1f} s; step {step_s * 1e3:.1f} ms (median of {steps})\n"
          f"tokens/s: {result['tokens_per_s']:,.0f} ({result['tokens_per_s'] / len(devices):,.0f} per device)\n"
          f"TFLOP/s per device (model FLOPs): {result['tflops_per_device']:.3g}\n"
          f"MFU vs datasheet peak: {pct(result['mfu'])};  vs measured matmul ceiling: "
          f"{pct(result['mfu_vs_ceiling'])};  HFU: {pct(result['hfu'])}\n"
          f"memory per device: the compiled step needs {result['step_memory_gb']:.2f} GB"
          + (f"; device peak in use {result['peak_memory_gb']:.2f} GB of {result['memory_limit_gb']:.1f} GB"
             if result["peak_memory_gb"] is not None and result["memory_limit_gb"] else ""), flush=True)
    del step  # the training executable; the later sections build their own

    # 3b. the llama_1b preset on one device, remat none / dots / full, at section 3's sequences per device
    section[0] = "section 3b (llama_1b on one GPU)"
    row_steps = min(steps, 10)
    base = (TINY if args.dry_run else PRESET) + [f"train.batch_size={per_device}", f"train.steps={row_steps + 1}"]

    def load(remat: str, more: list[str]):
        """The row's config: the layout and remat last, so they win over any override given for section 3."""
        return load_config(preset, base + extra + more + ONE_GPU + [f"parallel.remat={remat}"])

    try:
        name = "tiny stand-in" if args.dry_run else "configs/llama_1b.py"
        result["one_gpu"] = one_gpu_rows(name, load, lambda c: time_steps(c, devices[:1], row_steps), devices[0],
                                         ceiling, section_3, left)
    except Exception as e:  # noqa: BLE001 — keep every figure above whatever happens here
        result["one_gpu"] = f"failed: {' '.join(str(e).split())[:300]}"
        print(f"one-GPU section failed: {result['one_gpu']}", flush=True)

    section[0] = "section 4 (decoding)"
    if left() < DECODE_LEFT_S:
        result["decode"] = f"skipped: {left():.0f} s left, decoding starts only with {DECODE_LEFT_S} s"
        print(f"decode section {result['decode']}", flush=True)
    else:
        try:
            result["decode"] = decode_speed(m, devices, args.dry_run)
        except Exception as e:  # noqa: BLE001 — one shot on a lent GPU: keep the training figures whatever happens
            result["decode"] = f"failed: {' '.join(str(e).split())[:300]}"
            print(f"decode section failed: {result['decode']}", flush=True)

    section[0] = "section 5 (the planner)"
    if left() < PROBE_LEFT_S:
        result["planner"] = f"skipped: {left():.0f} s left, the planner starts only with {PROBE_LEFT_S} s"
        print(f"planner section {result['planner']}", flush=True)
    else:
        try:  # 5. the planner (issue 20): probe, predict the step above, plan the model, run the plan
            result["planner"] = planner_check(config, devices, step_s, result["step_memory_gb"], time_steps,
                                              deadline=started + BUDGET_S - PLAN_LEFT_S)
        except Exception as e:  # noqa: BLE001 — keep every figure above whatever happens here
            result["planner"] = f"failed: {' '.join(str(e).split())[:300]}"
            print(f"planner section failed: {result['planner']}", flush=True)
    timer.cancel()
    print("GPU-RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
