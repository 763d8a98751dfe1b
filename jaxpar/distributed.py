"""Multi-process start-up on `jax.distributed`: one JAX process per host (or per GPU), all running the same command.

    settings = resolve(cli_flags, os.environ)   # who am I, who is the coordinator, which local devices
    initialize(settings)                        # jax.distributed.initialize + a watchdog for lost peers

Where the settings come from, first match wins:

| source | coordinator | process count / id | local devices |
|---|---|---|---|
| flags `--coordinator --num-processes --process-id [--local-device-ids]` | flag | flags | flag, else all visible |
| env `JAXPAR_COORDINATOR`, `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID`, `JAXPAR_LOCAL_DEVICE_IDS` (`jaxpar launch`, the JobSet) | env | env | env, else all visible |
| SLURM (`srun`: `SLURM_NTASKS > 1`) or Open MPI (`mpirun`: `OMPI_COMM_WORLD_SIZE > 1`) | JAX's cluster detection | JAX's cluster detection | see below |
| none of these | — one process, nothing to initialise — | | |

**The local-device trap.** JAX's SLURM/Open MPI detection assumes one process per GPU and sets
`local_device_ids = [local rank]`; with one task per node and 8 GPUs each process would then see one GPU. So under a
cluster we decide ourselves, from the tasks on this node `L` and the GPUs this task can see `V`
(`CUDA_VISIBLE_DEVICES`, else `SLURM_GPUS_ON_NODE`):
`L = 1` → all visible devices; `SLURM_GPUS_PER_TASK` set (SLURM already bound the task's GPUs) → all `V` visible;
`V` a multiple of `L` → this rank's contiguous `V/L`; unknown `V` → JAX's `[local rank]`. `--local-device-ids`
overrides all of it.

**A lost peer is an error, not a hang.** `initialization_timeout` bounds start-up (a peer that never comes);
`heartbeat_timeout_seconds = peer_timeout` (default 60 s) bounds how long the coordination service waits for a
silent host. A process that dies closes its sockets, which `Watchdog` sees at once: every live process prints
`jaxpar: lost process K …` and exits with status `EXIT_LOST_PEER` (3), typically within a second or two.
All options exist under these names in jax 0.10.2 through 0.12.

**No persistent compilation cache across CPU processes.** JAX writes the cache from process 0 only, so a resumed run
has process 0 load its step from the cache while the others compile it; with CPU (gloo) collectives on jax 0.12.1
that step's first collective never completed (both processes waiting on its result). `initialize` turns the cache
off for multi-process CPU runs and says so (`cpu_cache_notice`); GPU runs keep it.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence

EXIT_LOST_PEER = 3  # exit status when a peer process was lost (distinct from 1: an exception, 2: a config error)
DEFAULT_PEER_TIMEOUT_S = 60


class DistributedError(ValueError):
    """Inconsistent or incomplete multi-process settings; the message names the flag (or variable) and a fix."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved multi-process settings. `num_processes == 1` means: do not initialise anything.

    `source` says where they came from ('single', 'flags', 'env', 'slurm', 'ompi'); `coordinator`, `process_id` are
    None under a cluster (JAX's detection fills them); `local_device_ids` None lets JAX decide.
    """

    num_processes: int = 1
    process_id: int | None = 0
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "single"
    init_timeout_s: int = 300
    peer_timeout_s: int = DEFAULT_PEER_TIMEOUT_S


def _int(value: str, name: str, fix: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} = {value!r}: must be an integer. Fix: {fix}") from None


def _ids(value: str | Sequence[int] | None, name: str) -> tuple[int, ...] | None:
    """'0,1,2,3' (or a sequence) → (0, 1, 2, 3); '' or None → None."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return tuple(_int(v, name, "a comma-separated list of local device ordinals, e.g. 0,1,2,3")
                     for v in value.split(","))
    return tuple(int(v) for v in value)


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Processes on this node under SLURM ('8' or '8(x4)' in SLURM_STEP_TASKS_PER_NODE) or Open MPI."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(key):
            return int(env[key].split("(")[0].split(",")[0])
    return None


