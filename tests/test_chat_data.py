"""Chat data for SFT (jaxpar/data/chat.py): conversations rendered with the tokenizer's own template, the assistant's
tokens — and only they — scored; rows, splits and the errors for data that cannot work; then a real fine-tune of an
imported Hugging Face model on 8 devices that learns the format."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import make_tokenizer
from jaxpar.data.chat import chat_template_of, encode_with_starts, load_chat_rows, render_with_mask
from jaxpar.data.tokenizers import ByteTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"

# ChatML (Qwen's, without the default system prompt): each turn "<|im_start|>role\ncontent<|im_end|>\n"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "4 + 4 = 8."}]


@pytest.fixture(scope="module")
def chat_dir():
    """The llama fixture: a transformers-written model, its BPE tokenizer and a ChatML chat template."""
    d = FIXTURES / "llama"
    assert chat_template_of(d)[0] == CHATML
    return d


@pytest.mark.parametrize("bpe", [False, True], ids=["bytes", "bpe"])
def test_the_assistant_turns_and_their_end_of_turn_are_scored(chat_dir, bpe):
    tokenizer = make_tokenizer(str(chat_dir / "tokenizer.json")) if bpe else ByteTokenizer()
    template = chat_template_of(chat_dir)
    ids, scored = render_with_mask(tokenizer, template, TALK)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in TALK)
    assert tokenizer.decode(ids) == text and ids == tokenizer.encode(text)  # the whole text, tokenized once
    assert scored_runs(tokenizer, ids, scored) == ["2 + 3 = 5.<|im_end|>\n", "4 + 4 = 8.<|im_end|>\n"]


# ChatML whose assistant turns are marked `{% generation %}` (transformers' return_assistant_tokens_mask reads these)
GENERATION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
              "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
              "message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("bpe", [False, True], ids=["bytes", "bpe"])
def test_a_template_that_marks_the_generation_is_read_as_transformers_reads_it(chat_dir, bpe):
    """With `{% generation %}` blocks the mask is theirs: the content and <|im_end|>, not the newline after it.
    (Checked against transformers 5.24's apply_chat_template(return_assistant_tokens_mask=True) on 51
    conversations with the llama fixture's tokenizer: ids and masks equal.)"""
    tokenizer = make_tokenizer(str(chat_dir / "tokenizer.json")) if bpe else ByteTokenizer()
    ids, scored = render_with_mask(tokenizer, (GENERATION, {}), TALK)
    assert tokenizer.decode(ids) == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in TALK)
    assert scored_runs(tokenizer, ids, scored) == ["2 + 3 = 5.<|im_end|>", "4 + 4 = 8.<|im_end|>"]


def scored_runs(tokenizer, ids, scored) -> list[str]:
    """The text of each run of scored tokens."""
    runs, run = [], []
    for i, s in zip(ids, scored + [0]):
        if s:
            run.append(i)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs + ([tokenizer.decode(run)] if run else [])


def test_character_starts_follow_utf8_bytes():
    ids, starts = encode_with_starts(ByteTokenizer(), "aé€b")
    assert ids == list("aé€b".encode()) and starts == [0, 1, 1, 2, 2, 2, 3]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_splits_and_padding(chat_dir, tmp_path):
    rows = [{"messages": TALK[1:3]}] * 30 + [{"prompt": "Q: 1+1?\nA: ", "completion": "2"}] * 10
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    data = DataConfig(source="chat", path=str(path), tokenizer=str(chat_dir / "tokenizer.json"))
    tokenizer = make_tokenizer(data.tokenizer)
    train, held = (load_chat_rows(data, tokenizer, s, 96) for s in ("train", "eval"))
    assert train["tokens"].shape == (38, 97) and held["tokens"].shape == (2, 97)  # rows 19 and 39 held out
    # a prompt/completion row: the completion and the eos scored, the padding after them (eos ids) not
    last = train["tokens"][-1], train["mask"][-1]
    n = len(tokenizer.encode("Q: 1+1?\nA: 2")) + 1
    assert tokenizer.decode(last[0][last[1] == 1]) == "2<|endoftext|>" and not last[1][n:].any()
    assert (last[0][n:] == tokenizer.eos_id).all()


@pytest.mark.parametrize("rows,tokenizer,field,needle", [
    ([{"messages": TALK[1:2]}], "chat", "data.path", "line 1 has no assistant turn"),
    (["not json"], "chat", "data.path", "line 1 is not JSON"),
    ([{"messages": [{"role": "user"}]}], "chat", "data.path", "without a string 'role' and 'content'"),
    ([{"text": "hello"}], "chat", "data.path", "neither"),
    ([{"messages": TALK}], "bytes", "data.tokenizer", "has no chat template"),
    ([{"prompt": "x" * 80, "completion": "y"}], "bytes", "train.seq_len", "is 81 tokens"),
])
def test_bad_chat_data_names_the_field_and_the_line(chat_dir, tmp_path, rows, tokenizer, field, needle):
    path = tmp_path / "c.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows * 3))
    spec = "bytes" if tokenizer == "bytes" else str(chat_dir / "tokenizer.json")
    data = DataConfig(source="chat", path=str(path), tokenizer=spec)
    with pytest.raises(ConfigError, match=needle) as info:
        load_chat_rows(data, make_tokenizer(spec), "train", 64)
    assert info.value.field == field


