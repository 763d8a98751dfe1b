"""Hugging Face checkpoints ⇄ jaxpar: Llama, Mistral, Qwen2, GPT-2, Mixtral, Qwen2-MoE and DeepSeek-V2 / V3
directories in, the same format out.

A Hugging Face model directory holds `config.json`, the weights as `model.safetensors` or as shards listed by
`model.safetensors.index.json`, and usually `tokenizer.json`. Only those JSON and safetensors files are read —
never a pickle (`*.bin`, `*.pt`): loading one can run arbitrary code.

The mapping is one table per family, kept in the family's file (jaxpar/families/): each jaxpar parameter names the Hugging Face tensor it comes from
and the reshape between the two layouts, e.g.

    jaxpar blocks.wq [L, D, H, E]  ←  model.layers.{l}.self_attn.q_proj.weight [H·E, D]   (torch Linear: [out, in])
    jaxpar blocks.wq [L, D, H, E]  ←  transformer.h.{l}.attn.c_attn.weight[:, 0:D] [D, H·E] (GPT-2 Conv1D: [in, out],
                                      q, k, v fused on the last axis)

Import places every parameter straight onto its mesh layout with `jax.make_array_from_callback`: each device's
shard is cut from the per-layer tensors it covers, read one at a time from the memory-mapped files, so host memory
peaks at about one parameter's local shard, never the model. Layer order (pipeline) and vocab padding (tensor
parallelism) are applied on the way in, exactly as checkpoints are (`jaxpar.store.checkpoint`). Export is the
inverse and writes safetensors shards of at most `max_shard_bytes` plus the index, so `transformers` (or jaxpar)
loads the result with `from_pretrained`.

Mixture of experts (Mixtral, Qwen2-MoE; the names in jaxpar/families/moe_hf.py). Hugging Face stores one tensor
per layer and expert, jaxpar one array [L, X, …] per parameter, so an expert parameter's rule is an `ExpertRule`
whose name holds both placeholders and whose to_jax / to_hf convert one expert:

    jaxpar blocks.we_gate [L, X, D, F]  ←  model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight [F, D]

A device's shard of an expert parameter (experts split over the mesh axis `expert`, F over `tensor`) is assembled
from the (layer, expert) tensors it covers only — a rank of expert 4 reads a quarter of the expert tensors. The
fused layout transformers 5 can also save (`experts.gate_up_proj` [X, 2F, D]) is read through safetensors slices, one
expert at a time, so the same holds for it; export writes the per-expert hub layout.

Mixed dense / MoE stacks (Qwen2-MoE's decoder_sparse_step, mlp_only_layers) keep two stacks of layers, `blocks` (the
MoE layers) and `dense_blocks`; each stacked rule names the model layer of every entry of its stack (`Rule.layers`),
so entry i of `dense_blocks.wq` is `model.layers.{layers[i]}.self_attn.q_proj.weight`. Under a pipeline each stack
is stored in its own order (`Plan.stack_order(n)`, n the stack's length).

Model state that is not a parameter (a `jaxpar.model.Buffer`) travels where the format has a tensor for it: a rule
naming the buffer's path (DeepSeek-V3's `blocks.e_score_correction_bias` ⇄ `mlp.gate.e_score_correction_bias`) reads
and writes it like a parameter (kept float32 on export); a buffer no rule names (expert_load) starts at its initial
value on import and is not exported.

Reading and writing the safetensors files themselves — which files of a directory may be read (every one
must resolve inside it), which weight dtypes are accepted, the index and the shards — is
`jaxpar.interop.safetensors_files`.

Every problem — a missing or non-directory path, a damaged file, a config.json key that is missing, of the wrong
type or out of range, a missing tensor, a shape or dtype mismatch, an unsupported architecture or option — is an
`HFError` (a `JaxparError`: the CLI prints it as one line and exits 2) naming the file and, where there is one, the
tensor or config key. Export refuses, as a ConfigError, a jaxpar model that the target architecture cannot express
(a GPT-2 with grouped-query attention or a sliding window).
"""

from __future__ import annotations

import dataclasses
import json
import os
import math
import pathlib
import re
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.config import Config, ConfigError, DataConfig, ModelConfig
from jaxpar.families import FAMILIES, Rule, family
from jaxpar.families.moe_hf import FUSED, ExpertRule, ZeroRule
from jaxpar.interop.safetensors_files import (INDEX, SINGLE, HFError, SafetensorsDir, check_members, inside, member,
                                             model_dir, write_shards)
from jaxpar.model import abstract_model, buffers_of, initial_buffers, merge_adapters, merge_state, trainable
from jaxpar.plan import Plan
from jaxpar.sharding import layer_axis, vocab_dims
from jaxpar.store import checkpoint
from jaxpar.store.lock import Staged, check_new_output, check_outside

ARCHITECTURES = {  # Hugging Face class → (jaxpar family, model_type), from each family's table
    arch: (fam.name, model_type) for fam in FAMILIES.values() for arch, model_type in fam.hf.architectures.items()}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# -----------------------------------------------------------------------------------------------------------------
# config.json ⇄ ModelConfig


