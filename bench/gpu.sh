#!/usr/bin/env bash
# One prepared GPU check for a lent NVIDIA GPU, in at most 8 minutes (a `timeout` enforces it):
#   1. XLA's GPU flags (jaxpar.perf), then check that JAX sees the GPU(s);
#   2. the bf16 matmul ceiling (8192^3), beside the datasheet peak;
#   3. ~30 training steps of a ~1B Llama (d_model 2048, 16 layers, 16 heads, seq 2048, bf16 compute) on random
#      tokens, printing tokens/s, TFLOP/s per device, MFU against the datasheet peak and the measured ceiling,
#      HFU, and peak memory;
#   3b. the llama_1b preset itself (32 heads of 64, bf16) on one GPU (data=tensor=pipe=1) with remat none, dots and
#      full, up to 10 steps each: the same figures per row, a row skipped (with the reason) when time is short;
#   4. decoding the same shape in bf16 / int8 / int4;
#   5. the planner (issue 20): probe this GPU, predict step 3's time and memory from the probe, then compile and
#      time `parallel.auto`'s own layout for the model — predicted vs measured step time, MFU and memory; then,
#      with time left, where step 3's temp allocation goes (stacked per computation vs allocated vs live at once:
#      does XLA:GPU stack loop bodies' temporaries on their callers' as XLA:CPU does?).
#   The last line, `GPU-RESULT {json}`, goes into bench/RESULTS.md with the date. Every deadline inside is set from
#   GPU_BENCH_TIMEOUT_S (default 470 s; the dry run's 840 s is a safety net for a loaded CI machine, not a target);
#   10 s before it a watchdog prints GPU-RESULT with what was measured so far and exits 3.
#
#   bench/gpu.sh                      on the GPU machine, from anywhere (it cds to the repo root)
#   bench/gpu.sh --dry-run            the same path on CPU with a tiny model (CI runs this; ~45 s on an idle 2-core VM)
#   bench/gpu.sh --steps 20 --batch-per-device 8 parallel.remat=dots      options and config overrides
#
# JAX with CUDA: the script uses $PYTHON, else .venv/bin/python, else python3. If that JAX cannot see a GPU and
# $WHEELS names a directory of carried wheels (pip download 'jax[cuda12]' elsewhere), they are installed offline
# first. Timing: ~1-2 min of start-up and compilation, ~30 steps of ~0.1-0.3 s, the matmul check seconds; then
# one compile per section 3b row, decoding and the planner, each while its share of the time is left.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  export GPU_BENCH_TIMEOUT_S="${GPU_BENCH_TIMEOUT_S:-840}"  # a safety net: a loaded machine is slow, not broken
  export XLA_FLAGS="$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
  if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" >/dev/null 2>&1; then
    if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
      echo "JAX sees no GPU: installing jax[cuda12] from $WHEELS (offline)"
      "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "jax[cuda12]"
    fi
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_BENCH_TIMEOUT_S="${GPU_BENCH_TIMEOUT_S:-470}"  # bench.gpu sets its deadlines from the same value
exec timeout "$GPU_BENCH_TIMEOUT_S" "$PY" -m bench.gpu "$@"
