"""The config's schema: five frozen dataclasses (`ModelConfig` with its `MoEConfig`, `ParallelConfig`, `TrainConfig`,
`DataConfig`, `CheckpointConfig`) under one `Config`, each field with its default and its help (the README's
reference is generated from them), and every check that needs only the config (`__post_init__`) or the device
count (`Config.resolve_for_devices`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from typing import Any

from jaxpar.config.checks import check_fields, check_positive, check_choice, same_chunks, nearest_multiples
from jaxpar.errors import ConfigError, check_divides, divisors
from jaxpar.families import FAMILIES, attention_kind
from jaxpar.parallel import axes
from jaxpar.parallel.schedule import SCHEDULES, check as schedule_check

CONTEXT_IMPLS = ("all_gather", "ring")  # jaxpar.parallel.context_parallel (here: the config loads before jax)
OVERLAPS = ("none", "collective_matmul")  # jaxpar.parallel.overlap


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a one-line help string (the README's config reference is generated from these)."""
    return dataclasses.field(default=default, metadata={"help": help})


DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("float", "int8", "int4")  # jaxpar.matmul.Quantized
MATMULS = ("float", "fp8_rowwise")  # model.matmul: the block's matmul policy (jaxpar.fp8.RECIPES)
DEFAULT_GROUP = 128  # int4's group size when none is given: the largest up to this that fits the model (int4_groups)
REMAT_POLICIES = ("none", "full", "dots", "selective")
# What `parallel.auto` chooses (the planner's search, jaxpar.planner.search): these parallel fields and
# train.grad_accum. `parallel.keep` names the ones to leave as the config has them.
PLANNED = ("data", "pipe", "expert", "context", "tensor", "schedule", "repeats", "microbatches", "sequence_parallel",
           "overlap", "context_impl", "zero", "remat", "skip_bubble")
