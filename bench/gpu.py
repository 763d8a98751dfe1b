"""The one-shot GPU check that `bench/gpu.sh` runs (see there for usage).

1. XLA's GPU flags (`jaxpar.perf.configure_gpu_flags`), then: does JAX see the GPU(s)?
2. The matmul ceiling: the best TFLOP/s of a large bf16 matmul (n = 8192: 2n³ FLOPs per call), the realistic
   upper bound for a transformer step on this device, beside the datasheet peak.
3. A ~1B Llama (d_model 2048, 16 layers, 16 heads of 128, 8 kv heads, d_ff 8192, vocab 128256 tied, seq 2048, bf16
   compute, fp32 master weights and AdamW state; `configs/llama_1b.py` with 16 heads) trained for `--steps` steps on
   random tokens, data-parallel over the local GPUs; per-step wall times after the compiling step. Printed:
   tokens/s, model TFLOP/s per device (`jaxpar.flops`, causal attention pairs, no recomputation), MFU
   against the datasheet peak and against the measured ceiling, HFU, and peak device memory.
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
`model.attention=xla`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from bench.gpu_plan import planner_check
from jaxpar import perf

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN_BY_S = 330  # seconds into the run after which the planner's layout is not compiled (gpu.sh stops it at 470)
ONE_B = ["model.n_heads=16", "model.head_dim=128", "model.n_kv_heads=8", "parallel.data=-1", "parallel.tensor=1",
         "train.grad_accum=1", "train.warmup_steps=10", "data.source=synthetic"]
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
    from jaxpar.parallel.plan import make_plan

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu.sh")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script end to end")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; dry run 4)")
    parser.add_argument("--batch-per-device", type=int, default=None, help="sequences per device (default 4)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, section.field=value")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    added = perf.configure_gpu_flags()  # before any backend starts

    import jax
    import jax.numpy as jnp

    from jaxpar import flops
    from jaxpar.analysis.hlo import memory
    from jaxpar.config import load_config, resolve_attention
    from jaxpar.train import build_trainer
    from jaxpar.model import count_params

    devices = jax.devices()
    kind = devices[0].device_kind
    print(f"jax {jax.__version__}: {len(devices)} x {kind} ({devices[0].platform}); XLA flags added: "
          f"{' '.join(added) or 'none'}", flush=True)
    if not args.dry_run and devices[0].platform != "gpu":
        print("no GPU visible to JAX: install jax[cuda12] (or carry its wheels, see bench/gpu.sh), or use --dry-run")
        return 2

    n, mm_dtype = (512, jnp.float32) if args.dry_run else (8192, jnp.bfloat16)
    ceiling = matmul_ceiling(n, mm_dtype)
    mm_peak = flops.device_peak(devices[0], jnp.dtype(mm_dtype).name)
    print(f"matmul ceiling: {ceiling / 1e12:.3g} TFLOP/s ({n}^3 {jnp.dtype(mm_dtype).name}); datasheet peak: "
          + (f"{mm_peak / 1e12:.1f} TFLOP/s" if mm_peak else f"none for {kind!r}"), flush=True)

    steps = args.steps or (4 if args.dry_run else 30)
    per_device = args.batch_per_device or (2 if args.dry_run else 4)
    preset = None if args.dry_run else str(ROOT / "configs/llama_1b.py")

    extra = list(args.overrides)

    def time_steps(config):
        """(compiled step, compile s, median step s, losses) of `config`'s train step on random tokens."""
        trainer = build_trainer(config, devices)
        batch = trainer.random_batch(config)
        start = time.perf_counter()
        step = trainer.train_step.lower(trainer.state, batch).compile()
        compile_s = time.perf_counter() - start
        state, times, losses = trainer.state, [], []
        for _ in range(steps + 1):
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

    while True:
        try:
            config, step, compile_s, step_s, losses = train(per_device)
            break
        except Exception as e:  # one shot on a lent GPU: retry what can be retried instead of ending the run
            text = str(e)
            if "cudnn" in text.lower() and "model.attention=xla" not in extra:
                print(f"cuDNN attention failed ({text.splitlines()[0][:200]}); retrying with model.attention=xla",
                      flush=True)
                extra.append("model.attention=xla")
            elif ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()) and per_device > 1:
                print(f"out of memory at {per_device} sequences per device; retrying with {per_device // 2}",
                      flush=True)
                per_device //= 2
            else:
                raise
    m, t = config.model, config.train
    n_params = count_params(m)

    tokens = t.batch_size * t.seq_len
    attention = resolve_attention(m, devices[0]).attention  # the kernel the run used ('auto' resolved)
    peak = flops.device_peak(devices[0], m.dtype)
    util = flops.utilisation(flops.train_flops_per_token(m, t.seq_len) * tokens, step_s, len(devices), peak)
    full = attention != "cudnn"  # XLA computes the whole score square; cuDNN flash attention skips masked tiles
    hw = flops.hardware_flops_per_token(m, t.seq_len, remat=config.parallel.remat, full_attention=full) * tokens
    stats = devices[0].memory_stats() or {}
    result = {
        "device": kind, "devices": len(devices), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
        "params": n_params, "seq_len": t.seq_len,
        "batch_per_device": per_device, "dtype": m.dtype, "attention": attention, "remat": config.parallel.remat,
        "matmul_ceiling_tflops": ceiling / 1e12, "peak_tflops": peak / 1e12 if peak else None,
        "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "tflops_per_device": util["tflops_per_device"], "mfu": util.get("mfu"),
        "mfu_vs_ceiling": util["tflops_per_device"] * 1e12 / ceiling,
        "hfu": hw / step_s / len(devices) / peak if peak else None,
        "loss_first_last": [losses[0], losses[-1]],
        "step_memory_gb": memory(step)["peak_bytes"] / 1e9,  # the compiled step's arguments + outputs + temps
        "peak_memory_gb": stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None,
        "memory_limit_gb": stats["bytes_limit"] / 1e9 if "bytes_limit" in stats else None,
    }
    pct = lambda x: "n/a (no datasheet peak for this device)" if x is None else f"{100 * x:.1f}%"
    print(f"model: {result['params'] / 1e6:,.1f}M params, d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
          f"seq {t.seq_len}, {per_device} seq/device, {m.dtype}, attention {result['attention']}\n"
          f"compile {compile_s:.1f} s; step {step_s * 1e3:.1f} ms (median of {steps})\n"
          f"tokens/s: {result['tokens_per_s']:,.0f} ({result['tokens_per_s'] / len(devices):,.0f} per device)\n"
          f"TFLOP/s per device (model FLOPs): {util['tflops_per_device']:.3g}\n"
          f"MFU vs datasheet peak: {pct(result['mfu'])};  vs measured matmul ceiling: "
          f"{pct(result['mfu_vs_ceiling'])};  HFU: {pct(result['hfu'])}\n"
          f"memory per device: the compiled step needs {result['step_memory_gb']:.2f} GB"
          + (f"; device peak in use {result['peak_memory_gb']:.2f} GB of {result['memory_limit_gb']:.1f} GB"
             if result["peak_memory_gb"] is not None and result["memory_limit_gb"] else ""))
    del step  # the training executable; the decode section builds its own model
    try:
        result["decode"] = decode_speed(m, devices, args.dry_run)
    except Exception as e:  # noqa: BLE001 — one shot on a lent GPU: keep the training figures whatever happens here
        result["decode"] = f"failed: {' '.join(str(e).split())[:300]}"
        print(f"decode section failed: {result['decode']}", flush=True)
    try:  # 5. the planner (issue 20): probe, predict the step above, plan the model, run the plan
        result["planner"] = planner_check(config, devices, step_s, result["step_memory_gb"], time_steps,
                                          deadline=started + PLAN_BY_S)
    except Exception as e:  # noqa: BLE001 — keep every figure above whatever happens here
        result["planner"] = f"failed: {' '.join(str(e).split())[:300]}"
        print(f"planner section failed: {result['planner']}", flush=True)
    print("GPU-RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
