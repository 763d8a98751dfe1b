"""The Llama family — Llama 2 and 3, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (the q/k norm), and their
mixture-of-experts relatives Mixtral, Qwen2-MoE and Qwen3-MoE (moe.n_experts > 0).

A layer: x + attention(RMSNorm(x)), then + SwiGLU(RMSNorm(x)). Attention is grouped-query with rotary positions
(Hugging Face's rotate-half convention, optional linear / Llama 3.1 frequency scaling) and an optional sliding
window. No biases except Qwen2's on q, k, v. Qwen3 normalises each query and key head (RMSNorm over head_dim, one
scale for all heads) after the projection and before RoPE.

    per layer   attn_norm [D]; wq [D, H, E]; wk, wv [D, K, E]; wo [H, E, D]; mlp_norm [D];
                w_gate, w_up [D, F]; w_down [F, D]; with qkv_bias: bq [H, E]; bk, bv [K, E];
                with qk_norm: q_norm, k_norm [E] (self_attn.q_norm.weight, k_norm.weight)

Hugging Face: `model.layers.{l}.*` of LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM,
and of MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM, whose MoE keys and tensors (one per layer and
expert) are mapped in jaxpar/families/moe_hf.py. torch Linear weights are [out, in], so each is transposed (and the
head dims split) on the way in.
"""

from __future__ import annotations

from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families import gpt_oss_hf, moe_hf, rope_hf
from jaxpar.families.attention import GQA, attention_params, qk_norm_params, qkv_bias_params, sink_params
from jaxpar.families.base import Family, HuggingFace, Param, Rule, mlp_params, same, swiglu_d_ff


def layer_params(cfg, moe: bool) -> dict[str, Param]:
    """The llama layer: the shared attention with RMSNorms, a SwiGLU MLP (or, `moe`, a mixture of SwiGLU experts:
    Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), q/k/v biases only with qkv_bias, the output projection's bias bo [D]
    only with o_bias, the q/k norm's scales only with qk_norm, the sinks [H] only with attention_sinks."""
    params = {**attention_params(cfg, GQA, norm_bias=False), **mlp_params(cfg, moe)}
    if cfg.qkv_bias:
        params.update(qkv_bias_params(cfg))
    if cfg.o_bias:
        params["bo"] = Param((cfg.d_model,), ("embed",), "zeros", decay=False)
    if cfg.qk_norm:
        params.update(qk_norm_params(cfg))
    if cfg.attention_sinks:
        params.update(sink_params(cfg))
    return params


def check(cfg) -> None:
    """RoPE rotates dims in pairs: head_dim must be even."""
    if cfg.head_dim % 2:
        raise ConfigError("model.head_dim", cfg.head_dim, "must be even for RoPE (dims rotate in pairs)",
                          f"use head_dim {cfg.head_dim + 1}" + (f" or {cfg.head_dim - 1}" if cfg.head_dim > 1 else ""))


# -----------------------------------------------------------------------------------------------------------------
# Hugging Face

DENSE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
FUSED_QKV = ".self_attn.qkv_proj.weight"  # Phi-3's fused layout (a tensor name ending that marks it)
QWEN3 = ("qwen3", "qwen3_moe")  # the q/k norm (always on), attention_bias (default false)
ARCHITECTURES = {**DENSE, **moe_hf.ARCHITECTURES, **gpt_oss_hf.ARCHITECTURES}

# jaxpar ModelConfig field → the config.json key it comes from (for ModelConfig's errors)
KEYS = dict(vocab_size="vocab_size", d_model="hidden_size", n_layers="num_hidden_layers",
            n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", head_dim="head_dim",
            d_ff="intermediate_size", max_seq_len="max_position_embeddings", norm_eps="rms_norm_eps",
            sliding_window="sliding_window")


