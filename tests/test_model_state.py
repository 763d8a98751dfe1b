"""Model state that is not a parameter (jaxpar.model.Buffer): the MoE layers' `expert_load` (moe.load_ema).

It follows its rule step by step from the step's per-layer statistics, receives no gradient, Adam moment or weight
decay, comes out the same at every layout (circular pipeline, a schedule table, expert and tensor parallelism),
restores bit for bit onto other layouts, and `jaxpar convert` carries it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import FIT_LAYOUTS, canonical_host, restore_on
from jaxpar.config import load_config
from jaxpar.model import abstract_model, buffers_of
from jaxpar.store import checkpoint
from jaxpar.train import build_trainer, fit
from jaxpar.train.step import loss_and_grads

DECAY = 0.75
# Odd where the layouts allow: 6 experts (split over expert = 2) of width 10 (over tensor = 2), top 2, d_model 24 (head_dim 6).
MODEL = ["model.d_model=24", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "moe.n_experts=6",
         "moe.top_k=2", "moe.d_ff=10", f"moe.load_ema={DECAY}", "train.batch_size=16", "train.seq_len=16",
         "train.steps=3", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1",
         "train.weight_decay=0.5"]  # a decay that would show on the buffer if it reached it
LAYOUTS = {name: FIT_LAYOUTS[name] for name in ("single device", "(pipe, expert, tensor) = (2, 2, 2) circular",
                                                  "(data, pipe, tensor) = (2, 2, 2) ZB-V")}


def config_at(name):
    return load_config("configs/moe_tiny.py", MODEL + LAYOUTS[name][0])


def test_expert_load_follows_its_rule_and_the_optimizer_never_sees_it():
    """On one device, step by step: expert_load ← d·expert_load + (1 − d)·load/Σload per MoE layer, from the load
    the step's own statistics give (each layer's, computed beside it); it starts at 1/X; the weights train while the
    optimizer's state holds no buffer (no moments, so no update and no weight decay can reach it)."""
    config = config_at("single device").resolve_for_devices(1)
    trainer = build_trainer(config, jax.devices()[:1])
    stats_of = jax.jit(loss_and_grads(trainer.graphdef, stats=True))
    state, X = trainer.state, config.model.moe.n_experts
    want = np.full((4, X), 1 / X, np.float32)
    np.testing.assert_array_equal(state.params["blocks"]["expert_load"][...], want)
    assert "expert_load" not in str(jax.tree_util.tree_flatten_with_path(state.opt_state)[0])
    rng = np.random.default_rng(3)
    router = np.asarray(state.params["blocks"]["router"][...])
    for _ in range(3):
        batch = jnp.asarray(rng.integers(0, 256, (16, 17)), jnp.int32)
        load = np.asarray(stats_of(state.params, batch)[2]["load"], np.float64)  # [L_moe, X], this step's
        assert load.shape == (4, X) and (load.sum(-1) == 16 * 16 * 2).all()  # every token's top-2 assignments
        want = DECAY * want + (1 - DECAY) * load / load.sum(-1, keepdims=True)
        state, metrics = trainer.train_step(state, batch)
        assert int(metrics["skipped"]) == 0
        np.testing.assert_allclose(state.params["blocks"]["expert_load"][...], want, rtol=1e-6)
    assert not np.array_equal(state.params["blocks"]["router"][...], router)  # the weights trained meanwhile
    assert list(nnx.to_pure_dict(buffers_of(state.params))) == ["blocks"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name → (workdir, FitResult): three steps of `fit` at each layout, on the same batches."""
    out = {}
    for name, (_, devices) in LAYOUTS.items():
        workdir = tmp_path_factory.mktemp("run")
        out[name] = workdir, fit(config_at(name), workdir, devices=jax.devices()[:devices], progress=False)
    return out


def test_every_layout_updates_the_buffer_alike_and_it_restores_anywhere_bit_for_bit(runs, tmp_path):
    """The per-layer statistics reach the buffer in model order at every layout (the circular pipeline's passes and
    ZB-V's V placement both reorder the layers in memory); a checkpoint written by the circular run restores onto
    the other two layouts bit for bit (training reader and params-only reader), and `convert` carries it."""
    host = {name: canonical_host(result.state.params, result.config, result.mesh)
            for name, (_, result) in runs.items()}
    want = host["single device"]["blocks"]["expert_load"]
    assert not np.allclose(want, 1 / 6)  # it moved
    for name, tree in host.items():
        np.testing.assert_allclose(tree["blocks"]["expert_load"], want, rtol=1e-6, err_msg=name)

    source = "(pipe, expert, tensor) = (2, 2, 2) circular"
    workdir = runs[source][0]
    for target in ("single device", "(data, pipe, tensor) = (2, 2, 2) ZB-V"):
        state, got = restore_on(workdir, config_at(target), LAYOUTS[target][1])
        jax.tree.map(np.testing.assert_array_equal, got, host[source])
        assert "expert_load" not in str(jax.tree_util.tree_flatten_with_path(state.opt_state)[0])

    checkpoint.convert(workdir, tmp_path / "converted")
    _, params, step = checkpoint.read_canonical(tmp_path / "converted")
    assert step == 3
    np.testing.assert_array_equal(np.asarray(params["blocks"]["expert_load"][...]),
                                  host[source]["blocks"]["expert_load"])


def test_hugging_face_export_holds_the_weights_and_an_import_starts_the_buffer_anew(runs, tmp_path):
    """Mixtral's format has no expert_load: the export writes the weights alone (the import's weights equal them
    bit for bit), and a model built from them with moe.load_ema starts its buffer at 1/X, as a new model does."""
    from jaxpar.interop import hf

    source = "(pipe, expert, tensor) = (2, 2, 2) circular"
    workdir, result = runs[source]
    hf.export_workdir(workdir, tmp_path / "hf")
    names = hf.checkpoint_names(tmp_path / "hf")
    assert names and not any("load" in n for n in names)
    cfg = hf.model_config(hf.read_config(tmp_path / "hf"), tmp_path / "hf")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_ema=DECAY))
    loaded = hf.load_params(tmp_path / "hf", cfg, abstract_model(cfg)[1])
    np.testing.assert_array_equal(np.asarray(loaded["blocks"]["expert_load"][...]), np.full((4, 6), 1 / 6, np.float32))
    want = canonical_host(result.state.params, result.config, result.mesh)
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(loaded))
    assert got.keys() == want.keys()
    for name in set(want) - {"blocks"}:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in want["blocks"]:
        if name != "expert_load":
            np.testing.assert_array_equal(got["blocks"][name], want["blocks"][name], err_msg=name)
