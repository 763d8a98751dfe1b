"""Attention kinds: what a layer's attention holds, what its decoding cache holds, and the rules it sets.

A family names its attention kind (`Family.attention`) as it names its MLP; this table declares each kind as data —
its parameters, its cache layout (per array: one slot's shape on one tensor rank and the logical axes of each
dim), its layout rules against the tensor degree, and its FLOPs — and `jaxpar.model.ATTENTION` holds the function
that computes it. Everything that sizes, lays out, checks or counts attention reads these entries: the model's
parameters and its `KVCache`, decoding's cache layout on a mesh (`jaxpar.infer.decode`), the planner's cache bytes
(`jaxpar.planner.memory.kv_cache_bytes`), the config's layout checks and the FLOP formulas. So a new kind (latent
attention, a paged layout) is a new entry here and its function in jaxpar.model; decode, the planner and the checks
do not change.

Like the family files, this module imports no jax (the config validates against it before jax loads).
"""

from __future__ import annotations

import math

from jaxpar.errors import ConfigError, check_divides, divisors
from jaxpar.families.base import AttentionKind, CacheArray, Param

# Dimension letters: D d_model, H query heads, K kv heads, E head_dim, t the tensor degree.


def _gqa_params(cfg) -> dict[str, Param]:
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {"wq": Param((D, H, E), ("embed", "heads", "head_dim"), "normal", contract=(0,), role="attention"),
            "wk": Param((D, K, E), ("embed", "kv_heads", "head_dim"), "normal", contract=(0,), role="attention"),
            "wv": Param((D, K, E), ("embed", "kv_heads", "head_dim"), "normal", contract=(0,), role="attention"),
            "wo": Param((H, E, D), ("heads", "head_dim", "embed"), "out", contract=(0, 1), role="attention")}


def _gqa_heads(cfg, tensor: int) -> int:
    """The kv heads one tensor rank holds: K/t, or one when K does not split over t (the one its query heads read)."""
    return cfg.n_kv_heads // tensor if cfg.n_kv_heads % tensor == 0 else 1


def _gqa_cache(cfg, tensor: int) -> dict[str, CacheArray]:
    slot = CacheArray((_gqa_heads(cfg, tensor), cfg.head_dim), ("kv_heads", "head_dim"), split=0)
    return {"k": slot, "v": slot}  # keys after RoPE, and values


def _gqa_check(cfg, tensor: int) -> None:
    check_divides("model.n_heads", cfg.n_heads, "parallel.tensor", tensor, "each tensor shard holds whole query heads")
    if cfg.n_kv_heads % tensor and tensor % cfg.n_kv_heads:
        raise ConfigError("model.n_kv_heads", cfg.n_kv_heads,
                          f"must be a multiple or a divisor of parallel.tensor = {tensor} (kv heads are split "
                          "over tensor, or replicated so each rank holds the one its query heads use)",
                          f"use n_kv_heads among {divisors(tensor)} or a multiple of {tensor}")


def _gqa_shared(cfg, tensor: int) -> int:
    return tensor // cfg.n_kv_heads if tensor > 1 and cfg.n_kv_heads % tensor else 1


def _gqa_flops(cfg, keys: float, tensor: int) -> tuple[float, float]:
    """q, k, v and out projections: 2·D·E·(H + 2K) + 2·H·E·D; scores and their product with V: 4·H·E·keys (local
    heads: H/t, and K/t or at least one)."""
    D, E = cfg.d_model, cfg.head_dim
    H, K = cfg.n_heads / tensor, max(cfg.n_kv_heads / tensor, 1)
    return 2 * D * E * (H + 2 * K) + 2 * H * E * D, 4 * H * E * keys


