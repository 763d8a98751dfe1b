"""XLA flags for NVIDIA GPUs, set in one place: `configure_gpu_flags()`.

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
"""

from __future__ import annotations

import importlib.metadata
import os
import re
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
