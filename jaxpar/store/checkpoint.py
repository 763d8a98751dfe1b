"""Orbax checkpoints under WORKDIR/checkpoints/<step>/.

One format, used by training and generation alike. Each checkpoint holds three items:
- `params`: a plain nested dict of arrays in the *canonical* layout — stacked layers `[layers, …]` in model order,
  vocab unpadded — whatever pipeline order or vocab padding the run used (`Plan.to_canonical` / `from_canonical`), so
  params restore onto any layout;
- `train`: step and optimizer state, its parameter-shaped parts (Adam's moments) canonical in the same way;
- `data`: the data loader's position (JSON), so a continued run sees the batches an uninterrupted one would;
- `config`: the resolved config that wrote it (a resumed run must be compatible: `check_resumable`);
- `checksums`: a layout-independent 64-bit fingerprint of every array above (`jaxpar.store.fingerprint`) and a
  SHA-256 of the data item, computed from the values being written (the config item is only compared, never
  restored into the run).
Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save never leaves a
half-written step that looks finished. A checkpoint written at one (data, pipe, tensor, repeats, SP) layout restores
onto any other.

Damage is anything that stops a step from restoring exactly: missing or truncated files, undecodable data, or
values whose fingerprint differs from the stored one (bit rot that still decodes). Training falls back to the
newest step that restores exactly and moves each damaged step aside to WORKDIR/damaged-checkpoints/ (kept for
inspection, never deleted), so the step is trained again and saved again; readers (generate, convert, export) fall
back the same way but leave the workdir as it is. Every fallback is a warning naming the step and the array.
A save that orbax does not perform is an error, never a silent no-op.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import time
import warnings
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import Config, ConfigError, ModelConfig, config_from_dict
from jaxpar.errors import CheckpointError, InputNotFound
from jaxpar.model import abstract_model, buffers_of, merge_state, quantize_state, trainable
from jaxpar.plan import Plan, make_plan
from jaxpar.sharding import vocab_dim
from jaxpar.store import quiet
from jaxpar.store.fingerprint import fingerprints, leaf_path
from jaxpar.store.lock import Staged, check_new_output, check_outside


class TrainState(Protocol):
    """What `save` writes and `restore_train` rebuilds: `jaxpar.train.state.TrainState` (a flax.struct dataclass).
    Described by its fields, not imported, because the store sits below the training stack that uses it."""

    step: jax.Array  # int32 []
    params: nnx.State
    opt_state: Any

    def replace(self, **fields) -> TrainState:
        """A copy with `fields` replaced (flax.struct dataclasses have it)."""


ITEMS = ("params", "train", "data", "config", "checksums")
DAMAGED = "damaged-checkpoints"  # WORKDIR/damaged-checkpoints/<step>-<time>: steps that failed to restore exactly


def manager(workdir: str | pathlib.Path, keep: int = 3, permanent_every: int = 0) -> ocp.CheckpointManager:
    """The orbax CheckpointManager of WORKDIR/checkpoints: newest `keep` kept, plus multiples of `permanent_every`."""
    path = pathlib.Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=permanent_every or None, create=True)
    return ocp.CheckpointManager(path, options=options, item_names=ITEMS)


class Damaged(Exception):
    """A step whose restored values differ from the checksums stored with it."""


class Mismatch(Exception):
    """A step whose arrays' shapes or names (from its metadata) are not the ones the reader's config describes."""


def _check_stored_shapes(mngr: ocp.CheckpointManager, step: int, item: str, target) -> None:
    """Raise Mismatch naming the first array of `item` whose stored shape (from the step's metadata, no data read)
    differs from `target`'s, or that one of them lacks — before orbax restores anything: orbax's own refusal comes
    from its background threads, with tracebacks on stderr and a fix (`strict=False`) that is not the user's."""
    try:
        meta = ocp.StandardCheckpointHandler().metadata(pathlib.Path(mngr.directory) / str(step) / item)
    except Exception as e:  # noqa: BLE001 — unreadable metadata: damaged, like unreadable data
        raise Damaged(f"{item}: its metadata cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})") \
            from None
    shapes = lambda tree: {leaf_path(p): tuple(x.shape)  # noqa: E731
                           for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    stored, wanted = shapes(getattr(meta, "tree", meta)), shapes(target)
    for path in sorted(stored.keys() | wanted.keys()):
        if stored.get(path) != wanted.get(path):
            if path not in stored:
                what = "the config describes it, the step does not hold it"
            elif path not in wanted:
                what = f"the step holds it {stored[path]}, the config does not describe it"
            else:
                what = f"{stored[path]} in the step, {wanted[path]} by the config"
            raise Mismatch(f"{item}/{path}: {what} — the workdir's config.json does not match its checkpoints")


def restore_latest_good(mngr: ocp.CheckpointManager, restore: Callable[[int], object], *,
                        quarantine: bool = False) -> tuple[object, int]:
    """restore(step) for the newest step that restores exactly; a damaged one (missing, truncated or undecodable
    files, or values that fail their checksums) is reported with a warning naming its step and what failed, and the
    one before it is tried. Steps still being written are never listed: orbax writes into a temporary directory and
    renames it only when complete. Every process sees the same outcome.

    A reader races the cleanup of a run still training there (`checkpoint.keep`): the step it picked can be deleted
    while it reads it, and the older ones with it. A step that fails and has meanwhile disappeared, or been
    superseded by a newer one, is not damaged: the listing is read again and the newest step tried (up to
    `_RESTARTS` times), without a warning.

    With `quarantine` (the training run, which will save those steps again) the damaged steps newer than the one
    that restored are moved aside to WORKDIR/damaged-checkpoints/. Nothing moves unless an older step restores:
    when every step fails, the cause is more likely the reader than the data (a changed optimizer, too little
    memory), so the workdir is left as it is and the error names what failed."""
    steps = _listed_steps(mngr)
    if not steps:
        raise CheckpointError(f"no checkpoint under {mngr.directory}; run `jaxpar train` first")
    failed: list[tuple[int, str]] = []
    restarts, i = 0, 0
    while i < len(steps):
        step = steps[i]
        try:
            result, problem = restore(step), ""
        except Exception as e:  # noqa: BLE001 — any failure to read a step means: use the previous one
            detail = " ".join(str(e).split())[:300]
            result, problem = None, detail if isinstance(e, (Damaged, Mismatch)) else f"{type(e).__name__}: {detail}"
        if _all_processes_ok(not problem):
            for bad, why in failed:
                where = f"; moved to {_quarantine(mngr, bad)}" if quarantine else ""
                warnings.warn(f"checkpoint step {bad} under {mngr.directory} is damaged ({why}){where}; fell back "
                              f"to step {step}", stacklevel=2)
            return result, step
        if restarts < _RESTARTS and not _all_processes_ok(not _superseded(mngr, step, steps)):
            restarts += 1  # deleted under us by a run's cleanup: start again from the newest step there is now
            steps = [s for s in _listed_steps(mngr) if s not in {bad for bad, _ in failed}]
            i = 0
            continue
        failed.append((step, problem or "damaged on another process"))
        i += 1
    if not failed:  # every step listed was deleted while it was read
        raise CheckpointError(f"the checkpoints under {mngr.directory} were deleted while being read "
                              f"({restarts} times): a run is saving and removing them faster than they can be read "
                              "(checkpoint.keep); read again, or raise checkpoint.keep")
    raise CheckpointError(f"no checkpoint under {mngr.directory} restores (steps {[s for s, _ in failed]}; step "
                          f"{failed[0][0]}: {failed[0][1][:200]}); nothing was moved. If the config changed, restore "
                          "it; else inspect the files or start a new --workdir")


_RESTARTS = 50  # how often a reader starts again from the newest step when the one it read was deleted meanwhile


def _listed_steps(mngr: ocp.CheckpointManager, wait: bool = True) -> list[int]:
    """The manager's steps, newest first, read from the disk again (`reload`). A step deleted while the listing is
    read (a run's cleanup) makes orbax raise FileNotFoundError: the listing is read again. With `wait`, an empty
    listing while a save is under way (a run's cleanup can remove the old step before the new one is listed) waits
    up to ~3 s for that save."""
    for attempt in range(10):
        steps = _reload(mngr)
        if steps or not wait or not _saving(mngr):
            return steps
        time.sleep(0.05 * (attempt + 1))
    return _reload(mngr)


def _reload(mngr: ocp.CheckpointManager) -> list[int]:
    for attempt in range(20):
        try:
            mngr.reload()
            return sorted(mngr.all_steps(), reverse=True)
        except (FileNotFoundError, NotADirectoryError):  # a step directory deleted while orbax listed it
            time.sleep(0.01 * (attempt + 1))
    mngr.reload()
    return sorted(mngr.all_steps(), reverse=True)


def _saving(mngr: ocp.CheckpointManager) -> bool:
    """True when the checkpoints directory holds a step orbax is still writing (its temporary directory)."""
    try:
        return any(".orbax-checkpoint-tmp" in p.name for p in pathlib.Path(mngr.directory).iterdir())
    except OSError:
        return False


def _superseded(mngr: ocp.CheckpointManager, step: int, listed: list[int]) -> bool:
    """True when step `step`, which failed to restore, was deleted meanwhile, or a step newer than every one in
    `listed` has appeared: the failure is the race with a run's cleanup, not damage."""
    if not (pathlib.Path(mngr.directory) / str(step)).is_dir():
        return True
    try:
        now = _listed_steps(mngr, wait=False)
    except Exception:  # noqa: BLE001 — a listing that keeps failing says nothing about this step
        return False
    return step not in now or bool(now and listed and now[0] > listed[0])


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _quarantine(mngr: ocp.CheckpointManager, step: int) -> pathlib.Path:
    """Move step `step` out of the manager's view (process 0 moves it; everyone reloads)."""
    src = pathlib.Path(mngr.directory) / str(step)
    dst = pathlib.Path(mngr.directory).parent / DAMAGED / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
    if jax.process_index() == 0 and src.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jaxpar quarantine {step}")
    mngr.reload()
    return dst


def _json_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _array_sums(tree) -> dict:
    """{path: {"fp": fingerprint, "dtype": dtype}} of every array in the pytree `tree`."""
    dtypes = {leaf_path(path): str(np.dtype(x.dtype)) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return {path: {"fp": fp, "dtype": dtypes[path]} for path, fp in fingerprints(tree).items()}


def _with_saved_dtypes(target, sums: dict | None):
    """Restore targets at the dtype each array was saved in (so it can be verified bit for bit; `_into_layout`
    then casts to the run's dtype). Without stored checksums the targets stay as they are."""
    if not sums:
        return target

    def retype(path, t):
        entry = sums.get(leaf_path(path))
        return jax.ShapeDtypeStruct(t.shape, np.dtype(entry["dtype"]), sharding=t.sharding) if entry else t

    return jax.tree_util.tree_map_with_path(retype, target)


def _verify(item: str, restored, stored: dict) -> None:
    """Raise Damaged naming the arrays of `item` whose fingerprints differ from the stored ones."""
    found = fingerprints(restored)
    bad = sorted(p for p in stored if found.get(p) != stored[p]["fp"])
    missing = sorted(set(found) - set(stored))
    if bad or missing:
        names = ", ".join(f"{item}/{p}" for p in (bad or missing)[:4])
        raise Damaged(f"{names} {'fail their checksums' if bad else 'have no stored checksum'}"
                      f"{f' (and {len(bad) - 4} more)' if len(bad) > 4 else ''}")


def _read_checksums(mngr: ocp.CheckpointManager, step: int) -> dict | None:
    """The step's stored checksums, or None for a checkpoint written before jaxpar stored them (not verified). A
    step whose orbax metadata lists a `checksums` item that is not there is damaged (verification must not be
    switched off by deleting it)."""
    step_dir = pathlib.Path(mngr.directory) / str(step)
    if not (step_dir / "checksums").exists():
        try:
            items = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
        except (OSError, ValueError, KeyError, TypeError):
            items = None
        if items is None or "checksums" in items:
            raise Damaged("the checksums item is missing")
        warnings.warn(f"checkpoint step {step} under {mngr.directory} has no checksums (written by an older jaxpar): "
                      "its values cannot be verified", stacklevel=3)
        return None
    return mngr.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))["checksums"]


def save(mngr: ocp.CheckpointManager, state: TrainState, data_state: dict, layout: Plan, config: dict, *,
         wait: bool = True) -> None:
    """Save asynchronously (orbax copies device arrays to host first, then writes in the background), with the
    checksums of the exact values written. `config` is the resolved config as a dict (stored beside the arrays;
    WORKDIR/config.json holds the newest). Raises CheckpointError if orbax declines to save the step."""
    step = int(jax.device_get(state.step))
    canonical = lambda p: nnx.to_pure_dict(layout.to_canonical(p))  # noqa: E731
    params = canonical(state.params)
    train = {"step": state.step, "opt_state": _map_states(canonical, state.opt_state)}
    checksums = {"params": _array_sums(params), "train": _array_sums(train), "data": _json_digest(data_state)}
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        train=ocp.args.StandardSave(train),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config),
        checksums=ocp.args.JsonSave(checksums))
    _save(mngr, step, args)
    if wait:
        mngr.wait_until_finished()


