"""Chat templates as Hugging Face renders them: the Jinja template of a model directory's tokenizer_config.json, run
in a sandbox with the variables and helpers `PreTrainedTokenizer.apply_chat_template` provides (messages,
add_generation_prompt, the special tokens, `raise_exception`, a `tojson` filter; trim_blocks and lstrip_blocks on).
Used by `jaxpar.infer.pipeline` for chat inputs and by `jaxpar serve` for /v1/chat/completions."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxpar.errors import GenerateError


def chat_template_of(path: str | pathlib.Path) -> tuple[str | None, dict[str, Any]]:
    """tokenizer_config.json's chat template (a string, or the "default" one of a list of named templates) and its
    special tokens as template variables (bos_token, eos_token, pad_token, unk_token), or (None, {})."""
    file = pathlib.Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return None, {}
    config = json.loads(file.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise GenerateError(f"{file}: chat_template must be a string or a list of named templates")
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        special[key] = value.get("content") if isinstance(value, dict) else value
    return template, special


def render_chat(template: str, messages: list[dict], special: dict[str, Any],
                add_generation_prompt: bool = True) -> str:
    """The chat `messages` ([{"role", "content"}, …]) as text, the way transformers' `apply_chat_template(messages,
    tokenize=False, add_generation_prompt=…)` renders it. A template that refuses the messages (its
    `raise_exception`), or one that does not parse, is a GenerateError."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **special)
    except TemplateError as e:
        raise GenerateError(f"the chat template refused the messages: {' '.join(str(e).split())}") from None
