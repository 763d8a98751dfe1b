"""Test session setup: 8 simulated CPU devices and a persistent compilation cache.

The device count must be fixed before jax is imported and can be set only once per process, so it is set here for
the whole session; tests that need one device build a 1-device mesh or run with no mesh at all.
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