def _save(mngr: ocp.CheckpointManager, step: int, args) -> None:
    if not mngr.save(step, args=args):
        raise CheckpointError(f"checkpoint step {step} under {mngr.directory} was not saved: orbax declined it "
                              f"(the newest saved step is {mngr.latest_step()}); nothing was overwritten")


def stored_config(mngr: ocp.CheckpointManager, workdir: str | pathlib.Path) -> dict | None:
    """The config (as a dict) that wrote the newest checkpoint: its `config` item, else WORKDIR/config.json."""
    step = mngr.latest_step()
    if step is not None:
        try:
            return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception:  # noqa: BLE001 — a damaged item: config.json is the next best witness
            pass
    file = pathlib.Path(workdir) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


# Fields a resumed run may change: numerics of the forward pass, layout, schedule, budget and cadence. Everything
# else in `model` changes the weights' shapes or the function they compute; `train.{batch_size, seq_len, seed}` and
# `data` define the batch stream whose position the checkpoint holds.
_RESUMABLE_MODEL = ("dtype", "param_dtype", "attention", "init_std", "scan_unroll", "matmul")
_STREAM = {"train": ("batch_size", "seq_len", "seed"), "data": ("source", "path", "tokenizer")}


def check_resumable(saved: dict, config: Config, workdir: str | pathlib.Path) -> None:
    """Raise ConfigError naming every field in which `config` differs from the config that wrote the workdir's
    checkpoints in a way that resuming cannot honour (the model's architecture, the data stream), and how to
    proceed: restore the value, or start a new workdir (keeping the weights through a Hugging Face export when
    only the data stream changed)."""
    now = config.to_dict()
    model = [f for f in now["model"] if f not in _RESUMABLE_MODEL and saved.get("model", {}).get(f) != now["model"][f]]
    stream = [f"{section}.{f}" for section, fields in _STREAM.items() for f in fields
              if saved.get(section, {}).get(f) != now[section][f]]
    if (saved.get("train", {}).get("grad_clip", 0) > 0) != (config.train.grad_clip > 0):
        stream.append("train.grad_clip")  # clipping on/off changes the optimizer state's structure
    changed = [f"model.{f}" for f in model] + stream
    if not changed:
        return
    value = lambda d, dotted: d.get(dotted.split(".")[0], {}).get(dotted.split(".")[1])  # noqa: E731
    first = changed[0]
    diffs = ", ".join(f"{f} {value(saved, f)!r} → {value(now, f)!r}" for f in changed)
    if model:
        rule = f"differs from the checkpoints in {workdir}, which were written with other weights' shapes or math"
        fix = "restore the checkpoint's values, or pass a new --workdir to start a different model from scratch"
    elif first == "train.grad_clip":
        rule = (f"differs from the checkpoints in {workdir}: switching gradient clipping on or off changes the "
                "structure of the optimizer state they hold")
        fix = ("keep clipping on (any positive value) or off as it was; or keep the weights in a new run: "
               f"`jaxpar convert --from {workdir} --to-hf DIR`, then `jaxpar train --init-from-hf DIR --workdir NEW`")
    else:
        rule = f"differs from the checkpoints in {workdir}, whose saved data position counts batches of the old stream"
        fix = ("restore the checkpoint's values; or keep the weights in a new run: `jaxpar convert --from "
               f"{workdir} --to-hf DIR`, then `jaxpar train --init-from-hf DIR --workdir NEW`")
    raise ConfigError(first, value(now, first), f"{rule} (changed: {diffs})", fix)


