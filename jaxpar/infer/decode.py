"""KV-cache generation: a decode step that rows at different positions share, and the device-side loop over it.

    prompts (ragged) ─right-pad→ tokens [B, P], lengths n [B] ─prefill→ row b's slots 0…P-1 (n_b real)
                     ─decode→ row b's token i at slot i: n_b, n_b+1, … (one token a row a step)

Row b's token at position i lives in cache slot i, for every row: a step writes each row's new tokens at that row's
own position (`jaxpar.model.KVCache.lengths`) and each query attends to its row's slots up to its own position, so
rows of different lengths share a step with no left padding and no per-row offset. The prefill writes a short
prompt's padding too; those slots lie past the row's position, never attended to, until its decoded tokens overwrite
them.

`decode_step(model, tokens [B, T], positions [B], cache) → (logits, cache)` is the step, callable from a host loop (an
engine whose rows start and stop at different times). `generate` runs the same step in one loop on device
(`_decode_loop`): the prefill, then a `lax.while_loop` of one token a row inside the same `jit` — no host round trip
per token — that stops early once every row has emitted a stop token.

Per step the matmuls see one token per row — their cost does not grow with the context; attention reads the whole
cache buffer of `P + max_new_tokens` slots (masked), a cost fixed at compile time.

On a mesh the parameters keep their tensor-parallel sharding. With an explicit plan (what `jaxpar.infer.text.load`
gives) the same loop runs inside one `shard_map` with the training step's collectives and a vocab-parallel sampler
(`_explicit_parts`); without one GSPMD partitions the computation (the comparison baseline). Either way the cache is
laid out like the activations that fill it, as the model's attention kind declares it (`AttentionKind.cache`: nothing
here knows GQA) — batch over `data`, GQA's kv heads over `tensor` (one head a rank when there are fewer kv heads than
tensor ranks, as the weights are replicated then).
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
from jaxpar.families import attention_kind
from jaxpar.infer.sampling import check_sampling_args, sample_logits, sample_sharded
from jaxpar.model import KVCache
from jaxpar.parallel.context import SINGLE_DEVICE, Parallel
from jaxpar.parallel.vma import vary
from jaxpar.sharding import constrain, param_specs



def cache_axes(cfg) -> dict[str, tuple[str | None, ...]]:
    """The logical axes of each array of the model's decoding cache (`KVCache.arrays`, as its attention kind declares
    them): [L, B, S] then the kind's per-slot axes — GQA's k and v ("layers", "batch", "seq", "kv_heads",
    "head_dim")."""
    return {name: ("layers", "batch", "seq", *a.axes) for name, a in attention_kind(cfg).cache(cfg, 1).items()}


def laid_out(cache: KVCache, cfg) -> KVCache:
    """The cache constrained to its logical layout (GSPMD: rows over `data`, what the rules split over `tensor`)."""
    axes = cache_axes(cfg)
    return KVCache({name: constrain(a, axes[name]) for name, a in cache.arrays.items()}, cache.lengths)


def right_pad(input_ids: Sequence[Sequence[int]] | np.ndarray, attention_mask: np.ndarray | None = None, *,
              pad_token_id: int = 0, multiple: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts → (tokens int32 [B, P] with each row's real tokens first, lengths int32 [B]).

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
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    return tokens, np.array([len(r) for r in rows], np.int32)


@functools.partial(jax.jit, static_argnames="par")
def decode_step(model: nnx.Module, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                counts: jax.Array | None = None, par: Parallel = SINGLE_DEVICE) -> tuple[jax.Array, KVCache]:
    """Run tokens int32 [B, T] of row b at positions[b] … positions[b]+T-1 against `cache` → (float32 logits
    [B, T, V], the cache with their keys and values written; `Transformer.decode`). Rows may be at different
    positions (a row restarting at 0 reuses its slots); counts [B]: the real tokens among a row's T (a right-padded
    prompt), which set its length (`cache.lengths` = positions + counts, default + T).

    `model` is the NNX module, a pytree of its parameters (sharded or not: GSPMD partitions); `par`, inside a
    shard_map, the explicit context — V is then this rank's vocab shard and the cache its rows and kv heads."""
    return model.decode(tokens, cache, par, positions=positions, counts=counts)


