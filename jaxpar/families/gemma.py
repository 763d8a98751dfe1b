"""The Gemma family — Gemma 3's text model (Gemma3ForCausalLM: the 1B checkpoint, and the language model of the
larger ones once taken out of their multimodal wrapper).

A layer normalises before *and* after each half: x + RMSNorm'(attention(RMSNorm(x))), then
x + RMSNorm'(GeGLU(RMSNorm(x))). Every RMSNorm multiplies by 1 + w (its scale is born zero), including the q/k norm
over each head and the final norm. The token embedding is multiplied by √d_model; the MLP is gated with the tanh GELU;
the scores are scaled by 1/√query_pre_attn_scalar. Layers come in two kinds (HF `layer_types`): sliding-window layers
with a local RoPE base (10 000), and every `full_attention_every`-th layer (6 in the released models) over the whole
causal past with the global base (1 000 000) and its scaling — jaxpar's `model.sliding_window`,
`model.full_attention_every`, `model.local_rope_theta` and `model.rope_*`.

    per layer   attn_norm [D]; wq [D, H, E]; wk, wv [D, K, E]; wo [H, E, D]; q_norm, k_norm [E];
                post_attn_norm [D]; mlp_norm [D]; post_mlp_norm [D]; w_gate, w_up [D, F]; w_down [F, D]

Hugging Face: `model.layers.{l}.*` of Gemma3ForCausalLM (model_type gemma3_text): input_layernorm,
post_attention_layernorm (after attention, *not* before the MLP as in Llama), pre_feedforward_layernorm,
post_feedforward_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj; the norms'
weights are the w of 1 + w, stored as they are.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families.attention import GQA
from jaxpar.families.base import Family, HuggingFace, Param, Rule, same, swiglu_d_ff


def layer_params(cfg, moe: bool = False) -> dict[str, Param]:
    """Gemma's layer: pre- and post-norms around attention and the GeGLU MLP (every scale born zero: 1 + w), the q/k
    norm with qk_norm (always, in Gemma 3)."""
    D, F, E = cfg.d_model, cfg.d_ff, cfg.head_dim
    scale = lambda n: Param((n,), ("norm",) if n == D else ("head_dim",), "zeros", decay=False)  # noqa: E731
    params = {"attn_norm": scale(D), **GQA.params(cfg)}
    if cfg.qk_norm:
        params.update(q_norm=scale(E), k_norm=scale(E))
    params.update(post_attn_norm=scale(D), mlp_norm=scale(D), post_mlp_norm=scale(D),
                  w_gate=Param((D, F), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
                  w_up=Param((D, F), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
                  w_down=Param((F, D), ("mlp", "embed"), "out", contract=(0,), role="mlp"))
    return params


def check(cfg) -> None:
    """RoPE rotates dims in pairs; Gemma's layers have no biases, sinks or experts."""
    if cfg.head_dim % 2:
        raise ConfigError("model.head_dim", cfg.head_dim, "must be even for RoPE (dims rotate in pairs)",
                          f"use head_dim {cfg.head_dim + 1}")
    for name in ("qkv_bias", "attention_sinks"):
        if getattr(cfg, name):
            raise ConfigError(f"model.{name}", True, "the gemma family's layers have no q/k/v biases or sinks",
                              f"set model.{name}=false, or use model.family=llama")


# -----------------------------------------------------------------------------------------------------------------
# Hugging Face

ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text"}
KINDS = ("full_attention", "sliding_attention")
# jaxpar ModelConfig field → the config.json key it comes from (for ModelConfig's errors)
KEYS = dict(vocab_size="vocab_size", d_model="hidden_size", n_layers="num_hidden_layers",
            n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", head_dim="head_dim",
            d_ff="intermediate_size", max_seq_len="max_position_embeddings", norm_eps="rms_norm_eps",
            sliding_window="sliding_window", full_attention_every="layer_types",
            query_pre_attn_scalar="query_pre_attn_scalar")


