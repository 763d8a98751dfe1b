"""The search: every valid layout of a model on a device count, the ones that fit, ranked by predicted tokens/s.

A layout is a `ParallelConfig` (data, pipe, expert, context, tensor; schedule, repeats, microbatches; sequence
parallelism, collective matmul, context impl; ZeRO; remat) and `train.grad_accum`. Valid means the config's own
checks accept it (every candidate is built through `Config`, so the planner can never propose what `jaxpar train`
refuses) and `tensor` stays inside a host. Each valid layout gets `memory.predict_memory` and `cost.predict_time`;
those over the memory budget are dropped, the rest ranked fastest first (less memory breaks ties; and the layouts within
`TIE`, a thousandth, of the fastest step time count as tied with it, leanest first).

Fields named in `fixed` keep the config's value; the rest are searched.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Iterator

from jaxpar.config import PLANNED, REMAT_POLICIES, Config, ConfigError, resolve_attention
from jaxpar.errors import PlanError, UsageError, divisors
from jaxpar.parallel.schedule import SCHEDULES
from jaxpar.planner.cost import Timing, predict_time
from jaxpar.planner.profile import Profile
from jaxpar.planner.memory import Memory, predict_memory, state_bytes, state_floor

TIE = 1e-3  # step times within this fraction of the fastest's rank as tied with it (the leanest first)


@dataclasses.dataclass(frozen=True)
class Candidate:
    config: Config
    memory: Memory
    timing: Timing

    def label(self) -> str:
        """The layout in one line (`describe`)."""
        return describe(self.config)


def describe(config: Config) -> str:
    """A layout in one short line: the degrees above 1, then what else differs from the defaults."""
    p, t = config.parallel, config.train
    parts = [f"{a}{getattr(p, a)}" for a in ("data", "pipe", "expert", "context", "tensor") if getattr(p, a) > 1]
    parts = ["x".join(parts) or "1 device"]
    if p.pipe > 1:
        parts.append(f"{p.schedule} v{p.repeats} m{p.microbatches}" + (" skip" if p.skip_bubble else ""))
    if p.sequence_parallel:
        parts.append("sp" + ("+cm" if p.overlap == "collective_matmul" else ""))
    if p.context > 1:
        parts.append(p.context_impl)
    if p.zero:
        parts.append(f"zero{p.zero}")
    if p.remat != "none":
        parts.append(f"remat={p.remat}")
    if t.grad_accum > 1:
        parts.append(f"accum{t.grad_accum}")
    return " ".join(parts)


def _degrees(config: Config, devices: int, devices_per_host: int, fixed: set[str]) -> Iterator[dict[str, int]]:
    m, p = config.model, config.parallel
    choices = {
        "pipe": divisors(m.pipelined_layers),  # a dense prefix runs beside the embedding
        "expert": divisors(m.moe.n_experts) if m.moe.enabled else [1],
        "context": [c for c in (1, 2, 4, 8, 16, 32, 64) if c == 1 or not m.moe.enabled],
        "tensor": [t for t in divisors(m.n_heads) if t <= devices_per_host],
    }
    for axis in choices:
        if axis in fixed:
            choices[axis] = [getattr(p, axis)]
    for pipe, expert, context, tensor in itertools.product(*choices.values()):
        inner = pipe * expert * context * tensor
        if devices % inner == 0 and ("data" not in fixed or p.data in (-1, devices // inner)):
            yield {"data": devices // inner, "pipe": pipe, "expert": expert, "context": context, "tensor": tensor}


def layouts(config: Config, devices: int, devices_per_host: int, fixed: Iterable[str] = ()) -> Iterator[Config]:
    """Every valid layout of `config` on `devices` (resolved: data filled in), fixed fields kept."""
    fixed = set(fixed)
    base, train = config.parallel, config.train
    keep = lambda name, values: [getattr(base, name)] if name in fixed else values  # noqa: E731
    for deg in _degrees(config, devices, devices_per_host, fixed):
        if train.batch_size % (deg["data"] * deg["expert"]):
            continue
        rows = train.batch_size // (deg["data"] * deg["expert"])
        accums = [train.grad_accum] if "grad_accum" in fixed else [a for a in (1, 2, 4, 8) if rows % a == 0]
        pipes = [("circular", 1, 1, False)]
        if deg["pipe"] > 1:
            L = config.model.pipelined_layers
            pipes = [(s, v, mb, skip) for s in keep("schedule", list(SCHEDULES))
                     for v in keep("repeats", divisors(L // deg["pipe"]))
                     for mb in keep("microbatches", [deg["pipe"] * k for k in (1, 2, 4, 8)])
                     for skip in keep("skip_bubble", [False, True] if s == "circular" else [False])]
        sps = keep("sequence_parallel", [False, True] if deg["tensor"] > 1 else [False])
        zeros = keep("zero", [0, 1, 3] if deg["data"] > 1 else [0])
        impls = keep("context_impl", ["all_gather", "ring"] if deg["context"] > 1 else ["all_gather"])
        for (sched, v, mb, skip), sp, zero, impl, remat, accum in itertools.product(
                pipes, sps, zeros, impls, keep("remat", list(REMAT_POLICIES)), accums):
            for overlap in keep("overlap", ["none", "collective_matmul"] if sp else ["none"]):
                try:
                    par = dataclasses.replace(base, **deg, schedule=sched, repeats=v, microbatches=mb,
                                              sequence_parallel=sp, overlap=overlap, zero=zero, context_impl=impl,
                                              remat=remat, skip_bubble=skip)
                    yield dataclasses.replace(config, parallel=par, train=dataclasses.replace(
                        train, grad_accum=accum)).resolve_for_devices(devices)
                except ConfigError:
                    continue


def rank(config: Config, devices: int, profile: Profile, *, devices_per_host: int | None = None,
         memory_gb: float | None = None, fixed: Iterable[str] = (),
         leanest: bool = True) -> tuple[list[Candidate], list[Candidate], int]:
    """(those that fit, fastest first; those predicted not to, smallest first; how many valid layouts there are) for
    `config` on `devices`.

    A layout whose state alone (parameters, optimizer state, gradients, batch: exact, and shared by every remat
    policy) exceeds the budget is dropped before its activations and time are predicted — at scale most are (llama_8b
    on 64 devices: ~6 in 7). Only when nothing fits (and `leanest`) are they all predicted, to name the leanest
    (`smallest_fit`)."""
    per_host = devices_per_host or devices
    budget = (memory_gb if memory_gb is not None else profile.memory_gb) * 1e9
    device = _Device(profile)
    config = dataclasses.replace(config, model=resolve_attention(config.model, device))
    fit, over, state = [], [], {}
    for prune in (True, False):
        valid, over = 0, []
        for layout in layouts(config, devices, per_host, fixed):
            valid += 1
            if prune:
                key = (layout.mesh_shape, layout.parallel.zero, layout.train.grad_accum > 1)
                if key not in state:
                    state[key] = sum(state_bytes(layout).values())
                if state[key] > budget:
                    continue
            mem = predict_memory(layout, device.platform)
            cand = Candidate(layout, mem, predict_time(layout, profile, per_host, mem))
            (fit if mem.total <= budget else over).append(cand)
        if fit or not leanest:
            break
    fit.sort(key=lambda c: (c.timing.step, c.memory.total))
    if fit:
        # Step times within TIE of the fastest's count as equal (the time model cannot tell them apart: ZeRO-1's
        # sharded update against the whole one is ~1e-6 of llama_8b's step): of those, the leanest goes first.
        tied = sum(c.timing.step <= fit[0].timing.step * (1 + TIE) for c in fit)
        fit[:tied] = sorted(fit[:tied], key=lambda c: c.memory.total)
    over.sort(key=lambda c: c.memory.total)
    return fit, over, valid


@dataclasses.dataclass(frozen=True)
class _Device:
    """What `resolve_attention` reads of a device, for the kind being planned for."""

    profile: Profile

    @property
    def platform(self) -> str:
        return "cpu" if self.profile.name.lower().startswith("cpu") else "gpu"

    @property
    def device_kind(self) -> str:
        return "cpu" if self.platform == "cpu" else f"NVIDIA {self.profile.name}"


def why(winner: Candidate, other: Candidate) -> str:
    """One sentence on why `winner` beats `other`: the part of the step time that differs most."""
    a, b = winner.timing, other.timing
    if abs(b.step / a.step - 1) < TIE:
        return (f"{winner.label()} ties {other.label()} (predicted step times within {TIE * 100:g} %) and needs "
                f"{(other.memory.total - winner.memory.total) / 1e9:.3g} GB less per device")
    parts = {"compute": b.compute - a.compute, "bubble": (b.bubble - a.bubble) * b.step}
    for axis in set(a.comm) | set(b.comm):
        parts[f"{axis} communication"] = b.comm.get(axis, 0.0) - a.comm.get(axis, 0.0)
    name, gain = max(parts.items(), key=lambda kv: kv[1])
    return (f"{winner.label()} beats {other.label()} by {(b.step / a.step - 1) * 100:.1f} % of predicted step time; "
            f"the largest difference is {name} ({gain * 1e3:.3g} ms less per step)")


def smallest_fit(config: Config, profile: Profile, devices: int, devices_per_host: int, memory_gb: float,
                 over: list[Candidate], fixed: Iterable[str] = ()) -> str:
    """When nothing fits: the memory per device the leanest layout needs (`over`: `rank`'s layouts over the budget,
    smallest first), and the smallest power-of-two device count (up to 4096) on which some layout fits it."""
    need = over[0].memory.total / 1e9
    head = f"the leanest layout on {devices} devices ({over[0].label()}) needs {need:.3g} GB per device"
    return head + _more_devices(config, profile, devices, devices_per_host, memory_gb, fixed)


def _more_devices(config: Config, profile: Profile, devices: int, devices_per_host: int, memory_gb: float,
                  fixed: Iterable[str]) -> str:
    """The end of a no-fit message: the smallest power-of-two multiple of `devices` (up to 4096) on which a layout
    fits the budget ("; N devices fit it in M GB (layout)"), or that none does. A count whose state floor (`memory.state_floor`) alone exceeds the budget is skipped without
    building a layout, and each count's search stops at the layouts whose state fits (no leanest to name)."""
    n = devices
    while n < 4096:
        n *= 2
        if state_floor(config, n) > memory_gb * 1e9:
            continue
        fit, _, _ = rank(config, n, profile, devices_per_host=min(devices_per_host, n), memory_gb=memory_gb,
                         fixed=fixed, leanest=False)
        if fit:
            return f"; {n} devices fit it in {memory_gb:g} GB ({fit[0].label()})"
    return f"; no device count up to 4096 fits it in {memory_gb:g} GB"


