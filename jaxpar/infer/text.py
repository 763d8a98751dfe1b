"""Load a model for inference — a `jaxpar train` workdir or a Hugging Face directory — onto a (data, tensor) mesh,
and generate: token ids in and out (`LoadedModel.generate`, shaped like Hugging Face's), or text through the
tokenizer (`generate_text`, the `jaxpar generate` command).

Inference uses `data` for independent prompts and `tensor` for the Megatron split of each layer; there is no
pipeline (pipe = 1). Parameters are placed straight onto that layout (checkpoints and HF files are layout-free), and
generation runs under the same explicit collectives as training (`explicit=False`: GSPMD, for comparison).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxpar import data as data_lib
from jaxpar.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, check_layout
from jaxpar.errors import GenerateError, InputNotFound
from jaxpar.infer import decode
from jaxpar.infer.sampling import check_sampling_args
from jaxpar.interop import hf
from jaxpar.model import abstract_model, quantize_state
from jaxpar.plan import Plan, make_plan
from jaxpar.sharding import param_shardings
from jaxpar.store import checkpoint


@dataclasses.dataclass
class LoadedModel:
    """A model placed on its inference mesh, with its tokenizer (None when the directory has none)."""

    config: Config  # the run's config as saved (an HF directory's: its model), the model as loaded (dtype,
    # quantization); the inference layout is `plan`'s
    model: nnx.Module  # params placed on `mesh`
    mesh: jax.sharding.Mesh
    tokenizer: data_lib.Tokenizer | None
    step: int | None  # the checkpoint step (None for a Hugging Face directory)
    eos_token_id: tuple[int, ...] = ()  # the default stop tokens
    hf_config: dict | None = None  # the imported config.json, kept for export
    plan: Plan | None = None  # the layout; explicit: generation runs its shard_map (else GSPMD partitions)

    def generate(self, input_ids: Sequence[Sequence[int]] | np.ndarray, **kwargs) -> np.ndarray:
        """`jaxpar.infer.decode.generate` on this model and mesh; eos_token_id defaults to the model's."""
        kwargs.setdefault("eos_token_id", self.eos_token_id or None)
        return decode.generate(self.model, input_ids, mesh=self.mesh, plan=self.plan, **kwargs)


