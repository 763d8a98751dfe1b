"""Hugging Face mapping of gpt-oss (GptOssForCausalLM) onto the llama family.

gpt-oss is a llama layer with every mechanism switched on: q, k, v *and* o biases (`model.qkv_bias`,
`model.o_bias`), attention sinks (`model.attention_sinks`: a learned logit per head in the softmax), sliding-window
and full layers alternating (`layer_types`: `model.sliding_window`, `model.full_attention_every` 2), YaRN RoPE
with unrounded ramp ends (`rope_scaling` yarn, `rope_truncate` false, its cos/sin factor 0.1·ln(factor) + 1), and
in every layer a mixture of experts whose router has a bias (`moe.router_bias`), whose top-k logits are softmaxed
(the top-k of the softmax over all experts, renormalised: `moe.norm_topk_prob`), and whose experts have biases
(`moe.expert_bias`) and the clamped SwiGLU (`moe.swiglu_limit`, `moe.swiglu_alpha`):
(clip(up, −limit, limit) + 1) · g · σ(alpha·g), g = min(gate, limit).

    config.json                          jaxpar
    num_local_experts                    moe.n_experts
    num_experts_per_tok                  moe.top_k
    intermediate_size                    moe.d_ff (and model.d_ff)
    swiglu_limit, swiglu_alpha           moe.swiglu_limit, moe.swiglu_alpha
    router_aux_loss_coef                 moe.aux_loss_coef
    attention_bias                       model.qkv_bias and model.o_bias
    sliding_window, layer_types          model.sliding_window, model.full_attention_every
    rope_parameters (yarn)               model.rope_* (rope_truncate from truncate)

Tensors per layer l (under `model.layers.{l}.`; the experts' are [in, out], not torch Linear's [out, in]):

    jaxpar                      gpt-oss
    attn_norm, mlp_norm [D]     input_layernorm.weight, post_attention_layernorm.weight
    wq, wk, wv, wo; bq, bk, bv  self_attn.{q,k,v,o}_proj.weight; self_attn.{q,k,v}_proj.bias (llama's rules)
    bo [D]                      self_attn.o_proj.bias
    sinks [H]                   self_attn.sinks
    router [D, X]; router_b [X] mlp.router.weight [X, D]; mlp.router.bias
    we_gate, we_up [X, D, F]    mlp.experts.gate_up_proj [X, D, 2F]: gate in the even columns, up in the odd
    we_gate_b, we_up_b [X, F]   mlp.experts.gate_up_proj_bias [X, 2F], interleaved alike
    we_down [X, F, D]           mlp.experts.down_proj [X, F, D]
    we_down_b [X, D]            mlp.experts.down_proj_bias

A layer's fused expert tensor is read whole for each part (`Rule.interleave`). The released checkpoints store the
experts' matrices in MXFP4 (`*_blocks`, `*_scales` and a `quantization_config`): refused by name — dequantize them
with transformers (`Mxfp4Config(dequantize=True)`, then `save_pretrained`) and import that.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families import rope_hf
from jaxpar.families.base import Rule, same

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
KEYS = {"moe.n_experts": "num_local_experts", "moe.top_k": "num_experts_per_tok", "moe.d_ff": "intermediate_size",
        "moe.swiglu_limit": "swiglu_limit", "moe.swiglu_alpha": "swiglu_alpha",
        "moe.aux_loss_coef": "router_aux_loss_coef", "full_attention_every": "layer_types"}


def read(keys, n_layers: int) -> tuple[dict, dict]:
    """The fields a gpt-oss config.json sets beyond the llama family's common ones (the attention's biases and
    sinks, the layer pattern, YaRN, the experts), and their key names."""
    quant = keys.raw("quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise keys.bad("quantization_config", {"quant_method": method}, "the experts are stored quantized (MXFP4 "
                       "blocks and scales), which jaxpar does not dequantize; load the model in transformers with "
                       "Mxfp4Config(dequantize=True), save_pretrained it, and import that")
    bias = keys.flag("attention_bias", True)
    windowed = _windowed(keys, n_layers)
    every = 0 if all(windowed) or not any(windowed) else 2
    if any(windowed) and not all(windowed) and windowed != [i % 2 == 0 for i in range(n_layers)]:
        full = [i for i, w in enumerate(windowed) if not w]
        raise keys.error(f"layer_types: full attention on layers {full} is not every other layer (1, 3, 5, …); jaxpar "
                         "runs gpt-oss's alternating pattern (model.full_attention_every 2)")
    rope, names = rope_hf.read(keys, "llama", yarn=True)
    width = keys.integer("intermediate_size")
    moe = dict(n_experts=keys.integer("num_local_experts"), top_k=keys.integer("num_experts_per_tok"), d_ff=width,
               norm_topk_prob=True, router_bias=True, expert_bias=True,
               swiglu_limit=keys.number("swiglu_limit", 7.0), swiglu_alpha=keys.number("swiglu_alpha", 1.702),
               aux_loss_coef=keys.number("router_aux_loss_coef", 0.001))
    fields = dict(qkv_bias=bias, o_bias=bias, attention_sinks=True, d_ff=width, moe=moe, full_attention_every=every,
                  sliding_window=keys.integer("sliding_window", 128) if any(windowed) else 0, **rope)
    return fields, {**names, **KEYS}


def _windowed(keys, n_layers: int) -> list[bool]:
    """Per layer, whether it is a sliding-window layer: `layer_types`, or transformers' default (even layers)."""
    types = keys.raw("layer_types", None)
    if types is None:
        return [i % 2 == 0 for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"full_attention",
                                                                                   "sliding_attention"}:
        raise keys.bad("layer_types", types, f"must list 'full_attention' or 'sliding_attention' for each of the "
                       f"num_hidden_layers = {n_layers} layers")
    return [t == "sliding_attention" for t in types]