class _Keys:
    """Typed reads of one config.json object, or of one section of it (`prefix` 'rope_scaling.'). Each read returns
    the value or raises an HFError naming the file and the key — the checks transformers itself makes late (a
    ZeroDivisionError, a shape error) or never (a string "false" is true). `None` (JSON null) counts as absent, as
    in transformers. Ranges between keys are left to ModelConfig, whose errors `model_config` renames."""

    def __init__(self, d: dict, path: pathlib.Path, prefix: str = "", needed_by: str = ""):
        self.d, self.path, self.prefix = d, path, prefix
        self.needed_by = needed_by or f"a {d.get('model_type', '?')} model"

    def bad(self, key: str, value: Any, rule: str) -> HFError:
        return HFError(f"{self.path}: {self.prefix}{key} = {value!r}: {rule}")

    def error(self, message: str) -> HFError:
        """An HFError about this file (a family's reader raises these for what it does not support)."""
        return HFError(f"{self.path}: {message}")

    def raw(self, key: str, default: Any = ...) -> Any:
        """The value as JSON gave it, or `default` (trusted: never checked) when absent; no default: required."""
        if self.d.get(key) is not None:
            return self.d[key]
        if default is ...:
            raise HFError(f"{self.path}: no {self.prefix + key!r}, which {self.needed_by} needs; add it, or re-save "
                          "the model with transformers")
        return default

    def integer(self, key: str, default: Any = ..., *, minimum: int = 1) -> int:
        if self.d.get(key) is None:
            return self.raw(key, default)
        value = self.d[key]
        if isinstance(value, bool) or not isinstance(value, int):  # JSON 4.0 and "4" are not sizes
            raise self.bad(key, value, "must be an integer")
        if value < minimum:
            raise self.bad(key, value, f"must be > {minimum - 1}" if minimum else "must be >= 0")
        return value

    def number(self, key: str, default: Any = ...) -> float:
        if self.d.get(key) is None:
            return self.raw(key, default)
        value = self.d[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(key, value, "must be a number")
        if not math.isfinite(value):  # Python's json reads NaN and Infinity
            raise self.bad(key, value, "must be a finite number")
        return float(value)

    def flag(self, key: str, default: Any = ...) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "must be true or false")
        return value

    def text(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.bad(key, value, "must be a string")
        return value

    def section(self, key: str, needed_by: str = "") -> "_Keys":
        """The JSON object under `key` (empty when absent or null)."""
        value = self.raw(key, {})
        if not isinstance(value, dict):
            raise self.bad(key, value, "must be a JSON object")
        return _Keys(value, self.path, f"{self.prefix}{key}.", needed_by or self.needed_by)


def architecture(hf: dict, path: pathlib.Path) -> str:
    """The single supported architecture named by config.json, or an HFError listing the supported ones."""
    archs = hf.get("architectures") or []
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) and archs[0] in ARCHITECTURES):
        raise HFError(f"{path}: architectures = {archs!r} is not supported; jaxpar imports exactly one of "
                      f"{sorted(ARCHITECTURES)} (a causal LM with its config.json 'architectures' field)")
    return archs[0]


def model_config(hf: dict, path: pathlib.Path, **overrides: Any) -> ModelConfig:
    """The jaxpar ModelConfig of a Hugging Face config.json dict read from `path` (the directory or the file, for
    messages). `overrides` (e.g. dtype) are applied on top.

    Every problem is an HFError naming config.json and the Hugging Face key: a missing key, a wrong JSON type, a size
    below 1, and — renamed from jaxpar's ConfigError — a range or cross-key rule ModelConfig enforces (heads that
    kv heads do not divide, an odd head_dim, …). A ConfigError about an override (the run's own choice) stays one.
    """
    path = pathlib.Path(path)
    path = path / "config.json" if path.suffix != ".json" else path
    _require_object(hf, path)
    arch = architecture(hf, path)
    family_name, model_type = ARCHITECTURES[arch]
    fields, names = FAMILIES[family_name].hf.read(_Keys(hf, path), model_type)
    if fields.get("mtp_depth") and "mtp_depth" not in overrides and not beyond_layers(
            _tensor_names(path.parent), fields["n_layers"]):
        fields["mtp_depth"] = 0  # num_nextn_predict_layers without MTP tensors (transformers 5 writes 1 always)
    dtype = _DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), "float32")
    fields.update(param_dtype=dtype, dtype=dtype)
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        field = e.field.removeprefix("model.")
        if field in overrides or field not in names:
            raise
        # ModelConfig speaks jaxpar's field names (model.d_ff, moe.top_k); the user edits config.json, so say its keys.
        rule, fix = (re.sub(r"\b(model\.|moe\.)(\w+)", lambda m: names.get(
            m.group(2) if m.group(1) == "model." else m.group(0), m.group(0)), text) for text in (e.rule, e.fix))
        raise HFError(f"{path}: {names[field]} = {e.value!r}: {rule}; {fix}") from None