AUTO_KEEPS = PLANNED + ("grad_accum",)
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
SOURCES = ("default", "synthetic", "text", "tokens", "chat", "pairs")
OBJECTIVES = ("lm", "dpo")  # train.objective
DPO_LOSSES = ("sigmoid", "ipo")  # train.dpo_loss (jaxpar.train.dpo)
DPO_REFERENCES = ("model", "none")  # train.dpo_reference
SCORINGS = ("softmax", "sigmoid")  # MoEConfig.scoring (jaxpar.parallel.expert.route)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (LoRA): W x + (alpha/rank)·B·A x on the named weight matrices, every other weight frozen."""

    rank: int = _f(0, "the adapters' rank r (0: no adapters, every weight trains)")
    alpha: float = _f(16.0, "the adapters' scale is alpha / rank (PEFT's lora_alpha)")
    targets: tuple[str, ...] = _f(("wq", "wk", "wv", "wo"), "the layer weight matrices that get adapters, by jaxpar name "
                        "(llama: wq, wk, wv, wo, w_gate, w_up, w_down; PEFT's q_proj … down_proj)")
    dropout: float = _f(0.0, "PEFT's lora_dropout: in training each adapter reads its input with this share of "
                        "the entries zeroed (the rest scaled by 1/(1 - dropout)), from a mask fixed by the token's "
                        "place in the run, the layer, the weight and the feature, so every layout drops the same "
                        "entries; 0: off")

    @property
    def scale(self) -> float:
        """The adapters' scale alpha / rank (what multiplies A·B; 0 rank: no adapters, scale unused → alpha)."""
        return self.alpha / max(self.rank, 1)

    def __post_init__(self):
        check_fields(self, "lora")
        check_positive("lora.rank", self.rank, allow_zero="no adapters")
        check_positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("lora.dropout", self.dropout, "is the share of an adapter's input dropped in training",
                              "use a value in [0, 1), e.g. 0.05 (0: off)")
        if self.dropout and not self.rank:
            raise ConfigError("lora.dropout", self.dropout, "drops the adapters' inputs, and lora.rank = 0 adds no "
                              "adapters", "set lora.rank (e.g. 8) or lora.dropout=0")
        if self.rank and not self.targets:
            raise ConfigError("lora.targets", [], "names no weight to adapt", "name some, e.g. [wq, wv]")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: a router and stacked SwiGLU experts in place of each layer's MLP (n_experts 0: dense)."""

    n_experts: int = _f(0, "routed experts per MoE layer (split over 'expert'); 0: a dense MLP in every layer")
    top_k: int = _f(2, "experts each token is sent to")
    d_ff: int = _f(0, "hidden width of one expert; 0 means model.d_ff")
    norm_topk_prob: bool = _f(True, "renormalise the top-k router probabilities to sum to 1 (Mixtral: true; "
                              "Qwen2-MoE's default: false)")
    capacity_factor: float = _f(0.0, "0: dropless (every assignment computed); > 0: each expert takes at most "
                                "ceil(capacity_factor * seq_len * top_k / n_experts) tokens of a sequence, first "
                                "choices before second, earlier tokens first; the rest are dropped and counted")
    aux_loss_coef: float = _f(0.01, "Switch/GShard load-balancing loss coefficient: coef * n_experts * sum_e f_e * "
                              "P_e per sequence, averaged over sequences and MoE layers; 0: off")
    z_loss_coef: float = _f(0.0, "router z-loss coefficient (ST-MoE): coef * mean logsumexp(router logits)^2; 0: off")
    shared_d_ff: int = _f(0, "hidden width of a shared expert every token also passes (Qwen2-MoE); 0: none")
    shared_gate: bool = _f(False, "scale the shared expert's output by sigmoid(x . w) per token (Qwen2-MoE)")
    sparse_step: int = _f(1, "layer i (from 0) is an MoE layer when (i + 1) % sparse_step == 0, the others keep "
                          "a dense SwiGLU of width model.d_ff (Qwen2-MoE's decoder_sparse_step); 1: every layer")
    dense_layers: tuple[int, ...] = _f((), "layers that keep a dense MLP whatever sparse_step says (Qwen2-MoE's "
                                       "mlp_only_layers; DeepSeek's first k dense layers: 0, …, k-1)")
    load_ema: float = _f(0.0, "0: off; in (0, 1): keep expert_load, each MoE layer's exponential moving average "
                         "(this decay per step) of its experts' shares of the routed assignments — model state "
                         "outside the gradient, checkpointed with the parameters")
    scoring: str = _f("softmax", "router scores: 'softmax' over the experts (Mixtral, Qwen2-MoE, DeepSeek-V2) or "
                      "'sigmoid' of each logit (DeepSeek-V3)")
    n_group: int = _f(1, "group-limited routing (DeepSeek): the experts form this many equal groups and a token "
                      "picks its top_k among the topk_group best groups only; 1: no groups")
    topk_group: int = _f(1, "groups a token may route to when n_group > 1; a group's score is its best expert's "
                         "(softmax) or the sum of its two best biased scores (sigmoid)")
    routed_scale: float = _f(1.0, "multiplies the routed experts' gates (Hugging Face's routed_scaling_factor)")
    correction_bias: bool = _f(False, "each MoE layer keeps e_score_correction_bias [n_experts] (float32 model "
                               "state), added to the scores to choose the experts, never to the gates (DeepSeek-V3)")
    bias_update_rate: float = _f(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): after each step bias += rate * "
                                 "sign(mean load - load) per MoE layer, from the step's global loads; 0: frozen")
    bias_recenter: bool = _f(False, "re-centre each layer's correction bias to mean 0 after every update")
    router_bias: bool = _f(False, "a bias [n_experts] on the router logits (gpt-oss)")
    expert_bias: bool = _f(False, "biases on every expert's gate, up and down projections (gpt-oss)")
    swiglu_limit: float = _f(0.0, "> 0: the experts' activation is gpt-oss's clamped SwiGLU, (min(max(up, -limit), "
                             "limit) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, limit); 0: SwiGLU")
    swiglu_alpha: float = _f(1.702, "the clamped SwiGLU's sigmoid slope (moe.swiglu_limit > 0; gpt-oss's 1.702)")

    def __post_init__(self):
        check_fields(self, "moe")
        for name in ("n_experts", "d_ff", "shared_d_ff"):
            check_positive(f"moe.{name}", getattr(self, name), allow_zero="derived" if name == "d_ff" else "off")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            check_positive(f"moe.{name}", getattr(self, name), allow_zero="off")
        if not 0 <= self.load_ema < 1:
            raise ConfigError("moe.load_ema", self.load_ema, "must be in [0, 1) (0: off; else the decay per step)",
                              "use a decay such as 0.9, or 0 to keep no expert_load")
        if self.load_ema and not self.enabled:
            raise ConfigError("moe.load_ema", self.load_ema, "tracks the experts' load, and moe.n_experts = 0 "
                              "(a dense model)", "set moe.n_experts > 0, or drop moe.load_ema")
        check_positive("moe.top_k", self.top_k)
        check_positive("moe.sparse_step", self.sparse_step)
        check_positive("moe.swiglu_limit", self.swiglu_limit, allow_zero="plain SwiGLU")
        check_positive("moe.swiglu_alpha", self.swiglu_alpha)
        for name in ("router_bias", "expert_bias", "swiglu_limit"):
            if getattr(self, name) and not self.enabled:
                raise ConfigError(f"moe.{name}", getattr(self, name), "shapes the experts, and moe.n_experts = 0 "
                                  "(a dense model)", f"set moe.n_experts > 0, or drop moe.{name}")
        if len(set(self.dense_layers)) != len(self.dense_layers) or any(i < 0 for i in self.dense_layers):
            raise ConfigError("moe.dense_layers", list(self.dense_layers), "must list distinct layer indices >= 0",
                              "list each dense layer once, counting from 0")
        object.__setattr__(self, "dense_layers", tuple(sorted(self.dense_layers)))
        if not self.enabled and (self.sparse_step != 1 or self.dense_layers):
            field = "moe.sparse_step" if self.sparse_step != 1 else "moe.dense_layers"
            raise ConfigError(field, getattr(self, field[4:]), "chooses which layers are MoE, and moe.n_experts = 0 "
                              "(a dense model)", f"set moe.n_experts > 0, or drop {field}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ConfigError("moe.top_k", self.top_k, f"must be <= moe.n_experts = {self.n_experts} (a token "
                              "picks distinct experts)", f"use top_k among 1..{self.n_experts}")
        self._check_routing()
        if self.shared_gate and not self.shared_d_ff:
            raise ConfigError("moe.shared_gate", True, "gates the shared expert, and moe.shared_d_ff = 0 (none)",
                              "set moe.shared_d_ff > 0, or moe.shared_gate=false")

    def _check_routing(self):
        """The DeepSeek routing fields: scoring, the expert groups, the gate scale and the correction bias."""
        check_choice("moe.scoring", self.scoring, SCORINGS)
        check_positive("moe.n_group", self.n_group)
        check_positive("moe.topk_group", self.topk_group)
        check_positive("moe.routed_scale", self.routed_scale)
        check_positive("moe.bias_update_rate", self.bias_update_rate, allow_zero="off")
        for name, off in (("n_group", 1), ("scoring", "softmax"), ("correction_bias", False),
                          ("bias_recenter", False), ("routed_scale", 1.0)):
            if getattr(self, name) != off and not self.enabled:
                raise ConfigError(f"moe.{name}", getattr(self, name), "configures the routing, and moe.n_experts = 0 "
                                  "(a dense model)", f"set moe.n_experts > 0, or drop moe.{name}")
        if self.topk_group > self.n_group:
            raise ConfigError("moe.topk_group", self.topk_group, f"must be <= moe.n_group = {self.n_group} (the "
                              "groups a token may pick among)", f"use topk_group among 1..{self.n_group}")
        if self.bias_update_rate and not self.correction_bias:
            raise ConfigError("moe.bias_update_rate", self.bias_update_rate, "updates the correction bias, and "
                              "moe.correction_bias is false (no bias)", "set moe.correction_bias=true, or drop "
                              "moe.bias_update_rate")
        if self.bias_recenter and not self.correction_bias:
            raise ConfigError("moe.bias_recenter", True, "re-centres the correction bias, and moe.correction_bias "
                              "is false (no bias)", "set moe.correction_bias=true, or moe.bias_recenter=false")
        if self.n_group == 1 or not self.enabled:
            return
        if self.n_experts % self.n_group:
            raise ConfigError("moe.n_group", self.n_group, f"must divide moe.n_experts = {self.n_experts} (equal "
                              "groups of experts)", f"use one of {divisors(self.n_experts)}")
        per_group = self.n_experts // self.n_group
        if self.scoring == "sigmoid" and per_group < 2:
            raise ConfigError("moe.n_group", self.n_group, f"leaves {per_group} expert a group, and sigmoid scoring "
                              "ranks groups by the sum of their two best experts' scores", "use at most "
                              f"{self.n_experts // 2} groups")
        if self.top_k > self.topk_group * per_group:
            raise ConfigError("moe.top_k", self.top_k, f"exceeds the {self.topk_group * per_group} experts of the "
                              f"topk_group = {self.topk_group} groups a token may use ({per_group} each)",
                              f"raise moe.topk_group to {math.ceil(self.top_k / per_group)} or lower moe.top_k")

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape and numerics. Sizes of 0 are derived (see each field)."""

    family: str = _f("llama", " or ".join(f"'{f.name}' ({f.summary})" for f in FAMILIES.values()))
    vocab_size: int = _f(256, "vocabulary size; must cover the tokenizer (256 for the byte tokenizer)")
    d_model: int = _f(128, "residual stream width h")
    n_layers: int = _f(4, "number of transformer blocks L")
    n_heads: int = _f(4, "query heads a")
    n_kv_heads: int = _f(0, "key/value heads (GQA); 0 means n_heads (plain multi-head attention)")
    head_dim: int = _f(0, "width of one head; 0 means d_model // n_heads")
    d_ff: int = _f(0, "MLP hidden width; 0 means the family's default: 4*d_model (gpt2), 8/3*d_model rounded up "
                   "to 32 (llama)")
    max_seq_len: int = _f(256, "longest sequence the model accepts (size of the gpt2 position table)")
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama family)")
    rope_scaling: str = _f("none", "RoPE frequency scaling for long context: 'none', 'linear' (positions / "
                           "rope_factor), 'llama3' (Llama 3.1's per-frequency interpolation) or 'yarn' (YaRN: "
                           "per-frequency ramp between beta_fast and beta_slow rotations, and its attention "
                           "factor: DeepSeek, gpt-oss)")
    rope_factor: float = _f(1.0, "RoPE scaling factor (rope_scaling 'linear', 'llama3' or 'yarn')")
    rope_low_freq_factor: float = _f(1.0, "llama3 scaling: wavelengths above original_max_len/this are scaled fully")
    rope_high_freq_factor: float = _f(4.0, "llama3 scaling: wavelengths below original_max_len/this are kept")
    rope_original_max_len: int = _f(8192, "llama3 / yarn scaling: the context length the model was pretrained at")
    rope_beta_fast: float = _f(32.0, "yarn scaling: dims rotating more than this often over original_max_len are "
                               "kept (extrapolated)")
    rope_beta_slow: float = _f(1.0, "yarn scaling: dims rotating less than this often are interpolated fully")
    rope_mscale: float = _f(1.0, "yarn scaling: the cos/sin attention factor's numerator coefficient "
                            "(0.1*mscale*ln(factor) + 1); 0: unset (HF config.json without the key)")
    rope_mscale_all_dim: float = _f(0.0, "yarn scaling: the factor's denominator coefficient; when non-zero the "
                                    "softmax scale is also multiplied by (0.1*mscale_all_dim*ln(factor) + 1)^2 "
                                    "(DeepSeek)")
    rope_truncate: bool = _f(True, "yarn scaling: round the ramp's ends to whole dims (transformers' truncate; "
                             "gpt-oss sets false)")
    rope_interleave: bool = _f(False, "RoPE rotates dim pairs (2i, 2i+1) (Hugging Face DeepSeek's complex-pair "
                               "order) instead of (i, i+E/2); deepseek family")
    q_lora_rank: int = _f(0, "MLA (deepseek family): rank of the low-rank query projection; 0: queries projected "
                          "directly from d_model")
    kv_lora_rank: int = _f(0, "MLA (deepseek family): width r of the compressed key/value latent the cache holds")
    qk_rope_head_dim: int = _f(0, "MLA (deepseek family): width R of each head's rotary query part and of the "
                               "rotary key all heads share")
    qk_nope_head_dim: int = _f(0, "MLA (deepseek family): width of each head's query/key part without RoPE; "
                               "head_dim = qk_nope_head_dim + qk_rope_head_dim")
    v_head_dim: int = _f(0, "MLA (deepseek family): width of each head's value")
    mtp_depth: int = _f(0, "multi-token prediction (DeepSeek-V3, HF num_nextn_predict_layers): D sequential "
                        "modules, module k predicting token i+k+1 from the hidden state of depth k-1 and token i+k's "
                        "embedding (its own norms, projection and one block of the model's kind; the embedding and "
                        "LM head shared); trained with train.mtp_loss_weight, a draft for self-speculative "
                        "decoding; RMSNorm families; 0: off")
    qkv_bias: bool = _f(False, "biases on the q, k, v projections in the llama family (Qwen2); gpt2 always has them")
    o_bias: bool = _f(False, "a bias on the attention output projection (gpt-oss's attention_bias, with "
                      "qkv_bias); llama family")
    qk_norm: bool = _f(False, "RMSNorm over head_dim on every query and key head, each with its own scale "
                       "[head_dim], after the projection and before RoPE (Qwen3); llama family")
    attention_sinks: bool = _f(False, "a learned logit per query head in each layer's softmax denominator "
                               "(gpt-oss's sinks: attention may put weight on no key); llama family, XLA attention")
    sliding_window: int = _f(0, "attend only to the last this-many positions, the query's own included (Mistral); "
                             "0: full causal attention")
    full_attention_every: int = _f(0, "with model.sliding_window: layer i (from 0) attends over the whole causal "
                                   "past when (i + 1) % full_attention_every == 0 and within the window otherwise "
                                   "(Gemma 3: 6, gpt-oss: 2; Hugging Face's layer_types); 0: every layer windowed")
    local_rope_theta: float = _f(0.0, "the RoPE base of the windowed layers, which then take no RoPE scaling "
                                 "(Gemma 3's local base 10000; the full layers keep rope_theta and rope_scaling); "
                                 "0: every layer the same RoPE")
    query_pre_attn_scalar: float = _f(0.0, "scale the attention scores by 1/sqrt(this) instead of 1/sqrt(head_dim) "
                                      "(Gemma's query_pre_attn_scalar); 0: head_dim")
    attention: str = _f("auto", "attention kernel via jax.nn.dot_product_attention: 'xla', 'cudnn' (flash attention "
                        "on NVIDIA GPUs, bf16/fp16; untested until a GPU run shows it), or 'auto' (cudnn where it "
                        "applies, else xla)")
    scan_unroll: int = _f(4, "layers per iteration of the scan over layers (per pipeline stage): the loop runs "
                          "ceil(n/u) iterations of u unrolled layers, so XLA schedules across their boundaries and "
                          "keeps fewer per-layer buffers; compile time grows with u, never with depth. 1: one layer "
                          "per iteration")
    norm_eps: float = _f(1e-5, "epsilon of RMSNorm / LayerNorm")
    tie_embeddings: bool = _f(False, "share the token embedding with the LM head")
    init_std: float = _f(0.02, "std of the normal init; output projections get init_std/sqrt(2*n_layers)")
    dtype: str = _f("float32", "compute dtype of matmuls ('bfloat16' on GPUs); softmax and loss always run in float32")
    param_dtype: str = _f("float32", "dtype of the master parameters and optimizer state")
    weights: str = _f("float", "how the layers' weight matrices are stored: 'float' (param_dtype: what trains), or "
                      "quantized for inference, dequantized inside the matmul — 'int8' (symmetric, a scale per "
                      "output channel) or 'int4' (symmetric, a scale per weight_group inputs of each output "
                      "channel). Embeddings, the LM head and the MoE router stay float. Made by `jaxpar convert "
                      "--quantize` or `load(..., quantize=)`")
    weight_group: int = _f(128, "int4: consecutive inputs of an output channel sharing one scale; must divide "
                           "every quantized matrix's input width (d_model, heads*head_dim, d_ff). `jaxpar convert "
                           "--quantize int4` without --group-size picks the largest up to 128 that does")
    matmul: str = _f("float", "the block's matmuls (attention, MLP, experts; router, embedding and head stay float): "
                     "'float' (the compute dtype) or 'fp8_rowwise' (e4m3 inputs and weights, e5m2 output gradients, "
                     "a scale per row, the weight gradient in the compute dtype: jaxpar.fp8)")
    # The `moe` section is part of the model's shape, so it rides inside ModelConfig (everything that builds a model
    # from a ModelConfig — the plan, checkpoints, Hugging Face import — gets it for free); on the command line, in
    # config files and in config.json it is its own section `moe.*` (config_from_dict / Config.to_dict move it).
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig, metadata={
        "section": "moe", "help": "the mixture-of-experts section (`moe.*`, below)"})
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig, metadata={
        "section": "lora", "help": "the low-rank adapters section (`lora.*`, below)"})

    def __post_init__(self):
        if isinstance(self.moe, dict):  # config.json written before `moe` moved out, or a dict from a caller
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        check_fields(self, "model")
        check_choice("model.family", self.family, tuple(FAMILIES))
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.param_dtype", self.param_dtype, DTYPES)
        check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        check_choice("model.attention", self.attention, ATTENTION_IMPLS)
        check_positive("model.rope_factor", self.rope_factor)
        check_positive("model.rope_original_max_len", self.rope_original_max_len)
        check_positive("model.sliding_window", self.sliding_window, allow_zero="full causal attention")
        self._check_attention_pattern()
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor > 0:
            raise ConfigError("model.rope_high_freq_factor", self.rope_high_freq_factor,
                              f"must exceed model.rope_low_freq_factor = {self.rope_low_freq_factor} > 0 "
                              "for llama3 RoPE scaling", "Llama 3.1 uses low 1.0 and high 4.0")
        if self.attention == "cudnn" and self.dtype == "float32":
            raise ConfigError("model.attention", self.attention, "cuDNN flash attention needs a 16-bit compute dtype",
                              "set model.dtype=bfloat16, or model.attention=auto/xla")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "scan_unroll"):
            check_positive(f"model.{name}", getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "d_ff"):
            check_positive(f"model.{name}", getattr(self, name), allow_zero="derived")
        for name in ("rope_theta", "norm_eps", "init_std"):
            check_positive(f"model.{name}", getattr(self, name))
        self._check_mla_and_yarn()
        check_positive("model.mtp_depth", self.mtp_depth, allow_zero="off")
        fam = FAMILIES[self.family]
        for name, what in (("qk_norm", "normalises GQA's query and key heads with RMSNorm"),
                           ("attention_sinks", "adds a logit per query head to GQA's softmax")):
            if getattr(self, name) and (fam.attention != "gqa" or fam.norm not in ("rms", "rms_offset")):
                raise ConfigError(f"model.{name}", True, f"{what}, and the {self.family} family's attention is "
                                  f"{fam.attention} with {fam.norm} norms",
                                  f"use model.family=llama, or model.{name}=false")
        if self.mtp_depth and FAMILIES[self.family].norm != "rms":
            raise ConfigError("model.mtp_depth", self.mtp_depth, f"multi-token prediction's modules normalise with "
                              f"RMSNorm (enorm, hnorm), and family {self.family!r} uses LayerNorm",
                              "set model.mtp_depth=0, or use a llama-like family (llama, deepseek)")
        if self.attention_sinks and self.attention == "cudnn":
            raise ConfigError("model.attention", "cudnn", "cuDNN's flash attention has no sink term",
                              "set model.attention=xla (or auto, which picks xla with sinks)")
        # Resolve the derived sizes so the frozen config (and config.json) holds concrete numbers.
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim == 0 and self.qk_nope_head_dim + self.qk_rope_head_dim:  # MLA: the query/key head width
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ConfigError("model.n_heads", self.n_heads, f"must divide model.d_model = {self.d_model} "
                                  "when model.head_dim is derived (0)",
                                  f"use n_heads among {divisors(self.d_model)} or set model.head_dim explicitly")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", FAMILIES[self.family].default_d_ff(self.d_model))
        if self.moe.enabled and self.moe.d_ff == 0:
            object.__setattr__(self, "moe", dataclasses.replace(self.moe, d_ff=self.d_ff))
        if self.moe.enabled and FAMILIES[self.family].mlp != "swiglu":
            raise ConfigError("moe.n_experts", self.moe.n_experts, f"MoE experts are SwiGLU MLPs, and the "
                              f"{self.family} family's MLP is {FAMILIES[self.family].mlp}",
                              "use model.family=llama for an MoE model, or moe.n_experts=0")
        FAMILIES[self.family].check(self)  # the family's own rules (llama: an even head_dim for RoPE)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads,
                              f"must divide model.n_heads = {self.n_heads} (each kv head serves a group of query heads)",
                              f"use one of {divisors(self.n_heads)}")
        if self.moe.enabled:
            late = [i for i in self.moe.dense_layers if i >= self.n_layers]
            if late:
                raise ConfigError("moe.dense_layers", list(self.moe.dense_layers), f"layers {late} do not exist: "
                                  f"the model has n_layers = {self.n_layers} (indices 0..{self.n_layers - 1})",
                                  "list layers below model.n_layers")
            if not any(self.layer_kinds):
                raise ConfigError("moe.sparse_step" if self.moe.sparse_step > 1 else "moe.dense_layers",
                                  self.moe.sparse_step if self.moe.sparse_step > 1 else list(self.moe.dense_layers),
                                  f"leaves none of the {self.n_layers} layers an MoE layer",
                                  "set moe.n_experts=0 for a dense model, or make some layer MoE")
        check_choice("model.weights", self.weights, WEIGHT_FORMATS)
        check_choice("model.matmul", self.matmul, MATMULS)
        if self.matmul != "float" and self.weights != "float":
            raise ConfigError("model.matmul", self.matmul, f"quantizes float weights, and model.weights = "
                              f"{self.weights!r} stores integers (an inference format)",
                              "use model.matmul=float with quantized weights, or model.weights=float")
        check_positive("model.weight_group", self.weight_group)
        if self.weights == "int4":
            self._check_groups()
        if self.lora.rank:
            self._check_lora()

    def lora_params(self, moe: bool) -> dict:
        """The matrices of one layer (of kind `moe`) that get adapters: {name: family Param} (none without LoRA)."""
        if not self.lora.rank:
            return {}
        params = FAMILIES[self.family].layer_params(self, moe)
        return {k: params[k] for k in self.lora.targets if k in params}

    def _check_lora(self):
        """Adapters go on the block's dense matrices the model contracts through the matmul seam (attention's
        and the MLP's): each target must be one of those in some layer of this model."""
        kinds = set(self.layer_kinds)
        adaptable = sorted({k for moe in kinds for k, p in FAMILIES[self.family].layer_params(self, moe).items()
                            if p.contract and p.role in ("attention", "mlp")})
        unknown = [t for t in self.lora.targets if t not in adaptable]
        if unknown:
            raise ConfigError("lora.targets", list(self.lora.targets), f"{unknown} is no weight matrix of the "
                              f"{self.family} family's layers that LoRA adapts (experts, routers, embeddings and "
                              "norms are not adapted)", f"choose from {adaptable}")
        if self.mtp_depth:
            raise ConfigError("lora.rank", self.lora.rank, "the MTP modules' blocks would train whole beside the "
                              "adapters", "set model.mtp_depth=0 (or import with --drop-mtp)")

    def _check_attention_pattern(self):
        """The per-layer attention pattern (full layers among windowed ones, a local RoPE) needs a window and RoPE;
        MTP's module runs one layer of no stated kind, so it is refused with a pattern."""
        check_positive("model.full_attention_every", self.full_attention_every, allow_zero="every layer windowed")
        check_positive("model.local_rope_theta", self.local_rope_theta, allow_zero="one RoPE for every layer")
        check_positive("model.query_pre_attn_scalar", self.query_pre_attn_scalar, allow_zero="head_dim")
        for name in ("full_attention_every", "local_rope_theta"):
            if getattr(self, name) and not self.sliding_window:
                raise ConfigError(f"model.{name}", getattr(self, name), "describes the windowed layers, and "
                                  "model.sliding_window is 0 (no layer is windowed)",
                                  f"set model.sliding_window > 0, or model.{name}=0")
        if self.local_rope_theta and FAMILIES[self.family].positions != "rope":
            raise ConfigError("model.local_rope_theta", self.local_rope_theta, f"is a RoPE base, and the "
                              f"{self.family} family's positions are {FAMILIES[self.family].positions}",
                              "set model.local_rope_theta=0")
        if self.mtp_depth and (self.full_attention_every or self.local_rope_theta):
            raise ConfigError("model.mtp_depth", self.mtp_depth, "an MTP module runs one layer, and a model with "
                              "full and windowed layers (full_attention_every) or a local RoPE does not say which "
                              "kind it is", "set model.mtp_depth=0")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per model layer, its sliding window (0: the whole causal past): `sliding_window` on every layer but the
        full ones `full_attention_every` marks."""
        every, W = self.full_attention_every, self.sliding_window
        return tuple(0 if not W or (every and (i + 1) % every == 0) else W for i in range(self.n_layers))

    def layer_config(self, window: int) -> "ModelConfig":
        """The config a layer with `window` (an entry of `layer_windows`) runs under: the model's, with that
        window, and for a windowed layer the local RoPE (`local_rope_theta`, unscaled) — so the layer functions,
        the attention kernels and the masks read one `sliding_window` and one RoPE, as in a uniform model. The
        model's own config where every layer is alike."""
        return _layer_config(self, window)

    def _check_mla_and_yarn(self):
        """Multi-head latent attention's sizes belong to a family whose attention kind is 'mla' (deepseek), and its
        RoPE part rotates in pairs; YaRN needs a real extension (factor > 1) and ordered ramp bounds, and only the
        mla kind applies its attention factor."""
        for name in MLA_FIELDS:
            check_positive(f"model.{name}", getattr(self, name), allow_zero="unused")
        mla = FAMILIES[self.family].attention == "mla"
        if not mla:
            for name in MLA_FIELDS + ("rope_interleave",):
                if getattr(self, name):
                    raise ConfigError(f"model.{name}", getattr(self, name), f"is a multi-head latent attention "
                                      f"setting, and the {self.family} family's attention is "
                                      f"{FAMILIES[self.family].attention}",
                                      f"use model.family=deepseek, or leave model.{name} at its default")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("model.qk_rope_head_dim", self.qk_rope_head_dim, "must be even: RoPE rotates dims in "
                              "pairs", f"use qk_rope_head_dim {self.qk_rope_head_dim + 1}")
        for name in ("rope_beta_fast", "rope_beta_slow"):
            check_positive(f"model.{name}", getattr(self, name))
        check_positive("model.rope_mscale", self.rope_mscale, allow_zero="unset, as transformers reads an absent "
                       "mscale key: the attention factor is then 0.1*ln(factor) + 1")
        check_positive("model.rope_mscale_all_dim", self.rope_mscale_all_dim, allow_zero="no softmax-scale "
                       "correction")
        if self.rope_scaling != "yarn":
            return
        if FAMILIES[self.family].positions != "rope":
            raise ConfigError("model.rope_scaling", self.rope_scaling, f"scales RoPE, and the {self.family} family's "
                              f"positions are {FAMILIES[self.family].positions}", "set model.rope_scaling=none")
        if not mla and self.rope_mscale_all_dim:
            raise ConfigError("model.rope_mscale_all_dim", self.rope_mscale_all_dim, "corrects the softmax scale of "
                              f"multi-head latent attention (DeepSeek), and the {self.family} family's attention is "
                              f"{FAMILIES[self.family].attention}", "set model.rope_mscale_all_dim=0")
        if not self.rope_factor > 1:
            raise ConfigError("model.rope_factor", self.rope_factor, "must exceed 1 for yarn scaling (the context "
                              "extension factor; 1 or less leaves the frequencies unscaled)",
                              "set model.rope_factor > 1 (DeepSeek-V2 uses 40), or rope_scaling 'none'")
        if not self.rope_beta_fast > self.rope_beta_slow:
            raise ConfigError("model.rope_beta_fast", self.rope_beta_fast, f"must exceed model.rope_beta_slow = "
                              f"{self.rope_beta_slow} (yarn ramps between those rotation counts)",
                              "DeepSeek uses beta_fast 32 and beta_slow 1")

    def quantized_params(self, moe: bool) -> dict:
        """The matrices of one layer (of kind `moe`) that `weights` stores quantized: {name: family Param}."""
        if self.weights == "float":
            return {}
        return {k: p for k, p in FAMILIES[self.family].layer_params(self, moe).items() if p.contract}

    def scale_param(self, spec):
        """The scale Param of a quantized matrix (families.base.Param.scale): per output channel for int8, in
        groups of weight_group inputs for int4."""
        return spec.scale(self.weight_group if self.weights == "int4" else None)

    def _check_groups(self):
        """Every int4 matrix must split into whole groups of weight_group inputs (AWQ / GPTQ's rule)."""
        specs = {k: p for moe in set(self.layer_kinds) for k, p in self.quantized_params(moe).items()}
        for name, spec in specs.items():
            try:
                self.scale_param(spec)
            except ValueError as e:
                ok = self.int4_groups()
                raise ConfigError("model.weight_group", self.weight_group,
                                  f"cannot group {name} {list(spec.shape)} ({e})",
                                  f"use model.weight_group {ok[0]} (the largest up to {DEFAULT_GROUP} that divides "
                                  f"every quantized width; others: {ok[1:6]})" if ok else "use model.weights=int8 "
                                  "(a scale per output channel)") from None

    def int4_groups(self, limit: int = 0) -> list[int]:
        """The int4 group sizes up to `limit` (default DEFAULT_GROUP), largest first, that split every matrix int4
        quantizes into whole groups (each contracted width; `families.base.Param.scale`): what `weight_group` may
        be. The first is the default of `jaxpar convert --quantize int4` and `load(quantize='int4')` without a
        group size."""
        limit = limit or DEFAULT_GROUP
        family = FAMILIES[self.family]
        specs = [p for moe in set(self.layer_kinds) for p in family.layer_params(self, moe).values() if p.contract]
        return [g for g in range(limit, 0, -1) if all(_tiles(p, g) for p in specs)]

    @property
    def weights_label(self) -> str:
        """How the layers' matrices are stored, in words: 'float', 'int8', 'int4 in groups of 32'."""
        return f"int4 in groups of {self.weight_group}" if self.weights == "int4" else self.weights

    @property
    def layer_kinds(self) -> tuple[bool, ...]:
        """Per model layer: True for an MoE layer (router and experts), False for a dense MLP."""
        m = self.moe
        if not m.enabled:
            return (False,) * self.n_layers
        dense = set(m.dense_layers)
        return tuple((i + 1) % m.sparse_step == 0 and i not in dense for i in range(self.n_layers))

    @property
    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """The model layers each stack of layer parameters holds, in model order. `blocks`: every layer of a dense or
        all-MoE model, the MoE layers of a mixed one; `dense_blocks` (a mixed dense / MoE model only): its dense
        layers. Every layer of a stack has the same parameters, so each stack scans (jaxpar.model.run_layers)."""
        kinds = self.layer_kinds
        if all(kinds) or not any(kinds):
            return {"blocks": tuple(range(self.n_layers))}
        return {"blocks": tuple(i for i, k in enumerate(kinds) if k),
                "dense_blocks": tuple(i for i, k in enumerate(kinds) if not k)}

    @property
    def prefix_layers(self) -> int:
        """How many leading layers form a prefix of another kind, which a pipeline runs outside its stages, beside
        the embedding: DeepSeek's first `first_k_dense_replace` dense layers before MoE layers only (k > 0 dense
        layers, then n_layers − k MoE layers). Their stack (`dense_blocks`) is stacked on the `prefix_layers`
        logical axis, which no mesh axis splits. 0 for any other pattern (a uniform model; dense layers
        interleaved with MoE ones, which a pipeline cuts into chunks of one pattern)."""
        kinds = self.layer_kinds
        k = kinds.index(True) if True in kinds else 0
        return k if k and all(kinds[k:]) else 0

    @property
    def pipelined_layers(self) -> int:
        """The layers a pipeline splits into chunks: all but the `prefix_layers`."""
        return self.n_layers - self.prefix_layers

    @property
    def layer_pattern(self) -> tuple[str, ...]:
        """Per model layer, the name of the stack that holds it (`layer_stacks`)."""
        where = {i: name for name, layers in self.layer_stacks.items() for i in layers}
        return tuple(where[i] for i in range(self.n_layers))

    @property
    def moe_layer_count(self) -> int:
        """How many layers are MoE layers."""
        return sum(self.layer_kinds)


def _tiles(spec, group: int) -> bool:
    try:
        spec.scale(group)
        return True
    except ValueError:
        return False


def resolve_attention(cfg: ModelConfig, device: Any) -> ModelConfig:
    """`cfg` with attention 'auto' replaced by the kernel for `device` (a jax device): cuDNN flash attention on an
    NVIDIA GPU for a 16-bit compute dtype and a head width it supports (≤ 128, a multiple of 8) without attention
    sinks, XLA otherwise.
    The plan calls it where the config meets its devices, so the model never probes devices; a model built directly
    from a config that still says 'auto' runs the XLA kernel."""
    if cfg.attention != "auto":
        return cfg
    nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
    fits = (cfg.dtype in ("bfloat16", "float16") and cfg.head_dim <= 128 and cfg.head_dim % 8 == 0
            and not cfg.attention_sinks)  # cuDNN has no sink term
    return dataclasses.replace(cfg, attention="cudnn" if nvidia and fits else "xla")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism on the mesh axes (jaxpar.parallel.axes) and how the step is cut up."""

    data: int = _f(-1, "data-parallel degree (batch sharded over 'data'); -1 fills the devices left over")
    pipe: int = _f(1, "pipeline stages on 'pipe'")
    expert: int = _f(1, "expert-parallel degree on 'expert': MoE experts split over its ranks, which are "
                     "data-parallel outside the MoE layers (tokens reach their experts by all-to-all)")
    context: int = _f(1, "context-parallel degree on 'context': the sequence of every activation split over "
                      "ranks (zigzag chunks, causal work balanced)")
    context_impl: str = _f("all_gather", "context-parallel attention: 'all_gather' (each layer gathers K/V over "
                           "'context', reduce-scatters their gradients) or 'ring' (K/V blocks passed around the "
                           "ring, online softmax, no S-long score row)")
    tensor: int = _f(1, "tensor-parallel degree on 'tensor' (innermost mesh axis, fastest links)")
    sequence_parallel: bool = _f(False, "shard norms/residuals on the sequence dim inside tensor-parallel regions")
    overlap: str = _f("none", "tensor-parallel communication under sequence parallelism: 'none' (each all-gather / "
                      "reduce-scatter whole, before / after its matmul) or 'collective_matmul' (each decomposed into "
                      "tensor-1 ring steps beside the partial matmuls, which hide them)")
    repeats: int = _f(1, "circular pipeline passes through the stages (1 is GPipe)")
    microbatches: int = _f(1, "pipeline microbatches per step")
    schedule: str = _f("circular", "pipeline schedule: 'circular' (autodiff of the circular loop), or a table run "
                       "with explicit vjps: " + ", ".join(SCHEDULES[:1] + SCHEDULES[2:]))
    skip_bubble: bool = _f(False, "circular pipeline: a stage skips its layers in its bubble iterations (a cond "
                           "per iteration). Saves compute only where devices share cores (simulated CPU devices; "
                           "benchmark figures in bench/RESULTS.md); XLA's conditional copies an iteration's "
                           "activations in and out, so the peak grows")
    zero: int = _f(0, "ZeRO stage over 'data': 0 off, 1 optimizer state sharded, 3 parameters too")
    remat: str = _f("none", "activation checkpointing per layer: 'none', 'full', 'dots' (save matmul outputs), or "
                    "'selective' (Megatron's: save every linear layer's named input and output, recompute the core "
                    "attention; jaxpar.model.CHECKPOINT_NAMES)")
    auto: bool = _f(False, "let the planner choose the layout on the devices the run has (`jaxpar plan`): the fields "
                    "of parallel.keep stay as set, and so does any field set to a non-default value; the rest of "
                    f"{', '.join(AUTO_KEEPS)} are chosen, and the choice and the runner-up are logged")
    keep: tuple[str, ...] = _f((), "with parallel.auto: fields to keep as set even at their default value (a config "
                               "file's and --config overrides' parallel keys, and train.grad_accum, join it by "
                               "themselves)")
    profile: str = _f("", "with parallel.auto: a machine profile written by `jaxpar probe` on this machine ('' : the "
                      "device kind's datasheet on known GPUs, else a probe of the devices at start, ~12 s)")

    def __post_init__(self):
        check_fields(self, "parallel")
        if not self.auto and (self.keep or self.profile):
            name = "keep" if self.keep else "profile"
            raise ConfigError(f"parallel.{name}", getattr(self, name), "only read by the planner, and "
                              "parallel.auto is off", f"set parallel.auto=true, or drop parallel.{name}")
        for name in self.keep:
            if name not in AUTO_KEEPS:
                close = difflib.get_close_matches(name, AUTO_KEEPS, n=1)
                raise ConfigError("parallel.keep", self.keep, f"names {name!r}, which the planner does not choose",
                                  (f"did you mean {close[0]!r}? " if close else "") + f"name among {', '.join(AUTO_KEEPS)}")
        if self.data != -1:
            check_positive("parallel.data", self.data, fix="use a positive degree, or -1 to fill the remaining devices")
        for name in [a for a in axes.AXES if a != axes.DATA] + ["repeats", "microbatches"]:
            check_positive(f"parallel.{name}", getattr(self, name))
        if self.sequence_parallel and self.tensor == 1:
            # SP swaps the tensor-parallel boundaries for all-gather/reduce-scatter over `tensor`: with one rank
            # there is nothing to shard, and the flag would silently do nothing.
            raise ConfigError("parallel.sequence_parallel", True, "sequence parallelism shards activations over the "
                              "tensor axis, and parallel.tensor = 1", "set parallel.tensor > 1, or "
                              "parallel.sequence_parallel=false")
        check_choice("parallel.overlap", self.overlap, OVERLAPS)
        if self.overlap == "collective_matmul" and not self.sequence_parallel:
            raise ConfigError("parallel.overlap", self.overlap, "decomposes sequence parallelism's all-gathers and "
                              "reduce-scatters, and parallel.sequence_parallel is off",
                              "set parallel.sequence_parallel=true (with parallel.tensor > 1), or "
                              "parallel.overlap=none")
        if self.overlap == "collective_matmul" and self.pipe > 1 and self.schedule != "circular":
            # As the ring's below: a ring step inside one stage's branch waits for stages on other actions.
            raise ConfigError("parallel.overlap", self.overlap, f"its collective-permutes would run inside the "
                              f"per-stage branches of the '{self.schedule}' schedule, where XLA waits for every "
                              "device of the mesh (stages on other actions never arrive)",
                              "use parallel.overlap=none with a schedule table, or parallel.schedule=circular")
        if self.skip_bubble and (self.pipe == 1 or self.schedule != "circular"):
            raise ConfigError("parallel.skip_bubble", True, "only the circular pipeline computes its bubble (a "
                              "schedule table's idle ticks already run nothing)" if self.pipe > 1 else
                              "there is no pipeline bubble with parallel.pipe = 1",
                              "drop parallel.skip_bubble" + ("" if self.pipe > 1 else ", or set parallel.pipe > 1"))
        if self.skip_bubble and (self.overlap == "collective_matmul" or (self.context > 1
                                                                          and self.context_impl == "ring")):
            field = "overlap" if self.overlap == "collective_matmul" else "context_impl"
            raise ConfigError("parallel.skip_bubble", True, f"parallel.{field}={getattr(self, field)} runs "
                              "collective-permutes inside the layers, and XLA waits for every device of the mesh "
                              "at each: a stage skipping its bubble would never arrive",
                              f"drop parallel.skip_bubble, or change parallel.{field}")
        check_choice("parallel.zero", self.zero, (0, 1, 3))
        check_choice("parallel.context_impl", self.context_impl, CONTEXT_IMPLS)
        if self.context > 1 and self.context_impl == "ring" and self.pipe > 1 and self.schedule != "circular":
            # The executor runs each stage's action in its own switch branch; XLA:CPU's collective-permute waits
            # for every device of the mesh, so a ring step in one stage's branch waits for stages that never come.
            # Refused on every backend, not only in the plan for CPUs: XLA:GPU also rendezvouses every
            # participant of a collective-permute, and no GPU run has shown the branch safe there.
            raise ConfigError("parallel.context_impl", "ring", f"ring attention's collective-permutes would run "
                              f"inside the per-stage branches of the '{self.schedule}' schedule, where XLA waits "
                              "for every device of the mesh (stages on other actions never arrive)",
                              "use parallel.context_impl=all_gather with a schedule table, or "
                              "parallel.schedule=circular")
        check_choice("parallel.remat", self.remat, REMAT_POLICIES)
        if self.schedule != "circular":  # the circular loop's own rules follow below
            why = schedule_check(self.schedule, self.pipe, self.repeats, self.microbatches)
            if why:
                raise ConfigError(*why)
        if self.pipe == 1 and (self.repeats != 1 or self.microbatches != 1):
            name = "repeats" if self.repeats != 1 else "microbatches"
            raise ConfigError(f"parallel.{name}", getattr(self, name), "only meaningful with pipeline parallelism "
                              "(parallel.pipe > 1)", f"set parallel.{name}=1, or parallel.pipe > 1 "
                              "(use train.grad_accum to split a step without a pipeline)")
        if self.pipe > 1 and self.microbatches < self.pipe:
            raise ConfigError("parallel.microbatches", self.microbatches,
                              f"must be >= parallel.pipe = {self.pipe} (a microbatch leaving the last stage must not "
                              "reach the first before that stage has started every other microbatch of the pass)",
                              f"use microbatches {self.pipe} or another multiple of {self.pipe}")
        if self.pipe > 1 and self.microbatches % self.pipe:
            raise ConfigError("parallel.microbatches", self.microbatches,
                              f"must be a multiple of parallel.pipe = {self.pipe} (each stage embeds, and finally "
                              "holds, microbatches/pipe of them)",
                              f"use microbatches {nearest_multiples(self.microbatches, self.pipe)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimisation: batch arithmetic, AdamW with warmup + cosine decay, logging and evaluation cadence."""

    batch_size: int = _f(32, "global batch in sequences per optimizer step")
    seq_len: int = _f(128, "tokens per training sequence")
    steps: int = _f(500, "optimizer steps")
    lr: float = _f(3e-3, "peak learning rate")
    warmup_steps: int = _f(50, "linear warmup steps from 0 to lr")
    min_lr_ratio: float = _f(0.1, "cosine decay ends at lr*min_lr_ratio")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms, biases)")
    b1: float = _f(0.9, "AdamW beta1")
    b2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip gradients to this global norm; 0 disables")
    grad_accum: int = _f(1, "gradient accumulation: split each step's batch into this many sequential chunks")
    seed: int = _f(0, "seed for parameter init, data order and sampling")
    log_every: int = _f(10, "log metrics every this many steps")
    profile_steps: int = _f(0, "trace this many steps with jax.profiler into WORKDIR/profile, from the second step "
                            "of the run (the first compiles); 0: off")
    eval_every: int = _f(100, "evaluate held-out loss every this many steps (0: only at the end)")
    eval_batches: int = _f(4, "held-out batches per evaluation")
    max_bad_steps: int = _f(5, "stop after this many consecutive steps with a non-finite loss, gradient or update "
                               "(each such step is skipped: parameters and optimizer state are left as they were)")
    mtp_loss_weight: float = _f(0.3, "lambda of the multi-token prediction loss (model.mtp_depth > 0): the "
                                "objective adds lambda/D times the sum over depths of each depth's mean cross-entropy "
                                "(logged as mtp_loss; the reported loss stays the next-token loss)")
    init_from_hf: str = _f("", "a Hugging Face model directory whose weights start the run (the model section must "
                           "match it: `jaxpar train --init-from-hf DIR` fills it in); '' starts from random weights")
    objective: str = _f("lm", "'lm': next-token cross-entropy (over the loss mask's tokens with chat data); 'dpo': "
                        "direct preference optimisation on data.source=pairs (jaxpar.train.dpo)")
    dpo_beta: float = _f(0.1, "DPO's beta: how far the policy may move from the reference (larger: closer)")
    dpo_loss: str = _f("sigmoid", "'sigmoid' (DPO: -log sigmoid of the reward margin) or 'ipo' (the squared loss "
                       "of Azar et al., on per-token mean log-probabilities)")
    dpo_reference: str = _f("model", "'model': the model the run starts from (its log-probabilities computed by a "
                            "forward pass before each step); 'none': reference-free (log pi_ref = 0)")

    def __post_init__(self):
        check_fields(self, "train")
        for name in ("batch_size", "seq_len", "steps", "lr", "grad_accum", "log_every", "eval_batches", "max_bad_steps"):
            check_positive(f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "seed", "profile_steps",
                     "mtp_loss_weight"):
            check_positive(f"train.{name}", getattr(self, name), allow_zero="allowed")
        if self.seed >= 2**32:
            raise ConfigError("train.seed", self.seed, "must lie in [0, 2**32) (it seeds the data order too)",
                              "pick a smaller seed")
        check_choice("train.objective", self.objective, OBJECTIVES)
        check_choice("train.dpo_loss", self.dpo_loss, DPO_LOSSES)
        check_choice("train.dpo_reference", self.dpo_reference, DPO_REFERENCES)
        check_positive("train.dpo_beta", self.dpo_beta)
        for name in ("min_lr_ratio", "b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"train.{name}", value, "must lie in [0, 1]", "pick a value between 0 and 1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = _f("default", "'default' (this Python's stdlib sources), 'synthetic', 'text' (files/dir/JSONL), "
                     "'tokens' (memmap), 'chat' (JSONL conversations, one per row, the assistant's tokens scored), "
                     "'pairs' (JSONL preference pairs for train.objective=dpo: prompt, chosen, rejected)")
    path: str = _f("", "file or directory for source 'text' or 'tokens'; the .jsonl file for 'chat' or 'pairs'")
    tokenizer: str = _f("bytes", "'bytes' (vocab 256) or a path to a Hugging Face tokenizer.json")
    pack: bool = _f(False, "with source 'chat': best-fit pack conversations several a row (attention and positions "
                    "kept inside each, segment ids); false: one conversation a row, padded")

    def __post_init__(self):
        check_fields(self, "data")
        check_choice("data.source", self.source, SOURCES)
        if self.pack and self.source != "chat":
            raise ConfigError("data.pack", self.pack, f"packs whole documents, and data.source = {self.source!r} is "
                              "a token stream cut into windows (which fill every slot already)",
                              "set data.source=chat, or data.pack=false")
        if self.source in ("text", "tokens", "chat", "pairs") and not self.path:
            raise ConfigError("data.path", self.path, f"data.source = {self.source!r} needs a path",
                              "set data.path to a file or directory")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under WORKDIR/checkpoints."""

    every: int = _f(0, "save (asynchronously) every this many steps (0: only at the end, or when preempted)")
    keep: int = _f(3, "keep the newest this many checkpoints")
    permanent_every: int = _f(0, "also keep every checkpoint whose step is a multiple of this for good (0: none)")

    def __post_init__(self):
        check_fields(self, "checkpoint")
        check_positive("checkpoint.every", self.every, allow_zero="allowed")
        check_positive("checkpoint.keep", self.keep)
        check_positive("checkpoint.permanent_every", self.permanent_every, allow_zero="allowed")
        # Only saved steps can be kept: with no periodic saves, or a period that is not a multiple of the saving
        # cadence, most of the "permanent" steps would never exist, and the run would keep fewer than asked.
        if self.permanent_every and (not self.every or self.permanent_every % self.every):
            raise ConfigError("checkpoint.permanent_every", self.permanent_every,
                              f"must be a multiple of checkpoint.every = {self.every} > 0 (only saved steps can be "
                              "kept)", f"set checkpoint.every to a divisor of {self.permanent_every}, or "
                              "checkpoint.permanent_every=0")


@functools.lru_cache(maxsize=None)
def _layer_config(m: ModelConfig, window: int) -> ModelConfig:
    """`ModelConfig.layer_config`, built once per (model, window)."""
    if not (m.full_attention_every or m.local_rope_theta):
        return m
    local = dict(rope_theta=m.local_rope_theta, rope_scaling="none") if window and m.local_rope_theta else {}
    return dataclasses.replace(m, sliding_window=window, full_attention_every=0, local_rope_theta=0.0, **local)


def check_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """The rules between a model and its layout, for training and inference alike (`Config` checks them with the
    rest; `jaxpar.infer.text.load` for an inference layout): the attention kind's heads (its `check`) and the MLP
    widths against `tensor`, the layers against the pipeline's chunks, and the mixture-of-experts rules. The
    embedding needs none: it is padded to a multiple of `tensor` (jaxpar.sharding)."""
    attention_kind(m).check(m, p.tensor)  # its heads (or latent dims) against the tensor degree
    check_divides("model.d_ff", m.d_ff, "parallel.tensor", p.tensor, "the MLP hidden dim is split over tensor")
    stages = p.pipe * p.repeats
    L, k = m.pipelined_layers, m.prefix_layers  # (stages = 1 without a pipeline: ParallelConfig's rule)
    if L % stages and k:  # DeepSeek's dense first layers run beside the embedding: the pipeline splits the rest
        raise ConfigError("model.n_layers", m.n_layers, f"the first {k} (dense) layers run outside the pipeline, "
                          f"beside the embedding, and the other {L} (MoE) layers must be divisible by "
                          f"parallel.pipe * parallel.repeats = {p.pipe}*{p.repeats} = {stages}",
                          f"use n_layers {k} + a multiple of {stages} (e.g. {k + stages * max(1, L // stages)}), "
                          f"or pipe*repeats among {divisors(L)}")
    if L % stages:
        raise ConfigError("model.n_layers", m.n_layers,
                          f"must be divisible by parallel.pipe * parallel.repeats = {p.pipe}*{p.repeats} = {stages}",
                          f"use n_layers a multiple of {stages}, or pipe*repeats among {divisors(m.n_layers)}")
    windows = m.layer_windows[k:]
    if p.pipe > 1 and not same_chunks(windows, stages):
        fits = [c for c in divisors(L) if c > 1 and same_chunks(windows, c)]
        raise ConfigError("model.full_attention_every", m.full_attention_every, f"the pipeline cuts the {L} layers "
                          f"into pipe*repeats = {stages} chunks, and they do not all hold the same full / windowed "
                          f"layers (full: {[i for i, w in enumerate(m.layer_windows) if not w]}); every stage runs "
                          "one program", f"use pipe*repeats among {fits}" if fits else "run this pattern without a "
                          "pipeline (parallel.pipe=1), or n_layers a multiple of full_attention_every")
    _check_moe(m, p)


def _check_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """Mixture-of-experts rules: experts split evenly over `expert`, expert widths over `tensor`, and the
    combinations this release does not run refused by name."""
    moe = m.moe
    if not moe.enabled:
        if p.expert > 1:
            raise ConfigError("parallel.expert", p.expert, "nothing splits over 'expert': the model has no MoE "
                              "layers (moe.n_experts = 0)", "set parallel.expert=1, or moe.n_experts > 0")
        return
    check_divides("moe.n_experts", moe.n_experts, "parallel.expert", p.expert, "each expert rank holds "
                   "n_experts/expert whole experts")
    check_divides("moe.d_ff", moe.d_ff, "parallel.tensor", p.tensor, "each expert's hidden dim is split over "
                   "tensor")
    if moe.shared_d_ff:
        check_divides("moe.shared_d_ff", moe.shared_d_ff, "parallel.tensor", p.tensor, "the shared expert's "
                       "hidden dim is split over tensor")
    chunks = p.pipe * p.repeats
    piped = m.layer_kinds[m.prefix_layers:]  # a dense prefix runs beside the embedding (`prefix_layers`)
    if p.pipe > 1 and len(piped) % chunks == 0 and not same_chunks(piped, chunks):
        fits = [c for c in divisors(m.n_layers) if c > 1 and same_chunks(m.layer_kinds, c)]
        raise ConfigError("parallel.repeats" if p.repeats > 1 else "parallel.pipe", p.repeats if p.repeats > 1
                          else p.pipe, f"the pipeline cuts the {m.n_layers} layers into pipe*repeats = {chunks} "
                          f"chunks, and they do not all hold the same dense / MoE layers (MoE: "
                          f"{[i for i, k in enumerate(m.layer_kinds) if k]}); every stage runs one program",
                          f"use pipe*repeats among {fits}" if fits else "run this layer pattern without a "
                          "pipeline (parallel.pipe=1), or make the pattern periodic (moe.sparse_step)")
    if p.context > 1:
        raise ConfigError("parallel.context", p.context, "MoE layers route whole sequences (capacity and the "
                          "load-balancing loss are per sequence), and context parallelism splits them",
                          "set parallel.context=1 for an MoE model")


@dataclasses.dataclass(frozen=True)
class Config:
    """One run. Cross-section rules (heads vs tensor, layers vs stages, seq_len vs max_seq_len, …) are checked here."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self):
        m, p, t = self.model, self.parallel, self.train
        check_layout(m, p)
        if p.context > 1 and t.seq_len % (2 * p.context * (p.tensor if p.sequence_parallel else 1)):
            # zigzag: 2c chunks, rank r holding chunks r and 2c-1-r; SP then splits each rank's seq_len/c over tensor
            k = 2 * p.context * (p.tensor if p.sequence_parallel else 1)
            by = (f"2 × parallel.context × parallel.tensor = 2 × {p.context} × {p.tensor} = {k} (sequence parallel "
                  "splits each chunk over tensor)" if p.sequence_parallel else
                  f"2 × parallel.context = 2 × {p.context} = {k}")
            raise ConfigError("train.seq_len", t.seq_len, f"must be divisible by {by}: context parallelism "
                              "cuts the sequence into 2 chunks per context rank",
                              f"use seq_len {nearest_multiples(t.seq_len, k)}, or a smaller parallel.context")
        if p.sequence_parallel and t.seq_len % p.tensor:
            raise ConfigError("train.seq_len", t.seq_len,
                              f"must be divisible by parallel.tensor = {p.tensor} with sequence_parallel on "
                              "(each rank holds seq_len/tensor tokens between tensor-parallel regions)",
                              f"use seq_len {nearest_multiples(t.seq_len, p.tensor)}, or sequence_parallel=false")
        if t.seq_len > m.max_seq_len:
            raise ConfigError("train.seq_len", t.seq_len, f"must be <= model.max_seq_len = {m.max_seq_len}",
                              f"lower train.seq_len or raise model.max_seq_len to >= {t.seq_len}")
        if self.data.tokenizer == "bytes" and m.vocab_size < 256:
            raise ConfigError("model.vocab_size", m.vocab_size, "the byte tokenizer needs 256 ids",
                              "set model.vocab_size >= 256")
        if self.data.source in ("chat", "pairs") and m.mtp_depth:
            raise ConfigError("model.mtp_depth", m.mtp_depth, f"{self.data.source} data scores the assistant's "
                              "tokens only (a loss mask), and the MTP modules' losses take no mask yet",
                              "set model.mtp_depth=0 (or import with --drop-mtp)")
        if t.objective == "dpo" and self.data.source != "pairs":
            raise ConfigError("train.objective", t.objective, f"DPO trains on preference pairs, and data.source = "
                              f"{self.data.source!r} holds none", "set data.source=pairs and data.path to a JSONL of "
                              '{"prompt": …, "chosen": …, "rejected": …} rows')
        if self.data.source == "pairs" and t.objective != "dpo":
            raise ConfigError("data.source", self.data.source, "preference pairs train with DPO (each row holds a "
                              "chosen and a rejected answer)", "set train.objective=dpo, or data.source=chat")

    def _check_batch(self, data: int):
        p, t = self.parallel, self.train
        # Rows split over data and expert (MoE ranks are data-parallel outside their layers), then into accumulation
        # chunks and pipeline microbatches.
        shards, name = (data * p.expert, f"data*expert*microbatches*grad_accum = {data}*{p.expert}*") if p.expert > 1 \
            else (data, f"data*microbatches*grad_accum = {data}*")
        per_step = shards * p.microbatches * t.grad_accum
        if t.batch_size % per_step:
            raise ConfigError("train.batch_size", t.batch_size,
                              f"must be divisible by {name}{p.microbatches}*{t.grad_accum} = {per_step} (every chunk "
                              "splits evenly over the data shards)",
                              f"use batch_size {nearest_multiples(t.batch_size, per_step)}")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The degrees in mesh-axis order (jaxpar.parallel.axes.AXES: data, pipe, expert, context, tensor); only
        meaningful after `resolve_for_devices` has filled data=-1."""
        return axes.mesh_shape(self.parallel)

    def resolve_for_devices(self, n_devices: int) -> "Config":
        """Fill `parallel.data = -1` from the device count and check the mesh product matches it."""
        p = self.parallel
        data = axes.resolve_degrees(p, n_devices)[axes.DATA]
        resolved = dataclasses.replace(self, parallel=dataclasses.replace(p, data=data))
        resolved._check_batch(resolved.parallel.data)
        return resolved

    @property
    def moe(self) -> MoEConfig:
        """The `moe` section (held by the model config: it is part of the model's shape)."""
        return self.model.moe

    @property
    def lora(self) -> LoRAConfig:
        """The `lora` section (held by the model config: the adapters are parameters of the model)."""
        return self.model.lora

    def to_dict(self) -> dict:
        """The config as nested plain dicts (what config.json and checkpoints store); `moe` and `lora` are sections
        of their own."""
        d = dataclasses.asdict(self)
        return {"model": d["model"], **{k: d["model"].pop(k) for k in NESTED},
                **{k: v for k, v in d.items() if k != "model"}}

    def to_json(self) -> str:
        """The config as sorted, indented JSON (config.json); `config_from_dict` reads it back."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS: dict[str, type] = {"model": ModelConfig, "moe": MoEConfig, "lora": LoRAConfig, "parallel": ParallelConfig,
                             "train": TrainConfig, "data": DataConfig, "checkpoint": CheckpointConfig}
NESTED = ("moe", "lora")  # sections that ride inside the model config (ModelConfig.moe, .lora)
