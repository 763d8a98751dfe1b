"""Nothing lost, nothing silent: the workdir lock, damaged steps moved aside and saved again, checksums that catch
bit rot in real orbax files, and resumes whose config no longer matches the checkpoints."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ConfigError, load_config
from jaxpar.errors import CheckpointError, WorkdirLocked
from jaxpar.model import abstract_model
from jaxpar.plan import make_plan
from jaxpar.store import checkpoint
from jaxpar.store.checkpoint import restore_params
from jaxpar.store.fingerprint import fingerprints
from jaxpar.store.lock import WorkdirLock
from jaxpar.train import fit
from jaxpar.train.loop import TrainingDiverged

ROOT = pathlib.Path(__file__).resolve().parent.parent
# One device and a 2-layer model of odd width: every run here compiles in seconds.
ONE = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1", "parallel.microbatches=1",
       "model.d_model=40", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "train.batch_size=6",
       "train.seq_len=24", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=2",
       "data.source=synthetic"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def run_fit(workdir, *overrides):
    return fit(load_config("configs/tiny.py", ONE + list(overrides)), workdir, devices=jax.devices()[:1],
               progress=False)


def params_of(workdir, step=None):
    cfg = load_config("configs/tiny.py", ONE)
    _, abstract = abstract_model(cfg.model)
    params, at = restore_params(workdir, abstract, make_plan(cfg.model),
                                cfg.model.vocab_size, step=step)
    return at, jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def cli(workdir, *overrides, steps=6):
    args = [f"--config.{o}" for o in ONE + [f"train.steps={steps}", "checkpoint.every=1", *overrides]]
    return [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.py", "--workdir", str(workdir),
            "--no-progress", *args]


def data_files(step_dir):
    """The array data files of one checkpoint item, largest first (orbax OCDBT: d/<hash> files)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


# ---------------------------------------------------------------------------------------------------------------------
# The lock