def cluster_local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The local devices of this process under SLURM / Open MPI (see the module docstring for the rule)."""
    tasks = _tasks_per_node(env)
    rank = env.get("SLURM_LOCALID") or env.get("OMPI_COMM_WORLD_LOCAL_RANK")
    if env.get("CUDA_VISIBLE_DEVICES"):
        visible = len(env["CUDA_VISIBLE_DEVICES"].split(","))
    elif env.get("SLURM_GPUS_ON_NODE"):
        visible = int(env["SLURM_GPUS_ON_NODE"])
    else:
        visible = None
    if visible is None or tasks is None or rank is None:
        return None  # JAX's default ([local rank] on GPU; TPU and CPU ignore it)
    if tasks == 1 or env.get("SLURM_GPUS_PER_TASK"):
        return tuple(range(visible))  # the task sees exactly its own GPUs
    if visible % tasks:
        raise DistributedError(
            f"{tasks} processes on this node share {visible} visible GPUs, which does not divide evenly. Fix: run "
            "one task per node or per GPU, or pass --local-device-ids")
    per = visible // tasks
    return tuple(range(int(rank) * per, (int(rank) + 1) * per))


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            local_device_ids: str | Sequence[int] | None = None, *, peer_timeout_s: int = DEFAULT_PEER_TIMEOUT_S,
            init_timeout_s: int = 300, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from explicit flags, else `JAXPAR_*` variables, else a SLURM / Open MPI step, else one process.

    Raises DistributedError naming the flag for a partial or inconsistent set (a coordinator without a process
    count, a process id out of range, …).
    """
    env = os.environ if env is None else env
    if peer_timeout_s <= 0 or init_timeout_s <= 0:
        raise DistributedError(f"--peer-timeout = {peer_timeout_s}, --init-timeout = {init_timeout_s}: must be "
                               "positive seconds. Fix: e.g. --peer-timeout 60")
    timeouts = {"peer_timeout_s": peer_timeout_s, "init_timeout_s": init_timeout_s}
    source = "flags"
    if coordinator is None and num_processes is None and process_id is None and env.get("JAXPAR_NUM_PROCESSES"):
        source = "env"
        coordinator = env.get("JAXPAR_COORDINATOR") or None
        num_processes = _int(env["JAXPAR_NUM_PROCESSES"], "JAXPAR_NUM_PROCESSES", "the number of processes")
        if env.get("JAXPAR_PROCESS_ID"):
            process_id = _int(env["JAXPAR_PROCESS_ID"], "JAXPAR_PROCESS_ID", "this process's rank, 0-based")
        local_device_ids = local_device_ids or env.get("JAXPAR_LOCAL_DEVICE_IDS")
    ids = _ids(local_device_ids, "--local-device-ids")
    if coordinator is not None or num_processes is not None or process_id is not None:
        flag = "--" if source == "flags" else "JAXPAR_"
        missing = [name for name, v in (("coordinator", coordinator), ("num-processes", num_processes),
                                        ("process-id", process_id)) if v is None]
        if missing and num_processes != 1:
            raise DistributedError(
                f"{', '.join(flag + m.replace('-', '_').upper() if flag == 'JAXPAR_' else flag + m for m in missing)} "
                f"missing: a multi-process run needs the coordinator's host:port, the process count and this "
                f"process's id. Fix: pass all three (jaxpar launch sets them for local runs)")
        if num_processes is not None and num_processes < 1:
            raise DistributedError(f"{flag}num-processes = {num_processes}: must be >= 1")
        if num_processes == 1:
            return Settings(source=source, local_device_ids=ids, **timeouts)
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"{flag}process-id = {process_id}: must lie in [0, {num_processes}) for "
                                   f"{num_processes} processes. Fix: number processes 0..{num_processes - 1}")
        if ":" not in coordinator:
            raise DistributedError(f"{flag}coordinator = {coordinator!r}: must be host:port (process 0's address "
                                   "and a free port), e.g. 10.0.0.1:1234")
        return Settings(num_processes, process_id, coordinator, ids, source, **timeouts)
    for name, size_key, rank_key in (("slurm", "SLURM_NTASKS", "SLURM_PROCID"),
                                     ("ompi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        # SLURM_NTASKS alone is also set in an salloc shell; SLURM_PROCID only inside an srun step.
        if env.get(size_key) and env.get(rank_key) and int(env[size_key]) > 1:
            ids = ids if ids is not None else cluster_local_device_ids(env)
            return Settings(int(env[size_key]), int(env[rank_key]), None, ids, name, **timeouts)
    return Settings(local_device_ids=ids, **timeouts)


def initialize(settings: Settings) -> None:
    """Start `jax.distributed` for `settings` (nothing for one process) and the lost-peer watchdog.

    Must run before anything touches a JAX backend (jax.devices(), any array), like jax.distributed.initialize.
    """
    if settings.num_processes == 1:
        return
    import jax

    kwargs = {"initialization_timeout": settings.init_timeout_s, "heartbeat_timeout_seconds": settings.peer_timeout_s}
    if settings.source in ("flags", "env"):
        # Explicit settings: no cluster detection, so nothing overrides them (or the local devices, None = all).
        kwargs.update(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
                      process_id=settings.process_id, cluster_detection_method="deactivate")
    # 'local_device_ids=None' under a cluster lets JAX pick [local rank]; `resolve` fills it where that is wrong.
    jax.distributed.initialize(local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
                               **kwargs)
    # The coordinator's address as JAX resolved it (also under cluster detection): process 0's host.
    from jax._src import distributed

    host = distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
    start_watchdog(jax.process_count(), jax.process_index(), host, settings.peer_timeout_s)
    notice = cpu_cache_notice(jax.default_backend(), jax.config.jax_compilation_cache_dir,
                              jax.config.jax_enable_compilation_cache)
    if notice:  # before the first compile, which is when JAX opens the cache
        jax.config.update("jax_enable_compilation_cache", False)
        if jax.process_index() == 0:
            print(notice, flush=True)


def cpu_cache_notice(backend: str, cache_dir: str | None, enabled: bool) -> str | None:
    """The line a multi-process run prints when it turns JAX's persistent compilation cache off (CPU only: see the
    module docstring), or None where there is nothing to turn off."""
    if backend != "cpu" or not cache_dir or not enabled:
        return None
    return (f"jaxpar: the persistent compilation cache ({cache_dir}) is off for this multi-process CPU run: JAX "
            "writes it from process 0 only, and a resume where process 0 loads a step the others compile never "
            "finished its first collective (jax 0.12.1, gloo)")


def batch_rows(sharding, batch_size: int) -> tuple[int, int]:
    """(index, count): this process's rows of a [batch_size, …] global batch laid out with `sharding` are slice
    `index` of `count` equal contiguous slices — what the data loader takes as its process index and count.

    Usually (index, count) = (process_index, process_count); when `pipe` spans hosts several processes hold the
    same data slice, and each of them loads those rows (count < process_count).
    """
    shape = (batch_size, *([1] * (len(sharding.spec) - 1 if len(sharding.spec) else 0)))
    spans = {(i[0].start or 0, batch_size if i[0].stop is None else i[0].stop)
             for i in sharding.addressable_devices_indices_map(shape).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    rows = hi - lo
    if sum(b - a for a, b in spans) < rows or batch_size % rows or lo % rows:
        raise DistributedError(f"this process's batch rows {sorted(spans)} are not one aligned contiguous slice of "
                               f"{batch_size}. Fix: order the mesh with jaxpar.mesh.make_mesh (hybrid order)")
    return lo // rows, batch_size // rows


def _client():
    """The live coordination-service client (the public API exposes no key-value store; present in jax 0.4–0.12)."""
    from jax._src import distributed

    return distributed.global_state.client


class Watchdog:
    """Notices a lost peer within about a second of its death and exits this process (status EXIT_LOST_PEER).

    JAX's coordination service only learns of a dead process when its heartbeats stop (`peer_timeout` later), and a
    collective with a dead peer either fails at once (gloo: "connection closed by peer", which names no rank) or,
    on other transports, hangs. So every process keeps one TCP connection to process 0 (a star; the address is
    published in the coordination service's key-value store), and a process's death closes its socket:

    - process 0 sees connection k close → prints "lost process k", tells every other process ("lost k") and exits;
    - process k sees process 0's connection close without such a message → "lost process 0 (the coordinator)".

    A host that vanishes without closing its sockets is caught by JAX's heartbeat timeout instead (`peer_timeout`),
    which terminates the process with JAX's own message. `disarm()` (at a clean end, before JAX's shutdown barrier)
    stops treating closed connections as losses. The exit is `os._exit`: the main thread may be blocked in a
    collective that will never complete, and JAX's shutdown barrier would wait for the dead peer.
    """

    KEY = "jaxpar/watchdog"

    def __init__(self, num_processes: int, process_id: int, coordinator_host: str, timeout_s: float):
        self.num_processes, self.process_id, self.timeout_s = num_processes, process_id, timeout_s
        self.armed = True
        self._conns: dict[int, socket.socket] = {}
        if process_id == 0:
            # All interfaces, IPv6 too where the host has it (a coordinator name may resolve to either family).
            dual = socket.has_dualstack_ipv6()
            server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                          backlog=num_processes, dualstack_ipv6=dual)
            _client().key_value_set(self.KEY, str(server.getsockname()[1]))
            server.settimeout(timeout_s)
            for _ in range(num_processes - 1):  # everyone connects right after jax.distributed.initialize
                conn, _ = server.accept()
                self._conns[int(conn.recv(16).decode().strip())] = conn
            server.close()
        else:
            port = int(_client().blocking_key_value_get(self.KEY, int(timeout_s * 1000)))
            conn = socket.create_connection((coordinator_host, port), timeout=timeout_s)
            conn.sendall(f"{process_id:<15d}\n".encode())
            self._conns[0] = conn
        self._thread = threading.Thread(target=self._watch, name="jaxpar-peer-watchdog", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        """A clean end: closed connections from now on are peers finishing, not peers lost."""
        self.armed = False

    def lost(self, who: str) -> None:
        """Report the loss and exit this process at once."""
        if not self.armed:
            return
        print(f"jaxpar: lost {who}; process {self.process_id} of {self.num_processes} exits with status "
              f"{EXIT_LOST_PEER}. Relaunch the same command to resume from the last checkpoint.",
              file=sys.stderr, flush=True)
        os._exit(EXIT_LOST_PEER)

    def _watch(self) -> None:
        while self._conns:
            ready, _, _ = select.select(list(self._conns.values()), [], [], 1.0)
            for conn in ready:
                k = next(k for k, c in self._conns.items() if c is conn)
                try:
                    message = conn.recv(64).decode()
                except OSError:
                    message = ""
                if message.startswith("lost "):  # process 0 tells us which peer it lost
                    self.lost(f"process {message.split()[1]} (reported by process 0)")
                if not self.armed:
                    del self._conns[k]
                    continue
                if self.process_id == 0:
                    for other, c in self._conns.items():
                        if other != k:
                            try:
                                c.sendall(f"lost {k}\n".encode())
                            except OSError:
                                pass
                    self.lost(f"process {k} (its connection closed: it exited or crashed)")
                else:
                    self.lost("process 0, the coordinator (its connection closed: it exited or crashed)")


_watchdog: Watchdog | None = None


def start_watchdog(num_processes: int, process_id: int, coordinator_host: str, timeout_s: float) -> Watchdog:
    """Start the lost-peer watchdog (see `Watchdog`) and disarm it at interpreter exit, before JAX's shutdown."""
    global _watchdog
    _watchdog = Watchdog(num_processes, process_id, coordinator_host, timeout_s)
    atexit.register(_watchdog.disarm)  # atexit runs last-in first-out: before jax's own distributed.shutdown
    return _watchdog


def fail(error: BaseException) -> None:
    """End a multi-process run that raised `error`: if it came from a lost peer, the watchdog names that peer within
    a moment; otherwise exit 1 here (skipping JAX's shutdown barrier, which would wait `peer_timeout` for peers that
    are not coming). Does nothing on a single process."""
    if _watchdog is None:
        return
    traceback.print_exception(error)
    time.sleep(2.0)  # let the watchdog, if a peer is gone, report it first
    print(f"jaxpar: process {_watchdog.process_id} failed ({type(error).__name__}); exiting with status 1",
          file=sys.stderr, flush=True)
    os._exit(1)
