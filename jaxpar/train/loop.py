"""`fit(config, workdir)`: the training loop as a library function (the CLI, notebooks and tests all call it)."""

from __future__ import annotations

import dataclasses
import pathlib
import signal
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpar import data as data_lib
from jaxpar import flops, perf
from jaxpar.config import Config
from jaxpar.distributed import batch_rows
from jaxpar.errors import CheckpointError, ConfigError, OutputError
from jaxpar.interop import hf
from jaxpar.mesh import describe_mesh
from jaxpar.model import buffers_of, count_params, update_buffers
from jaxpar.store import checkpoint
from jaxpar.store.lock import WorkdirLock
from jaxpar.train.metrics import MetricsWriter, StepProfiler
from jaxpar.plan import Plan, make_plan
from jaxpar.sharding import param_shardings, param_specs
from jaxpar.train.state import TrainState, create_state, lr_schedule, make_optimizer
from jaxpar.train.dpo import DPO
from jaxpar.train.step import (compile_steps, make_eval_step, make_reference_step, make_train_step,
                               sharded_loss_and_grads)


@dataclasses.dataclass
class Trainer:
    """Everything a step needs, assembled for one plan (its mesh None: the single-device reference)."""

    graphdef: nnx.GraphDef
    state: TrainState
    shardings: TrainState | None
    train_step: Callable  # (state, batch int [B, T+1]) -> (state, metrics); jitted
    eval_step: Callable  # (params, batch) -> loss; jitted
    plan: Plan
    loss_and_grads: Callable  # (params, batch) -> (loss, grads): the train step's gradients alone, not jitted
    dpo: DPO | None = None  # the preference objective (train.objective = "dpo"), else None

    @property
    def mesh(self) -> Mesh | None:
        return self.plan.mesh

    def put(self, rows: np.ndarray | dict[str, np.ndarray]) -> jax.Array | dict[str, jax.Array]:
        """This process's batch rows (and their loss mask: a dict) → global arrays laid out for the step (rows
        over the batch axes)."""
        if self.mesh is None:
            return jax.device_put(rows)
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(self.plan.batch_sharding, a), rows)

    def random_batch(self, config: Config, seed: int = 0) -> jax.Array:
        """A global batch int32 [batch_size, seq_len + 1] of uniform random token ids, laid out for the step
        (benchmarks and analyses that need real arrays but not real text). One process's view: all rows."""
        t = config.train
        rows = np.random.default_rng(seed).integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1))
        return self.put(rows.astype(np.int32))


def dpo_of(config: Config) -> DPO | None:
    """The run's preference objective (jaxpar.train.dpo), or None for next-token training."""
    t = config.train
    return DPO(t.dpo_beta, t.dpo_loss) if t.objective == "dpo" else None


def reference_pass(trainer: Trainer, params: nnx.State) -> Callable[[dict], dict]:
    """DPO's reference: a copy of `params` (the model the run starts from) on the trainer's devices, laid out
    without the pipeline (`Plan.without_pipeline`: its forward needs no schedule), and batch → the batch with its
    "ref" sums (`make_reference_step`), computed before the step that uses them. The copy costs one more set of
    weights per device (each stage's share of the layers becomes every layer under a pipeline)."""
    plan = trainer.plan
    if plan.mesh is None:
        ref, forward = jax.tree.map(jnp.copy, params), jax.jit(make_reference_step(trainer.graphdef, plan))
        return lambda batch: {**batch, "ref": forward(ref, batch)}
    flat = plan.without_pipeline()
    shardings = param_shardings(params, plan.mesh, flat.rules, flat.param_zero_data)
    with jax.set_mesh(plan.mesh):
        ref = jax.jit(lambda p: flat.from_canonical(plan.to_canonical(p)), out_shardings=shardings)(params)
    step = make_reference_step(trainer.graphdef, flat,
                               param_specs=param_specs(params, flat.rules, flat.param_zero_data))
    forward = jax.jit(step, in_shardings=(shardings, plan.batch_sharding), out_shardings=plan.batch_sharding)

    def add_ref(batch: dict) -> dict:
        with jax.set_mesh(plan.mesh):
            return {**batch, "ref": forward(ref, batch)}

    return add_ref


def no_reference(trainer: Trainer) -> Callable[[dict], dict]:
    """Reference-free DPO (train.dpo_reference = "none"): batch → the batch with "ref" zeros [B, 2]."""
    where = None if trainer.mesh is None else trainer.plan.batch_sharding

    def add_ref(batch: dict) -> dict:
        return {**batch, "ref": jnp.zeros((batch["tokens"].shape[0], 2), jnp.float32, device=where)}

    return add_ref


