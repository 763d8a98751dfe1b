"""Logical axes → mesh axes: the one rules table, and the helpers that apply it.

The model names every parameter and main activation with *logical* axes (`("embed", "mlp")`); nothing in it knows
the mesh. `RULES` is derived from the mesh-axis table of `jaxpar.parallel.axes` (which says which logical axes each
mesh axis splits, and why); as of today it reads

| logical  | mesh                  | why                                                                      |
|----------|-----------------------|--------------------------------------------------------------------------|
| batch    | data, pipe, expert    | data parallelism; the pipeline's embedding/head/loss also split rows over `pipe`; expert ranks are data-parallel outside MoE layers |
| layers   | pipe                  | stacked layers: stage s holds its contiguous slice of the stack (kept in pipeline order) |
| experts  | expert                | MoE expert weights (reserved: no layer has them yet)                     |
| seq      | context               | context parallelism splits activations on the sequence dim (size 1 until it exists) |
| heads    | tensor                | Megatron: attention is split by heads (column-parallel QKV, row-parallel out) |
| kv_heads | tensor                | the kv heads of a query-head group live on the same shard                |
| mlp      | tensor                | column-parallel up/gate, row-parallel down                               |
| vocab    | tensor                | vocab-parallel embedding and LM head                                     |
| (others) | —                     | replicated: embed, head_dim, norm                                        |

One exception is derived from it, per model and mesh (`jaxpar.plan.make_plan`): with fewer kv heads than
tensor ranks (GQA, K < t) the kv heads cannot be split, so `kv_heads` is replicated and each rank uses the head of
its query group.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.parallel.axes import DATA, RULES, MeshAxes

LogicalAxes = tuple[str | None, ...]


def logical_to_spec(axes: Sequence[str | None], rules: Sequence[tuple[str, MeshAxes]] = RULES) -> P:
    """PartitionSpec for an array whose dims carry `axes`. A mesh axis is used at most once (first dim wins)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; add it to a mesh axis of jaxpar.parallel.axes (or to REPLICATED)")
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
    if data > 1 and DATA not in jax.tree.leaves(entries):
        for i, (entry, size) in enumerate(zip(entries, shape)):
            if entry is None and size % data == 0:
                entries[i] = DATA
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


# ---------------------------------------------------------------------------------------------------------------------
# Layout transforms of a parameter State, found by logical axis (never by parameter name).


def vocab_dim(v: nnx.Variable) -> int | None:
    """The dim of a parameter that runs over the vocabulary (its `vocab` logical axis), or None."""
    axes = _axes_of(v)
    return axes.index("vocab") if "vocab" in axes else None


def vocab_dims(state: nnx.State) -> dict[str, int]:
    """{'embed': 0, 'lm_head': 1}: each parameter with a `vocab` logical axis (dotted path) and that dim."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    return {".".join(str(k.key) for k in path): d for path, v in leaves if (d := vocab_dim(v)) is not None}


def pad_vocab(params: nnx.State, padded_vocab: int) -> nnx.State:
    """Resize the vocab dim of every parameter that has one (the embedding's rows, the LM head's columns) to
    `padded_vocab`, adding zero entries or dropping trailing ones. Converts between a model and its tensor-parallel
    (padded) twin. Returns a new State; the caller's is left alone."""

    def resize(v: nnx.Variable) -> nnx.Variable:
        axis = vocab_dim(v)
        if axis is None:
            return v
        x = v[...]
        n = padded_vocab - x.shape[axis]
        if n <= 0:
            return v.replace(jax.lax.slice_in_dim(x, 0, padded_vocab, axis=axis))
        return v.replace(jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)]))

    return jax.tree.map(resize, params, is_leaf=_is_variable)


def layer_axis(v: nnx.Variable) -> str | None:
    """The logical name of a variable's leading axis (`layers` for a stack a pipeline splits; `prefix_layers`,
    `mtp_layers` for the stacks it runs outside its stages: jaxpar.model.Blocks), None for an empty shape."""
    return _axes_of(v)[0] if v.shape else None


def permute_layers(params: nnx.State, order: Callable[[int], Any]) -> nnx.State:
    """Reorder the stacked layer axis (the leading `layers` logical axis) of every parameter that has one: position i
    of the result holds `params`' entry order(n)[i], n the length of the parameter's stack."""

    def permute(v):
        if layer_axis(v) != "layers":
            return v
        return v.replace(v[...][jnp.asarray(order(v.shape[0]))])

    return jax.tree.map(permute, params, is_leaf=_is_variable)
