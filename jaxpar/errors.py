"""The error types a user can cause, as opposed to bugs.

Every input problem — a config that cannot run, a damaged or mismatched checkpoint, a Hugging Face directory that
cannot be imported, a workdir another run holds, an impossible generation request — raises a subclass of
`JaxparError`. `str(err)` is one line that names the input at fault and what to do about it. The command line
prints exactly that line on stderr and exits with status 2; any other exception is a bug and keeps its traceback.

The subclasses also derive from the built-in type a caller would expect (`ValueError`, `FileNotFoundError`), so
code written against those keeps working.
"""

from __future__ import annotations

from typing import Any


class JaxparError(Exception):
    """A user error: bad input, not a bug. `kind` is the word the CLI prints before the message."""

    kind = "error"


class ConfigError(JaxparError, ValueError):
    """A configuration that cannot run. `str(err)` is one line: field, value, rule and fix."""

    kind = "config error"

    def __init__(self, field: str, value: Any, rule: str, fix: str):
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        super().__init__(f"{short(field, 300, repr_=False)} = {short(value)}: {rule}. Fix: {fix}")


def short(value: Any, limit: int = 100, repr_: bool = True) -> str:
    """`repr(value)` (or `str`) cut to `limit` characters and an ellipsis: a value a message quotes may be a whole
    file's worth (a long list, a string, a YAML alias expanded), and the message must stay one short line."""
    if repr_:  # reprlib: a nested container is not rendered whole first (a billion-element repr would not fit)
        import reprlib

        r = reprlib.Repr()
        r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 4, 24, 24, 12, 12
        r.maxstring, r.maxother, r.maxlong = 10 * limit, 10 * limit, 10 * limit
        text = r.repr(value)
    else:
        text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…"


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: what an error's fix offers when a degree must divide a size."""
    return [k for k in range(1, n + 1) if n % k == 0]


def check_divides(name: str, value: int, by_name: str, by: int, why: str) -> None:
    """Refuse `value` not divisible by `by`, listing the divisors of `value` that would work."""
    if value % by:
        raise ConfigError(name, value, f"must be divisible by {by_name} = {by} ({why})",
                          f"use {by_name} among {divisors(value)}, or {name} a multiple of {by}")


class CheckpointError(JaxparError):
    """A workdir's checkpoints cannot serve the request: none readable, or written by an incompatible config."""

    kind = "checkpoint error"


class WorkdirLocked(JaxparError):
    """Another live run holds the workdir's lock."""

    kind = "workdir locked"


class GenerateError(JaxparError, ValueError):
    """A generation request that has no meaning (empty prompt, no samples, a temperature below zero, …)."""

    kind = "generate error"


class RequestError(JaxparError, ValueError):
    """A serving request that cannot run (`jaxpar.serve`): `status` is the HTTP status a server answers it with —
    400 a malformed or meaningless request, 413 a prompt longer than the model's context, 422 a parameter out of
    range."""

    kind = "request error"

    def __init__(self, message: str, status: int = 400):
        self.status = status
        super().__init__(message)


class Overloaded(JaxparError):
    """The serving engine's queue is full (back-pressure: retry later; a server answers 429)."""

    kind = "overloaded"
    status = 429


class InputNotFound(JaxparError, FileNotFoundError):
    """A path given on the command line or to the API does not exist or is not what it should be."""

    kind = "not found"


class PlanError(JaxparError, ValueError):
    """No layout of the model fits the devices and memory asked for (jaxpar.planner): the message names what would."""

    kind = "plan error"


class UsageError(JaxparError, ValueError):
    """Flags that do not go together (or a flag's value that argparse cannot check)."""

    kind = "usage error"


class OutputError(JaxparError):
    """A path to write to cannot be written (not a directory, no permission, already holds something)."""

    kind = "cannot write"


__all__ = ["CheckpointError", "check_divides", "ConfigError", "divisors", "short", "GenerateError", "InputNotFound", "JaxparError", "OutputError", "UsageError", "WorkdirLocked"]