def _check_trainable(model) -> None:
    """Integers have no gradient: quantization is applied to a trained model, for inference — or frozen under LoRA's
    adapters (QLoRA), which are what trains."""
    if model.weights != "float" and not model.lora.rank:
        raise ConfigError("model.weights", model.weights, "is an inference format: quantized weights cannot train "
                          "(but can stay frozen under LoRA adapters: lora.rank > 0)",
                          "train with model.weights=float, then quantize with `jaxpar convert --quantize "
                          f"{model.weights}` or load(..., quantize='{model.weights}')")


def build_trainer(config: Config, devices: list | Mesh | None, *, explicit: bool = True,
                  abstract: bool = False) -> Trainer:
    """Optimizer, born-sharded state and the compiled steps for `config` on `devices` (a list, or a mesh built for
    this config; None: one device, no mesh) — through one `make_plan`, which validates the layout first.

    explicit=False leaves tensor parallelism to GSPMD instead of our shard_map collectives (for comparisons);
    abstract=True makes `state` shapes only (to lower and analyse the step without allocating it).
    """
    model, parallel = config.model, config.parallel
    _check_trainable(model)
    plan = make_plan(model, parallel, devices, explicit)
    tx = make_optimizer(config.train)
    graphdef, state, shardings = create_state(plan.model, tx, config.train.seed, plan, abstract=abstract)
    specs = param_specs(state.params, plan.rules, plan.param_zero_data) if plan.mesh is not None else None
    # ZeRO-1: the gradients leave split as the optimizer state is (a reduce-scatter, not an all-reduce)
    grad_specs = (param_specs(state.params, plan.rules, plan.opt_zero_data)
                  if plan.mesh is not None and plan.opt_zero_data != plan.param_zero_data else None)
    dpo = dpo_of(config)
    grads_of, step_grads = (sharded_loss_and_grads(graphdef, plan, grad_accum=config.train.grad_accum,
                                                   remat=parallel.remat, param_specs=specs, grad_specs=grad_specs,
                                                   stats=stats, mtp_weight=config.train.mtp_loss_weight, dpo=dpo)
                            for stats in (False, model.moe.enabled or model.mtp_depth > 0 or dpo is not None))
    # (the statistics: the MoE layers', MTP's, DPO's rewards)
    moe_layers = model.moe_layer_count

    def update_in_layout(buffers, stats):  # the buffers live in the plan's layer order, the rule reads model order
        return plan.from_canonical(update_buffers(plan.to_canonical(buffers), stats, plan.model))

    update = update_in_layout if jax.tree.leaves(buffers_of(state.params)) else None
    dropout_seed = config.train.seed if model.lora.dropout else None  # LoRA dropout: masks of the step's tokens
    train_step, eval_step = compile_steps(make_train_step(step_grads, tx, lr_schedule(config.train), moe_layers,
                                                          update, dropout_seed),
                                          make_eval_step(graphdef, plan, param_specs=specs, dpo=dpo), plan.mesh,
                                          shardings)
    return Trainer(graphdef, state, shardings, train_step, eval_step, plan, grads_of, dpo)


@dataclasses.dataclass
class FitResult:
    """What a run produced: the final state, the resolved config and mesh, every logged metrics record, and whether
    it stopped early on SIGTERM/SIGINT (after saving a checkpoint)."""

    config: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    state: TrainState
    history: list[dict]
    preempted: bool = False


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss, gradient or update."""


class Preemption:
    """While active, SIGTERM and SIGINT only set `requested`; the loop then saves and returns (a cluster's
    preemption notice, or Ctrl-C, costs at most one step). Handlers are restored on exit; off the main thread
    (where signals cannot be caught) it does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def fit(config: Config, workdir: str | pathlib.Path, *, devices: list | None = None, progress: bool = True) -> FitResult:
    """Train `config` on `devices` (default: all), writing metrics, TensorBoard events, config.json and orbax
    checkpoints under `workdir`. If `workdir` already holds a checkpoint, training continues from it (parameters,
    optimizer state, step and data order) — provided `config` is compatible with the one that wrote it
    (`checkpoint.check_resumable`). The workdir is locked for the run: a second writer gets `WorkdirLocked`."""
    _check_trainable(config.model)
    perf.retain_host_memory()  # (a no-op if `jaxpar train` already did it, before the backend started)
    devices = list(jax.devices() if devices is None else devices)
    if config.parallel.auto:  # the planner's layout for these devices, logged with the runner-up
        from jaxpar.planner import auto

        config = auto.choose(config, devices)
    config = config.resolve_for_devices(len(devices))
    with WorkdirLock(workdir):
        return _fit(config, pathlib.Path(workdir), devices, progress)


