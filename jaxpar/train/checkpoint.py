"""Orbax checkpoints under WORKDIR/checkpoints/<step>/.

One format, used by training and generation alike. Each checkpoint holds three items:
- `params`: a plain nested dict of arrays in the *canonical* layout — stacked layers `[layers, …]` in model order,
  vocab unpadded — whatever pipeline order or vocab padding the run used (`to_canonical` / `from_canonical`), so
  params restore onto any layout;
- `train`: step and optimizer state, its parameter-shaped parts (Adam's moments) canonical in the same way;
- `data`: the data loader's position (JSON), so a continued run sees the batches an uninterrupted one would.
Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save never leaves a
half-written step that looks finished. A checkpoint written at one (data, pipe, tensor, repeats, SP) layout restores
onto any other. (Preemption, corruption handling and ZeRO are the checkpoint issue's.)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import warnings
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.model import pad_vocab, permute_layers
from jaxpar.sharding import ModelLayout
from jaxpar.config import Config, config_from_dict
from jaxpar.train.state import TrainState, abstract_model

VOCAB_PARAMS = ("embed", "lm_head")


def to_canonical(params: nnx.State, layout: ModelLayout, vocab_size: int) -> nnx.State:
    """Runtime params → model layer order and the true vocab size."""
    if layout.layer_order is not None:
        params = permute_layers(params, np.argsort(layout.layer_order))
    return pad_vocab(params, vocab_size)


def from_canonical(params: nnx.State, layout: ModelLayout) -> nnx.State:
    """Canonical params → the layout's vocab padding and layer order."""
    params = pad_vocab(params, layout.padded_vocab)
    if layout.layer_order is not None:
        params = permute_layers(params, layout.layer_order)
    return params


ITEMS = ("params", "train", "data", "config")


def manager(workdir: str | pathlib.Path, keep: int = 3, permanent_every: int = 0) -> ocp.CheckpointManager:
    """The orbax CheckpointManager of WORKDIR/checkpoints: newest `keep` kept, plus multiples of `permanent_every`."""
    path = pathlib.Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=permanent_every or None, create=True)
    return ocp.CheckpointManager(path, options=options, item_names=ITEMS)


def restore_latest_good(mngr: ocp.CheckpointManager, restore: Callable[[int], object]) -> tuple[object, int]:
    """restore(step) for the newest step that restores; a damaged one (truncated or corrupt files) is reported with
    a warning naming its step, and the one before it is tried. Steps still being written are never listed: orbax
    writes into a temporary directory and renames it only when complete."""
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {mngr.directory}; run `jaxpar train` first")
    for step in steps:
        try:
            return restore(step), step
        except Exception as e:  # noqa: BLE001 — any failure to read a step means: use the previous one
            warnings.warn(f"checkpoint step {step} under {mngr.directory} is unreadable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); falling back to the previous checkpoint", stacklevel=2)
    raise RuntimeError(f"no readable checkpoint under {mngr.directory} (tried steps {steps})")


def save(mngr: ocp.CheckpointManager, state: TrainState, data_state: dict, layout: ModelLayout, config: dict, *,
         wait: bool = True) -> None:
    """Save asynchronously (orbax copies device arrays to host first, then writes in the background). `config` is
    the resolved config as a dict (stored beside the arrays; WORKDIR/config.json holds the newest)."""
    step = int(jax.device_get(state.step))
    vocab_size = config["model"]["vocab_size"]
    canonical = lambda p: nnx.to_pure_dict(to_canonical(p, layout, vocab_size))  # noqa: E731
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(canonical(state.params)),
        train=ocp.args.StandardSave({"step": state.step, "opt_state": _map_states(canonical, state.opt_state)}),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config))
    mngr.save(step, args=args)
    if wait:
        mngr.wait_until_finished()


def _canonical_target(like: nnx.State, shardings: nnx.State | None, vocab_size: int) -> dict:
    """Abstract canonical params to restore into: the runtime shardings, except that vocab-sized arrays (whose
    unpadded size need not divide `tensor`) come in replicated and are padded and resharded afterwards."""
    like, shardings = nnx.to_pure_dict(like), nnx.to_pure_dict(shardings) if shardings is not None else None

    def target(path, a):
        name = path[0].key
        shape = list(a.shape)
        if name in VOCAB_PARAMS:
            shape[0 if name == "embed" else 1] = vocab_size
        if shardings is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            s = _lookup(shardings, path)
            sharding = NamedSharding(s.mesh, P()) if name in VOCAB_PARAMS else s
        return jax.ShapeDtypeStruct(tuple(shape), a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, like)


