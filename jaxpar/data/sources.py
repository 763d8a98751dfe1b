"""Token streams for training and held-out evaluation, from four sources.

`load_tokens(data, tokenizer, split, seq_len=..., seed=...)` returns one flat 1-D stream of token ids for split
"train" or "eval"; the `Loader` cuts it into sequences. Documents are joined with `separator_ids(tokenizer)` (the
tokenizer's eos id, else the bytes "\\n\\n") after every document.

| source      | what                                                     | held-out "eval" split                     |
|-------------|----------------------------------------------------------|-------------------------------------------|
| "default"   | this interpreter's standard-library .py sources          | files with `is_held_out(relative path)`   |
| "synthetic" | random words from a fixed random lexicon (learnable)     | same lexicon, different draws             |
| "text"      | data.path: a text/.jsonl file or a directory of them     | by file as above; last 5% if one-sided    |
| "tokens"    | data.path: a raw uint16 .bin memmap, or a .npy           | last 5% of the ids                        |
| "chat"      | data.path: JSONL conversations, one per row (data.chat)  | every 20th conversation                   |
| "pairs"     | data.path: JSONL preference pairs, one per row (DPO)     | every 20th pair                           |

Splitting by a hash of the file's relative path (not by position) keeps the split stable when files are added, and
keeps a whole file on one side, so the held-out loss measures generalisation to unseen files rather than to the
second half of a file already seen.

Every problem with the data itself raises `ConfigError` naming the field to change (data.path, data.tokenizer,
train.seq_len).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sysconfig
import zlib

import numpy as np

from jaxpar.config import SOURCES, ConfigError, DataConfig
from jaxpar.data.chat import load_chat_rows, load_pair_rows
from jaxpar.data.tokenizers import Tokenizer, encode_documents

SPLITS = ("train", "eval")
HELD_OUT = 0.05  # fraction of files (or of the last tokens) kept for "eval"

# The default corpus reads at most this many bytes per split (the stdlib is ~32 MB of .py, two thirds of it tests).
# 16 MB of train text is ~16M byte tokens: far more than a demo run consumes (500 steps x 32 x 128 = 2M tokens),
# and reading + encoding it takes ~0.25 s with the byte tokenizer (a BPE tokenizer.json: several seconds).
DEFAULT_MAX_BYTES = {"train": 16 * 2**20, "eval": 1 * 2**20}
SYNTHETIC_TOKENS = {"train": 2**21, "eval": 2**17}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def load_tokens(data: DataConfig, tokenizer: Tokenizer, split: str, *, seq_len: int, seed: int = 0
                ) -> np.ndarray | dict[str, np.ndarray]:
    """The token stream of `split` -> integer [n_tokens], with n_tokens >= seq_len + 1 — or for "chat" the rows
    themselves, {"tokens", "mask"} int32 [N, seq_len + 1] each (jaxpar.data.chat), which the `Loader` batches whole
    (and for "pairs" their "segments" too: jaxpar.data.chat.load_pair_rows).

    int32 for the "default", "synthetic" and "text" sources. For "tokens" it is a read-only memory-mapped view in
    the file's own integer dtype (uint16 for .bin), so a file larger than memory is never copied; the `Loader`
    casts each window to int32. "default" and "synthetic" results are cached per process and returned read-only.

    Raises ConfigError for a missing path, an empty corpus, ids outside the tokenizer's vocabulary ("tokens"),
    or a split shorter than one sequence.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if data.source == "default":
        tokens, field, value = _cached(_default_tokens, tokenizer, split), "train.seq_len", seq_len
    elif data.source == "synthetic":
        tokens, field, value = _synthetic_tokens(tokenizer.vocab_size, split, seed), "train.seq_len", seq_len
    elif data.source == "text":
        tokens, field, value = _text_tokens(data.path, tokenizer, split), "data.path", data.path
    elif data.source == "tokens":
        tokens, field, value = _file_tokens(data.path, tokenizer.vocab_size, split), "data.path", data.path
    elif data.source == "chat":  # whole rows with their loss mask, not a stream
        return load_chat_rows(data, tokenizer, split, seq_len)
    elif data.source == "pairs":  # whole rows, a chosen and a rejected conversation each (segments 1 and 2)
        return load_pair_rows(data, tokenizer, split, seq_len)
    else:  # unreachable for a DataConfig, which validates `source`; kept so a new source cannot fall through
        raise ConfigError("data.source", data.source, "unknown source", "use one of " + ", ".join(SOURCES))
    if len(tokens) < seq_len + 1:
        raise ConfigError(field, value, f"the {split!r} split holds {len(tokens)} tokens, fewer than one sequence "
                          f"needs (train.seq_len + 1 = {seq_len + 1})", "add more data or lower train.seq_len")
    return tokens


