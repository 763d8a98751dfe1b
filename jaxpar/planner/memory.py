"""Memory of one train step per device, predicted without devices or a compile.

    total = params + optimizer + batch           (the step's arguments: what stays resident between steps)
          + gradients + activations + workspace  (what lives during the step)

State — exact, the sums of shard sizes. Every parameter's PartitionSpec comes from its logical axes through the
plan's rules (`jaxpar.parallel.plan.plan_rules`, no mesh needed) and ZeRO's data split (`sharding.zero_spec`):
    params      Σ ⌈shape / mesh degrees of its spec⌉ · param bytes   (ZeRO-3 adds `data` to each)
    optimizer   AdamW's two moments, each as its parameter but split over `data` from ZeRO-1, + the step counters
    gradients   one float per parameter shard as the step holds it (gradient accumulation adds a second: the sum)
    batch       the int32 token rows [B / (data·pipe·expert), T + 1]

Activations — traced, not hand-written. `jax.ad_checkpoint`'s residual analysis lists what autodiff keeps for the
backward pass; we run it on the model itself (abstract arrays, no memory) with one tensor rank's shapes (heads/t,
kv heads max(K/t, 1), d_ff/t, vocab/t), the device's rows and tokens, and the remat policy, at one and at two
layers: the difference is one layer, the rest the embedding, head and loss. So the formula follows the code — a
new policy, a named checkpoint or an MoE router changes the trace, not this file. Then, per device:
    no pipeline       L layers on b/A rows (A = grad_accum: one chunk's activations at a time)
    circular          the autodiff of the loop keeps every iteration: (v·m + p − 1)·k layers on a microbatch
    a schedule table  its peak in flight (chunk-activations, `Table.in_flight`) · k layers on a microbatch, twice:
                      the executor stashes each chunk's vjp residuals and, apart, its matmul inputs (the W tape)
    sequence parallel the residual-stream tensors [rows, s, h] split over `tensor` (Korthikanti et al. 2022)
    context parallel  s/c query tokens a rank; all_gather's gathered K/V and [s/c, s] scores are c times the local
                      trace's (the ring keeps its own blocks only)
Workspace — what the step allocates around those (XLA's temporaries). Measured, not derived: under remat, one layer's
activations without remat (what the policy recomputes comes back one layer at a time), times a factor fitted on
compiled programs (`WORKSPACE`, bench/plan.py measures it). `backend='cpu'` adds what XLA:CPU's dense lowering of the
MoE grouped matmuls holds (`_routed_factor`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Config, ModelConfig
from jaxpar.model import abstract_model
from jaxpar.parallel import pipeline, schedule
from jaxpar.parallel.axes import AXES, BATCH_AXES, TENSOR
from jaxpar.parallel.plan import padded_vocab, plan_rules
from jaxpar.planner import expected
from jaxpar.sharding import logical_to_spec, zero_spec

# XLA's temporaries beyond the saved activations and gradients, in units of the backward's working set (under remat:
# one layer's activations, recomputed; on XLA:CPU also the dense MoE expert buffers): least squares on XLA:CPU's
# buffer assignment over the 33 layouts of bench/plan.py (tiny, MoE, long context) gave 1.17 with the activations
# scaled 0.95 — so, activations taken whole, about 1.15. bench/RESULTS.md has the spread.
WORKSPACE = 1.15


@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device of one train step, by part (see the module docstring)."""

    params: int
    optimizer: int
    batch: int
    gradients: int
    activations: float
    workspace: float

    @property
    def resident(self) -> int:
        """What the step's arguments hold: the training state and the batch (compare `argument_size_in_bytes`)."""
        return self.params + self.optimizer + self.batch

    @property
    def total(self) -> float:
        return self.resident + self.gradients + self.activations + self.workspace

    def as_dict(self) -> dict[str, float]:
        """Bytes by part, with `resident` and `total`, for JSON."""
        return {**dataclasses.asdict(self), "resident": self.resident, "total": self.total}


def degrees_of(config: Config) -> dict[str, int]:
    """{mesh axis: degree} of a config resolved for its devices (data filled in)."""
    return dict(zip(AXES, config.mesh_shape))