def _tensor_names(directory: pathlib.Path) -> set[str]:
    """The tensor names of a Hugging Face directory from its headers; empty where it holds no weights (a
    config.json alone)."""
    try:
        return SafetensorsDir(directory).names()
    except (HFError, OSError):
        return set()


def hf_config(cfg: ModelConfig, base: dict | None = None, dtype: str | None = None) -> dict:
    """The Hugging Face config.json for `cfg`: `base` (the imported config, when there is one) updated with every
    field jaxpar knows, or a fresh one (architecture chosen by the features: GPT-2, Qwen2 for q/k/v biases,
    Mistral for a sliding window, else Llama; with experts Qwen2-MoE for a shared expert, else Mixtral)."""
    _check_exportable(cfg)
    out = dict(base or {})
    dtype = dtype or cfg.param_dtype
    family(cfg).hf.write(cfg, out, base)
    out["dtype" if "dtype" in out else "torch_dtype"] = dtype
    return out


def _check_exportable(cfg: ModelConfig) -> None:
    """Raise a ConfigError naming the first field of `cfg` that the Hugging Face architecture it exports as cannot
    express: transformers would refuse the tensors' shapes or, worse, load them and compute something else."""
    family(cfg).hf.exportable(cfg)


# -----------------------------------------------------------------------------------------------------------------
# The tensor tables


def _rules(cfg: ModelConfig, names: set[str] | None = None) -> list[Rule]:
    """The tensor table of `cfg`'s family (each family file holds its own). `names` (the tensors present) settles
    naming variants (GPT-2's 'transformer.' prefix)."""
    return family(cfg).hf.tensors(cfg, names)


# -----------------------------------------------------------------------------------------------------------------
# Reading


def read_config(path: str | pathlib.Path) -> dict:
    """config.json of a Hugging Face directory, as a dict (HFError if the directory or file is missing, or the file
    is not one JSON object)."""
    directory = model_dir(path)
    file = directory / "config.json"
    if member(directory, "config.json") is None:
        raise HFError(f"{file}: not found — is {path} a Hugging Face model directory?")
    check_members(directory)  # tokenizer.json, the index, …: refused now, before any of them is used
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise HFError(f"{file}: not found — is {path} a Hugging Face model directory?") from None
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError; a directory named config.json an OSError
        raise HFError(f"{file}: not valid JSON ({e})") from None
    return _require_object(hf, file)


def _require_object(hf: Any, file: pathlib.Path) -> dict:
    """`hf` if config.json held a JSON object, else an HFError saying what it held."""
    if not isinstance(hf, dict):
        raise HFError(f"{file}: holds a JSON {type(hf).__name__}, not an object; a Hugging Face config.json is one "
                      "object of settings")
    return hf


def is_hf_dir(path: str | pathlib.Path) -> bool:
    """True when `path` looks like a Hugging Face model directory (config.json with 'architectures' or
    'model_type', or a config.json that is no JSON object beside safetensors weights — read_config then says what
    is wrong), not a jaxpar workdir."""
    path = pathlib.Path(path)
    file = path / "config.json"
    if os.path.lexists(file) and not inside(path, file):  # not read here: read_config says why it is refused
        return (path / SINGLE).exists() or (path / INDEX).exists()
    if not file.is_file():
        return False
    try:
        cfg = json.loads(file.read_text())
    except (ValueError, OSError):
        return False
    if not isinstance(cfg, dict):
        return (path / SINGLE).exists() or (path / INDEX).exists()
    return "architectures" in cfg or "model_type" in cfg


