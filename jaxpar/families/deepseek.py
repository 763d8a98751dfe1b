"""The DeepSeek family — DeepSeek-V2 and V3: multi-head latent attention and DeepSeekMoE.

A layer: x + MLA(RMSNorm(x)), then + SwiGLU(RMSNorm(x)) — a dense SwiGLU in the first layers (moe.dense_layers:
HF's first_k_dense_replace), a mixture of fine-grained SwiGLU experts with shared experts elsewhere (base.moe_params;
moe.shared_d_ff is n_shared_experts · moe_intermediate_size). Attention is the `mla` kind
(jaxpar.families.attention.MLA, jaxpar.model.mla_attention): queries directly or through a low-rank path with its
RMSNorm, keys and values from a compressed latent with its RMSNorm, a rotary key shared by all heads, RoPE in
DeepSeek's interleaved pair order when rope_interleave, YaRN scaling with its softmax-scale correction.

    per layer   attn_norm [D]; wq [D, H, Eqk] or wq_a [D, rq], q_a_norm [rq], wq_b [rq, H, Eqk];
                wkv_a [D, r + R]; kv_a_norm [r]; wkv_b [r, H, N + Ev]; wo [H, Ev, D]; mlp_norm [D];
                w_gate, w_up [D, F]; w_down [F, D] (dense layers) or the MoE parameters (base.moe_params)

Hugging Face: DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, mapped in jaxpar/families/deepseek_hf.py.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families.attention import MLA, attention_params
from jaxpar.families import deepseek_hf
from jaxpar.families.base import Family, Param, mlp_params, swiglu_d_ff


def layer_params(cfg, moe: bool) -> dict[str, Param]:
    """The deepseek layer: latent attention between RMSNorms, a SwiGLU MLP or (`moe`) DeepSeekMoE."""
    return {**attention_params(cfg, MLA, norm_bias=False), **mlp_params(cfg, moe)}


def check(cfg) -> None:
    """MLA needs its latent and head widths; head_dim is the query/key width, and there are no kv heads."""
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"model.{name}", getattr(cfg, name), "must be > 0 for the deepseek family (multi-head "
                              "latent attention)", "DeepSeek-V2-Lite uses kv_lora_rank 512, qk_rope_head_dim 64, "
                              "qk_nope_head_dim 128, v_head_dim 128")
    if cfg.head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim:
        raise ConfigError("model.head_dim", cfg.head_dim, f"must be qk_nope_head_dim + qk_rope_head_dim = "
                          f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} in the deepseek family (the query/key "
                          "head width)", "leave model.head_dim at 0 (derived)")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError("model.n_kv_heads", cfg.n_kv_heads, "multi-head latent attention has no kv heads: every "
                          f"head reads the shared latent (n_kv_heads must equal n_heads = {cfg.n_heads})",
                          "leave model.n_kv_heads at 0")


# -----------------------------------------------------------------------------------------------------------------

FAMILY = Family(name="deepseek", summary="RMSNorm, RoPE, SwiGLU / DeepSeekMoE, multi-head latent attention "
                "(DeepSeek-V2, V3)", norm="rms", positions="rope", mlp="swiglu", layer_params=layer_params,
                default_d_ff=swiglu_d_ff, check=check, hf=deepseek_hf.HF, attention=MLA.name)
