"""The device mesh: axes `("data", "pipe", "tensor")`, tensor innermost.

`tensor` is the innermost (fastest-varying) axis so that a tensor-parallel group is made of neighbouring devices —
on a GPU host those share NVLink, which the per-layer all-reduces of Megatron TP need. `jax.make_mesh` asks
`mesh_utils.create_device_mesh` for a topology-aware device order, so the same holds on TPU slices.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from jaxpar.config import ParallelConfig, data_degree

AXES = ("data", "pipe", "tensor")


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all devices) with axes data, pipe, tensor.

    Axis types are `Auto`: the compiler (GSPMD/Shardy) propagates shardings from the parameter and batch
    annotations; explicit per-collective code runs under `jax.shard_map` on top of the same mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (data_degree(parallel, len(devices)), parallel.pipe, parallel.tensor)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
