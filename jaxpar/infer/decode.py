"""KV-cache generation: one prefill over the (left-padded) prompts, then one token per step, all on device.

    prompts (ragged) ─left-pad→ tokens [B, P] ─prefill→ cache slots 0…P-1 ─decode→ slot P, P+1, … (one token each)

Left padding puts every row's next token in the same cache slot, so each step is one `dynamic_update_slice` for
the whole batch; the pad slots are masked out of attention and positions count from each row's first real token
(`jaxpar.model.KVCache`). The decode loop is a `lax.while_loop` inside the same `jit` as the prefill: no host round
trip per token, and it stops early once every row has emitted a stop token.

Per step the matmuls see one token per row — their cost does not grow with the context; attention reads the whole
cache buffer of `P + max_new_tokens` slots (masked), a cost fixed at compile time.

On a mesh the parameters keep their tensor-parallel sharding. With an explicit plan (what `jaxpar.infer.text.load`
gives) the whole loop runs inside one `shard_map` with the training step's collectives and a vocab-parallel sampler
(`_explicit_parts`); without one GSPMD partitions the computation (the comparison baseline). Either way the cache is
laid out like the activations that fill it — batch over `data`, kv heads over `tensor` (one head a rank when there
are fewer kv heads than tensor ranks, as the weights are replicated then).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxpar.errors import GenerateError
from jaxpar.infer.sampling import check_sampling_args, sample_logits, sample_sharded
from jaxpar.model import KVCache
from jaxpar.parallel.vma import vary
from jaxpar.sharding import constrain, param_specs

CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def left_pad(input_ids: Sequence[Sequence[int]] | np.ndarray, attention_mask: np.ndarray | None = None, *,
             pad_token_id: int = 0, multiple: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts → (tokens int32 [B, P], start int32 [B]) with each row's real tokens right-aligned.

    input_ids: a list of token lists, or an int array [B, T] whose `attention_mask` (1 real, 0 padding; either side)
    says which entries are real. P is the longest prompt rounded up to `multiple` (fewer distinct compilations).
    """
    if attention_mask is not None:
        ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
        if ids.shape != mask.shape:
            raise GenerateError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        rows = [row[m].tolist() for row, m in zip(ids, mask)]
    elif hasattr(input_ids, "shape"):  # a NumPy or JAX array [B, T], all of it real
        rows = np.asarray(input_ids).tolist()
    else:
        rows = [list(r) for r in input_ids]
    if not rows or any(len(r) == 0 for r in rows):
        raise GenerateError("every prompt needs at least one token (and there must be at least one prompt)")
    P = -(-max(len(r) for r in rows) // multiple) * multiple
    tokens = np.full((len(rows), P), pad_token_id, np.int32)
    start = np.array([P - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        tokens[b, P - len(r):] = r
    return tokens, start


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "stop",
                                             "pad_token_id"))
def _generate(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, start: jax.Array, rng: jax.Array, *,
              max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop: tuple[int, ...],
              pad_token_id: int) -> tuple[jax.Array, jax.Array]:
    """Prefill `tokens` [B, P], then sample up to max_new_tokens. → (new int32 [B, max_new_tokens], count int32 [])
    where columns ≥ count are padding (every row had stopped) and a stopped row's later entries are pad_token_id."""
    model = nnx.merge(graphdef, params)
    B, P = tokens.shape
    cache = KVCache.empty(model.cfg, B, P + max_new_tokens, start)
    cache = KVCache(constrain(cache.k, CACHE_AXES), constrain(cache.v, CACHE_AXES), cache.start, cache.end)
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    logits, cache = model.decode(tokens, cache)
    first = sample(logits[:, -1, :model.cfg.vocab_size], jax.random.fold_in(rng, 0))  # [B]
    out = jnp.full((B, max_new_tokens), pad_token_id, jnp.int32)
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)

    def cond(carry):
        n, _, _, _, done = carry
        return (n < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        n, tok, cache, out, done = carry
        out = out.at[:, n].set(jnp.where(done, pad_token_id, tok))
        done = done | jnp.isin(tok, stop_ids)
        logits, cache = model.decode(tok[:, None], cache)  # [B, 1, V]
        tok = sample(logits[:, 0, :model.cfg.vocab_size], jax.random.fold_in(rng, n + 1))
        return n + 1, tok, cache, out, done

    init = (jnp.int32(0), first, cache, out, jnp.zeros((B,), bool))
    n, _, _, out, _ = jax.lax.while_loop(cond, body, init)
    return out, n


def _explicit_parts(graphdef: nnx.GraphDef, plan, *, temperature: float, top_k: int, top_p: float):
    """The two programs of explicit-TP decoding, to run inside the plan's shard_map: prefill(params, tokens [B, P],
    start [B], slots, key) → (first token [B], cache) and step(params, tok [B], cache, key) → (next token, cache).
    Each tensor rank keeps its heads' share of the KV cache (one head when there are fewer kv heads than ranks),
    runs its column / row shards with f and g around them, and samples with `sample_sharded`."""
    par, cfg = plan.parallel, plan.model
    axis = None if par.tensor is None else par.tensor.axis
    # Prefill runs the plan's layout (with sequence parallelism and collective matmuls if it has them: the prompt
    # is a multiple of 8 tokens); a decode step has one token a row, which no sequence split can take.
    one_token = par if par.tensor is None else dataclasses.replace(
        par, tensor=dataclasses.replace(par.tensor, sequence=False, overlap=False))

    def sample(logits, key):  # rows are split over `data`: the noise follows each row's global index
        return sample_sharded(logits, key, vocab_size=cfg.vocab_size, axis=axis, temperature=temperature,
                              top_k=top_k, top_p=top_p, first_row=jax.lax.axis_index("data") * logits.shape[0])

    def prefill(params, tokens, start, slots, key):
        cache = _local_cache(plan, tokens.shape[0], slots, start)
        logits, cache = nnx.merge(graphdef, params).decode(tokens, cache, par)  # [B, P, V/t]
        return sample(logits[:, -1], key), cache  # [B], the same on every tensor rank

    def step(params, tok, cache, key):
        logits, cache = nnx.merge(graphdef, params).decode(tok[:, None], cache, one_token)  # [B, 1, V/t]
        return sample(logits[:, 0], key), cache

    return prefill, step


# Compiled explicit programs, by what they depend on (never the plan's id, which a later plan may reuse); each holds
# an executable, so a caller that varies the settings (a server: every max_new_tokens, temperature, stop list) must
# not grow it without bound: the least recently used past EXPLICIT_CACHE_SIZE are dropped.
_EXPLICIT_CACHE: collections.OrderedDict = collections.OrderedDict()
EXPLICIT_CACHE_SIZE = 16


def _program(key: tuple, build):
    """The explicit program for `key` — `build()` on a miss — now the most recently used."""
    fn = _EXPLICIT_CACHE.pop(key, None)
    _EXPLICIT_CACHE[key] = fn = build() if fn is None else fn
    while len(_EXPLICIT_CACHE) > EXPLICIT_CACHE_SIZE:
        _EXPLICIT_CACHE.popitem(last=False)
    return fn


def _plan_key(graphdef: nnx.GraphDef, plan) -> tuple:
    """What an explicit program depends on of the model and its plan (the `_EXPLICIT_CACHE` key's common part)."""
    return graphdef, plan.mesh, plan.rules, plan.parallel, plan.model


def _local_cache(plan, batch: int, slots: int, start: jax.Array) -> KVCache:
    """An empty cache of this rank's rows and kv heads, inside the plan's shard_map, typed as varying over what the
    keys and values written into it vary over (data, and tensor when the heads are split)."""
    cache = KVCache.empty(plan.model, batch, slots, start, kv_heads(plan))
    heads = ("data",) + (("tensor",) if plan.parallel.tensor is not None else ())
    return KVCache(vary(cache.k, heads), vary(cache.v, heads), cache.start, cache.end)


def kv_heads(plan) -> int:
    """The kv heads one tensor rank's cache holds (`KVCache.heads_per_rank`)."""
    return KVCache.heads_per_rank(plan.model, plan.degrees["tensor"])


def cache_spec(plan) -> P:
    """Where the explicit path's KV cache [L, B, S, K', E] lives: rows over `data`, each tensor rank's heads
    (K' = t · `kv_heads`) over `tensor`."""
    return P(None, "data", None, "tensor" if plan.degrees["tensor"] > 1 else None, None)


def explicit_decode_step(model: nnx.Module, plan, batch: int, slots: int, **sampling):
    """One decode step of the explicit path as its own program (for accounting and benchmarks): → (a jitted
    fn(params, tok [B], k, v, start, end, key) → (tok, k, v), its example arguments), the cache [L, B, slots, K', E]
    empty in the model's dtype."""
    graphdef, params = nnx.split(model)
    _, step = _explicit_parts(graphdef, plan, **sampling)

    def run(params, tok, k, v, start, end, key):
        tok, cache = step(params, tok, KVCache(k, v, start, end), key)
        return tok, cache.k, cache.v

    specs, rows, cache = _param_specs(params, plan), P("data"), cache_spec(plan)
    fn = jax.jit(jax.shard_map(run, mesh=plan.mesh, in_specs=(specs, rows, cache, cache, rows, P(), P()),
                               out_specs=(rows, cache, cache), check_vma=True))
    cfg, t = plan.model, plan.degrees["tensor"]
    place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(plan.mesh, spec))  # noqa: E731
    kv = place(jnp.zeros((cfg.n_layers, batch, slots, kv_heads(plan) * t, cfg.head_dim), cfg.dtype), cache)
    args = (params, place(jnp.zeros((batch,), jnp.int32), rows), kv, kv, place(jnp.zeros((batch,), jnp.int32), rows),
            jnp.int32(slots - 1), jax.random.key(0))
    return fn, args


