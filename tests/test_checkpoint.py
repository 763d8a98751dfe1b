"""Checkpoints are layout-free: written at one (data, pipe, tensor, repeats) layout, restored at another."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from _parity import canonical_host
from jaxpar.config import load_config
from jaxpar.store import checkpoint
from jaxpar.train import build_trainer, fit

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


def canonical_state(state, config, mesh) -> dict:
    """The whole train state on the host in canonical form: step, parameters, and every leaf of the optimizer state
    by its path — Adam's moments (`….mu`, `….nu`: parameter-shaped States, canonicalised like the parameters) and
    counts."""
    is_state = lambda x: isinstance(x, nnx.State)  # noqa: E731
    opt = {jax.tree_util.keystr(path): canonical_host(x, config, mesh) if is_state(x) else np.asarray(x)
           for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state, is_leaf=is_state)[0]}
    assert sorted(k.rpartition(".")[2] for k, x in opt.items() if isinstance(x, dict)) == ["mu", "nu"], list(opt)
    return {"step": np.asarray(state.step), "params": canonical_host(state.params, config, mesh), "opt_state": opt}


def assert_states_equal(got: dict, want: dict) -> None:
    """Bit for bit, leaf by leaf (canonical_state's dicts); the message names the leaf."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


# Writer → reader pairs. A checkpoint is canonical (model layer order, unpadded vocab), so writing and reading are
# independent maps through that one format: every writer and every reader layout appears, not every product.
PAIRS = [("(2,2,2) v=2", "(1,2,4) v=1"), ("(2,2,2) v=2", "single device"), ("(2,2,2) v=2", "(4,1,2) zero=3"),
         ("single device", "(2,2,2) v=2 zero=1 SP"), ("single device", "(8,1,1)"),
         ("(4,1,2) zero=3", "(2,2,2) v=2"), ("(4,1,2) zero=3", "(2,2,2) v=2 zero=1 SP")]
# Pairs that also train on from the restored state (a compile of the target's step each): a pipelined layout to one
# device, and ZeRO-3 shards to a pipelined layout. The bitwise restore of every pair already shows the state whole.
TRAIN_ON = {("(2,2,2) v=2", "single device"), ("(4,1,2) zero=3", "(2,2,2) v=2")}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """source -> (workdir, its final state on the host, canonical, a function giving the source's own fourth loss):
    three steps at the source layout, checkpointed; the fourth, from that checkpoint, runs when first asked for.
    Written once per source and module (a fixture parametrized by the pairs would be set up again for every pair)."""
    cache, fourths = {}, {}

    def fourth(source):
        if source not in fourths:
            workdir = cache[source][0]
            shutil.copytree(workdir / "src", workdir / "cont")
            fourths[source] = run(source, workdir / "cont", 4).history[-1]["loss"]
        return fourths[source]

    def write(source):
        if source not in cache:
            workdir = tmp_path_factory.mktemp("ckpt")
            result = run(source, workdir / "src", 3)
            cache[source] = workdir, canonical_state(result.state, result.config, result.mesh), lambda: fourth(source)
        return cache[source]

    return write


@pytest.mark.parametrize("source,target", PAIRS)
def test_restore_onto_another_layout(written, source, target, tmp_path):
    """Parameters, Adam's moments and the step restore bit for bit at the target layout (the training reader and the
    params-only reader of inference/convert), and (TRAIN_ON) training continues there to the source's own fourth
    loss."""
    workdir, want, fourth = written(source)
    config = config_at(target, 4).resolve_for_devices(LAYOUTS[target][1])
    like = build_trainer(config, jax.devices()[: LAYOUTS[target][1]], abstract=True)  # the target's state layout
    mesh = like.mesh  # and shardings; nothing allocated
    mngr = checkpoint.manager(workdir / "src")
    try:
        state, _ = checkpoint.restore_train(mngr, like.state, like.shardings, like.plan, config.model.vocab_size)
    finally:
        mngr.close()
    assert int(state.step) == 3
    assert_states_equal(canonical_state(state, config, mesh), want)
    params, step = checkpoint.restore_params(workdir / "src", like.state.params, like.plan, config.model.vocab_size,
                                             like.shardings.params)
    assert step == 3
    assert_states_equal(canonical_host(params, config, mesh), want["params"])
    if (source, target) not in TRAIN_ON:
        return
    shutil.copytree(workdir / "src", tmp_path / "run")
    history = run(target, tmp_path / "run", 4).history
    assert [r["step"] for r in history] == [4]
    np.testing.assert_allclose(history[0]["loss"], fourth(), rtol=1e-5)


# Resuming bit for bit (parameters and Adam's moments) is shown where a run is really interrupted: SIGKILL at a random
# moment (test_preemption) and a lost process of two, resumed by `jaxpar launch` (test_multihost).


def test_convert_exports_params_that_generate_reads(tmp_path):
    from jaxpar.infer.text import generate_tokens, load
    from jaxpar.store.checkpoint import convert

    result = run("(2,2,2) v=2", tmp_path / "src", 2)
    assert convert(tmp_path / "src", tmp_path / "bf16", dtype="bfloat16") == 2
    loaded = load(tmp_path / "bf16")
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


ZERO_BASE = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.repeats=1",
             "parallel.microbatches=1", "train.steps=3"]


@pytest.fixture(scope="module")
def zero0(tmp_path_factory):
    """The zero=0 run both ZeRO stages are compared with (run once)."""
    return run_config(ZERO_BASE, tmp_path_factory.mktemp("zero0"))


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_shards_optimizer_state_and_trains_the_same(zero, zero0, tmp_path):
    sharded = run_config(ZERO_BASE + [f"parallel.zero={zero}"], tmp_path / "zero")
    np.testing.assert_allclose([r["loss"] for r in sharded.history], [r["loss"] for r in zero0.history], rtol=1e-5)
    ratio = opt_state_bytes_on_device_0(sharded.state) / opt_state_bytes_on_device_0(zero0.state)
    print(f"zero={zero}: optimizer-state bytes per device = {ratio:.3f} of zero=0 at data=4")
    assert ratio <= 1.02 / 4
    wq = sharded.state.params["blocks"]["wq"][...]
    assert ("data" in str(wq.sharding.spec)) == (zero == 3)


def run_config(overrides, workdir):
    config = load_config("configs/tiny.py", MODEL + overrides)
    return fit(config, workdir, progress=False)
