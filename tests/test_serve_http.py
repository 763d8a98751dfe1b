"""`jaxpar serve` as a real process on a loopback port, driven by the `openai` Python client and plain HTTP (httpx):
completions and chat (a copy of the Hugging Face llama fixture given a ChatML template), streaming whose pieces add
up to the whole text, greedy text equal to `jaxpar generate`'s, 32 concurrent clients with zero errors, a client that
disconnects mid-stream (its request aborted, its pages freed, the server serving on), Prometheus metrics, the status
of each kind of bad request, tensor 2 giving tensor 1's text, and SIGTERM draining the requests in flight.
Back-pressure (429) and the API key run in-process, on a one-row engine with a one-request queue."""

import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxpar.launch import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
PROMPT = "def fibonacci(n):"


def start(model_dir, *flags) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--max-batch", "4", "--page-size", "8", "--prefill-chunk", "16", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"jaxpar serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("jaxpar serve did not come up in 300 s")


def chatml_copy(tmp_path_factory) -> pathlib.Path:
    """A copy of the llama HF fixture whose tokenizer_config.json has the ChatML template."""
    model_dir = tmp_path_factory.mktemp("chatml") / "llama"
    shutil.copytree(FIXTURE, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=CHATML)))
    return model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = chatml_copy(tmp_path_factory)
    proc, url = start(model_dir)
    yield url, model_dir
    proc.terminate()
    proc.wait(timeout=60)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_completions_chat_and_streaming_with_the_openai_client(server):
    from openai import OpenAI

    from jaxpar.infer.text import generate_text, load
    from jaxpar.data.chat import render_chat

    url, model_dir = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["llama"]
    got = client.completions.create(model="llama", prompt=PROMPT, max_tokens=12, temperature=0)
    want = generate_text(load(FIXTURE), [PROMPT], max_new_tokens=12, temperature=0.0)[0]
    assert got.choices[0].text == want  # (the fixture's model says its eos token within the 12: both stop there)
    assert got.choices[0].finish_reason in ("stop", "length") and got.usage.completion_tokens <= 12
    pieces = [c.choices[0].text for c in client.completions.create(model="llama", prompt=PROMPT, max_tokens=12,
                                                                   temperature=0, stream=True)]
    assert "".join(pieces) == want and len(pieces) > 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="llama", messages=messages, max_tokens=6, temperature=0)
    rendered = render_chat(CHATML, messages, {})
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nBe brief.<|im_end|>" in rendered
    plain = client.completions.create(model="llama", prompt=rendered, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="llama", messages=messages, max_tokens=6, temperature=0, stream=True)]
    assert "".join(deltas) == plain.choices[0].text
    two = client.completions.create(model="llama", prompt=[PROMPT, "x = "], max_tokens=3, n=2, temperature=0)
    assert [c.text for c in two.choices][:2] == [want[:len(two.choices[0].text)]] * 2  # n copies, greedy alike


def test_concurrent_clients_disconnects_and_metrics(server):
    url, _ = server

    def one(i):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"{PROMPT} # {i}", "max_tokens": 5 + i % 7,
                                                      "temperature": 0.7, "seed": i}, timeout=300)
        return r.status_code, len(r.json()["choices"][0]["text"]) if r.status_code == 200 else r.text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(64)))
    assert [status for status, _ in results] == [200] * 64, results
    # a client that reads one event and hangs up: the server aborts its request and frees its pages
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "stream": True},
                      timeout=60) as stream:
        next(stream.iter_lines())
    deadline = time.time() + 30
    while (metric(url, "jaxpar_requests_running") or metric(url, "jaxpar_kv_pages_used")) and time.time() < deadline:
        time.sleep(0.2)
    assert metric(url, "jaxpar_requests_running") == 0 and metric(url, "jaxpar_kv_pages_used") == 0
    assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert metric(url, "jaxpar_time_to_first_token_seconds_count") >= 64
    assert metric(url, "jaxpar_generation_tokens_total") >= 64 * 5
    assert metric(url, "jaxpar_prefix_cache_queries_total") > 0


