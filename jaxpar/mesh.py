"""The device mesh: axes `("data", "pipe", "tensor")`, tensor innermost.

`tensor` is the innermost (fastest-varying) axis so that a tensor-parallel group is made of neighbouring devices —
on a GPU host those share NVLink, which the per-layer all-reduces of Megatron TP need. `jax.make_mesh` asks
`mesh_utils.create_device_mesh` for a topology-aware device order, so the same holds on TPU slices.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from jaxpar.config import ConfigError, ParallelConfig

AXES = ("data", "pipe", "tensor")


def mesh_shape(parallel: ParallelConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, pipe, tensor) with `data = -1` filled from the device count; ConfigError if the product is wrong."""
    fixed = parallel.pipe * parallel.tensor
    data = parallel.data
    if data == -1:
        if n_devices % fixed:
            raise ConfigError("parallel.tensor", parallel.tensor,
                              f"pipe*tensor = {fixed} must divide the {n_devices} available devices",
                              "choose pipe and tensor whose product divides the device count")
        data = n_devices // fixed
    if data * fixed != n_devices:
        raise ConfigError("parallel.data", parallel.data,
                          f"mesh data*pipe*tensor = {data}*{parallel.pipe}*{parallel.tensor} = {data * fixed} must "
                          f"equal the {n_devices} available devices", "set parallel.data=-1 to fill the devices")
    return data, parallel.pipe, parallel.tensor


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all devices) with axes data, pipe, tensor.

    Axis types are `Auto`: the compiler (GSPMD/Shardy) propagates shardings from the parameter and batch
    annotations; explicit per-collective code runs under `jax.shard_map` on top of the same mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(parallel, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
