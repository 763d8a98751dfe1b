"""Tokenizers: raw UTF-8 bytes, or a Hugging Face `tokenizer.json`.

Everything downstream (sources, loader, sampling) sees only the small `Tokenizer` protocol. `encode_documents` is
the one bulk path: it turns many documents into one int32 stream with a separator between documents, using the fast
route each tokenizer offers (a single `np.frombuffer` for bytes, the Rust `encode_batch` for Hugging Face).
"""

from __future__ import annotations

import pathlib
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from jaxpar.config import ConfigError

# Special tokens that mark the end of a document in common tokenizers, in order of preference.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """text <-> ids. `eos_id` is the document separator, or None when the tokenizer has none (bytes)."""

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """text → token ids (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """token ids → text."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte: vocab 256, no special tokens, lossless for any text.

    `decode` uses errors="replace", so a sampled id sequence that cuts a multi-byte character still decodes.
    All instances are equal (and hash alike), so cached corpora are shared between them.
    """

    vocab_size: int = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes → text (invalid UTF-8 replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __eq__(self, other) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json.

    `encode` adds no special tokens (no BOS/CLS from a post-processor): the training stream places separators
    itself. `decode` keeps special tokens, so a sample shows where the model ended a document.
    `vocab_size` is one past the largest id, counting added tokens (ids need not be contiguous).
    Equality and hash follow the file path, so cached corpora are keyed on it.
    """

    def __init__(self, path: str | pathlib.Path):
        import tokenizers  # imported here: the byte tokenizer needs no native extension

        self.path = str(pathlib.Path(path).resolve())
        self._tok = tokenizers.Tokenizer.from_file(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)

    def encode(self, text: str) -> list[int]:
        """text → ids, without the post-processor's special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """text → (ids, the index in `text` of each token's first character), no special tokens added."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many documents at once; the Rust side spreads them over threads."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """ids → text, special tokens included."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizer) and other.path == self.path

    def __hash__(self) -> int:
        return hash((HFTokenizer, self.path))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def make_tokenizer(spec: str) -> Tokenizer:
    """"bytes" -> `ByteTokenizer`; otherwise a path to a tokenizer.json (or a directory holding one).

    Raises ConfigError("data.tokenizer", ...) when the file is missing or is not a tokenizer.json.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"  # a Hugging Face model directory
    if not path.is_file():
        raise ConfigError("data.tokenizer", spec, "tokenizer file not found",
                          "use 'bytes' or a path to a Hugging Face tokenizer.json")
    try:
        return HFTokenizer(path)
    except Exception as e:  # the Rust side raises a bare Exception for malformed JSON
        raise ConfigError("data.tokenizer", spec, f"could not be loaded as a Hugging Face tokenizer.json ({e})",
                          "point data.tokenizer at a tokenizer.json saved by the `tokenizers` library") from None


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raise ConfigError("model.vocab_size", ...) if the model's embedding cannot hold every token id."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size,
                          f"is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size} ids)",
                          f"set model.vocab_size >= {tokenizer.vocab_size} (round up to a multiple of 128 for speed)")


def separator_ids(tokenizer: Tokenizer) -> list[int]:
    """What goes between two documents: [eos_id] if the tokenizer has one, else the encoding of "\\n\\n".

    Why "\\n\\n" without an eos: a blank line already reads as a document break in text and source code, so the
    byte model learns nothing unnatural from it.
    """
    return [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n\n")


def encode_documents(tokenizer: Tokenizer, docs: Sequence[str | bytes]) -> np.ndarray:
    """Encode and join documents with `separator_ids` between them -> int32 [n_tokens].

    Documents may be `bytes` (UTF-8) to spare a decode on the byte path. The separator also follows the last
    document, so a stream built from concatenated splits or shards keeps every boundary.
    """
    if not docs:
        return np.zeros((0,), np.int32)
    if isinstance(tokenizer, ByteTokenizer):
        raw = [d if isinstance(d, bytes) else d.encode("utf-8") for d in docs]
        return np.frombuffer(b"\n\n".join(raw) + b"\n\n", np.uint8).astype(np.int32)
    texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in docs]
    encoded = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else map(tokenizer.encode, texts)
    sep = np.asarray(separator_ids(tokenizer), np.int32)
    parts = []
    for ids in encoded:
        parts += [np.asarray(ids, np.int32), sep]
    return np.concatenate(parts)


__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "make_tokenizer", "check_vocab", "encode_documents",
           "separator_ids"]
