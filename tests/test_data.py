"""Tokenizers, the four token sources, and the grain loader (order, process slices, resume)."""

import json
import pathlib

import numpy as np
import pytest

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import ByteTokenizer, Loader, check_vocab, load_tokens, make_loader, make_tokenizer
from jaxpar.data import sources
from jaxpar.data.tokenizers import encode_documents

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "tokenizer" / "tokenizer.json"
TEXT = "def f(x):\n    return 'héllo, wörld — 日本語 ✓'\n"
BYTES = ByteTokenizer()


def entropy_nats(ids: np.ndarray, vocab: int) -> float:
    p = np.bincount(ids, minlength=vocab) / len(ids)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers.


def test_byte_tokenizer_round_trip():
    tok = make_tokenizer("bytes")
    ids = tok.encode(TEXT)
    assert (tok.vocab_size, tok.eos_id) == (256, None)
    assert len(ids) == len(TEXT.encode("utf-8")) > len(TEXT)  # non-ASCII takes several bytes
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids[:-2] + [0xE6]).endswith("\ufffd")  # a cut multi-byte character decodes as U+FFFD


def test_hf_tokenizer_fixture_round_trip():
    tok = make_tokenizer(str(FIXTURE))
    assert tok.vocab_size == 512 and tok.eos_id is not None
    ids = tok.encode(TEXT)
    assert max(ids) < tok.vocab_size and len(ids) < len(TEXT.encode("utf-8"))  # BPE merges something
    assert tok.decode(ids) == TEXT
    assert make_tokenizer(str(FIXTURE.parent)) == tok  # a model directory holding tokenizer.json works too


def test_encode_documents_places_separators():
    tok = make_tokenizer(str(FIXTURE))
    stream = encode_documents(tok, ["a b", "c"])
    assert stream.dtype == np.int32 and list(stream).count(tok.eos_id) == 2  # after every document
    assert bytes(encode_documents(BYTES, ["a", b"b"]).astype(np.uint8)) == b"a\n\nb\n\n"


def test_missing_tokenizer_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer"):
        make_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="data.tokenizer"):
        make_tokenizer(str(tmp_path / "bad.json"))


def test_check_vocab():
    check_vocab(BYTES, 256)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        check_vocab(make_tokenizer(str(FIXTURE)), 256)


# ---------------------------------------------------------------------------------------------------------------------
# Sources.


def test_default_corpus_is_real_source_split_by_file():
    data = DataConfig(source="default")
    train = load_tokens(data, BYTES, "train", seq_len=128)
    held = load_tokens(data, BYTES, "eval", seq_len=128)
    assert train.dtype == held.dtype == np.int32 and len(train) > 10 * len(held) > 0
    docs = sources._stdlib_documents()
    train_files, eval_files = ({rel for rel, _ in docs[s]} for s in ("train", "eval"))
    assert train_files and eval_files and not train_files & eval_files
    assert all(sources.is_held_out(rel) for rel in eval_files)
    assert not any("site-packages" in rel for rel in train_files)
    # Deterministic: the cache returns the same array, and a fresh read gives the same one.
    assert load_tokens(data, BYTES, "train", seq_len=128) is train
    assert np.array_equal(sources._default_tokens.__wrapped__(BYTES, "train"), train)
    assert not train.flags.writeable
    assert 2.5 < entropy_nats(train, 256) < 3.8  # English-ish source code; random bytes would give log(256) = 5.5


def test_synthetic_is_deterministic_and_learnable():
    data = DataConfig(source="synthetic")
    train = load_tokens(data, BYTES, "train", seq_len=64, seed=3)
    assert np.array_equal(train, load_tokens(data, BYTES, "train", seq_len=64, seed=3))
    held = load_tokens(data, BYTES, "eval", seq_len=64, seed=3)
    assert not np.array_equal(train[: len(held)], held)
    assert train.min() >= 0 and train.max() < 256
    # Structure: within a word the next token is fixed, so H(next | previous) = H(bigram) - H(unigram) falls far
    # below H(unigram) (about 2 vs 5 nats); for independent random tokens the two would be equal.
    unigram = entropy_nats(train, 256)
    conditional = entropy_nats(train[:-1] * 256 + train[1:], 256 * 256) - unigram
    assert conditional < 0.6 * unigram