def _hf_shape(rule: Rule, abstract_layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's expected shape, from the jaxpar shape (without vocab padding) via the inverse map, traced
    on shapes only: a config.json of absurd sizes (a vocab of 10^12) allocates nothing here."""
    return tuple(jax.eval_shape(rule.to_hf, jax.ShapeDtypeStruct(tuple(abstract_layer_shape), np.int8)).shape)


def beyond_layers(names: set[str], n_layers: int) -> set[str]:
    """The tensors of `names` under `model.layers.{i}.` with i >= n_layers: what DeepSeek-V3 stores its
    multi-token-prediction (MTP) modules as (layer num_hidden_layers, …): what `drop_mtp` leaves out."""
    return {n for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= n_layers}


def load_params(path: str | pathlib.Path, cfg: ModelConfig, abstract: nnx.State, layout: Plan = Plan(),
                shardings: nnx.State | None = None, *, drop_mtp: bool = False) -> nnx.State:
    """The Hugging Face weights of directory `path` as the runtime params of `abstract` (shapes, dtypes), placed
    with `shardings` (None: the default device) in `layout`'s layer order and vocab padding.

    Each device's shard is assembled from the HF tensors it covers, read one layer at a time (mmap), so host memory
    stays near one parameter's local shard. Stored entry i of a stack of n layers holds the stack's entry
    j = `layout.stack_order(n)[i]` (i without a pipeline), which is model layer `rule.model_layers(n_layers)[j]`.

    drop_mtp: leave out the tensors of layers from cfg.n_layers on (`beyond_layers`: DeepSeek-V3's MTP modules),
    which a family's table otherwise refuses by name — an explicit choice, never a default.
    """
    path = pathlib.Path(path)
    if cfg.weights != "float":  # QLoRA: the float weights read, then quantized where they are
        return _load_quantized(path, cfg, abstract, layout, shardings, drop_mtp=drop_mtp)
    files = SafetensorsDir(path)
    dropped = beyond_layers(files.names(), cfg.n_layers) if drop_mtp else set()
    table = _rules(cfg, files.names() - dropped)
    rules = {r.param: r for r in table if not isinstance(r, ZeroRule)}
    # The weights, and the buffers the format holds (DeepSeek-V3's e_score_correction_bias: the table names them),
    # are read from the files; the other buffers (expert_load) start at their initial values, placed like the weights.
    buffers = initial_buffers(abstract, cfg)
    if shardings is not None:
        buffers = jax.device_put(buffers, buffers_of(shardings))
    like = _carried(abstract, rules)
    vocab_axes = vocab_dims(abstract)  # which dim of which parameter runs over the vocab (its logical axes)
    placed = nnx.to_pure_dict(shardings) if shardings is not None else None
    used: set[str] = set()
    _check_shapes(files, cfg, like, rules, vocab_axes, path)  # every header against config.json, before any data

    # the stacks a pipeline stores in its own order: those on the `layers` logical axis (not DeepSeek's dense
    # prefix or the MTP modules, which every stage holds in model order: jaxpar.model.Blocks)
    piped = {".".join(str(k.key) for k in key) for key, v in jax.tree_util.tree_flatten_with_path(
        abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))[0] if layer_axis(v) == "layers"}

    def load(key_path, var):
        param = ".".join(str(k.key) for k in key_path)
        rule = _rule_of(rules, param, cfg, path)
        # stored entry i of the stack → the model layer it holds
        layers = _stored_layers(rule, var, layout if param in piped else Plan(), cfg, path) if rule.stacked else None
        if isinstance(rule, ExpertRule):
            return jax.make_array_from_callback(tuple(var.shape), sharding_of(key_path),
                                                _expert_shards(rule, var, files, layers, used, path))
        shape, dtype = var.shape, var.dtype
        vocab_axis = vocab_axes.get(param)
        layer_shape = shape[1:] if rule.stacked else shape
        true_shape, expected = _expected_shape(rule, var, vocab_axis, cfg)
        cache: dict[int, np.ndarray] = {}

        def layer_array(layer: int | None, rule=rule, expected=expected, true_shape=true_shape,
                        vocab_axis=vocab_axis, layer_shape=layer_shape, dtype=dtype, cache=cache) -> np.ndarray:
            """One layer (or the whole unstacked param), in jaxpar's layout, padded, cast; the last one is cached."""
            key = -1 if layer is None else layer
            if key not in cache:
                cache.clear()
                name = rule.name.format(l=layer) if layer is not None else rule.name
                used.add(name)
                x = files.get(name, expected)
                x = rule.to_jax(rule.piece(x))
                if tuple(x.shape) != tuple(true_shape):  # the table and config.json disagree: a bug, not bad input
                    raise HFError(f"{path}: tensor {name!r} maps to shape {x.shape}, expected {tuple(true_shape)}")
                if vocab_axis is not None and layer_shape[vocab_axis] != cfg.vocab_size:
                    pad = [(0, 0)] * x.ndim
                    pad[vocab_axis] = (0, layer_shape[vocab_axis] - cfg.vocab_size)
                    x = np.pad(x, pad)
                cache[key] = x.astype(dtype)
            return cache[key]

        def shard(index: tuple[slice, ...], rule=rule, layer_array=layer_array, layers=layers) -> np.ndarray:
            if not rule.stacked:
                return layer_array(None)[index]
            return np.stack([layer_array(layers[i])[index[1:]] for i in range(*index[0].indices(shape[0]))])

        return jax.make_array_from_callback(tuple(shape), sharding_of(key_path), shard)

    def sharding_of(key_path) -> jax.sharding.Sharding:
        if placed is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        sharding = placed
        for k in key_path:
            sharding = sharding[k.key]
        return sharding

    arrays = jax.tree_util.tree_map_with_path(load, like)
    for rule in table:  # tensors no parameter holds (a zero-width shared expert): checked where present, not loaded
        if isinstance(rule, ZeroRule):
            for layer in rule.model_layers(cfg.n_layers):
                name = rule.name.format(l=layer)
                if name in files.names():
                    files.get(name, rule.shape)  # [1, D] at most
                    used.add(name)
    # GPT-2 checkpoints may hold non-parameter buffers (attention masks); anything else left over is reported.
    ignored = {n for n in files.names() - used if n.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))}
    # copies of a parameter another rule reads (DeepSeek-V3's per-MTP-layer embedding and head: export writes them)
    ignored |= {r.name for r in table if rules.get(r.param) is not r and not r.stacked and r.name in files.names()}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unused = files.names() - used - ignored - dropped
    if unused:
        raise HFError(f"{path}: tensors {sorted(unused)[:5]} are not used by the jaxpar {cfg.family} model — the "
                      "config.json does not describe these weights (an unsupported variant?)")
    params = jax.tree.map(lambda x: x, trainable(abstract))
    state = merge_state(params, buffers) if jax.tree.leaves(buffers) else params
    nnx.replace_by_pure_dict(state, arrays)  # the weights and the buffers read; the others keep their start values
    return state