def _canonical_target(like: nnx.State, shardings: nnx.State | None, vocab_size: int) -> dict:
    """Abstract canonical params to restore into: the runtime shardings, except that vocab-sized arrays (whose
    unpadded size need not divide `tensor`) come in replicated and are padded and resharded afterwards."""
    state, like = like, nnx.to_pure_dict(like)
    shardings = nnx.to_pure_dict(shardings) if shardings is not None else None

    def target(path, a):
        shape, dim = list(a.shape), vocab_dim(_lookup(state, path))  # the parameter's `vocab` logical axis
        if dim is not None:
            shape[dim] = vocab_size
        if shardings is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            s = _lookup(shardings, path)
            sharding = NamedSharding(s.mesh, P()) if dim is not None else s
        return jax.ShapeDtypeStruct(tuple(shape), a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, like)


def _lookup(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def restore_params(workdir: str | pathlib.Path, abstract_params: nnx.State, layout: Plan, vocab_size: int,
                   shardings: nnx.State | None = None, step: int | None = None) -> tuple[nnx.State, int]:
    """Load the params of checkpoint `step` (default: the newest that restores exactly) into the runtime layout of
    `abstract_params`, placed with `shardings` when given, verified against their checksums. Returns (params,
    step). A named step that is missing or damaged is a CheckpointError; read-only: nothing in the workdir moves."""
    _require_workdir(workdir)  # a clear error for a path that is not a workdir (before orbax creates anything)
    mngr = _reader_manager(workdir)

    def read(s: int) -> dict:
        sums = _read_checksums(mngr, s)
        target = _with_saved_dtypes(_canonical_target(abstract_params, shardings, vocab_size), sums and sums["params"])
        _check_stored_shapes(mngr, s, "params", target)
        restored = mngr.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
        if sums is not None:
            _verify("params", restored, sums["params"])
        return restored

    try:
        if step is not None:
            if step not in mngr.all_steps():
                raise CheckpointError(f"checkpoint step {step} is not in {mngr.directory} (it holds steps "
                                      f"{sorted(mngr.all_steps())}); pass one of those, or none for the newest")
            try:
                restored = read(step)
            except Exception as e:  # noqa: BLE001 — whatever fails, the step asked for cannot be served
                if not (pathlib.Path(mngr.directory) / str(step)).is_dir():
                    raise CheckpointError(f"checkpoint step {step} under {mngr.directory} was deleted while being "
                                          "read (a run's cleanup: checkpoint.keep); pass a step it keeps, or none "
                                          "for the newest") from None
                what = "does not match the config" if isinstance(e, Mismatch) else "is damaged"
                raise CheckpointError(f"checkpoint step {step} under {mngr.directory} {what} "
                                      f"({' '.join(str(e).split())[:300]}); pass another step") from None
        else:
            restored, step = restore_latest_good(mngr, read)
    finally:
        mngr.close()
    return _into_layout(restored, abstract_params, layout, shardings), step


def _reader_manager(workdir: str | pathlib.Path) -> ocp.CheckpointManager:
    """`manager(workdir)` for a reader: orbax lists the steps when it opens, and a step a running trainer deletes
    meanwhile (its cleanup) makes that raise FileNotFoundError or NotADirectoryError; the listing is read again."""
    quiet.contain_orbax_aftermath()
    for attempt in range(20):
        try:
            return manager(workdir)
        except (FileNotFoundError, NotADirectoryError):  # a step directory deleted while orbax listed it
            time.sleep(0.01 * (attempt + 1))
    return manager(workdir)


def _into_layout(canonical: dict, like: nnx.State, layout: Plan, shardings: nnx.State | None) -> nnx.State:
    """Canonical arrays (as restored) → a State in the runtime layout and dtypes of `like`, resharded like the
    training state."""
    params = jax.tree.map(lambda x: x, like)  # the State structure and metadata; values replaced next
    nnx.replace_by_pure_dict(params, canonical)
    dtypes = jax.tree.map(lambda x: x.dtype, like)

    def place(p):
        return jax.tree.map(lambda x, d: x.astype(d), layout.from_canonical(p), dtypes)

    return jax.jit(place, out_shardings=shardings)(params)


def _is_state(x) -> bool:
    return isinstance(x, nnx.State)


def _map_states(fn, opt_state):
    """Apply fn to every parameter-shaped nnx.State inside an optax state (Adam's mu and nu), leave the rest."""
    return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def restore_train(mngr: ocp.CheckpointManager, like: TrainState, shardings: TrainState, layout: Plan,
                  vocab_size: int) -> tuple[TrainState, dict]:
    """Restore the newest exactly-restorable (state, data loader state) into the layout of `like`, placed with
    `shardings` — whatever layout wrote it. Damaged steps are moved aside (this run will save them again)."""
    steps = mngr.all_steps()
    if steps and not any((pathlib.Path(mngr.directory) / str(s) / item).exists() for s in steps
                         for item in ("train", "data")):
        workdir = pathlib.Path(mngr.directory).parent
        raise CheckpointError(f"{workdir} holds a params-only export (no optimizer state or data position), which "
                              "training cannot resume; pass a new --workdir (to start from these weights: `jaxpar "
                              f"convert --from {workdir} --to-hf DIR`, then `jaxpar train --init-from-hf DIR`)")
    restored, _ = restore_latest_good(mngr, lambda step: _restore_train_step(mngr, step, like, shardings, layout,
                                                                             vocab_size), quarantine=True)
    return restored


def _restore_train_step(mngr, step, like: TrainState, shardings: TrainState, layout: Plan, vocab_size: int):
    sums = _read_checksums(mngr, step)

    def target(x, s):  # canonical targets for parameter-shaped States, plain ones for the rest (Adam's count, …)
        if _is_state(x):
            return _canonical_target(x, s, vocab_size)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    train_target = {"step": target(like.step, shardings.step),
                    "opt_state": jax.tree.map(target, like.opt_state, shardings.opt_state, is_leaf=_is_state)}
    params_target = _canonical_target(like.params, shardings.params, vocab_size)
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_with_saved_dtypes(params_target, sums and sums["params"])),
        train=ocp.args.StandardRestore(_with_saved_dtypes(train_target, sums and sums["train"])),
        data=ocp.args.JsonRestore()))
    if sums is not None:
        _verify("params", restored["params"], sums["params"])
        _verify("train", restored["train"], sums["train"])
        if _json_digest(restored["data"]) != sums["data"]:
            raise Damaged("data (the loader position) fails its checksum")
    params = _into_layout(restored["params"], like.params, layout, shardings.params)
    opt_state = jax.tree.map(lambda x, canon, s: _into_layout(canon, x, layout, s) if _is_state(x) else canon,
                             like.opt_state, restored["train"]["opt_state"], shardings.opt_state, is_leaf=_is_state)
    return like.replace(step=restored["train"]["step"], params=params, opt_state=opt_state), restored["data"]


