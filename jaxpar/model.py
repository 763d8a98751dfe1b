"""Decoder-only transformer in Flax NNX: the Llama family and the GPT-2 family in one file.

Dimension letters used in shapes and einsums (gemma style):
    B batch, T query positions, S key positions, D d_model, H query heads, K kv heads, G = H/K query heads per kv
    head, E head_dim, F d_ff, V vocab, L layers.

Design:
- Parameters carry *logical* axes as metadata (`logical_axes=("embed", "mlp")`); `jaxpar.sharding` maps them to the
  mesh. The model imports nothing about meshes or devices.
- The L layers are one `Blocks` module whose parameters are stacked on a leading `layers` axis; the forward is a
  `jax.lax.scan` over that axis, so compile time does not grow with depth and the pipeline can view the stack as
  `[repeats, stages, layers_per_stage, …]` without touching the model.
- The math reads head counts from weight *shapes* (`wq.shape[-2]`), never from the config, so the same code runs on
  full weights on one device and on a tensor-parallel shard (H/t local heads) inside `shard_map`. Where a
  tensor-parallel region begins or ends the model calls a `TensorParallel` handed in from outside (`tp.column`,
  `tp.row`, `tp.embed`, …); the default is the single-device one, whose methods are the plain computation.
- Numerics: master parameters in `param_dtype`; matmuls in `dtype`; the residual stream, norms, softmax and logits in
  float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.parallel.tensor import NEG_INF, SINGLE_DEVICE, TensorParallel
from jaxpar.sharding import constrain

Array = jax.Array

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
}


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, *, std: float = 0.0,
           fill: float = 0.0, pad: tuple[tuple[int, int], ...] | None = None) -> nnx.Param:
    """A parameter with logical axes: normal(0, std) when std > 0, else the constant `fill`; then zero `pad`."""
    if std > 0:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = jnp.full(shape, fill, jnp.float32)
    if pad is not None:
        value = jnp.pad(value, pad)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class Blocks(nnx.Module):
    """All L transformer blocks, parameters stacked on a leading `layers` axis.

    Per-layer parameter shapes (drop the leading L):
        attn_norm [L, D]; wq [L, D, H, E]; wk, wv [L, D, K, E]; wo [L, H, E, D]; mlp_norm [L, D]
        llama: w_gate, w_up [L, D, F]; w_down [L, F, D]
        gpt2:  w_up [L, D, F]; w_down [L, F, D]; biases attn_norm_b, mlp_norm_b, bo, b_down [L, D];
               bq [L, H, E]; bk, bv [L, K, E]; b_up [L, F]
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, D, H, K, E, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        out_std = std / math.sqrt(2 * L)  # GPT-2 / Megatron: scale the projections that write into the residual
        gpt2 = cfg.family == "gpt2"
        self.attn_norm = _param(None, (L, D), ("layers", "norm"), pd, fill=1.0)
        self.wq = _param(rngs, (L, D, H, E), ("layers", "embed", "heads", "head_dim"), pd, std=std)
        self.wk = _param(rngs, (L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), pd, std=std)
        self.wv = _param(rngs, (L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), pd, std=std)
        self.wo = _param(rngs, (L, H, E, D), ("layers", "heads", "head_dim", "embed"), pd, std=out_std)
        self.mlp_norm = _param(None, (L, D), ("layers", "norm"), pd, fill=1.0)
        if not gpt2:
            self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd, std=std)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd, std=std)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), pd, std=out_std)
        if gpt2:
            self.attn_norm_b = _param(None, (L, D), ("layers", "norm"), pd)
            self.mlp_norm_b = _param(None, (L, D), ("layers", "norm"), pd)
            self.bq = _param(None, (L, H, E), ("layers", "heads", "head_dim"), pd)
            self.bk = _param(None, (L, K, E), ("layers", "kv_heads", "head_dim"), pd)
            self.bv = _param(None, (L, K, E), ("layers", "kv_heads", "head_dim"), pd)
            self.bo = _param(None, (L, D), ("layers", "embed"), pd)
            self.b_up = _param(None, (L, F), ("layers", "mlp"), pd)
            self.b_down = _param(None, (L, D), ("layers", "embed"), pd)
        self.cfg = cfg

    def stacked(self) -> dict[str, Array]:
        """The stacked parameters by name, each [L, …] (the local share of the stack inside shard_map)."""
        return {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}

    def __call__(self, x: Array, positions: Array, mask: Array, *, remat: str = "none",
                 tp: TensorParallel = SINGLE_DEVICE) -> Array:
        """x [B, T, D] float32 (T/t under sequence parallelism) → same; positions [B, T]; mask [B, 1, 1, T, S] bool."""
        return run_layers(self.stacked(), x, positions, mask, self.cfg, remat=remat, tp=tp)