def _fit(config: Config, workdir: pathlib.Path, devices: list, progress: bool) -> FitResult:
    mngr = checkpoint.manager(workdir, keep=config.checkpoint.keep, permanent_every=config.checkpoint.permanent_every)
    try:
        if mngr.all_steps():  # before anything loads or compiles: a changed model is a config error, not "damage"
            saved = checkpoint.stored_config(mngr, workdir)
            if saved is not None:
                checkpoint.check_resumable(saved, config, workdir)
        return _prepare(config, workdir, devices, progress, mngr)
    finally:
        mngr.close()  # also on errors: orbax's background threads end here, not in interpreter shutdown


def _prepare(config: Config, workdir: pathlib.Path, devices: list, progress: bool, mngr) -> FitResult:
    train, model_cfg = config.train, config.model
    if train.init_from_hf:
        hf.check_matches(model_cfg, train.init_from_hf)  # before anything compiles
    tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
    data_lib.check_vocab(tokenizer, model_cfg.vocab_size)
    train_tokens = data_lib.load_tokens(config.data, tokenizer, "train", seq_len=train.seq_len, seed=train.seed)
    eval_tokens = data_lib.load_tokens(config.data, tokenizer, "eval", seq_len=train.seq_len, seed=train.seed)
    trainer = build_trainer(config, devices)
    if jax.process_count() > 1 and jax.process_index() == 0:
        print(describe_mesh(trainer.mesh), flush=True)  # which host holds which mesh position
    # Each process loads only the rows its devices hold: its own data slices, or a slice it shares with the other
    # processes of a pipeline that spans hosts.
    rows_index, rows_count = batch_rows(trainer.plan.batch_sharding, train.batch_size)
    loader_args = dict(batch_size=train.batch_size, seq_len=train.seq_len, process_index=rows_index,
                       process_count=rows_count, pack=config.data.pack)
    # Batches are placed on the step's devices by the loader's prefetch thread, two steps ahead.
    loader = data_lib.make_loader(train_tokens, seed=train.seed, place=trainer.put, prefetch=2, **loader_args)
    if jax.process_index() == 0:  # the model's own count (vocab unpadded), as Megatron and MaxText print theirs
        print(f"jaxpar: {count_params(model_cfg):,} parameters", flush=True)
    if trainer.plan.padded_vocab != model_cfg.vocab_size and jax.process_index() == 0:
        print(f"jaxpar: vocab {model_cfg.vocab_size} padded to {trainer.plan.padded_vocab} (a multiple of "
              f"parallel.tensor={config.parallel.tensor}); the pad rows are zero and their logits masked")
    return _run(config, workdir, devices, progress, trainer, mngr, loader, eval_tokens, loader_args)


