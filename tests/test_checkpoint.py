"""Checkpoints are layout-free: written at one (data, pipe, tensor, repeats) layout, restored at another."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.mesh import make_mesh
from jaxpar.sharding import model_layout, param_shardings
from jaxpar.train import fit
from jaxpar.train.checkpoint import restore_params, to_canonical
from jaxpar.train.state import abstract_model

MODEL = ["model.d_model=48", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "train.batch_size=16",
         "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=2"]
LAYOUTS = {  # name: (overrides, number of devices)
    "(8,1,1)": (["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1",
                 "parallel.microbatches=1"], 8),
    "(2,2,2) v=2": (["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.repeats=2",
                     "parallel.microbatches=4"], 8),
    "(1,2,4) v=1": (["parallel.data=1", "parallel.pipe=2", "parallel.tensor=4", "parallel.repeats=1",
                     "parallel.microbatches=2"], 8),
    "single device": (["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1",
                       "parallel.microbatches=1"], 1),
    "(4,1,2) zero=3": (["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.repeats=1",
                        "parallel.microbatches=1", "parallel.zero=3"], 8),
    "(2,2,2) v=2 zero=1 SP": (["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.repeats=2",
                               "parallel.microbatches=4", "parallel.zero=1", "parallel.sequence_parallel=true"], 8),
}


def config_at(name, steps):
    overrides, _ = LAYOUTS[name]
    return load_config("configs/tiny.py", MODEL + overrides + [f"train.steps={steps}"])


def run(name, workdir, steps):
    return fit(config_at(name, steps), workdir, devices=jax.devices()[: LAYOUTS[name][1]], progress=False)


def canonical_host(params, config, mesh):
    layout = model_layout(config.model, config.parallel, mesh)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(to_canonical(params, layout, config.model.vocab_size)))


# Writer → reader pairs. A checkpoint is canonical (model layer order, unpadded vocab), so writing and reading are
# independent maps through that one format: every writer and every reader layout appears, not every product.
PAIRS = [("(2,2,2) v=2", "(1,2,4) v=1"), ("(2,2,2) v=2", "single device"), ("(2,2,2) v=2", "(4,1,2) zero=3"),
         ("single device", "(2,2,2) v=2 zero=1 SP"), ("single device", "(8,1,1)"),
         ("(4,1,2) zero=3", "(2,2,2) v=2"), ("(4,1,2) zero=3", "(2,2,2) v=2 zero=1 SP")]


@pytest.fixture(scope="module")
def written(request, tmp_path_factory):
    """Three steps at the source layout, checkpointed; and the source's own fourth step for comparison."""
    source = request.param
    workdir = tmp_path_factory.mktemp("ckpt")
    result = run(source, workdir / "src", 3)
    shutil.copytree(workdir / "src", workdir / "cont")
    fourth = run(source, workdir / "cont", 4).history[-1]["loss"]
    return source, workdir, canonical_host(result.state.params, result.config, result.mesh), fourth


@pytest.mark.parametrize("written,target", PAIRS, indirect=["written"])
def test_restore_onto_another_layout(written, target, tmp_path):
    source, workdir, params, fourth = written
    config = config_at(target, 4).resolve_for_devices(LAYOUTS[target][1])
    mesh = make_mesh(config.parallel, jax.devices()[: LAYOUTS[target][1]])
    layout = model_layout(config.model, config.parallel, mesh)
    _, abstract = abstract_model(config.model, layout.padded_vocab)
    restored, step = restore_params(workdir / "src", abstract, layout, config.model.vocab_size,
                                    param_shardings(abstract, mesh, layout.rules, layout.param_zero_data))
    assert step == 3
    jax.tree.map(np.testing.assert_array_equal, canonical_host(restored, config, mesh), params)  # bit for bit
    # The whole training state (optimizer moments, step, data position) continues on the new layout.
    shutil.copytree(workdir / "src", tmp_path / "run")
    history = run(target, tmp_path / "run", 4).history
    assert [r["step"] for r in history] == [4]
    np.testing.assert_allclose(history[0]["loss"], fourth, rtol=1e-5)


def test_resume_after_a_clean_stop_is_bitwise_equal(tmp_path):
    """2 steps, stop, 2 more from the checkpoint == 4 steps in one go (same layout): every parameter bit for bit."""
    whole = run("(2,2,2) v=2", tmp_path / "whole", 4)
    run("(2,2,2) v=2", tmp_path / "split", 2)
    resumed = run("(2,2,2) v=2", tmp_path / "split", 4)
    assert [r["step"] for r in resumed.history] == [3, 4]
    jax.tree.map(np.testing.assert_array_equal, canonical_host(resumed.state.params, resumed.config, resumed.mesh),
                 canonical_host(whole.state.params, whole.config, whole.mesh))


def test_convert_exports_params_that_generate_reads(tmp_path):
    from jaxpar.infer.text import generate_tokens, load_workdir
    from jaxpar.train.checkpoint import convert

    result = run("(2,2,2) v=2", tmp_path / "src", 2)
    assert convert(tmp_path / "src", tmp_path / "bf16", dtype="bfloat16") == 2
    loaded = load_workdir(tmp_path / "bf16")
    assert loaded.config.model.param_dtype == "bfloat16" and loaded.step == 2
    want = canonical_host(result.state.params, result.config, result.mesh)
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param)))
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, w.astype(g.dtype)), got, want)
    assert generate_tokens(loaded, np.array([list(b"def ")], np.int32), max_new_tokens=5).shape == (1, 5)


def opt_state_bytes_on_device_0(state) -> int:
    """Bytes of Adam's moments held by the first device."""
    moments = [x for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
               if isinstance(s, nnx.State) for x in jax.tree.leaves(s)]
    return sum(shard.data.nbytes for x in moments for shard in x.addressable_shards if shard.device == jax.devices()[0])


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_shards_optimizer_state_and_trains_the_same(zero, tmp_path):

    base = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.repeats=1", "parallel.microbatches=1",
            "train.steps=3"]
    plain = run_config(base, tmp_path / "plain")
    sharded = run_config(base + [f"parallel.zero={zero}"], tmp_path / "zero")
    np.testing.assert_allclose([r["loss"] for r in sharded.history], [r["loss"] for r in plain.history], rtol=1e-5)
    ratio = opt_state_bytes_on_device_0(sharded.state) / opt_state_bytes_on_device_0(plain.state)
    print(f"zero={zero}: optimizer-state bytes per device = {ratio:.3f} of zero=0 at data=4")
    assert ratio <= 1.02 / 4
    wq = sharded.state.params["blocks"]["wq"][...]
    assert ("data" in str(wq.sharding.spec)) == (zero == 3)


def run_config(overrides, workdir):
    config = load_config("configs/tiny.py", MODEL + overrides)
    return fit(config, workdir, progress=False)
