"""A machine as the planner sees it: the `Profile` the time model reads, its checks, the datasheet defaults per
device kind, and the profile file — written by `jaxpar probe`, read by `jaxpar plan` and `parallel.auto`, refused
when it was measured on other hardware.

Kept apart from `cost` (the time model that reads a profile) and `probe` (the measurements that fill one), which
both need it: neither imports the other.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import stat

from jaxpar.errors import ConfigError, OutputError
from jaxpar import flops

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the time model knows of a machine: achievable dense matmul FLOP/s per compute dtype, per-device link
    bandwidth inside a host and across hosts (bytes/s, one direction), and the memory of one device."""

    name: str
    flops: dict[str, float]
    intra_host: float
    inter_host: float
    memory_gb: float
    source: str = "datasheet"
    peak: dict[str, float] = dataclasses.field(default_factory=dict)
    latency: float = 10e-6  # seconds a collective costs however small (launch, synchronisation), inside a host
    latency_inter: float = 20e-6  # and across hosts
    layer_overhead: float = 30e-6  # fixed seconds per layer application (kernel launches, loop bookkeeping)
    # seconds per byte of a microbatch's activations [mb, s, h] per pipeline iteration (forward and backward): the
    # loop's own selects, buffer updates and permute (probed; the datasheet profiles count them in the permute)
    pipeline_byte: float = 0.0
    # seconds per byte of the step's temporaries (gradients, activations, workspace) when the runtime allocates them
    # afresh each step (XLA:CPU: the OS faults the pages in; probed) — 0 where an allocator keeps a pool (GPUs)
    fresh_byte: float = 0.0
    # Probed (`jaxpar probe`): {collective: {group size: bus bytes/s per device}} inside a host, the machine it was
    # measured on, and how many devices shared it then (a CPU's simulated devices share its cores).
    overlap: float = 1.0  # the fraction of a hideable collective that hides behind compute (1: own engines)
    matmul: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # probed {dtype: {width: FLOP/s}}
    links: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    machine: dict = dataclasses.field(default_factory=dict)
    devices: int = 0

    def __post_init__(self):
        check_profile(self)

    @property
    def shared_cores(self) -> bool:
        """The devices share one pool of cores (probed on simulated CPU devices): compute one device skips goes to
        the others, so skipped work costs no time (`parallel.skip_bubble`)."""
        return self.machine.get("platform") == "cpu" and self.devices > 1

    def rate(self, dtype: str, width: int | None = None) -> float:
        """Achievable matmul FLOP/s for compute `dtype` (float32's where the dtype has no entry); with `width` and a
        probed table, that of a token-major matmul [M, w] @ [w, w] of that width — narrow matmuls run below the
        large ones' rate — interpolated log-linearly between the widths measured (clamped to the ends)."""
        table = self.matmul.get(dtype) or self.matmul.get("float32")
        if not width or not table:
            return self.flops.get(dtype) or self.flops["float32"]
        points = sorted((int(w), r) for w, r in table.items())
        if width <= points[0][0]:
            return points[0][1]
        for (w0, r0), (w1, r1) in zip(points, points[1:]):
            if width <= w1:
                a = math.log(width / w0) / math.log(w1 / w0)
                return math.exp((1 - a) * math.log(r0) + a * math.log(r1))
        return points[-1][1]

    def bandwidth(self, kind: str, group: int, inside: bool) -> float:
        """Bytes/s per device of collective `kind` ('all_reduce', 'all_to_all', 'permute') over `group` devices:
        the network's across hosts; inside a host the probed rate of the nearest group size measured (the largest
        not above `group`), else the host's link rate."""
        if not inside:
            return self.inter_host
        measured = {int(g): bw for g, bw in self.links.get(kind, {}).items()}
        fits = [g for g in measured if g <= group] or sorted(measured)[:1]
        return measured[max(fits)] if fits else self.intra_host

    def flops_peak(self, dtype: str) -> float | None:
        """The datasheet peak the MFU column divides by (None for a probed CPU: no datasheet)."""
        return self.peak.get(dtype) or self.peak.get("float32") if self.peak else None


# What each field of a profile may hold (`check_profile`): seconds, rates and fractions are finite numbers, rates
# and sizes above 0, fixed costs at least 0, the overlap a fraction.
# the compute dtypes a profile rates (jaxpar.config.DTYPES), and float8: FP8 matmuls (model.matmul, jaxpar.fp8)
DTYPES = ("float32", "bfloat16", "float16", "float8")
LINK_KINDS = ("all_reduce", "all_to_all", "permute")  # the collectives a profile rates (jaxpar.planner.probe.KINDS)
_POSITIVE = ("intra_host", "inter_host", "memory_gb")
_NON_NEGATIVE = ("latency", "latency_inter", "layer_overhead", "pipeline_byte", "fresh_byte")