def _decode_loop(prefill, step, sample, params, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                 rng: jax.Array, *, max_new_tokens: int, stop: tuple[int, ...], pad_token_id: int,
                 all_stopped=jnp.all) -> tuple[jax.Array, jax.Array]:
    """Prefill the right-padded prompts tokens [B, P] (real lengths [B]) into the empty `cache`, then sample up to
    max_new_tokens, one a row a step. → (new int32 [B, max_new_tokens], count int32 []) where columns ≥ count are
    padding (every row had stopped) and a stopped row's later entries are pad_token_id.

    prefill, step: fn(params, tokens [B, T], positions [B], cache, counts) → (logits [B, T, V(_local)], cache)
    (`decode_step`; the explicit path's prefill may run a sequence split its steps cannot); sample(logits [B,
    V(_local)], key) → tokens [B], the key folded with the step's index (0: the prefill's). all_stopped(done [B]):
    whether every row has stopped — over all the data shards inside a shard_map, so every rank runs as many steps."""
    logits, cache = prefill(params, tokens, jnp.zeros_like(lengths), cache, lengths)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]: each row's last token
    first = sample(last, jax.random.fold_in(rng, 0))  # [B]
    out = jnp.full_like(first, pad_token_id, shape=(first.shape[0], max_new_tokens))  # typed like the rows
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)

    def cond(carry):
        n, _, _, _, _, finished = carry
        return (n < max_new_tokens) & ~finished

    def body(carry):
        n, tok, cache, out, done, _ = carry
        out = out.at[:, n].set(jnp.where(done, pad_token_id, tok))
        done = done | jnp.isin(tok, stop_ids)
        logits, cache = step(params, tok[:, None], cache.lengths, cache, None)  # [B, 1, V]
        tok = sample(logits[:, 0], jax.random.fold_in(rng, n + 1))
        return n + 1, tok, cache, out, done, all_stopped(done)

    init = (jnp.int32(0), first, cache, out, jnp.zeros_like(first, bool), jnp.bool_(False))
    n, _, _, out, _, _ = jax.lax.while_loop(cond, body, init)
    return out, n


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "stop",
                                             "pad_token_id"))
def _generate(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, lengths: jax.Array, rng: jax.Array, *,
              max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop: tuple[int, ...],
              pad_token_id: int) -> tuple[jax.Array, jax.Array]:
    """`_decode_loop` on one device or under GSPMD: right-padded tokens [B, P] with their lengths [B] → (new
    [B, max_new_tokens], count)."""
    cfg = nnx.merge(graphdef, params).cfg
    B, P_ = tokens.shape
    cache = laid_out(KVCache.empty(cfg, B, P_ + max_new_tokens), cfg)

    def step(params, tokens, positions, cache, counts):
        return decode_step(nnx.merge(graphdef, params), tokens, positions, cache, counts)

    def sample(logits, key):
        return sample_logits(logits[:, :cfg.vocab_size], key, temperature=temperature, top_k=top_k, top_p=top_p)

    return _decode_loop(step, step, sample, params, tokens, lengths, cache, rng, max_new_tokens=max_new_tokens,
                        stop=stop, pad_token_id=pad_token_id)


def _explicit_parts(graphdef: nnx.GraphDef, plan, *, temperature: float, top_k: int, top_p: float):
    """What `_decode_loop` runs inside the plan's shard_map: (prefill, step, sample) — `decode_step` with the plan's
    explicit context, and the vocab-parallel sampler `sample_sharded`. Each tensor rank keeps its heads' share of the
    KV cache (one head when there are fewer kv heads than ranks), runs its column / row shards with f and g around
    them, and samples its vocab shard's logits; the tokens come out the same on every tensor rank."""
    par, cfg = plan.parallel, plan.model
    axis = None if par.tensor is None else par.tensor.axis
    # Prefill runs the plan's layout (with sequence parallelism and collective matmuls if it has them: the prompt
    # is a multiple of 8 tokens); a decode step has one token a row, which no sequence split can take.
    one_token = par if par.tensor is None else dataclasses.replace(
        par, tensor=dataclasses.replace(par.tensor, sequence=False, overlap=False))

    def sample(logits, key):  # rows are split over `data`: the noise follows each row's global index
        return sample_sharded(logits, key, vocab_size=cfg.vocab_size, axis=axis, temperature=temperature,
                              top_k=top_k, top_p=top_p, first_row=jax.lax.axis_index("data") * logits.shape[0])

    def prefill(params, tokens, positions, cache, counts):
        return decode_step(nnx.merge(graphdef, params), tokens, positions, cache, counts, par=par)  # [B, P, V/t]

    def step(params, tokens, positions, cache, counts):
        return decode_step(nnx.merge(graphdef, params), tokens, positions, cache, counts, par=one_token)

    return prefill, step, sample


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


