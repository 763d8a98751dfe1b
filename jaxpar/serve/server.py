"""`jaxpar serve`: an OpenAI-compatible HTTP server over the continuous-batching engine, on FastAPI (Starlette) and
uvicorn, with Server-Sent Events from sse-starlette and Prometheus metrics from prometheus_client.

    GET  /health               {"status": "ok"}
    GET  /v1/models            the one model served
    POST /v1/completions       prompt (a string or a list of them), max_tokens, temperature, top_p, top_k, n,
                               stop, seed, stream
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template (tokenizer_config.json's, as
                               Hugging Face renders it: jaxpar.data.chat); 404 where the model has none
    GET  /metrics              Prometheus: running / waiting requests, KV pages in use, prefix-cache hits, time to
                               first token and inter-token latency histograms, generated tokens and tokens/s

The engine runs on a thread of its own (`EngineThread`): handlers submit requests under its lock, and each
request's tokens come back to its handler through an asyncio queue. A client that disconnects mid-stream has its
request aborted, so its row and pages are freed at once. Errors are OpenAI's shape, {"error": {"message": one line,
"type", "code"}}: 400 a malformed request (broken JSON, an empty prompt, prompt + max_tokens past the context, n too
large), 401 a missing or wrong API key, 413 a prompt longer than the context, 422 an unknown parameter or a value
out of range, 429 a full queue. On SIGTERM uvicorn stops accepting connections and waits for the requests in
flight before the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import threading
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxpar.errors import GenerateError, JaxparError, Overloaded, RequestError
from jaxpar.data.chat import chat_template_of, render_chat
from jaxpar.serve.engine import Engine, Request, SamplingParams


class Sampling(BaseModel):
    """The sampling fields /v1/completions and /v1/chat/completions share (OpenAI's, and vLLM's top_k); any other
    field is refused (422), not ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, description="new tokens at most (default 16; chat: up to the context)")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class Completion(Sampling):
    """/v1/completions: a prompt, or a list of prompts (each gets n choices)."""

    prompt: str | list[str]


class Message(BaseModel):
    """One chat message; fields besides role and content pass through to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class Chat(Sampling):
    """/v1/chat/completions: the conversation so far."""

    messages: list[Message]


class EngineThread:
    """The engine, stepped on a background thread whenever it has work; every engine call holds `lock`."""

    def __init__(self, engine: Engine, mesh=None):
        self.engine, self.mesh = engine, mesh
        self.lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="jaxpar-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import jax

        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            while True:
                with self.lock:
                    while not self.engine.has_work and not self._stop:
                        self.lock.wait()
                    if self._stop:
                        return
                    self.engine.step()

    def submit(self, prompt: list[int], params: SamplingParams, on_token, on_finish) -> Request:
        """`Engine.submit`, and wake the loop."""
        with self.lock:
            r = self.engine.submit(prompt, params, on_token=on_token, on_finish=on_finish)
            self.lock.notify()
            return r

    def abort(self, request: Request) -> None:
        """`Engine.abort`: the request's row and pages are free when this returns."""
        with self.lock:
            self.engine.abort(request)

    def stats(self) -> dict[str, float]:
        """`Engine.stats`, read between steps."""
        with self.lock:
            return self.engine.stats()

    def close(self) -> None:
        """Stop the loop after the step it is in."""
        with self.lock:
            self._stop = True
            self.lock.notify()
        self._thread.join(timeout=30)


