"""The command line, as a user runs it: the README's demo command (at reduced steps) and clean config errors."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_demo_command_trains_and_samples(tmp_path):
    """`make demo` as in the README, shortened: train tiny on 8 devices, then print a sample."""
    workdir = tmp_path / "demo"
    args = ("--no-progress --config.train.steps=12 --config.train.eval_every=6 --config.train.log_every=6 "
            "--config.train.warmup_steps=2")
    out = subprocess.run(["make", "demo", f"DEMO_DIR={workdir}", f"DEMO_ARGS={args}"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 12 and "eval_loss" in records[-1]
    config = json.loads((workdir / "config.json").read_text())
    assert [config["parallel"][k] for k in ("data", "pipe", "tensor")] == [2, 2, 2]
    assert "def " in out.stdout and "-" * 40 in out.stdout  # the prompt echoed with its sample


def test_config_error_is_one_clean_line_with_exit_status_2(tmp_path):
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.py", "--config.parallel.tensor=3",
           "--workdir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tensor" in lines[0] and "Fix:" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_mesh_product_error_names_data(tmp_path):
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.py", "--config.parallel.data=3",
           "--workdir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "parallel.data" in out.stderr and "8 available devices" in out.stderr, out.stderr
    assert not (tmp_path / "checkpoints").exists()  # failed before anything was written


def test_schedule_command_prints_grid_and_draws(tmp_path):
    png = tmp_path / "schedule.png"
    cmd = [sys.executable, "-m", "jaxpar.cli", "schedule", "--pipe", "2", "--repeats", "2", "--microbatches", "4",
           "--png", str(png)]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "stage1   - 0.0 1.0 2.0 3.0 0.1 1.1 2.1 3.1" in out.stdout
    assert "bubble (p − 1)/(v·m + p − 1) = 0.111" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(cmd[:-2] + ["--microbatches", "3"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert bad.returncode == 2 and "parallel.microbatches" in bad.stderr