def _require_workdir(workdir: str | pathlib.Path) -> pathlib.Path:
    """WORKDIR/config.json, or InputNotFound when `workdir` is not a jaxpar workdir."""
    workdir = pathlib.Path(workdir)
    file = workdir / "config.json"
    if not file.is_file():
        what = "does not exist" if not workdir.exists() else "is not a jaxpar workdir (no config.json)"
        raise InputNotFound(f"{workdir} {what}; pass a directory written by `jaxpar train` or `jaxpar convert`")
    return file


def read_saved_config(workdir: str | pathlib.Path) -> Config:
    """The resolved config of a jaxpar workdir (WORKDIR/config.json); InputNotFound / CheckpointError when `workdir`
    is not one."""
    file = _require_workdir(workdir)
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read ({e}); restore it from a checkpoint's config item") from None
    try:
        return config_from_dict(saved)
    except ConfigError as e:
        raise CheckpointError(f"{file} is not a valid jaxpar config ({e})") from None


def read_canonical(workdir: str | pathlib.Path, step: int | None = None) -> tuple[Config, nnx.State, int]:
    """(config, canonical params on the default device, step) of checkpoint `step` (default: latest) of `workdir`."""
    config = read_saved_config(workdir)
    _, abstract = abstract_model(config.model)
    params, step = restore_params(workdir, abstract, make_plan(config.model),
                                  config.model.vocab_size, step=step)
    return config, params, step


