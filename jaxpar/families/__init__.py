"""Model families as data: one file per family (its layer recipe, parameters, config rules and Hugging Face
mapping), registered here. The contract is `jaxpar.families.base.Family`."""

from __future__ import annotations

from jaxpar.families import gpt2, llama
from jaxpar.families.base import Family, Param, Rule

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, gpt2.FAMILY)}


def family(cfg) -> Family:
    """The Family of a ModelConfig (its `family` field is validated against FAMILIES)."""
    return FAMILIES[cfg.family]


__all__ = ["FAMILIES", "Family", "Param", "Rule", "family"]
