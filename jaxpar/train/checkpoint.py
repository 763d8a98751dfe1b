"""Orbax checkpoints under WORKDIR/checkpoints/<step>/.

One format, used by training and generation alike. Each checkpoint holds two items:
- `params`: a plain nested dict of arrays in the canonical layout (`[layers, …]` stacks in model order), the part a
  sampler or a converter needs;
- `train`: step and optimizer state;
- `data`: the data loader's position (JSON), so a continued run sees the batches an uninterrupted one would.
Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save never leaves a
half-written step that looks finished. (Resume, preemption and restore-onto-any-layout semantics are the checkpoint
issue's; this module is the seam they will grow from.)
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.train.state import TrainState


def manager(workdir: str | pathlib.Path, keep: int = 3) -> ocp.CheckpointManager:
    path = pathlib.Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(path, options=options, item_names=("params", "train", "data"))


def save(mngr: ocp.CheckpointManager, state: TrainState, data_state: dict, *, wait: bool = True) -> None:
    """Save asynchronously (orbax copies device arrays to host first, then writes in the background)."""
    step = int(jax.device_get(state.step))
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
        train=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
        data=ocp.args.JsonSave(data_state))
    mngr.save(step, args=args)
    if wait:
        mngr.wait_until_finished()


def restore_train(mngr: ocp.CheckpointManager, like: TrainState, shardings: TrainState) -> tuple[TrainState, dict]:
    """Restore the latest (state, data loader state), placed like `like` with `shardings`."""
    step = mngr.latest_step()
    as_target = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    target = jax.tree.map(as_target, like, shardings)
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(nnx.to_pure_dict(target.params)),
        train=ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state}),
        data=ocp.args.JsonRestore()))
    params = jax.tree.map(lambda x: x, like.params)
    nnx.replace_by_pure_dict(params, restored["params"])
    train = restored["train"]
    return TrainState(step=train["step"], params=params, opt_state=train["opt_state"]), restored["data"]


def restore_params(workdir: str | pathlib.Path, abstract_params: nnx.State, shardings: nnx.State | None = None,
                   step: int | None = None) -> tuple[nnx.State, int]:
    """Load the params of checkpoint `step` (default: latest) into the structure of `abstract_params`, placed with
    `shardings` when given. Returns (params, step)."""
    mngr = manager(workdir)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {pathlib.Path(workdir) / 'checkpoints'}; run `jaxpar train` first")
    target = nnx.to_pure_dict(abstract_params)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), target)
    else:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              target, nnx.to_pure_dict(shardings))
    restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    params = jax.tree.map(lambda x: x, abstract_params)
    nnx.replace_by_pure_dict(params, restored["params"])
    return params, step
