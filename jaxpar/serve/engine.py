"""A continuous-batching engine over the paged KV cache: requests join and leave the running batch at any step.

    submit ─► waiting (bounded: `Overloaded` when full) ─admit─► a row of the batch, its prefix pages matched
           ─► prefill, a chunk a step ─► decode, a token a step ─► finished: pages released, the row free

Each `step` runs at most two device programs, each compiled once for its fixed shapes:

    prefill  [prefill_rows, prefill_chunk] tokens: a budget of prefill_rows chunks, filled with the prompts' next
             chunks in admission order (one prompt may take several rows of one call; chunked prefill — a prompt
             longer than the budget takes several steps, interleaved with the running decodes, instead of stalling
             them);
    decode   [max_batch, 1] tokens: one token for every row in the decode phase.

Both read and write the cache through the rows' block tables (`jaxpar.model.PagedKVCache`); the host owns the
tables (`pages.PagePool`): pages are allocated as a sequence grows, released when it finishes, and a prompt's full
pages are kept under a hash of their prefix, so a later prompt with the same prefix starts after them (prefix
caching: its prefill skips them).

**Batch invariance.** A request's tokens are the same whether it runs alone or among others that join and leave at
other steps: every program runs at one shape whatever the batch holds, rows never mix (attention reads only a row's
own pages; every other operation is per token), each query sees the same keys at the same positions, and a masked
slot contributes exactly zero — so a token's logits do not depend on which row it sits in, on its neighbours, or on
where its prompt's chunks or cached pages begin. Sampling draws from the request's own generator (its seed).
`tests/test_serve_engine.py` checks it over a workload of staggered requests of mixed lengths.

Sampling runs on the host over each row's float32 logits (greedy: argmax; else temperature, top-k, top-p), so every
request carries its own parameters at no compile cost.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import Overloaded, RequestError
from jaxpar.families import attention_kind
from jaxpar.model import PagedKVCache
from jaxpar.parallel.context import SINGLE_DEVICE
from jaxpar.serve.pages import JUNK, PagePool, page_hashes


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's fixed shapes and budgets.

    max_batch      rows decoding at once (the decode program's batch)
    page_size      positions a page holds
    n_pages        pages in the pool, the junk page included (0: enough for max_batch rows of max_seq_len)
    prefill_chunk  prompt tokens a row of the prefill program holds
    prefill_rows   rows of the prefill program: prefill_rows · prefill_chunk prompt tokens a step at most, one
                   prompt's consecutive chunks or several prompts' side by side
    max_queue      requests waiting for a row before `submit` refuses (back-pressure)
    max_seq_len    positions a sequence may reach, prompt and output (0: the model's max_seq_len)
    prefix_caching keep full prompt pages for reuse
    static         static batching (the benchmark's baseline): admit a new batch only when the running one has
                   finished entirely — the same programs, slots and pages"""

    max_batch: int = 8
    page_size: int = 16
    n_pages: int = 0
    prefill_chunk: int = 64
    prefill_rows: int = 2
    max_queue: int = 256
    max_seq_len: int = 0
    prefix_caching: bool = True
    static: bool = False

    def __post_init__(self):
        for name in ("max_batch", "page_size", "prefill_chunk", "prefill_rows", "max_queue"):
            if getattr(self, name) < 1:
                raise RequestError(f"EngineConfig.{name} = {getattr(self, name)}: must be >= 1", 422)
        for name in ("n_pages", "max_seq_len"):
            if getattr(self, name) < 0:
                raise RequestError(f"EngineConfig.{name} = {getattr(self, name)}: must be >= 0 (0: the default)",
                                   422)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings (OpenAI's names): max_tokens new tokens at most; temperature 0 is greedy;
    top_k 0 and top_p 1 are off; seed fixes the request's draws (None: the engine's generator); stop_token_ids end
    the request (the engine's eos ids too, unless ignore_eos); stop strings end it once the decoded output contains
    one (needs the engine's `detokenize`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens = {self.max_tokens!r}: must be an integer >= 1", 422)
        if not self.temperature >= 0:
            raise RequestError(f"temperature = {self.temperature!r}: must be >= 0 (0: greedy)", 422)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k = {self.top_k!r}: must be an integer >= 0 (0: off)", 422)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p = {self.top_p!r}: must be in (0, 1] (1: off)", 422)


PREFILL, DECODE, DONE = "prefill", "decode", "done"


@dataclasses.dataclass(eq=False)
class Request:
    """One request as the engine runs it. `tokens` grows as the engine samples; `finish_reason` is 'stop' (a stop
    token or string), 'length' (max_tokens), or 'abort' once it is done. `on_token(request, token)` is called for
    each new token (streaming) and `on_finish(request)` once at the end, both from the thread that runs `step`."""

    id: str
    prompt: list[int]
    params: SamplingParams
    on_token: Callable | None = None
    on_finish: Callable | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None  # the decoded output, cut before a stop string (with a detokenizer)
    finish_reason: str | None = None
    state: str = PREFILL
    row: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    done: int = 0  # prompt positions in the cache (cached pages included)
    cached: int = 0  # prompt positions taken from the prefix cache
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # the prompt's full pages' prefix hashes
    need: int = 0  # pages the whole sequence needs (reserved at admission)
    rng: np.random.Generator | None = None
    submitted: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.state == DONE

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return self.token_times[0] - self.submitted if self.token_times else None


class Engine:
    """Continuous batching of generation requests on one model (module docstring).

    model: an NNX Transformer, its parameters on one device or sharded (GSPMD partitions the programs).
    plan: an explicit inference plan (`jaxpar.infer.text.load`'s, tensor > 1): the programs then run inside its
    shard_map with the training step's collectives (`LoadedModel.plan`): each tensor rank holds its heads' share of
    every page (the attention kind's `CacheArray.split`), runs its column and row shards, and returns its vocab
    shard's logits, put together for the host's sampler.
    eos_token_id: stop tokens every request gets (unless ignore_eos). detokenize(ids) → text, for stop strings.
    """

    def __init__(self, model: nnx.Module, config: EngineConfig = EngineConfig(), *,
                 eos_token_id: Sequence[int] = (), detokenize: Callable[[list[int]], str] | None = None,
                 seed: int = 0, plan=None):
        cfg = model.cfg
        self.model_config, self.config = cfg, config
        c = config
        self.max_seq_len = c.max_seq_len or cfg.max_seq_len
        self.pages_per_row = -(-self.max_seq_len // c.page_size)
        n_pages = c.n_pages or 1 + c.max_batch * self.pages_per_row
        if n_pages < 2:
            raise RequestError(f"EngineConfig.n_pages = {n_pages}: the pool needs the junk page and one more", 422)
        self.pool = PagePool(n_pages, c.page_size, c.prefix_caching)
        self.eos = tuple(int(t) for t in eos_token_id)
        self.detokenize = detokenize
        self.vocab = cfg.vocab_size
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self.waiting: collections.deque[Request] = collections.deque()
        self.rows: list[Request | None] = [None] * c.max_batch
        self.reserved = 0  # pages admitted requests will still allocate
        self.steps = self.generated = self.prefill_calls = self.decode_calls = 0
        graphdef, state = nnx.split(model)
        self._state = state
        explicit = plan is not None and plan.sharded and plan.parallel.tensor is not None
        t = plan.degrees["tensor"] if explicit else 1
        # one token a row or a chunk of a prompt: no sequence split (chunks need not divide by t), no ring
        par = SINGLE_DEVICE if not explicit else dataclasses.replace(
            plan.parallel, tensor=dataclasses.replace(plan.parallel.tensor, sequence=False, overlap=False))
        kinds = attention_kind(cfg).cache(cfg, t)

        def run(state, tokens, positions, arrays, pages, last):
            """tokens [R, T] at positions [R] … through the rows' block tables pages [R, n] → (float32 logits
            [R, V(/t)] at each row's index `last` [R], the pools with the tokens' slots written)."""
            m = nnx.merge(graphdef, state)
            logits, out = m.decode(tokens, PagedKVCache(arrays, pages, positions), par, positions=positions)
            at = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
            return at.astype(jnp.float32), out.arrays

        shape = lambda a: tuple(n * t if i == a.split else n for i, n in enumerate(a.shape))  # noqa: E731
        pools = {name: jnp.zeros((cfg.n_layers, n_pages, c.page_size, *shape(a)), cfg.dtype)
                 for name, a in kinds.items()}
        if explicit:
            from jax.sharding import NamedSharding, PartitionSpec as P

            from jaxpar.infer.decode import _param_specs

            axis = plan.parallel.tensor.axis
            specs = {name: P(None, None, None, *(axis if i == a.split else None for i in range(len(a.shape))))
                     for name, a in kinds.items()}
            pools = {name: jax.device_put(a, NamedSharding(plan.mesh, specs[name])) for name, a in pools.items()}
            run = jax.shard_map(run, mesh=plan.mesh, in_specs=(_param_specs(state, plan), P(), P(), specs, P(), P()),
                                out_specs=(P(None, axis), specs), check_vma=True)
        self._arrays = pools
        self._run = jax.jit(run, donate_argnums=3)

    # ------------------------------------------------------------------------------------------------ requests

    def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(), *, request_id: str | None = None,
               on_token: Callable | None = None, on_finish: Callable | None = None) -> Request:
        """Queue a request (prompt: token ids). Raises `RequestError` for one that cannot run (its `status`: 400
        empty or out-of-vocab ids, or prompt + max_tokens past max_seq_len; 413 a prompt that alone fills the
        context) and `Overloaded` when max_queue requests wait already."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty: it needs at least one token", 400)
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise RequestError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab})", 400)
        if len(prompt) >= self.max_seq_len:
            raise RequestError(f"the prompt's {len(prompt)} tokens fill the model's context of {self.max_seq_len} "
                               "(no room for a new token): shorten it", 413)
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"context of {self.max_seq_len} tokens: lower max_tokens to at most "
                               f"{self.max_seq_len - len(prompt)}", 400)
        if self._pages_for(len(prompt) + params.max_tokens) > self.pool.n_pages - 1:
            raise RequestError(f"the request needs {self._pages_for(len(prompt) + params.max_tokens)} pages; the "
                               f"pool holds {self.pool.n_pages - 1}", 413)
        if len(self.waiting) >= self.config.max_queue:
            raise Overloaded(f"{len(self.waiting)} requests are waiting already (max_queue): retry later")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
        r = Request(request_id or f"req-{next(self._ids)}", prompt, params, on_token, on_finish,
                    rng=np.random.default_rng(seed), submitted=time.perf_counter())
        self.waiting.append(r)
        return r

    def abort(self, request: Request) -> None:
        """End a request now (a client that went away): its row and pages are freed at once."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            request.state = DONE
            request.finish_reason = "abort"
            return
        self._finish(request, "abort")

    @property
    def running(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.rows)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams()) -> list[list[int]]:
        """Submit every prompt (queueing past max_queue as rows free up) and step until all finish → each one's
        new tokens, in order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        todo = collections.deque(zip(prompts, params))
        requests = []
        while todo or self.has_work:
            while todo and len(self.waiting) < self.config.max_queue:
                prompt, p = todo.popleft()
                requests.append(self.submit(prompt, p))
            self.step()
        return [r.tokens for r in requests]

    # ---------------------------------------------------------------------------------------------------- steps

    def step(self) -> list[tuple[Request, int]]:
        """Admit what fits, run one prefill call (up to prefill_rows chunks of the prefilling prompts) and one decode
        token of every decoding row → the (request, token) pairs this step produced."""
        self._admit()
        decoding = [r for r in self.rows if r is not None and r.state == DECODE]
        prefilling = sorted((r for r in self.rows if r is not None and r.state == PREFILL),
                            key=lambda r: r.submitted)[:self.config.prefill_rows]  # first come, first served
        events: list[tuple[Request, int]] = []
        if prefilling:
            events += self._prefill(prefilling)
            self.prefill_calls += 1
        if decoding:
            events += self._decode(decoding)
            self.decode_calls += 1
        self.steps += 1
        return events

    def _admit(self) -> None:
        c = self.config
        if c.static and any(r is not None for r in self.rows):
            return
        while self.waiting and None in self.rows:
            r = self.waiting[0]
            n = len(r.prompt)
            r.need = self._pages_for(n + r.params.max_tokens)
            # full pages of the prompt but its last token (which must run, for the first new token's logits)
            hashes = page_hashes(r.prompt, c.page_size, (n - 1) // c.page_size)
            hit = self.pool.match(hashes)
            if self.pool.available - self.reserved < r.need - len(hit):
                self.pool.release(hit)
                return
            self.waiting.popleft()
            self.pool.hits, self.pool.queries = self.pool.hits + len(hit), self.pool.queries + len(hashes)
            r.pages, r.cached = hit, len(hit) * c.page_size
            r.done = r.cached
            r.hashes = hashes
            self.reserved += r.need - len(hit)
            r.row = self.rows.index(None)
            self.rows[r.row] = r

    def _pages_for(self, positions: int) -> int:
        """Pages for a sequence that reaches `positions` tokens (its last token is never written: positions − 1)."""
        return -(-(positions - 1) // self.config.page_size)

    def _grow(self, r: Request, upto: int) -> None:
        """Allocate r's pages to hold positions 0 … upto-1."""
        while len(r.pages) * self.config.page_size < upto:
            r.pages.append(self.pool.allocate())
            self.reserved -= 1

    def _table(self, rows: Sequence[Request | None]) -> np.ndarray:
        table = np.full((len(rows), self.pages_per_row), JUNK, np.int32)
        for i, r in enumerate(rows):
            if r is not None:
                table[i, :len(r.pages)] = r.pages
        return table

    def _prefill(self, batch: list[Request]) -> list[tuple[Request, int]]:
        """One prefill call: its prefill_rows rows of prefill_chunk tokens are a token budget, filled in admission
        order — a prompt takes consecutive chunks in as many rows as it needs (a 70-token prompt at chunk 32 fills
        three rows of one call, not three calls), then the next prompt. The rows of one prompt share its block
        table: each layer writes every row's keys before any row reads (`write_pages` then `read_pages`), so a
        later chunk's queries see the earlier chunks of the same call at their positions, as if they had run in
        earlier steps — the tokens are the same either way (batch invariance)."""
        c = self.config
        R, C = c.prefill_rows, c.prefill_chunk
        tokens = np.zeros((R, C), np.int32)
        positions = np.zeros((R,), np.int32)
        last = np.zeros((R,), np.int32)
        rows: list[Request | None] = [None] * R
        ends = []  # (request, the row holding its last token of this call, its prompt positions after the call)
        i = 0
        for r in batch:
            at = r.done
            while i < R and at < len(r.prompt):
                count = min(C, len(r.prompt) - at)
                tokens[i, :count] = r.prompt[at:at + count]
                positions[i], last[i], rows[i] = at, count - 1, r
                at += count
                i += 1
            if at > r.done:
                self._grow(r, at)
                ends.append((r, i - 1, at))
        logits = self._call(tokens, positions, self._table(rows), last)
        events = []
        for r, i, at in ends:
            r.done = at
            full = r.done // c.page_size  # the prompt's full pages so far: kept for later prompts
            for j in range(r.cached // c.page_size, min(full, len(r.hashes))):
                self.pool.register(r.pages[j], r.hashes[j])
            if r.done == len(r.prompt):
                r.state = DECODE
                events += self._emit(r, logits[i])
        return events

    def _decode(self, batch: list[Request]) -> list[tuple[Request, int]]:
        B = self.config.max_batch
        tokens = np.zeros((B, 1), np.int32)
        positions = np.zeros((B,), np.int32)
        rows: list[Request | None] = [None] * B
        for r in batch:
            pos = len(r.prompt) + len(r.tokens) - 1  # where the last sampled token goes
            self._grow(r, pos + 1)
            tokens[r.row, 0], positions[r.row], rows[r.row] = r.tokens[-1], pos, r
        logits = self._call(tokens, positions, self._table(rows), np.zeros((B,), np.int32))
        events = []
        for r in batch:
            events += self._emit(r, logits[r.row])
        return events

    def _call(self, tokens, positions, table, last) -> np.ndarray:
        logits, self._arrays = self._run(self._state, jnp.asarray(tokens), jnp.asarray(positions), self._arrays,
                                         jnp.asarray(table), jnp.asarray(last))
        return np.asarray(logits)[:, :self.vocab]  # (a tensor-parallel model's vocab is padded)

    def _emit(self, r: Request, logits: np.ndarray) -> list[tuple[Request, int]]:
        """Sample r's next token from its logits [V], record it, and finish r if it should stop."""
        token = sample(logits, r.params, r.rng)
        r.tokens.append(token)
        r.token_times.append(time.perf_counter())
        self.generated += 1
        if r.on_token is not None:
            r.on_token(r, token)
        p = r.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            self._finish(r, "stop")
        elif p.stop and self.detokenize is not None and self._stopped_by_string(r):
            self._finish(r, "stop")
        elif len(r.tokens) >= p.max_tokens:
            self._finish(r, "length")
        return [(r, token)]

    def _stopped_by_string(self, r: Request) -> bool:
        text = self.detokenize(r.tokens)
        cut = min((i for i in (text.find(s) for s in r.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        r.text = text[:cut]
        return True

    def _finish(self, r: Request, reason: str) -> None:
        r.state, r.finish_reason = DONE, reason
        if r.text is None and self.detokenize is not None:
            r.text = self.detokenize(r.tokens)
        self.reserved -= r.need - len(r.pages)
        self.pool.release(r.pages)
        r.pages = []
        self.rows[r.row] = None
        if r.on_finish is not None:
            r.on_finish(r)

    # -------------------------------------------------------------------------------------------------- metrics

    def stats(self) -> dict[str, float]:
        """Gauges and counters for a metrics endpoint: running and waiting requests, KV pages in use (and the
        pool), prefix-cache page hits and lookups, tokens generated, steps run and the prefill and decode programs'
        calls among them."""
        return {"running": len(self.running), "waiting": len(self.waiting), "pages_used": self.pool.used,
                "pages_total": self.pool.n_pages - 1, "prefix_hits": self.pool.hits,
                "prefix_queries": self.pool.queries, "generated_tokens": self.generated, "steps": self.steps,
                "prefill_calls": self.prefill_calls, "decode_calls": self.decode_calls}


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from float32 logits [V]: argmax when temperature is 0; else softmax(logits / temperature) over the
    top_k largest (0: all) within the smallest set of probability ≥ top_p, drawn with `rng`."""
    if p.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / p.temperature
    if p.top_k:
        kth = np.partition(z, -min(p.top_k, z.size))[-min(p.top_k, z.size)]
        z = np.where(z >= kth, z, -np.inf)
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    if p.top_p < 1:
        order = np.argsort(-prob, kind="stable")
        keep = np.cumsum(prob[order]) - prob[order] < p.top_p  # the smallest prefix reaching top_p
        mask = np.zeros_like(prob, bool)
        mask[order[keep]] = True
        prob = np.where(mask, prob, 0.0)
        prob /= prob.sum()
    return int(rng.choice(prob.size, p=prob))