def check_params_only_target(workdir: str | pathlib.Path, source: str | pathlib.Path | None = None) -> None:
    """Raise unless `write_params_only` may create `workdir`: it must be absent or an empty directory (a workdir
    with checkpoints is a CheckpointError, anything else holding files an OutputError: a conversion never writes
    into a directory it did not create) and lie outside `source`, the directory being converted. Made before the
    source is read, so a refusal costs nothing; the publication re-checks it atomically."""
    workdir = pathlib.Path(workdir)
    if source is not None:
        check_outside(source, workdir)
    checkpoints = workdir / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink() and any(checkpoints.iterdir()):
        raise CheckpointError(f"{workdir} already holds checkpoints; pass a new directory to write to (nothing "
                              "was written)")
    check_new_output(workdir)


def write_params_only(workdir: str | pathlib.Path, config: Config, params: nnx.State, step: int, *,
                      files: dict[str, bytes] | None = None) -> None:
    """A params-only workdir: config.json, the `files` given (name → bytes, e.g. a tokenizer.json) and one
    checkpoint holding canonical `params` with their checksums (what `jaxpar generate`, `restore_params` and the
    Hugging Face export read). `workdir` must be absent or an empty directory (`check_params_only_target`:
    CheckpointError / OutputError, nothing written). The workdir is written whole beside its target and published
    with one rename (`jaxpar.store.lock.Staged`): a crash leaves nothing under `workdir`, and of two conversions
    into one directory the second is refused with the first's result intact."""
    workdir = pathlib.Path(workdir)
    check_params_only_target(workdir)
    with Staged(workdir) as tmp:
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        (tmp / "config.json").write_text(config.to_json())
        mngr = manager(tmp)
        pure = nnx.to_pure_dict(params)
        try:
            _save(mngr, step, ocp.args.Composite(params=ocp.args.StandardSave(pure),
                                                 checksums=ocp.args.JsonSave({"params": _array_sums(pure)})))
            mngr.wait_until_finished()
        finally:
            mngr.close()


