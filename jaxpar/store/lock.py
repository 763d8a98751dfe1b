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

Conversions (`jaxpar convert --to DIR`, `--to-hf DIR`) write a new directory rather than into a live one, so they
need no lock: `Staged` writes the whole result into a private temporary directory beside the target and publishes
it with one `rename(2)`, which the kernel performs only onto an absent name or an empty directory. So an output
directory holds either nothing of a conversion or all of it; two conversions into one target cannot mix (the second
rename fails and that conversion is refused, the first one's result intact); and nothing already there — a user's
file, a run that has not saved yet, a model directory — is ever replaced.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import stat
import sys
import tempfile
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


def check_new_output(path: str | pathlib.Path, flag: str = "--to") -> pathlib.Path:
    """`path` if a conversion may write a new directory there — absent, or an empty directory, below a parent that
    is (or can be created as) a writable directory — else an OutputError naming the path and what it holds. A
    check made early (before seconds of loading); `Staged` makes the publication itself exclusive."""
    path = pathlib.Path(path)
    if path.is_symlink():
        raise OutputError(f"{flag} {path}: a symbolic link; pass a new directory (nothing was written)")
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"{flag} {path}: not a directory; pass a new directory (nothing was written)")
        held = _entries(path)
        if held:
            raise OutputError(f"{flag} {path}: already holds files ({held}); pass a new or empty directory (nothing "
                              "was written or overwritten)")
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:  # the nearest ancestor that exists must take the new one
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: {parent} is not a directory; pass a path in a writable directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {parent} is not writable; pass a path in a writable directory")
    return path


def check_outside(src: str | pathlib.Path, dst: str | pathlib.Path, flag: str = "--to") -> None:
    """OutputError unless output `dst` lies outside conversion source `src` (both with links resolved): writing into
    the directory being read turns one into the other (`convert --from-hf X --to X`)."""
    source, target = pathlib.Path(src).resolve(), pathlib.Path(dst).resolve()
    if target == source or target.is_relative_to(source):
        where = "is" if target == source else "is inside"
        raise OutputError(f"{flag} {dst}: {where} the source {src}; write the conversion to a new directory outside "
                          "it (nothing was written)")


def _entries(path: pathlib.Path, most: int = 3) -> str:
    """The first `most` names in directory `path`, sorted, for a message ('' when it is empty)."""
    names = []
    with os.scandir(path) as it:
        for entry in it:
            names.append(entry.name)
            if len(names) > most:
                break
    shown = ", ".join(sorted(names)[:most])
    return shown + (", …" if len(names) > most else "")


def umask() -> int:
    """The process's file mode creation mask (read without changing it where /proc says it)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_modes(root: pathlib.Path) -> None:
    """Give `root` and everything under it the modes a plain `mkdir` / `open` would: directories 0777 and files
    0666, less the umask (temporary files and `mkdtemp` make them 0600 / 0700)."""
    mask = umask()
    for base, dirs, files in os.walk(root):
        os.chmod(base, 0o777 & ~mask)
        for name in files:
            file = os.path.join(base, name)
            if not os.path.islink(file):
                os.chmod(file, 0o666 & ~mask)


class Staged:
    """`with Staged(final) as tmp:` write a whole new directory into `tmp` (a private sibling of `final`); on a
    clean exit it is published as `final` with one rename, atomically and exclusively: the rename succeeds only onto
    an absent name or an empty directory, so a second writer, or a file that appeared meanwhile, makes it fail with
    an OutputError and nothing of this writer's is left. On any exit the temporary directory is removed. Modes are
    normalized (`normal_modes`). Errors creating the directory (no permission, a parent that is a file) are
    OutputErrors too."""

    def __init__(self, final: str | pathlib.Path, flag: str = "--to"):
        self.final, self.flag = pathlib.Path(final), flag
        self.tmp: pathlib.Path | None = None

    def __enter__(self) -> pathlib.Path:
        check_new_output(self.final, self.flag)
        parent = self.final.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{self.final.name}.partial-", dir=parent))
        except OSError as e:
            raise OutputError(f"{self.flag} {self.final}: cannot be created in {parent} ({e.strerror or e}); pass a "
                              "path in a writable directory (nothing was written)") from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                normal_modes(self.tmp)
                self._publish()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _publish(self) -> None:
        try:
            os.rename(self.tmp, self.final)  # onto an absent name or an empty directory only
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                held = _entries(self.final) if self.final.is_dir() else "?"
                raise OutputError(f"{self.flag} {self.final}: already holds files ({held}), written while this "
                                  "conversion ran (another one into the same directory?); this one wrote nothing, "
                                  "pass a new directory") from None
            if e.errno == errno.ENOTDIR:
                raise OutputError(f"{self.flag} {self.final}: not a directory (it appeared while this conversion "
                                  "ran); pass a new directory (nothing was written)") from None
            raise OutputError(f"{self.flag} {self.final}: cannot be written ({e.strerror or e}); pass a new directory "
                              "in a writable place (nothing was written)") from None


__all__ = ["LOCK_FILE", "Staged", "WorkdirLock", "check_new_output", "check_outside", "normal_modes", "umask"]