def write_text_corpus(root: pathlib.Path, n_files: int) -> dict[str, str]:
    """n_files .txt/.md files and one .jsonl, plus a binary and a hidden file that must be skipped."""
    texts = {}
    for i in range(n_files):
        rel = f"sub{i % 3}/doc{i:02d}.{'txt' if i % 2 else 'md'}"
        texts[rel] = f"document {i}: " + "the quick brown fox. " * 5
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_text(texts[rel])
    records = [{"text": "jsonl record one", "id": 1}, {"text": "jsonl record two ü", "id": 2}]
    (root / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    texts["records.jsonl"] = "jsonl record one\n\njsonl record two ü"
    (root / "image.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x81]) * 8)
    (root / ".hidden.txt").write_text("SECRET")
    return texts


def test_text_source_splits_directory_by_file(tmp_path):
    texts = write_text_corpus(tmp_path, n_files=60)
    data = DataConfig(source="text", path=str(tmp_path))
    split = {s: bytes(load_tokens(data, BYTES, s, seq_len=8).astype(np.uint8)).decode() for s in ("train", "eval")}
    assert split["eval"]  # 60 files: some hash to eval
    for rel, text in texts.items():
        assert text in split["eval" if sources.is_held_out(rel) else "train"]
    both = split["train"] + split["eval"]
    assert '"id"' not in both and "SECRET" not in both and "\ufffd" not in both


def test_text_source_single_file_holds_out_its_tail(tmp_path):
    (tmp_path / "one.txt").write_text("abcdefghij" * 100)
    data = DataConfig(source="text", path=str(tmp_path / "one.txt"))
    train, held = (load_tokens(data, BYTES, s, seq_len=8) for s in ("train", "eval"))
    stream = np.concatenate([train, held])
    assert len(held) == int(0.05 * len(stream)) and bytes(stream.astype(np.uint8)) == b"abcdefghij" * 100 + b"\n\n"


def test_text_source_bad_jsonl_raises(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match="data.path"):
        load_tokens(DataConfig(source="text", path=str(tmp_path)), BYTES, "train", seq_len=8)


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_tokens_source_memmap(tmp_path, suffix):
    ids = (np.arange(10_000) * 7 % 251).astype(np.uint16)
    path = tmp_path / f"ids{suffix}"
    np.save(path, ids.astype(np.int32)) if suffix == ".npy" else ids.tofile(path)
    data = DataConfig(source="tokens", path=str(path))
    train, held = (load_tokens(data, BYTES, s, seq_len=16) for s in ("train", "eval"))
    assert (len(train), len(held)) == (9_500, 500)
    assert np.array_equal(np.concatenate([train, held]), ids)
    batch = next(make_loader(train, batch_size=4, seq_len=16, seed=0))
    assert batch.dtype == np.int32 and batch.shape == (4, 17)


def test_tokens_source_rejects_ids_outside_vocab(tmp_path):
    path = tmp_path / "ids.bin"
    np.array([1, 2, 300, 4] * 100, np.uint16).tofile(path)
    with pytest.raises(ConfigError, match="300"):
        load_tokens(DataConfig(source="tokens", path=str(path)), BYTES, "train", seq_len=8)


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_missing_path_raises_config_error(tmp_path, source):
    with pytest.raises(ConfigError, match="data.path"):
        load_tokens(DataConfig(source=source, path=str(tmp_path / "missing")), BYTES, "train", seq_len=8)


def test_too_few_tokens_raises_config_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 50)
    with pytest.raises(ConfigError, match="seq_len"):
        load_tokens(DataConfig(source="text", path=str(tmp_path)), BYTES, "train", seq_len=128)
    (tmp_path / "tiny.txt").write_text("")
    with pytest.raises(ConfigError, match="no UTF-8 text"):
        load_tokens(DataConfig(source="text", path=str(tmp_path)), BYTES, "train", seq_len=8)


# ---------------------------------------------------------------------------------------------------------------------
# Loader. The stream is 0, 1, 2, ... so a row's first id tells which window it is.

T = 16
STREAM = np.arange(T * 61 + 1, dtype=np.int32)  # 61 windows: prime, so batches run across epoch boundaries


def take(loader: Loader, n: int) -> list[np.ndarray]:
    return [next(loader) for _ in range(n)]


def test_loader_rows_are_shifted_windows():
    batches = take(make_loader(STREAM, batch_size=6, seq_len=T, seed=0), 12)
    for b in batches:
        assert b.shape == (6, T + 1) and b.dtype == np.int32
        assert np.all(b[:, 0] % T == 0)                       # window i starts at i*T
        assert np.array_equal(b[:, 1:], b[:, :-1] + 1)        # targets = inputs shifted by one
    again = take(make_loader(STREAM, batch_size=6, seq_len=T, seed=0), 12)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    other_seed = take(make_loader(STREAM, batch_size=6, seq_len=T, seed=1), 12)
    assert not all(np.array_equal(a, b) for a, b in zip(batches, other_seed))


def test_loader_epochs_cover_every_window_in_new_orders():
    starts = np.concatenate(list(make_loader(STREAM, batch_size=1, seq_len=T, seed=0, num_epochs=2)))[:, 0] // T
    first, second = starts[:61], starts[61:]
    assert sorted(first) == sorted(second) == list(range(61)) and not np.array_equal(first, second)
    in_order = take(make_loader(STREAM, batch_size=4, seq_len=T, seed=0, shuffle=False), 2)
    assert np.array_equal(np.concatenate(in_order)[:, 0], np.arange(8) * T)
    finite = list(make_loader(STREAM, batch_size=4, seq_len=T, seed=0, num_epochs=1))
    assert len(finite) == 61 // 4  # the partial last batch is dropped


@pytest.mark.parametrize("process_count", [2, 4])
def test_loader_process_slices_match_reference(process_count):
    global_batches = take(make_loader(STREAM, batch_size=8, seq_len=T, seed=5), 10)
    per_process = [take(make_loader(STREAM, batch_size=8, seq_len=T, seed=5, process_index=p,
                                    process_count=process_count), 10) for p in range(process_count)]
    for step, reference in enumerate(global_batches):
        assert np.array_equal(np.concatenate([rows[step] for rows in per_process]), reference)


def test_loader_state_resumes_exactly():
    loader = make_loader(STREAM, batch_size=6, seq_len=T, seed=2)
    take(loader, 3)
    state = json.loads(json.dumps(loader.get_state()))
    expected = take(loader, 2)
    resumed = make_loader(STREAM, batch_size=6, seq_len=T, seed=2)
    resumed.set_state(state)
    assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 2), expected))
    # The state is a global batch index, so a run may resume on a different number of processes.
    half = make_loader(STREAM, batch_size=6, seq_len=T, seed=2, process_index=1, process_count=2)
    half.set_state(state)
    assert np.array_equal(next(half), expected[0][3:])
    with pytest.raises(ValueError, match="seed"):
        make_loader(STREAM, batch_size=6, seq_len=T, seed=3).set_state(state)


