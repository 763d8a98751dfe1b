"""Conversions and checkpoint readers as real concurrent processes (issue 35, items 2 and 7).

- Two `jaxpar convert --to-hf` into the same new directory at once: exactly one succeeds, the other is refused with
  one line (exit 2), and the directory holds exactly the winner's files — never a mix.
- Readers racing a trainer that saves every step and keeps one (`checkpoint.every=1 keep=1`): every read succeeds,
  on the newest step there is when the one it picked is deleted under it; no traceback, no "no checkpoint restores".
- A workdir whose config.json no longer matches its checkpoints: one line on stderr, nothing else (orbax's background
  threads used to print a dozen tracebacks after it).

The tiny model is the hostile-inputs table's (`ONE`); each test runs in a few tens of seconds on two CPU cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from jaxpar.config import load_config
from jaxpar.train import fit

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_hostile_inputs import ONE  # noqa: E402 — the same tiny model

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", *map(str, args)]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if "Warning" not in line and "warnings.warn" not in line]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("safety") / "trained"
    fit(load_config("configs/tiny.py", ONE + ["train.steps=2"]), workdir, devices=jax.devices()[:1], progress=False)
    return workdir


def test_two_concurrent_exports_into_one_directory_do_not_mix(trained, tmp_path):
    """Item 2: both start before either publishes (the emptiness check passes for both); the rename makes one win."""
    target = tmp_path / "hf"
    # the second export comes from another model (bfloat16), so a mix of the two would show in the files
    procs = [subprocess.Popen(_cli("convert", "--from", trained, "--to-hf", target, *extra), cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--dtype", "bfloat16"])]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    statuses = sorted(rc for rc, _, _ in results)
    assert statuses == [0, 2], results
    rc, _, stderr = next(r for r in results if r[0] == 2)
    lines = _error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("jaxpar: ") and "already holds files" in lines[0], stderr
    assert "Traceback" not in stderr
    winner = 0 if results[0][0] == 0 else 1
    dtype = json.loads((target / "config.json").read_text()).get("dtype") or \
        json.loads((target / "config.json").read_text()).get("torch_dtype")
    assert dtype == ("float32" if winner == 0 else "bfloat16")
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="numpy") as f:  # weights of the same export
        name = next(iter(f.keys()))
        assert str(f.get_slice(name).get_dtype()) == ("F32" if winner == 0 else "BF16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left beside it
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {oct(0o666 & ~mask)}  # item 16
    assert oct(target.stat().st_mode & 0o777) == oct(0o777 & ~mask)


def test_two_concurrent_converts_into_one_workdir_do_not_mix(trained, tmp_path):
    """Item 2 for `--to DIR`: the params-only workdir is published with one rename too."""
    target = tmp_path / "w"
    procs = [subprocess.Popen(_cli("convert", "--from", trained, "--to", target, *extra), cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--quantize", "int8"])]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    rc, _, stderr = next(r for r in results if r[0] == 2)
    lines = _error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("jaxpar: ") and "Traceback" not in stderr, stderr
    winner = 0 if results[0][0] == 0 else 1
    weights = json.loads((target / "config.json").read_text())["model"]["weights"]
    assert weights == ("float" if winner == 0 else "int8")
    assert [p.name for p in (target / "checkpoints").iterdir()] == ["2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


READER = textwrap.dedent("""
    import json, pathlib, sys, time, warnings
    from jaxpar.store import checkpoint

    workdir, done = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    real, raced = checkpoint._superseded, []

    def superseded(*args):
        raced.append(real(*args))
        return raced[-1]

    checkpoint._superseded = superseded
    # a finalized step: orbax writes "<step>.orbax-checkpoint-tmp-…" first, and renames it to "<step>" when done (a
    # reader started at the tmp directory finds no checkpoint yet — the race this test is about is the cleanup's)
    while not any(p.name.isdigit() for p in (workdir / "checkpoints").glob("[0-9]*")):
        time.sleep(0.05)
    ok, errors, steps = 0, [], set()
    while not done.exists():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _, _, step = checkpoint.read_canonical(workdir)
            ok += 1
            steps.add(step)
            errors += [f"warning: {w.message}" for w in caught if "damaged" in str(w.message)]
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"ok": ok, "errors": errors, "steps": len(steps), "restarts": sum(raced)}))
""")


def test_readers_racing_the_trainers_cleanup_read_the_newest_step(tmp_path):
    """Item 7: a trainer saving every step and keeping one, a reader reading in a loop, and `jaxpar convert` runs,
    all at once. Every read succeeds, and none warns of damage (a deleted step is not a damaged one)."""
    workdir, done = tmp_path / "w", tmp_path / "done"
    overrides = [f"--config.{o}" for o in ONE + ["train.steps=60", "checkpoint.every=1", "checkpoint.keep=1",
                                                 "train.log_every=1000"]]
    trainer = subprocess.Popen(_cli("train", "--no-progress", "--config", "configs/tiny.py", "--workdir", workdir,
                                    *overrides), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(workdir), str(done)], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    converts = []
    try:
        while not any((workdir / "checkpoints").glob("[0-9]*")) and trainer.poll() is None:
            time.sleep(0.05)
        for i in range(2):  # the CLI, as a user runs it while the trainer saves
            out = subprocess.run(_cli("convert", "--from", workdir, "--to", tmp_path / f"out{i}"), cwd=ROOT, env=ENV,
                                 capture_output=True, text=True, timeout=300)
            converts.append((out.returncode, out.stderr, trainer.poll()))
        assert trainer.wait(timeout=300) == 0, trainer.communicate()[1][-3000:]
    finally:
        done.touch()
        if trainer.poll() is None:
            trainer.kill()
    stdout, stderr = reader.communicate(timeout=300)
    assert reader.returncode == 0, stderr[-3000:]
    # nothing of orbax's aftermath either: no traceback, no asyncio/absl error lines, no never-awaited coroutine
    assert "Traceback" not in stderr and "ERROR:" not in stderr and "never awaited" not in stderr, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["errors"] == [], "\n".join(summary["errors"])
    assert summary["ok"] >= 3 and summary["steps"] >= 2, summary  # it read while the trainer moved on
    for rc, err, _ in converts:
        assert rc == 0 and "Traceback" not in err and "ERROR:" not in err, err[-3000:]
    print(summary, [c[2] for c in converts])


def test_a_config_that_no_longer_matches_its_checkpoints_is_one_line(trained, tmp_path):
    """Item 8: the shapes are checked against the step's metadata before orbax restores anything, so stderr holds
    the one line and nothing else (no event-loop or TensorStore traceback, no `strict=False` advice)."""
    import shutil

    workdir = tmp_path / "w"
    shutil.copytree(trained, workdir)
    saved = json.loads((workdir / "config.json").read_text())
    saved["model"]["d_model"] = 32
    (workdir / "config.json").write_text(json.dumps(saved))
    for args in (["convert", "--from", workdir, "--to", tmp_path / "out"],
                 ["generate", "--workdir", workdir, "--max-new-tokens", "2"]):
        out = subprocess.run(_cli(*args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("jaxpar: "), out.stderr[-3000:]
        assert "config.json does not match its checkpoints" in out.stderr and "strict" not in out.stderr
    assert not (tmp_path / "out").exists()


def test_staged_publication_is_atomic_and_exclusive(tmp_path):
    """Item 2's mechanism, deterministically: two writers that both passed the emptiness check; the first rename
    publishes, the second is refused (OutputError) and the first's files stay. An existing empty directory is taken
    over; modes are a plain mkdir's and open's (item 16)."""
    from jaxpar.errors import OutputError
    from jaxpar.store.lock import Staged, umask

    target = tmp_path / "out"
    target.mkdir()  # empty: may be written
    first, second = Staged(target), Staged(target)
    a, b = first.__enter__(), second.__enter__()
    (a / "config.json").write_text("first\n")
    (b / "config.json").write_text("second\n")
    first.__exit__(None, None, None)
    with pytest.raises(OutputError, match="written while this conversion ran"):
        second.__exit__(None, None, None)
    assert (target / "config.json").read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # both temporary directories are gone
    mask = umask()
    assert oct((target / "config.json").stat().st_mode & 0o777) == oct(0o666 & ~mask)
    assert oct(target.stat().st_mode & 0o777) == oct(0o777 & ~mask)
    with pytest.raises(RuntimeError), Staged(tmp_path / "failed") as tmp:  # a writer that fails publishes nothing
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _snapshot(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_refused_conversions_change_nothing(trained, tmp_path):
    """Item 1: a user's config.json, a run killed before its first save, a Hugging Face directory converted into
    itself, and the source workdir: each refused before anything is read, every byte as it was."""
    import shutil

    from jaxpar.errors import JaxparError
    from jaxpar.interop import hf
    from jaxpar.store import checkpoint

    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text('{"my": 1}\n')
    unsaved = tmp_path / "unsaved"
    shutil.copytree(trained, unsaved)
    shutil.rmtree(unsaved / "checkpoints")
    model = tmp_path / "model"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "llama", model)
    calls = [(own, lambda: checkpoint.convert(trained, own)),
             (unsaved, lambda: checkpoint.convert(trained, unsaved)),
             (own, lambda: hf.import_to_workdir(model, own)),
             (model, lambda: hf.import_to_workdir(model, model)),
             (model, lambda: hf.import_to_workdir(model, model / "w")),
             (trained, lambda: checkpoint.convert(trained, trained / "copy")),
             (model, lambda: hf.export_workdir(trained, model))]
    for directory, call in calls:
        before = _snapshot(directory)
        with pytest.raises(JaxparError):
            call()
        assert _snapshot(directory) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "own", "unsaved"]  # no temporary left
