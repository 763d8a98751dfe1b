"""The error types a user can cause, as opposed to bugs.

Every input problem — a config that cannot run, a damaged or mismatched checkpoint, a Hugging Face directory that
cannot be imported, a workdir another run holds, an impossible generation request — raises a subclass of
`JaxparError`. `str(err)` is one line that names the input at fault and what to do about it. The command line
prints exactly that line on stderr and exits with status 2; any other exception is a bug and keeps its traceback.

The subclasses also derive from the built-in type a caller would expect (`ValueError`, `FileNotFoundError`), so
code written against those keeps working.
"""

from __future__ import annotations


class JaxparError(Exception):
    """A user error: bad input, not a bug. `kind` is the word the CLI prints before the message."""

    kind = "error"


class CheckpointError(JaxparError):
    """A workdir's checkpoints cannot serve the request: none readable, or written by an incompatible config."""

    kind = "checkpoint error"


class WorkdirLocked(JaxparError):
    """Another live run holds the workdir's lock."""

    kind = "workdir locked"


class GenerateError(JaxparError, ValueError):
    """A generation request that has no meaning (empty prompt, no samples, a temperature below zero, …)."""

    kind = "generate error"


class InputNotFound(JaxparError, FileNotFoundError):
    """A path given on the command line or to the API does not exist or is not what it should be."""

    kind = "not found"


class UsageError(JaxparError, ValueError):
    """Flags that do not go together (or a flag's value that argparse cannot check)."""

    kind = "usage error"


class OutputError(JaxparError):
    """A path to write to cannot be written (not a directory, no permission, already holds something)."""

    kind = "cannot write"


__all__ = ["CheckpointError", "GenerateError", "InputNotFound", "JaxparError", "OutputError", "UsageError", "WorkdirLocked"]