def holds(cfg) -> bool:
    """Whether cfg is exported as gpt-oss: the llama family with sinks and a mixture of experts."""
    return cfg.attention_sinks and cfg.moe.enabled


def exportable(cfg) -> None:
    """Raise ConfigError for a model with sinks and experts that GptOssForCausalLM cannot express."""
    moe = cfg.moe
    needs = [("model.o_bias", cfg.o_bias, cfg.qkv_bias),  # one attention_bias key: both or neither
             ("model.qk_norm", cfg.qk_norm, False), ("moe.router_bias", moe.router_bias, True),
             ("moe.expert_bias", moe.expert_bias, True), ("moe.norm_topk_prob", moe.norm_topk_prob, True),
             ("moe.shared_d_ff", moe.shared_d_ff, 0), ("moe.scoring", moe.scoring, "softmax"),
             ("moe.n_group", moe.n_group, 1), ("moe.routed_scale", moe.routed_scale, 1.0),
             ("moe.correction_bias", moe.correction_bias, False), ("model.local_rope_theta", cfg.local_rope_theta, 0.0)]
    for field, value, want in needs:
        if value != want:
            raise ConfigError(field, value, f"gpt-oss, the Hugging Face architecture with attention sinks and "
                              f"experts, has {field} = {want}", f"export a model trained with {field}={want}")
    if not moe.swiglu_limit:
        raise ConfigError("moe.swiglu_limit", 0.0, "gpt-oss's experts use the clamped SwiGLU",
                          "export a model trained with moe.swiglu_limit > 0 (gpt-oss: 7.0)")
    if cfg.full_attention_every not in (0, 2) or "dense_blocks" in cfg.layer_stacks:
        field, value = (("model.full_attention_every", cfg.full_attention_every) if cfg.full_attention_every
                        not in (0, 2) else ("moe.sparse_step", moe.sparse_step))
        raise ConfigError(field, value, "gpt-oss alternates sliding and full layers, every one an MoE layer",
                          "export a model with full_attention_every 2 (or 0) and every layer MoE")
    if cfg.rope_scaling not in ("none", "yarn"):
        raise ConfigError("model.rope_scaling", cfg.rope_scaling, "gpt-oss's config holds default or yarn RoPE for "
                          "jaxpar to write", "export a model with rope_scaling none or yarn")


def write(cfg, out: dict) -> None:
    """gpt-oss's own keys of config.json (the llama family writes the common ones and the RoPE)."""
    moe = cfg.moe
    out.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=cfg.qkv_bias,
               num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k, intermediate_size=moe.d_ff,
               swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha, router_aux_loss_coef=moe.aux_loss_coef,
               sliding_window=cfg.sliding_window or None,
               layer_types=["sliding_attention" if w else "full_attention" for w in cfg.layer_windows])
    for key in ("num_experts", "moe_intermediate_size", "norm_topk_prob", "qkv_bias", "decoder_sparse_step",
                "mlp_only_layers", "shared_expert_intermediate_size"):
        out.pop(key, None)


def tensors(cfg) -> list[Rule]:
    """The gpt-oss-only rules (the llama family's table holds the norms, q/k/v/o and their q/k/v biases)."""
    lay, experts = "model.layers.{l}.", "model.layers.{l}.mlp.experts."
    pair = [dict(part=i, parts=2, axis=-1, interleave=True) for i in range(2)]
    rules = [Rule("blocks.bo", lay + "self_attn.o_proj.bias", same, same),
             Rule("blocks.sinks", lay + "self_attn.sinks", same, same),
             Rule("blocks.router", lay + "mlp.router.weight", lambda x: x.T, lambda x: x.T),
             Rule("blocks.router_b", lay + "mlp.router.bias", same, same),
             Rule("blocks.we_down", experts + "down_proj", same, same),
             Rule("blocks.we_down_b", experts + "down_proj_bias", same, same)]
    rules += [Rule(f"blocks.we_{p}", experts + "gate_up_proj", same, same, **pair[i]) for i, p in
              enumerate(("gate", "up"))]
    rules += [Rule(f"blocks.we_{p}_b", experts + "gate_up_proj_bias", same, same, **pair[i]) for i, p in
              enumerate(("gate", "up"))]
    return rules
