"""Chat and instruction data for supervised fine-tuning: JSONL conversations rendered with the tokenizer's own chat
template, one conversation per row, scored on the assistant's tokens only (`data.source = "chat"`).

Each line of data.path is one of

    {"messages": [{"role": "system" | "user" | "assistant" | …, "content": "…"}, …]}
        rendered as transformers' `apply_chat_template(messages)` renders it (`render_chat` below: the Jinja
        template of tokenizer_config.json beside data.tokenizer); the whole text tokenized once, as transformers does.
    {"prompt": "…", "completion": "…"}
        plain text, prompt then completion then the tokenizer's eos (no template: TRL's "standard" prompt-completion
        rows); the completion and the eos are scored.

Which tokens an assistant turn owns: a template that marks them itself (`{% generation %}…{% endgeneration %}`, as
transformers' `return_assistant_tokens_mask` reads them) says so; otherwise they are found by rendering prefixes of
the conversation: turn i's text is what render(messages[:i+1]) adds to render(messages[:i],
add_generation_prompt=True) — its content and the template's end-of-turn (ChatML's `<|im_end|>`), so the model
learns to stop. A token is scored when its first character lies in such a span. A template whose longer prefixes
do not extend the shorter ones (and that marks nothing) cannot be split this way and is refused by name.

Preference pairs for DPO (`data.source = "pairs"`, `load_pair_rows`) are TRL's rows: {"prompt": messages, "chosen":
messages, "rejected": messages} (the answers' messages follow the prompt's), {"chosen": messages, "rejected":
messages} (each a whole conversation: the prompt implicit), or {"prompt": "…", "chosen": "…", "rejected": "…"}
(plain text, as prompt/completion rows). Both conversations of a pair go in one row — the chosen one as segment 1,
the rejected one as segment 2 (jaxpar.train.dpo) — each rendered and scored as above.

A row is [T + 1] tokens (T = train.seq_len): the conversation, then the tokenizer's eos (or 0) as padding, which is
never scored and — after the conversation, under causal attention — never seen by it. A conversation longer than a
row is refused (raise train.seq_len, or shorten it) rather than cut: a truncated answer teaches the model to stop
mid-sentence. Every 20th conversation (rows 19, 39, …; the last one if there are fewer) is held out for "eval".
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data.tokenizers import ByteTokenizer, Tokenizer
from jaxpar.errors import GenerateError

HELD_OUT_EVERY = 20  # conversation i is held out when i % 20 == 19


def load_chat_rows(data: DataConfig, tokenizer: Tokenizer, split: str, seq_len: int) -> dict[str, np.ndarray]:
    """The conversations of `split` as rows: {"tokens": int32 [N, T+1], "mask": int32 [N, T+1], "lengths": int32
    [N]} (mask[:, t]: token t is an assistant token, scored as a target; a row's tokens after its length are
    padding, which the loader marks as segment 0 or drops when it packs). Raises ConfigError naming the field and
    the line for a missing template, a row that is not a conversation, one with no assistant turn, or one longer
    than a row."""
    renderer = _Renderer(data, tokenizer)
    rows = _load(data, split, seq_len, tokenizer, "conversations",
                 lambda line, n: [renderer.document(_parse(line, data.path, n), n)])
    rows.pop("segments")
    return rows


def load_pair_rows(data: DataConfig, tokenizer: Tokenizer, split: str, seq_len: int) -> dict[str, np.ndarray]:
    """The preference pairs of `split` (module docstring), one a row: {"tokens", "mask", "segments"} int32 [N, T+1]
    (segments: 1 the chosen conversation, 2 the rejected one, 0 padding) and "lengths" [N]. Raises ConfigError
    naming the field and the line for a row that is not a pair, a missing template, an answer with nothing scored,
    or a pair longer than a row."""
    renderer = _Renderer(data, tokenizer)

    def documents(line: str, n: int) -> list[tuple[list[int], list[int]]]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("data.path", data.path, f"line {n} is not JSON ({e.msg})", "one JSON object per line"
                              ) from None
        if not isinstance(row, dict) or not {"chosen", "rejected"} <= set(row):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError("data.path", data.path, f"line {n} is not a preference pair (it has {keys}); DPO "
                              "needs a 'chosen' and a 'rejected' answer in every row",
                              'write {"prompt": …, "chosen": …, "rejected": …} rows (TRL\'s preference format)')
        prompt = row.get("prompt", [] if isinstance(row["chosen"], list) else "")
        out = []
        for side in ("chosen", "rejected"):
            answer = row[side]
            if isinstance(prompt, list) and isinstance(answer, list):
                one = {"messages": prompt + answer}
            elif isinstance(prompt, str) and isinstance(answer, str):
                one = {"prompt": prompt, "completion": answer}
            else:
                raise ConfigError("data.path", data.path, f"line {n}: 'prompt' and '{side}' must both be lists of "
                                  "messages or both strings", "write the pair in one of the two forms")
            out.append(renderer.document(_parse(json.dumps(one), data.path, n), n))
        return out

    return _load(data, split, seq_len, tokenizer, "pairs", documents)


class _Renderer:
    """One row's parsed form (`_parse`) → (its token ids, 1 for each scored token else 0); the chat template is read
    once, when the first conversation of messages needs it."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer):
        self.data, self.tokenizer, self.template = data, tokenizer, None

    def document(self, row: dict, n: int) -> tuple[list[int], list[int]]:
        if "messages" not in row:
            return _prompt_completion(self.tokenizer, row, self.data.path, n)
        if self.template is None:
            self.template = _template(self.data, self.tokenizer)
        return render_with_mask(self.tokenizer, self.template, row["messages"], self.data.path, n)