def convert(src: str | pathlib.Path, dst: str | pathlib.Path, *, step: int | None = None,
            dtype: str | None = None, quantize: str | None = None, group_size: int | None = None) -> int:
    """Write a params-only export of checkpoint `step` (default: latest) of workdir `src` as workdir `dst`:
    canonical params, optionally cast to `dtype` and quantized (`quantize` 'int8' / 'int4', `quantize_config`), and
    its config.json. A layout change needs no conversion — any layout restores these — so this is for handing a
    model on (to `jaxpar generate`, to a finetune). `dst` must be a new (absent or empty) directory outside `src`
    (`check_params_only_target`). Returns the step exported."""
    _require_workdir(src)
    check_params_only_target(dst, src)  # before seconds of reading
    config, params, step = read_canonical(src, step)
    params, config = cast_and_quantize(params, config, dtype, quantize, group_size)
    write_params_only(dst, config, params, step)
    return step


def quantize_config(model: ModelConfig, quantize: str | None, group_size: int | None) -> ModelConfig:
    """`model` stored quantized as `quantize` ('int8', or 'int4' in groups of `group_size`; None: the largest group
    up to 128 that divides every quantized matrix's width, `ModelConfig.int4_groups`, named by
    `ModelConfig.weights_label`): a ConfigError for a model that is quantized already (rounding twice compounds the
    error) or groups it cannot take (an explicit `group_size` that does not divide them is refused, not replaced)."""
    if model.weights != "float":
        raise ConfigError("quantize", quantize, f"the model is stored quantized already (model.weights = "
                          f"{model.weights})", "quantize the float workdir it came from")
    if quantize == "int4" and group_size is None:
        groups = model.int4_groups()
        if not groups:
            raise ConfigError("quantize", quantize, "no int4 group size up to 128 divides every quantized matrix's "
                              "width", "quantize to int8 (a scale per output channel)")
        group_size = groups[0]
    group = {} if group_size is None else {"weight_group": group_size}
    return dataclasses.replace(model, weights=quantize, **group)  # validates: ConfigError names the field


def cast_and_quantize(params: nnx.State, config: Config, dtype: str | None, quantize: str | None,
                      group_size: int | None) -> tuple[nnx.State, Config]:
    """Canonical float params and their config → cast to `dtype` (the float weights; buffers keep theirs), then
    quantized."""
    model = config.model
    if dtype is not None:
        def cast(path, x):  # integers and quantization scales keep their dtypes
            keep = not jnp.issubdtype(x.dtype, jnp.floating) or "_scale" in jax.tree_util.keystr(path)
            return x if keep else x.astype(dtype)

        params = merge_state(jax.tree_util.tree_map_with_path(cast, trainable(params)), buffers_of(params))
        model = dataclasses.replace(model, param_dtype=dtype)
    if quantize is not None:
        model = quantize_config(model, quantize, group_size)
        params = quantize_state(params, model)
    return params, dataclasses.replace(config, model=model)
