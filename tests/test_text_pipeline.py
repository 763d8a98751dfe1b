"""`jaxpar.infer.pipeline("text-generation", model=…)` returns what transformers' pipeline returns, for a prompt, a
list of prompts, num_return_sequences, return_full_text and chat messages (the llama HF fixture given a ChatML
template), with greedy text equal to `generate_text`'s; what it does not implement is refused by name."""

import pytest

import jaxpar.infer
from jaxpar.errors import GenerateError
from jaxpar.data.chat import render_chat
from jaxpar.infer.text import generate_text

from test_serve_http import CHATML, PROMPT, chatml_copy


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return jaxpar.infer.pipeline("text-generation", model=chatml_copy(tmp_path_factory))


def test_structures_and_greedy_text(pipe):
    new = generate_text(pipe.loaded, [PROMPT], max_new_tokens=6, temperature=0.0)[0]
    assert pipe(PROMPT, max_new_tokens=6) == [{"generated_text": PROMPT + new}]  # do_sample defaults to False
    assert pipe(PROMPT, max_new_tokens=6, return_full_text=False) == [{"generated_text": new}]
    both = pipe([PROMPT, "x = "], max_new_tokens=6)
    assert len(both) == 2 and both[0] == [{"generated_text": PROMPT + new}] and len(both[1]) == 1
    sampled = pipe(PROMPT, max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=4)
    assert len(sampled) == 3 and all(s["generated_text"].startswith(PROMPT) for s in sampled)
    assert sampled == pipe(PROMPT, max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=4)


def test_chat_messages(pipe):
    messages = [{"role": "user", "content": "Hello"}]
    reply = generate_text(pipe.loaded, [render_chat(CHATML, messages, {})], max_new_tokens=5, temperature=0.0)[0]
    assert pipe(messages, max_new_tokens=5) == [{"generated_text": messages + [{"role": "assistant",
                                                                               "content": reply}]}]
    assert pipe([messages, messages], max_new_tokens=5, return_full_text=False) == [[{"generated_text": reply}]] * 2


@pytest.mark.parametrize("call,words", [
    (lambda p: p(PROMPT, num_beams=2), "num_beams"),
    (lambda p: p(PROMPT, num_return_sequences=0), "num_return_sequences"),
    (lambda p: p(42), "text_inputs"),
    (lambda p: p(PROMPT, max_new_tokens=6, do_sample=True, temperature=-1.0), "temperature"),
    (lambda p: jaxpar.infer.pipeline("summarization", model=p.loaded), "text-generation"),
])
def test_refusals(pipe, call, words):
    with pytest.raises(GenerateError, match=words):
        call(pipe)
