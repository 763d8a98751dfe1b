"""Hugging Face checkpoints ⇄ jaxpar: Llama, Mistral, Qwen2 and GPT-2 directories in, the same format out.

A Hugging Face model directory holds `config.json`, the weights as `model.safetensors` or as shards listed by
`model.safetensors.index.json`, and usually `tokenizer.json`. Only those JSON and safetensors files are read —
never a pickle (`*.bin`, `*.pt`): loading one can run arbitrary code.

The mapping is one table per family (`_rules`): each jaxpar parameter names the Hugging Face tensor it comes from
and the reshape between the two layouts, e.g.

    jaxpar blocks.wq [L, D, H, E]  ←  model.layers.{l}.self_attn.q_proj.weight [H·E, D]   (torch Linear: [out, in])
    jaxpar blocks.wq [L, D, H, E]  ←  transformer.h.{l}.attn.c_attn.weight[:, 0:D] [D, H·E] (GPT-2 Conv1D: [in, out],
                                      q, k, v fused on the last axis)

Import places every parameter straight onto its mesh layout with `jax.make_array_from_callback`: each device's
shard is cut from the per-layer tensors it covers, read one at a time from the memory-mapped files, so host memory
peaks at about one parameter's local shard, never the model. Layer order (pipeline) and vocab padding (tensor
parallelism) are applied on the way in, exactly as checkpoints are (`jaxpar.train.checkpoint`). Export is the
inverse and writes safetensors shards of at most `max_shard_bytes` plus the index, so `transformers` (or jaxpar)
loads the result with `from_pretrained`.

Every problem — a damaged file, a missing tensor, a shape mismatch, an unsupported architecture or option — is an
`HFError` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxpar.config import ModelConfig
from jaxpar.errors import JaxparError
from jaxpar.sharding import ModelLayout

ARCHITECTURES = {  # Hugging Face class → (jaxpar family, model_type)
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("llama", "mistral"),
    "Qwen2ForCausalLM": ("llama", "qwen2"),
    "GPT2LMHeadModel": ("gpt2", "gpt2"),
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class HFError(JaxparError, ValueError):
    """A Hugging Face directory that cannot be imported, with the file (and tensor) at fault and what to do."""

    kind = "Hugging Face error"


# -----------------------------------------------------------------------------------------------------------------
# config.json ⇄ ModelConfig


def _get(hf: dict, key: str, path: pathlib.Path, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFError(f"{path}: no {key!r}, which a {hf.get('model_type', '?')} model needs")
    return default


def architecture(hf: dict, path: pathlib.Path) -> str:
    """The single supported architecture named by config.json, or an HFError listing the supported ones."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFError(f"{path}: architectures = {archs!r} is not supported; jaxpar imports exactly one of "
                      f"{sorted(ARCHITECTURES)} (a causal LM with its config.json 'architectures' field)")
    return archs[0]


