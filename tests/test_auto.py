"""`jaxpar probe` and `parallel.auto`: the machine measured and refused elsewhere, the fields a user set kept, and a run
that trains with the planner's layout and records it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, ParallelConfig, config_from_dict, load_config
from jaxpar.planner import auto, probe, profile as machine, search
from jaxpar.train import fit

# A model small enough that the search and one compile take seconds: 5 heads (tensor 1 or 5), 3 layers (pipe 1 or 3).
MODEL = {"d_model": 40, "d_ff": 120, "n_heads": 5, "n_kv_heads": 5, "n_layers": 3, "vocab_size": 256, "max_seq_len": 24}
TRAIN = {"batch_size": 16, "seq_len": 24, "steps": 2, "eval_every": 0, "eval_batches": 1, "warmup_steps": 1}


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    """This machine's profile, probed once through the command line."""
    path = tmp_path_factory.mktemp("probe") / "profile.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["probe", "--out", str(path)]) == 0
    assert "written to" in out.getvalue()
    return path


def test_probe_measures_this_machine_and_refuses_another(profile_file, tmp_path):
    prof = machine.load_profile(str(profile_file))
    assert prof.devices == len(jax.devices()) and prof.machine == machine.machine()
    assert all(rate > 0 for rate in prof.flops.values()) and prof.latency > 0 and prof.layer_overhead > 0
    assert 0.0 <= prof.overlap <= 1.0 and prof.memory_gb > 0
    # the FP8 policy's product at every width the plain matmuls are probed at (emulated on a CPU)
    assert set(prof.matmul["float8"]) == set(prof.matmul["float32"]) and min(prof.matmul["float8"].values()) > 0
    for kind in probe.KINDS:  # every collective at every group size an axis of 8 devices can have
        assert set(prof.links[kind]) == {"2", "4", "8"} and all(bw > 0 for bw in prof.links[kind].values())
    assert prof.bandwidth("permute", 4, inside=True) == prof.links["permute"]["4"]
    assert prof.bandwidth("permute", 4, inside=False) == prof.inter_host
    other = tmp_path / "other.json"
    machine.write(dataclasses.replace(prof, machine={**prof.machine, "cores": prof.machine["cores"] + 1}), other)
    with pytest.raises(ConfigError, match="another machine"):
        machine.load_profile(str(other))
    assert machine.load_profile(str(other), this_machine=False).machine["cores"] == prof.machine["cores"] + 1


def test_the_fields_a_user_set_stay():
    """A config file's (or override's) parallel keys are kept even at their default value; from Python, every field
    set to another value than its default; train.grad_accum when set."""
    d = {"model": MODEL, "train": {**TRAIN, "grad_accum": 1}, "data": {"source": "synthetic"},
         "parallel": {"auto": True, "pipe": 1, "remat": "full"}}
    config = config_from_dict(d)
    assert config.parallel.keep == ("pipe", "remat", "grad_accum")
    assert auto.kept_fields(config) == {"pipe", "remat", "grad_accum"}
    from_python = dataclasses.replace(config, parallel=ParallelConfig(auto=True, tensor=5))
    assert auto.kept_fields(from_python) == {"tensor"}
    assert config_from_dict(dict(d, parallel={"tensor": 5})).parallel.keep == ()  # no auto: nothing recorded


def test_auto_trains_with_the_planners_layout(profile_file, tmp_path):
    """`parallel.auto` logs the winner and the runner-up, trains with the winner, and config.json records it with
    auto off; the layout is the one `jaxpar plan` ranks first for the same machine, budget and kept fields."""
    d = {"model": MODEL, "train": TRAIN, "data": {"source": "synthetic"},
         "parallel": {"auto": True, "pipe": 1, "profile": str(profile_file)}}
    config = config_from_dict(d)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fit(config, tmp_path / "w", progress=False)
    log = out.getvalue()
    assert "parallel.auto chose" in log and "runner-up" in log, log
    assert len(result.history) == 2 and all(h["loss"] > 0 for h in result.history)
    saved = json.loads((tmp_path / "w" / "config.json").read_text())["parallel"]
    assert saved["auto"] is False and saved["keep"] == [] and saved["pipe"] == 1
    base = load_config(None, [f"model.{k}={v}" for k, v in MODEL.items()] + [f"train.{k}={v}" for k, v in TRAIN.items()]
                       + ["data.source=synthetic", "parallel.pipe=1"])
    expected = search.plan(base, 8, machine.load_profile(str(profile_file)),
                           memory_gb=probe.device_memory_gb(jax.devices()[0]), fixed={"pipe"})["winner"]
    assert {k: saved[k] for k in expected["parallel"]} == expected["parallel"], log
    assert expected["layout"] in log


def test_auto_names_the_kept_fields_that_leave_no_layout_and_the_profile_field_it_refuses(tmp_path):
    """parallel.auto keeps what the config file sets (tiny: pipe 2, tensor 2, …), which one device cannot run: the
    error names those fields, values that run, and how to set them; the values it names then plan. A profile with a
    field out of range is refused naming the field (issue 35)."""
    path = tmp_path / "h100.json"  # a datasheet profile claims no machine: usable here without probing
    machine.write(machine.profile_for("h100"), path)
    asked = ["parallel.auto=true", f"parallel.profile={path}"]
    with pytest.raises(search.PlanError) as err:
        auto.choose(load_config("configs/tiny.py", asked), jax.devices()[:1], log=None)
    msg = str(err.value)
    assert "keeps parallel.microbatches = 4, parallel.pipe = 2, parallel.repeats = 2, parallel.tensor = 2" in msg
    assert "parallel.microbatches=1 parallel.pipe=1 parallel.repeats=1 parallel.tensor=1" in msg
    assert "on the command line" in msg and "config file" in msg
    named = [f"parallel.{f}=1" for f in ("microbatches", "pipe", "repeats", "tensor")]
    chosen = auto.choose(load_config("configs/tiny.py", asked + named), jax.devices()[:1], log=None)
    assert chosen.mesh_shape == (1, 1, 1, 1, 1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**dataclasses.asdict(machine.profile_for("h100")), "overlap": 5}))
    with pytest.raises(ConfigError, match=f"parallel.profile {bad}: field overlap = 5: must lie in"):
        auto.choose(load_config("configs/tiny.py", ["parallel.auto=true", f"parallel.profile={bad}"]),
                    jax.devices()[:1], log=None)