@pytest.mark.parametrize("body,status,words", [
    ('{"prompt": ', 400, "not valid JSON"),
    ('{"prompt": "x", "best_of": 2}', 422, "unknown parameter 'best_of'"),
    ('{"prompt": "x", "max_tokens": -3}', 422, "max_tokens"),
    ('{"prompt": "x", "temperature": -1}', 422, "temperature"),
    ('{"prompt": "x", "n": 9}', 400, "n = 9"),
    ('{"prompt": "x", "max_tokens": 500}', 400, "max_tokens"),
    ('{"prompt": "' + "word " * 200 + '"}', 413, "context"),
    ('{"prompt": ""}', 400, "empty"),
])
def test_bad_requests_get_their_status_and_the_server_goes_on(server, body, status, words):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message
    assert httpx.get(url + "/health").status_code == 200


def test_tensor_parallel_server_and_sigterm_draining():
    """`--tensor 2` (the engine in the explicit plan's shard_map): the greedy text is tensor 1's; then SIGTERM with
    a request in flight — it finishes, and the server exits."""
    from jaxpar.infer.text import generate_text, load

    proc, url = start(FIXTURE, "--tensor", "2")
    got = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
                     timeout=120).json()["choices"][0]["text"]
    assert got == generate_text(load(FIXTURE), [PROMPT], max_new_tokens=12, temperature=0.0)[0]
    results = []
    thread = threading.Thread(target=lambda: results.append(httpx.post(
        url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0}, timeout=120)))
    thread.start()
    deadline = time.time() + 30
    while not metric(url, "jaxpar_requests_running") and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    # uvicorn stops accepting, finishes the request in flight, then re-raises the signal it caught
    assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
    assert results and results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 40 or results[0].json()["choices"][0][
        "finish_reason"] == "stop"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_a_quantized_server_answers_with_the_quantized_models_text():
    """`jaxpar serve --quantize int4` (weights quantized at load, groups of the default size): the greedy completion
    over HTTP is the text `generate` gives the same int4 model."""
    from jaxpar.infer.text import generate_text, load

    proc, url = start(FIXTURE, "--quantize", "int4")
    try:
        got = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
                         timeout=120).json()["choices"][0]["text"]
        assert got == generate_text(load(FIXTURE, quantize="int4"), [PROMPT], max_new_tokens=12, temperature=0.0)[0]
        assert got != generate_text(load(FIXTURE), [PROMPT], max_new_tokens=12, temperature=0.0)[0]  # int4 shows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_back_pressure_and_the_api_key_in_process():
    """A one-row engine with a one-request queue: of 6 simultaneous long requests some get 429 with a one-line
    message, the rest finish; without the key (or with a wrong one) /v1 answers 401, /health stays open."""
    import uvicorn
    from flax import nnx

    from jaxpar.config import ModelConfig
    from jaxpar.data.tokenizers import ByteTokenizer
    from jaxpar.model import Transformer
    from jaxpar.serve.engine import Engine, EngineConfig
    from jaxpar.serve.server import EngineThread, build_app

    cfg = ModelConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                      max_seq_len=96)
    engine = EngineThread(Engine(Transformer(cfg, rngs=nnx.Rngs(0)), EngineConfig(max_batch=1, max_queue=1,
                                                                                 page_size=8, prefill_chunk=8)))
    app = build_app(engine, ByteTokenizer(), model_name="bytes", api_key="sesame")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
        auth = {"authorization": "Bearer sesame"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "bytes"

        def one(i):
            return httpx.post(url + "/v1/completions", headers=auth, timeout=120,
                              json={"prompt": "abc", "max_tokens": 60, "temperature": 0})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(one, range(6)))
        statuses = sorted(r.status_code for r in responses)
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, statuses
        refused = next(r for r in responses if r.status_code == 429).json()["error"]
        assert refused["type"] == "rate_limit_error" and "\n" not in refused["message"]
    finally:
        server.should_exit = True
        engine.close()