def model_config(hf: dict, path: pathlib.Path, **overrides: Any) -> ModelConfig:
    """The jaxpar ModelConfig of a Hugging Face config.json dict read from `path` (the directory or the file, for
    messages). `overrides` (e.g. dtype) are applied on top."""
    path = pathlib.Path(path)
    path = path / "config.json" if path.suffix != ".json" else path
    arch = architecture(hf, path)
    family, model_type = ARCHITECTURES[arch]
    if family == "gpt2":
        act = _get(hf, "activation_function", path, "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFError(f"{path}: activation_function = {act!r} is not supported; jaxpar's GPT-2 uses the tanh "
                          "GELU ('gelu_new')")
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(key):
                raise HFError(f"{path}: {key} = true is not supported (jaxpar's GPT-2 attention is the standard one)")
        d_model = _get(hf, "n_embd", path)
        fields = dict(family="gpt2", vocab_size=_get(hf, "vocab_size", path), d_model=d_model,
                      n_layers=_get(hf, "n_layer", path), n_heads=_get(hf, "n_head", path),
                      d_ff=_get(hf, "n_inner", path, 4 * d_model), max_seq_len=_get(hf, "n_positions", path),
                      norm_eps=_get(hf, "layer_norm_epsilon", path, 1e-5),
                      tie_embeddings=_get(hf, "tie_word_embeddings", path, True))
    else:
        act = _get(hf, "hidden_act", path, "silu")
        if act != "silu":
            raise HFError(f"{path}: hidden_act = {act!r} is not supported; jaxpar's llama family uses SwiGLU (silu)")
        for key in ("mlp_bias", "attention_bias") if model_type == "llama" else ():
            if hf.get(key):
                raise HFError(f"{path}: {key} = true is not supported for LlamaForCausalLM (only Qwen2's q/k/v "
                              "biases are)")
        n_heads, d_model = _get(hf, "num_attention_heads", path), _get(hf, "hidden_size", path)
        window = 0
        if model_type == "mistral":
            window = int(hf.get("sliding_window") or 0)
        elif model_type == "qwen2" and hf.get("use_sliding_window"):
            # Qwen2 windows the layers from max_window_layers on: all of them, none, or (unsupported) some.
            first, n_layers = hf.get("max_window_layers", 0), _get(hf, "num_hidden_layers", path)
            if 0 < first < n_layers:
                raise HFError(f"{path}: use_sliding_window with max_window_layers = {first} < num_hidden_layers = "
                              f"{n_layers} (a window on some layers only) is not supported")
            window = int(hf.get("sliding_window") or 0) if first == 0 else 0
        fields = dict(family="llama", vocab_size=_get(hf, "vocab_size", path), d_model=d_model,
                      n_layers=_get(hf, "num_hidden_layers", path), n_heads=n_heads,
                      n_kv_heads=_get(hf, "num_key_value_heads", path, n_heads),
                      head_dim=_get(hf, "head_dim", path, d_model // n_heads),
                      d_ff=_get(hf, "intermediate_size", path),
                      max_seq_len=_get(hf, "max_position_embeddings", path),
                      rope_theta=float(_rope_parameters(hf).get("rope_theta", 10000.0)),
                      norm_eps=_get(hf, "rms_norm_eps", path, 1e-6),
                      tie_embeddings=_get(hf, "tie_word_embeddings", path, False),
                      qkv_bias=model_type == "qwen2", sliding_window=window, **_rope_scaling(hf, path))
    dtype = _DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), "float32")
    fields.update(param_dtype=dtype, dtype=dtype)
    fields.update(overrides)
    return ModelConfig(**fields)


def _rope_parameters(hf: dict) -> dict:
    """RoPE settings in either spelling: transformers ≥ 5 nests them as `rope_parameters` (rope_theta inside),
    older versions have top-level `rope_theta` and `rope_scaling`."""
    if hf.get("rope_parameters"):
        return dict(hf["rope_parameters"])
    out = dict(hf.get("rope_scaling") or {})
    if hf.get("rope_theta") is not None:
        out["rope_theta"] = hf["rope_theta"]
    return out


def _rope_scaling(hf: dict, path: pathlib.Path) -> dict:
    scaling = _rope_parameters(hf)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind == "linear":
        return dict(rope_scaling="linear", rope_factor=float(scaling["factor"]))
    if kind == "llama3":
        return dict(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_len=int(scaling["original_max_position_embeddings"]))
    raise HFError(f"{path}: rope_scaling type {kind!r} is not supported; jaxpar implements 'linear' and 'llama3' "
                  "(dynamic NTK, YaRN and LongRoPE are not implemented)")