def load(path: str | pathlib.Path, *, data: int = 1, tensor: int | None = None, devices: list | None = None,
         step: int | None = None, dtype: str | None = None, explicit: bool = True, sequence_parallel: bool = False,
         overlap: str = "none", quantize: str | None = None, group_size: int | None = None) -> LoadedModel:
    """Load a `jaxpar train` workdir (checkpoint `step`, default latest) or a Hugging Face model directory onto a
    (data, pipe=1, tensor) mesh of the first data·tensor `devices`. tensor=None: the training run's tensor degree
    (1 for an HF directory) when there are devices for it. dtype: compute and parameter dtype (default: as saved).
    explicit: generate under the training step's explicit collectives (shard_map, the vocab-parallel sampler);
    False leaves the partitioning to GSPMD (the comparison baseline). sequence_parallel, overlap: the prefill's
    layout, as `parallel.sequence_parallel` / `parallel.overlap` ('collective_matmul') in training; decode steps
    (one token a row) run plain tensor parallelism.
    quantize: 'int8' or 'int4' — store the layers' weight matrices quantized (`ModelConfig.weights`; int4 in groups
    of `group_size`, default the largest up to 128 that divides every quantized width and that `tensor` splits
    into whole groups: `loaded.config.model.weights_label` names it), quantized on the devices after loading; a
    workdir written by `jaxpar convert --quantize` loads as it is stored (asking it for another format is a
    ConfigError: it would quantize twice), at the saved tensor degree or the largest divisor of it that keeps its
    int4 groups whole.
    A layout the model cannot take (heads not divisible by tensor, int4 groups a tensor rank would split, …) is a
    ConfigError naming the field.
    """
    path = pathlib.Path(path)
    devices = list(jax.devices() if devices is None else devices)
    hf_cfg = None
    if hf.is_hf_dir(path):
        hf_cfg = hf.read_config(path)
        overrides = {"dtype": dtype, "param_dtype": dtype} if dtype else {}
        model_cfg = hf.model_config(hf_cfg, path, **overrides)
        tokenizer_spec = str(path) if (path / "tokenizer.json").is_file() else "bytes"
        saved = Config(model=model_cfg, data=DataConfig(tokenizer=tokenizer_spec))
        default_tensor = 1
    else:
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "holds no config.json"
            raise InputNotFound(f"{path} {what}: pass a jaxpar workdir (config.json + checkpoints/) or a Hugging Face "
                                "model directory (config.json + *.safetensors)")
        saved = checkpoint.read_saved_config(path)
        if dtype:
            saved = dataclasses.replace(saved, model=dataclasses.replace(saved.model, dtype=dtype, param_dtype=dtype))
        model_cfg = saved.model
        default_tensor = saved.parallel.tensor
    stored = model_cfg
    if tensor is None:
        tensor = default_tensor if len(devices) >= data * default_tensor else 1
        if model_cfg.weights == "int4" and quantize is None:  # stored int4: a degree that keeps its groups whole
            tensor = max(t for t in range(1, tensor + 1) if tensor % t == 0 and _groups_whole(model_cfg, t))
    for name, value in (("data", data), ("tensor", tensor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"parallel.{name}", value, "must be a positive integer", f"pass --{name} 1 or more")
    model_cfg = _quantized(model_cfg, quantize, group_size, tensor)
    if data * tensor > len(devices):
        name, value = ("parallel.data", data) if data > len(devices) else ("parallel.tensor", tensor)
        raise ConfigError(name, value, f"data*tensor = {data}*{tensor} needs more than the "
                          f"{len(devices)} available devices", f"use data*tensor <= {len(devices)}")
    parallel = ParallelConfig(data=data, pipe=1, tensor=tensor, sequence_parallel=sequence_parallel, overlap=overlap)
    check_layout(model_cfg, parallel)  # the model against this layout; the run's training fields play no part
    config = dataclasses.replace(saved, model=model_cfg)
    plan = make_plan(model_cfg, parallel, devices[:data * tensor], explicit=explicit)
    mesh = plan.mesh
    graphdef, abstract = abstract_model(plan.model, plan.padded_vocab)  # attention resolved for these devices
    shardings = param_shardings(abstract, mesh, plan.rules)
    quantizing = model_cfg != stored  # here: read the float weights onto the mesh, then quantize each shard
    read_like, read_shardings = abstract, shardings
    if quantizing:
        _, read_like = abstract_model(dataclasses.replace(plan.model, weights=stored.weights), plan.padded_vocab)
        read_shardings = param_shardings(read_like, mesh, plan.rules)
    if hf_cfg is not None:
        params, at_step = hf.load_params(path, stored, read_like, plan, read_shardings), None
    else:
        params, at_step = checkpoint.restore_params(path, read_like, plan, model_cfg.vocab_size, read_shardings,
                                                    step=step)
    if quantizing:
        params = quantize_state(params, plan.model, shardings)
    tokenizer = data_lib.make_tokenizer(config.data.tokenizer) if config.data.tokenizer else None
    return LoadedModel(config, nnx.merge(graphdef, params), mesh, tokenizer, at_step, _stop_ids(path, hf_cfg, tokenizer),
                       hf_cfg, plan)


def _quantized(cfg: ModelConfig, quantize: str | None, group_size: int | None, tensor: int = 1) -> ModelConfig:
    """The model config to run: `cfg` as stored, or quantized to `quantize` (validated: ConfigError). int4 without
    a `group_size` on a float model: the largest group up to 128 that divides every quantized matrix's width
    (`ModelConfig.int4_groups`) and that a `tensor`-way split leaves whole on each rank (`plan._check_scales`, the
    rule `make_plan` applies); an explicit `group_size` is taken as given, and refused if it does not fit."""
    if quantize is None and group_size is None:
        return cfg
    if quantize not in ("int8", "int4"):
        raise ConfigError("quantize", quantize, "must be 'int8' or 'int4' (group_size needs one of them)",
                          "pass quantize='int8' (a scale per output channel) or 'int4' (per group_size inputs)")
    if cfg.weights == "float":
        if quantize == "int4" and group_size is None:
            group_size = _default_group(cfg, tensor)
        return checkpoint.quantize_config(cfg, quantize, group_size)
    if (quantize, group_size) not in ((cfg.weights, None), (cfg.weights, cfg.weight_group)):
        stored = cfg.weights + (f" in groups of {cfg.weight_group}" if cfg.weights == "int4" else "")
        raise ConfigError("quantize", quantize + (f" in groups of {group_size}" if group_size else ""),
                          f"this model is stored quantized as {stored}: quantizing it again would compound the "
                          "rounding", "load it as stored (no quantize), or quantize the float model it came from")
    return cfg


def _default_group(cfg: ModelConfig, tensor: int) -> int | None:
    """The largest int4 group (up to 128) of `cfg` whose scales a `tensor`-way split leaves whole; None when none
    does (`quantize_config` then names what does not fit)."""
    return next((g for g in cfg.int4_groups()
                 if _groups_whole(dataclasses.replace(cfg, weights="int4", weight_group=g), tensor)), None)


def _groups_whole(model: ModelConfig, tensor: int) -> bool:
    """Whether a `tensor`-way split leaves each rank whole int4 groups of `model` (the rule `make_plan` applies)."""
    from jaxpar.parallel.axes import AXES
    from jaxpar.plan import _check_scales, plan_rules

    degrees = {**{a: 1 for a in AXES}, "tensor": tensor}
    if model.n_heads % tensor or model.d_ff % tensor:
        return False
    try:
        _check_scales(model, dict(plan_rules(model, degrees)), degrees)
    except ConfigError:
        return False
    return True


def _stop_ids(path: pathlib.Path, hf_cfg: dict | None, tokenizer) -> tuple[int, ...]:
    """Default stop tokens: an HF directory's generation_config.json / config.json eos_token_id, else the
    tokenizer's eos."""
    if hf_cfg is not None:
        generation = path / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        eos = hf_cfg.get("eos_token_id") if eos is None else eos
        if eos is not None:
            return tuple(int(i) for i in np.atleast_1d(eos))
    eos = getattr(tokenizer, "eos_id", None)
    return () if eos is None else (int(eos),)


def generate_text(loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int, seed: int = 0,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  stop: Sequence[int] | None = None) -> list[str]:
    """Continue each prompt (any lengths) and return the new text. temperature 0 is greedy; `stop` overrides the
    model's stop tokens (an empty list: none), whose text is not included. A request without meaning (no prompts,
    an empty or non-UTF-8 prompt, a negative or NaN temperature, …) is a GenerateError."""
    if loaded.tokenizer is None:
        raise GenerateError("this model directory has no tokenizer.json: pass token ids to LoadedModel.generate")
    if isinstance(prompts, str) or not prompts:
        raise GenerateError(f"prompts = {prompts!r}: must be a non-empty list of strings (one per sample)")
    check_sampling_args(temperature, top_k, top_p)  # before temperature > 0 picks sampling: NaN/negative refused
    encoded = []
    for i, prompt in enumerate(prompts):
        try:
            encoded.append(loaded.tokenizer.encode(prompt))
        except UnicodeEncodeError as e:
            raise GenerateError(f"prompt {i} is not valid UTF-8 text (character {e.start}: "
                                f"{prompt[e.start:e.end]!r}); pass UTF-8 text") from None
        if len(encoded[-1]) == 0:
            raise GenerateError(f"prompt {i} is empty: give at least one character")
    stop_ids = tuple(loaded.eos_token_id if stop is None else stop)
    new = loaded.generate(encoded, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                          temperature=temperature or 1.0, top_k=top_k, top_p=top_p, eos_token_id=stop_ids or None,
                          seed=seed, return_prompt=False)
    texts = []
    for row in new.tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        texts.append(loaded.tokenizer.decode(row[:cut]))
    return texts


def held_out_loss(loaded: LoadedModel, windows: np.ndarray, *, batch: int = 8) -> float:
    """Mean next-token loss in nats of `windows` int [N, T+1] (e.g. held-out text) under the loaded model and
    layout: the prefill logits of windows[:, :-1], `batch` rows at a time (a multiple of the data degree), against
    windows[:, 1:], the log-softmax in float64 on the host. How quantized weights are judged against float ones."""
    windows = np.asarray(windows)
    data = loaded.plan.degrees["data"]
    if windows.ndim != 2 or windows.shape[1] < 2 or len(windows) % data or batch % data:
        raise GenerateError(f"windows of shape {windows.shape} and batch {batch}: need [N, T+1] with T >= 1 and N, "
                            f"batch multiples of the data degree {data}")
    total = 0.0
    for i in range(0, len(windows), batch):
        rows = windows[i:i + batch]
        logits = decode.explicit_prefill_logits(loaded.model, loaded.plan, rows[:, :-1].astype(np.int32))
        total += next_token_nll(logits, rows[:, 1:]) * rows[:, 1:].size
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def next_token_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean loss in nats of logits [B, T, V] against targets int [B, T], the log-softmax in float64."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return float((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean())


def generate_tokens(loaded: LoadedModel, prompt: np.ndarray, *, max_new_tokens: int, seed: int = 0,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """prompt int32 [B, P] → new tokens int32 [B, n] (KV-cache decoding; n = max_new_tokens unless every row
    stopped at the model's eos)."""
    check_sampling_args(temperature, top_k, top_p)
    return loaded.generate(np.asarray(prompt), max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                           temperature=temperature or 1.0, top_k=top_k, top_p=top_p, seed=seed, return_prompt=False)
