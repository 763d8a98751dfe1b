"""One writer per workdir: an exclusive `flock` on WORKDIR/.lock, held for as long as a run writes there.

Two `jaxpar train` runs on one workdir would interleave their metrics, overwrite each other's config.json and
checkpoints, and race on orbax's temporary directories; whichever saved last would silently win. So a run takes
the lock before it reads or writes anything in the workdir, and a second one is refused with the holder's pid,
host and command line.

Why `flock` and not a pid file: the kernel drops the lock the moment its holder dies (SIGKILL, OOM, a lost node),
so a lock left behind by a killed run never blocks the next one and no one has to guess whether a pid is stale.
The file itself stays (deleting it while another process opens it would let two runs lock two different files);
its contents — who holds it — are informational. On a network filesystem `flock` is only as good as the server's
lock support (NFSv4 and Lustre with `flock` mounts honour it across hosts); where the filesystem refuses locks the
run goes on with a warning that concurrent runs will not be detected.

A multi-process run is one logical writer: process 0 takes the lock and tells every other process whether it got
it, so all of them start or all of them stop with the same message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import socket
import stat
import sys
import time
import warnings

import jax
import numpy as np

from jaxpar.errors import OutputError, WorkdirLocked

LOCK_FILE = ".lock"


class WorkdirLock:
    """Context manager holding the workdir's lock (all processes enter it; process 0 holds the file lock)."""

    def __init__(self, workdir: str | pathlib.Path, purpose: str = "train"):
        self.workdir = pathlib.Path(workdir)
        self.purpose = purpose
        self._fd: int | None = None

    def __enter__(self) -> "WorkdirLock":
        error, message = self._acquire() if jax.process_index() == 0 else (None, "")
        if jax.process_count() > 1:  # every process learns process 0's outcome, so none starts alone
            from jax.experimental import multihost_utils

            refused = int(multihost_utils.broadcast_one_to_all(np.int32(bool(message))))
            if refused and not message:
                error, message = WorkdirLocked, f"{self.workdir}: process 0 could not take the workdir's lock"
        if message:
            raise error(message)
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # nobody holds it now
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def _acquire(self) -> tuple[type | None, str]:
        """Take the lock; return (None, '') on success, else the error type and its one-line message."""
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            return OutputError, f"workdir {self.workdir} is not a directory; pass a directory (created if missing)"
        except OSError as e:
            return OutputError, f"workdir {self.workdir} cannot be created ({e.strerror}); pass a writable directory"
        path = self.workdir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as e:
            return OutputError, f"{path} cannot be opened ({e.strerror}); pass a writable workdir"
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return OutputError, f"{path} is not a regular file; remove it (jaxpar keeps its lock there)"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _describe(_read_holder(fd))
                os.close(fd)
                return WorkdirLocked, (f"{self.workdir} is in use by {holder}; wait for that run to finish or stop "
                                       "it, or pass another --workdir (two writers would overwrite each other's "
                                       "checkpoints and metrics)")
            warnings.warn(f"cannot lock {path} ({e.strerror}: the filesystem does not support flock); a second run "
                          "on this workdir would not be detected", stacklevel=3)
            os.close(fd)
            return None, ""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return None, ""


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another run"
    what = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if holder.get("since"):
        what += f" since {holder['since']}"
    if holder.get("command"):
        what += f" ({holder['command'][:120]})"
    return what


__all__ = ["LOCK_FILE", "WorkdirLock"]