def is_held_out(relative_path: str) -> bool:
    """Whether a file belongs to "eval": crc32 of its '/'-separated relative path, stable across runs and machines."""
    return zlib.crc32(relative_path.encode("utf-8")) % 10_000 < HELD_OUT * 10_000


def _cached(fn, tokenizer: Tokenizer, split: str) -> np.ndarray:
    """Call an lru_cached `fn(tokenizer, split)`, bypassing the cache for a tokenizer that cannot be hashed."""
    try:
        hash(tokenizer)
    except TypeError:
        return fn.__wrapped__(tokenizer, split)
    return fn(tokenizer, split)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # a cached array is shared by every caller; nobody may change it in place
    return a


# ---------------------------------------------------------------------------------------------------------------------
# "default": the standard library's own sources.


@functools.lru_cache(maxsize=1)
def _stdlib_documents() -> dict[str, list[tuple[str, bytes]]]:
    """{"train": [(relative path, raw bytes), ...], "eval": [...]}: stdlib .py files in sorted relative-path order.

    Files that are not valid UTF-8 (a few deliberate test fixtures) are skipped. Each split stops taking files once
    it has read `DEFAULT_MAX_BYTES[split]`; on CPython 3.12 the train side then ends part way through `test/`.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs: dict[str, list[tuple[str, bytes]]] = {s: [] for s in SPLITS}
    left = dict(DEFAULT_MAX_BYTES)
    for rel in _walk_files(root, suffix=".py"):
        split = "eval" if is_held_out(rel) else "train"
        if left[split] <= 0:
            if max(left.values()) <= 0:
                break
            continue
        raw = (root / rel).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs[split].append((rel, raw))
        left[split] -= len(raw)
    return docs


@functools.lru_cache(maxsize=8)
def _default_tokens(tokenizer: Tokenizer, split: str) -> np.ndarray:
    docs = [raw for _, raw in _stdlib_documents()[split]]
    if not docs:
        raise ConfigError("data.source", "default", f"found no readable .py files under "
                          f"{sysconfig.get_paths()['stdlib']} for {split!r}", "use data.source=synthetic or text")
    return _read_only(encode_documents(tokenizer, docs))


# ---------------------------------------------------------------------------------------------------------------------
# "synthetic": random words from a fixed lexicon.


@functools.lru_cache(maxsize=8)
def _synthetic_tokens(vocab_size: int, split: str, seed: int) -> np.ndarray:
    """`SYNTHETIC_TOKENS[split]` ids: words drawn with Zipf frequencies from 512 random words of 2..8 tokens.

    Why this is learnable: the choice of word carries ~4.8 nats (Zipf over 512), and every token after a word's
    first is determined by the tokens before it, so a model that memorises the lexicon reaches a loss near
    (word entropy) / (mean word length ~5.2) ~ 0.9 nat, far below log(vocab) (5.5 for bytes). The lexicon depends only on
    `seed`, so "eval" (different draws, same lexicon) measures exactly what "train" teaches.
    """
    n_words = 512
    lex_rng = np.random.default_rng(seed)
    lengths = lex_rng.integers(2, 9, n_words)                         # [W]
    lexicon = lex_rng.integers(0, vocab_size, lengths.sum())          # all words back to back
    offsets = np.cumsum(lengths) - lengths                            # [W] start of each word in `lexicon`
    p = 1.0 / np.arange(1, n_words + 1)
    rng = np.random.default_rng([seed, 1 + SPLITS.index(split)])      # draws differ between splits
    n_tokens = SYNTHETIC_TOKENS[split]
    words = rng.choice(n_words, size=n_tokens // 2 + 1, p=p / p.sum())  # [N]; >= n_tokens ids since length >= 2
    lens = lengths[words]
    # Gather word by word without a Python loop: token j of the stream is lexicon[start of its word + its offset].
    first = np.repeat(np.cumsum(lens) - lens, lens)                   # stream index where each token's word begins
    index = np.repeat(offsets[words], lens) + np.arange(lens.sum()) - first
    return _read_only(lexicon[index][:n_tokens].astype(np.int32))


# ---------------------------------------------------------------------------------------------------------------------
# "text": files or a directory of text and JSONL.


def _text_tokens(path: str, tokenizer: Tokenizer, split: str) -> np.ndarray:
    """Read every file under `path` (sorted), .jsonl by its "text" field, anything else as UTF-8 text.

    Files are split by `is_held_out`; when that leaves one side empty (one file, or a few that all hash to train)
    the whole corpus is one stream and "eval" is its last `HELD_OUT` of tokens.
    """
    root = pathlib.Path(path).expanduser()
    if not root.exists():
        raise ConfigError("data.path", path, "does not exist", "point data.path at a text/.jsonl file or a directory")
    rels = [root.name] if root.is_file() else _walk_files(root)
    base = root.parent if root.is_file() else root
    by_split: dict[str, list[str]] = {s: [] for s in SPLITS}
    every: list[str] = []
    for rel in rels:
        docs = _read_documents(base / rel, path)
        by_split["eval" if is_held_out(rel) else "train"] += docs
        every += docs
    if not any(d.strip() for d in every):
        raise ConfigError("data.path", path, "holds no UTF-8 text (empty files, or only binary ones)",
                          "add .txt/.md/.py/.jsonl files with text")
    if all(any(d.strip() for d in by_split[s]) for s in SPLITS):
        return encode_documents(tokenizer, by_split[split])
    tokens = encode_documents(tokenizer, every)
    cut = len(tokens) - int(len(tokens) * HELD_OUT)
    return tokens[:cut] if split == "train" else tokens[cut:]


def _read_documents(file: pathlib.Path, path: str) -> list[str]:
    """One file -> its documents: each JSONL line's "text", or the whole file. Undecodable files give []."""
    try:
        text = file.read_text("utf-8")
    except UnicodeDecodeError:
        return []  # a binary file in a text directory (an image, a .pyc): not text, so not training data
    if file.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)["text"]
            if not isinstance(doc, str):
                raise TypeError
            docs.append(doc)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError("data.path", path, f"line {n} of {file} is not a JSON object with a \"text\" field",
                              "write one {\"text\": ...} object per line") from None
    return docs