def _load_quantized(path: pathlib.Path, cfg: ModelConfig, state: nnx.State, layout: Plan,
                    shardings: nnx.State | None, *, drop_mtp: bool) -> nnx.State:
    """`load_params` for a model whose weights are stored quantized (`cfg.weights`: a frozen base under LoRA
    adapters): the float model's weights read into `layout`, then quantized as `jaxpar convert --quantize` does
    (`quantize_state`, each device its own share). `state` holds the run's start values: its adapters and
    buffers are kept."""
    from jaxpar.model import quantize_state
    from jaxpar.sharding import param_shardings

    plain = dataclasses.replace(cfg, weights="float")
    _, like = abstract_model(plain, layout.padded_vocab)
    placed = None if shardings is None else param_shardings(like, layout.mesh, layout.rules, layout.param_zero_data)
    read = nnx.to_pure_dict(load_params(path, plain, like, layout, placed, drop_mtp=drop_mtp))
    start = nnx.to_pure_dict(state)
    for stack, layers in read.items():  # the adapters: not in the file, so the run's own start values
        if isinstance(layers, dict):
            layers.update({k: v for k, v in start[stack].items() if k.endswith(("_lora_a", "_lora_b"))})
    float_state = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(float_state, read)
    return quantize_state(float_state, cfg, shardings)


def _named(tree: dict) -> dict[str, Any]:
    """The leaves of a pure dict by dotted path ("blocks.wq")."""
    out: dict[str, Any] = {}
    jax.tree_util.tree_map_with_path(lambda kp, x: out.__setitem__(".".join(str(k.key) for k in kp), x), tree)
    return out


def _carried(state: nnx.State, rules: dict[str, Rule]) -> dict:
    """The pure dict of what a Hugging Face checkpoint holds of model state `state`: every parameter but LoRA's
    adapters (a run's own: they keep the values they start at on import, and an export merges them), and each
    buffer a rule names (a buffer without a tensor, like expert_load, is left out: it starts at its initial value
    on import and is not exported)."""
    buffers = _named(nnx.to_pure_dict(buffers_of(state)))

    def keep(d: dict, prefix: str) -> dict:
        out = {}
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                if sub := keep(v, name + "."):
                    out[k] = sub
            elif (name not in buffers or name in rules) and not k.endswith(("_lora_a", "_lora_b")):
                out[k] = v
        return out

    return keep(nnx.to_pure_dict(state), "")


def _rule_of(rules: dict[str, Rule], param: str, cfg: ModelConfig, path: pathlib.Path) -> Rule:
    if param not in rules:
        raise HFError(f"{path}: jaxpar parameter {param!r} has no Hugging Face tensor (family {cfg.family})")
    return rules[param]


def _expected_shape(rule: Rule, var, vocab_axis: int | None, cfg: ModelConfig) -> tuple[list[int], tuple[int, ...]]:
    """(one layer's jaxpar shape without vocab padding, the HF tensor's shape it comes from) of non-expert
    parameter `var` (stacked: [L, …])."""
    layer_shape = var.shape[1:] if rule.stacked else var.shape
    true_shape = list(layer_shape)
    if vocab_axis is not None:
        true_shape[vocab_axis] = cfg.vocab_size
    return true_shape, rule.fused_shape(_hf_shape(rule, tuple(true_shape)))


def _check_shapes(files: "SafetensorsDir", cfg: ModelConfig, like: dict, rules: dict[str, Rule],
                  vocab_axes: dict[str, int], path: pathlib.Path) -> None:
    """Raise an HFError at the first tensor that config.json's sizes do not describe — missing, or of another shape
    in its file's header — naming the config.json key where one explains it, before any tensor's data is read or
    any array built for it (a vocab_size of 10^12 in a 515-token model is refused here, not a MemoryError later).
    Only headers are read."""

    def check(name: str, expected: tuple[int, ...]) -> None:
        stored = files.shape(name)
        if stored != tuple(expected):
            raise HFError(f"{path / files.where[name]}: tensor {name!r} has shape {stored}, but config.json implies "
                          f"{tuple(expected)}{_size_hint(cfg, path, expected, stored)}")

    for param, var in _named(like).items():
        rule = _rule_of(rules, param, cfg, path)
        layers = rule.model_layers(cfg.n_layers) if rule.stacked else (None,)
        if isinstance(rule, ExpertRule):
            _, X, *one = var.shape
            expected = _hf_shape(rule, tuple(one))
            for layer in layers:
                if rule.per_expert:
                    for e in range(X):
                        check(rule.name.format(l=layer, e=e), expected)
                else:
                    check(rule.name.format(l=layer), (X, expected[0] * rule.parts, *expected[1:]))
            continue
        _, expected = _expected_shape(rule, var, vocab_axes.get(param), cfg)
        for layer in layers:
            check(rule.name.format(l=layer) if layer is not None else rule.name, expected)


