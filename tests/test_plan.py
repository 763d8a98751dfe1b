"""The parallel plan: the mesh-axis table and what is derived from it, make_plan's validation, and a model trained on
the five-axis mesh against the single-device reference."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import sharding
from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, load_config
from jaxpar.mesh import describe_mesh, hybrid_device_order, make_mesh
from jaxpar.parallel import axes
from jaxpar.plan import make_plan

# The rules table as it was written out by hand before the axis table existed, plus the two new axes' names.
OLD_RULES = {"batch": ("data", "pipe"), "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
             "layers": "pipe", "embed": None, "head_dim": None, "seq": None, "norm": None}

MODEL = ModelConfig(vocab_size=263, d_model=30, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=6, d_ff=44,
                    max_seq_len=11)


def test_axis_table_order_tensor_innermost():
    assert axes.AXES == ("data", "pipe", "expert", "context", "tensor")
    assert [a.field for a in axes.MESH_AXES] == [f"parallel.{n}" for n in axes.AXES]
    assert all(a.why for a in axes.MESH_AXES)


def test_rules_are_derived_from_the_table():
    rules = dict(axes.RULES)
    assert len(rules) == len(axes.RULES)  # each logical name once
    assert sharding.RULES is axes.RULES  # the one table the sharding helpers apply
    # Every old rule holds, with the new axes added where they split: batch also over expert, seq over context.
    # and MLA's latents (q_lora, kv_lora) replicated, as are the stacks a pipeline runs outside its stages.
    want = dict(OLD_RULES, batch=("data", "pipe", "expert"), seq="context", experts="expert", q_lora=None,
                kv_lora=None, prefix_layers=None, mtp_layers=None)
    assert rules == want
    assert [name for name, mesh_axes in axes.RULES if mesh_axes is None] == [
        "embed", "head_dim", "norm", "q_lora", "kv_lora", "prefix_layers", "mtp_layers"]
    assert axes.BATCH_AXES == ("data", "pipe", "expert")
    assert axes.GRAD_AXES == ("data", "expert")


def test_degree_resolution_and_its_errors():
    assert axes.resolve_degrees(ParallelConfig(tensor=2), 8) == {"data": 4, "pipe": 1, "expert": 1, "context": 1,
                                                                 "tensor": 2}
    assert axes.resolve_degrees(ParallelConfig(data=2, pipe=2, tensor=2, microbatches=2), 8)["data"] == 2
    with pytest.raises(ConfigError, match=r"^parallel.data = 3: mesh data\*pipe\*expert\*context\*tensor = "
                                          r"3\*1\*1\*1\*2 = 6 must equal the 8"):
        axes.resolve_degrees(ParallelConfig(data=3, tensor=2), 8)
    with pytest.raises(ConfigError, match=r"^parallel.tensor = 3: .* must divide the 8 available devices"):
        axes.resolve_degrees(ParallelConfig(tensor=3), 8)
    with pytest.raises(ConfigError, match=r"^parallel.pipe = 3"):  # the axis set above 1 is the one named
        axes.resolve_degrees(ParallelConfig(pipe=3, microbatches=3), 8)


def test_expert_axis_needs_moe_layers():
    """Every axis now has a strategy; `expert` needs experts to split (jaxpar.config), and a degree must be ≥ 1."""
    with pytest.raises(ConfigError, match=r"^parallel.expert = 2: nothing splits over 'expert': the model has no "
                                          r"MoE layers.*Fix: set parallel.expert=1, or moe.n_experts > 0"):
        load_config(None, ["parallel.expert=2"])
    with pytest.raises(ConfigError, match=r"^parallel.expert = 0"):
        ParallelConfig(expert=0)


def test_mesh_has_the_five_axes_in_order():
    mesh = make_mesh(ParallelConfig(data=2, pipe=2, tensor=2, microbatches=2))
    assert mesh.axis_names == axes.AXES
    assert dict(mesh.shape) == {"data": 2, "pipe": 2, "expert": 1, "context": 1, "tensor": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
    assert all(b == a + 1 for a, b in ids)  # a tensor pair is neighbouring devices
    text = describe_mesh(mesh)
    assert "data 1 pipe 0: tensor -> " in text and "expert" not in text.splitlines()[1]


def test_hybrid_order_places_every_axis_but_data_inside_a_host():
    fake = [types.SimpleNamespace(process_index=p, id=p * 100 + i) for p in range(2) for i in range(4)]
    order = hybrid_device_order(fake, (2, 2, 1, 1, 2))
    procs = np.vectorize(lambda d: d.process_index)(order)
    assert (procs == np.arange(2)[:, None, None, None, None]).all()
    with pytest.raises(ValueError, match="one degree per mesh axis"):
        hybrid_device_order(fake, (2, 2, 2))


def test_plan_exposes_what_each_strategy_needs():
    parallel = ParallelConfig(data=2, pipe=2, tensor=2, repeats=2, microbatches=4, sequence_parallel=True, zero=1)
    plan = make_plan(MODEL, parallel, jax.devices())
    assert plan.degrees == {"data": 2, "pipe": 2, "expert": 1, "context": 1, "tensor": 2}
    assert plan.mesh.axis_names == axes.AXES
    assert plan.padded_vocab == 264  # 263 rounded up to a multiple of tensor
    assert (plan.tensor.axis, plan.tensor.sequence, plan.tensor.kv_replicas) == ("tensor", True, 1)
    p = plan.pipeline
    assert (p.stages, p.repeats, p.microbatches, p.layers, p.iterations) == (2, 2, 4, 4, 2 * 4 + 2 - 1)
    assert plan.stack_order(4).tolist() == [0, 2, 1, 3]
    assert (plan.zero, plan.opt_zero_data, plan.param_zero_data) == (1, 2, 1)
    assert plan.batch_axes == ("data", "pipe", "expert") and plan.grad_axes == ("data", "expert")
    assert plan.batch_spec == P(("data", "pipe", "expert"), None)
    # GQA with fewer kv heads than tensor ranks: kv heads replicated, each rank uses its group's head.
    gqa = make_plan(MODEL, ParallelConfig(tensor=4, data=2), jax.devices())
    assert dict(gqa.rules)["kv_heads"] is None and gqa.tensor.kv_replicas == 2 and gqa.pipeline is None
    # The same plan from an existing mesh.
    again = make_plan(MODEL, parallel, plan.mesh)
    assert again.degrees == plan.degrees and again.mesh is plan.mesh


def test_single_device_plan_is_the_reference():
    plan = make_plan(MODEL)
    assert plan.mesh is None and not plan.sharded and plan.tensor is None and plan.pipeline is None
    assert plan.padded_vocab == MODEL.vocab_size and plan.stack_order(4) is None
    assert set(plan.degrees.values()) == {1}


@pytest.mark.parametrize("parallel, explicit, field, rule", [
    (ParallelConfig(data=4, pipe=2, microbatches=2), False, "parallel.pipe", "GSPMD baseline"),
    (ParallelConfig(data=4, tensor=2, sequence_parallel=True), False, "parallel.sequence_parallel", "GSPMD baseline"),
    (ParallelConfig(data=1, pipe=2, tensor=4, microbatches=2, zero=1), True, "parallel.zero", "size 1"),
    (ParallelConfig(data=1, tensor=2, zero=3), True, "parallel.zero", "size 1"),
])
def test_plan_refuses_what_would_not_run_as_asked(parallel, explicit, field, rule):
    devices = jax.devices()[:2] if parallel.data == 1 and parallel.pipe == 1 else jax.devices()
    with pytest.raises(ConfigError, match=rf"^{field} = .*{rule}.*Fix:"):
        make_plan(MODEL, parallel, devices, explicit=explicit)


def test_plan_refuses_a_mesh_the_config_does_not_describe():
    mesh = make_mesh(ParallelConfig(tensor=2))  # data 4, tensor 2
    with pytest.raises(ConfigError, match=r"^parallel.tensor = 1: the mesh has tensor = 2"):
        make_plan(MODEL, ParallelConfig(), mesh)
    assert make_plan(MODEL, None, mesh).degrees["tensor"] == 2  # no config: the mesh's own degrees


def test_sequence_parallel_without_tensor_is_refused():
    with pytest.raises(ConfigError, match=r"^parallel.sequence_parallel = True: .*parallel.tensor = 1"):
        ParallelConfig(sequence_parallel=True)


def test_mean_over_gradient_axes_with_size_one_axes_is_bitwise_the_data_mean():
    """pmean over (data, expert) with expert = 1 is the same all-reduce as over data alone, bit for bit."""
    mesh = make_mesh(ParallelConfig(tensor=2))
    x = jax.random.normal(jax.random.key(0), (8, 37), jnp.float32) * 1e3

    def mean(over):
        # check_vma=False: the comparison needs the mean over `data` alone, which leaves the (size-1) expert axis
        # unreduced — exactly what the check exists to refuse in real code.
        fn = jax.shard_map(lambda a: jax.lax.pmean(a, over), mesh=mesh, in_specs=P(axes.GRAD_AXES),
                           out_specs=P(), check_vma=False)
        return np.asarray(jax.jit(fn)(x))

    np.testing.assert_array_equal(mean(axes.GRAD_AXES), mean("data"))


# ---------------------------------------------------------------------------------------------------------------------
# Training on the five-axis mesh. One compile per mesh: the reference (no mesh) and (2, 2, 1, 1, 2).

SMALL = ["model.vocab_size=263", "model.d_model=30", "model.n_heads=6", "model.n_kv_heads=2", "model.head_dim=6",
         "model.d_ff=44", "model.n_layers=4", "model.max_seq_len=11", "train.seq_len=11", "train.batch_size=8",
         "train.lr=1e-2", "train.warmup_steps=1", "parallel.repeats=1"]


def train_losses(config, devices, steps=3):
    from jaxpar.train import build_trainer

    trainer = build_trainer(config, devices)
    rows = np.random.default_rng(0).integers(0, config.model.vocab_size, (8, 12)).astype(np.int32)
    state, out = trainer.state, []
    for _ in range(steps):  # the same batch each step: the loss must fall
        state, metrics = trainer.train_step(state, trainer.put(rows))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(out), trainer


def test_five_axis_mesh_training_matches_single_device_reference():
    single = load_config(None, SMALL + ["parallel.data=1", "parallel.microbatches=1"])
    want, _ = train_losses(single, None)
    layout = load_config(None, SMALL + ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                        "parallel.microbatches=2"]).resolve_for_devices(8)
    got, trainer = train_losses(layout, jax.devices())
    assert dict(trainer.mesh.shape) == {"data": 2, "pipe": 2, "expert": 1, "context": 1, "tensor": 2}
    assert want[-1, 0] < want[0, 0]  # it trains, so the comparison covers optimizer updates
    np.testing.assert_allclose(got, want, rtol=1e-5)