def read(keys, model_type: str) -> tuple[dict, dict]:
    """ModelConfig fields from a Gemma3ForCausalLM config.json (transformers 5's `rope_parameters` per layer kind, or
    the older top-level rope_theta, rope_local_base_freq and rope_scaling), and their key names."""
    act = keys.text("hidden_activation", keys.text("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise keys.bad("hidden_activation", act, "jaxpar's gemma family gates its MLP with the tanh GELU "
                       "('gelu_pytorch_tanh', every released Gemma 3)")
    for key, why in (("attention_bias", "biases q, k, v and o_proj"),
                     ("use_bidirectional_attention", "makes attention bidirectional (an encoder)")):
        if keys.flag(key, False):
            raise keys.bad(key, True, f"{why}, which jaxpar's gemma family does not; every released Gemma 3 "
                           "causal LM has it false")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if keys.raw(key, None) is not None:
            raise keys.bad(key, keys.raw(key), "soft-caps logits with tanh (Gemma 2), which jaxpar does not "
                           "implement; Gemma 3 leaves it null")
    n_heads, d_model = keys.integer("num_attention_heads"), keys.integer("hidden_size")
    n_layers = keys.integer("num_hidden_layers")
    windowed = _windowed_layers(keys, n_layers)
    window = keys.integer("sliding_window", 4096) if any(windowed) else 0
    every = 0 if all(windowed) or not any(windowed) else _every(keys, windowed)
    rope, names = _rope_fields(keys, window)
    fields = dict(family="gemma", vocab_size=keys.integer("vocab_size"), d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, n_kv_heads=keys.integer("num_key_value_heads", n_heads),
                  head_dim=keys.integer("head_dim", 256), d_ff=keys.integer("intermediate_size"),
                  max_seq_len=keys.integer("max_position_embeddings", 131072),
                  norm_eps=keys.number("rms_norm_eps", 1e-6), tie_embeddings=keys.flag("tie_word_embeddings", True),
                  qk_norm=True, query_pre_attn_scalar=keys.number("query_pre_attn_scalar", 256.0),
                  sliding_window=window, full_attention_every=every, **rope)
    return fields, names


def _windowed_layers(keys, n_layers: int) -> list[bool]:
    """Per layer, whether it is a sliding-window layer: config.json's `layer_types`, or (older files) every layer but
    each `sliding_window_pattern`-th (transformers' default pattern 6); a null sliding_window windows none."""
    if keys.raw("sliding_window", None) is None and "sliding_window" in keys.d:
        return [False] * n_layers
    types = keys.raw("layer_types", None)
    if types is None:
        pattern = keys.integer("sliding_window_pattern", 6)
        return [(i + 1) % pattern != 0 for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(KINDS):
        raise keys.bad("layer_types", types, f"must list 'full_attention' or 'sliding_attention' for each of the "
                       f"num_hidden_layers = {n_layers} layers")
    return [t == "sliding_attention" for t in types]


def _every(keys, windowed: list[bool]) -> int:
    """The k for which exactly the layers i with (i + 1) % k == 0 are full (jaxpar's full_attention_every), or an
    HFError naming layer_types."""
    full = [i for i, w in enumerate(windowed) if not w]
    k = full[0] + 1
    if windowed != [(i + 1) % k != 0 for i in range(len(windowed))]:
        raise keys.error(f"layer_types: full attention on layers {full} is not every k-th layer; jaxpar runs full "
                         "layers at (i + 1) % k == 0 (model.full_attention_every: Gemma 3's 6)")
    return k


def _rope_fields(keys, window: int) -> tuple[dict, dict]:
    """(ModelConfig RoPE fields, their config.json key names): the full layers' RoPE (default or linear scaling)
    and the sliding layers' base, which must be unscaled."""
    nested = keys.raw("rope_parameters", None)
    if nested is not None:
        section = keys.section("rope_parameters")
        full, local = section.section("full_attention"), section.section("sliding_attention")
        local_theta = local.number("rope_theta", 10000.0)
        local_kind = local.text("rope_type", "default")
        local_name = local.prefix + "rope_theta"
    else:
        full = keys.section("rope_scaling")
        local_theta, local_kind, local_name = keys.number("rope_local_base_freq", 10000.0), "default", \
            "rope_local_base_freq"
    theta_from = full if nested is not None else keys
    fields = dict(rope_theta=theta_from.number("rope_theta", 1_000_000.0))
    names = dict(KEYS, rope_theta=theta_from.prefix + "rope_theta", local_rope_theta=local_name,
                 rope_factor=full.prefix + "factor")
    kind = full.text("rope_type", full.text("type", "default"))
    if kind == "linear":
        fields.update(rope_scaling="linear", rope_factor=full.number("factor"))
    elif kind != "default":
        raise keys.error(f"{full.prefix}rope_type = {kind!r} is not supported for Gemma 3; jaxpar implements "
                         "'default' and 'linear' for its full layers")
    if local_kind != "default":
        raise keys.error(f"rope_parameters.sliding_attention.rope_type = {local_kind!r}: jaxpar's sliding layers "
                         "take an unscaled RoPE ('default')")
    if window:
        fields["local_rope_theta"] = local_theta
    return fields, names


def write(cfg, out: dict, base: dict | None) -> None:
    """config.json for cfg as Gemma3ForCausalLM, its layer kinds spelled out (`layer_types`) and the RoPE of each
    (transformers ≥ 5's `rope_parameters`, or the older top-level keys where the imported file had them)."""
    windows, scalar = cfg.layer_windows, cfg.query_pre_attn_scalar or cfg.head_dim
    out.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=cfg.vocab_size,
               hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_ff,
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, hidden_activation="gelu_pytorch_tanh",
               # an int where it is one: Gemma3TextConfig types the key int and refuses 32.0
               query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar, attention_bias=False,
               final_logit_softcapping=None, attn_logit_softcapping=None,
               sliding_window=cfg.sliding_window or None,
               layer_types=["sliding_attention" if w else "full_attention" for w in windows])
    out.pop("sliding_window_pattern", None)
    full = {"rope_type": "default"} if cfg.rope_scaling == "none" else {"rope_type": "linear",
                                                                        "factor": cfg.rope_factor}
    # windowed layers: their own unscaled base, or (local_rope_theta 0) the full layers' RoPE itself
    local = ({"rope_type": "default", "rope_theta": cfg.local_rope_theta} if cfg.local_rope_theta else
             {**full, "rope_theta": cfg.rope_theta})
    if base is not None and "rope_local_base_freq" in base and "rope_parameters" not in base:
        out.update(rope_theta=cfg.rope_theta, rope_local_base_freq=local["rope_theta"],
                   rope_scaling=None if full["rope_type"] == "default" else full)
    else:
        for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
            out.pop(key, None)
        out["rope_parameters"] = {"full_attention": {**full, "rope_theta": cfg.rope_theta},
                                  "sliding_attention": local}


def exportable(cfg) -> None:
    """Gemma3ForCausalLM always has the q/k norm; its sliding layers' RoPE is unscaled unless it is the full
    layers' own (local_rope_theta 0)."""
    if not cfg.qk_norm:
        raise ConfigError("model.qk_norm", False, "Gemma3ForCausalLM always normalises q and k",
                          "export a model trained with model.qk_norm=true")
    if cfg.rope_scaling not in ("none", "linear"):
        raise ConfigError("model.rope_scaling", cfg.rope_scaling, "Gemma 3's config holds default or linear RoPE "
                          "for jaxpar to write", "export a model with rope_scaling none or linear")


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """The `model.layers.{l}.*` tensor table (torch Linear weights transposed, head dims split)."""
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    lay = "model.layers.{l}."
    linear_in = lambda n: (lambda x: x.T.reshape(D, n, E), lambda x: x.reshape(D, -1).T)  # noqa: E731
    norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
    rules = [Rule("embed", "model.embed_tokens.weight", same, same),
             Rule("final_norm", "model.norm.weight", same, same)]
    rules += [Rule(f"blocks.{p}", lay + f"{hf}.weight", same, same) for p, hf in norms.items()]
    rules += [Rule(f"blocks.w{p}", lay + f"self_attn.{p}_proj.weight", *linear_in(n))
              for p, n in zip("qkv", (H, K, K))]
    rules.append(Rule("blocks.wo", lay + "self_attn.o_proj.weight", lambda x: x.T.reshape(H, E, D),
                      lambda x: x.reshape(-1, D).T))
    if cfg.qk_norm:
        rules += [Rule(f"blocks.{n}_norm", lay + f"self_attn.{n}_norm.weight", same, same) for n in ("q", "k")]
    rules += [Rule(f"blocks.w_{p}", lay + f"mlp.{p}_proj.weight", lambda x: x.T, lambda x: x.T)
              for p in ("gate", "up", "down")]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", lambda x: x.T, lambda x: x.T))
    return rules


FAMILY = Family(name="gemma", summary="Gemma 3: RMSNorm (1 + w) before and after attention and MLP, √d embeddings, "
                "GeGLU, the q/k norm, local and global layers", norm="rms_offset", positions="rope", mlp="geglu",
                layer_params=layer_params, default_d_ff=swiglu_d_ff, check=check,
                hf=HuggingFace(ARCHITECTURES, read, write, exportable, tensors), attention=GQA.name,
                embed_scale=True)