def _run(config: Config, workdir: pathlib.Path, devices: list, progress: bool, trainer: Trainer, mngr, loader,
         eval_tokens, loader_args: dict) -> FitResult:
    train, model_cfg = config.train, config.model
    state, shardings, train_step, to_device = trainer.state, trainer.shardings, trainer.train_step, trainer.put

    resuming = bool(mngr.all_steps())
    reference = trainer.dpo is not None and train.dpo_reference == "model"  # DPO's: the model the run started from
    # the starting weights: a fresh run's, or (a resumed DPO run) its reference's
    initial = state.params if not resuming or reference else None
    if train.init_from_hf and initial is not None:  # Hugging Face weights (Adam's moments start at zero)
        initial = hf.load_params(train.init_from_hf, model_cfg, state.params, trainer.plan,
                                 None if shardings is None else shardings.params)
    if resuming:
        state, data_state = checkpoint.restore_train(mngr, state, shardings, trainer.plan, model_cfg.vocab_size)
        try:
            loader.set_state(data_state)
        except ValueError as e:
            raise CheckpointError(f"the data stream differs from the one {workdir}'s checkpoints were saved from "
                                  f"({e}); restore the data files, or start a new --workdir") from None
    else:
        state = state.replace(params=initial)
    # DPO: each batch gains its reference sums before its step (a copy of the starting model's weights: the step
    # donates the state's)
    with_ref = (lambda batch: batch) if trainer.dpo is None else (
        reference_pass(trainer, initial) if reference else no_reference(trainer))
    del initial

    def evaluate(params) -> float:
        eval_loader = data_lib.make_loader(eval_tokens, seed=0, shuffle=False, **loader_args)
        losses = [trainer.eval_step(params, with_ref(to_device(next(eval_loader))))
                  for _ in range(train.eval_batches)]
        return float(np.mean(jax.device_get(losses)))
    if jax.process_index() == 0:  # (the workdir exists: taking its lock made it)
        try:
            (workdir / "config.json").write_text(config.to_json())
        except OSError as e:
            raise OutputError(f"{workdir / 'config.json'} cannot be written ({e.strerror or e}); it must be a "
                              "regular file") from None

    def save(wait: bool) -> None:
        checkpoint.save(mngr, state, loader.get_state(), trainer.plan, config.to_dict(), wait=wait)

    start = int(jax.device_get(state.step))
    writer = MetricsWriter(workdir, train.steps, start, progress=progress)
    history: list[dict] = []
    tokens_per_step = train.batch_size * train.seq_len
    flops_per_step = flops.train_flops_per_token(model_cfg, train.seq_len) * tokens_per_step  # model FLOPs (MFU's)
    peak = flops.training_peak(model_cfg, train.seq_len, devices[0])  # None on CPUs: no mfu is logged there
    profiler = StepProfiler(workdir, start + 2, train.profile_steps)  # the run's first step compiles: skip it
    last_time, last_step = time.perf_counter(), start
    bad_streak = skipped_total = 0  # consecutive and total skipped (non-finite) steps, exact
    preemption = Preemption()

    def finish(step: int, metrics: dict, evaluate_now: bool) -> None:
        """Account for a step whose work may still be running: read its skip flag (waiting for it), stop on
        divergence, and log it on logging steps. Called one step late — after the next step is dispatched — except
        where the loop must see the state of this very step (evaluation, a save, preemption, the end)."""
        nonlocal bad_streak, skipped_total, last_time, last_step
        skipped = int(metrics["skipped"])  # a scalar: consecutive bad steps must be counted exactly
        skipped_total += skipped
        bad_streak = bad_streak + 1 if skipped else 0
        if bad_streak >= train.max_bad_steps:
            raise TrainingDiverged(
                f"steps {step - bad_streak + 1}..{step} had a non-finite loss, gradient or update and were "
                f"skipped (train.max_bad_steps = {train.max_bad_steps}); nothing was saved after step "
                f"{mngr.latest_step()}. Lower train.lr, raise train.warmup_steps or check the data.")
        record = None
        if step % train.log_every == 0 or step == train.steps or step == start + 1:
            metrics = jax.device_get(metrics)  # the step has finished: the time below covers its real work
            now = time.perf_counter()
            dt = (now - last_time) / (step - last_step)
            record = {**metrics, "skipped_steps": skipped_total, "step_time_s": dt,
                      "tokens_per_sec": tokens_per_step / dt,
                      **flops.utilisation(flops_per_step, dt, len(devices), peak)}
            last_time, last_step = now, step
        if evaluate_now:
            record = {**(record or {}), "eval_loss": evaluate(state.params)}
            last_time = time.perf_counter()  # keep evaluation out of the next interval's step time
        if record is not None:
            writer.write(step, record)
            history.append({"step": step, **{k: np.asarray(v).tolist() for k, v in record.items()}})

    # The loop is asynchronous: step t + 1 is dispatched before step t is accounted for, so the host's reads of
    # step t's results overlap step t + 1's device work and the devices never wait for Python. The loader has
    # the next batches already placed (a prefetch thread). Where the loop needs the state of the step it just ran —
    # evaluation and checkpoints (the next step donates that state), preemption and the end — it accounts for that
    # step first, so what is saved or evaluated has been checked exactly as in a synchronous loop.
    pending = None  # (step, metrics) dispatched but not yet accounted for
    try:
        with preemption:
            for step in range(start + 1, train.steps + 1):
                profiler.before(step)
                state, metrics = train_step(state, with_ref(next(loader)))
                profiler.after(step, state)
                writer.advance()
                if pending is not None:
                    finish(*pending, evaluate_now=False)
                pending = (step, metrics)
                evaluate_now = bool(train.eval_every and step % train.eval_every == 0) or step == train.steps
                save_now = bool(config.checkpoint.every and step % config.checkpoint.every == 0
                                and step != train.steps)
                if evaluate_now or save_now or preemption.requested:
                    finish(*pending, evaluate_now=evaluate_now)
                    pending = None
                if preemption.requested:
                    break
                if save_now:
                    save(wait=False)
            ran = int(jax.device_get(state.step)) - start
            if ran and skipped_total == ran:  # nothing was learnt: say so rather than save and report "done"
                raise TrainingDiverged(
                    f"every step of this run ({start + 1}..{start + ran}) had a non-finite loss, gradient or update "
                    f"and was skipped; nothing was saved after step {mngr.latest_step()}. Lower train.lr, raise "
                    "train.warmup_steps or check the data.")
            if ran or mngr.latest_step() is None:
                save(wait=True)  # at the end, or on preemption: before returning
    finally:
        loader.close()
        profiler.close()
        mngr.wait_until_finished()
        writer.close()
    return FitResult(config=config, mesh=trainer.mesh, graphdef=trainer.graphdef, state=state, history=history,
                     preempted=preemption.requested)