def test_prefetching_loader_places_the_same_batches_and_keeps_its_state():
    """With `place`, a background thread runs ahead (here 3 batches), yet every batch, the state after each, and a
    resume from that state are those of the plain loader: the state counts batches handed out, not prefetched."""
    import jax

    plain = make_loader(STREAM, batch_size=6, seq_len=T, seed=2)
    placed = make_loader(STREAM, batch_size=6, seq_len=T, seed=2, place=jax.device_put, prefetch=3)
    for _ in range(4):
        batch = next(placed)
        assert isinstance(batch, jax.Array) and np.array_equal(np.asarray(batch), next(plain))
        assert placed.get_state() == plain.get_state()
    resumed = make_loader(STREAM, batch_size=6, seq_len=T, seed=2, place=jax.device_put, prefetch=3)
    resumed.set_state(placed.get_state())
    expected = take(plain, 2)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(take(resumed, 2), expected))
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(take(placed, 2), expected))
    placed.close(), resumed.close()
    with pytest.raises(ValueError, match="prefetch"):
        make_loader(STREAM, batch_size=6, seq_len=T, seed=2, place=jax.device_put, prefetch=-1)


def test_loader_rejects_uneven_process_split():
    with pytest.raises(ValueError, match="divisible"):
        make_loader(STREAM, batch_size=6, seq_len=T, seed=0, process_count=4)
