"""The device mesh: axes `("data", "pipe", "tensor")`, tensor innermost.

`tensor` is the innermost (fastest-varying) axis so that a tensor-parallel group is made of neighbouring devices —
on a GPU host those share NVLink, which the per-layer all-reduces of Megatron TP need. `jax.make_mesh` asks
`mesh_utils.create_device_mesh` for a topology-aware device order, so the same holds on TPU slices. Across several
processes (hosts) the order is explicit instead (`hybrid_device_order`): tensor, then pipe, inside a host; data across
hosts.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import ConfigError, ParallelConfig, data_degree

AXES = ("data", "pipe", "tensor")


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all devices) with axes data, pipe, tensor.

    Axis types are `Auto`: the compiler (GSPMD/Shardy) propagates shardings from the parameter and batch
    annotations; explicit per-collective code runs under `jax.shard_map` on top of the same mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (data_degree(parallel, len(devices)), parallel.pipe, parallel.tensor)
    if len({d.process_index for d in devices}) > 1:
        return Mesh(hybrid_device_order(devices, shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def hybrid_device_order(devices: list, shape: tuple[int, int, int]) -> np.ndarray:
    """Devices of several processes (hosts) as an array of `shape` = (data, pipe, tensor): `tensor`, then `pipe`
    inside a process where they fit, `data` across processes.

    Devices are sorted by (process_index, id) and reshaped, so consecutive mesh positions fill one process before
    the next: with D devices per process, a tensor group (t consecutive positions) stays inside a process when t
    divides D, and a whole pipe x tensor block too when p*t divides D; otherwise pipe spans processes (activations
    cross the network once per pipeline iteration — cheap next to TP's per-layer all-reduces), and the processes
    sharing a data slice all load its rows. Processes must hold equal device counts, and pipe*tensor must divide or
    be a multiple of that count (so no process holds part of a data slice another process also partly holds).
    Raises ConfigError naming the axis otherwise.
    """
    _, pipe, tensor = shape
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    counts = set(per_process.values())
    local = next(iter(counts))
    if len(counts) > 1:
        raise ConfigError("devices", per_process, "every process must hold the same number of devices",
                          "give each process the same --devices-per-process / GPUs")
    if local % tensor:
        raise ConfigError("parallel.tensor", tensor, f"must divide the {local} devices of each process (a tensor "
                          "group inside one host: its per-layer all-reduces need the fast links)",
                          f"use parallel.tensor among {[k for k in range(1, local + 1) if local % k == 0]}")
    block = pipe * tensor  # devices of one data slice
    if local % block and block % local:
        raise ConfigError("parallel.pipe", pipe, f"pipe*tensor = {block} must divide, or be a multiple of, the {local} "
                          "devices of each process (so that each process holds whole data slices, or whole shares "
                          "of one)", f"use pipe*tensor among the divisors or multiples of {local}")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(shape)


def describe_mesh(mesh: Mesh) -> str:
    """The mesh's device order, one line per (data, pipe) row: `data 0 pipe 1: tensor -> [2 3] (process 0)`."""
    lines = [(f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices in "
             f"{len({d.process_index for d in mesh.devices.flat})} process(es); device ids:")]
    for i, j in np.ndindex(*mesh.devices.shape[:2]):
        devs = mesh.devices[i, j]
        procs = sorted({d.process_index for d in devs})
        lines.append(f"  data {i} pipe {j}: tensor -> {[d.id for d in devs]} (process {', '.join(map(str, procs))})")
    return "\n".join(lines)
