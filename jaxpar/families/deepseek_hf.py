"""Hugging Face mapping of the deepseek family: DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (transformers 5).

Both are the deepseek layer — multi-head latent attention (attention kind "mla"), RMSNorm, SwiGLU — with the first
`first_k_dense_replace` layers a dense SwiGLU of width intermediate_size and the others DeepSeekMoE: X routed experts
of width moe_intermediate_size plus n_shared_experts shared ones (one SwiGLU of n·moe_intermediate_size, no gate).
They differ in routing and rotary order:

    config.json                       V2 (default)                V3 (default)            jaxpar
    n_routed_experts                  required                    required                moe.n_experts
    num_experts_per_tok               required                    required                moe.top_k
    moe_intermediate_size             required                    required                moe.d_ff
    n_shared_experts                  2                           1                       moe.shared_d_ff = n·moe.d_ff
    first_k_dense_replace             0                           3                       moe.dense_layers = (0..k-1)
    moe_layer_freq                    1 (refused otherwise)       1 (refused otherwise)   (every later layer MoE)
    scoring_func                      "softmax" (only)            "sigmoid" (only)        moe.scoring
    topk_method                       "greedy" | "group_limited_greedy"   "noaux_tc" (only)   moe.n_group > 1
    n_group, topk_group               read for group_limited      8, 4                    moe.n_group, moe.topk_group
    (correction bias)                 none                        always                  moe.correction_bias
    routed_scaling_factor             1.0                         2.5                     moe.routed_scale
    norm_topk_prob                    false (true refused)        true                    moe.norm_topk_prob
    aux_loss_alpha                    0.0 (transformers: no loss) 0.0                     moe.aux_loss_coef
    q_lora_rank                       required, null: q_proj      required, null          model.q_lora_rank (0)
    kv_lora_rank, qk_rope_head_dim,   required                    required                model.kv_lora_rank, …
      qk_nope_head_dim, v_head_dim
    rope_interleave                   (always complex pairs)      true                    model.rope_interleave
    intermediate_size                 required                    required                model.d_ff (dense layers)

head_dim is qk_nope_head_dim + qk_rope_head_dim; transformers 5's own `head_dim` key (the rope width) and
`qk_head_dim` are derived, so they are not read. num_key_value_heads must equal num_attention_heads (every head
reads its own keys from the latent; transformers' eager path repeats nothing). RoPE comes in both spellings
(`rope_parameters`, or `rope_theta` + `rope_scaling` with `rope_type` or `type`); YaRN maps to rope_scaling "yarn"
with factor (absent: max_position_embeddings / original_max_position_embeddings, as transformers), beta_fast (32),
beta_slow (1), original_max_position_embeddings, mscale and mscale_all_dim. transformers' YaRN multiplies cos/sin by
get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are non-zero and by get_mscale(factor)
otherwise (get_mscale(s, m) = 0.1·m·ln s + 1 for s > 1, else 1), and the softmax scale by
get_mscale(factor, mscale_all_dim)² when mscale_all_dim is non-zero: so without mscale_all_dim the mscale key is
ignored (rope_mscale 1.0, rope_mscale_all_dim 0.0), and a non-zero mscale_all_dim without mscale — whose cos/sin
factor no (rope_mscale, rope_mscale_all_dim) pair reproduces — is refused, as are `attention_factor`, `truncate`
false and `partial_rotary_factor`. V2's rotary is always complex-pair (rope_interleave true); transformers 5 ignores
V2's norm_topk_prob, which DeepSeek's own V2 code honours, so true is refused rather than guessed.

transformers adds no auxiliary loss for these models (aux_loss_alpha is DeepSeek's key; its `seq_aux` is a
per-sequence variant of the loss, which jaxpar computes per batch). The correction bias moves only by
moe.bias_update_rate, a training setting config.json has no key for: an import starts it at 0.

Tensors (`model.layers.{l}.` + name; torch Linear [out, in], so every matrix is transposed; H heads, E = nope + rope
(the last R = qk_rope_head_dim dims of each head's query rows are its rope part, in HF's order: no permutation),
r = kv_lora_rank, rq = q_lora_rank, Ev = v_head_dim, F = moe_intermediate_size, Fs = n_shared_experts·F):

    jaxpar                           Hugging Face
    attn_norm, mlp_norm [D]          input_layernorm.weight, post_attention_layernorm.weight
    wq [D, H, E]                     self_attn.q_proj.weight [H·E, D]            (q_lora_rank null)
    wq_a [D, rq]; q_a_norm [rq]      self_attn.q_a_proj.weight [rq, D]; self_attn.q_a_layernorm.weight
    wq_b [rq, H, E]                  self_attn.q_b_proj.weight [H·E, rq]
    wkv_a [D, r + R]; kv_a_norm [r]  self_attn.kv_a_proj_with_mqa.weight [r + R, D]; self_attn.kv_a_layernorm.weight
    wkv_b [r, H, nope + Ev]          self_attn.kv_b_proj.weight [H·(nope + Ev), r]   (per head: k_nope, then v)
    wo [H, Ev, D]                    self_attn.o_proj.weight [D, H·Ev]
    w_gate, w_up [D, F_d]; w_down    mlp.{gate,up}_proj.weight [F_d, D]; mlp.down_proj.weight    (dense layers)
    router [D, X]                    mlp.gate.weight [X, D]                                       (MoE layers)
    e_score_correction_bias [X]      mlp.gate.e_score_correction_bias [X] (float32; a Buffer, not a parameter)
    we_gate[e], we_up[e] [D, F]      mlp.experts.{e}.{gate,up}_proj.weight [F, D]
    we_down[e] [F, D]                mlp.experts.{e}.down_proj.weight [D, F]
    ws_gate, ws_up [D, Fs]; ws_down  mlp.shared_experts.{gate,up}_proj.weight [Fs, D]; .down_proj.weight [D, Fs]

plus model.embed_tokens.weight, model.norm.weight and (untied) lm_head.weight as llama's. The dense layers are the
`dense_blocks` stack, the MoE layers `blocks` (`ModelConfig.layer_stacks`; `Rule.layers` names each entry's model
layer). transformers 5's fused expert layout (`mlp.experts.gate_up_proj` [X, 2F, D], `mlp.experts.down_proj`
[X, D, F], written by save_pretrained(save_original_format=False)) imports as Qwen2-MoE's does
(jaxpar/families/moe_hf.py); export writes the hub layout above. With n_shared_experts 0 the shared expert has width
0 and its tensors are `ZeroRule`s; a sigmoid-scored jaxpar model without a correction bias exports as V3 with a zero
bias.

Refused on import, each with an error naming it: attention_bias / mlp_bias true, any quantization_config (fp8
blocks) or `*.weight_scale_inv` tensor, DeepSeek-V3.2's lightning indexer (`index_*` keys, `*.indexer.*` tensors),
and multi-token-prediction modules the config.json does not declare: V3 checkpoints store `num_nextn_predict_layers`
MTP modules as layers num_hidden_layers, num_hidden_layers + 1, … — a tensor of a layer past them is refused rather
than dropped, unless the import is told to leave every layer from num_hidden_layers on out (`jaxpar convert
--from-hf DIR --to WORKDIR --drop-mtp`; `drop_mtp=True` of jaxpar.interop.hf's import_to_workdir / load_params),
what transformers itself does, silently.

MTP modules (model.mtp_depth = num_nextn_predict_layers, jaxpar.model.MTP), layer L + k for module k (L =
num_hidden_layers, never a fixed 61): the block's tensors as any MoE layer's (stack `mtp.blocks`), and

    mtp.enorm[k], mtp.hnorm[k] [D]     model.layers.{L+k}.enorm.weight, .hnorm.weight
    mtp.eh_proj[k] [2D, D]             model.layers.{L+k}.eh_proj.weight [D, 2D]  (input [enorm(emb); hnorm(h)])
    mtp.head_norm[k] [D]               model.layers.{L+k}.shared_head.norm.weight
    embed, lm_head (shared)            model.layers.{L+k}.embed_tokens.weight, .shared_head.head.weight: copies the
                                       export writes from the model's one embedding and head; the import reads the
                                       main ones (`_mtp_copies`)

num_nextn_predict_layers counts only where the checkpoint holds MTP tensors (transformers 5 writes 1 for every V3
model and saves no MTP weights): jaxpar.interop.hf.model_config sets mtp_depth 0 otherwise. Export writes
num_nextn_predict_layers = mtp_depth.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families import rope_hf
from jaxpar.families.base import HuggingFace, Rule, same
from jaxpar.families.moe_hf import FUSED, ExpertRule, ZeroRule

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}

# transformers' class defaults for the keys a config.json may omit ({model_type: {key: default}})
DEFAULTS = {"deepseek_v2": dict(n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0,
                                topk_method="greedy", scoring_func="softmax", norm_topk_prob=False),
            "deepseek_v3": dict(n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=8,
                                topk_group=4)}

# jaxpar ModelConfig field → the config.json key it comes from (for ModelConfig's errors)
KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
        "head_dim": "qk_nope_head_dim + qk_rope_head_dim", "d_ff": "intermediate_size",
        "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "q_lora_rank": "q_lora_rank",
        "kv_lora_rank": "kv_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim",
        "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim", "rope_interleave": "rope_interleave",
        "moe.n_experts": "n_routed_experts", "moe.top_k": "num_experts_per_tok", "moe.d_ff": "moe_intermediate_size",
        "moe.shared_d_ff": "n_shared_experts", "moe.dense_layers": "first_k_dense_replace",
        "moe.norm_topk_prob": "norm_topk_prob", "moe.aux_loss_coef": "aux_loss_alpha",
        "moe.scoring": "scoring_func", "moe.n_group": "n_group", "moe.topk_group": "topk_group",
        "moe.routed_scale": "routed_scaling_factor", "moe.correction_bias": "topk_method"}

# checkpoint contents jaxpar does not implement: (tensor-name pattern, what it is, what to do)
_REFUSED_TENSORS = (
    (re.compile(r".*\.weight_scale_inv$"), "an fp8 weight block's scale (a quantized checkpoint)",
     "convert the checkpoint to bfloat16 weights first (DeepSeek's fp8-to-bf16 conversion) and import that"),
    (re.compile(r".*\.indexer\..*"), "DeepSeek-V3.2's lightning indexer (DeepSeek sparse attention), which jaxpar "
     "does not implement", "import a DeepSeek-V2/V3 checkpoint; V3.2 is not supported"),
)


def read(keys, model_type: str) -> tuple[dict, dict]:
    """ModelConfig fields (family 'deepseek', the `moe` section as a dict) of a DeepSeek-V2 / V3 config.json, and
    the config.json key of each (for ModelConfig's errors). Refuses, naming the key, what jaxpar does not implement
    (the module docstring)."""
    v3, default = model_type == "deepseek_v3", DEFAULTS[model_type]
    _refuse_unimplemented(keys)
    n_heads, d_model = keys.integer("num_attention_heads"), keys.integer("hidden_size")
    n_layers = keys.integer("num_hidden_layers")
    kv_heads = keys.integer("num_key_value_heads", n_heads)
    if kv_heads != n_heads:  # MLA's keys are per head; transformers would repeat them into a shape error
        raise keys.bad("num_key_value_heads", kv_heads, f"must equal num_attention_heads = {n_heads} in a DeepSeek "
                       "model (latent attention gives every head its own keys)")
    nope, rope_dim = keys.integer("qk_nope_head_dim"), keys.integer("qk_rope_head_dim")
    # MTP modules (layers n_layers …): hf.model_config sets 0 when the checkpoint holds no MTP tensors
    mtp_depth = keys.integer("num_nextn_predict_layers", 0, minimum=0)
    rope, names = rope_hf.read(keys, "deepseek", yarn=True)
    names.update(KEYS)
    fields = dict(family="deepseek", vocab_size=keys.integer("vocab_size"), d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=n_heads, head_dim=nope + rope_dim,
                  d_ff=keys.integer("intermediate_size"), max_seq_len=keys.integer("max_position_embeddings"),
                  norm_eps=keys.number("rms_norm_eps", 1e-6), tie_embeddings=keys.flag("tie_word_embeddings", False),
                  q_lora_rank=_q_lora_rank(keys), kv_lora_rank=keys.integer("kv_lora_rank"),
                  qk_rope_head_dim=rope_dim, qk_nope_head_dim=nope, v_head_dim=keys.integer("v_head_dim"),
                  # V2 rotates complex pairs (view_as_complex) always; V3 as its key says
                  rope_interleave=keys.flag("rope_interleave", True) if v3 else True, **rope)
    if mtp_depth:
        fields["mtp_depth"] = mtp_depth
    fields["moe"] = _moe(keys, model_type, default, n_layers)
    names["mtp_depth"] = "num_nextn_predict_layers"
    return fields, names


def _refuse_unimplemented(keys) -> None:
    """An HFError for each config.json setting whose model jaxpar's deepseek family does not compute."""
    act = keys.text("hidden_act", "silu")
    if act != "silu":
        raise keys.error(f"hidden_act = {act!r} is not supported; jaxpar's deepseek family uses SwiGLU (silu)")
    for key, what in (("attention_bias", "biases on q_a_proj, kv_a_proj_with_mqa and o_proj"),
                      ("mlp_bias", "biases on the MLPs' projections")):
        if keys.flag(key, False):
            raise keys.error(f"{key} = true ({what}) is not supported: jaxpar's deepseek layers have no biases")
    if keys.raw("quantization_config", None) is not None:
        quant = keys.raw("quantization_config")
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise keys.error(f"quantization_config (quant_method {method!r}) is not supported: the weights are stored "
                         "quantized (DeepSeek-V3's fp8 blocks with weight_scale_inv scales), and jaxpar imports float "
                         "weights; convert the checkpoint to bfloat16 first and import that")
    index = sorted(k for k in keys.d if k.startswith("index_"))
    if index:
        raise keys.error(f"{', '.join(index)}: DeepSeek-V3.2's lightning indexer (DeepSeek sparse attention) is not "
                         "implemented; jaxpar imports DeepSeek-V2 and V3")
    freq = keys.integer("moe_layer_freq", 1)
    if freq != 1:
        raise keys.bad("moe_layer_freq", freq, "only 1 is supported (every layer from first_k_dense_replace on is "
                       "an MoE layer, as transformers builds it; DeepSeek's own code would skip layers)")


def _q_lora_rank(keys) -> int:
    """q_lora_rank: null is no low-rank query path (jaxpar 0: q_proj); a number is the rank (>= 1: transformers
    builds a rank-0 path for 0)."""
    if "q_lora_rank" in keys.d and keys.d["q_lora_rank"] is None:
        return 0
    if "q_lora_rank" not in keys.d:
        raise keys.error("no 'q_lora_rank', which a DeepSeek model needs: the rank of the query's low-rank path, or "
                         "null for a direct q_proj (transformers' default is 1536)")
    return keys.integer("q_lora_rank")


def _moe(keys, model_type: str, default: dict, n_layers: int) -> dict:
    """The `moe` fields: routing (scoring, groups, bias, scale), experts, the dense prefix."""
    v3 = model_type == "deepseek_v3"
    scoring = keys.text("scoring_func", default["scoring_func"])
    method = keys.text("topk_method", default["topk_method"])
    allowed = {"sigmoid": ("noaux_tc",)} if v3 else {"softmax": ("greedy", "group_limited_greedy")}
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    if scoring not in allowed:
        raise keys.bad("scoring_func", scoring, f"{arch} scores experts by {next(iter(allowed))!r} only")
    if method not in allowed[scoring]:
        raise keys.bad("topk_method", method, f"{arch} selects experts by {' or '.join(map(repr, allowed[scoring]))}")
    if method == "greedy":  # plain top-k: the group keys are unused (transformers ignores them)
        n_group = topk_group = 1
    else:
        n_group, topk_group = keys.integer("n_group", default.get("n_group", ...)), keys.integer(
            "topk_group", default.get("topk_group", ...))
    norm = keys.flag("norm_topk_prob", default["norm_topk_prob"])
    if norm and not v3:
        raise keys.bad("norm_topk_prob", norm, "DeepseekV2ForCausalLM in transformers 5 never renormalises the top-k "
                       "weights while DeepSeek's own V2 code does (and then skips routed_scaling_factor); jaxpar "
                       "refuses the ambiguity: set it to false to import as transformers computes")
    dense = keys.integer("first_k_dense_replace", default["first_k_dense_replace"], minimum=0)
    if dense >= n_layers:
        raise keys.bad("first_k_dense_replace", dense, f"leaves none of the num_hidden_layers = {n_layers} layers an "
                       "MoE layer; jaxpar imports DeepSeek models with MoE layers")
    expert_ff = keys.integer("moe_intermediate_size")
    return dict(n_experts=keys.integer("n_routed_experts"), top_k=keys.integer("num_experts_per_tok"),
                d_ff=expert_ff, shared_d_ff=keys.integer("n_shared_experts", default["n_shared_experts"],
                                                         minimum=0) * expert_ff,
                shared_gate=False, dense_layers=tuple(range(dense)), norm_topk_prob=norm,
                aux_loss_coef=keys.number("aux_loss_alpha", 0.0), scoring=scoring, n_group=n_group,
                topk_group=topk_group, correction_bias=method == "noaux_tc",
                routed_scale=keys.number("routed_scaling_factor", default["routed_scaling_factor"]))


# -----------------------------------------------------------------------------------------------------------------
# Export


def architecture(cfg) -> tuple[str, str]:
    """(HF class, model_type) `cfg` exports as: V3 for sigmoid scoring, V2 for softmax (`exportable` refuses what
    neither holds)."""
    if cfg.moe.scoring == "sigmoid":
        return "DeepseekV3ForCausalLM", "deepseek_v3"
    return "DeepseekV2ForCausalLM", "deepseek_v2"


def exportable(cfg) -> None:
    """Raise ConfigError naming the first field of `cfg` that neither DeepseekV2ForCausalLM nor
    DeepseekV3ForCausalLM (as transformers 5 computes them) can express."""
    moe = cfg.moe

    def refuse(field: str, value: Any, why: str, fix: str) -> None:
        raise ConfigError(field, value, why, fix)

    if not moe.enabled:
        refuse("moe.n_experts", moe.n_experts, "DeepSeek's Hugging Face classes always route experts after the first "
               "first_k_dense_replace layers", "export a model with experts")
    if cfg.qkv_bias:
        refuse("model.qkv_bias", True, "DeepSeek's attention has no q/k/v biases", "export a model without them")
    if cfg.sliding_window:
        refuse("model.sliding_window", cfg.sliding_window, "DeepSeek's attention has no sliding window",
               "export a model with sliding_window 0")
    if moe.shared_gate:
        refuse("moe.shared_gate", True, "DeepSeek's shared experts are added ungated", "train with shared_gate false")
    if moe.shared_d_ff % moe.d_ff:
        refuse("moe.shared_d_ff", moe.shared_d_ff, f"config.json states the shared experts as n_shared_experts · "
               f"moe_intermediate_size, and {moe.shared_d_ff} is no multiple of moe.d_ff = {moe.d_ff}",
               "use a multiple of moe.d_ff")
    k = len(moe.dense_layers)
    if moe.sparse_step != 1 or tuple(moe.dense_layers) != tuple(range(k)):
        refuse("moe.dense_layers", moe.dense_layers, "DeepSeek's dense layers are the first first_k_dense_replace "
               "ones, every later layer MoE (moe.sparse_step 1)", "use dense_layers (0, …, k-1) and sparse_step 1")
    if moe.scoring == "softmax":  # V2
        fix = "export a model without it, or one that scores by sigmoid (DeepseekV3ForCausalLM)"
        if moe.correction_bias:
            refuse("moe.correction_bias", True, "DeepseekV2ForCausalLM (softmax scoring) has no "
                   "e_score_correction_bias; V3 has one, with sigmoid scoring", fix)
        if moe.norm_topk_prob:
            refuse("moe.norm_topk_prob", True, "DeepseekV2ForCausalLM (softmax scoring) never renormalises the "
                   "top-k weights in transformers 5", fix)
        if not cfg.rope_interleave:
            refuse("model.rope_interleave", False, "DeepseekV2ForCausalLM rotates complex pairs (rope_interleave "
                   "true) only", fix)


def write(cfg, out: dict, base: dict | None) -> None:
    """config.json dict `out` for cfg (`base`: the imported config.json, or None): the keys transformers 5 reads,
    plus DeepSeek's own routing keys (topk_method, scoring_func, moe_layer_freq, aux_loss_alpha) so that the
    checkpoint also states them to other readers."""
    arch, model_type = architecture(cfg)
    moe = cfg.moe
    if moe.scoring == "sigmoid":
        method = "noaux_tc"
    else:
        method = "group_limited_greedy" if moe.n_group > 1 else "greedy"
    out.update(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
               intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False,
               q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
               qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
               v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,  # transformers 5's head_dim: the rope width
               qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
               n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.d_ff,
               n_shared_experts=moe.shared_d_ff // moe.d_ff, first_k_dense_replace=len(moe.dense_layers),
               moe_layer_freq=1, topk_method=method, scoring_func=moe.scoring, n_group=moe.n_group,
               topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scale,
               norm_topk_prob=moe.norm_topk_prob, aux_loss_alpha=moe.aux_loss_coef)
    if model_type == "deepseek_v3":
        out.update(rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=cfg.mtp_depth)
    else:
        out["mlp_bias"] = False
    rope_hf.write(cfg, out, legacy_type=True)  # transformers 4 / DeepSeek's own code read rope_scaling["type"]


# -----------------------------------------------------------------------------------------------------------------
# Tensors


def check_names(cfg, names: set[str] | None) -> None:
    """Raise ConfigError for a tensor of the checkpoint that jaxpar does not implement and would otherwise drop or
    misread: fp8 scales, V3.2's indexer, and MTP modules (layers from num_hidden_layers on)."""
    for name in sorted(names or ()):
        for pattern, what, fix in _REFUSED_TENSORS:
            if pattern.match(name):
                raise ConfigError(f"tensor {name}", "present", f"is {what}", fix)
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= cfg.n_layers + cfg.mtp_depth:
            raise ConfigError(
                f"tensor {name}", "present", f"belongs to layer {layer.group(1)} >= num_hidden_layers = "
                f"{cfg.n_layers}: a multi-token-prediction (MTP) module beyond the num_nextn_predict_layers = "
                f"{cfg.mtp_depth} that config.json declares, which the import would drop",
                "to import the base model without them, say so: `jaxpar convert --from-hf DIR --to WORKDIR "
                "--drop-mtp` (hf.import_to_workdir(..., drop_mtp=True))")


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """The tensor table (module docstring): attention rules once per layer stack (`blocks` the MoE layers,
    `dense_blocks` the dense prefix), the dense MLP on `dense_blocks`, the router, correction bias, experts (hub
    layout, or the fused one when `names` holds it) and shared experts on `blocks`. `names` (the tensors present)
    are first checked for what jaxpar does not implement (`check_names`)."""
    check_names(cfg, names)
    D, H, E = cfg.d_model, cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r, rq, Ev, nope = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim, cfg.qk_nope_head_dim
    lay, attn = "model.layers.{l}.", "model.layers.{l}.self_attn."
    T = (lambda x: x.T, lambda x: x.T)
    stacks = cfg.layer_stacks
    layers = {name: (ls if len(stacks) > 1 else None) for name, ls in stacks.items()}  # None: every layer, in order

    def heads(rows: int, n: int, width: int):  # [H·width, rows] ⇄ [rows, H, width] (head-major rows)
        return lambda x: x.T.reshape(rows, n, width), lambda x: x.reshape(rows, -1).T

    rules = _mtp_copies(cfg) + [Rule("embed", "model.embed_tokens.weight", same, same),
                                Rule("final_norm", "model.norm.weight", same, same)]
    if cfg.mtp_depth:  # the MTP modules: layers n_layers … n_layers + D - 1, each an MoE layer with its own norms
        ls = tuple(range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth))
        layers["mtp.blocks"] = ls
        rules += [Rule("mtp.enorm", lay + "enorm.weight", same, same, layers=ls),
                  Rule("mtp.hnorm", lay + "hnorm.weight", same, same, layers=ls),
                  Rule("mtp.eh_proj", lay + "eh_proj.weight", *T, layers=ls),  # [D, 2D]: [enorm(e); hnorm(h)]
                  Rule("mtp.head_norm", lay + "shared_head.norm.weight", same, same, layers=ls)]
    for stack, ls in layers.items():
        rules += [Rule(f"{stack}.attn_norm", lay + "input_layernorm.weight", same, same, layers=ls),
                  Rule(f"{stack}.mlp_norm", lay + "post_attention_layernorm.weight", same, same, layers=ls)]
        if rq:
            rules += [Rule(f"{stack}.wq_a", attn + "q_a_proj.weight", *T, layers=ls),
                      Rule(f"{stack}.q_a_norm", attn + "q_a_layernorm.weight", same, same, layers=ls),
                      Rule(f"{stack}.wq_b", attn + "q_b_proj.weight", *heads(rq, H, E), layers=ls)]
        else:
            rules.append(Rule(f"{stack}.wq", attn + "q_proj.weight", *heads(D, H, E), layers=ls))
        rules += [Rule(f"{stack}.wkv_a", attn + "kv_a_proj_with_mqa.weight", *T, layers=ls),
                  Rule(f"{stack}.kv_a_norm", attn + "kv_a_layernorm.weight", same, same, layers=ls),
                  Rule(f"{stack}.wkv_b", attn + "kv_b_proj.weight", *heads(r, H, nope + Ev), layers=ls),
                  Rule(f"{stack}.wo", attn + "o_proj.weight", lambda x: x.T.reshape(H, Ev, D),
                       lambda x: x.reshape(-1, D).T, layers=ls)]
    if "dense_blocks" in stacks:
        rules += [Rule(f"dense_blocks.w_{p}", lay + f"mlp.{p}_proj.weight", *T, layers=layers["dense_blocks"])
                  for p in ("gate", "up", "down")]
    rules += _moe_rules(cfg, names, layers["blocks"])
    if cfg.mtp_depth:
        rules += _moe_rules(cfg, names, layers["mtp.blocks"], stack="mtp.blocks")
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", *T))
    return rules


