"""The mesh axes: one ordered table, and everything derived from it.

Every axis of the device mesh is one row below, outermost first. Order matters: the mesh is a row-major device
array, so the last axis varies fastest and its groups are neighbouring devices — `tensor` goes innermost because
Megatron's per-layer all-reduces need the fastest links (NVLink inside a GPU host, the nearest ICI neighbours on a
TPU slice); `data` goes outermost because it communicates once per step (the gradient all-reduce).

| mesh axis | config field      | splits (logical axes)   | why                                                       |
|-----------|-------------------|-------------------------|-----------------------------------------------------------|
| data      | parallel.data     | batch                   | data parallelism: each rank a slice of the rows            |
| pipe      | parallel.pipe     | batch, layers           | pipeline stages own contiguous layers; embedding/head/loss split rows over `pipe` too |
| expert    | parallel.expert   | batch, experts          | expert parallelism: MoE experts split over ranks that are data-parallel outside the MoE layers (MaxText, Megatron-Core) |
| context   | parallel.context  | seq                     | context parallelism: activations split on the sequence dim |
| tensor    | parallel.tensor   | heads, kv_heads, mlp, vocab | Megatron TP: heads and MLP columns split, vocab-parallel embedding and head |
| —         |                   | embed, head_dim, norm, q_lora, kv_lora | replicated (q_lora, kv_lora: MLA's latent widths) |

Derived here, so adding an axis is one `MeshAxis` row plus its logical names:
- `RULES`: logical → mesh axes (jaxpar.sharding applies it). A logical name that several axes split maps to the
  tuple of them in table order (`batch → ("data", "pipe", "expert")`).
- `resolve_degrees`: the degree of every axis for a device count (`data = -1` fills what the others leave).
- `BATCH_AXES`: the axes that split batch rows (the data loader's row split, the batch's PartitionSpec).
- `GRAD_AXES`: the batch axes gradients are averaged over — those other than `pipe` (a pipeline's stages each
  hold different layers; gradients of what they all hold are summed over `pipe` by the pipeline step instead).
- `SEQ_AXES`: the axes that split the tokens of a row (`context`): every rank holds the whole rows and takes its
  part; loss and gradients are averaged over them too (each rank's loss is the mean over its equal share).

Pure data: this module imports only jaxpar.errors, so jaxpar.config can use it without a cycle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.errors import ConfigError, divisors


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its name (also its config field `parallel.<name>`), the logical axes it splits, and why."""

    name: str
    splits: tuple[str, ...]
    why: str

    @property
    def field(self) -> str:
        return f"parallel.{self.name}"


MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis("data", ("batch",), "data parallelism: each rank a slice of the rows"),
    MeshAxis("pipe", ("batch", "layers"), "pipeline stages own contiguous layers; embedding, head and loss split "
             "rows over the stages"),
    MeshAxis("expert", ("batch", "experts"), "MoE experts split over ranks that are data-parallel outside the MoE "
             "layers"),
    MeshAxis("context", ("seq",), "context parallelism: activations split on the sequence dim"),
    MeshAxis("tensor", ("heads", "kv_heads", "mlp", "vocab"), "Megatron TP: heads and MLP columns split, vocab-parallel "
             "embedding and head (innermost: the fastest links)"),
)

# Logical axes no mesh axis splits. q_lora / kv_lora: multi-head latent attention's latent widths (its down-projections
# and their norms are held whole by every tensor rank: jaxpar.model.mla_attention). prefix_layers / mtp_layers: the
# stacked axes of layers a pipeline runs outside its stages — DeepSeek's leading dense layers beside the embedding,
# the MTP modules beside the head — which every stage holds whole (jaxpar.model.Blocks).
REPLICATED: tuple[str, ...] = ("embed", "head_dim", "norm", "q_lora", "kv_lora", "prefix_layers", "mtp_layers")

AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES)  # mesh axis names, outermost first
DATA, PIPE, EXPERT, CONTEXT, TENSOR = AXES

MeshAxes = str | tuple[str, ...] | None


def _rules() -> tuple[tuple[str, MeshAxes], ...]:
    """Logical → mesh axes, in order of first appearance in the table, then the replicated names."""
    split_by: dict[str, list[str]] = {}
    for axis in MESH_AXES:
        for logical in axis.splits:
            split_by.setdefault(logical, []).append(axis.name)
    rules = [(logical, axes[0] if len(axes) == 1 else tuple(axes)) for logical, axes in split_by.items()]
    return tuple(rules) + tuple((name, None) for name in REPLICATED)


RULES: tuple[tuple[str, MeshAxes], ...] = _rules()

BATCH_AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES if "batch" in a.splits)
GRAD_AXES: tuple[str, ...] = tuple(a for a in BATCH_AXES if a != PIPE)
SEQ_AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES if "seq" in a.splits)  # split the tokens of a row


def resolve_degrees(parallel: Any, n_devices: int) -> dict[str, int]:
    """{axis: degree} for `n_devices`, in table order. `parallel` has one int attribute per axis; `data = -1` is
    filled with what the other axes leave; otherwise the product must equal the device count."""
    fixed_axes = AXES[1:]
    fixed = math.prod(getattr(parallel, a) for a in fixed_axes)
    names, values = "*".join(fixed_axes), "*".join(str(getattr(parallel, a)) for a in fixed_axes)
    if parallel.data == -1:
        if n_devices % fixed:
            # Name the innermost axis set above 1 (usually tensor): the one a user most likely set by hand.
            culprit = next((a for a in reversed(fixed_axes) if getattr(parallel, a) > 1), AXES[-1])
            raise ConfigError(f"parallel.{culprit}", getattr(parallel, culprit),
                              f"{names} = {values} = {fixed} must divide the {n_devices} available devices",
                              f"use {names} among {divisors(n_devices)}")
        data = n_devices // fixed
    else:
        data = parallel.data
        if data * fixed != n_devices:
            raise ConfigError("parallel.data", data,
                              f"mesh {'*'.join(AXES)} = {data}*{values} = {data * fixed} must equal the {n_devices} "
                              "available devices",
                              f"set parallel.data={n_devices // fixed} (or -1 to fill)" if n_devices % fixed == 0
                              else f"choose {names} among {divisors(n_devices)}, then parallel.data=-1")
    return {a: data if a == DATA else getattr(parallel, a) for a in AXES}


def mesh_shape(parallel: Any) -> tuple[int, ...]:
    """The degrees in table order, as configured (data may still be -1)."""
    return tuple(getattr(parallel, a) for a in AXES)
