"""Regenerate the README's config reference from the config classes: `python scripts/update_readme.py`."""

import pathlib
import re

from jaxpar.config import reference_markdown

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(text: str) -> str:
    return re.sub(f"{START}.*?{END}", lambda _: f"{START}\n{reference_markdown()}{END}", text, flags=re.S)


if __name__ == "__main__":
    README.write_text(render(README.read_text()))
