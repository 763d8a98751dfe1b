"""The compiled train step against Megatron's analytic accounting: tensor-axis bytes, FLOPs, activation memory."""

import functools
import json
import os
import pathlib
import subprocess
import types

import jax
import pytest

from jaxpar.analysis.report import activation_bytes_per_layer, analyze
from jaxpar.config import load_config
from jaxpar.mesh import make_mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_PIPE = ["--config.parallel.pipe=1", "--config.parallel.repeats=1", "--config.parallel.microbatches=1"]
# V = 263 (padded per t) > h = 24 and V/8 = 33 > h, so a gathered-logits collective would be the largest one.
SMALL = ["model.vocab_size=263", "model.d_model=24", "model.n_layers=3", "model.n_heads=8", "model.n_kv_heads=2",
         "model.head_dim=6", "model.d_ff=40", "model.max_seq_len=16", "train.seq_len=16", "train.batch_size=8"]


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_tensor_axis_collectives_are_megatrons(tensor, sequence):
    config = load_config(None, SMALL + [f"parallel.tensor={tensor}", f"parallel.sequence_parallel={sequence}"])
    report = analyze(config, activations=False)
    c, cfg = report["collectives"], report["config"]
    assert c["exact"]  # every loop around a collective had a known trip count
    assert 0.98 <= report["ratio"]["tensor_sent_bytes"] <= 1.02, (c, report["expected"]["tensor_sent_bytes"])
    kinds = {k.split("@")[0] for k in c["by_kind_and_axes"] if k.endswith("@tensor")}
    if sequence:  # the layer boundaries are all-gathers and reduce-scatters; all-reduces only carry scalars/grads
        assert {"all-gather", "reduce-scatter"} <= kinds
        small = report["expected"]["tensor_sent_bytes"]["loss"] + report["expected"]["tensor_sent_bytes"]["param_grads"]
        reduces = c["by_kind_and_axes"]["all-reduce@tensor"]["sent_bytes"] - c["tensor_scalar_sent_bytes"]
        assert reduces <= 1.02 * small
    else:
        assert kinds == {"all-reduce"}
    # The loss stays vocab-parallel: no array on the tensor axis is as large as one [b, s, V/t] logits block.
    b, s = cfg["batch_per_data_shard"], cfg["seq_len"]
    assert c["largest_tensor_array_elements"] < b * s * cfg["padded_vocab"] // tensor


def test_flops_count_every_layer_not_one_loop_body():
    """XLA's cost_analysis counts a scanned layer once; the HLO count with trip counts matches the formula."""
    config = load_config(None, SMALL + ["parallel.tensor=2", "model.n_layers=6", "model.scan_unroll=1"])
    report = analyze(config, activations=False)  # (one layer per trip: the loop body XLA counts once is one layer)
    assert report["ratio"]["flops"] == pytest.approx(1.0, rel=1e-3)
    assert report["flops"]["xla_cost_flops"] < 0.6 * report["flops"]["dot_flops"]


def test_zero1_reduce_scatters_the_gradients():
    """ZeRO-1: the gradients leave the backward split over `data` as Adam's moments are — a reduce-scatter of their
    bytes, no all-reduce of them — and the updated parameters come back by an all-gather of the same bytes: 2(d−1)/d
    of the gradient bytes on `data` (planner/cost.py's count), not an all-reduce's 2(d−1)/d plus the gather."""
    from jaxpar.model import count_params

    config = load_config(None, SMALL + ["parallel.data=8", "parallel.tensor=1", "parallel.zero=1"])
    by = analyze(config, activations=False)["collectives"]["by_kind_and_axes"]
    grads = 4 * count_params(config.model)  # float32; every SMALL parameter has a dim divisible by 8
    assert by["reduce-scatter@data"]["bytes"] == by["all-gather@data"]["bytes"] >= 0.99 * grads, by
    assert by.get("all-reduce@data", {"bytes": 0})["bytes"] < 0.01 * grads, by  # scalars only: the loss, the norms


MEMORY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=8",
          "model.d_ff=128", "model.max_seq_len=64", "train.seq_len=64", "train.batch_size=8"]


@functools.lru_cache(maxsize=None)
def per_layer(tensor, sequence):
    config = load_config(None, MEMORY + [f"parallel.tensor={tensor}", f"parallel.sequence_parallel={sequence}",
                                         "parallel.data=1"])
    mesh = make_mesh(types.SimpleNamespace(data=1, pipe=1, expert=1, context=1, tensor=tensor), jax.devices()[:tensor])
    return activation_bytes_per_layer(config, mesh)["per_layer"]


@pytest.mark.parametrize("tensor", [2, 4])  # two degrees show the 1/t; 8 added 30 s and nothing new
def test_sequence_parallel_divides_activation_memory_by_tensor(tensor):
    """Korthikanti et al.: TP alone leaves the norm/residual/dropout activations (≈10·s·b·h) replicated; TP+SP
    shards all of a layer's activations, so per device they are 1/t of the single-device figure."""
    base = per_layer(1, False)
    with_sp, without_sp = per_layer(tensor, True), per_layer(tensor, False)
    assert with_sp <= 1.1 * base / tensor
    assert without_sp > 1.05 * base / tensor  # what SP removes: replicated activations outside the TP regions


def test_analyze_cli_reports_json_sections(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([str(ROOT / ".venv/bin/jaxpar") if (ROOT / ".venv/bin/jaxpar").exists() else "jaxpar",
                          "analyze", "--config", "configs/tiny.py", "--config.parallel.data=2",
                          "--config.parallel.tensor=4", *NO_PIPE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert {"collectives", "flops", "memory", "expected", "ratio"} <= set(report)
    assert report["config"]["mesh"] == {"data": 2, "pipe": 1, "expert": 1, "context": 1, "tensor": 4}
    assert report["memory"]["activations"]["per_layer"] > 0
    assert 0.98 <= report["ratio"]["tensor_sent_bytes"] <= 1.02