def run_layers(stacked: dict[str, Array], x: Array, positions: Array, mask: Array, cfg: ModelConfig, *,
               remat: str = "none", tp: TensorParallel = SINGLE_DEVICE) -> Array:
    """Apply the layers of `stacked` ([n, …] each) in order with a scan; `remat` checkpoints each layer."""

    def body(x, layer):
        return block(layer, x, positions, mask, cfg, tp), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(body, x, stacked)
    return x


class Transformer(nnx.Module):
    """Token ids [B, T] → logits [B, T, V] (float32).

    padded_vocab: rows of the embedding (and columns of the head), ≥ vocab_size. The extra rows are zeros and their
    logits are masked to NEG_INF, so the model computes exactly what the unpadded one does; tensor parallelism pads
    the vocab to a multiple of the tensor degree.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, padded_vocab: int | None = None):
        V, D, pd = cfg.vocab_size, cfg.d_model, jnp.dtype(cfg.param_dtype)
        self.padded_vocab = Vp = padded_vocab or V
        # Random rows for the real vocab first, then zero rows: the real rows get the same values at any padding.
        self.embed = _param(rngs, (V, D), ("vocab", "embed"), pd, std=cfg.init_std, pad=((0, Vp - V), (0, 0)))
        if cfg.family == "gpt2":
            self.pos_embed = _param(rngs, (cfg.max_seq_len, D), (None, "embed"), pd, std=cfg.init_std / 2)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = _param(None, (D,), ("norm",), pd, fill=1.0)
        if cfg.family == "gpt2":
            self.final_norm_b = _param(None, (D,), ("norm",), pd)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (D, V), ("embed", "vocab"), pd, std=cfg.init_std, pad=((0, 0), (0, Vp - V)))
        self.cfg = cfg

    def __call__(self, tokens: Array, *, positions: Array | None = None, segment_ids: Array | None = None,
                 remat: str = "none", tp: TensorParallel = SINGLE_DEVICE) -> Array:
        """tokens int [B, T]; positions [B, T] (default 0..T-1); segment_ids [B, T]: attend only within a segment.

        Returns float32 logits [B, T, V_local]: the whole (padded) vocab on one device, this rank's vocab shard under
        tensor parallelism (the loss is then `tp.cross_entropy`).
        """
        B, T = tokens.shape
        if positions is None:
            positions = default_positions(B, T)
        x = self.embed_tokens(tokens, positions, tp)
        x = self.blocks(x, positions, attention_mask(T, segment_ids), remat=remat, tp=tp)
        return self.logits(x, tp)

    def embed_tokens(self, tokens: Array, positions: Array, tp: TensorParallel = SINGLE_DEVICE) -> Array:
        """tokens [B, T] → residual stream [B, T, D] float32 ([B, T/t, D] under sequence parallelism)."""
        cfg = self.cfg
        x = tp.embed(self.embed[...].astype(cfg.dtype), tokens)
        if cfg.family == "gpt2":
            pos = jnp.take(tp.replicated(self.pos_embed[...]), tp.seq_shard(positions), axis=0)
            x = x + pos.astype(jnp.float32)
        return constrain(x, ("batch", "seq", "embed"))

    def logits(self, x: Array, tp: TensorParallel = SINGLE_DEVICE) -> Array:
        """Final norm and LM head: [B, T(/t), D] → float32 logits [B, T, V_local], padded vocab masked."""
        cfg = self.cfg
        x = norm(x, tp.replicated(self.final_norm[...]), _maybe(tp.replicated, getattr(self, "final_norm_b", None)),
                 cfg)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]  # [D, V_local]
        (logits,) = tp.column(x, (head.astype(cfg.dtype),), ("btd,dv->btv",))  # [B, T, V_local] float32
        if self.padded_vocab != cfg.vocab_size:
            logits = jnp.where(tp.vocab_ids(logits.shape[-1]) < cfg.vocab_size, logits, NEG_INF)
        return constrain(logits, ("batch", "seq", "vocab"))


# -----------------------------------------------------------------------------------------------------------------
# The math of one layer, as plain functions of (per-layer parameter dict, activations).


def _maybe(fn, x):
    return None if x is None else fn(x)


def block(p: dict[str, Array], x: Array, positions: Array, mask: Array, cfg: ModelConfig,
          tp: TensorParallel = SINGLE_DEVICE) -> Array:
    """One pre-norm transformer block. p holds one layer's parameters (no leading L); x [B, T, D] float32
    ([B, T/t, D] under sequence parallelism: norms and residual adds run on sequence shards)."""
    h = norm(x, tp.replicated(p["attn_norm"]), _maybe(tp.replicated, p.get("attn_norm_b")), cfg)
    x = x + attention(p, h, positions, mask, cfg, tp)
    x = constrain(x, ("batch", "seq", "embed"))
    h = norm(x, tp.replicated(p["mlp_norm"]), _maybe(tp.replicated, p.get("mlp_norm_b")), cfg)
    x = x + mlp(p, h, cfg, tp)
    return constrain(x, ("batch", "seq", "embed"))


def norm(x: Array, scale: Array, bias: Array | None, cfg: ModelConfig) -> Array:
    """RMSNorm (llama) or LayerNorm (gpt2) in float32 → compute dtype. x [B, T, D]."""
    x = x.astype(jnp.float32)
    if cfg.family == "gpt2":
        x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(cfg.dtype)


def attention(p: dict[str, Array], h: Array, positions: Array, mask: Array, cfg: ModelConfig,
              tp: TensorParallel = SINGLE_DEVICE) -> Array:
    """Causal self-attention with GQA. h [B, T, D] (compute dtype) → [B, T, D] float32.

    Query head n belongs to kv group n // G (Hugging Face's `repeat_kv` order), so a contiguous slice of query heads
    and the matching slice of kv heads form a self-contained tensor-parallel shard. QKV is column-parallel (local
    heads), the output projection row-parallel.
    """
    dt = cfg.dtype
    wk, wv = tp.kv_weight(p["wk"]), tp.kv_weight(p["wv"])
    q, k, v = (y.astype(dt) for y in tp.column(h, (p["wq"].astype(dt), wk.astype(dt), wv.astype(dt)),
                                                ("btd,dhe->bthe", "bsd,dke->bske", "bsd,dke->bske")))
    # q [B, T, H, E]; k, v [B, S, K, E] (local heads under tensor parallelism; S = T, the full sequence)
    if cfg.family == "gpt2":
        bk, bv = tp.kv_weight(p["bk"]), tp.kv_weight(p["bv"])
        q, k, v = q + p["bq"].astype(dt), k + bk.astype(dt), v + bv.astype(dt)
    else:
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
    B, T, H, E = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, H // K, E)  # [B, T, K, G, E]
    scores = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(E)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)  # mask [B, 1, 1, T, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    o = jnp.einsum("bkgts,bske->btkge", probs, v).reshape(B, T, H, E)  # [B, T, H, E]
    out = tp.row(o, p["wo"].astype(dt), "bthe,hed->btd")  # [B, T, D] float32 ([B, T/t, D] under SP)
    if "bo" in p:
        out = out + tp.replicated(p["bo"]).astype(jnp.float32)
    return out


def mlp(p: dict[str, Array], h: Array, cfg: ModelConfig, tp: TensorParallel = SINGLE_DEVICE) -> Array:
    """SwiGLU (llama) or GELU (gpt2) MLP: up/gate column-parallel, down row-parallel. h [B, T, D] → [B, T, D] f32."""
    dt = cfg.dtype
    if cfg.family == "gpt2":
        (up,) = tp.column(h, (p["w_up"].astype(dt),), ("btd,df->btf",))  # [B, T, F]
        act = jax.nn.gelu((up + p["b_up"]).astype(dt), approximate=True)  # GPT-2's tanh GELU ("gelu_new")
    else:
        gate, up = tp.column(h, (p["w_gate"].astype(dt), p["w_up"].astype(dt)), ("btd,df->btf", "btd,df->btf"))
        act = (jax.nn.silu(gate) * up).astype(dt)
    act = constrain(act, ("batch", "seq", "mlp"))
    out = tp.row(act, p["w_down"].astype(dt), "btf,fd->btd")
    if "b_down" in p:
        out = out + tp.replicated(p["b_down"]).astype(jnp.float32)
    return out


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding, Hugging Face's rotate-half convention. x [B, T, N, E]; positions [B, T].

    Pairs (i, i + E/2) rotate by angle pos · theta^(-2i/E):  [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin].
    """
    E = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E)  # [E/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]  # [B, T, 1, E/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def default_positions(B: int, T: int) -> Array:
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def attention_mask(T: int, segment_ids: Array | None) -> Array:
    """Causal mask, intersected with same-segment when segment_ids [B, T] is given. → bool [B|1, 1, 1, T, S]."""
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))  # [T, S]
    if segment_ids is None:
        return causal[None, None, None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    return (causal & same)[:, None, None]


def pad_vocab(params: nnx.State, padded_vocab: int) -> nnx.State:
    """Resize the vocab dim of `embed` [V, D] (rows) and `lm_head` [D, V] (columns) to `padded_vocab`, adding zero
    rows or dropping trailing ones. Converts between a model and its tensor-parallel (padded) twin."""

    def resize(x, axis):
        n = padded_vocab - x.shape[axis]
        if n <= 0:
            return jax.lax.slice_in_dim(x, 0, padded_vocab, axis=axis)
        return jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])

    out = jax.tree.map(lambda x: x, params)  # a copy: the caller's State is left alone
    out["embed"] = params["embed"].replace(resize(params["embed"][...], 0))
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"].replace(resize(params["lm_head"][...], 1))
    return out


def permute_layers(params: nnx.State, order) -> nnx.State:
    """Reorder the stacked layer axis: position n of the result holds `params`' layer order[n]."""
    out = jax.tree.map(lambda x: x, params)
    out["blocks"] = jax.tree.map(lambda x: x[jnp.asarray(order)], params["blocks"])
    return out


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters, from the abstract model (no allocation)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
