"""Where metrics go: WORKDIR/metrics.jsonl (one JSON object per logged step), TensorBoard event files, and a progress
bar. Only process 0 writes (the others would write the same numbers). `StepProfiler`: a `jax.profiler` trace of a
few steps into WORKDIR/profile."""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np

from jaxpar.errors import OutputError
from tqdm import tqdm  # plain text bar: works in terminals, logs and notebooks (no ipywidgets)


def _supersede(path: pathlib.Path, initial_step: int) -> None:
    """Move the records of metrics.jsonl with step > initial_step to metrics.superseded.jsonl (atomic rewrite)."""
    if not path.is_file():
        return
    keep, later = [], []
    original = path.read_bytes().decode("utf-8", errors="replace")  # a damaged line is superseded, not fatal
    text = original + "\n" if original and not original.endswith("\n") else original  # a cut-short last line
    # must not run into the next run's first record
    for line in text.splitlines(keepends=True):
        try:
            step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):  # a line cut short by a crash: superseded too
            step = initial_step + 1
        (later if not isinstance(step, int) or step > initial_step else keep).append(line)
    if not later and text == original:
        return
    with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
        f.writelines(later)  # every line ends with a newline: `text` does
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def _value(v) -> float | list[float]:
    """A metric as JSON: a float, or a list of floats for an array of several values."""
    a = np.asarray(v)
    return [float(x) for x in a.ravel()] if a.size > 1 else float(a)


class MetricsWriter:
    """Process 0's metrics: one JSON object per logged step in WORKDIR/metrics.jsonl, TensorBoard scalars, and the
    progress bar. Other processes write nothing.

    A run that resumes at `initial_step` first moves the records of later steps — work of a run that crashed or fell
    back before saving it, which this run is about to redo — to metrics.superseded.jsonl, so metrics.jsonl stays one
    record per step in order and nothing logged is lost."""

    def __init__(self, workdir: str | pathlib.Path, total_steps: int, initial_step: int = 0, progress: bool = True):
        self.active = jax.process_index() == 0
        self.workdir = pathlib.Path(workdir)
        self._jsonl = self._tb = self._bar = None
        if not self.active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "metrics.jsonl"
        try:
            _supersede(path, initial_step)
            self._jsonl = open(path, "a")
        except OSError as e:
            raise OutputError(f"{path} cannot be written ({e.strerror or e}); it must be a regular file") from None
        from tensorboardX import SummaryWriter  # imported lazily: it is slow to import

        self._tb = SummaryWriter(str(self.workdir / "tensorboard"))
        if progress:
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's scalar metrics everywhere."""
        if not self.active:
            return
        # Scalars, and per-expert lists (moe_load: one count per expert) written as JSON lists.
        record = {"step": step, **{k: _value(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in record.items():
            if k != "step" and not isinstance(v, list):
                self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            shown = {k: f"{record[k]:.4g}" for k in ("loss", "eval_loss", "tokens_per_sec", "step_time_s",
                                                      "tflops_per_device", "mfu", "moe_imbalance", "moe_dropped")
                     if k in record}
            self._bar.set_postfix(shown, refresh=False)

    def advance(self, n: int = 1) -> None:
        """Move the progress bar by n steps."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Flush and close the files and the bar."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._jsonl.close()


class StepProfiler:
    """Traces steps first … first + count − 1 with `jax.profiler` into WORKDIR/profile (TensorBoard's profile plugin
    or Perfetto read it). `before(step)` / `after(step, state)` bracket each step; `after` waits for the traced
    steps' device work before stopping, so the trace holds them whole. count 0: does nothing."""

    def __init__(self, workdir: str | pathlib.Path, first: int, count: int):
        self.dir, self.first, self.last = pathlib.Path(workdir) / "profile", first, first + count - 1
        self.active = False
        self.enabled = count > 0

    def before(self, step: int) -> None:
        """Start the trace when `step` is the first traced one."""
        if self.enabled and step == self.first:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def after(self, step: int, state) -> None:
        """Stop the trace after the last traced step, once its work has finished."""
        if self.active and step >= self.last:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stop a trace still running (the run ended inside the traced steps)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
