"""Model families as data: one file per family (its layer recipe, parameters, config rules and Hugging Face
mapping), registered here. The contract is `jaxpar.families.base.Family`."""

from __future__ import annotations

from jaxpar.families import deepseek, gemma, gpt2, llama
from jaxpar.families.attention import ATTENTION_KINDS
from jaxpar.families.base import AttentionKind, CacheArray, Family, Param, Rule

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, gpt2.FAMILY, deepseek.FAMILY, gemma.FAMILY)}


def family(cfg) -> Family:
    """The Family of a ModelConfig (its `family` field is validated against FAMILIES)."""
    return FAMILIES[cfg.family]


def attention_kind(cfg) -> AttentionKind:
    """The attention kind of a ModelConfig's family (`Family.attention`)."""
    return ATTENTION_KINDS[family(cfg).attention]


__all__ = ["ATTENTION_KINDS", "AttentionKind", "CacheArray", "FAMILIES", "Family", "Param", "Rule", "attention_kind",
           "family"]
