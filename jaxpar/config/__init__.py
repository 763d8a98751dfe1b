"""Typed, frozen, validated configuration.

Every run is described by one `Config`: five frozen dataclasses (`ModelConfig`, `ParallelConfig`, `TrainConfig`,
`DataConfig`, `CheckpointConfig`). They are built from an ml_collections file (`configs/*.py` with `get_config()`),
a YAML recipe (`recipes/*.yaml`, optionally naming a `base:` file), and `a.b=v` overrides, always through
`config_from_dict`, so every source gets the same checks.

All validation lives in this package. Checks that need only the config run on construction (`__post_init__`);
checks that need the device count (mesh product, batch divisibility once `data=-1` is filled) run in
`resolve_for_devices`. Both raise `ConfigError` naming the field, the value, the rule and a fix, before anything is traced or compiled.

The package, by concern:

    schema.py      the dataclasses, their fields' defaults and help, and their checks
    checks.py      the small checks the sections share (types, unknown keys, positive values, choices)
    load.py        files, dicts and overrides → Config (YAML recipes bounded, a `.py` base held to its tree)
    reference.py   the Markdown reference the README embeds
"""

from jaxpar.config.load import MAX_YAML_NODES, config_from_dict, load_config
from jaxpar.config.reference import reference_markdown
from jaxpar.config.schema import (ATTENTION_IMPLS, AUTO_KEEPS, CONTEXT_IMPLS, DEFAULT_GROUP, DTYPES, OVERLAPS, PLANNED,
                                  REMAT_POLICIES, ROPE_SCALINGS, SECTIONS, SOURCES, WEIGHT_FORMATS, CheckpointConfig,
                                  Config, DataConfig, LoRAConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig,
                                  check_layout, resolve_attention)
from jaxpar.errors import ConfigError

__all__ = ["ATTENTION_IMPLS", "AUTO_KEEPS", "CONTEXT_IMPLS", "DEFAULT_GROUP", "DTYPES", "MAX_YAML_NODES", "OVERLAPS",
           "PLANNED", "REMAT_POLICIES", "ROPE_SCALINGS", "SECTIONS", "SOURCES", "WEIGHT_FORMATS", "CheckpointConfig",
           "Config", "ConfigError", "DataConfig", "LoRAConfig", "ModelConfig", "MoEConfig", "ParallelConfig", "TrainConfig",
           "check_layout", "config_from_dict", "load_config", "reference_markdown", "resolve_attention"]
