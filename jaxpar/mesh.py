"""The device mesh: the axes of `jaxpar.parallel.axes` (data, pipe, expert, context, tensor), tensor innermost.

`tensor` is the innermost (fastest-varying) axis so that a tensor-parallel group is made of neighbouring devices —
on a GPU host those share NVLink, which the per-layer all-reduces of Megatron TP need. `jax.make_mesh` asks
`mesh_utils.create_device_mesh` for a topology-aware device order, so the same holds on TPU slices. Across several
processes (hosts) the order is explicit instead (`hybrid_device_order`): every axis but data inside a host where it
fits, innermost first; data across hosts. A size-1 axis costs nothing: it adds a dim of length 1 to the array.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import ConfigError, ParallelConfig
from jaxpar.errors import divisors
from jaxpar.parallel.axes import AXES, DATA, TENSOR, resolve_degrees


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all devices) with the axes of the table, sized by `parallel` (data = -1
    fills the rest).

    Axis types are `Auto`: the compiler (GSPMD/Shardy) propagates shardings from the parameter and batch
    annotations; explicit per-collective code runs under `jax.shard_map` on top of the same mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(resolve_degrees(parallel, len(devices)).values())
    if len({d.process_index for d in devices}) > 1:
        return Mesh(hybrid_device_order(devices, shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def hybrid_device_order(devices: list, shape: tuple[int, ...]) -> np.ndarray:
    """Devices of several processes (hosts) as an array of `shape` (one degree per axis of `AXES`, data first):
    every axis but `data` inside a process where it fits, innermost (`tensor`) first; `data` across processes.

    Devices are sorted by (process_index, id) and reshaped, so consecutive mesh positions fill one process before
    the next: with D devices per process, a tensor group (t consecutive positions) stays inside a process when t
    divides D, and the whole block of one data slice (the product of every axis but data, e.g. pipe·tensor) too
    when it divides D; otherwise the outer of those axes span processes (pipe's activations cross the network once
    per pipeline iteration — cheap next to TP's per-layer all-reduces), and the processes sharing a data slice all
    load its rows. Processes must hold equal device counts, and the block must divide or be a multiple of that
    count (so no process holds part of a data slice another process also partly holds). Raises ConfigError naming
    the axis otherwise.
    """
    if len(shape) != len(AXES):
        raise ValueError(f"shape {shape} must give one degree per mesh axis {AXES}")
    degrees = dict(zip(AXES, shape))
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    counts = set(per_process.values())
    local = next(iter(counts))
    if len(counts) > 1:
        raise ConfigError("devices", per_process, "every process must hold the same number of devices",
                          "give each process the same --devices-per-process / GPUs")
    tensor = degrees[TENSOR]
    if local % tensor:
        raise ConfigError("parallel.tensor", tensor, f"must divide the {local} devices of each process (a tensor "
                          "group inside one host: its per-layer all-reduces need the fast links)",
                          f"use parallel.tensor among {divisors(local)}")
    inner = [a for a in AXES if a != DATA]  # the axes of one data slice, outermost first
    block = math.prod(degrees[a] for a in inner)  # devices of one data slice
    if local % block and block % local:
        # Name the outermost axis above 1 of the slice: the one that spans processes (pipe, in today's layouts).
        culprit = next((a for a in inner if degrees[a] > 1), TENSOR)
        names = "*".join(a for a in inner if degrees[a] > 1 or a == culprit)
        raise ConfigError(f"parallel.{culprit}", degrees[culprit], f"{names} = {block} must divide, or be a "
                          f"multiple of, the {local} devices of each process (so that each process holds whole data "
                          "slices, or whole shares of one)", f"use {names} among the divisors or multiples of {local}")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(shape)


def describe_mesh(mesh: Mesh) -> str:
    """The mesh's device order, one line per position of every axis but the innermost:
    `data 0 pipe 1: tensor -> [2 3] (process 0)`. Outer axes of size 1 other than data (whose index is the data
    slice) are left out of the labels: their index is always 0."""
    lines = [(f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices in "
             f"{len({d.process_index for d in mesh.devices.flat})} process(es); device ids:")]
    outer, last = mesh.axis_names[:-1], mesh.axis_names[-1]
    shown = [k for k, name in enumerate(outer) if name == DATA or mesh.shape[name] > 1]
    for index in np.ndindex(*mesh.devices.shape[:-1]):
        devs = mesh.devices[index]
        procs = sorted({d.process_index for d in devs})
        where = " ".join(f"{outer[k]} {index[k]}" for k in shown)
        lines.append(f"  {where}: {last} -> {[d.id for d in devs]} (process {', '.join(map(str, procs))})")
    return "\n".join(lines)
