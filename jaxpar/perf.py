"""Process-level performance settings, set in one place: XLA's flags for NVIDIA GPUs (`configure_gpu_flags()`) and
the host allocator (`retain_host_memory()`).

XLA reads `XLA_FLAGS` once, when a backend starts, so this must run before anything touches a JAX backend
(`jax.devices()`, the first jit); `jaxpar train` calls it first thing. Afterwards it changes nothing and says so.

The flags (names checked against the JAX GPU performance guide, NVIDIA JAX-Toolbox's "GPU performance" page and
MaxText's GPU recipes; every one is known to the XLA of jax 0.10–0.12, and an unknown name would abort the process,
which `tests/test_flops.py` guards against on CPU, where they are accepted and ignored):

    --xla_gpu_enable_latency_hiding_scheduler=true       schedule asynchronous collectives (tensor-parallel
                                                         all-reduces, data-parallel gradient reductions, pipeline
                                                         permutes) to overlap with independent compute
    --xla_gpu_enable_highest_priority_async_stream=true  run those collectives on a high-priority stream, so
                                                         overlapped communication is not starved by compute kernels
    --xla_gpu_enable_triton_gemm=false                   keep matmuls on cuBLAS (MaxText's choice: for the large
                                                         bf16 GEMMs of a transformer cuBLAS is as fast or faster and
                                                         compiles without autotuning Triton tiles)
    --xla_gpu_all_reduce_combine_threshold_bytes=…       combine small collectives into few large ones (up to
    --xla_gpu_all_gather_combine_threshold_bytes=…       128 MiB): the per-parameter gradient all-reduces and ZeRO
    --xla_gpu_reduce_scatter_combine_threshold_bytes=…   gathers/scatters become a handful of bandwidth-bound ones

Left out on purpose: the collective pipeliner flags (`xla_gpu_enable_pipelined_*`, for FSDP-style per-layer
gathers, which jaxpar does not do) and while-loop double buffering (it unrolls the layer scan twice: longer
compiles, more memory).

A flag already named in `XLA_FLAGS` — whatever its value — is never changed: the user's setting wins.

The host allocator. XLA's CPU runtime allocates each execution's temporaries (tens of MB for a training step, 57 MB
for the tiny Llama of bench/versus.py) with `malloc` and frees them when it ends. glibc serves such sizes with a
fresh `mmap` — or from a per-thread arena heap that it unmaps when empty — so every step faults in every page of
its temporaries again (about 14,000 minor faults a step there), and page faults serialise the process's threads on
the kernel's memory-map lock. `retain_host_memory()` tells glibc, through `mallopt`, to serve every size from one
arena and never give memory back (the behaviour tcmalloc and jemalloc have by default, and what MaxText's TPU setup
gets by preloading tcmalloc): the pages of step t are reused by step t + 1, faults drop to zero, and on the tiny
model the single-device step's CPU time falls by a third. The cost is that the process keeps its peak host memory
until it exits — the right trade for a training or serving process. `jaxpar train` and `fit` call it; it applies
only where glibc is the allocator (Linux) and does nothing when `JAXPAR_HOST_MALLOC=system` is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import re
import sys
import warnings

COMBINE_BYTES = 128 * 1024 * 1024

GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_enable_triton_gemm": "false",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_BYTES),
}


def _set_flag_names(flags: str) -> set[str]:
    """Names of the flags in an XLA_FLAGS string (`--name=value` or `--name`)."""
    return set(re.findall(r"--([A-Za-z0-9_]+)", flags))


def _gpu_expected(environ) -> bool:
    """Will JAX pick an NVIDIA GPU? Decided without starting a backend: JAX_PLATFORMS if set, else whether a CUDA
    PJRT plugin is installed (a machine with the plugin but no GPU falls back to CPU, where the flags are inert)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return any("cuda" in ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))


def configure_gpu_flags(environ=None) -> list[str]:
    """Add `GPU_FLAGS` to XLA_FLAGS in `environ` (default os.environ) when JAX will run on an NVIDIA GPU and no
    backend has started yet; flags the user already set are left alone. Returns the flags added (`--name=value`)."""
    environ = os.environ if environ is None else environ
    if not _gpu_expected(environ):
        return []
    from jax._src import xla_bridge  # importing jax starts no backend

    if xla_bridge.backends_are_initialized():
        warnings.warn("jaxpar.perf.configure_gpu_flags: a JAX backend already started, so XLA_FLAGS can no longer "
                      "change; call it before the first jax.devices() or jit", stacklevel=2)
        return []
    current = environ.get("XLA_FLAGS", "")
    taken = _set_flag_names(current)
    added = [f"--{name}={value}" for name, value in GPU_FLAGS.items() if name not in taken]
    if added:
        environ["XLA_FLAGS"] = " ".join([current.strip(), *added]).strip()
    return added


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def retain_host_memory() -> bool:
    """Make glibc keep and reuse freed memory (one arena, no mmap'd chunks, no trimming); see the module docstring.
    Returns whether it applied. Threads that already have their own arena keep it, so call this before JAX starts a
    backend for the full effect; calling it again does nothing."""
    if not sys.platform.startswith("linux") or os.environ.get("JAXPAR_HOST_MALLOC", "") == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(param, value) == 1 for param, value in settings)