def _mtp_copies(cfg) -> list[Rule]:
    """Each MTP layer's copies of the shared embedding and head (`model.layers.{L+k}.embed_tokens.weight`,
    `.shared_head.head.weight`: DeepSeek-V3's checkpoint stores them per module). The model holds one embedding and
    one head, so export writes the copies from them and import reads the main tensors (these rules come first: a
    later rule of the same parameter is the one `load_params` reads; the copies are not read)."""
    head = Rule("embed", "", same, same) if cfg.tie_embeddings else Rule("lm_head", "", lambda x: x.T, lambda x: x.T)
    out = []
    for layer in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
        out += [Rule("embed", f"model.layers.{layer}.embed_tokens.weight", same, same),
                dataclasses.replace(head, name=f"model.layers.{layer}.shared_head.head.weight")]
    return out


def _moe_rules(cfg, names: set[str] | None, ls: tuple[int, ...] | None, stack: str = "blocks") -> list[Rule]:
    """The MoE layers' rules (stack `stack`, model layers `ls`; None: every layer)."""
    moe, D, X = cfg.moe, cfg.d_model, cfg.moe.n_experts
    lay, T = "model.layers.{l}.mlp.", (lambda x: x.T, lambda x: x.T)
    rules = [Rule(f"{stack}.router", lay + "gate.weight", *T, layers=ls)]
    bias = lay + "gate.e_score_correction_bias"
    if moe.correction_bias:  # a Buffer: carried by import and export like a parameter, never trained
        rules.append(Rule(f"{stack}.e_score_correction_bias", bias, same, same, layers=ls))
    elif moe.scoring == "sigmoid":  # V3 always holds one: zeros select as no bias does
        rules.append(ZeroRule(f"{stack}.e_score_correction_bias", bias, same, same, layers=ls, shape=(X,)))
    if names is not None and any(n.endswith(FUSED) for n in names):  # transformers 5's fused layout
        rules += [ExpertRule(f"{stack}.we_gate", lay + "experts.gate_up_proj", *T, part=0, parts=2, layers=ls),
                  ExpertRule(f"{stack}.we_up", lay + "experts.gate_up_proj", *T, part=1, parts=2, layers=ls),
                  ExpertRule(f"{stack}.we_down", lay + "experts.down_proj", *T, layers=ls)]
    else:
        rules += [ExpertRule(f"{stack}.we_{p}", lay + f"experts.{{e}}.{p}_proj.weight", *T, layers=ls)
                  for p in ("gate", "up", "down")]
    if moe.shared_d_ff:
        rules += [Rule(f"{stack}.ws_{p}", lay + f"shared_experts.{p}_proj.weight", *T, layers=ls)
                  for p in ("gate", "up", "down")]
    else:  # n_shared_experts 0: transformers builds a shared MLP of width 0, which adds exactly zero
        rules += [ZeroRule(f"{stack}.ws_{p}", lay + f"shared_experts.{p}_proj.weight", *T, layers=ls, shape=shape)
                  for p, shape in (("gate", (0, D)), ("up", (0, D)), ("down", (D, 0)))]
    return rules


HF = HuggingFace(ARCHITECTURES, read, write, exportable, tensors)

__all__ = ["ARCHITECTURES", "HF", "KEYS", "architecture", "check_names", "exportable", "read", "tensors", "write"]