def _size_hint(cfg: ModelConfig, path: pathlib.Path, expected: tuple[int, ...], stored: tuple[int, ...]) -> str:
    """'; config.json's vocab_size = 10^12 does not describe these weights' for the config.json keys whose values
    are the sizes in `expected` that `stored` lacks ('' when none is one key's value)."""
    wrong = set(expected) - set(stored) if len(expected) == len(stored) else set(expected)
    try:
        hf = read_config(path)
        family_name, model_type = ARCHITECTURES[architecture(hf, path)]
        _, names = FAMILIES[family_name].hf.read(_Keys(hf, path), model_type)
    except HFError:
        return ""
    keys = []
    for field, key in names.items():
        value = getattr(cfg.moe, field[4:], None) if field.startswith("moe.") else getattr(cfg, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value in wrong:
            keys.append(f"{key} = {value}")
    return f"; config.json's {', '.join(sorted(set(keys)))} does not describe these weights" if keys else ""


def _stored_layers(rule: Rule, var, layout: Plan, cfg: ModelConfig, path: pathlib.Path) -> list[int]:
    """The model layer at each stored entry of stacked parameter `var`: the stack's entries in the layout's storage
    order (`Plan.stack_order`), each mapped to its model layer (`Rule.layers`)."""
    model_layers = rule.model_layers(cfg.n_layers)
    if len(model_layers) != var.shape[0]:  # the table and the model disagree: a bug, not bad input
        raise HFError(f"{path}: jaxpar parameter {rule.param!r} stacks {var.shape[0]} layers, its tensor rule "
                      f"names {len(model_layers)}")
    order = layout.stack_order(var.shape[0])
    return [model_layers[int(order[i]) if order is not None else i] for i in range(var.shape[0])]


def _expert_shards(rule: ExpertRule, var, files: SafetensorsDir, layers: list[int], used: set[str],
                   path: pathlib.Path):
    """The shard callback of a stacked expert parameter [L, X, …]: a device's shard is stacked from the (layer,
    expert) tensors its index covers — one HF tensor each in the hub layout, one slice of the layer's fused tensor
    otherwise — each converted by `rule.to_jax` and cast; the last one read is cached. `layers`: the model layer of
    each stored entry (`_stored_layers`)."""
    L, X, *one = var.shape  # `one`: one expert's jaxpar shape
    expected = _hf_shape(rule, tuple(one))  # one expert's HF tensor (or its part of the fused rows)
    rows = expected[0]
    fused = (X, rows * rule.parts, *expected[1:])  # the fused layout's whole tensor of a layer
    cache: dict[tuple[int, int], np.ndarray] = {}

    def expert(layer: int, e: int) -> np.ndarray:
        if (layer, e) not in cache:
            cache.clear()
            if rule.per_expert:
                name = rule.name.format(l=layer, e=e)
                x = files.get(name, expected)
            else:
                name = rule.name.format(l=layer)
                x = files.get(name, fused, index=(e, slice(rule.part * rows, (rule.part + 1) * rows)))
            used.add(name)
            x = rule.to_jax(x)
            if tuple(x.shape) != tuple(one):  # the table and config.json disagree: a bug, not bad input
                raise HFError(f"{path}: tensor {name!r} maps to shape {x.shape}, expected {tuple(one)}")
            cache[(layer, e)] = x.astype(var.dtype)
        return cache[(layer, e)]

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        experts = range(*index[1].indices(X))
        return np.stack([np.stack([expert(layers[i], e)[index[2:]] for e in experts])
                         for i in range(*index[0].indices(L))])

    return shard


# -----------------------------------------------------------------------------------------------------------------
# Writing


def save_params(params: nnx.State, cfg: ModelConfig, path: str | pathlib.Path, *, base_config: dict | None = None,
                dtype: str | None = None, tokenizer: str | pathlib.Path | None = None, max_shard_bytes: int = 2 << 30,
                names: set[str] | None = None) -> pathlib.Path:
    """Write canonical `params` (layers in model order, as `jaxpar.store.checkpoint.read_canonical` gives them) as a
    Hugging Face directory `path`: config.json, safetensors shards of at most `max_shard_bytes` (one
    `model.safetensors` when it fits, else shards plus the index), and tokenizer.json when given. `dtype`: the
    tensors' dtype (default: the params'). `names`: the imported checkpoint's tensor names, to keep GPT-2's prefix.
    Parameters are fetched one layer at a time. `path` must be new: absent or an empty directory (else an
    OutputError, nothing written). The files are written into a temporary sibling directory and published with one
    rename when complete (`jaxpar.store.lock.Staged`), so a crash never leaves a half-written model under `path`,
    and of two exports into one directory the second is refused with the first's intact. With a Qwen2-MoE
    `base_config`, pass its `names` too: they tell Qwen2-MoE's tensor names for a model Mixtral could also hold."""
    path = pathlib.Path(path)
    if cfg.weights != "float":
        raise ConfigError("model.weights", cfg.weights, "the model's weights are quantized, and a Hugging Face "
                          "export writes float tensors", "export the float model (workdir) it was quantized from")
    if dtype is not None and dtype not in _DTYPES:
        raise HFError(f"{path}: dtype {dtype!r} cannot be exported; use one of {sorted(_DTYPES)}")
    _check_exportable(cfg)  # before any file is written
    with Staged(path, "--to-hf") as tmp:
        _write_files(params, cfg, tmp, base_config=base_config, dtype=dtype, tokenizer=tokenizer,
                     max_shard_bytes=max_shard_bytes, names=names)
    return path


def _write_files(params: nnx.State, cfg: ModelConfig, path: pathlib.Path, *, base_config, dtype, tokenizer,
                 max_shard_bytes: int, names) -> None:
    rules = _rules(cfg, names)
    if any(isinstance(r, ExpertRule) and not r.per_expert for r in rules):
        # an import of the fused expert layout exports the hub's per-expert one
        rules = _rules(cfg, {n for n in names if not n.endswith(FUSED)})
    # the weights and the buffers the format holds (a rule names them); not expert_load, which no format has
    flat = _named(_carried(params, {r.param: r for r in rules}))
    kept = _named(nnx.to_pure_dict(buffers_of(params)))  # the buffers: float32 state, written as float32 whatever
    # `dtype` (transformers keeps them so)
    vocab_axes = vocab_dims(params)
    first = next(iter(nnx.to_pure_dict(trainable(params)).values()))
    while isinstance(first, dict):
        first = next(iter(first.values()))
    # HF tensor → the (rule, stack entry, expert) pieces that make it; a stack's entry i is model layer layers[i]
    by_name: dict[str, list[tuple[Rule, int | None, int | None]]] = {}
    for rule in rules:
        for entry, layer in enumerate(rule.model_layers(cfg.n_layers)) if rule.stacked else ((None, None),):
            per_expert = isinstance(rule, ExpertRule)
            for e in range(flat[rule.param].shape[1]) if per_expert else (None,):
                name = rule.name.format(l=layer, e=e) if per_expert else rule.name.format(l=layer)
                by_name.setdefault(name, []).append((rule, entry, e))

    def tensor(name: str) -> np.ndarray:
        parts = []
        for rule, entry, e in sorted(by_name[name], key=lambda piece: piece[0].part):
            if isinstance(rule, ZeroRule):  # no parameter holds it: zeros (a zero-width shared expert and its gate)
                parts.append(np.zeros(rule.shape, np.dtype(first.dtype)))
                continue
            x = flat[rule.param] if entry is None else flat[rule.param][entry]
            x = np.asarray(jax.device_get(x if e is None else x[e]))
            if rule.param in vocab_axes:  # drop the tensor-parallel vocab padding
                x = x[(slice(None),) * vocab_axes[rule.param] + (slice(0, cfg.vocab_size),)]
            parts.append(rule.to_hf(x))
        x = by_name[name][0][0].fuse(parts)
        cast = dtype and not any(rule.param in kept for rule, _, _ in by_name[name])
        return np.ascontiguousarray(x.astype(dtype) if cast else x)

    # in the table's order: one parameter after another, each layer by layer
    write_shards(((name, tensor(name)) for name in by_name), path, max_shard_bytes)
    config = hf_config(cfg, base_config, dtype or str(np.dtype(first.dtype)))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        src = pathlib.Path(tokenizer)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if member(src, file) is not None:  # held to its directory: a link out is refused, never copied
                shutil.copyfile(src / file, path / file)


def checkpoint_names(path: str | pathlib.Path) -> set[str]:
    """The tensor names of a Hugging Face directory (to keep its naming when exporting)."""
    return SafetensorsDir(pathlib.Path(path)).names()



# -----------------------------------------------------------------------------------------------------------------
# Workdirs: import, export, and starting a training run from Hugging Face weights

SOURCE = "hf_source.json"  # written into an imported workdir: the HF config.json and tensor names, for export
# a run's own choices, not properties of the checkpoint: the numerics, and LoRA's adapters over its weights
_NUMERICS = ("dtype", "param_dtype", "attention", "lora", "weights", "weight_group")


def init_config(config, path: str | pathlib.Path):
    """`config` with its model section taken from the Hugging Face directory `path` (keeping the run's dtype,
    param_dtype and attention kernel), `train.init_from_hf` set, and the directory's tokenizer.json as the
    tokenizer when the config uses the byte tokenizer. Validated like any config (e.g. heads vs tensor)."""
    path = pathlib.Path(path)
    model = model_config(read_config(path), path, **{k: getattr(config.model, k) for k in _NUMERICS})
    data = config.data
    if data.tokenizer == "bytes" and member(path, "tokenizer.json") is not None:
        data = dataclasses.replace(data, tokenizer=str(path.absolute() / "tokenizer.json"))
    train = dataclasses.replace(config.train, init_from_hf=str(path.absolute()))
    return dataclasses.replace(config, model=model, data=data, train=train)


def check_matches(cfg: ModelConfig, path: str | pathlib.Path) -> None:
    """Raise ConfigError naming the first model field where `cfg` differs from the HF directory's config.json."""
    path = pathlib.Path(path)
    want = model_config(read_config(path), path, **{k: getattr(cfg, k) for k in _NUMERICS})
    for field in dataclasses.fields(ModelConfig):
        if field.name != "init_std" and getattr(cfg, field.name) != getattr(want, field.name):
            raise ConfigError(f"model.{field.name}", getattr(cfg, field.name),
                              f"differs from {path}/config.json, which implies {getattr(want, field.name)!r}",
                              "use `jaxpar train --init-from-hf DIR`, which takes the model section from DIR")
    check_sizes(path, cfg)


def check_sizes(path: str | pathlib.Path, cfg: ModelConfig) -> None:
    """Raise an HFError unless every tensor `cfg` needs is in directory `path` with the shape `cfg` implies, read
    from the safetensors headers alone: what `load_params` checks first, for a caller that must know before it
    builds anything of the model's size (a training run initializes its state before it reads the weights)."""
    path = model_dir(path)
    files = SafetensorsDir(path)
    cfg = dataclasses.replace(cfg, weights="float")  # (a quantized base is read as float, then quantized)
    _, abstract = abstract_model(cfg)
    rules = {r.param: r for r in _rules(cfg, files.names()) if not isinstance(r, ZeroRule)}
    _check_shapes(files, cfg, _carried(abstract, rules), rules, vocab_dims(abstract), path)


def import_to_workdir(src: str | pathlib.Path, dst: str | pathlib.Path, *, dtype: str | None = None,
                      quantize: str | None = None, group_size: int | None = None,
                      drop_mtp: bool = False) -> pathlib.Path:
    """Write the Hugging Face model `src` as a params-only jaxpar workdir `dst` (step 0): config.json, the
    checkpoint, its tokenizer.json, and hf_source.json (so that export reproduces the original names and config).
    `dst` must be new — absent or an empty directory, outside `src` — and is published whole or not at all
    (`checkpoint.write_params_only`). quantize: store the layers' matrices as 'int8' / 'int4'
    (`checkpoint.cast_and_quantize`). drop_mtp: import without the tensors of layers from num_hidden_layers on
    (DeepSeek-V3's multi-token-prediction modules: the model gets model.mtp_depth 0; `load_params`)."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    hf_cfg = read_config(src)
    checkpoint.check_params_only_target(dst, src)  # a new directory outside src, before anything is read
    cfg = model_config(hf_cfg, src, **({"dtype": dtype, "param_dtype": dtype} if dtype else {}),
                       **({"mtp_depth": 0} if drop_mtp else {}))
    if quantize is not None:
        checkpoint.quantize_config(cfg, quantize, group_size)  # a bad group size fails before anything is read
    _, abstract = abstract_model(cfg)
    params = load_params(src, cfg, abstract, drop_mtp=drop_mtp)
    names = checkpoint_names(src)
    names -= beyond_layers(names, cfg.n_layers) if drop_mtp else set()
    files = {SOURCE: json.dumps({"config": hf_cfg, "tensor_names": sorted(names)}, indent=1).encode()}
    tokenizer = "bytes"
    if (tokenizer_file := member(src, "tokenizer.json")) is not None:
        files["tokenizer.json"] = tokenizer_file.read_bytes()
        tokenizer = str(dst.absolute() / "tokenizer.json")
    config = Config(model=cfg, data=DataConfig(tokenizer=tokenizer))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=min(128, cfg.max_seq_len)))
    params, config = checkpoint.cast_and_quantize(params, config, None, quantize, group_size)
    # Written beside dst and published whole with one rename, only onto an absent or empty directory.
    checkpoint.write_params_only(dst, config, params, step=0, files=files)
    return dst


def export_workdir(src: str | pathlib.Path, dst: str | pathlib.Path, *, step: int | None = None,
                   dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> int:
    """Write checkpoint `step` (default: latest) of jaxpar workdir `src` as a Hugging Face directory `dst`.
    Returns the step. An imported workdir keeps its original config.json fields and tensor names."""
    src = pathlib.Path(src)
    checkpoint.read_saved_config(src)  # a missing source is named first
    check_outside(src, dst, "--to-hf")
    check_new_output(dst, "--to-hf")  # before seconds of reading; the publication re-checks it atomically
    config, params, step = checkpoint.read_canonical(src, step)
    if config.model.lora.rank:  # LoRA: the adapters merged into their weights, W + (alpha/r)·A·B
        params, model = merge_adapters(params, config.model)
        config = dataclasses.replace(config, model=model)
    source = json.loads((src / SOURCE).read_text()) if (src / SOURCE).is_file() else {}
    # The byte tokenizer has no file to copy (and "bytes" must not be read as a path relative to the cwd).
    tokenizer = pathlib.Path(config.data.tokenizer) if config.data.tokenizer != "bytes" else None
    save_params(params, config.model, dst, base_config=source.get("config"), dtype=dtype,
                tokenizer=(tokenizer if tokenizer.is_dir() else tokenizer.parent) if tokenizer and tokenizer.exists()
                else None,
                max_shard_bytes=max_shard_bytes, names=set(source.get("tensor_names", ())) or None)
    return step
