"""The GPT-2 family.

A layer: x + attention(LayerNorm(x)), then + MLP(LayerNorm(x)) with the tanh GELU ("gelu_new"). Positions are a
learned table added to the token embedding; every projection and norm has a bias.

    model       pos_embed [P, D] (P = max_seq_len); final_norm_b [D]
    per layer   attn_norm, attn_norm_b [D]; wq [D, H, E]; wk, wv [D, K, E]; wo [H, E, D]; mlp_norm, mlp_norm_b [D];
                w_up [D, F]; w_down [F, D]; bq [H, E]; bk, bv [K, E]; bo [D]; b_up [F]; b_down [D]

Hugging Face: GPT2LMHeadModel, `transformer.h.{l}.*` (or `h.{l}.*` in files saved from the bare GPT2Model). GPT-2
uses Conv1D, whose weights are [in, out] (no transpose), with q, k, v fused in one `c_attn` tensor.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families.attention import GQA, attention_params, qkv_bias_params
from jaxpar.families.base import Family, HuggingFace, Param, Rule, same


def layer_params(cfg, moe: bool = False) -> dict[str, Param]:
    """GPT-2's layer: the shared attention with LayerNorms (scale and bias), a GELU MLP, biases everywhere."""
    D, F = cfg.d_model, cfg.d_ff
    params = attention_params(cfg, GQA, norm_bias=True)
    params.update(w_up=Param((D, F), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
                  w_down=Param((F, D), ("mlp", "embed"), "out", contract=(0,), role="mlp"))
    params.update(qkv_bias_params(cfg))
    params.update(bo=Param((D,), ("embed",), "zeros", decay=False), b_up=Param((F,), ("mlp",), "zeros", decay=False),
                  b_down=Param((D,), ("embed",), "zeros", decay=False))
    return params


def default_d_ff(d_model: int) -> int:
    """GPT-2's MLP is 4·d_model wide."""
    return 4 * d_model


def check(cfg) -> None:
    """Every option of ModelConfig runs on GPT-2's layers (export is stricter: `exportable`)."""


# -----------------------------------------------------------------------------------------------------------------
# Hugging Face

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2"}

# jaxpar ModelConfig field → the config.json key it comes from (for ModelConfig's errors)
KEYS = dict(vocab_size="vocab_size", d_model="n_embd", n_layers="n_layer", n_heads="n_head", d_ff="n_inner",
            max_seq_len="n_positions", norm_eps="layer_norm_epsilon")


def read(keys, model_type: str) -> tuple[dict, dict]:
    """ModelConfig fields from a GPT2LMHeadModel config.json, and their key names."""
    act = keys.text("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise keys.error(f"activation_function = {act!r} is not supported; jaxpar's GPT-2 uses the tanh GELU "
                         "('gelu_new')")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if keys.flag(key, False):
            raise keys.error(f"{key} = true is not supported (jaxpar's GPT-2 attention is the standard one)")
    if not keys.flag("scale_attn_weights", True):
        raise keys.error("scale_attn_weights = false is not supported (jaxpar's attention always scales by "
                         "head_dim ** -0.5)")
    d_model, n_heads = keys.integer("n_embd"), keys.integer("n_head")
    if d_model % n_heads:  # GPT2Attention's own rule: heads split n_embd evenly (there is no head_dim key)
        raise keys.bad("n_head", n_heads, f"must divide n_embd = {d_model}")
    fields = dict(family="gpt2", vocab_size=keys.integer("vocab_size"), d_model=d_model,
                  n_layers=keys.integer("n_layer"), n_heads=n_heads, d_ff=keys.integer("n_inner", 4 * d_model),
                  max_seq_len=keys.integer("n_positions"), norm_eps=keys.number("layer_norm_epsilon", 1e-5),
                  tie_embeddings=keys.flag("tie_word_embeddings", True))
    return fields, KEYS


def write(cfg, out: dict, base: dict | None) -> None:
    """config.json for cfg as a GPT2LMHeadModel."""
    out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size, n_embd=cfg.d_model,
               n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff, n_positions=cfg.max_seq_len,
               n_ctx=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
               tie_word_embeddings=cfg.tie_embeddings)


def exportable(cfg) -> None:
    """GPT-2 has no GQA, no head_dim key and no sliding window: refuse a cfg that uses one."""
    why = "GPT2LMHeadModel cannot express it"
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError("model.n_kv_heads", cfg.n_kv_heads, f"must equal model.n_heads = {cfg.n_heads} to export "
                          f"as GPT-2 ({why}: c_attn holds q, k, v of n_embd columns each)",
                          "train gpt2 without grouped-query attention, or use the llama family")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise ConfigError("model.head_dim", cfg.head_dim, f"must be d_model / n_heads = {cfg.d_model / cfg.n_heads:g}"
                          f" to export as GPT-2 ({why}: there is no head_dim key)", "leave model.head_dim = 0")
    if cfg.sliding_window:
        raise ConfigError("model.sliding_window", cfg.sliding_window, f"must be 0 to export as GPT-2 ({why}: GPT-2 "
                          "attends to every earlier position)", "use the llama family (exports as Mistral)")


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """`names` (the tensors present) picks the prefix: 'transformer.' (GPT2LMHeadModel) or none (GPT2Model)."""
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pre = "transformer." if names is None or "transformer.wte.weight" in names else ""
    h = pre + "h.{l}."
    rules = [Rule("embed", pre + "wte.weight", same, same), Rule("pos_embed", pre + "wpe.weight", same, same),
             Rule("final_norm", pre + "ln_f.weight", same, same),
             Rule("final_norm_b", pre + "ln_f.bias", same, same),
             Rule("blocks.attn_norm", h + "ln_1.weight", same, same),
             Rule("blocks.attn_norm_b", h + "ln_1.bias", same, same),
             Rule("blocks.mlp_norm", h + "ln_2.weight", same, same),
             Rule("blocks.mlp_norm_b", h + "ln_2.bias", same, same)]
    for i, (w, b, n) in enumerate((("wq", "bq", H), ("wk", "bk", K), ("wv", "bv", K))):
        rules.append(Rule(f"blocks.{w}", h + "attn.c_attn.weight", lambda x, n=n: x.reshape(D, n, E),
                          lambda x: x.reshape(D, -1), part=i, parts=3))
        rules.append(Rule(f"blocks.{b}", h + "attn.c_attn.bias", lambda x, n=n: x.reshape(n, E),
                          lambda x: x.reshape(-1), part=i, parts=3))
    rules += [Rule("blocks.wo", h + "attn.c_proj.weight", lambda x: x.reshape(H, E, D), lambda x: x.reshape(-1, D)),
              Rule("blocks.bo", h + "attn.c_proj.bias", same, same),
              Rule("blocks.w_up", h + "mlp.c_fc.weight", same, same),
              Rule("blocks.b_up", h + "mlp.c_fc.bias", same, same),
              Rule("blocks.w_down", h + "mlp.c_proj.weight", same, same),
              Rule("blocks.b_down", h + "mlp.c_proj.bias", same, same)]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", lambda x: x.T, lambda x: x.T))
    return rules


FAMILY = Family(name="gpt2", summary="LayerNorm, learned positions, GELU, biases (GPT-2)", norm="layer",
                positions="learned", mlp="gelu", layer_params=layer_params, default_d_ff=default_d_ff, check=check,
                hf=HuggingFace(ARCHITECTURES, read, write, exportable, tensors), attention=GQA.name)