def _setting(config: Config, name: str):
    """A planned field's value: `grad_accum` from the train section, the rest from the parallel one."""
    return config.train.grad_accum if name == "grad_accum" else getattr(config.parallel, name)


def blocked(config: Config, devices: int, hosts: int = 1, fixed: Iterable[str] = (),
            release: str = "drop those --config.parallel overrides (a field set on the command line is kept as "
                               "set), or set them to the values named") -> str:
    """Why no layout of `config` is valid on `devices` over `hosts` with the `fixed` fields kept, and what to do: the
    fewest kept fields whose values no layout on these devices takes (with values one does take), or, when no
    layout exists even with every field free, the device counts nearby that have one. `release`: how a user frees
    a kept field (it depends on where the kept fields came from)."""
    fixed, per_host = set(fixed), devices // hosts
    best = None
    for layout in layouts(config, devices, per_host, ()):
        change = {f: _setting(layout, f) for f in sorted(fixed)
                  if _setting(layout, f) != _setting(config, f) and not (f == "data" and config.parallel.data == -1)}
        if best is None or len(change) < len(best):
            best = change
            if len(best) <= 1:
                break
    word = "device" if devices == 1 else "devices"
    if best == {}:  # a free layout takes every kept value, yet none keeps them all (a combination the checks refuse)
        return (f"no valid layout of this model on {devices} {word} keeps all of {', '.join(map(_path, sorted(fixed)))}"
                f" at once (the config's checks refuse every combination with them). Fix: {release}")
    if best:
        kept = ", ".join(f"{_path(f)} = {_setting(config, f)!r}" for f in best)
        works = " ".join(f"{_path(f)}={v}" for f, v in best.items())
        return (f"no valid layout of this model on {devices} {word} keeps {kept} (the config's checks refuse every "
                f"combination with them); one runs with {works}. Fix: {release}")
    counts = [n for n in (*range(devices - 1, 0, -1), *range(devices + 1, 2 * devices + 1)) if n % hosts == 0]
    below = next((n for n in counts if n < devices and any(True for _ in layouts(config, n, n // hosts, ()))), None)
    above = next((n for n in counts if n > devices and any(True for _ in layouts(config, n, n // hosts, ()))), None)
    m, t = config.model, config.train
    why = (f"data*pipe*expert*context*tensor must multiply to {devices}, with data*expert dividing train.batch_size "
           f"= {t.batch_size}, pipe dividing model.n_layers = {m.n_layers}, tensor dividing model.n_heads = "
           f"{m.n_heads} within a host of {per_host}")
    near = " or ".join(str(n) for n in (below, above) if n is not None)
    return (f"no layout of this model runs on {devices} {word}, whatever the fields ({why}). Fix: "
            + (f"plan for {near} devices" if near else "change the model's sizes or train.batch_size")
            + (f" (then: {release})" if fixed else ""))


def _path(name: str) -> str:
    return "train.grad_accum" if name == "grad_accum" else f"parallel.{name}"


def plan(config: Config, devices: int, profile: Profile, *, hosts: int = 1, memory_gb: float | None = None,
         fixed: Iterable[str] = (), release: str | None = None) -> dict:
    """The planner's answer for `config` on `devices` split over `hosts` hosts: every layout that fits the memory
    budget per device (default: the profile's device memory), fastest first, the winner and why. A model that fits
    no layout raises `PlanError` naming the memory or device count that would fit; one with no valid layout at all
    names the kept fields that block it (`blocked`; `release`: how to free them, in the error's fix).

    Before anything is predicted: a budget below what the parameters and Adam moments alone need per device
    (`memory.state_floor`) is refused at once, with the device count whose floor fits it."""
    if (isinstance(devices, bool) or not isinstance(devices, int) or isinstance(hosts, bool)
            or not isinstance(hosts, int) or devices < 1 or hosts < 1 or devices % hosts):
        raise UsageError(f"--devices {devices} --hosts {hosts}: the devices must split evenly over the hosts "
                         "(both positive whole numbers)")
    budget = profile.memory_gb if memory_gb is None else memory_gb
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise UsageError(f"--memory-gb {budget}: a memory budget per device must be a positive finite number"
                         if memory_gb is not None else
                         f"profile {profile.name}: memory_gb = {budget}: the device memory must be positive")
    per_host = devices // hosts
    if next(iter(layouts(config, devices, per_host, fixed)), None) is None:
        raise PlanError(blocked(config, devices, hosts, fixed, *([release] if release else [])))
    floor = state_floor(config, devices)
    if floor > budget * 1e9:
        word = "device" if devices == 1 else "devices"
        raise PlanError(f"no layout fits {budget:g} GB per device on {devices} {word}: the model's state alone needs "
                        f"at least {floor / 1e9:.3g} GB per device there (its parameters and Adam moments, "
                        f"{floor * devices / 1e9:.3g} GB" + (f", spread over all {devices})" if devices > 1 else ")")
                        + _more_devices(config, profile, devices, per_host, budget, fixed)
                        + " (raise --memory-gb or --devices)")
    fit, over, valid = rank(config, devices, profile, devices_per_host=per_host, memory_gb=budget, fixed=fixed)
    if not fit:
        raise PlanError(f"no layout fits {budget:g} GB per device on {devices} devices: "
                        + smallest_fit(config, profile, devices, per_host, budget, over, fixed)
                        + " (raise --memory-gb or --devices)")
    peak = profile.flops_peak(config.model.dtype)
    rows = [_row(c, peak) for c in fit]
    out = {"devices": devices, "hosts": hosts, "memory_gb": budget, "profile": profile.name,
           "profile_source": profile.source, "layouts": valid, "fit": len(fit), "ranked": rows,
           "winner": rows[0]}
    if len(fit) > 1:
        runner = next((c for c in fit[1:] if _structure(c.config) != _structure(fit[0].config)), fit[1])
        out["runner_up"] = _row(runner, peak)
        out["why"] = why(fit[0], runner)
    return out


def as_json(result: dict) -> str:
    """`plan()`'s result (with `verify`'s, if any) as strict JSON (RFC 8259, what every parser reads): a number that
    is not finite (an infinite or NaN prediction or error) is written as null, never as `Infinity` / `NaN`."""
    import json
    import numbers

    def finite(x):
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, numbers.Integral):  # NumPy's integers
            return int(x)
        if isinstance(x, numbers.Real):  # floats, NumPy's included
            return float(x) if math.isfinite(x) else None
        if isinstance(x, dict):
            return {str(k): finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return str(x)

    return json.dumps(finite(result), indent=2, allow_nan=False)


def layout_config(config: Config, row: dict) -> Config:
    """`config` with a ranked row's layout (`plan()['winner']`, …): its parallel fields and grad_accum."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **row["parallel"]),
                               train=dataclasses.replace(config.train, grad_accum=row["grad_accum"]))


def _structure(config: Config) -> tuple:
    """A layout less what only trades memory for time (ZeRO, remat, accumulation, skipping the bubble): the
    runner-up differs in it."""
    p = config.parallel
    return (config.mesh_shape, p.schedule, p.repeats, p.microbatches, p.sequence_parallel, p.overlap,
            p.context_impl)


def _row(c: Candidate, peak: float | None) -> dict:
    parallel = {f: getattr(c.config.parallel, f) for f in PLANNED}
    return {"layout": c.label(), "parallel": parallel, "grad_accum": c.config.train.grad_accum,
            "memory": c.memory.as_dict(), "time": c.timing.as_dict(), "mfu": c.timing.mfu(peak)}


def format_plan(result: dict, top: int = 10) -> str:
    """The plan as a table: the `top` fastest layouts that fit, memory by part (GB per device), step time, MFU,
    bubble and communication share, then the winner and why."""
    gb = lambda b: f"{b / 1e9:7.3f}"  # noqa: E731
    head = (f"{'#':>3} {'layout':52} {'params':>7} {'optim':>7} {'grads':>7} {'activ':>7} {'work':>7} {'total':>7} "
            f"{'step ms':>9} {'tok/s':>10} {'MFU':>6} {'bubble':>6} {'comm':>6}")
    lines = [f"{result['fit']} of {result['layouts']} valid layouts fit {result['memory_gb']:g} GB per device on "
             f"{result['devices']} devices ({result['hosts']} host(s)); profile {result['profile']} "
             f"({result['profile_source']})", head, "-" * len(head)]
    for i, r in enumerate(result["ranked"][:top], 1):
        m, t = r["memory"], r["time"]
        mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "     -"
        lines.append(f"{i:3d} {r['layout'][:52]:52} {gb(m['params'])} {gb(m['optimizer'])} {gb(m['gradients'])} "
                     f"{gb(m['activations'])} {gb(m['workspace'])} {gb(m['total'])} {t['step_s'] * 1e3:9.3f} "
                     f"{t['tokens_per_s']:10.4g} {mfu} {t['bubble'] * 100:5.1f}% {t['comm_share'] * 100:5.1f}%")
    lines.append(f"winner: {result['winner']['layout']}")
    if "why" in result:
        lines.append(f"why: {result['why']}")
    return "\n".join(lines)