def read(keys, model_type: str) -> tuple[dict, dict]:
    """ModelConfig fields from a Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE config.json, and their key names."""
    act = keys.text("hidden_act", "silu")
    if act != "silu":
        raise keys.error(f"hidden_act = {act!r} is not supported; jaxpar's llama family uses SwiGLU (silu)")
    for key in ("mlp_bias", "attention_bias") if model_type == "llama" else ():
        if keys.flag(key, False):
            raise keys.error(f"{key} = true is not supported for LlamaForCausalLM (only Qwen2's q/k/v biases are)")
    if model_type == "phi3":  # partial RoPE (Phi-4-mini's 0.75) rotates only part of each head
        rope = keys.raw("rope_parameters", None)  # transformers >= 5 keeps it there, older files at the top
        partial = (rope if isinstance(rope, dict) and "partial_rotary_factor" in rope else keys.d).get(
            "partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise keys.bad("partial_rotary_factor", partial, "rotates only part of each head, and jaxpar's RoPE "
                           "rotates the whole head; import a Phi-3 checkpoint with partial_rotary_factor 1.0")
    if model_type in QWEN3 and keys.flag("attention_bias", False):
        raise keys.bad("attention_bias", True, "biases q, k, v and o_proj in Qwen3, and jaxpar's llama family has no "
                       "o_proj bias; import a checkpoint with attention_bias false (every released Qwen3)")
    n_heads, d_model = keys.integer("num_attention_heads"), keys.integer("hidden_size")
    n_layers = keys.integer("num_hidden_layers")
    if model_type == "gpt_oss":  # its attention, layer pattern, YaRN and experts: jaxpar/families/gpt_oss_hf.py
        own, names = gpt_oss_hf.read(keys, n_layers)
        names = {**KEYS, **names}
    else:
        own = dict(sliding_window=_sliding_window(keys, model_type, n_layers))
        rope, rope_names = rope_hf.read(keys, "llama")
        own.update(rope)
        names = {**KEYS, **rope_names}
    # Qwen2 always has q/k/v biases; Qwen2-MoE has them unless its qkv_bias key (transformers >= 5) says otherwise.
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and keys.flag("qkv_bias", True))
    fields = dict(family="llama", vocab_size=keys.integer("vocab_size"), d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=keys.integer("num_key_value_heads", n_heads),
                  # transformers' own default, floor division included
                  head_dim=keys.integer("head_dim", d_model // n_heads),
                  d_ff=keys.integer("intermediate_size"), max_seq_len=keys.integer("max_position_embeddings"),
                  norm_eps=keys.number("rms_norm_eps", 1e-6),
                  tie_embeddings=keys.flag("tie_word_embeddings", False), qkv_bias=qkv_bias,
                  qk_norm=model_type in QWEN3)
    fields.update(own)
    if model_type in moe_hf.ARCHITECTURES.values():
        fields["moe"], moe_names = moe_hf.read(keys, model_type)
        names.update(moe_names)
    return fields, names


def _sliding_window(keys, model_type: str, n_layers: int) -> int:
    """The sliding window (0: none). Mistral, Mixtral and Phi-3 window every layer when `sliding_window` is set,
    Qwen3-MoE when use_sliding_window. Qwen2 and Qwen3 window layer i when use_sliding_window and i >= max_window_layers
    (Qwen3's default 28), Qwen2-MoE (transformers 5's default) when use_sliding_window, i is even and
    i < max_window_layers — or, for these three, when config.json lists `layer_types`
    (transformers ≥ 4.53), the layers marked 'sliding_attention'; jaxpar supports all layers windowed or none."""
    def window() -> int:  # an absent key is transformers' default (MistralConfig, Qwen2Config: 4096); null is none
        return keys.integer("sliding_window", 0) if "sliding_window" in keys.d else 4096

    if model_type == "mistral":
        return window()
    if model_type in ("mixtral", "phi3"):  # MixtralConfig's and Phi3Config's default is None
        return keys.integer("sliding_window", 0)
    if model_type not in ("qwen2", "qwen2_moe", *QWEN3):
        return 0
    if not keys.flag("use_sliding_window", False):  # transformers then sets sliding_window to None
        return 0
    if model_type == "qwen3_moe":  # windows every layer (its config has no max_window_layers or layer_types)
        return window()
    layer_types = keys.raw("layer_types", None)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= {
                "full_attention", "sliding_attention"}:
            raise keys.bad("layer_types", layer_types, f"must list 'full_attention' or 'sliding_attention' for each "
                           f"of the num_hidden_layers = {n_layers} layers")
        windowed = [t == "sliding_attention" for t in layer_types]
    elif model_type in ("qwen2", "qwen3"):
        first = keys.integer("max_window_layers", 0 if model_type == "qwen2" else 28, minimum=0)
        windowed = [i >= first for i in range(n_layers)]
    else:
        last = keys.integer("max_window_layers", 28, minimum=0)  # Qwen2MoeConfig's default
        windowed = [i % 2 == 0 and i < last for i in range(n_layers)]
    if any(windowed) and not all(windowed):
        raise keys.error(f"a sliding window on layers {[i for i, w in enumerate(windowed) if w]} only "
                         "(layer_types / max_window_layers) is not supported; jaxpar windows all layers or none")
    return window() if all(windowed) else 0


def write(cfg, out: dict, base: dict | None) -> None:
    """config.json for cfg. Dense: Qwen3 for the q/k norm, Qwen2 for q/k/v biases, Mistral for a sliding window, else
    Llama (or the imported config's own dense architecture). MoE: Qwen3-MoE for the q/k norm, Mixtral where it holds
    the model, else Qwen2-MoE (`moe_hf.architecture`)."""
    if gpt_oss_hf.holds(cfg):
        arch, model_type = "GptOssForCausalLM", "gpt_oss"
    elif cfg.moe.enabled:
        arch, model_type = moe_hf.architecture(cfg, base)
    elif cfg.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    else:
        arch, model_type = ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else (
            ("MistralForCausalLM", "mistral") if cfg.sliding_window else ("LlamaForCausalLM", "llama"))
        if (base and base.get("architectures") and base["architectures"][0] not in moe_hf.ARCHITECTURES
                and not cfg.qk_norm):
            arch = base["architectures"][0]
            model_type = DENSE.get(arch, base.get("model_type"))
    out.update(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_ff,
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu")
    if model_type in ("mistral", "mixtral", "phi3"):
        out["sliding_window"] = cfg.sliding_window or None
    elif model_type in ("qwen2", "qwen2_moe", *QWEN3):
        out.update(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None)
        if cfg.sliding_window:  # Qwen2 / Qwen3 window layers i >= max_window_layers: 0 windows all of them
            # (Qwen2-MoE windows even layers below it by default, so its layer_types below say which)
            out["max_window_layers"] = 0 if model_type != "qwen2_moe" else cfg.n_layers
        if model_type in QWEN3:
            out["attention_bias"] = False
        if "layer_types" in out or model_type in ("qwen2_moe", "qwen3"):  # transformers >= 4.53 reads these first
            out["layer_types"] = [("sliding" if cfg.sliding_window else "full") + "_attention"] * cfg.n_layers
    if model_type == "gpt_oss":
        gpt_oss_hf.write(cfg, out)
        out.setdefault("rope_parameters", {})  # transformers >= 5's spelling, which GptOssConfig reads
    elif cfg.moe.enabled:
        moe_hf.write(cfg, out, model_type)
    rope_hf.write(cfg, out)


def exportable(cfg) -> None:
    """Llama, Mistral (window), Qwen2 (q/k/v biases, window) and Qwen3 (q/k norm, window) between them hold every
    dense llama option but q/k/v biases beside the q/k norm (Qwen3's attention_bias also biases o_proj); Mixtral,
    Qwen2-MoE and Qwen3-MoE not every MoE one (`moe_hf.exportable`)."""
    if gpt_oss_hf.holds(cfg):
        return gpt_oss_hf.exportable(cfg)
    for field, value, why in (("attention_sinks", cfg.attention_sinks, "attention sinks"),
                              ("o_bias", cfg.o_bias, "an o_proj bias"),
                              ("full_attention_every", cfg.full_attention_every, "full layers among windowed ones"),
                              ("local_rope_theta", cfg.local_rope_theta, "a local RoPE base")):
        if value:
            raise ConfigError(f"model.{field}", value, f"of the llama family's Hugging Face architectures only "
                              f"gpt-oss (sinks and experts) holds {why}", f"export a model trained with "
                              f"model.{field} off, or as gpt-oss (with experts and sinks)")
    if cfg.qk_norm and cfg.qkv_bias:
        raise ConfigError("model.qkv_bias", True, "Qwen3, the Hugging Face architecture with the q/k norm, biases "
                          "q, k, v and o_proj together (attention_bias) and jaxpar has no o_proj bias",
                          "export a model trained with model.qkv_bias=false")
    if cfg.moe.enabled:
        moe_hf.exportable(cfg)


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """The `model.layers.{l}.*` tensor table (torch Linear weights transposed, head dims split); Phi-3's fused
    qkv_proj and gate_up_proj where `names` (the tensors present, or an imported model's on export) hold them; an
    MoE layer's router and experts from `moe_hf.tensors` (`names` tells its fused layout). A mixed dense /
    MoE model has the attention rules once per layer stack (`blocks`: the MoE layers, `dense_blocks`: the dense
    ones), each naming its stack's model layers (`Rule.layers`), and the dense MLP rules on `dense_blocks`."""
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    lay = "model.layers.{l}."
    stacks = cfg.layer_stacks
    layers = {name: (ls if len(stacks) > 1 else None) for name, ls in stacks.items()}  # None: every layer, in order
    linear_in = lambda n: (lambda x: x.T.reshape(D, n, E), lambda x: x.reshape(D, -1).T)  # noqa: E731
    rules = [Rule("embed", "model.embed_tokens.weight", same, same),
             Rule("final_norm", "model.norm.weight", same, same)]
    # Phi-3 fuses q, k, v into qkv_proj [(H + 2K)·E, D] (rows: the queries, then the keys, then the values) and the
    # MLP's gate and up into gate_up_proj [2F, D] (gate first): one rule per part, sliced along the rows
    fused = names is not None and any(n.endswith(FUSED_QKV) for n in names)
    qkv = [dict(part=i, parts=3, sizes=(H * E, K * E, K * E), axis=0) if fused else {} for i in range(3)]
    for stack, ls in layers.items():
        rules += [Rule(f"{stack}.attn_norm", lay + "input_layernorm.weight", same, same, layers=ls),
                  Rule(f"{stack}.mlp_norm", lay + "post_attention_layernorm.weight", same, same, layers=ls)]
        rules += [Rule(f"{stack}.w{p}", lay + f"self_attn.{'qkv' if fused else p}_proj.weight", *linear_in(n),
                       layers=ls, **split) for p, n, split in zip("qkv", (H, K, K), qkv)]
        rules.append(Rule(f"{stack}.wo", lay + "self_attn.o_proj.weight", lambda x: x.T.reshape(H, E, D),
                          lambda x: x.reshape(-1, D).T, layers=ls))
    if gpt_oss_hf.holds(cfg):
        rules += gpt_oss_hf.tensors(cfg)
    elif cfg.moe.enabled:
        rules += moe_hf.tensors(cfg, names)
    dense = "dense_blocks" if cfg.moe.enabled else "blocks"  # the stack of dense layers (none: an all-MoE model)
    if dense in stacks and fused:
        F = cfg.d_ff
        rules += [Rule(f"{dense}.w_{p}", lay + "mlp.gate_up_proj.weight", lambda x: x.T, lambda x: x.T,
                       layers=layers[dense], part=i, parts=2, sizes=(F, F), axis=0)
                  for i, p in enumerate(("gate", "up"))]
        rules.append(Rule(f"{dense}.w_down", lay + "mlp.down_proj.weight", lambda x: x.T, lambda x: x.T,
                          layers=layers[dense]))
    elif dense in stacks:
        rules += [Rule(f"{dense}.w_{p}", lay + f"mlp.{p}_proj.weight", lambda x: x.T, lambda x: x.T,
                       layers=layers[dense]) for p in ("gate", "up", "down")]
    if cfg.qk_norm:
        rules += [Rule(f"{stack}.{n}_norm", lay + f"self_attn.{n}_norm.weight", same, same, layers=ls)
                  for stack, ls in layers.items() for n in ("q", "k")]
    if cfg.qkv_bias:
        rules += [Rule(f"{stack}.{b}", lay + f"self_attn.{p}_proj.bias", lambda x, n=n: x.reshape(n, E),
                       lambda x: x.reshape(-1), layers=ls)
                  for stack, ls in layers.items() for b, p, n in (("bq", "q", H), ("bk", "k", K), ("bv", "v", K))]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", lambda x: x.T, lambda x: x.T))
    return rules


FAMILY = Family(name="llama", summary="RMSNorm, RoPE, SwiGLU, GQA (Llama, Mistral, Qwen2, Qwen3)", norm="rms",
                positions="rope", mlp="swiglu", layer_params=layer_params, default_d_ff=swiglu_d_ff, check=check,
                hf=HuggingFace(ARCHITECTURES, read, write, exportable, tensors), attention=GQA.name)
