"""Logical axes → mesh axes: the one rules table, and the helpers that apply it.

The model names every parameter and main activation with *logical* axes (`("embed", "mlp")`); nothing in it knows
the mesh. This table is the only place that says how a logical axis is laid out on `data`, `pipe`, `tensor`:

| logical  | mesh     | why                                                                      |
|----------|----------|--------------------------------------------------------------------------|
| batch    | data,pipe| data parallelism; the pipeline's embedding/head/loss also split rows over `pipe` |
| heads    | tensor   | Megatron: attention is split by heads (column-parallel QKV, row-parallel out) |
| kv_heads | tensor   | the kv heads of a query-head group live on the same shard                |
| mlp      | tensor   | column-parallel up/gate, row-parallel down                               |
| vocab    | tensor   | vocab-parallel embedding and LM head                                     |
| layers   | pipe     | stacked layers: stage s holds its contiguous slice of the stack (kept in pipeline order) |
| (others) | —        | replicated: embed, head_dim, seq, norm                                   |

One exception is derived from it, per model and mesh (`model_layout`): with fewer kv heads than tensor ranks (GQA,
K < t) the kv heads cannot be split, so `kv_heads` is replicated and each rank uses the head of its query group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError, ModelConfig, ParallelConfig
from jaxpar.parallel.pipeline import pipeline_order
from jaxpar.parallel.context import Parallel
from jaxpar.parallel.tensor import TensorParallel

LogicalAxes = tuple[str | None, ...]

MeshAxes = str | tuple[str, ...] | None

RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "pipe")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", "pipe"),
    ("embed", None),
    ("head_dim", None),
    ("seq", None),
    ("norm", None),
)


def logical_to_spec(axes: Sequence[str | None], rules: Sequence[tuple[str, MeshAxes]] = RULES) -> P:
    """PartitionSpec for an array whose dims carry `axes`. A mesh axis is used at most once (first dim wins)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; add it to jaxpar.sharding.RULES")
        mesh_axes = table.get(name) if name is not None else None
        group = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        group = tuple(a for a in group if a not in used)
        used.update(group)
        out.append(None if not group else group[0] if len(group) == 1 else group)
    return P(*out)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _axes_of(v: nnx.Variable) -> LogicalAxes:
    axes = v.get_metadata().get("logical_axes")
    return tuple(axes) if axes is not None else (None,) * len(v.shape)


