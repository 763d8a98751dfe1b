"""Crashes, preemption, damaged files and non-finite steps: the last good state is never lost or poisoned."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.model import abstract_model
from jaxpar.store.checkpoint import restore_params
from jaxpar.train import build_trainer, fit
from jaxpar.train.loop import TrainingDiverged

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
SMALL = ["model.d_model=32", "train.batch_size=16", "train.seq_len=32", "train.log_every=1", "train.eval_every=0",
         "train.eval_batches=1", "train.warmup_steps=2", "checkpoint.every=2"]


@pytest.fixture(autouse=True, scope="module")
def compile_once(tmp_path_factory):
    """The subprocess runs here compile the same steps again and again (an uninterrupted run, the one killed, its
    resume): JAX's persistent compilation cache, one per module run, compiles each program once. The runs do not
    read their compiled programs (what a cache hit could change), only train."""
    ENV["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    yield
    ENV.pop("JAX_COMPILATION_CACHE_DIR")


def train_cmd(workdir, steps):
    overrides = [f"--config.{o}" for o in SMALL + [f"train.steps={steps}"]]
    return [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.py", "--workdir", str(workdir),
            "--no-progress", *overrides]


def final_params(workdir):
    """Canonical parameters of the newest checkpoint, on the host."""
    cfg = load_config("configs/tiny.py", SMALL)
    _, abstract = abstract_model(cfg.model)
    from jaxpar.plan import make_plan

    params, step = restore_params(workdir, abstract, make_plan(cfg.model),
                                  cfg.model.vocab_size)
    return step, jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def final_state(workdir, steps):
    """The whole train state of the newest checkpoint — step, parameters, Adam's moments and counts — restored onto
    the run's own layout and canonical on the host (test_checkpoint.canonical_state)."""
    from test_checkpoint import canonical_state

    from jaxpar.store import checkpoint

    config = load_config("configs/tiny.py", SMALL + [f"train.steps={steps}"]).resolve_for_devices(8)
    like = build_trainer(config, jax.devices(), abstract=True)
    mngr = checkpoint.manager(workdir)
    try:
        state, _ = checkpoint.restore_train(mngr, like.state, like.shardings, like.plan, config.model.vocab_size)
    finally:
        mngr.close()
    return canonical_state(state, config, like.mesh)


def wait_for_metrics(workdir, lines, proc, timeout=600):
    deadline = time.time() + timeout
    path = workdir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"training never logged {lines} steps")