def _load(data: DataConfig, split: str, seq_len: int, tokenizer: Tokenizer, what: str, documents
          ) -> dict[str, np.ndarray]:
    """The lines of data.path in `split` (every 20th held out) → rows {"tokens", "mask", "segments"} [N, T+1],
    "lengths" [N]: each line's `documents(line, n)` (its (ids, scored) documents) one after another in one row,
    numbered 1, 2, … in "segments"."""
    path = pathlib.Path(data.path).expanduser()
    if not path.is_file():
        raise ConfigError("data.path", data.path, f"no such file; data.source {data.source!r} reads a JSONL file of "
                          f"{what}", "point data.path at a .jsonl file")
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    if not lines:
        raise ConfigError("data.path", data.path, f"holds no {what}", "add JSONL rows (jaxpar.data.chat)")
    if len(lines) == 1:
        raise ConfigError("data.path", data.path, f"holds one row of {what}; training and its held-out split need "
                          "two at least", "add rows")
    held = {i for i in range(len(lines)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1} or {len(lines) - 1}
    mine = [lines[i] for i in range(len(lines)) if (i in held) == (split == "eval")]
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    out = {"tokens": np.full((len(mine), seq_len + 1), pad, np.int32),
           **{k: np.zeros((len(mine), seq_len + 1), np.int32) for k in ("mask", "segments")},
           "lengths": np.zeros((len(mine),), np.int32)}
    for r, (n, line) in enumerate(mine):
        docs = documents(line, n)
        length = sum(len(ids) for ids, _ in docs)
        if length > seq_len + 1:
            raise ConfigError("train.seq_len", seq_len, f"line {n} of data.path is {length} tokens, more than a "
                              f"row holds (train.seq_len + 1 = {seq_len + 1}); jaxpar does not cut conversations",
                              f"raise train.seq_len to {length - 1} or more, or shorten that row")
        at = 0
        for segment, (ids, scored) in enumerate(docs, 1):
            out["tokens"][r, at:at + len(ids)], out["mask"][r, at:at + len(ids)] = ids, scored
            out["segments"][r, at:at + len(ids)] = segment
            at += len(ids)
        out["lengths"][r] = length
    return out


def _parse(line: str, path: str, n: int) -> dict:
    """Line n of data.path → a dict holding `messages`, or `prompt` and `completion` (strings)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError("data.path", path, f"line {n} is not JSON ({e.msg})", "one JSON object per line") from None
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        messages = row["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise ConfigError("data.path", path, f"line {n} has a message without a string 'role' and 'content'",
                              'write each message as {"role": "user", "content": "…"}')
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError("data.path", path, f"line {n} has no assistant turn, so nothing in it is scored",
                              "add the assistant's reply, or drop the conversation")
        return row
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return row
    raise ConfigError("data.path", path, f"line {n} is neither {{\"messages\": [...]}} nor "
                      "{\"prompt\": …, \"completion\": …}",
                      "write conversations as messages, or prompt/completion pairs of strings")


def _template(data: DataConfig, tokenizer: Tokenizer) -> tuple[str, dict]:
    """(the chat template, its special-token variables) from tokenizer_config.json beside data.tokenizer."""
    where = None if isinstance(tokenizer, ByteTokenizer) else pathlib.Path(tokenizer.path).parent
    template, special = chat_template_of(where) if where is not None else (None, {})
    if template is None:
        place = "the byte tokenizer" if where is None else f"{where / 'tokenizer_config.json'}"
        raise ConfigError("data.tokenizer", data.tokenizer, f"has no chat template ({place}); conversations of "
                          "messages are rendered with the tokenizer's own", "use a Hugging Face model directory "
                          "whose tokenizer_config.json has a chat_template, or prompt/completion rows")
    return template, special


def render_with_mask(tokenizer: Tokenizer, template: tuple[str, dict], messages: list[dict], path: str = "",
                     n: int = 1) -> tuple[list[int], list[int]]:
    """A conversation (line n of data.path, for the errors) → (its token ids, 1 for each assistant token else 0),
    as the module docstring describes."""
    source, special = template

    def render(part, prompt, marked=False):
        try:
            text, spans = render_chat_spans(source, part, special, add_generation_prompt=prompt)
        except GenerateError as e:
            raise ConfigError("data.path", path, f"line {n}: {e}", "fix the conversation, or the template"
                              ) from None
        return (text, spans) if marked else text

    text, spans = render(messages, False, marked=True)
    # the template's own marks ({% generation %}, as transformers reads them), else the assistant turns' prefixes
    for i, m in enumerate(messages if not spans else ()):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError("data.path", path, f"line {n}: data.tokenizer's chat template renders a longer "
                              "conversation as something other than the shorter one plus the new turn, so the "
                              "assistant's tokens cannot be told apart",
                              "use a template whose prefixes extend (every ChatML / Llama 3 template does)")
        spans.append((len(before), len(through)))
    ids, starts = encode_with_starts(tokenizer, text)
    return ids, [int(any(a <= s < b for a, b in spans)) for s in starts]


def _prompt_completion(tokenizer: Tokenizer, row: dict, path: str, n: int) -> tuple[list[int], list[int]]:
    """prompt + completion (+ eos) as plain text; the completion's tokens and the eos scored."""
    text = row["prompt"] + row["completion"]
    ids, starts = encode_with_starts(tokenizer, text)
    scored = [int(s >= len(row["prompt"])) for s in starts]
    if not any(scored) and tokenizer.eos_id is None:
        raise ConfigError("data.path", path, f"line {n} has an empty completion, so nothing in it is scored",
                          "drop the row")
    if tokenizer.eos_id is not None:
        ids, scored = ids + [tokenizer.eos_id], scored + [1]
    return ids, scored


def encode_with_starts(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """text → (ids, the index in `text` of each token's first character), the whole text tokenized at once."""
    if isinstance(tokenizer, ByteTokenizer):
        raw = text.encode("utf-8")
        # byte k belongs to the character whose UTF-8 encoding covers it
        char_of = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text]).tolist()
        return list(raw), char_of
    return tokenizer.encode_with_offsets(text)


