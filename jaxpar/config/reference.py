"""The config reference as Markdown, generated from the schema (the README embeds it verbatim)."""

from __future__ import annotations

import dataclasses
import typing

from jaxpar.config.checks import type_hints
from jaxpar.config.schema import SECTIONS


def reference_markdown() -> str:
    """The config reference as Markdown tables, generated from the dataclasses (the README embeds it verbatim)."""
    lines = []
    for section, cls in SECTIONS.items():
        lines += [f"#### `{section}` — {cls.__doc__.strip().splitlines()[0]}", "",
                  "| field | type | default | meaning |", "|---|---|---|---|"]
        hints = type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("section"):
                continue
            hint = hints[f.name]
            kind = f"list[{typing.get_args(hint)[0].__name__}]" if typing.get_origin(hint) is tuple else hint.__name__
            lines.append(f"| `{section}.{f.name}` | {kind} | `{f.default!r}` | {f.metadata['help']} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