def explicit_prefill_logits(model: nnx.Module, plan, tokens: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The explicit path's prefill logits, for checking it: left-padded tokens int32 [B, P] with their start [B]
    (`left_pad`) → float32 [B, P, vocab_size], each tensor rank's vocab shard put together on the host (the sampler
    never does that)."""
    graphdef, params = nnx.split(model)

    def build():  # once per model and plan: callers (held_out_loss) run it batch after batch
        def run(params, tokens, start):
            cache = _local_cache(plan, tokens.shape[0], tokens.shape[1], start)
            return nnx.merge(graphdef, params).decode(tokens, cache, plan.parallel)[0]  # [B, P, V/t]

        vocab = "tensor" if plan.degrees["tensor"] > 1 else None
        return jax.jit(jax.shard_map(run, mesh=plan.mesh, in_specs=(_param_specs(params, plan), P("data"), P("data")),
                                     out_specs=P("data", None, vocab), check_vma=True))

    rows = jax.sharding.NamedSharding(plan.mesh, P("data"))
    logits = _program(("prefill", *_plan_key(graphdef, plan)), build)(
        params, jax.device_put(jnp.asarray(tokens), rows), jax.device_put(jnp.asarray(start), rows))
    return np.asarray(logits)[..., :plan.model.vocab_size]


def _explicit_generate(graphdef: nnx.GraphDef, plan, specs, *, max_new_tokens: int, temperature: float, top_k: int,
                       top_p: float, stop: tuple[int, ...], pad_token_id: int):
    """`_generate` under one `shard_map` with the training step's explicit collectives (`_explicit_parts`): per-row
    scalars (or the top-k candidates) cross the tensor group, never the logits. Rows are split over `data`; every
    rank runs the same number of steps (the stop test is reduced over `data`). → a jitted fn(params, tokens [B, P],
    start [B], rng) → (new [B, max_new_tokens], count)."""
    prefill, step = _explicit_parts(graphdef, plan, temperature=temperature, top_k=top_k, top_p=top_p)
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)

    def run(params, tokens, start, rng):
        B, P_ = tokens.shape
        first, cache = prefill(params, tokens, start, P_ + max_new_tokens, jax.random.fold_in(rng, 0))
        out = vary(jnp.full((B, max_new_tokens), pad_token_id, jnp.int32), "data")
        done = vary(jnp.zeros((B,), bool), "data")

        def cond(carry):
            n, _, _, _, _, finished = carry
            return (n < max_new_tokens) & ~finished

        def body(carry):
            n, tok, cache, out, done, _ = carry
            out = out.at[:, n].set(jnp.where(done, pad_token_id, tok))
            done = done | jnp.isin(tok, stop_ids)
            tok, cache = step(params, tok, cache, jax.random.fold_in(rng, n + 1))
            finished = jax.lax.pmin(jnp.all(done).astype(jnp.int32), "data") == 1
            return n + 1, tok, cache, out, done, finished

        n, _, _, out, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), first, cache, out, done, jnp.bool_(False)))
        return out, n

    rows = P("data")
    return jax.jit(jax.shard_map(run, mesh=plan.mesh, in_specs=(specs, rows, rows, P()), out_specs=(rows, P()),
                                 check_vma=True))


def _param_specs(params: nnx.State, plan) -> nnx.State:
    """The parameters' specs on the inference mesh. No pipeline here: the stacked layers' `pipe` (size 1) is
    dropped, so nothing is typed as varying over it."""
    return jax.tree.map(lambda spec: P(*(None if a == "pipe" else a for a in spec)), param_specs(params, plan.rules),
                        is_leaf=lambda x: isinstance(x, P))


def generate(model: nnx.Module, input_ids: Sequence[Sequence[int]] | np.ndarray, *, max_new_tokens: int = 20,
             attention_mask: np.ndarray | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int = 0, mesh: jax.sharding.Mesh | None = None,
             return_prompt: bool = True, plan=None) -> np.ndarray:
    """Hugging Face-style generation with a KV cache: prompts (ragged lists, or [B, T] ids with an attention_mask)
    → int32 [B, P + n]: the left-padded prompts followed by the new tokens (just the n new ones with
    return_prompt=False). n = max_new_tokens unless every row stopped earlier.

    do_sample=False is greedy; otherwise sampling at `temperature` with optional top_k (0: off — HF's default is
    50) and top_p (1.0: off). eos_token_id: one id or several; a row that emits one is finished and padded with
    pad_token_id (default: the first eos id, else 0). seed fixes the sampling. `mesh`: run under it (the params'
    shardings decide the layout, GSPMD partitions). `plan` (jaxpar.plan, explicit): run under its
    shard_map with explicit tensor parallelism and the vocab-parallel sampler (`_explicit_generate`) — greedy
    tokens equal the single-device ones; sampled tokens are the same at every tensor degree (Gumbel-max on the
    whole vocab's noise), though not the GSPMD path's draws. The prompt plus max_new_tokens must fit the model's
    max_seq_len.
    """
    cfg = model.cfg
    temperature = temperature if do_sample else 0.0
    check_sampling_args(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens = {max_new_tokens!r}: must be an integer >= 1")
    stop = () if eos_token_id is None else tuple(int(i) for i in np.atleast_1d(eos_token_id))
    pad = pad_token_id if pad_token_id is not None else (stop[0] if stop else 0)
    # A sequence-parallel prefill splits the prompt over tensor: its padded length must divide.
    sp = plan is not None and plan.tensor is not None and plan.tensor.sequence
    tokens, start = left_pad(input_ids, attention_mask, pad_token_id=pad,
                             multiple=math.lcm(8, plan.degrees["tensor"]) if sp else 8)
    real = tokens[np.arange(tokens.shape[1])[None, :] >= start[:, None]]
    if real.size and (real.min() < 0 or real.max() >= cfg.vocab_size):
        bad = int(real.min() if real.min() < 0 else real.max())
        raise GenerateError(f"token id {bad} in the prompt is outside the model's vocabulary [0, {cfg.vocab_size})")
    longest = tokens.shape[1] - int(start.min())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise GenerateError(f"prompt of {longest} tokens + max_new_tokens = {max_new_tokens} exceeds the model's "
                         f"max_seq_len = {cfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    graphdef, params = nnx.split(model)
    rng = jax.random.key(seed)
    if plan is not None and plan.sharded:
        new = _generate_on_plan(graphdef, params, plan, tokens, start, rng, max_new_tokens=max_new_tokens,
                                temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), stop=stop,
                                pad_token_id=int(pad))
        return np.concatenate([tokens, new], axis=1) if return_prompt else new
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if mesh is not None:
            rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                "data" if tokens.shape[0] % mesh.shape["data"] == 0 else None))
            tokens_dev, start_dev = jax.device_put(tokens, rows), jax.device_put(start, rows)
        else:
            tokens_dev, start_dev = jnp.asarray(tokens), jnp.asarray(start)
        new, n = _generate(graphdef, params, tokens_dev, start_dev, rng, max_new_tokens=max_new_tokens,
                           temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), stop=stop,
                           pad_token_id=int(pad))
        new = np.asarray(new)[:, :int(n)]
    return np.concatenate([tokens, new], axis=1) if return_prompt else new


def _generate_on_plan(graphdef, params, plan, tokens: np.ndarray, start: np.ndarray, rng, **settings) -> np.ndarray:
    """Run `_explicit_generate` (built once per graph, plan and settings) on rows padded to a multiple of `data`
    (a padding row is one pad token, dropped again) → the new tokens [B, n]."""
    data = plan.degrees["data"]
    B = tokens.shape[0]
    extra = -B % data
    if extra:
        tokens = np.concatenate([tokens, np.full((extra, tokens.shape[1]), settings["pad_token_id"], np.int32)])
        start = np.concatenate([start, np.full((extra,), tokens.shape[1] - 1, np.int32)])
    program = _program((*_plan_key(graphdef, plan), tuple(sorted(settings.items()))),
                       lambda: _explicit_generate(graphdef, plan, _param_specs(params, plan), **settings))
    rows = jax.sharding.NamedSharding(plan.mesh, P("data"))
    new, n = program(params, jax.device_put(tokens, rows), jax.device_put(start, rows), rng)
    return np.asarray(new)[:B, :int(n)]
