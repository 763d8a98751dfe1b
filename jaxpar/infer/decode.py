"""KV-cache generation: one prefill over the (left-padded) prompts, then one token per step, all on device.

    prompts (ragged) ─left-pad→ tokens [B, P] ─prefill→ cache slots 0…P-1 ─decode→ slot P, P+1, … (one token each)

Left padding puts every row's next token in the same cache slot, so each step is one `dynamic_update_slice` for
the whole batch; the pad slots are masked out of attention and positions count from each row's first real token
(`jaxpar.model.KVCache`). The decode loop is a `lax.while_loop` inside the same `jit` as the prefill: no host round
trip per token, and it stops early once every row has emitted a stop token.

Per step the matmuls see one token per row — their cost does not grow with the context; attention reads the whole
cache buffer of `P + max_new_tokens` slots (masked), a cost fixed at compile time.

On a mesh the parameters keep their tensor-parallel sharding and GSPMD partitions the computation: the cache is laid
out like the activations that fill it — batch over `data`, kv heads over `tensor` (replicated when there are fewer
kv heads than tensor ranks, as the weights are).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.infer.sampling import check_sampling_args, sample_logits
from jaxpar.errors import GenerateError
from jaxpar.model import KVCache
from jaxpar.sharding import constrain

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


def generate(model: nnx.Module, input_ids: Sequence[Sequence[int]] | np.ndarray, *, max_new_tokens: int = 20,
             attention_mask: np.ndarray | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int = 0, mesh: jax.sharding.Mesh | None = None,
             return_prompt: bool = True) -> np.ndarray:
    """Hugging Face-style generation with a KV cache: prompts (ragged lists, or [B, T] ids with an attention_mask)
    → int32 [B, P + n]: the left-padded prompts followed by the new tokens (just the n new ones with
    return_prompt=False). n = max_new_tokens unless every row stopped earlier.

    do_sample=False is greedy; otherwise sampling at `temperature` with optional top_k (0: off — HF's default is
    50) and top_p (1.0: off). eos_token_id: one id or several; a row that emits one is finished and padded with
    pad_token_id (default: the first eos id, else 0). seed fixes the sampling. `mesh`: run under it (the params'
    shardings decide the layout). The prompt plus max_new_tokens must fit the model's max_seq_len.
    """
    cfg = model.cfg
    temperature = temperature if do_sample else 0.0
    check_sampling_args(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens = {max_new_tokens!r}: must be an integer >= 1")
    stop = () if eos_token_id is None else tuple(int(i) for i in np.atleast_1d(eos_token_id))
    pad = pad_token_id if pad_token_id is not None else (stop[0] if stop else 0)
    tokens, start = left_pad(input_ids, attention_mask, pad_token_id=pad)
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