class Metrics:
    """The Prometheus registry: gauges and counters read from the engine on scrape, latency histograms observed as
    tokens arrive, and tokens/s over the last `window` seconds."""

    def __init__(self, engine: EngineThread, window: float = 10.0):
        from prometheus_client import CollectorRegistry, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("jaxpar_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=buckets, registry=self.registry)
        self.itl = Histogram("jaxpar_inter_token_latency_seconds", "seconds between a request's consecutive tokens",
                             buckets=buckets, registry=self.registry)
        self.window, self.recent = window, collections.deque()
        metrics = self

        class FromEngine:
            def collect(self):
                s = engine.stats()
                for name, key, doc in (("jaxpar_requests_running", "running", "requests in the running batch"),
                                       ("jaxpar_requests_waiting", "waiting", "requests queued for a row"),
                                       ("jaxpar_kv_pages_used", "pages_used", "KV-cache pages some sequence holds"),
                                       ("jaxpar_kv_pages_total", "pages_total", "KV-cache pages in the pool")):
                    yield GaugeMetricFamily(name, doc, value=s[key])
                yield GaugeMetricFamily("jaxpar_generation_tokens_per_second", "tokens generated per second over "
                                        f"the last {metrics.window:g} s", value=metrics.rate())
                for name, key, doc in (("jaxpar_prefix_cache_hits", "prefix_hits", "prompt pages found in the "
                                        "prefix cache"),
                                       ("jaxpar_prefix_cache_queries", "prefix_queries", "prompt pages looked up"),
                                       ("jaxpar_generation_tokens", "generated_tokens", "tokens generated"),
                                       ("jaxpar_prefill_calls", "prefill_calls", "prefill program calls"),
                                       ("jaxpar_decode_calls", "decode_calls", "decode program calls")):
                    yield CounterMetricFamily(name, doc, value=s[key])

        self.registry.register(FromEngine())

    def token(self, request: Request) -> None:
        """Record a request's newest token (called on the engine thread)."""
        times = request.token_times
        if len(times) == 1:
            self.ttft.observe(times[0] - request.submitted)
        else:
            self.itl.observe(times[-1] - times[-2])
        now = times[-1]
        self.recent.append(now)
        while self.recent and self.recent[0] < now - self.window:
            self.recent.popleft()

    def rate(self) -> float:
        """Tokens generated per second over the last `window` seconds."""
        now = time.perf_counter()
        return sum(1 for t in list(self.recent) if t >= now - self.window) / self.window


def build_app(engine: EngineThread, tokenizer, *, model_name: str, api_key: str | None = None,
              chat_template: str | None = None, special_tokens: dict[str, Any] | None = None):
    """The FastAPI application serving `engine` (an `EngineThread`) with `tokenizer` (encode / decode)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from sse_starlette.sse import EventSourceResponse

    metrics = Metrics(engine)
    max_batch = engine.engine.config.max_batch

    app = FastAPI(title="jaxpar", docs_url=None, redoc_url=None)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": " ".join(message.split()), "type": kind, "code": status}},
                            status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error(400, "the request body is not valid JSON")
        e = errors[0]
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        if e.get("type") == "extra_forbidden":
            return error(422, f"unknown parameter {where!r}: this server does not support it")
        return error(422, f"{where}: {e.get('msg', 'invalid')}")

    @app.exception_handler(JaxparError)
    async def refused(_, exc: JaxparError):
        status = getattr(exc, "status", 400)
        return error(status, str(exc), "rate_limit_error" if isinstance(exc, Overloaded) else "invalid_request_error")

    @app.middleware("http")
    async def authorize(request: HTTPRequest, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxpar"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def sampling(body: Sampling, default_max: int, index: int) -> SamplingParams:
        if body.n < 1 or body.n > max_batch:
            raise RequestError(f"n = {body.n}: must lie in [1, {max_batch}] (the engine's rows)", 400)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return SamplingParams(max_tokens=body.max_tokens if body.max_tokens is not None else default_max,
                              temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              seed=None if body.seed is None else body.seed + index, stop=stop)

    async def run(prompts: list[list[int]], body: Sampling, default_max) -> list[tuple[Request, asyncio.Queue]]:
        """Submit n requests a prompt; each gets a queue of ("token", id) and ("finish", reason) events."""
        loop = asyncio.get_running_loop()
        out = []
        try:
            for prompt in prompts:
                for i in range(body.n):
                    queue: asyncio.Queue = asyncio.Queue()

                    def on_token(r, token, queue=queue):
                        metrics.token(r)
                        loop.call_soon_threadsafe(queue.put_nowait, ("token", token))

                    def on_finish(r, queue=queue):
                        loop.call_soon_threadsafe(queue.put_nowait, ("finish", r.finish_reason))

                    params = sampling(body, default_max(len(prompt)), i)
                    out.append((engine.submit(prompt, params, on_token, on_finish), queue))
        except JaxparError:
            for r, _ in out:
                engine.abort(r)
            raise
        return out

    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        if not ids:
            raise RequestError("the prompt is empty: it needs at least one token", 400)
        return ids

    def usage(prompts, requests) -> dict:
        p = sum(len(x) for x in prompts) * (len(requests) // max(1, len(prompts)))
        c = sum(len(r.tokens) for r, _ in requests)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def visible(r: Request) -> list[int]:
        """r's tokens without a stop token that ends them (the engine's eos or the request's stop ids)."""
        stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(engine.engine.eos))
        return r.tokens[:-1] if r.tokens and r.tokens[-1] in stops else r.tokens

    def text_of(r: Request) -> str:
        """The output text: cut before a stop string; without the stop token that ended it."""
        if r.text is not None and r.params.stop and r.finish_reason == "stop":
            return r.text
        return tokenizer.decode(visible(r))

    async def finished(requests) -> None:
        for r, queue in requests:
            while (await queue.get())[0] != "finish":
                pass

    async def respond(prompts, body: Sampling, chat: bool):
        default_max = (lambda n: engine.engine.max_seq_len - n) if chat else (lambda n: 16)
        requests = await run(prompts, body, default_max)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not body.stream:
            try:
                await finished(requests)
            except asyncio.CancelledError:
                for r, _ in requests:
                    engine.abort(r)
                raise
            choices = [({"index": i, "message": {"role": "assistant", "content": text_of(r)},
                         "finish_reason": r.finish_reason} if chat else
                        {"index": i, "text": text_of(r), "logprobs": None, "finish_reason": r.finish_reason})
                       for i, (r, _) in enumerate(requests)]
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                    "usage": usage(prompts, requests)}
        return EventSourceResponse(stream(requests, rid, created, chat), ping=15)

    async def stream(requests, rid: str, created: int, chat: bool):
        """One SSE event per new piece of text of any choice, then each choice's finish, then [DONE]. Text that
        could still turn out to start a stop string is held back until it cannot."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, queue):
            while True:
                event = await queue.get()
                await merged.put((i, event))
                if event[0] == "finish":
                    return

        pumps = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(requests)]
        sent = [0] * len(requests)
        live = len(requests)

        def chunk(i: int, text: str, reason: str | None) -> dict:
            choice = ({"index": i, "delta": {"content": text} if text or reason is None else {},
                       "finish_reason": reason} if chat else
                      {"index": i, "text": text, "logprobs": None, "finish_reason": reason})
            return {"data": json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                        "choices": [choice]})}

        try:
            if chat:
                for i in range(len(requests)):
                    yield {"data": json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                               "choices": [{"index": i, "delta": {"role": "assistant"},
                                                            "finish_reason": None}]})}
            while live:
                i, (what, value) = await merged.get()
                r = requests[i][0]
                if what == "token":
                    text = tokenizer.decode(visible(r))
                    hold = max((len(s) for s in r.params.stop), default=1) - 1
                    # a partial UTF-8 sequence decodes to U+FFFD: wait for the rest of its bytes
                    ready = len(text) - hold if not text.endswith("\ufffd") else len(text) - hold - 1
                    if ready > sent[i]:
                        yield chunk(i, text[sent[i]:ready], None)
                        sent[i] = ready
                else:
                    final = text_of(r)
                    yield chunk(i, final[sent[i]:], value)
                    live -= 1
            yield {"data": "[DONE]"}
        finally:  # the client went away (or the stream ended): abort what still runs, free its pages
            for task in pumps:
                task.cancel()
            for r, _ in requests:
                if not r.finished:
                    engine.abort(r)

    @app.post("/v1/completions")
    async def completions(body: Completion):
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise RequestError("prompt is an empty list", 400)
        return await respond([encode(p) for p in prompts], body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: Chat):
        if chat_template is None:
            return error(404, "this model's tokenizer has no chat template: use /v1/completions")
        try:
            text = render_chat(chat_template, [m.model_dump() for m in body.messages], special_tokens or {})
        except GenerateError as e:
            raise RequestError(str(e), 400) from None
        return await respond([encode(text)], body, chat=True)

    return app


def serve(path: str, *, host: str = "127.0.0.1", port: int = 8000, tensor: int = 1, api_key: str | None = None,
          quantize: str | None = None, max_batch: int = 8, page_size: int = 16, prefill_chunk: int = 64,
          max_queue: int = 256, name: str | None = None) -> None:
    """Load the model at `path` (a workdir or a Hugging Face directory) on `tensor` devices and serve it until
    SIGTERM / Ctrl-C (uvicorn then drains the requests in flight)."""
    import pathlib

    import uvicorn

    from jaxpar.infer.text import load
    from jaxpar.serve.engine import EngineConfig

    loaded = load(path, tensor=tensor, quantize=quantize)  # explicit: at tensor > 1 the engine runs its shard_map
    if loaded.tokenizer is None:
        raise RequestError(f"{path}: no tokenizer to serve text with", 400)
    engine = Engine(loaded.model, EngineConfig(max_batch=max_batch, page_size=page_size, prefill_chunk=prefill_chunk,
                                               max_queue=max_queue),
                    eos_token_id=loaded.eos_token_id, detokenize=loaded.tokenizer.decode, plan=loaded.plan)
    template, special = chat_template_of(path)
    thread = EngineThread(engine, loaded.mesh)
    app = build_app(thread, loaded.tokenizer, model_name=name or pathlib.Path(path).resolve().name, api_key=api_key,
                    chat_template=template, special_tokens=special)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
    finally:
        thread.close()