def _shard_bytes(v: nnx.Variable, rules, degrees: dict[str, int], zero_data: int) -> int:
    axes = tuple(v.get_metadata().get("logical_axes") or (None,) * len(v.shape))
    spec = zero_spec(logical_to_spec(axes, rules), v.shape, zero_data)
    n = 1
    for size, entry in zip(v.shape, tuple(spec) + (None,) * (len(v.shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-size // math.prod(degrees[a] for a in names))
    return n * jnp.dtype(v.dtype).itemsize


def param_bytes(config: Config, zero_data: int = 1) -> int:
    """Bytes of one device's shards of every parameter, each array also split over `data` when zero_data > 1 (ZeRO)
    and its dims allow (`sharding.zero_spec`)."""
    return _param_shards(config.model, tuple(degrees_of(config).items()), zero_data)


def state_bytes(config: Config) -> dict[str, int]:
    """params, optimizer, gradients and batch bytes per device: exact sums over the shards (see the docstring)."""
    p, degrees = config.parallel, degrees_of(config)
    param = param_bytes(config, p.data if p.zero >= 3 else 1)
    moments = param_bytes(config, p.data if p.zero >= 1 else 1)
    rows = config.train.batch_size // math.prod(degrees[a] for a in BATCH_AXES)
    return {"params": param, "optimizer": 2 * moments + _adam_counters() + 4,  # + the state's int32 step
            "gradients": param * (2 if config.train.grad_accum > 1 else 1),
            "batch": rows * (config.train.seq_len + 1) * 4}


@functools.lru_cache(maxsize=64)
def _variables(model: ModelConfig, vocab: int) -> tuple[nnx.Variable, ...]:
    _, params = abstract_model(model, vocab)
    return tuple(jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


@functools.lru_cache(maxsize=4096)
def _param_shards(model: ModelConfig, degrees: tuple, zero_data: int) -> int:
    """Bytes of one device's shards of every parameter."""
    degrees = dict(degrees)
    rules = plan_rules(model, degrees)
    return sum(_shard_bytes(v, rules, degrees, zero_data)
               for v in _variables(model, padded_vocab(model, degrees[TENSOR])))


@functools.cache
def _adam_counters() -> int:
    """Bytes of AdamW's state besides its moments (its step counts), from optax itself: its state for no parameters."""
    empty = jax.eval_shape(optax.adamw(optax.constant_schedule(1.0)).init, {})
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(empty))


def local_model(model: ModelConfig, degrees: dict[str, int]) -> ModelConfig:
    """The model as one tensor rank holds it: a/t query heads, max(K/t, 1) kv heads, d_ff/t (and the experts'),
    vocab/t — what a device computes, as a plain model the residual trace can run."""
    t = degrees[TENSOR]
    moe = model.moe
    if moe.enabled:
        moe = dataclasses.replace(moe, d_ff=moe.d_ff // t, shared_d_ff=moe.shared_d_ff // t)
    return dataclasses.replace(model, n_heads=model.n_heads // t, n_kv_heads=max(model.n_kv_heads // t, 1),
                               head_dim=model.head_dim, d_ff=model.d_ff // t, vocab_size=padded_vocab(model, t) // t,
                               moe=moe, weights="float", attention="xla")


@functools.lru_cache(maxsize=256)
def residuals(model: ModelConfig, seq: int, remat: str, moe_layer: bool) -> tuple[tuple, tuple]:
    """(one layer's, the embedding + head + loss's) residuals — (shape, bytes) pairs — that autodiff of the plain
    model keeps for the backward, for one sequence of `seq` tokens, one layer kind (MoE or dense)."""
    from jax._src.ad_checkpoint import saved_residuals  # public as jax.ad_checkpoint.print_saved_residuals (prints)

    moe = model.moe
    kind = (dataclasses.replace(moe, sparse_step=1, dense_layers=()) if moe_layer else
            dataclasses.replace(moe, n_experts=0, sparse_step=1, dense_layers=()))

    def trace(n_layers: int) -> list[tuple[tuple[int, ...], int]]:
        cfg = dataclasses.replace(model, n_layers=n_layers, moe=kind, scan_unroll=1)
        graphdef, params = abstract_model(cfg)

        def loss(p, batch):
            logits = nnx.merge(graphdef, p)(batch[:, :-1], remat=remat)
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1).mean()

        found = saved_residuals(loss, params, jax.ShapeDtypeStruct((1, seq + 1), jnp.int32))
        return [(tuple(a.shape), a.size * a.dtype.itemsize) for a, source in found
                if not source.startswith("from the argument")]

    one, two = collections.Counter(trace(1)), collections.Counter(trace(2))
    # What both traces keep alike is outside the layers (embedding, head, loss, and what the scan hoists out of its
    # body: the mask); the scan stacks a layer's residuals [n, …], so the rest of the second trace is [2, …] of them.
    same = one & two
    layer = collections.Counter((s[1:], b // 2) for s, b in (two - same).elements() if s and s[0] == 2)
    first = collections.Counter(((1,) + s, b) for s, b in layer.elements())
    return tuple(layer.elements()), tuple((same + (one - same - first)).elements())


def _scaled(entries, config: Config, s_local: int, routed: tuple[float, float] = (1.0, 1.0)) -> float:
    """Bytes of residual entries once sequence and context parallelism act on them (see the docstring); `routed`
    multiplies the experts' rows (2-D residuals of s·k routed assignments a sequence; `_routed_factor`: [hidden
    widths, model width])."""
    m, p = config.model, config.parallel
    t, c = p.tensor, p.context
    total = 0.0
    for shape, nbytes in entries:
        size = math.prod(shape)
        if len(shape) == 2 and shape[0] == s_local * m.moe.top_k:  # an expert-side [rows·k, n] (MoE layers only)
            nbytes *= routed[shape[-1] == m.d_model]
        if p.sequence_parallel and shape and shape[-1] == m.d_model and size % (s_local * m.d_model) == 0:
            nbytes /= t  # the residual stream between tensor regions: [rows, s/t, h]
        if c == 1 or p.context_impl == "ring":  # the ring keeps no [s/c, s] score row, only its own blocks
            pass
        elif len(shape) >= 4 and shape[-2:] == (s_local, s_local):  # [B, K, G, T, S] and the like
            nbytes *= c  # scores against the whole row's keys
        elif len(shape) == 4 and shape[1] == s_local and shape[-2:] == (max(m.n_kv_heads // t, 1),
                                                                                     m.head_dim):
            nbytes *= c  # gathered keys or values
        total += nbytes
    return total


def _routed_factor(config: Config, backend: str) -> tuple[float, float]:
    """How much larger an MoE layer's expert rows [rows·k, n] are than the trace's, for hidden widths n and for the
    model width: expert parallelism pads each rank's exchange to the worst case, ep·min(k, X/ep) rows a token
    instead of k (dropless); and XLA:CPU, which has no grouped matmul, lowers `ragged_dot` densely — every local
    expert over all rows — and keeps the down projection's [X/ep, rows, h] for the backward (its buffer assignment
    shows them), X/ep times the model-width rows. A GPU's grouped GEMM keeps the rows once."""
    moe, ep = config.moe, config.parallel.expert
    if not moe.enabled:
        return 1.0, 1.0
    local = moe.n_experts // ep
    pad = ep * min(moe.top_k, local) / moe.top_k if not moe.capacity_factor else 1.0
    return pad, pad * (local if backend == "cpu" else 1)


def activation_bytes(config: Config, backend: str = "gpu") -> dict[str, float]:
    """Activations saved for the backward, per device: {'layers', 'outside', 'working_set'} (see the docstring);
    `working_set` (the unit of `WORKSPACE`) is, under remat, one layer's activations without it, and on 'cpu' the
    dense MoE expert buffers of one layer."""
    m, p, t = config.model, config.parallel, config.train
    degrees = degrees_of(config)
    local = local_model(m, degrees)
    b = expected.rows_per_data_shard(config)
    s = t.seq_len // p.context
    A = t.grad_accum
    if p.pipe > 1:
        mb = b // p.microbatches // A
        k = m.n_layers // (p.pipe * p.repeats)
        if p.schedule == "circular":
            chunks = pipeline.iterations(p.pipe, p.repeats, p.microbatches)
        else:  # each chunk in flight holds its vjp residuals (the stash) and its matmul inputs (the tape, for W)
            chunks = 2 * max(schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches).in_flight())
        layer_rows, outside_rows, layers = mb, b // p.pipe // A, chunks
        kinds = m.layer_kinds[:k]
    else:
        layer_rows = outside_rows = b // A
        layers, kinds = 1, m.layer_kinds
    # Traced for one row: every residual is [rows, …] (or [rows·s, …]), so the bytes scale with the rows.
    routed = _routed_factor(config, backend)
    per_kind = {k: _scaled(residuals(local, s, p.remat, k)[0], config, s, routed) for k in set(kinds)}
    saved = layers * layer_rows * sum(per_kind[k] for k in kinds)
    outside = outside_rows * _scaled(residuals(local, s, p.remat, kinds[0])[1], config, s)
    # Under remat the backward brings one layer's activations back at a time: its working set on top of the saved.
    none = 0.0 if p.remat == "none" else layer_rows * max(
        _scaled(residuals(local, s, "none", k)[0], config, s, routed) for k in set(kinds))
    if backend == "cpu" and any(kinds):
        # XLA:CPU's dense `ragged_dot`: one MoE layer's backward holds ~7 [X/ep, rows·k, F/t] float32 buffers at once
        # (gate, up, their product and gradients; counted in the buffer assignment of moe_tiny's step).
        moe = m.moe
        none += 7 * (moe.n_experts // p.expert) * layer_rows * s * moe.top_k * routed[0] * (moe.d_ff // p.tensor) * 4
    return {"layers": saved, "outside": outside, "working_set": none}


def predict_memory(config: Config, backend: str = "gpu") -> Memory:
    """The step's memory per device for `config` resolved for its devices (`Config.resolve_for_devices`), compiled
    for `backend` ('gpu', or 'cpu': XLA:CPU's dense lowering of the MoE grouped matmuls, `_routed_factor`)."""
    state = state_bytes(config)
    act = activation_bytes(config, backend)
    return Memory(params=state["params"], optimizer=state["optimizer"], batch=state["batch"],
                  gradients=state["gradients"], activations=act["layers"] + act["outside"],
                  workspace=WORKSPACE * act["working_set"])

