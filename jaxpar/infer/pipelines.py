"""`pipeline("text-generation", model=…)`: called like Hugging Face transformers' text-generation pipeline, returning
the same structures, so code written for it runs unchanged on a jaxpar model.

    pipe = pipeline("text-generation", model="runs/demo")            # a workdir, an HF directory or a LoadedModel
    pipe("def ", max_new_tokens=40)              → [{"generated_text": "def …"}]
    pipe(["a", "b"], num_return_sequences=2)     → [[{…}, {…}], [{…}, {…}]]
    pipe([{"role": "user", "content": "hi"}])     → [{"generated_text": [{"role": "user", …},
                                                                         {"role": "assistant", "content": "…"}]}]

As in transformers: `return_full_text` (default True) puts the prompt in front of the new text (a chat: the
messages before the assistant's reply; False gives the reply's text alone); `do_sample` defaults to the model's
generation_config.json (False without one), and sampling draws with temperature 1, top_k 50, top_p 1 unless told
otherwise; new tokens stop at the model's eos tokens, whose text is left out; without max_new_tokens the pipeline
generates up to 256 new tokens (transformers' pipeline default) within the context. An argument transformers takes
and this does not implement (beam search, penalties, …) is a GenerateError naming it, never silently ignored.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

from jaxpar.errors import GenerateError
from jaxpar.data.chat import chat_template_of, render_chat
from jaxpar.infer.text import LoadedModel, generate_text, load

DEFAULT_NEW_TOKENS = 256


class TextGenerationPipeline:
    """The loaded model, its tokenizer and chat template, and the generation defaults of its directory."""

    task = "text-generation"

    def __init__(self, loaded: LoadedModel, path: pathlib.Path | None = None):
        if loaded.tokenizer is None:
            raise GenerateError("the model has no tokenizer.json: a text-generation pipeline needs one")
        self.loaded = loaded
        self.chat_template, self.special = chat_template_of(path) if path is not None else (None, {})
        self.defaults: dict[str, Any] = {}
        config = path / "generation_config.json" if path is not None else None
        if config is not None and config.is_file():
            g = json.loads(config.read_text())
            self.defaults = {k: g[k] for k in ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens")
                             if k in g}

    def __call__(self, text_inputs, *, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 return_full_text: bool = True, num_return_sequences: int = 1, seed: int = 0,
                 **unsupported) -> list:
        if unsupported:
            raise GenerateError(f"text-generation pipeline: {sorted(unsupported)} not supported here (jaxpar takes "
                                "max_new_tokens, do_sample, temperature, top_k, top_p, return_full_text, "
                                "num_return_sequences, seed)")
        if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) \
                or num_return_sequences < 1:
            raise GenerateError(f"num_return_sequences = {num_return_sequences!r}: must be an integer >= 1")
        single, items = _items(text_inputs)
        d = self.defaults
        sample = do_sample if do_sample is not None else bool(d.get("do_sample", False))
        settings = dict(temperature=(temperature if temperature is not None else d.get("temperature", 1.0))
                        if sample else 0.0,
                        top_k=(top_k if top_k is not None else d.get("top_k", 50)) if sample else 0,
                        top_p=(top_p if top_p is not None else d.get("top_p", 1.0)) if sample else 1.0)
        prompts = [self._prompt(item) for item in items]
        limit = self.loaded.config.model.max_seq_len
        out = []
        for item, prompt in zip(items, prompts):
            n = max_new_tokens if max_new_tokens is not None else d.get("max_new_tokens", DEFAULT_NEW_TOKENS)
            if max_new_tokens is None:  # the default stays within the context
                n = min(n, limit - len(self.loaded.tokenizer.encode(prompt)))
            texts = generate_text(self.loaded, [prompt] * num_return_sequences, max_new_tokens=n, seed=seed,
                                  **settings)
            out.append([{"generated_text": _result(item, prompt, text, return_full_text)} for text in texts])
        return out[0] if single else out

    def _prompt(self, item) -> str:
        if isinstance(item, str):
            return item
        if self.chat_template is None:
            raise GenerateError("chat messages given, and the model's tokenizer_config.json has no chat_template")
        return render_chat(self.chat_template, item, self.special)


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


def _items(inputs) -> tuple[bool, list]:
    """(whether the input was one prompt or one chat, the prompts / chats as a list)."""
    if isinstance(inputs, str) or _is_chat(inputs):
        return True, [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) or _is_chat(x) for x in inputs):
        return False, list(inputs)
    raise GenerateError(f"text_inputs: a string, a chat (a list of {{'role', 'content'}} messages), or a non-empty "
                        f"list of those — got {type(inputs).__name__}")


def _result(item, prompt: str, text: str, full: bool):
    if isinstance(item, str):
        return prompt + text if full else text
    return [*item, {"role": "assistant", "content": text}] if full else text


def pipeline(task: str, model: str | pathlib.Path | LoadedModel, **load_kwargs) -> TextGenerationPipeline:
    """transformers.pipeline's signature for task "text-generation": `model` a jaxpar workdir, a Hugging Face
    directory, or a `LoadedModel`; load_kwargs go to `jaxpar.infer.text.load` (tensor=, quantize=, dtype=, …)."""
    if task != "text-generation":
        raise GenerateError(f"task {task!r}: jaxpar's pipeline implements 'text-generation' only")
    if isinstance(model, LoadedModel):
        if load_kwargs:
            raise GenerateError(f"{sorted(load_kwargs)}: a LoadedModel is loaded already")
        return TextGenerationPipeline(model)
    path = pathlib.Path(model)
    return TextGenerationPipeline(load(path, **load_kwargs), path)


__all__: Sequence[str] = ["pipeline", "TextGenerationPipeline"]