def _number(name: str, value, low: float, *, above: bool, high: float | None = None) -> float:
    """`value` as a finite real number at least (`above`: above) `low` (and at most `high`), else a ConfigError
    naming profile field `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"field {name}", value, f"must be a number, got {type(value).__name__}",
                          "write a number (what `jaxpar probe` measures)")
    ok = math.isfinite(value) and (value > low if above else value >= low) and (high is None or value <= high)
    if not ok:
        rule = (f"must lie in [{low:g}, {high:g}]" if high is not None else
                f"must be a finite number {'>' if above else '>='} {low:g}")
        raise ConfigError(f"field {name}", value, rule, "fix the value, or measure this machine again with "
                          "`jaxpar probe --out FILE`")
    return value


def _rates(name: str, table, keys: tuple[str, ...] | None, *, int_keys: bool = False) -> None:
    """A table {key: positive finite number} (keys among `keys`; `int_keys`: integer-like strings >= 1)."""
    if not isinstance(table, dict):
        raise ConfigError(f"field {name}", table, f"must be a mapping, got {type(table).__name__}",
                          "write {key: number, ...}")
    for key, value in table.items():
        if keys is not None and key not in keys:
            raise ConfigError(f"field {name}", key, f"names an unknown key (known: {', '.join(keys)})",
                              "use one of those")
        if int_keys:
            if isinstance(key, bool) or not isinstance(key, (int, str)) or not str(key).isdigit() or int(key) < 1:
                raise ConfigError(f"field {name}", key, "must be keyed by whole numbers >= 1 (widths or group "
                                  "sizes)", "key each entry by its width or group size, e.g. \"8\"")
        _number(f"{name}[{key!r}]", value, 0.0, above=True)


def check_profile(profile: "Profile") -> None:
    """Every field of `profile` holds what the time model can use, else a ConfigError naming the field ("field
    intra_host = -1.0: must be a finite number > 0") — checked wherever a profile is made (loaded, probed,
    replaced), never by `assert`."""
    for name in ("name", "source"):
        if not isinstance(getattr(profile, name), str):
            raise ConfigError(f"field {name}", getattr(profile, name), "must be a string", "write a name")
    for name in _POSITIVE:
        _number(name, getattr(profile, name), 0.0, above=True)
    for name in _NON_NEGATIVE:
        _number(name, getattr(profile, name), 0.0, above=False)
    _number("overlap", profile.overlap, 0.0, above=False, high=1.0)
    _rates("flops", profile.flops, DTYPES)
    if "float32" not in profile.flops:
        raise ConfigError("field flops", profile.flops, "needs a float32 rate (the fallback of every dtype)",
                          "add \"float32\": FLOP/s")
    _rates("peak", profile.peak, DTYPES)
    for kind, sub in _table("matmul", profile.matmul, DTYPES).items():
        _rates(f"matmul[{kind!r}]", sub, None, int_keys=True)
    for kind, sub in _table("links", profile.links, LINK_KINDS).items():
        _rates(f"links[{kind!r}]", sub, None, int_keys=True)
    if not isinstance(profile.machine, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, (str, int, float))) for k, v in profile.machine.items()):
        raise ConfigError("field machine", profile.machine, "must be a mapping of names to plain values",
                          "write it as `jaxpar probe` does, or drop it (a hand-written profile claims no machine)")
    if isinstance(profile.devices, bool) or not isinstance(profile.devices, int) or profile.devices < 0:
        raise ConfigError("field devices", profile.devices, "must be a whole number >= 0",
                          "write the devices it was measured on (0: not measured)")


def _table(name: str, table, keys: tuple[str, ...]) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"field {name}", table, f"must be a mapping, got {type(table).__name__}",
                          "write {key: {size: number}}")
    for key in table:
        if key not in keys:
            raise ConfigError(f"field {name}", key, f"names an unknown key (known: {', '.join(keys)})",
                              "use one of those")
    return table


# Defaults per device kind: the datasheet's dense peak times an achievable fraction (large transformer matmuls reach
# about 60 % of peak in bf16 on Hopper; fp32 runs on TF32 tensor cores), NVLink per GPU one way at ~80 % of its
# rate as bus bandwidth, and a 400 Gb/s NIC per GPU across hosts. `jaxpar probe` measures the machine it runs on.
ACHIEVABLE = 0.6


def _gpu(row: str, nvlink: float, memory_gb: float) -> Profile:
    sheet = flops.PEAK_TFLOPS[row]
    peak = {"bfloat16": sheet["bfloat16"] * 1e12, "float16": sheet["bfloat16"] * 1e12, "float32": sheet["tf32"] * 1e12,
            **({"float8": sheet["float8"] * 1e12} if "float8" in sheet else {})}
    return Profile(row, {k: ACHIEVABLE * v for k, v in peak.items()}, 0.8 * nvlink, 0.8 * 50 * GB, memory_gb,
                   f"datasheet x {ACHIEVABLE} achievable", peak)


PROFILES: dict[str, Profile] = {
    "h200": _gpu("H200 SXM", 450 * GB, 141),
    "h100": _gpu("H100 SXM", 450 * GB, 80),
    "a100": _gpu("A100", 300 * GB, 80),
}


def profile_for(kind: str) -> Profile:
    """The default profile of a device kind (`h200`, `h100`, `a100`), or a clear error naming the ones known."""
    key = kind.lower().replace("nvidia", "").strip()
    for name, prof in PROFILES.items():
        if name in key:
            return prof
    raise ConfigError("--device-kind", kind, f"has no default profile (known: {', '.join(PROFILES)})",
                      "pick one of those, or measure this machine with `jaxpar probe --out FILE` and pass "
                      "--profile FILE")


def load_profile(path: str, *, field: str = "--profile", this_machine: bool = True) -> Profile:
    """A profile written by `jaxpar probe`; refused (a ConfigError naming `field`) when unreadable or incomplete, and
    (`this_machine`) when it was measured on other hardware than this process runs on."""
    p = pathlib.Path(path)
    again = "run `jaxpar probe --out FILE` on the machine to plan for"
    try:
        if not p.is_file():
            raise ConfigError(field, path, "does not exist" if not p.exists() else "is not a file", again)
        d = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(field, path, f"cannot be read ({e.strerror or e})", again) from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser
        raise ConfigError(field, path, f"is not a profile written by `jaxpar probe` (not JSON: {e})", again) from None
    if not isinstance(d, dict):
        raise ConfigError(field, path, f"is not a profile written by `jaxpar probe` (it holds a {type(d).__name__}, "
                          "not a mapping of fields)", again)
    known = {f.name: f for f in dataclasses.fields(Profile)}
    unknown = [k for k in d if k not in known]
    missing = [k for k, f in known.items() if k not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        name = (unknown or missing)[0]
        raise ConfigError(f"{field} {path}: field {name}", "unknown" if unknown else "missing",
                          f"{'is not a profile field' if unknown else 'is required'} (fields: {', '.join(known)})",
                          again)
    try:
        prof = Profile(**d)
    except ConfigError as e:  # `check_profile`: name the file and the field
        raise ConfigError(f"{field} {path}: {e.field}", e.value, e.rule, e.fix) from None
    if this_machine:
        check_machine(prof, path, field)
    return prof


def machine() -> dict:
    """What identifies this machine's hardware: accelerator kind, CPU model, cores and host memory (GB, rounded).
    Not the hostname: the nodes of a cluster are the same machine for the planner."""
    import jax  # (the only device call here: the rest of the planner plans meshes it does not have)

    dev = jax.local_devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": dev.platform, "device_kind": dev.device_kind, "cpu": cpu, "cores": os.cpu_count(),
            "host_memory_gb": round(host_memory_bytes() / GB)}


def host_memory_bytes() -> int:
    """The host's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_out(path: str | pathlib.Path, flag: str = "--out") -> None:
    """Refuse (OutputError) a place a profile cannot go: a path that exists and is not a regular file (a directory,
    a device node, a pipe, a socket) or is a symbolic link (writing would replace the link, not what it names), or
    whose directory does not exist. Checked before measuring, and again when writing."""
    path = pathlib.Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot be inspected ({e.strerror or e}); name a file in an existing "
                          "directory") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        what = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is a directory" if stat.S_ISDIR(st.st_mode)
                else "exists and is not a regular file (a device, pipe or socket)")
        raise OutputError(f"{flag} {path}: {what}; name a new file, or a profile file to replace (nothing was "
                          "written)")
    if not path.parent.is_dir():
        raise OutputError(f"{flag} {path}: its directory does not exist; name a file in an existing directory")


def write(profile: Profile, path: str | pathlib.Path) -> None:
    """Write `profile` as JSON (`load_profile` reads it), atomically: into a new temporary file beside `path`
    (created exclusively, never through a link), then renamed over it, so a crash leaves no half-written file and
    only a regular file is ever replaced (`check_out`)."""
    path = pathlib.Path(path)
    check_out(path)
    text = json.dumps(dataclasses.asdict(profile), indent=2, sort_keys=True, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@functools.cache
def _here() -> tuple:
    return tuple(sorted(machine().items()))


def check_machine(profile: Profile, path: str, field: str = "--profile") -> None:
    """Refuse a probed profile measured on other hardware than this process's (its rates describe that machine)."""
    if not profile.machine:
        return  # a hand-written or datasheet profile: it claims no machine
    here = dict(_here())
    diff = [k for k in profile.machine if profile.machine.get(k) != here.get(k)]
    if diff:
        k = diff[0]
        raise ConfigError(field, path, f"was measured on another machine ({k} {profile.machine.get(k)!r}; "
                          f"this one has {here.get(k)!r}), so its rates do not describe this one",
                          "run `jaxpar probe --out FILE` here (or plan for a device kind with --device-kind)")
