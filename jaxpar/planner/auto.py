"""`parallel.auto`: the planner chooses the layout of a run on the devices it has.

    kept     = parallel.keep (the config file's and overrides' parallel keys join it by themselves)
             ∪ every planned field set to a value other than its default (so `ParallelConfig(auto=True, tensor=2)`
               keeps tensor 2 from Python as well)
    machine  = parallel.profile (a `jaxpar probe` file of this machine), else the device kind's datasheet, else a probe
               of the devices now (CPU, one process: ~12 s)
    budget   = the memory one device may use (the allocator's limit; on CPU the host's memory over its devices)

`search.plan` ranks every valid layout that keeps the kept fields and fits the budget; the fastest is the run's
layout, logged with the runner-up and why it wins. The config that comes back has `auto` off and the layout filled
in, so config.json and the checkpoints record what ran.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jaxpar import flops
from jaxpar.config import PLANNED, Config, ConfigError, ParallelConfig, TrainConfig
from jaxpar.planner import probe, search
from jaxpar.planner.profile import Profile, load_profile, profile_for


def kept_fields(config: Config) -> set[str]:
    """The fields `parallel.auto` leaves as the config has them (see the module docstring)."""
    p, t = config.parallel, config.train
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    kept = set(p.keep) | {f for f in PLANNED if getattr(p, f) != defaults[f]}
    if t.grad_accum != TrainConfig.grad_accum:
        kept.add("grad_accum")
    return kept


def machine_profile(config: Config, devices: list) -> Profile:
    """The profile the choice is made with (see the module docstring)."""
    if config.parallel.profile:
        return load_profile(config.parallel.profile, field="parallel.profile")
    kind = devices[0].device_kind
    if devices[0].platform != "cpu" and flops.device_row(kind):
        return profile_for(kind)
    if jax.process_count() > 1:
        # Each process would measure its own devices, a little differently, and choose a different layout.
        raise ConfigError("parallel.profile", "", f"parallel.auto on {jax.process_count()} processes of "
                          f"'{kind}' devices (no datasheet) needs one profile every process reads",
                          "run `jaxpar probe --out FILE` on one host and pass --config.parallel.profile=FILE")
    return probe.measure(devices)


def choose(config: Config, devices: list, log: Callable[[str], None] | None = print) -> Config:
    """`config` with the planner's layout for `devices` filled in (resolved for them), `auto` off. `log` gets one
    line naming the choice, the runner-up and why (process 0 only; None: silent)."""
    n = len(devices)
    kept = kept_fields(config)
    profile = machine_profile(config, devices)
    budget = probe.device_memory_gb(devices[0])
    base = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, auto=False, keep=(), profile=""))
    # The kept fields come from the config file as well as the command line: say how to free or change them.
    release = ("set them to those values on the command line (--config.parallel.FIELD=VALUE; train.grad_accum the "
               "same), or delete them from the config file: parallel.auto keeps every parallel field (and "
               "train.grad_accum) the config file or an override sets, and any field set to a non-default value")
    result = search.plan(base, n, profile, hosts=jax.process_count(), memory_gb=budget, fixed=kept, release=release)
    win = result["winner"]
    chosen = search.layout_config(base, win)
    if log is not None and jax.process_index() == 0:
        step, gb = win["time"]["step_s"] * 1e3, win["memory"]["total"] / 1e9
        line = (f"jaxpar: parallel.auto chose {win['layout']} of {result['fit']} layouts that fit {budget:.3g} GB "
                f"per device on {n} devices (profile {profile.name}, {profile.source}; kept "
                f"{', '.join(sorted(kept)) or 'nothing'}): predicted {step:.4g} ms a step, {gb:.3g} GB per device")
        if "runner_up" in result:
            line += f"; runner-up {result['runner_up']['layout']}; {result['why']}"
        log(line)
    return chosen.resolve_for_devices(n)
