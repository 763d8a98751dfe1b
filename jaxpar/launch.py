"""`jaxpar launch`: N local processes on 127.0.0.1, for laptops and CI (CPU devices, gloo collectives).

    jaxpar launch --processes 2 --devices-per-process 4 -- jaxpar train --config configs/tiny.py --workdir runs/mh

Each child runs the command after `--` with

    JAXPAR_COORDINATOR=127.0.0.1:<free port>  JAXPAR_NUM_PROCESSES=N  JAXPAR_PROCESS_ID=k
    JAX_PLATFORMS=cpu  XLA_FLAGS=--xla_force_host_platform_device_count=K  PJRT_NPROC=max(CPUs, N·K)

which `jaxpar.distributed.resolve` reads, exactly as it reads the JobSet's variables on a cluster. Every line a child
prints is prefixed with `[k] `. CPU cross-process collectives go through gloo (`jax_cpu_collectives_implementation`,
the default in jax 0.10–0.12). If a child exits non-zero the others get `grace_s` seconds to notice by themselves (their
watchdog names the lost process), then are killed; the launcher exits with the first failing status.

PJRT_NPROC is what lets N × K devices compute bit for bit like one process with all N·K. XLA's CPU client sizes its
intra-op (Eigen) thread pool as max(PJRT_NPROC, else NPROC, else the CPUs it may run on; its local device count), and
a matmul's result depends on that size: how the contraction (for a weight gradient, the sum over tokens) is split into
partial sums follows the thread count. Without it, on 2 cores, 1 × 8 devices run 8 threads and 2 × 4 run 4 each, and
the MLP and LM-head gradients differ by rounding (about 2e-7 relative) before any collective runs. Each child
therefore gets the pool of the single process it stands in for.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxpar.errors import UsageError


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the coordinator binds it in process 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict[str, str], *, process_id: int, processes: int, devices_per_process: int,
              coordinator: str) -> dict[str, str]:
    """The environment of local process `process_id`: the JAXPAR_* wiring, a CPU platform with K devices, and the
    intra-op thread count of one process holding all N·K devices (PJRT_NPROC; see the module docstring)."""
    flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    return {**base, "JAXPAR_COORDINATOR": coordinator, "JAXPAR_NUM_PROCESSES": str(processes),
            "JAXPAR_PROCESS_ID": str(process_id), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags),
            "PJRT_NPROC": str(max(cpu_threads(base), processes * devices_per_process)), "PYTHONUNBUFFERED": "1"}


def cpu_threads(env: dict[str, str]) -> int:
    """The intra-op thread count XLA's CPU client starts from before it takes the device count into account
    (`xla::DefaultThreadPoolSize`): PJRT_NPROC, else NPROC, else the CPUs this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return max(0, int(env[name]))
        except (KeyError, ValueError):
            pass
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _resolve_command(command: Sequence[str]) -> list[str]:
    """`jaxpar ...` runs as `python -m jaxpar.cli ...` with this interpreter (no reliance on PATH)."""
    command = list(command)
    if command and command[0] == "jaxpar":
        return [sys.executable, "-m", "jaxpar.cli", *command[1:]]
    return command


def _pump(stream, prefix: str, out) -> None:
    """Copy a child's output to `out`, line by line, each line prefixed with its rank."""
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def launch(command: Sequence[str], processes: int, devices_per_process: int = 1, *, port: int | None = None,
           grace_s: float = 90.0, env: dict[str, str] | None = None) -> int:
    """Run `command` as `processes` local JAX processes wired to one coordinator; return the exit status.

    0 when every process exits 0; otherwise the status of the first process to fail (after the others have had
    `grace_s` seconds to exit on their own, then SIGKILL). SIGINT/SIGTERM to the launcher are forwarded.
    """
    if processes < 1:
        raise UsageError(f"--processes = {processes}: must be >= 1")
    if devices_per_process < 1:
        raise UsageError(f"--devices-per-process = {devices_per_process}: must be >= 1")
    if not command:
        raise UsageError("no command to launch. Fix: jaxpar launch --processes 2 -- jaxpar train --config ...")
    argv = _resolve_command(command)
    coordinator = f"127.0.0.1:{port or free_port()}"
    base = dict(os.environ if env is None else env)
    print(f"jaxpar launch: {processes} processes x {devices_per_process} CPU devices, coordinator {coordinator}: "
          f"{shlex.join(command)}", flush=True)
    children, pumps = [], []
    for k in range(processes):
        proc = subprocess.Popen(argv, env=child_env(base, process_id=k, processes=processes,
                                                    devices_per_process=devices_per_process,
                                                    coordinator=coordinator),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        children.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{k}] ", sys.stdout), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum, frame):
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status, deadline = 0, None
        while any(p.poll() is None for p in children):
            for k, proc in enumerate(children):
                rc = proc.poll()
                if rc not in (None, 0) and status == 0:
                    status = rc if rc > 0 else 128 - rc  # killed by signal s: 128 + s, like a shell
                    print(f"jaxpar launch: process {k} exited with status {rc}; waiting up to {grace_s:.0f} s for "
                          "the others", file=sys.stderr, flush=True)
                    deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for k, proc in enumerate(children):
                    if proc.poll() is None:
                        print(f"jaxpar launch: killing process {k}", file=sys.stderr, flush=True)
                        proc.kill()
            time.sleep(0.1)
        for k, proc in enumerate(children):
            if proc.returncode != 0 and status == 0:
                status = proc.returncode if proc.returncode > 0 else 128 - proc.returncode
        for pump in pumps:
            pump.join(timeout=5)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
