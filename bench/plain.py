"""A plain hand-written `jax.jit` train step of the same math as jaxpar's single-device step — the baseline of
`python -m bench`'s first row.

Nothing from jaxpar is used: parameters are a dict of arrays (the same names and shapes as `jaxpar.model.Blocks`,
stacked on a leading layer axis), the Llama block is written out with einsums, the layers run under `lax.scan`, the
loss is float32 cross-entropy, and the update is optax's clip-by-global-norm + AdamW with the same warmup-cosine
schedule and the same weight-decay mask (no decay on norms). The state is donated. What jaxpar adds on top —
NNX graph/state plumbing, skipping non-finite steps, the metrics dict — is exactly what the ratio measures.
Llama family only (RMSNorm, RoPE, GQA, SwiGLU; tied or untied head), no biases, no sliding window.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

Params = dict[str, jax.Array]


def _rms(x, scale, eps):  # x [B, T, D] float32
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _rope(x, theta):  # x [B, T, N, E], positions 0..T-1, rotate-half convention
    T, E = x.shape[1], x.shape[-1]
    angles = jnp.arange(T, dtype=jnp.float32)[:, None] * theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]  # [1, T, 1, E/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def loss_fn(params: Params, batch: jax.Array, *, dtype, eps: float, theta: float, tied: bool) -> jax.Array:
    """Mean next-token cross-entropy of batch int [B, T+1] under a Llama with stacked layer params."""
    tokens, targets = batch[:, :-1], batch[:, 1:]
    T = tokens.shape[1]
    x = params["embed"].astype(dtype)[tokens].astype(jnp.float32)  # [B, T, D]
    causal = jnp.tril(jnp.ones((T, T), bool))

    def layer(x, p):
        h = _rms(x, p["attn_norm"], eps).astype(dtype)
        q = _rope(jnp.einsum("btd,dhe->bthe", h, p["wq"].astype(dtype)), theta)  # [B, T, H, E]
        k = _rope(jnp.einsum("bsd,dke->bske", h, p["wk"].astype(dtype)), theta)  # [B, S, K, E]
        v = jnp.einsum("bsd,dke->bske", h, p["wv"].astype(dtype))
        B, _, H, E = q.shape
        K = k.shape[2]
        q = q.reshape(B, T, K, H // K, E)
        s = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(E)
        probs = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(jnp.float32).min), axis=-1).astype(dtype)
        o = jnp.einsum("bkgts,bske->btkge", probs, v).reshape(B, T, H, E)
        x = x + jnp.einsum("bthe,hed->btd", o, p["wo"].astype(dtype), preferred_element_type=jnp.float32)
        h = _rms(x, p["mlp_norm"], eps).astype(dtype)
        gate = jnp.einsum("btd,df->btf", h, p["w_gate"].astype(dtype), preferred_element_type=jnp.float32)
        up = jnp.einsum("btd,df->btf", h, p["w_up"].astype(dtype), preferred_element_type=jnp.float32)
        act = (jax.nn.silu(gate) * up).astype(dtype)
        return x + jnp.einsum("btf,fd->btd", act, p["w_down"].astype(dtype), preferred_element_type=jnp.float32), None

    x, _ = jax.lax.scan(layer, x, params["blocks"])
    head = params["embed"].T if tied else params["lm_head"]
    h = _rms(x, params["final_norm"], eps).astype(dtype)
    logits = jnp.einsum("btd,dv->btv", h, head.astype(dtype), preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def optimizer(train) -> optax.GradientTransformation:
    """Clip, then AdamW with warmup + cosine decay; decay on matrices and embeddings only (`train`: TrainConfig)."""
    decay_steps = max(train.steps, train.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, train.lr, train.warmup_steps, decay_steps,
                                                  train.lr * train.min_lr_ratio)
    mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in str(path[-1].key), params)
    adamw = optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw) if train.grad_clip > 0 else adamw


def make_step(model, train) -> tuple[Callable, optax.GradientTransformation]:
    """(jitted step (params, opt_state, batch) -> (params, opt_state, loss), the optimizer) for a ModelConfig and
    TrainConfig; params and optimizer state are donated."""
    tx = optimizer(train)
    loss = lambda p, b: loss_fn(p, b, dtype=jnp.dtype(model.dtype), eps=model.norm_eps,
                                theta=model.rope_theta, tied=model.tie_embeddings)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), tx


def init_params(key, *, vocab: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                d_ff: int, std: float = 0.02) -> Params:
    """Normal(0, std) matrices and unit norm scales, stacked on a leading layer axis (the names of `loss_fn`)."""
    L, D, H, K, E, F = n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff
    shapes = {"wq": (L, D, H, E), "wk": (L, D, K, E), "wv": (L, D, K, E), "wo": (L, H, E, D),
              "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    keys = iter(jax.random.split(key, len(shapes) + 2))
    blocks = {name: std * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}
    blocks.update(attn_norm=jnp.ones((L, D)), mlp_norm=jnp.ones((L, D)))
    return {"embed": std * jax.random.normal(next(keys), (vocab, D)), "blocks": blocks,
            "final_norm": jnp.ones((D,)), "lm_head": std * jax.random.normal(next(keys), (D, vocab))}


# Which dimension of each stacked block weight splits over `tensor` (Megatron: q/k/v and gate/up by output
# columns — heads or MLP hidden — o and down by input rows); everything else is replicated.
TENSOR_DIM = {"wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 2, "w_up": 2, "w_down": 1}


def shardings(params: Params, mesh) -> Params:
    """NamedShardings for `params` on a ("data", "tensor") mesh (see TENSOR_DIM)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def spec(path, leaf):
        name = path[-1].key
        dims = [None] * leaf.ndim
        if path[0].key == "blocks" and name in TENSOR_DIM:
            dims[TENSOR_DIM[name]] = "tensor"
        return NamedSharding(mesh, P(*dims))

    return jax.tree_util.tree_map_with_path(spec, params)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import types

    import numpy as np

    parser = argparse.ArgumentParser(prog="python -m bench.plain", description=__doc__.split("\n\n")[0])
    for name, default in (("steps", 10), ("data", 1), ("tensor", 1), ("batch", 8), ("seq", 64), ("vocab", 256),
                          ("d-model", 128), ("layers", 4), ("heads", 4), ("kv-heads", 4), ("head-dim", 32),
                          ("d-ff", 512)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args(argv)
    model = types.SimpleNamespace(dtype="float32", norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
    train = types.SimpleNamespace(steps=a.steps, warmup_steps=max(1, a.steps // 10), lr=3e-3, min_lr_ratio=0.1,
                                  b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0)
    step, tx = make_step(model, train)
    params = init_params(jax.random.key(0), vocab=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
                         n_kv_heads=a.kv_heads, head_dim=a.head_dim, d_ff=a.d_ff)
    put = jax.device_put
    if a.data * a.tensor > 1:
        from jax.sharding import NamedSharding, PartitionSpec as P

        auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagates the shardings (no sharding-in-types)
        mesh = jax.make_mesh((a.data, a.tensor), ("data", "tensor"), auto, devices=jax.devices()[: a.data * a.tensor])
        params = jax.device_put(params, shardings(params, mesh))
        rows = NamedSharding(mesh, P("data"))
        put = lambda x: jax.device_put(x, rows)  # noqa: E731
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    loss = None
    for _ in range(a.steps):
        batch = put(rng.integers(0, a.vocab, (a.batch, a.seq + 1)).astype(np.int32))
        params, opt_state, loss = step(params, opt_state, batch)
    print(f"done: {a.steps} steps, loss {float(loss):.4f}")
    return 0


def params_from_jaxpar(params) -> Params:
    """A jaxpar single-device `nnx.State` of parameters → the plain dict (fresh buffers, so donation is safe)."""
    from flax import nnx

    return jax.tree.map(jnp.copy, dict(nnx.to_pure_dict(params)))


if __name__ == "__main__":
    import sys

    sys.exit(main())
