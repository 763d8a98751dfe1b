"""Test session setup: 8 simulated CPU devices (and, deliberately, no persistent compilation cache).

The device count must be fixed before jax is imported and can be set only once per process, so it is set here for
the whole session; tests that need one device build a 1-device mesh or run with no mesh at all.
"""

import os

# --xla_backend_optimization_level=0: LLVM compiles the CPU kernels without optimisation. The suite is compile-bound
# (tiny models, hundreds of programs): `make test` 35.8 → 24.4 min on 2 cores (a benchmark figure, README "Tests";
# `pytest tests/test_mla.py -k layouts_equal -n 0` 142 → 84 s side by side under the same load); the HLO passes,
# buffer assignment and collectives — what the tests compare and measure — are XLA's, not LLVM's. Subprocesses inherit
# the flags, so a two-process run and its one-process reference compile alike. Users' programs keep XLA's default.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent compilation cache: an executable that the cache loads back from disk deadlocked XLA CPU's collective
# rendezvous (pipeline + remat at (2, 2, 2): devices reached an all-reduce and a collective-permute in different
# orders), while the same program compiled fresh runs. Reproduce: enable the cache, run
# `pytest tests/test_pipeline.py -k "remat and llama"` twice.
