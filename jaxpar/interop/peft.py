"""LoRA adapters as a PEFT directory (`jaxpar convert --from W --to-peft DIR`): `adapter_model.safetensors` and
`adapter_config.json`, which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face base model.

PEFT's LoRA layer adds scale·B·A x to a torch Linear y = W x (W [out, in]), with lora_A.weight [r, in], lora_B.weight
[out, r] and scale = lora_alpha / r. jaxpar's adapter on a weight [in…, out…] is A [in…, r], B [r, out…] (the input
dims flattened row-major, as the family's Hugging Face rule flattens them), so

    base_model.model.<module>.lora_A.weight = A.reshape(in, r).T        <module>: the HF tensor's name less ".weight"
    base_model.model.<module>.lora_B.weight = B.reshape(r, out).T       (model.layers.{l}.self_attn.q_proj, …)

— exactly when the family's rule for the weight is that plain transpose of [in, out] (checked on a probe array;
a fused tensor such as Phi-3's qkv_proj, or a permuted one, is refused by name).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.families import family
from jaxpar.store import checkpoint
from jaxpar.store.lock import Staged, check_new_output, check_outside

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def adapter_tensors(params: nnx.State, cfg) -> tuple[dict[str, np.ndarray], list[str]]:
    """(PEFT's tensors by name, the target module names) of a LoRA model's canonical state (layers in model
    order)."""
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0, dropout=0.0), weights="float")
    rules = {r.param: r for r in family(cfg).hf.tensors(plain, None)}
    pure, r = nnx.to_pure_dict(params), cfg.lora.rank
    tensors, modules = {}, set()
    for stack, layers in pure.items():
        if not isinstance(layers, dict):
            continue
        for name in sorted(n.removesuffix("_lora_a") for n in layers if n.endswith("_lora_a")):
            rule = rules.get(f"{stack}.{name}")
            a, b = np.asarray(layers[name + "_lora_a"], np.float32), np.asarray(layers[name + "_lora_b"], np.float32)
            shape = np.asarray(layers[name]).shape[1:]  # one layer's weight [in…, out…]
            n_in = a.ndim - 2
            if rule is None or not _is_transpose(rule, shape, n_in):
                raise ConfigError("lora.targets", list(cfg.lora.targets), f"{name} is not one Hugging Face Linear "
                                  "weight transposed (fused or permuted in this family), which PEFT's adapters "
                                  "assume", f"export merged weights with --to-hf, or adapt other matrices")
            module = rule.name.removesuffix(".weight")
            for j, layer in enumerate(rule.model_layers(cfg.n_layers)):
                key = "base_model.model." + module.format(l=layer)
                tensors[key + ".lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, r).T)
                tensors[key + ".lora_B.weight"] = np.ascontiguousarray(b[j].reshape(r, -1).T)
            modules.add(module.rsplit(".", 1)[-1])
    return tensors, sorted(modules)


def _is_transpose(rule, shape: tuple[int, ...], n_in: int) -> bool:
    """Whether the rule writes a weight [in…, out…] as W.reshape(in, out).T (a torch Linear's [out, in])."""
    probe = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    flat = probe.reshape(int(np.prod(shape[:n_in])), -1).T
    try:
        got = np.asarray(rule.to_hf(probe))
    except Exception:  # noqa: BLE001 — a rule that cannot take this shape is not a plain transpose
        return False
    return got.shape == flat.shape and bool((got == flat).all())


def export_peft(src: str | pathlib.Path, dst: str | pathlib.Path, *, step: int | None = None) -> int:
    """Write the LoRA adapters of checkpoint `step` (default: the latest) of workdir `src` as PEFT directory `dst`
    (written beside it and published whole: `Staged`). Returns the step."""
    from safetensors.numpy import save_file

    src = pathlib.Path(src)
    checkpoint.read_saved_config(src)
    check_outside(src, dst, "--to-peft")
    check_new_output(dst, "--to-peft")
    config, params, step = checkpoint.read_canonical(src, step)
    cfg = config.model
    if not cfg.lora.rank:
        raise ConfigError("lora.rank", 0, f"{src} was trained without adapters: there is nothing to write as PEFT",
                          "export its weights with --to-hf")
    tensors, modules = adapter_tensors(params, cfg)
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
                "lora_dropout": cfg.lora.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "inference_mode": True, "init_lora_weights": True,
                "base_model_name_or_path": config.train.init_from_hf or None}
    with Staged(pathlib.Path(dst), "--to-peft") as out:
        save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return step


__all__ = ["adapter_tensors", "export_peft"]
