"""The benchmark tooling: bench/gpu.sh's dry run, the plain baseline's math, MFU logging and profiling in `fit`,
and the GPU XLA flags (added without clobbering the user's, accepted on CPU)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from bench import plain
from bench.run import _env, format_table
from jaxpar.config import load_config
from jaxpar.train import build_trainer, fit

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONE_DEVICE = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1",
              "parallel.microbatches=1"]
SMALL = ONE_DEVICE + ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                      "train.batch_size=4", "train.seq_len=16", "train.warmup_steps=1"]


def test_gpu_script_dry_run():
    """bench/gpu.sh --dry-run: the GPU script's whole path on CPU with a tiny model, the one-GPU rows (remat none,
    dots, full; FP8 rowwise) and the planner's section included. ~45 s on an idle 2-core VM; the timeouts (gpu.sh's own for a dry
    run, 840 s, and this one) are safety nets for a loaded machine, not limits the test measures."""
    from bench import gpu

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "GPU_BENCH_TIMEOUT_S")}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # one CPU device; unoptimised kernels (tests/conftest.py)
    proc = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", "--steps", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("GPU-RESULT "))
    assert result["device"] == "cpu" and result["mfu"] is None  # no datasheet peak for a CPU
    assert result["tokens_per_s"] > 0 and result["tflops_per_device"] > 0 and result["matmul_ceiling_tflops"] > 0
    assert "MFU vs datasheet peak" in proc.stdout and "stopped" not in result
    one_gpu = result["one_gpu"]  # section 3b: the preset's stand-in on one device at each remat policy
    assert one_gpu["layout"] == {"data": 1, "tensor": 1, "pipe": 1} and one_gpu["params"] == result["params"]
    assert [(row["remat"], row["matmul"]) for row in one_gpu["rows"]] == list(gpu.ROWS), one_gpu["rows"]
    for row in one_gpu["rows"]:
        assert row["tokens_per_s"] > 0 and row["tflops_per_device"] > 0 and row["mfu_vs_ceiling"] > 0, row
        assert row["mfu"] is None and row["hfu"] is None and row["step_memory_gb"] > 0, row
        assert row["fp8_gemms"] == 0, row  # emulated on a CPU: dequantized operands, float dots
    assert "one GPU, remat none, fp8_rowwise: compile" in proc.stdout
    planner = result["planner"]  # section 5: the probe's prediction of the step above, and the planner's own layout
    assert planner["ran"]["predicted_step_s"] > 0 and planner["ran"]["measured_step_s"] == result["step_s"]
    assert planner["planned"]["measured_step_s"] > 0 and planner["planned"]["predicted_gb"] > 0
    heap = planner["heap"]  # where the step's temp allocation goes (analysis.heap), read from a dump of its compile
    assert heap["live"] <= heap["allocation"] and abs(heap["stacked"] / heap["allocation"] - 1) < 0.1, heap


def test_gpu_script_skips_rows_without_time_and_stops_at_its_limit():
    """Section 3b skips a row, with the reason, when the last row's time would eat into the later sections' share,
    records a row that runs out of memory, and retries a cuDNN failure with XLA attention once; with almost no time
    the watchdog prints the figures measured so far as the GPU-RESULT line and exits 3 (the child's 11 s budget is
    the behaviour under test; the 600 s timeout is a safety net)."""
    from bench import gpu

    config = load_config("configs/tiny.py", SMALL)
    load = lambda remat, more: config  # noqa: E731

    def untimed(c):
        raise AssertionError("a row skipped for time was timed")

    def oom(c):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")

    out = gpu.one_gpu_rows("tiny", load, untimed, jax.devices()[0], 1e12, 60.0, lambda: gpu.ROWS_LEFT_S + 30)
    assert [r["remat"] for r in out["rows"]] == [remat for remat, _ in gpu.ROWS]
    assert all("s left" in r["skipped"] for r in out["rows"])
    out = gpu.one_gpu_rows("tiny", load, oom, jax.devices()[0], 1e12, 0.0, lambda: 1e6)
    assert [r["skipped"] for r in out["rows"]] == ["out of memory at 4 sequences"] * len(gpu.ROWS)
    assert out["params"] > 0

    asked = []  # a cuDNN failure is retried once with XLA attention, which the later rows then keep

    def cudnn(c):
        raise RuntimeError("cuDNN fused attention failed")
    out = gpu.one_gpu_rows("tiny", lambda remat, more: asked.append(list(more)) or config, cudnn,
                           jax.devices()[0], 1e12, 0.0, lambda: 1e6)
    kinds = [[f"model.matmul={matmul}"] for _, matmul in gpu.ROWS]
    assert asked == [kinds[0], ["model.attention=xla", *kinds[0]]] + [["model.attention=xla", *k] for k in kinds[1:]]
    assert all(r["skipped"].startswith("failed: cuDNN") for r in out["rows"])

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "GPU_BENCH_TIMEOUT_S": "11"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as gpu.sh's dry run has
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("GPU-RESULT "))
    assert result["device"] == "cpu" and result["stopped"].startswith("time limit reached during "), result


def test_plain_step_matches_jaxpar_step():
    """The benchmark's hand-written baseline computes what jaxpar's single-device step computes."""
    config = load_config("configs/tiny.py", SMALL)
    trainer = build_trainer(config, None)
    step, tx = plain.make_step(config.model, config.train)
    params = plain.params_from_jaxpar(trainer.state.params)
    opt_state, state = tx.init(params), trainer.state
    batches = np.random.default_rng(0).integers(0, 256, (2, 4, 17)).astype(np.int32)
    for batch in batches:
        state, metrics = trainer.train_step(state, batch)
        params, opt_state, loss = step(params, opt_state, batch)
        np.testing.assert_allclose(loss, metrics["loss"], rtol=1e-5)
    # Adam divides by the gradients' own scale, so rounding differences in tiny gradients show in the update.
    np.testing.assert_allclose(params["blocks"]["wq"], state.params["blocks"]["wq"][...], rtol=1e-3, atol=1e-5)


def test_fit_logs_flops_and_writes_a_profile(tmp_path):
    config = load_config("configs/tiny.py", SMALL + ["train.steps=3", "train.log_every=1", "train.eval_every=0",
                                                     "train.eval_batches=1", "train.profile_steps=1",
                                                     "data.source=synthetic"])
    fit(config, tmp_path, devices=jax.devices()[:1], progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["tflops_per_device"] > 0 for r in records)
    assert not any("mfu" in r for r in records)  # a CPU has no peak: achieved FLOP/s only
    assert list((tmp_path / "profile").rglob("*.xplane.pb")), list((tmp_path / "profile").rglob("*"))


def test_gpu_flags_keep_user_settings_and_are_harmless_on_cpu():
    """In a fresh interpreter (XLA reads XLA_FLAGS once): the user's value of a flag wins; nothing is added for a
    CPU platform or once a backend has started; and a CPU run accepts every flag (an unknown one would abort)."""
    code = """
