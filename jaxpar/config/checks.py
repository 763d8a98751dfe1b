"""The small checks every config section shares: strict field types, unknown keys with a did-you-mean, positive
values, choices, divisibility. Each raises a `ConfigError` naming the field, the value, the rule and a fix."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Any

from jaxpar.errors import ConfigError


def reject_unknown(d: dict, known: dict, prefix: str) -> None:
    """Refuse a key of `d` that is not in `known`, naming the closest known key (a typo) or all of them."""
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known keys: {', '.join(prefix + k for k in known)}"
            raise ConfigError(f"{prefix}{key}", d[key], "unknown key", hint)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """A section's field types (resolved once: every config the planner builds checks its fields)."""
    return typing.get_type_hints(cls)


def check_fields(obj: Any, section: str) -> None:
    """Strict type check against the annotations: int fields reject bools and floats; float fields accept ints."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, kind, name = getattr(obj, f.name), hints[f.name], f"{section}.{f.name}"
        if typing.get_origin(kind) is tuple:  # tuple[int or str, ...]: a list or tuple (JSON, YAML give lists)
            item = typing.get_args(kind)[0]
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(v, item) and not isinstance(v, bool) for v in value):
                word, example = ("integers", "[0, 1]") if item is int else ("names", "[tensor, pipe]")
                raise ConfigError(name, value, f"must be a list of {word}",
                                  f"give {name} a list such as {example} (default {list(f.default)!r})")
            object.__setattr__(obj, f.name, tuple(value))
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, int) and not isinstance(value, bool) if kind is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
              isinstance(value, kind))
        if not ok:
            raise ConfigError(name, value, f"must be {kind.__name__}, got {type(value).__name__}",
                              f"give {name} a {kind.__name__} value (default {f.default!r})")
        if kind is float:
            if not math.isfinite(value):
                raise ConfigError(name, value, "must be finite", f"give {name} a finite number")
            object.__setattr__(obj, f.name, float(value))


def check_positive(name: str, value: float, allow_zero: str | None = None, fix: str | None = None) -> None:
    """Refuse a value <= 0 (< 0 with `allow_zero`; "derived" says 0 means the value is derived)."""
    if value > 0 or (allow_zero and value == 0):
        return
    rule = "must be >= 0" if allow_zero else "must be > 0"
    if allow_zero == "derived":
        rule += " (0 means derived)"
    raise ConfigError(name, value, rule, fix or f"set {name} to a {'non-negative' if allow_zero else 'positive'} value")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Refuse a value outside `choices`, suggesting the closest one."""
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(name, value, f"must be one of {', '.join(map(repr, choices))}", f"{hint}pick one of those")


def same_chunks(kinds: tuple, chunks: int) -> bool:
    """Whether `chunks` equal cuts of the layer kinds are all the same (what a pipeline over them needs)."""
    k = len(kinds) // chunks
    return all(kinds[i] == kinds[i % k] for i in range(len(kinds)))


def nearest_multiples(n: int, k: int) -> str:
    """The multiples of `k` either side of `n`, as a fix reads them ("12 or 16")."""
    lo, hi = (n // k) * k, (n // k + 1) * k
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"
