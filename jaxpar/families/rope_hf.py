"""config.json's RoPE keys ⇄ ModelConfig's `rope_*` fields, for every family that reads them (llama with gpt-oss,
deepseek; Gemma 3's per-layer-kind sections are its own, jaxpar/families/gemma.py).

RoPE settings come in two spellings: transformers ≥ 5 nests them as `rope_parameters` (rope_theta inside);
older versions have a top-level `rope_theta` and `rope_scaling`, whose kind is `rope_type` (or `type` in the
oldest files and in DeepSeek's own configs).

    kind       config.json (inside rope_parameters / rope_scaling)        jaxpar
    default    —                                                          rope_scaling 'none'
    linear     factor                                                     rope_factor
    llama3     factor, low_freq_factor, high_freq_factor,                 rope_factor, rope_low_freq_factor,
               original_max_position_embeddings                           rope_high_freq_factor, rope_original_max_len
    yarn       factor, original_max_position_embeddings, beta_fast,       rope_factor, rope_original_max_len,
               beta_slow, mscale, mscale_all_dim, truncate                rope_beta_fast, rope_beta_slow, rope_mscale,
                                                                          rope_mscale_all_dim, rope_truncate
"""

from __future__ import annotations

from typing import Any

# config.json key (inside the RoPE section) → ModelConfig field, per kind
_KEYS = {"linear": {"factor": "rope_factor"},
         "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                    "high_freq_factor": "rope_high_freq_factor",
                    "original_max_position_embeddings": "rope_original_max_len"},
         "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_len",
                  "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
                  "mscale_all_dim": "rope_mscale_all_dim", "truncate": "rope_truncate"}}


def read(keys, family: str, *, yarn: bool = False) -> tuple[dict, dict]:
    """(ModelConfig RoPE fields, the config.json key each comes from). `yarn` admits YaRN (DeepSeek, gpt-oss);
    any other kind (dynamic NTK, LongRoPE) is refused naming the key and `family`."""
    nested = keys.raw("rope_parameters", None) is not None
    section = keys.section("rope_parameters" if nested else "rope_scaling")
    theta_from = section if nested and section.raw("rope_theta", None) is not None else keys
    kind = section.text("rope_type", section.text("type", "default"))
    names = {"rope_theta": theta_from.prefix + "rope_theta",
             **{field: section.prefix + key for k in _KEYS.values() for key, field in k.items()}}
    fields: dict[str, Any] = dict(rope_theta=theta_from.number("rope_theta", 10000.0))
    if kind == "default":
        return fields, names
    known = ("yarn", "linear", "llama3") if yarn else ("linear", "llama3")
    if kind not in known:
        listing = ", ".join(map(repr, known[:-1])) + f" and {known[-1]!r}"
        missing = "dynamic NTK and LongRoPE" if yarn else "dynamic NTK, YaRN and LongRoPE"
        raise keys.error(f"{section.prefix}rope_type = {kind!r} is not supported; jaxpar's {family} family "
                         f"implements {listing} ({missing} are not implemented)")
    section.needed_by = f"{kind} RoPE scaling"
    if kind == "linear":
        return dict(fields, rope_scaling="linear", rope_factor=section.number("factor")), names
    if kind == "llama3":
        return dict(fields, rope_scaling="llama3", rope_factor=section.number("factor"),
                    rope_low_freq_factor=section.number("low_freq_factor"),
                    rope_high_freq_factor=section.number("high_freq_factor"),
                    rope_original_max_len=section.integer("original_max_position_embeddings")), names
    return dict(fields, **_yarn(keys, section)), names


def _yarn(keys, section) -> dict:
    """YaRN's fields. transformers reads `beta_fast or 32`, `beta_slow or 1` (a 0 is the default), `factor`
    defaulting to max_position_embeddings / original, and counts mscale only beside mscale_all_dim."""
    for key, unsupported in (("attention_factor", "an explicit cos/sin factor"),
                             ("partial_rotary_factor", "rotary on part of the rope dims")):
        if section.raw(key, None) is not None:
            raise keys.error(f"{section.prefix}{key} ({unsupported}) is not supported with YaRN; jaxpar derives the "
                             "factor from mscale / mscale_all_dim and rotates every rope dim")
    original = section.integer("original_max_position_embeddings")
    factor = section.number("factor", keys.integer("max_position_embeddings") / original)
    mscale, all_dim = section.number("mscale", 0.0), section.number("mscale_all_dim", 0.0)
    if all_dim and not mscale:
        raise keys.error(f"{section.prefix}mscale_all_dim = {all_dim} without mscale: transformers then scales cos/sin "
                         "by 0.1·ln(factor) + 1, ignoring mscale_all_dim, which jaxpar's YaRN (get_mscale(factor, "
                         "mscale) / get_mscale(factor, mscale_all_dim)) cannot express; set mscale (DeepSeek's "
                         "configs use mscale = mscale_all_dim)")
    return dict(rope_scaling="yarn", rope_factor=factor, rope_original_max_len=original,
                rope_beta_fast=section.number("beta_fast", 32.0) or 32.0,
                rope_beta_slow=section.number("beta_slow", 1.0) or 1.0,
                rope_mscale=mscale if all_dim else 1.0, rope_mscale_all_dim=all_dim,
                rope_truncate=section.flag("truncate", True))  # false: the ramp's ends unrounded (gpt-oss)


def write(cfg, out: dict, *, legacy_type: bool = False) -> None:
    """config.json's RoPE keys for cfg in the spelling `out` has: transformers ≥ 5's `rope_parameters` (rope_theta
    inside) where `out` holds it, else top-level `rope_theta` + `rope_scaling` (null for none; with `legacy_type`
    the kind also as `type`, which DeepSeek's own code reads). The inverse of `read`."""
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling in _KEYS:
        rope = {"rope_type": cfg.rope_scaling,
                **{key: getattr(cfg, field) for key, field in _KEYS[cfg.rope_scaling].items() if key != "truncate"}}
        if cfg.rope_scaling == "yarn" and not cfg.rope_truncate:
            rope["truncate"] = False
    if "rope_parameters" in out:  # transformers >= 5
        out["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}
    else:
        out["rope_theta"] = cfg.rope_theta
        out["rope_scaling"] = (None if rope["rope_type"] == "default" else
                               {**rope, "type": rope["rope_type"]} if legacy_type else rope)