def zero_spec(spec: P, shape: tuple[int, ...], data: int) -> P:
    """ZeRO: `spec` with 'data' added on the first dim it leaves whole whose size `data` divides (unchanged when
    there is none, or data == 1). Each data rank then stores 1/data of the array."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if data > 1 and "data" not in jax.tree.leaves(entries):
        for i, (entry, size) in enumerate(zip(entries, shape)):
            if entry is None and size % data == 0:
                entries[i] = "data"
                break
    return P(*entries)


def param_specs(state: nnx.State, rules=RULES, zero_data: int = 1) -> nnx.State:
    """A State of PartitionSpecs mirroring `state` (abstract or concrete); `zero_data` > 1 also splits each array
    over the data axis (`zero_spec`)."""
    return jax.tree.map(lambda v: v.replace(zero_spec(logical_to_spec(_axes_of(v), rules), v.shape, zero_data)),
                        state, is_leaf=_is_variable)


def param_shardings(state: nnx.State, mesh: Mesh, rules=RULES, zero_data: int = 1) -> nnx.State:
    """A State of NamedShardings mirroring `state`: what `jit(out_shardings=…)` needs to create it born sharded."""
    specs = param_specs(state, rules, zero_data)
    return jax.tree.map(lambda s: s.replace(NamedSharding(mesh, s.get_value())), specs, is_leaf=_is_variable)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names for the compiler (GSPMD). A no-op when no mesh is set (the plain
    single-device path) and inside `shard_map`, where arrays are already local shards.

    The trainer sets the mesh with `jax.set_mesh`; the model calls this with names only.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or getattr(mesh, "manual_axes", ()):
        return x
    # A dim the mesh axes don't divide stays whole (GQA with fewer kv heads than tensor ranks: kv replicated).
    spec = [None if a is not None and size % math.prod(mesh.shape[n] for n in ((a,) if isinstance(a, str) else a))
            else a for a, size in zip(logical_to_spec(axes), x.shape)]
    return jax.lax.with_sharding_constraint(x, P(*spec))


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """How one model sits on one mesh: the rules table (with the GQA exception applied), the vocab padded to a
    multiple of the tensor degree (Megatron's make-vocab-size-divisible-by: pad rows are zero and their logits
    masked, so the math is unchanged), and the tensor-parallel boundaries the model calls."""

    rules: tuple[tuple[str, MeshAxes], ...] = RULES
    padded_vocab: int | None = None
    par: Parallel = Parallel()
    pipeline: Pipeline | None = None
    zero: int = 0  # ZeRO stage: 1 shards optimizer moments over `data`, 3 parameters too
    data: int = 1  # the data degree those are split by

    @property
    def param_zero_data(self) -> int:
        return self.data if self.zero >= 3 else 1

    @property
    def opt_zero_data(self) -> int:
        return self.data if self.zero >= 1 else 1

    @property
    def layer_order(self) -> np.ndarray | None:
        """order[n] = the model layer at position n of the stacked axis in memory (None: model order)."""
        return None if self.pipeline is None else self.pipeline.layer_order


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The circular pipeline's counts (jaxpar.parallel.pipeline)."""

    stages: int
    repeats: int
    microbatches: int
    layers: int

    @property
    def layer_order(self) -> np.ndarray:
        return pipeline_order(self.layers, self.stages, self.repeats)


def model_layout(model: ModelConfig, parallel: ParallelConfig | None, mesh: Mesh | None,
                 explicit: bool = True) -> ModelLayout:
    """The layout of `model` with `parallel` settings on `mesh` (None: one device, no mesh).

    explicit: the step runs under `shard_map` with our collectives (TensorParallel bound to 'tensor'); False leaves
    tensor parallelism to GSPMD (the comparison baseline of bench/tp.py, and inference), which has no pipeline and
    no sequence parallelism: asking it for either is a ConfigError.
    """
    if mesh is None:
        return ModelLayout(padded_vocab=model.vocab_size)
    if not explicit and parallel is not None:
        # The GSPMD baseline is one global computation: it has no pipeline loop (with pipe > 1 the layers, stored in
        # pipeline order, would run in the wrong order) and no sequence-parallel boundaries. Refuse, don't pretend.
        if mesh.shape["pipe"] > 1:
            raise ConfigError("parallel.pipe", mesh.shape["pipe"], "the GSPMD baseline (explicit=False) runs no "
                              "pipeline", "compare against GSPMD at parallel.pipe=1, or use the explicit step")
        if parallel.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, "the GSPMD baseline (explicit=False) does not "
                              "implement sequence parallelism", "set parallel.sequence_parallel=false for it")
    t = mesh.shape["tensor"]
    rules = RULES
    kv_replicas = 1
    if model.n_kv_heads % t:
        rules = tuple((name, None if name == "kv_heads" else axis) for name, axis in RULES)
        kv_replicas = t // model.n_kv_heads
    sequence = parallel is not None and parallel.sequence_parallel
    par = Parallel(TensorParallel("tensor", sequence, kv_replicas) if explicit else None)
    pipeline = None
    if parallel is not None and mesh.shape["pipe"] > 1:
        pipeline = Pipeline(mesh.shape["pipe"], parallel.repeats, parallel.microbatches, model.n_layers)
    zero = parallel.zero if parallel is not None else 0
    return ModelLayout(rules, math.ceil(model.vocab_size / t) * t, par, pipeline, zero, mesh.shape["data"])