def test_sigkill_at_a_random_moment_then_resume_is_bitwise_equal(tmp_path):
    """SIGKILL at a random moment — after a random number of logged steps, at least 5 before the end, plus a random
    part of the time one more takes (mid-step, mid-async-save, …) — that must land while the run is going; resuming
    then ends with the train state of an uninterrupted run, bit for bit: parameters, both Adam moments, the step."""
    steps = 30
    whole = subprocess.run(train_cmd(tmp_path / "whole", steps), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]

    killed = tmp_path / "killed"
    rng = random.Random(os.getpid())
    logged = rng.randint(3, steps - 5)
    proc = subprocess.Popen(train_cmd(killed, steps), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_metrics(killed, logged - 1, proc)
    start = time.perf_counter()
    wait_for_metrics(killed, logged, proc)
    one_step = time.perf_counter() - start  # wall time from one logged step to the next, saves included
    # A random part of it — but never into the run's last steps: an early step's time (the first evaluation, a busy
    # machine) can exceed what all the remaining ones take (30 of 30 steps logged before the kill, seen on a loaded machine).
    deadline, metrics = time.perf_counter() + rng.uniform(0.0, one_step), killed / "metrics.jsonl"
    while time.perf_counter() < deadline and len(metrics.read_text().splitlines()) < steps - 3:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=600)  # a safety net: SIGKILL cannot be caught
    assert proc.returncode == -signal.SIGKILL  # killed, not exited by itself
    done = len((killed / "metrics.jsonl").read_text().splitlines())
    print(f"killed after {done} of {steps} steps logged (waited for {logged}, then up to {one_step:.2f} s)")
    assert logged <= done < steps  # the kill interrupted the run before its last step

    resumed = subprocess.run(train_cmd(killed, steps), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # Every step the killed run left listed restored: a save the kill interrupted was never listed as a step (had it
    # been, the resume would have moved it aside as damaged and retrained it — bitwise equal, but not this promise).
    assert not (killed / "damaged-checkpoints").exists(), resumed.stderr[-2000:]
    from test_checkpoint import assert_states_equal

    want, got = final_state(tmp_path / "whole", steps), final_state(killed, steps)
    assert int(want["step"]) == int(got["step"]) == steps
    assert_states_equal(got, want)  # every leaf by name: params, opt_state ….mu / ….nu (checked present), counts


def test_sigterm_and_sigint_save_and_exit_cleanly(tmp_path):
    """SIGTERM (a preemption notice) stops a run with a checkpoint of the step it reached and exit 0; the same
    command resumes from it, and SIGINT (Ctrl-C) then does the same at a later step (the second process compiles
    nothing: the module's compilation cache)."""
    workdir, stopped = tmp_path / "run", 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen(train_cmd(workdir, 400), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wait_for_metrics(workdir, stopped + 3, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=600)  # a safety net: "preempted at step" and step < 400 show it stopped
        assert proc.returncode == 0, (sig, err[-2000:])
        assert "preempted at step" in out, (sig, out[-2000:])
        step = int(out.split("preempted at step ")[1].split(":")[0])
        assert stopped + 3 <= step < 400, (sig, stopped, step)  # the second run resumed from the first's save
        assert final_params(workdir)[0] == step  # the checkpoint is the step it stopped at
        stopped = step


def test_keep_newest_plus_permanent_ones(tmp_path):
    config = load_config("configs/tiny.py", SMALL + ["train.steps=6", "checkpoint.every=1", "checkpoint.keep=1",
                                                     "checkpoint.permanent_every=4"])
    fit(config, tmp_path, progress=False)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 6]  # the newest, plus every multiple of 4


def test_truncated_checkpoint_falls_back_to_previous_step(tmp_path):
    config = load_config("configs/tiny.py", SMALL + ["train.steps=4", "checkpoint.keep=5"])
    fit(config, tmp_path, progress=False)
    files = sorted((tmp_path / "checkpoints" / "4" / "params").rglob("*"), key=lambda p: p.stat().st_size)
    victim = [f for f in files if f.is_file()][-1]  # the largest data file of the newest step
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.warns(UserWarning, match="checkpoint step 4 .* is damaged .*fell back to step 2"):
        step, _ = final_params(tmp_path)
    assert step == 2


def test_non_finite_update_is_skipped_and_state_kept():
    config = load_config("configs/tiny.py", SMALL + ["train.lr=1e30", "train.warmup_steps=0"])
    config = config.resolve_for_devices(8)
    trainer = build_trainer(config, jax.devices())
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.params))
    rows = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    state, metrics = trainer.train_step(trainer.state, trainer.put(rows))
    assert int(metrics["skipped"]) == 1 and int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.to_pure_dict(state.params)), before)


def test_consecutive_bad_steps_stop_the_run_without_a_checkpoint(tmp_path):
    config = load_config("configs/tiny.py", SMALL + ["train.lr=1e30", "train.warmup_steps=0", "train.steps=20",
                                                     "train.max_bad_steps=3"])
    with pytest.raises(TrainingDiverged, match=r"steps 1\.\.3 .*train.max_bad_steps = 3"):
        fit(config, tmp_path, progress=False)
    # checkpoint.every = 2 saved step 2 during the bad streak: it holds the untouched (finite) parameters.
    step, params = final_params(tmp_path)
    assert step == 2 and all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["skipped_steps"] >= 1
