"""Step time of a layout, predicted: FLOPs over the achievable rate, plus each mesh axis's bytes over its links.

    step = compute + Σ_axis exposed(bytes_axis / bandwidth_axis + collectives_axis · latency_axis)
    compute = executed matmul FLOPs per device · (1 + remat's recomputation) / achievable FLOP/s
              (a schedule table's useful FLOPs / (1 − its bubble); the circular loop executes its bubble iterations,
              so they are in its executed FLOPs already) + a fixed cost per layer application (kernel launches:
              what makes many small microbatches or accumulation chunks slower than few large ones) + the pipeline
              loop's own work per iteration (its selects, buffer updates and permute over a microbatch's [mb, s, h]:
              probed per byte, `Profile.pipeline_byte`) + the pages of the step's temporaries where the runtime
              allocates them afresh each step (XLA:CPU; probed per byte, `Profile.fresh_byte`; 0 on GPUs)
    achievable FLOP/s: each of a layer's matmuls (`layer_matmuls`) at the probed rate of its width, so tensor
              parallelism's narrower matmuls run slower where the machine's do

Bytes per device per step are `jaxpar.planner.expected`'s formulas — the ones `jaxpar analyze` checks against the
compiled program: tensor (Megatron's all-reduces, SP's gathers), pipe (the stages' permutes), context (K/V
gathers or the ring), expert (the all-to-alls) and data (the gradient all-reduce, 2(d−1)/d of the gradient shard;
ZeRO-1 the same volume as a reduce-scatter and an all-gather of the update; ZeRO-3 adds the parameters' gathers in
the forward and the backward, 2(d−1)/d more).

Links: the mesh is row-major with `tensor` innermost (jaxpar.mesh), so an axis stays inside a host when its degree
times the degrees of the axes inside it is at most the devices per host — it then runs at the host's link rate
(NVLink), else at the network's per device. A probed profile (`jaxpar probe`) has the host's rate per collective and
group size: the pipeline's and the ring's permutes, the experts' all-to-alls and everything else's all-reduces (or
their halves) each at what was measured for an axis of that degree.

Overlap, as the step runs today (what to change when the step changes):
    tensor    exposed: each all-reduce sits between the matmuls that need it; collective_matmul hides it behind the
              partial matmuls: the profile's `overlap` fraction of it, up to the compute time (which the ring's
              hiding shares: both hide behind the same matmuls)
    pipe      exposed: a permute per iteration, between two stage computations
    context   all_gather exposed; ring hidden behind each block's attention (as collective matmul's)
    expert    exposed: the dispatch all-to-all precedes the experts' matmuls, the combine follows them
    data      exposed: gradients are reduced once, after the backward, before the optimizer
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from jaxpar.config import Config, ConfigError
from jaxpar import flops
from jaxpar.parallel import pipeline, schedule
from jaxpar.parallel.axes import AXES, DATA, EXPERT, TENSOR
from jaxpar.parallel.plan import padded_vocab
from jaxpar.planner import expected
from jaxpar.planner.memory import Memory, param_bytes, predict_memory

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
DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes a profile rates (jaxpar.config.DTYPES)
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
    peak = {"bfloat16": sheet["bfloat16"] * 1e12, "float16": sheet["bfloat16"] * 1e12, "float32": sheet["tf32"] * 1e12}
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
        from jaxpar.planner.probe import check_machine  # (probe imports jax's device machinery; cost does not)

        check_machine(prof, path, field)
    return prof


@dataclasses.dataclass(frozen=True)
class Timing:
    """Predicted seconds of one train step and where they go; `comm` by mesh axis (exposed seconds)."""

    compute: float
    comm: dict[str, float]
    bubble: float
    tokens: int
    model_flops: float  # per device per step (the MFU numerator)

    @property
    def step(self) -> float:
        return self.compute + sum(self.comm.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step

    @property
    def comm_share(self) -> float:
        return sum(self.comm.values()) / self.step

    def mfu(self, peak: float | None) -> float | None:
        """Model FLOPs utilisation against `peak` FLOP/s (None without a peak)."""
        return self.model_flops / self.step / peak if peak else None

    def as_dict(self) -> dict:
        """Seconds by part, tokens/s and the communication share, for JSON."""
        return {"step_s": self.step, "compute_s": self.compute, "comm_s": self.comm, "bubble": self.bubble,
                "tokens_per_s": self.tokens_per_s, "comm_share": self.comm_share}


def inside_host(config: Config, devices_per_host: int) -> dict[str, bool]:
    """Per mesh axis: whether its groups stay inside one host (the axis and every axis inside it fit a host)."""
    out, span = {}, 1
    for axis in reversed(AXES):
        span *= getattr(config.parallel, axis)
        out[axis] = span <= devices_per_host or getattr(config.parallel, axis) == 1
    return out


def pipeline_ticks(config: Config, d: dict) -> float:
    """A step's pipeline iterations (circular: forward and backward each run them) or schedule-table ticks (one F, B
    or W each), accumulation chunks included; `d` = `expected._dims(config, …)`."""
    p = config.parallel
    if p.schedule == "circular":
        return d["iterations"]
    return schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches).n_ticks * d["A"]


def axis_collectives(config: Config) -> dict[str, float]:
    """How many collectives each mesh axis runs per step (each pays the link's latency, however small): Megatron's
    4 per layer application (6 with SP's gathers and scatters), a permute per pipeline iteration or tick each way,
    2 per layer for context parallelism's K/V (2(c−1) ring steps), 4 all-to-alls per MoE layer, and one bucketed
    gradient reduction over data."""
    p = config.parallel
    d = expected._dims(config, padded_vocab(config.model, p.tensor))
    out = {a: 0.0 for a in AXES}
    if p.tensor > 1:
        out[TENSOR] = d["layer_execs"] * (6 if p.sequence_parallel else 4)
    if p.pipe > 1:
        out["pipe"] = 2 * pipeline_ticks(config, d)
    if p.context > 1:
        out["context"] = d["layer_execs"] * (2 * (p.context - 1) if p.context_impl == "ring" else 2)
    if p.expert > 1:
        out[EXPERT] = 4 * d["moe_layer_execs"]
    if p.data > 1:  # ZeRO: reduce-scatter the gradients, all-gather the update (and stage 3 the weights per layer)
        out[DATA] = (2.0 if p.zero else 1.0) + (2 * d["layer_execs"] if p.zero >= 3 else 0)
    return out


def axis_bytes(config: Config) -> dict[str, float]:
    """Bytes each device sends per step on each mesh axis (see the module docstring)."""
    p = config.parallel
    V = padded_vocab(config.model, p.tensor)
    out = {a: 0.0 for a in AXES}
    out[TENSOR] = expected.tensor_bytes(config, V)["total"]
    if p.pipe > 1:
        if p.schedule == "circular":
            out["pipe"] = expected.pipeline_bytes(config)["permute_bytes"]
        else:
            table = schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches)
            sends = pipeline.Pipeline(p.pipe, p.repeats, p.microbatches, config.model.n_layers,
                                      p.schedule).program.sends()
            out["pipe"] = expected.schedule_permute_bytes(config, table.n_ticks,
                                                          (sends["down"] > 0) + (sends["up"] > 0))
    out["context"] = expected.context_bytes(config)
    if config.moe.enabled:
        out[EXPERT] = expected.expert_bytes(config)["total"]
    d = p.data
    if d > 1:  # the gradients as the step holds them before reducing: not split over data
        out[DATA] = 2 * (d - 1) / d * param_bytes(config) * (2 if p.zero >= 3 else 1)
    return out


def _kind(config: Config, axis: str) -> str:
    """The collective that carries `axis`'s bytes (whose probed bandwidth applies): the pipeline's and the ring's
    permutes, the experts' all-to-alls, and all-reduces (or their halves, gathers and scatters) elsewhere."""
    if axis == "pipe" or (axis == "context" and config.parallel.context_impl == "ring"):
        return "permute"
    return "all_to_all" if axis == EXPERT else "all_reduce"


def layer_matmuls(config: Config) -> list[tuple[float, float]]:
    """One layer's matmuls as a tensor rank runs them: (FLOPs per token, square-equivalent width √(K·N)) each — the
    projections q [h → a/t·E], k and v [h → K/t·E], o [a/t·E → h], the MLP's [h → F/t] (two under SwiGLU) and
    [F/t → h] (an MoE layer's top_k experts' instead, and its shared expert's), and the attention core's per-head
    [s, E] @ [E, s] and [s, s] @ [s, E]. The backward's matmuls have the same K·N."""
    m, t, s = config.model, config.parallel.tensor, config.train.seq_len
    h, E, a, kv = m.d_model, m.head_dim, max(m.n_heads // t, 1), max(m.n_kv_heads // t, 1)
    out = [(2 * h * a * E, math.sqrt(h * a * E))] * 2 + [(2 * h * kv * E, math.sqrt(h * kv * E))] * 2
    out += [(2 * E * s * a, math.sqrt(E * s))] * 2
    glu = 3 if m.family != "gpt2" else 2

    def mlp(width: int, copies: float):
        f = max(width // t, 1)
        return [(copies * 2 * h * f, math.sqrt(h * f))] * glu

    if m.moe.enabled:
        out += mlp(m.moe.d_ff, m.moe.top_k) + (mlp(m.moe.shared_d_ff, 1) if m.moe.shared_d_ff else [])
    else:
        out += mlp(m.d_ff, 1)
    return out


def matmul_rate(config: Config, profile: Profile) -> float:
    """The achievable FLOP/s of a layer's matmuls on `profile` (`layer_matmuls`): each at the probed rate of its
    square-equivalent width, combined as their FLOPs take time (Σ flops / Σ flops/rate). Tensor parallelism narrows
    the projections and the MLP, and narrow matmuls run below the large ones' rate."""
    mats = layer_matmuls(config)
    dtype = config.model.dtype
    return sum(f for f, _ in mats) / sum(f / profile.rate(dtype, round(w)) for f, w in mats)


def predict_time(config: Config, profile: Profile, devices_per_host: int, memory: Memory | None = None) -> Timing:
    """The step time of `config` (resolved for its devices) on `profile`'s machines; `memory`: its predicted memory
    (`predict_memory`; computed here when the profile charges fresh memory and none is given)."""
    m, p, t = config.model, config.parallel, config.train
    V = padded_vocab(m, p.tensor)
    f = expected.step_flops(config, V)
    recompute = (flops.hardware_flops_per_token(m, t.seq_len, remat=p.remat, full_attention=True)
                 / flops.hardware_flops_per_token(m, t.seq_len, remat="none", full_attention=True))
    rate = matmul_rate(config, profile)
    if p.pipe > 1 and p.schedule != "circular":
        bubble = schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches).bubble
        compute = f["useful"] * recompute / rate / (1 - bubble)
    else:
        bubble = pipeline.bubble_fraction(p.pipe, p.repeats, p.microbatches) if p.pipe > 1 else 0.0
        compute = f["executed"] * recompute / rate
    # Fixed costs per layer application: more microbatches, accumulation chunks or bubble iterations pay them.
    d = expected._dims(config, V)
    compute += d["layer_execs"] * profile.layer_overhead
    if p.pipe > 1:  # the pipeline loop's own work per iteration, in proportion to a microbatch's [mb, s, h]
        iterations = pipeline_ticks(config, d) / (1 if p.schedule == "circular" else 2)  # a tick: half of one
        compute += iterations * d["mb"] * d["s"] * m.d_model * d["beta"] * profile.pipeline_byte
    if profile.fresh_byte:  # a runtime that allocates the step's temporaries afresh (XLA:CPU) pays for their pages
        memory = memory or predict_memory(config, "cpu")
        compute += (memory.gradients + memory.activations + memory.workspace) * profile.fresh_byte
    inside = inside_host(config, devices_per_host)
    comm, count, hide = {}, axis_collectives(config), compute
    for axis, sent in axis_bytes(config).items():
        bandwidth = profile.bandwidth(_kind(config, axis), getattr(p, axis), inside[axis])
        seconds = sent / bandwidth + count[axis] * (profile.latency if inside[axis] else profile.latency_inter)
        if (axis == TENSOR and p.overlap == "collective_matmul") or (axis == "context" and p.context_impl == "ring"):
            # Both hide behind the same matmuls: they share one budget of hideable compute.
            hidden = min(seconds * profile.overlap, hide)
            seconds, hide = seconds - hidden, hide - hidden
        comm[axis] = seconds
    tokens = t.batch_size * t.seq_len
    return Timing(compute, comm, bubble, tokens, f["model_flops_per_device"])