def _gqa_local(cfg, tensor: int) -> dict[str, int]:
    return {"n_heads": cfg.n_heads // tensor, "n_kv_heads": _gqa_heads(cfg, tensor)}


def _gqa_traffic(cfg, tensor: int, sequence: bool) -> tuple[float, float]:
    """Tensor: f in (its all-reduce backward) and g out (forward) on D values, 4 halves; under SP the all-gather in,
    its backward re-gather, the reduce-scatter out and both backward: 5. Context: K_local keys and values of E."""
    return (5 if sequence else 4) * cfg.d_model, 2 * _gqa_heads(cfg, tensor) * cfg.head_dim


def _gqa_matmuls(cfg, tensor: int, seq: int) -> list[tuple[float, float]]:
    """q [D → H/t·E] and o [H/t·E → D]; k and v [D → K/t·E] (at least one head); per local head the scores
    [s, E] @ [E, s] and their product with V [s, s] @ [s, E] — 2·E·s FLOPs a token each."""
    D, E, a, kv = cfg.d_model, cfg.head_dim, max(cfg.n_heads // tensor, 1), max(cfg.n_kv_heads // tensor, 1)
    return ([(2 * D * a * E, math.sqrt(D * a * E))] * 2 + [(2 * D * kv * E, math.sqrt(D * kv * E))] * 2
            + [(2 * E * seq * a, math.sqrt(E * seq))] * 2)


# Grouped-query attention (multi-head when K = H): query head n reads kv head n // (H/K); the cache holds every
# layer's keys and values per slot, kv heads split over tensor.
GQA = AttentionKind("gqa", params=_gqa_params, cache=_gqa_cache, check=_gqa_check, shared=_gqa_shared,
                    flops=_gqa_flops, local=_gqa_local, traffic=_gqa_traffic, matmuls=_gqa_matmuls,
                    shared_axes=("kv_heads",))


# -----------------------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2 §2.1). Letters: r kv_lora_rank, rq q_lora_rank, R qk_rope_head_dim,
# N qk_nope_head_dim, Eqk = N + R (= head_dim), Ev v_head_dim.


def _mla_params(cfg) -> dict[str, Param]:
    """The projections in Hugging Face's order (and so a seed's draw order):

        wq [D, H, Eqk]                 queries straight from the stream (q_lora_rank 0), or
        wq_a [D, rq]; q_a_norm [rq]; wq_b [rq, H, Eqk]     the low-rank query path with its RMSNorm
        wkv_a [D, r + R]               the compressed latent (first r) and the rope key every head shares (last R)
        kv_a_norm [r]                  the latent's RMSNorm
        wkv_b [r, H, N + Ev]           the latent's up-projection: per head its key part without RoPE, then its value
        wo [H, Ev, D]

    Within each head's Eqk the last R dims are the rope part. The down-projections (wq_a, wkv_a) and their norms are
    held whole by every tensor rank (logical axes q_lora / kv_lora are replicated): their outputs are narrow, and
    the heads split only after them (jaxpar.model.mla_attention)."""
    D, H = cfg.d_model, cfg.n_heads
    r, rq, R, N, Ev = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    Eqk = N + R
    if rq:
        params = {"wq_a": Param((D, rq), ("embed", "q_lora"), "normal", contract=(0,), role="attention"),
                  "q_a_norm": Param((rq,), ("q_lora",), "ones", decay=False),
                  "wq_b": Param((rq, H, Eqk), ("q_lora", "heads", "head_dim"), "normal", contract=(0,),
                                role="attention")}
    else:
        params = {"wq": Param((D, H, Eqk), ("embed", "heads", "head_dim"), "normal", contract=(0,), role="attention")}
    params.update(
        wkv_a=Param((D, r + R), ("embed", "kv_lora"), "normal", contract=(0,), role="attention"),
        kv_a_norm=Param((r,), ("kv_lora",), "ones", decay=False),
        wkv_b=Param((r, H, N + Ev), ("kv_lora", "heads", "head_dim"), "normal", contract=(0,), role="attention"),
        wo=Param((H, Ev, D), ("heads", "head_dim", "embed"), "out", contract=(0, 1), role="attention"))
    return params


def _mla_cache(cfg, tensor: int) -> dict[str, CacheArray]:
    """Per slot the normalised latent [r] and the rotated rope key [R] — the same on every tensor rank (split None):
    r + R values a token a layer whatever the head count, against GQA's 2·K·E (K/t per rank)."""
    return {"latent": CacheArray((cfg.kv_lora_rank,), ("kv_lora",)),
            "k_rope": CacheArray((cfg.qk_rope_head_dim,), ("head_dim",))}


def _mla_check(cfg, tensor: int) -> None:
    check_divides("model.n_heads", cfg.n_heads, "parallel.tensor", tensor, "each tensor shard holds whole heads")


def _mla_flops(cfg, keys: float, tensor: int) -> tuple[float, float]:
    """Training's expanded form, per token on one of t ranks: projections 2·D·H·Eqk/t (or 2·D·rq + 2·rq·H·Eqk/t)
    + 2·D·(r + R) (the latent, replicated: every rank computes it for its tokens) + 2·r·H·(N + Ev)/t + 2·H·Ev·D/t;
    core 2·H·(Eqk + Ev)·keys/t.

    Decoding runs the absorbed form instead (jaxpar.model.mla_attention): per new token and local head 2·N·r (q
    into latent space) + 2·(r + R)·keys (scores) + 2·r·keys (context in latent space) + 2·r·Ev (the value
    up-projection), and no per-key up-projection — the latent cache is read once per head, never expanded."""
    D, H = cfg.d_model, cfg.n_heads / tensor
    r, rq, R, N, Ev = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = 2 * D * H * (N + R) if not rq else 2 * D * rq + 2 * rq * H * (N + R)
    projections = q + 2 * D * (r + R) + 2 * r * H * (N + Ev) + 2 * H * Ev * D
    return projections, 2 * H * (N + R + Ev) * keys


def _mla_local(cfg, tensor: int) -> dict[str, int]:
    return {"n_heads": cfg.n_heads // tensor, "n_kv_heads": cfg.n_heads // tensor}


def _mla_traffic(cfg, tensor: int, sequence: bool) -> tuple[float, float]:
    """Tensor, with Q = q_lora_rank (or D when queries are projected directly): the region is entered by the query
    latent (Q), the kv latent (r) and the rope key (R), and left by D. Without SP: f's all-reduces backward and g's
    forward, 2·(Q + r + R + D) halves. Under SP: Q, r, R gathered forward, Q and r re-gathered backward (the
    column groups'), their three gradients reduce-scattered; D reduce-scattered forward, gathered backward:
    3·Q + 3·r + 2·R + 2·D (the replicated down-projections' gradients are the planner's replicated parameters).
    Context: the expanded per-head keys and values, each padded to max(Eqk, Ev) (`mla_attention`)."""
    Q, r, R, D = cfg.q_lora_rank or cfg.d_model, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.d_model
    halves = 3 * Q + 3 * r + 2 * R + 2 * D if sequence else 2 * (Q + r + R + D)
    return halves, 2 * cfg.n_heads // tensor * max(cfg.head_dim, cfg.v_head_dim)


def _mla_matmuls(cfg, tensor: int, seq: int) -> list[tuple[float, float]]:
    """Training's expanded form on one rank, a = H/t local heads: the query path [D → rq] (replicated) and
    [rq → a·Eqk], or [D → a·Eqk] directly; the latent and rope key [D → r + R] (replicated); the latent's
    up-projection [r → a·(N + Ev)]; o [a·Ev → D]; per local head the scores [s, Eqk] @ [Eqk, s] and the context
    [s, s] @ [s, Ev]. The FLOPs sum to `_mla_flops` with keys = seq."""
    D, a = cfg.d_model, max(cfg.n_heads // tensor, 1)
    r, rq, R, N, Ev = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    Eqk = N + R
    out = ([(2 * D * rq, math.sqrt(D * rq)), (2 * rq * a * Eqk, math.sqrt(rq * a * Eqk))] if rq
           else [(2 * D * a * Eqk, math.sqrt(D * a * Eqk))])
    out += [(2 * D * (r + R), math.sqrt(D * (r + R))), (2 * r * a * (N + Ev), math.sqrt(r * a * (N + Ev))),
            (2 * a * Ev * D, math.sqrt(a * Ev * D))]
    return out + [(2 * Eqk * seq * a, math.sqrt(Eqk * seq)), (2 * Ev * seq * a, math.sqrt(seq * Ev))]


# Multi-head latent attention: the latent projections replicated, heads split over tensor; the cache holds each
# token's normalised latent and rotated rope key, whole on every tensor rank.
MLA = AttentionKind("mla", params=_mla_params, cache=_mla_cache, check=_mla_check, shared=lambda cfg, tensor: 1,
                    flops=_mla_flops, local=_mla_local, traffic=_mla_traffic, matmuls=_mla_matmuls)

ATTENTION_KINDS: dict[str, AttentionKind] = {GQA.name: GQA, MLA.name: MLA}


def attention_params(cfg, kind: AttentionKind, *, norm_bias: bool) -> dict[str, Param]:
    """A layer's attention half as a family lists it: the pre-attention norm, the kind's parameters, the pre-MLP
    norm (with LayerNorm biases when `norm_bias`) — in this order, which is the order a seed's draws follow."""
    D = cfg.d_model
    params = {"attn_norm": Param((D,), ("norm",), "ones", decay=False), **kind.params(cfg),
              "mlp_norm": Param((D,), ("norm",), "ones", decay=False)}
    if norm_bias:
        params.update(attn_norm_b=Param((D,), ("norm",), "zeros", decay=False),
                      mlp_norm_b=Param((D,), ("norm",), "zeros", decay=False))
    return params


def qk_norm_params(cfg) -> dict[str, Param]:
    """The q/k norm's scales (Qwen3): q_norm, k_norm [E], one RMSNorm scale each, shared by every head (held whole
    by every tensor rank: the heads split, head_dim never does)."""
    E = cfg.head_dim
    return {"q_norm": Param((E,), ("head_dim",), "ones", decay=False),
            "k_norm": Param((E,), ("head_dim",), "ones", decay=False)}


def sink_params(cfg) -> dict[str, Param]:
    """Attention sinks (gpt-oss): sinks [H], one learned logit per query head that joins its softmax's denominator
    (split over tensor with the heads)."""
    return {"sinks": Param((cfg.n_heads,), ("heads",), "zeros", decay=False)}


def qkv_bias_params(cfg) -> dict[str, Param]:
    """GQA's q, k, v projection biases (GPT-2; the llama family with qkv_bias, Qwen2): bq [H, E]; bk, bv [K, E]."""
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {"bq": Param((H, E), ("heads", "head_dim"), "zeros", decay=False),
            "bk": Param((K, E), ("kv_heads", "head_dim"), "zeros", decay=False),
            "bv": Param((K, E), ("kv_heads", "head_dim"), "zeros", decay=False)}