def _local_cache(plan, batch: int, slots: int) -> KVCache:
    """An empty cache of this rank's rows and share of the heads, inside the plan's shard_map, each array typed as
    varying over what is written into it: its rows over data, and over tensor where the ranks hold shares of it
    (`CacheArray.split`)."""
    t = plan.degrees["tensor"]
    cache = KVCache.empty(plan.model, batch, slots, tensor=t)
    kinds = attention_kind(plan.model).cache(plan.model, t)
    split = ("tensor",) if plan.parallel.tensor is not None else ()
    arrays = {name: vary(a, ("data", *(split if kinds[name].split is not None else ())))
              for name, a in cache.arrays.items()}
    return KVCache(arrays, vary(cache.lengths, "data"))


def cache_spec(plan) -> dict[str, P]:
    """Where the explicit path's cache arrays [L, B, S, *slot] live: rows over `data`, the dim each tensor rank holds
    its share of (`CacheArray.split`: GQA's kv heads) over `tensor` — its global size t × a rank's."""
    tensor = "tensor" if plan.degrees["tensor"] > 1 else None
    return {name: P(None, "data", None, *(tensor if i == a.split else None for i in range(len(a.shape))))
            for name, a in attention_kind(plan.model).cache(plan.model, plan.degrees["tensor"]).items()}


def explicit_decode_step(model: nnx.Module, plan, batch: int, slots: int, **sampling):
    """One decode step of the explicit path and its sampler as their own program (for accounting and benchmarks):
    → (a jitted fn(params, tok [B], cache arrays, lengths [B], key) → (next tok, cache arrays), its example
    arguments: the cache ({name: [L, B, slots, *slot]}, `cache_spec`) empty in the model's dtype, every row at
    position slots − 1, so it attends over them all)."""
    graphdef, params = nnx.split(model)
    _, step, sample = _explicit_parts(graphdef, plan, **sampling)

    def run(params, tok, arrays, lengths, key):
        logits, cache = step(params, tok[:, None], lengths, KVCache(arrays, lengths), None)  # [B, 1, V/t]
        return sample(logits[:, 0], key), cache.arrays

    specs, rows, cache = _param_specs(params, plan), P("data"), cache_spec(plan)
    fn = jax.jit(jax.shard_map(run, mesh=plan.mesh, in_specs=(specs, rows, cache, rows, P()),
                               out_specs=(rows, cache), check_vma=True))
    cfg, t = plan.model, plan.degrees["tensor"]
    place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(plan.mesh, spec))  # noqa: E731

    def empty(a):  # the global array: each tensor rank's share side by side along its split dim
        shape = tuple(n * t if i == a.split else n for i, n in enumerate(a.shape))
        return jnp.zeros((cfg.n_layers, batch, slots, *shape), cfg.dtype)

    arrays = {name: place(empty(a), cache[name]) for name, a in attention_kind(cfg).cache(cfg, t).items()}
    args = (params, place(jnp.zeros((batch,), jnp.int32), rows), arrays,
            place(jnp.full((batch,), slots - 1, jnp.int32), rows), jax.random.key(0))
    return fn, args


def explicit_prefill_logits(model: nnx.Module, plan, tokens: np.ndarray) -> np.ndarray:
    """The explicit path's prefill logits, for checking it: tokens int32 [B, P] from position 0 → float32
    [B, P, vocab_size], each tensor rank's vocab shard put together on the host (the sampler never does that). A
    right-padded row's (`right_pad`) real tokens attend to no padding: their logits are the prompt's alone."""
    graphdef, params = nnx.split(model)
    prefill, _, _ = _explicit_parts(graphdef, plan, temperature=0.0, top_k=0, top_p=1.0)

    def build():  # once per model and plan: callers (held_out_loss) run it batch after batch
        def run(params, tokens):
            B, P_ = tokens.shape
            positions = vary(jnp.zeros((B,), jnp.int32), "data")
            return prefill(params, tokens, positions, _local_cache(plan, B, P_), None)[0]  # [B, P, V/t]

        vocab = "tensor" if plan.degrees["tensor"] > 1 else None
        return jax.jit(jax.shard_map(run, mesh=plan.mesh, in_specs=(_param_specs(params, plan), P("data")),
                                     out_specs=P("data", None, vocab), check_vma=True))

    rows = jax.sharding.NamedSharding(plan.mesh, P("data"))
    logits = _program(("prefill", *_plan_key(graphdef, plan)), build)(params, jax.device_put(jnp.asarray(tokens), rows))
    return np.asarray(logits)[..., :plan.model.vocab_size]