def test_a_template_whose_prefixes_do_not_extend_is_refused(chat_dir, tmp_path):
    """A template that numbers turns from the end renders a shorter conversation differently."""
    d = tmp_path / "odd"
    shutil.copytree(chat_dir, d)
    odd = "{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": odd, "eos_token": "<|endoftext|>"}))
    data = DataConfig(source="chat", path=str(write_jsonl(tmp_path / "c.jsonl", [{"messages": TALK[1:3]}] * 2)),
                      tokenizer=str(d / "tokenizer.json"))
    with pytest.raises(ConfigError, match="cannot be told apart"):
        load_chat_rows(data, make_tokenizer(data.tokenizer), "train", 64)


def fit_recipe(monkeypatch, tmp_path, overrides):
    """recipes/sft_tiny.yaml from the llama fixture with `overrides` → its history (steps 1 and the last)."""
    from jaxpar.config import load_config
    from jaxpar.interop import hf
    from jaxpar.train import fit

    monkeypatch.chdir(ROOT)
    config = load_config("recipes/sft_tiny.yaml", ["train.steps=40", "train.eval_every=40", "train.log_every=40",
                                                   *overrides])
    history = fit(hf.init_config(config, FIXTURES / "llama"), tmp_path / "w", progress=False).history
    assert [h["step"] for h in history] == [1, 40], history
    return history


def test_the_sft_recipe_learns_the_format(monkeypatch, tmp_path):
    """recipes/sft_tiny.yaml at (data, pipe, tensor) = (2, 2, 2) SP: 40 steps take the loss on the assistant's
    tokens to under 0.3 of the first step's on held-out conversations (measured 9.76 → 2.46; the whole 150-step
    recipe ends at 0.94 held out), every step scoring only the assistant's ~21 tokens a conversation."""
    first, last = fit_recipe(monkeypatch, tmp_path, [])
    assert last["eval_loss"] < 0.3 * first["loss"], (first, last)
    assert all(10 * 16 < h["targets"] < 40 * 16 for h in (first, last))  # 16 rows of ~21 scored tokens


def test_packed_prompt_completion_pairs_train_through_the_pipeline(monkeypatch, tmp_path):
    """The recipe's layout on short prompt/completion rows, best-fit packed (~10 a row of 129): the rows fill
    (packing > 0.9, measured 0.98 and 0.99), the circular pipeline runs each microbatch under its own documents,
    and the held-out loss on the completions (and eos) falls under half the first step's (measured 9.89 → 2.54)."""
    rng = np.random.default_rng(1)
    pairs = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in rng.integers(0, 50, (400, 2))]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    first, last = fit_recipe(monkeypatch, tmp_path, [f"data.path={path}", "data.pack=true"])
    assert first["packing"] > 0.9 and last["packing"] > 0.9, (first, last)
    assert last["eval_loss"] < 0.5 * first["loss"], (first, last)


def test_packing_keeps_each_conversation_whole_and_resumes(chat_dir):
    """Best-fit packing (grain's packer in the loader): every packed document is one conversation, whole, with its
    mask; rows fill far better than one conversation a row; a loader restored from a saved state continues with
    the same batches."""
    from jaxpar.data import make_loader

    rng = np.random.default_rng(0)
    rows = [{"messages": [{"role": "user", "content": "x" * int(rng.integers(1, 40))},
                          {"role": "assistant", "content": "y" * int(rng.integers(1, 20))}]} for _ in range(60)]
    tokenizer = ByteTokenizer()  # byte rows rendered with the llama fixture's ChatML
    template = chat_template_of(chat_dir)
    whole = [render_with_mask(tokenizer, template, r["messages"]) for r in rows]
    T = 320
    docs = {"tokens": np.zeros((60, T + 1), np.int32), "mask": np.zeros((60, T + 1), np.int32),
            "lengths": np.asarray([len(ids) for ids, _ in whole], np.int32)}
    for i, (ids, scored) in enumerate(whole):
        docs["tokens"][i, :len(ids)], docs["mask"][i, :len(ids)] = ids, scored
    loader = make_loader(docs, batch_size=4, seq_len=T, seed=3, pack=True)
    unpacked = make_loader(docs, batch_size=4, seq_len=T, seed=3)
    seen, filled, one_a_row = set(), [], []
    for _ in range(5):
        batch, plain = next(loader), next(unpacked)
        assert set(batch) == {"tokens", "mask", "segments"} and batch["tokens"].shape == (4, T + 1)
        for row, mask, seg in zip(batch["tokens"], batch["mask"], batch["segments"]):
            for s in set(seg.tolist()) - {0}:
                at = np.flatnonzero(seg == s)
                assert (np.diff(at) == 1).all()  # a document is one run
                i = next(i for i, (ids, _) in enumerate(whole) if ids == row[at].tolist())
                assert mask[at].tolist() == whole[i][1]
                seen.add(i)
        filled.append((batch["segments"] > 0).mean())
        one_a_row.append((plain["segments"] > 0).mean())
    assert len(seen) > 5 * 4 and np.mean(filled) > 0.85 > 1.5 * np.mean(one_a_row)  # measured 0.90 and 0.29
    state = loader.get_state()
    want = [next(loader) for _ in range(2)]
    loader.close()
    again = make_loader(docs, batch_size=4, seq_len=T, seed=3, pack=True)
    again.set_state(state)
    for w in want:
        got = next(again)
        assert all((got[k] == w[k]).all() for k in w)
    again.close()
    unpacked.close()