# ---------------------------------------------------------------------------------------------------------------------
# Chat templates as Hugging Face renders them: the Jinja template of a model directory's tokenizer_config.json, run
# in a sandbox with the variables and helpers `PreTrainedTokenizer.apply_chat_template` provides (messages,
# add_generation_prompt, the special tokens, `raise_exception`, a `tojson` filter; trim_blocks and lstrip_blocks on).
# Also used by `jaxpar.infer.pipeline` for chat inputs and by `jaxpar serve` for /v1/chat/completions.


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


# `{% generation %}…{% endgeneration %}` (transformers' AssistantTracker: what the assistant generates) renders its
# body between two private-use characters, which `render_chat_spans` turns into spans and removes.
_OPEN, _CLOSE = "\ue000", "\ue001"


def render_chat(template: str, messages: list[dict], special: dict[str, Any],
                add_generation_prompt: bool = True) -> str:
    """The chat `messages` ([{"role", "content"}, …]) as text, the way transformers' `apply_chat_template(messages,
    tokenize=False, add_generation_prompt=…)` renders it. A template that refuses the messages (its
    `raise_exception`), or one that does not parse, is a GenerateError."""
    return render_chat_spans(template, messages, special, add_generation_prompt)[0]


def render_chat_spans(template: str, messages: list[dict], special: dict[str, Any],
                      add_generation_prompt: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat`, and the [start, end) character spans of the template's `{% generation %}` blocks (what
    transformers' `return_assistant_tokens_mask` marks; none when the template has no such block). The sandbox
    has what transformers gives templates: `raise_exception`, `strftime_now`, a `tojson` filter, loop controls."""
    import datetime

    import jinja2
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson
    try:
        marked = env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **special)
    except TemplateError as e:
        raise GenerateError(f"the chat template refused the messages: {' '.join(str(e).split())}") from None
    text, spans, start = [], [], 0
    for piece in marked.split(_OPEN):
        body, closed, rest = piece.partition(_CLOSE)
        if not closed:  # the text before the first block
            text.append(piece)
            start += len(piece)
            continue
        spans.append((start, start + len(body)))
        text += [body, rest]
        start += len(body) + len(rest)
    return "".join(text), spans


__all__ = ["load_chat_rows", "render_with_mask", "encode_with_starts", "chat_template_of", "render_chat",
           "render_chat_spans"]