def _walk_files(root: pathlib.Path, suffix: str = "") -> list[str]:
    """Sorted posix paths relative to `root` of files ending in `suffix`; hidden names and SKIP_DIRS are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(suffix) and not f.startswith(".")]
    return sorted(found)


# ---------------------------------------------------------------------------------------------------------------------
# "tokens": a memory-mapped array of ids.

_FULL_CHECK = 2**26  # ids scanned in full below this length (~0.1 s); above it, an evenly strided sample of 2**20


def _file_tokens(path: str, vocab_size: int, split: str) -> np.ndarray:
    """A read-only view of the ids in `path`: .npy via np.load(mmap_mode="r"), anything else as raw uint16."""
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise ConfigError("data.path", path, "file not found", "point data.path at a .bin (uint16) or .npy file of ids")
    try:
        ids = np.load(file, mmap_mode="r") if file.suffix == ".npy" else np.memmap(file, dtype=np.uint16, mode="r")
    except ValueError as e:  # empty file, or a size that is not a whole number of uint16s
        raise ConfigError("data.path", path, f"cannot be read as token ids ({e})",
                          "write ids with np.asarray(ids, np.uint16).tofile(path) or np.save") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError("data.path", path, f"holds a {ids.dtype} array of shape {ids.shape}",
                          "save a 1-D integer array of token ids")
    # Ids beyond the vocabulary would index past the embedding table silently on GPU; catch them here when it is
    # cheap: skip when the dtype cannot exceed the vocab, sample when the file is huge.
    if len(ids) and not (ids.dtype == np.uint16 and vocab_size >= 2**16):
        sample = ids if len(ids) <= _FULL_CHECK else ids[:: len(ids) // 2**20]
        lo, hi = int(sample.min()), int(sample.max())
        if lo < 0 or hi >= vocab_size:
            raise ConfigError("data.path", path, f"holds token id {hi if hi >= vocab_size else lo}, outside the "
                              f"tokenizer's vocabulary [0, {vocab_size})",
                              "set data.tokenizer to the tokenizer that produced this file")
    cut = len(ids) - int(len(ids) * HELD_OUT)
    return ids[:cut] if split == "train" else ids[cut:]


__all__ = ["load_tokens", "is_held_out", "SPLITS", "HELD_OUT", "DEFAULT_MAX_BYTES"]
