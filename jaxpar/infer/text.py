"""Text in, text out: load a trained workdir onto a mesh and sample from it (the `jaxpar generate` command)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from jaxpar import data as data_lib
from jaxpar.config import Config, config_from_dict
from jaxpar.infer.sampling import generate
from jaxpar.mesh import make_mesh
from jaxpar.sharding import model_layout, param_shardings
from jaxpar.train import checkpoint
from jaxpar.train.state import abstract_model


@dataclasses.dataclass
class LoadedModel:
    config: Config
    model: nnx.Module  # params placed on `mesh`
    mesh: jax.sharding.Mesh
    tokenizer: data_lib.Tokenizer
    step: int


def load_workdir(workdir: str | pathlib.Path, *, devices: list | None = None, step: int | None = None) -> LoadedModel:
    """The trained model of a `jaxpar train` workdir, tensor-sharded as it was trained (data=1, pipe=1: one copy)."""
    workdir = pathlib.Path(workdir)
    config = config_from_dict(json.loads((workdir / "config.json").read_text()))
    devices = list(jax.devices() if devices is None else devices)
    tensor = config.parallel.tensor if len(devices) >= config.parallel.tensor else 1
    parallel = dataclasses.replace(config.parallel, data=1, pipe=1, tensor=tensor, repeats=1, microbatches=1,
                                   sequence_parallel=False)
    mesh = make_mesh(parallel, devices[:tensor])
    # Generation runs the plain model under jit on the sharded params (GSPMD inserts the collectives).
    layout = model_layout(config.model, parallel, mesh, explicit=False)
    graphdef, abstract = abstract_model(config.model, layout.padded_vocab)
    params, step = checkpoint.restore_params(workdir, abstract, layout, config.model.vocab_size,
                                             param_shardings(abstract, mesh, layout.rules), step=step)
    tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
    return LoadedModel(config, nnx.merge(graphdef, params), mesh, tokenizer, step)


def generate_text(loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int, seed: int = 0,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[str]:
    """Sample a continuation of each prompt (prompts are encoded to the same length; left-truncated if longer)."""
    encoded = [loaded.tokenizer.encode(p) for p in prompts]
    length = min(len(e) for e in encoded)
    if length == 0:
        raise ValueError("prompt is empty: give at least one character")
    prompt = np.array([e[len(e) - length:] for e in encoded], np.int32)  # [B, P]
    new = generate_tokens(loaded, prompt, max_new_tokens=max_new_tokens, seed=seed, temperature=temperature,
                          top_k=top_k, top_p=top_p)
    return [loaded.tokenizer.decode(row.tolist()) for row in new]


def generate_tokens(loaded: LoadedModel, prompt: np.ndarray, *, max_new_tokens: int, seed: int = 0,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """prompt int32 [B, P] → new tokens int32 [B, n], n = max_new_tokens unless every row stopped at eos."""
    graphdef, params = nnx.split(loaded.model)

    @jax.jit
    def logits_fn(tokens):  # [B, max_len] -> [B, max_len, V]
        return nnx.merge(graphdef, params)(tokens)

    with jax.set_mesh(loaded.mesh):
        new = generate(logits_fn, prompt, max_new_tokens=max_new_tokens, max_len=loaded.config.model.max_seq_len,
                       rng=jax.random.key(seed), temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=loaded.tokenizer.eos_id)
    return new