def _explicit_generate(graphdef: nnx.GraphDef, plan, specs, *, max_new_tokens: int, temperature: float, top_k: int,
                       top_p: float, stop: tuple[int, ...], pad_token_id: int):
    """`_decode_loop` under one `shard_map` with the training step's explicit collectives (`_explicit_parts`):
    per-row scalars (or the top-k candidates) cross the tensor group, never the logits. Rows are split over `data`;
    every rank runs the same number of steps (the stop test is reduced over `data`). → a jitted fn(params, tokens
    [B, P], lengths [B], rng) → (new [B, max_new_tokens], count)."""
    prefill, step, sample = _explicit_parts(graphdef, plan, temperature=temperature, top_k=top_k, top_p=top_p)

    def all_stopped(done):
        return jax.lax.pmin(jnp.all(done).astype(jnp.int32), "data") == 1

    def run(params, tokens, lengths, rng):
        cache = _local_cache(plan, tokens.shape[0], tokens.shape[1] + max_new_tokens)
        return _decode_loop(prefill, step, sample, params, tokens, lengths, cache, rng, max_new_tokens=max_new_tokens,
                            stop=stop, pad_token_id=pad_token_id, all_stopped=all_stopped)

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
    → int32 [B, P + n]: the prompts left-padded with pad_token_id (as Hugging Face returns them) followed by the new
    tokens (just the n new ones with return_prompt=False). n = max_new_tokens unless every row stopped earlier.
    The device sees the prompts right-padded (`right_pad`) and each row decodes from its own length
    (`decode_step`).

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
    tokens, lengths = right_pad(input_ids, attention_mask, pad_token_id=pad,
                                multiple=math.lcm(8, plan.degrees["tensor"]) if sp else 8)
    B, P_ = tokens.shape
    real = tokens[np.arange(P_)[None, :] < lengths[:, None]]
    if real.size and (real.min() < 0 or real.max() >= cfg.vocab_size):
        bad = int(real.min() if real.min() < 0 else real.max())
        raise GenerateError(f"token id {bad} in the prompt is outside the model's vocabulary [0, {cfg.vocab_size})")
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise GenerateError(f"prompt of {longest} tokens + max_new_tokens = {max_new_tokens} exceeds the model's "
                         f"max_seq_len = {cfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    graphdef, params = nnx.split(model)
    rng = jax.random.key(seed)
    settings = dict(max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k),
                    top_p=float(top_p), stop=stop, pad_token_id=int(pad))
    if plan is not None and plan.sharded:
        new = _generate_on_plan(graphdef, params, plan, tokens, lengths, rng, **settings)
    else:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            if mesh is not None:
                rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                    "data" if B % mesh.shape["data"] == 0 else None))
                tokens_dev, lengths_dev = jax.device_put(tokens, rows), jax.device_put(lengths, rows)
            else:
                tokens_dev, lengths_dev = jnp.asarray(tokens), jnp.asarray(lengths)
            new, n = _generate(graphdef, params, tokens_dev, lengths_dev, rng, **settings)
            new = np.asarray(new)[:, :int(n)]
    if not return_prompt:
        return new
    source = np.arange(P_)[None, :] - (P_ - lengths)[:, None]  # [B, P]: output column → the row's prompt index
    prompts = np.where(source >= 0, np.take_along_axis(tokens, np.maximum(source, 0), axis=1), pad)
    return np.concatenate([prompts.astype(np.int32), new], axis=1)


def _generate_on_plan(graphdef, params, plan, tokens: np.ndarray, lengths: np.ndarray, rng, **settings) -> np.ndarray:
    """Run `_explicit_generate` (built once per graph, plan and settings) on rows padded to a multiple of `data`
    (a padding row is one pad token, dropped again) → the new tokens [B, n]."""
    data = plan.degrees["data"]
    B = tokens.shape[0]
    extra = -B % data
    if extra:
        tokens = np.concatenate([tokens, np.full((extra, tokens.shape[1]), settings["pad_token_id"], np.int32)])
        lengths = np.concatenate([lengths, np.ones((extra,), np.int32)])
    program = _program((*_plan_key(graphdef, plan), tuple(sorted(settings.items()))),
                       lambda: _explicit_generate(graphdef, plan, _param_specs(params, plan), **settings))
    rows = jax.sharding.NamedSharding(plan.mesh, P("data"))
    new, n = program(params, jax.device_put(tokens, rows), jax.device_put(lengths, rows), rng)
    return np.asarray(new)[:B, :int(n)]