def test_second_writer_is_refused_and_a_killed_holder_does_not_block(tmp_path):
    """Two real processes on one workdir: the second gets one line naming the holder; after the holder is killed
    (its flock dies with it) the next run takes the workdir and resumes."""
    first = subprocess.Popen(cli(tmp_path, steps=100000), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (tmp_path / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert first.poll() is None, first.stderr.read()[-2000:]
        second = subprocess.run(cli(tmp_path, "train.lr=1e-4"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.pid}" in lines[0] and "workdir locked" in lines[0], lines[0]
        with pytest.raises(WorkdirLocked, match=f"pid {first.pid}"):  # the Python API: the same refusal, typed
            run_fit(tmp_path, "train.steps=3")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL  # killed mid-run: it never finished on its own
    killed_at = checkpoint.manager(tmp_path).latest_step()
    result = run_fit(tmp_path, f"train.steps={(killed_at or 0) + 2}", "checkpoint.every=1")
    assert int(result.state.step) == (killed_at or 0) + 2


def test_lock_is_released_when_the_run_ends(tmp_path):
    run_fit(tmp_path, "train.steps=1")
    with WorkdirLock(tmp_path):  # free again, and informational contents were cleared
        pass
    assert (tmp_path / ".lock").read_text() == ""


# ---------------------------------------------------------------------------------------------------------------------
# Damage: moved aside, trained again, saved again


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """6 steps, a checkpoint after each; the pristine copy of the workdir and its final parameters."""
    workdir = tmp_path_factory.mktemp("six")
    run_fit(workdir, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10")
    return workdir, params_of(workdir)[1]


def copy_of(src, dst):
    import shutil

    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def test_deleted_file_step_is_moved_aside_retrained_and_saved(six_steps, tmp_path):
    pristine, final = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    victim = data_files(workdir / "checkpoints" / "6" / "params")[0]
    victim.unlink()
    with pytest.warns(UserWarning, match=r"checkpoint step 6 .* is damaged .*moved to .*damaged-checkpoints/6-"):
        run_fit(workdir, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10")
    moved = list((workdir / "damaged-checkpoints").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("6-") and (moved[0] / "params").is_dir()  # kept, not deleted
    step, again = params_of(workdir)  # step 6 exists again, restores cleanly, and equals the uninterrupted run's
    assert step == 6
    jax.tree.map(np.testing.assert_array_equal, again, final)


def flip(file, offset_fraction=0.5, n=8):
    data = bytearray(file.read_bytes())
    at = int(len(data) * offset_fraction)
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("item", ["params", "train"])
def test_flipped_bytes_fail_checksums_and_fall_back(six_steps, item, tmp_path):
    """Real flipped bytes inside a real orbax data file (uncompressed chunks: the flip still decodes, as wrong
    numbers) are caught by the checksums: the step and the array are named and the previous step is used."""
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    flip(data_files(workdir / "checkpoints" / "6" / item)[0])
    with pytest.warns(UserWarning, match=r"checkpoint step 6 .* is damaged") as caught:
        result = run_fit(workdir, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10")
    assert int(result.state.step) == 6
    message = " ".join(str(w.message) for w in caught)
    assert f"({item}/" in message and "fail their checksums" in message, message  # values changed, still decoded


def test_silent_value_change_is_caught_by_the_checksum(six_steps, tmp_path):
    """The values of one stored array change but still decode (what bit rot in an uncompressed chunk does): only the
    checksum can notice, and it names the array."""
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    sums_file = workdir / "checkpoints" / "6" / "checksums" / "metadata"
    sums = json.loads(sums_file.read_text())
    sums["params"]["blocks/wq"]["fp"] = "0" * 16  # same effect as changing wq's bytes: stored ≠ restored
    sums_file.write_text(json.dumps(sums))
    with pytest.warns(UserWarning, match=r"step 6 .* is damaged \(params/blocks/wq fail their checksums\)"):
        step, _ = params_of(workdir)
    assert step == 5
    assert (workdir / "checkpoints" / "6").is_dir()  # a reader falls back but moves nothing
    with pytest.raises(CheckpointError, match=r"step 6 .* is damaged .*params/blocks/wq"):
        params_of(workdir, step=6)  # a named step does not fall back


def test_fingerprint_is_layout_independent_and_sees_one_ulp():
    from jax.sharding import NamedSharding, PartitionSpec as P

    x = np.random.default_rng(0).standard_normal((7, 10, 6)).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharded = jax.device_put(x, NamedSharding(mesh, P(None, "a", None)))
    assert fingerprints({"x": x}) == fingerprints({"x": sharded})
    y = x.copy()
    y[6, 9, 5] = np.nextafter(y[6, 9, 5], np.float32(np.inf))
    assert fingerprints({"x": y}) != fingerprints({"x": x})
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprints({"x": swapped}) != fingerprints({"x": x})


def test_a_save_orbax_declines_is_an_error(six_steps, tmp_path):
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    cfg = load_config("configs/tiny.py", ONE).resolve_for_devices(1)
    from jaxpar.train import build_trainer

    trainer = build_trainer(cfg, None)
    state = trainer.state.replace(step=trainer.state.step + 3)  # step 3 already exists
    mngr = checkpoint.manager(workdir, keep=10)
    with pytest.raises(CheckpointError, match="step 3 .* was not saved"):
        checkpoint.save(mngr, state, {"grain": {}}, trainer.plan, cfg.to_dict())
    mngr.close()


# ---------------------------------------------------------------------------------------------------------------------
# Resuming with another config


@pytest.mark.parametrize("override, field", [("model.d_model=48", "model.d_model"),
                                             ("train.seq_len=16", "train.seq_len"),
                                             ("train.batch_size=12", "train.batch_size")])
def test_resume_with_an_incompatible_config_names_the_fields(six_steps, override, field, tmp_path):
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    with pytest.raises(ConfigError, match=rf"^{field} = .*differs from the checkpoints.*Fix: ") as err:
        run_fit(workdir, "train.steps=8", override)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == \
        sorted(p.name for p in (pristine / "checkpoints").iterdir())  # nothing moved aside or rewritten
    assert not (workdir / "damaged-checkpoints").exists()


def test_resume_may_change_layout_budget_and_numerics(six_steps, tmp_path):
    """… and the matmul precision: a float checkpoint resumes in FP8 (model.matmul, jaxpar.fp8: no state of its
    own) and back."""
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    result = run_fit(workdir, "train.steps=7", "train.lr=1e-3", "model.attention=xla", "checkpoint.keep=10",
                     "model.matmul=fp8_rowwise")
    assert int(result.state.step) == 7 and result.config.model.matmul == "fp8_rowwise"
    result = run_fit(workdir, "train.steps=8", "checkpoint.keep=10")
    assert int(result.state.step) == 8 and result.config.model.matmul == "float"
    assert all(np.isfinite(h["loss"]) for h in result.history)


# ---------------------------------------------------------------------------------------------------------------------
# Runs that trained nothing


def test_run_whose_every_step_was_skipped_is_not_done(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"every step of this run \(1\.\.3\)"):
        run_fit(tmp_path, "train.steps=3", "train.lr=1e30", "train.warmup_steps=0", "train.max_bad_steps=5")
    assert checkpoint.manager(tmp_path).latest_step() is None  # nothing saved


def test_a_crash_during_hugging_face_export_leaves_nothing_half_written(tmp_path, monkeypatch):
    """The export is written beside its target and moved into place when complete."""
    from jaxpar.interop import hf, safetensors_files

    src = ROOT / "tests" / "fixtures" / "hf" / "llama"
    cfg = hf.model_config(hf.read_config(src), src)
    _, abstract = abstract_model(cfg)
    params = hf.load_params(src, cfg, abstract)
    real, calls = safetensors_files.save_file, []

    def dies_on_second_shard(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors_files, "save_file", dies_on_second_shard)
    with pytest.raises(OSError, match="No space left"):
        hf.save_params(params, cfg, tmp_path / "out", max_shard_bytes=100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the target nor the partial directory
    monkeypatch.setattr(safetensors_files, "save_file", real)
    hf.save_params(params, cfg, tmp_path / "out", max_shard_bytes=100_000)
    assert (tmp_path / "out" / hf.INDEX).is_file() and (tmp_path / "out" / "config.json").is_file()


def test_metrics_of_redone_steps_are_superseded_not_duplicated(six_steps, tmp_path):
    """After a fallback the redone steps are logged once in metrics.jsonl; the lost run's lines move aside."""
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    for step in (6, 5):
        import shutil

        shutil.rmtree(workdir / "checkpoints" / str(step))  # as if the run had died after logging steps 5 and 6
    run_fit(workdir, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10")
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    superseded = [json.loads(line)["step"] for line in (workdir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [5, 6]


def test_when_every_step_fails_nothing_is_moved(six_steps, tmp_path):
    """A failure that hits every step alike points at the reader, not the data: the workdir is left as it is."""
    import shutil

    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    for step in (p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()):
        shutil.rmtree(step / "train")
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="no checkpoint .* restores .*nothing was moved"):
        run_fit(workdir, "train.steps=7", "checkpoint.keep=10")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
    assert not (workdir / "damaged-checkpoints").exists()


def test_deleting_the_checksums_does_not_switch_verification_off(six_steps, tmp_path):
    import shutil

    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    flip(data_files(workdir / "checkpoints" / "6" / "params")[0])
    shutil.rmtree(workdir / "checkpoints" / "6" / "checksums")
    with pytest.warns(UserWarning, match=r"checkpoint step 6 .* is damaged \(the checksums item is missing\)"):
        step, _ = params_of(workdir)
    assert step == 5


def test_importing_into_an_existing_workdir_writes_nothing(six_steps, tmp_path):
    from jaxpar.interop import hf

    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    before = {p.relative_to(workdir): p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        hf.import_to_workdir(ROOT / "tests" / "fixtures" / "hf" / "llama", workdir)
    after = {p.relative_to(workdir): p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before  # (the lock file it took is the only new file, and it is empty)


def test_damaged_metrics_lines_do_not_stop_or_corrupt_a_resume(six_steps, tmp_path):
    pristine, _ = six_steps
    workdir = copy_of(pristine, tmp_path / "w")
    metrics = workdir / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-1] + b"\n\xff\xfe{\"step\": 6, \"lo")  # bad bytes, a cut-short line
    run_fit(workdir, "train.steps=7", "checkpoint.keep=10")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line is JSON again
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