def hf_config(cfg: ModelConfig, base: dict | None = None, dtype: str | None = None) -> dict:
    """The Hugging Face config.json for `cfg`: `base` (the imported config, when there is one) updated with every
    field jaxpar knows, or a fresh one (architecture chosen by the features: GPT-2, Qwen2 for q/k/v biases,
    Mistral for a sliding window, else Llama)."""
    out = dict(base or {})
    dtype = dtype or cfg.param_dtype
    if cfg.family == "gpt2":
        out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size, n_embd=cfg.d_model,
                   n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff, n_positions=cfg.max_seq_len,
                   n_ctx=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
                   tie_word_embeddings=cfg.tie_embeddings)
    else:
        arch, model_type = ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else (
            ("MistralForCausalLM", "mistral") if cfg.sliding_window else ("LlamaForCausalLM", "llama"))
        if base and base.get("architectures"):
            arch = base["architectures"][0]
            model_type = ARCHITECTURES.get(arch, (None, base.get("model_type")))[1]
        out.update(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                   num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_ff,
                   max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                   tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu")
        if model_type == "mistral":
            out["sliding_window"] = cfg.sliding_window or None
        rope: dict[str, Any] = {"rope_type": "default"}
        if cfg.rope_scaling == "linear":
            rope = {"rope_type": "linear", "factor": cfg.rope_factor}
        elif cfg.rope_scaling == "llama3":
            rope = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                    "high_freq_factor": cfg.rope_high_freq_factor,
                    "original_max_position_embeddings": cfg.rope_original_max_len}
        if "rope_parameters" in out:  # transformers >= 5
            out["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}
        else:
            out["rope_theta"] = cfg.rope_theta
            out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    out["dtype" if "dtype" in out else "torch_dtype"] = dtype
    return out


# -----------------------------------------------------------------------------------------------------------------
# The tensor tables


@dataclasses.dataclass(frozen=True)
class Rule:
    """jaxpar parameter `param` ⇄ Hugging Face tensor `name` ("{l}" = layer index for stacked params).

    to_jax: the HF tensor → the jaxpar array (one layer's, for stacked params); to_hf: the inverse. Several rules
    may share one HF tensor (GPT-2's fused c_attn): each takes its `part` of `parts` equal slices of the last axis.
    """

    param: str
    name: str
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    part: int = 0
    parts: int = 1

    @property
    def stacked(self) -> bool:
        return "{l}" in self.name


def _rules(cfg: ModelConfig, names: set[str] | None = None) -> list[Rule]:
    """The table for `cfg`'s family. `names` (the tensors present) picks GPT-2's prefix ('transformer.' or none)."""
    D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    same = lambda x: x  # noqa: E731
    if cfg.family == "gpt2":
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
    lay = "model.layers.{l}."
    linear_in = lambda n: (lambda x: x.T.reshape(D, n, E), lambda x: x.reshape(D, -1).T)  # noqa: E731
    rules = [Rule("embed", "model.embed_tokens.weight", same, same), Rule("final_norm", "model.norm.weight", same, same),
             Rule("blocks.attn_norm", lay + "input_layernorm.weight", same, same),
             Rule("blocks.mlp_norm", lay + "post_attention_layernorm.weight", same, same),
             Rule("blocks.wq", lay + "self_attn.q_proj.weight", *linear_in(H)),
             Rule("blocks.wk", lay + "self_attn.k_proj.weight", *linear_in(K)),
             Rule("blocks.wv", lay + "self_attn.v_proj.weight", *linear_in(K)),
             Rule("blocks.wo", lay + "self_attn.o_proj.weight", lambda x: x.T.reshape(H, E, D),
                  lambda x: x.reshape(-1, D).T),
             Rule("blocks.w_gate", lay + "mlp.gate_proj.weight", lambda x: x.T, lambda x: x.T),
             Rule("blocks.w_up", lay + "mlp.up_proj.weight", lambda x: x.T, lambda x: x.T),
             Rule("blocks.w_down", lay + "mlp.down_proj.weight", lambda x: x.T, lambda x: x.T)]
    if cfg.qkv_bias:
        rules += [Rule(f"blocks.{b}", lay + f"self_attn.{p}_proj.bias", lambda x, n=n: x.reshape(n, E),
                       lambda x: x.reshape(-1)) for b, p, n in (("bq", "q", H), ("bk", "k", K), ("bv", "v", K))]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", lambda x: x.T, lambda x: x.T))
    return rules


# -----------------------------------------------------------------------------------------------------------------
# Reading


class SafetensorsDir:
    """The tensors of a Hugging Face directory by name, across shards, read lazily (memory-mapped) one at a time."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise HFError(f"{path / INDEX}: not a safetensors index ({e}); re-save the model") from None
        elif (path / SINGLE).is_file():
            weight_map = None
        else:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            hint = (f" (found {pickles}: jaxpar never loads pickles — re-save with "
                    "`model.save_pretrained(dir, safe_serialization=True)`)" if pickles else "")
            raise HFError(f"{path}: no {SINGLE} or {INDEX}{hint}")
        self._files: dict[str, Any] = {}
        if weight_map is None:
            self.where = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            self.where = dict(weight_map)
            for file in sorted(set(self.where.values())):
                present = set(self._open(file).keys())
                listed = {n for n, f in self.where.items() if f == file}
                if listed - present:
                    raise HFError(f"{path / file}: tensor {sorted(listed - present)[0]!r} is listed in {INDEX} but "
                                  "missing from the file; the download is incomplete")

    def _open(self, file: str):
        if file not in self._files:
            try:
                self._files[file] = safe_open(str(self.path / file), framework="numpy")
            except FileNotFoundError:
                raise HFError(f"{self.path / file}: file not found (listed in {INDEX}); the download is incomplete") \
                    from None
            except (SafetensorError, OSError) as e:
                raise HFError(f"{self.path / file}: damaged safetensors file ({e}); re-download or re-save it") \
                    from None
        return self._files[file]

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self.where)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor `name` as a NumPy array (checked against `shape` when given)."""
        if name not in self.where:
            raise HFError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        file = self.where[name]
        try:
            x = self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise HFError(f"{self.path / file}: tensor {name!r} could not be read ({e})") from None
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise HFError(f"{self.path / file}: tensor {name!r} has shape {tuple(x.shape)}, but config.json implies "
                          f"{tuple(shape)}")
        return x


def read_config(path: str | pathlib.Path) -> dict:
    """config.json of a Hugging Face directory, as a dict (HFError if missing or not JSON)."""
    file = pathlib.Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise HFError(f"{file}: not found — is {path} a Hugging Face model directory?") from None
    except ValueError as e:
        raise HFError(f"{file}: not valid JSON ({e})") from None


def is_hf_dir(path: str | pathlib.Path) -> bool:
    """True when `path` looks like a Hugging Face model directory (config.json with 'architectures' or
    'model_type'), not a jaxpar workdir."""
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        cfg = json.loads(file.read_text())
    except ValueError:
        return False
    return "architectures" in cfg or "model_type" in cfg


def _hf_shape(rule: Rule, abstract_layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's expected shape, from the jaxpar shape (without vocab padding) via the inverse map."""
    return rule.to_hf(np.zeros(abstract_layer_shape, np.int8)).shape


def load_params(path: str | pathlib.Path, cfg: ModelConfig, abstract: nnx.State, layout: ModelLayout = ModelLayout(),
                shardings: nnx.State | None = None) -> nnx.State:
    """The Hugging Face weights of directory `path` as the runtime params of `abstract` (shapes, dtypes), placed
    with `shardings` (None: the default device) in `layout`'s layer order and vocab padding.

    Each device's shard is assembled from the HF tensors it covers, read one layer at a time (mmap), so host memory
    stays near one parameter's local shard.
    """
    path = pathlib.Path(path)
    files = SafetensorsDir(path)
    rules = {r.param: r for r in _rules(cfg, files.names())}
    order = layout.layer_order
    like = nnx.to_pure_dict(abstract)
    placed = nnx.to_pure_dict(shardings) if shardings is not None else None
    used: set[str] = set()

    def load(key_path, var):
        param = ".".join(str(k.key) for k in key_path)
        if param not in rules:
            raise HFError(f"{path}: jaxpar parameter {param!r} has no Hugging Face tensor (family {cfg.family})")
        rule = rules[param]
        shape, dtype = var.shape, var.dtype
        vocab_axis = {"embed": 0, "lm_head": 1}.get(param)
        layer_shape = shape[1:] if rule.stacked else shape
        true_shape = list(layer_shape)
        if vocab_axis is not None:
            true_shape[vocab_axis] = cfg.vocab_size
        expected = _hf_shape(rule, tuple(true_shape))
        if rule.parts > 1:
            expected = (*expected[:-1], expected[-1] * rule.parts)
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
                if rule.parts > 1:
                    x = np.split(x, rule.parts, axis=-1)[rule.part]
                x = rule.to_jax(x)
                if tuple(x.shape) != tuple(true_shape):  # the table and config.json disagree: a bug, not bad input
                    raise HFError(f"{path}: tensor {name!r} maps to shape {x.shape}, expected {tuple(true_shape)}")
                if vocab_axis is not None and layer_shape[vocab_axis] != cfg.vocab_size:
                    pad = [(0, 0)] * x.ndim
                    pad[vocab_axis] = (0, layer_shape[vocab_axis] - cfg.vocab_size)
                    x = np.pad(x, pad)
                cache[key] = x.astype(dtype)
            return cache[key]

        def shard(index: tuple[slice, ...], rule=rule, layer_array=layer_array) -> np.ndarray:
            if not rule.stacked:
                return layer_array(None)[index]
            stack = range(*index[0].indices(shape[0]))
            layers = [order[i] if order is not None else i for i in stack]
            return np.stack([layer_array(int(layer))[index[1:]] for layer in layers])

        if placed is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            sharding = placed
            for k in key_path:
                sharding = sharding[k.key]
        return jax.make_array_from_callback(tuple(shape), sharding, shard)

    arrays = jax.tree_util.tree_map_with_path(load, like)
    # GPT-2 checkpoints may hold non-parameter buffers (attention masks); anything else left over is reported.
    ignored = {n for n in files.names() - used if n.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unused = files.names() - used - ignored
    if unused:
        raise HFError(f"{path}: tensors {sorted(unused)[:5]} are not used by the jaxpar {cfg.family} model — the "
                      "config.json does not describe these weights (an unsupported variant?)")
    params = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(params, arrays)
    return params


# -----------------------------------------------------------------------------------------------------------------
# Writing


def save_params(params: nnx.State, cfg: ModelConfig, path: str | pathlib.Path, *, base_config: dict | None = None,
                dtype: str | None = None, tokenizer: str | pathlib.Path | None = None, max_shard_bytes: int = 2 << 30,
                names: set[str] | None = None) -> pathlib.Path:
    """Write canonical `params` (layers in model order, as `jaxpar.train.checkpoint.read_canonical` gives them) as a
    Hugging Face directory `path`: config.json, safetensors shards of at most `max_shard_bytes` (one
    `model.safetensors` when it fits, else shards plus the index), and tokenizer.json when given. `dtype`: the
    tensors' dtype (default: the params'). `names`: the imported checkpoint's tensor names, to keep GPT-2's prefix.
    Parameters are fetched one layer at a time."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat: dict[str, Any] = {}
    jax.tree_util.tree_map_with_path(lambda kp, x: flat.__setitem__(".".join(str(k.key) for k in kp), x),
                                     nnx.to_pure_dict(params))
    by_name: dict[str, list[tuple[Rule, int | None]]] = {}  # HF tensor → the (rule, layer) pieces that make it
    for rule in _rules(cfg, names):
        for layer in (range(cfg.n_layers) if rule.stacked else (None,)):
            by_name.setdefault(rule.name.format(l=layer), []).append((rule, layer))

    def tensor(name: str) -> np.ndarray:
        parts = []
        for rule, layer in sorted(by_name[name], key=lambda piece: piece[0].part):
            x = flat[rule.param] if layer is None else flat[rule.param][layer]
            x = np.asarray(jax.device_get(x))
            if rule.param in ("embed", "lm_head"):
                x = x[:cfg.vocab_size] if rule.param == "embed" else x[:, :cfg.vocab_size]
            parts.append(rule.to_hf(x))
        x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
        return np.ascontiguousarray(x.astype(dtype) if dtype else x)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in by_name:  # table order: one parameter after another, each layer by layer
        x = tensor(name)
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    for old in list(path.glob("model*.safetensors")) + [path / INDEX]:
        old.unlink(missing_ok=True)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata=metadata)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata=metadata)
            weight_map.update({n: file for n in shard})
            total += sum(x.nbytes for x in shard.values())
        (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    first = next(iter(flat.values()))
    config = hf_config(cfg, base_config, dtype or str(np.dtype(first.dtype)))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        src = pathlib.Path(tokenizer)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (src / file).is_file():
                shutil.copyfile(src / file, path / file)
    return path


def checkpoint_names(path: str | pathlib.Path) -> set[str]:
    """The tensor names of a Hugging Face directory (to keep its naming when exporting)."""
    return SafetensorsDir(pathlib.Path(path)).names()



# -----------------------------------------------------------------------------------------------------------------
# Workdirs: import, export, and starting a training run from Hugging Face weights

SOURCE = "hf_source.json"  # written into an imported workdir: the HF config.json and tensor names, for export
_NUMERICS = ("dtype", "param_dtype", "attention")  # a run's own choices, not properties of the checkpoint


def init_config(config, path: str | pathlib.Path):
    """`config` with its model section taken from the Hugging Face directory `path` (keeping the run's dtype,
    param_dtype and attention kernel), `train.init_from_hf` set, and the directory's tokenizer.json as the
    tokenizer when the config uses the byte tokenizer. Validated like any config (e.g. heads vs tensor)."""
    path = pathlib.Path(path)
    model = model_config(read_config(path), path, **{k: getattr(config.model, k) for k in _NUMERICS})
    data = config.data
    if data.tokenizer == "bytes" and (path / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(path.absolute() / "tokenizer.json"))
    train = dataclasses.replace(config.train, init_from_hf=str(path.absolute()))
    return dataclasses.replace(config, model=model, data=data, train=train)


def check_matches(cfg: ModelConfig, path: str | pathlib.Path) -> None:
    """Raise ConfigError naming the first model field where `cfg` differs from the HF directory's config.json."""
    from jaxpar.config import ConfigError

    path = pathlib.Path(path)
    want = model_config(read_config(path), path, **{k: getattr(cfg, k) for k in _NUMERICS})
    for field in dataclasses.fields(ModelConfig):
        if field.name != "init_std" and getattr(cfg, field.name) != getattr(want, field.name):
            raise ConfigError(f"model.{field.name}", getattr(cfg, field.name),
                              f"differs from {path}/config.json, which implies {getattr(want, field.name)!r}",
                              "use `jaxpar train --init-from-hf DIR`, which takes the model section from DIR")


def import_to_workdir(src: str | pathlib.Path, dst: str | pathlib.Path, *, dtype: str | None = None) -> pathlib.Path:
    """Write the Hugging Face model `src` as a params-only jaxpar workdir `dst` (step 0): config.json, the
    checkpoint, its tokenizer.json, and hf_source.json (so that export reproduces the original names and config)."""
    from jaxpar.config import Config, DataConfig
    from jaxpar.train import checkpoint
    from jaxpar.train.state import abstract_model

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    hf_cfg = read_config(src)
    cfg = model_config(hf_cfg, src, **({"dtype": dtype, "param_dtype": dtype} if dtype else {}))
    _, abstract = abstract_model(cfg)
    params = load_params(src, cfg, abstract)
    dst.mkdir(parents=True, exist_ok=True)
    tokenizer = "bytes"
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
        tokenizer = str(dst.absolute() / "tokenizer.json")
    config = Config(model=cfg, data=DataConfig(tokenizer=tokenizer))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=min(128, cfg.max_seq_len)))
    (dst / SOURCE).write_text(json.dumps({"config": hf_cfg, "tensor_names": sorted(checkpoint_names(src))}, indent=1))
    checkpoint.write_params_only(dst, config, params, step=0)
    return dst


def export_workdir(src: str | pathlib.Path, dst: str | pathlib.Path, *, step: int | None = None,
                   dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> int:
    """Write checkpoint `step` (default: latest) of jaxpar workdir `src` as a Hugging Face directory `dst`.
    Returns the step. An imported workdir keeps its original config.json fields and tensor names."""
    from jaxpar.train import checkpoint

    src = pathlib.Path(src)
    config, params, step = checkpoint.read_canonical(src, step)
    source = json.loads((src / SOURCE).read_text()) if (src / SOURCE).is_file() else {}
    tokenizer = pathlib.Path(config.data.tokenizer)
    save_params(params, config.model, dst, base_config=source.get("config"), dtype=dtype,
                tokenizer=(tokenizer if tokenizer.is_dir() else tokenizer.parent) if tokenizer.exists() else None,
                max_shard_bytes=max_shard_bytes, names=set(source.get("tensor_names", ())) or None)
    return step