def _lookup(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def restore_params(workdir: str | pathlib.Path, abstract_params: nnx.State, layout: ModelLayout, vocab_size: int,
                   shardings: nnx.State | None = None, step: int | None = None) -> tuple[nnx.State, int]:
    """Load the params of checkpoint `step` (default: latest) into the runtime layout of `abstract_params`, placed
    with `shardings` when given. Returns (params, step)."""
    mngr = manager(workdir)
    target = _canonical_target(abstract_params, shardings, vocab_size)
    read = lambda s: mngr.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))  # noqa: E731
    if step is not None:
        restored = read(step)
    else:
        restored, step = restore_latest_good(mngr, read)
    return _into_layout(restored["params"], abstract_params, layout, shardings), step


def _into_layout(canonical: dict, like: nnx.State, layout: ModelLayout, shardings: nnx.State | None) -> nnx.State:
    """Canonical arrays (as restored) → a State in the runtime layout, resharded like the training state."""
    params = jax.tree.map(lambda x: x, like)  # the State structure and metadata; values replaced next
    nnx.replace_by_pure_dict(params, canonical)
    return jax.jit(lambda p: from_canonical(p, layout), out_shardings=shardings)(params)


def _is_state(x) -> bool:
    return isinstance(x, nnx.State)


def _map_states(fn, opt_state):
    """Apply fn to every parameter-shaped nnx.State inside an optax state (Adam's mu and nu), leave the rest."""
    return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def restore_train(mngr: ocp.CheckpointManager, like: TrainState, shardings: TrainState, layout: ModelLayout,
                  vocab_size: int) -> tuple[TrainState, dict]:
    """Restore the latest readable (state, data loader state) into the layout of `like`, placed with `shardings` —
    whatever layout wrote it."""
    restored, _ = restore_latest_good(mngr, lambda step: _restore_train_step(mngr, step, like, shardings, layout,
                                                                             vocab_size))
    return restored


def _restore_train_step(mngr, step, like: TrainState, shardings: TrainState, layout: ModelLayout, vocab_size: int):
    def target(x, s):  # canonical targets for parameter-shaped States, plain ones for the rest (Adam's count, …)
        if _is_state(x):
            return _canonical_target(x, s, vocab_size)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    opt_target = jax.tree.map(target, like.opt_state, shardings.opt_state, is_leaf=_is_state)
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_canonical_target(like.params, shardings.params, vocab_size)),
        train=ocp.args.StandardRestore({"step": target(like.step, shardings.step), "opt_state": opt_target}),
        data=ocp.args.JsonRestore()))
    params = _into_layout(restored["params"], like.params, layout, shardings.params)
    opt_state = jax.tree.map(lambda x, canon, s: _into_layout(canon, x, layout, s) if _is_state(x) else canon,
                             like.opt_state, restored["train"]["opt_state"], shardings.opt_state, is_leaf=_is_state)
    return TrainState(step=restored["train"]["step"], params=params, opt_state=opt_state), restored["data"]


def read_canonical(workdir: str | pathlib.Path, step: int | None = None) -> tuple[Config, nnx.State, int]:
    """(config, canonical params on the default device, step) of checkpoint `step` (default: latest) of `workdir`."""
    workdir = pathlib.Path(workdir)
    config = config_from_dict(json.loads((workdir / "config.json").read_text()))
    _, abstract = abstract_model(config.model)
    params, step = restore_params(workdir, abstract, ModelLayout(padded_vocab=config.model.vocab_size),
                                  config.model.vocab_size, step=step)
    return config, params, step


def write_params_only(workdir: str | pathlib.Path, config: Config, params: nnx.State, step: int) -> None:
    """A params-only workdir: config.json and one checkpoint holding canonical `params` (what `jaxpar generate`,
    `restore_params` and the Hugging Face export read)."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json())
    mngr = manager(workdir)
    mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(params))))
    mngr.wait_until_finished()


def convert(src: str | pathlib.Path, dst: str | pathlib.Path, *, step: int | None = None,
            dtype: str | None = None) -> int:
    """Write a params-only export of checkpoint `step` (default: latest) of workdir `src` as workdir `dst`:
    canonical params, optionally cast to `dtype`, and its config.json. A layout change needs no conversion — any
    layout restores these — so this is for handing a model on (to `jaxpar generate`, to a finetune). Returns the
    step exported."""
    config, params, step = read_canonical(src, step)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, param_dtype=dtype))
    write_params_only(dst, config, params, step)
    return step
