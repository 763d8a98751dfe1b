"""What a failed orbax restore leaves behind, kept off stderr.

A reader racing a training run's checkpoint cleanup (`checkpoint.keep`) can have the step it restores deleted under
it. `checkpoint.restore_latest_good` then moves on to the newest step — the reader's outcome is right — but orbax's
abandoned reads go on in TensorStore's threads and end as exceptions nobody receives, each printed as a traceback
with a fix (`strict=False`) that is not the user's. `contain_orbax_aftermath` (installed once, by the first reader)
filters exactly those and nothing else: every other unraisable exception, log record and warning is reported as
before.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings


def is_orbax_aftermath(unraisable) -> bool:
    """True for what an orbax restore that failed (a step deleted under a reader) leaves behind: the reads it had
    started go on in TensorStore's threads after orbax closed its event loop, and each one ends as an exception no
    one can receive — RuntimeError('Event loop is closed') from asyncio, or orbax's own read coroutine dropped with
    its error. Python reports those through sys.unraisablehook."""
    exc, obj = unraisable.exc_value, unraisable.object
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        frames = traceback.extract_tb(unraisable.exc_traceback)
        return not frames or frames[-1].name == "_check_closed"
    code = getattr(obj, "cr_code", None)
    return code is not None and "orbax" in code.co_filename


def contain_orbax_aftermath() -> None:
    """Keep the aftermath of a failed restore off stderr (`is_orbax_aftermath`, asyncio's and absl's log lines about
    its abandoned reads and about a step directory that vanished while it was listed, Python's warning about a read
    coroutine never started). The reader's own outcome — the step read, or one CheckpointError
    line — is unaffected, and every other unraisable exception is reported as before."""
    global _HOOKED
    if not _HOOKED:
        previous = sys.unraisablehook

        def hook(unraisable):
            if not is_orbax_aftermath(unraisable):
                previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("absl").addFilter(_vanished_step_filter)
        logging.getLogger("asyncio").addFilter(_abandoned_read_filter)
        warnings.filterwarnings("ignore", r"coroutine '_read_array_index_and_device_put' was never awaited",
                                RuntimeWarning)  # orbax's read of a restore that failed, never started
        _HOOKED = True


_HOOKED = False


def _abandoned_read_filter(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's 'Future exception was never retrieved' about a TensorStore read of a failed restore
    (`is_orbax_aftermath`): its error is the one the restore already reported, or the step's deletion."""
    message = record.getMessage()
    return not ("exception was never retrieved" in message and "tensorstore" in message.lower())


def _vanished_step_filter(record: logging.LogRecord) -> bool:
    """False (drop) for absl's 'Metadata file does not exist' / 'Failed to read Metadata file … No such file' about a
    step a trainer deleted while it was listed."""
    message = record.getMessage()
    return not (("does not exist" in message or "No such file" in message) and "checkpoints" in message)


__all__ = ["contain_orbax_aftermath", "is_orbax_aftermath"]