import json, os, warnings
from jaxpar import perf
env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
added = perf.configure_gpu_flags(env)
cpu = perf.configure_gpu_flags({"JAX_PLATFORMS": "cpu"})
os.environ["XLA_FLAGS"] = " ".join(f"--{k}={v}" for k, v in perf.GPU_FLAGS.items())
import jax, jax.numpy as jnp
total = float(jax.jit(lambda x: (x @ x).sum())(jnp.ones((4, 4))))
with warnings.catch_warnings(record=True):
    late = perf.configure_gpu_flags({"JAX_PLATFORMS": "cuda"})
print(json.dumps({"added": added, "flags": env["XLA_FLAGS"], "cpu": cpu, "late": late, "total": total}))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # a safety net: the child runs in seconds
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["total"] == 64.0 and out["cpu"] == [] and out["late"] == []
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out["added"]
    assert not any("triton_gemm" in f for f in out["added"])
    assert out["flags"].startswith("--xla_gpu_enable_triton_gemm=true ")


def test_bench_helpers():
    """Workers get the caller's XLA flags with their own device count; the table aligns its columns."""
    env = _env(8)
    assert env["XLA_FLAGS"].count("--xla_force_host_platform_device_count=") == 1
    assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=8") and env["JAX_PLATFORMS"] == "cpu"
    assert "device_count" not in _env(None)["XLA_FLAGS"]
    rows = [{"section": "s", "case": "c", "measured": "1 ms", "reference": "2 ms", "ratio": 0.5, "note": "n"},
            {"section": "sec", "case": "case", "measured": "10 ms", "reference": "", "ratio": None, "note": ""}]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4 and lines[2].index("1 ms") == lines[3].index("10 ms")


def test_serve_benchmark_quick_run(capsys):
    """bench/serve.py --quick: both modes run the same six requests and give the same tokens (it raises if not);
    the table has a row per mode."""
    from bench import serve

    assert serve.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count(" continuous ") == 2 and out.count(" static ") == 2 and "contiguous cache" in out
