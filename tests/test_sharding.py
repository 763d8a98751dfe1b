"""Mesh construction, the logical rules table, and parameters born sharded."""

import types

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, ModelConfig, TrainConfig
from jaxpar.mesh import make_mesh
from jaxpar.model import abstract_model
from jaxpar.parallel.axes import AXES
from jaxpar.plan import make_plan
from jaxpar.sharding import logical_to_spec, param_specs
from jaxpar.train.state import create_state, make_optimizer


def layout(data, pipe, tensor):
    return types.SimpleNamespace(data=data, pipe=pipe, expert=1, context=1, tensor=tensor)


def test_make_mesh_axes_fill_and_errors():
    mesh = make_mesh(layout(-1, 1, 2))
    assert mesh.axis_names == AXES and dict(mesh.shape) == {"data": 4, "pipe": 1, "expert": 1, "context": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="parallel.data"):
        make_mesh(layout(3, 1, 2))
    with pytest.raises(ConfigError, match="parallel.tensor"):
        make_mesh(layout(-1, 1, 3))


def test_tensor_is_innermost_axis():
    """Neighbouring device ids form a tensor group (on a GPU host: the NVLink-connected ones)."""
    mesh = make_mesh(layout(2, 2, 2))
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    assert all(b == a + 1 for a, b in ids)


def test_logical_to_spec_uses_each_mesh_axis_once():
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "pipe", "expert"), "context", None)
    assert logical_to_spec(("layers", "batch")) == P("pipe", ("data", "expert"))  # 'pipe' is taken: batch keeps the rest
    assert logical_to_spec(("heads", "mlp")) == P("tensor", None)  # second use of 'tensor' falls back to replicated
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",))


EXPECTED_LLAMA = {
    ("embed",): P("tensor", None),
    ("lm_head",): P(None, "tensor"),
    ("final_norm",): P(None),
    ("blocks", "attn_norm"): P("pipe", None),
    ("blocks", "mlp_norm"): P("pipe", None),
    ("blocks", "wq"): P("pipe", None, "tensor", None),
    ("blocks", "wk"): P("pipe", None, "tensor", None),
    ("blocks", "wv"): P("pipe", None, "tensor", None),
    ("blocks", "wo"): P("pipe", "tensor", None, None),
    ("blocks", "w_gate"): P("pipe", None, "tensor"),
    ("blocks", "w_up"): P("pipe", None, "tensor"),
    ("blocks", "w_down"): P("pipe", "tensor", None),
}
EXPECTED_GPT2_EXTRA = {
    ("pos_embed",): P(None, None),
    ("final_norm_b",): P(None),
    ("blocks", "attn_norm_b"): P("pipe", None),
    ("blocks", "mlp_norm_b"): P("pipe", None),
    ("blocks", "bq"): P("pipe", "tensor", None),
    ("blocks", "bk"): P("pipe", "tensor", None),
    ("blocks", "bv"): P("pipe", "tensor", None),
    ("blocks", "bo"): P("pipe", None),
    ("blocks", "b_up"): P("pipe", "tensor"),
    ("blocks", "b_down"): P("pipe", None),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_partition_spec_of_every_parameter_at_2_2_2(family):
    cfg = ModelConfig(family=family, vocab_size=256, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48)
    _, abstract = abstract_model(cfg)
    specs = {path: v.get_value() for path, v in nnx.to_flat_state(param_specs(abstract))}
    expected = dict(EXPECTED_LLAMA)
    if family == "gpt2":
        expected.pop(("blocks", "w_gate"))
        expected.update(EXPECTED_GPT2_EXTRA)
    assert specs == expected
    # ... and those specs are realisable on a (data, pipe, tensor) = (2, 2, 2) mesh: every sharded dim divides.
    mesh = make_mesh(layout(2, 2, 2))
    for path, v in nnx.to_flat_state(abstract):
        jax.sharding.NamedSharding(mesh, specs[path]).shard_shape(v.get_value().shape)


def test_state_is_born_sharded_and_optimizer_moments_follow_params():
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48)
    mesh = make_mesh(layout(2, 1, 4))
    _, state, _ = create_state(cfg, make_optimizer(TrainConfig()), seed=0, plan=make_plan(cfg, None, mesh))
    wq = state.params["blocks"]["wq"][...]
    assert wq.sharding.spec == P("pipe", None, "tensor", None)
    assert wq.addressable_shards[0].data.shape == (2, 32, 1, 8)  # each device holds 1 of 4 heads
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = (scale_by_adam, ...)
    assert adam.mu["blocks"]["wq"][...].sharding.spec == P("pipe", None, "tensor", None)
    assert state.step.sharding.spec == P()


@pytest.mark.parametrize("overrides, field", [
    ([], "parallel.pipe"),  # tiny's default (2, 2, 2): a pipeline the GSPMD step would run in storage order
    (["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel"),
])
def test_gspmd_baseline_refuses_what_it_cannot_run(overrides, field):
    """explicit=False used to accept a pipeline (training with the layers in the wrong order) and sequence
    parallelism (silently ignored); both are now ConfigErrors naming the field."""
    from jaxpar.config import load_config
    from jaxpar.train import build_trainer

    cfg = load_config("configs/tiny.py", overrides).resolve_for_devices(8)
    with pytest.raises(ConfigError, match=rf"^{field} = .*GSPMD baseline"):
        build_trainer(cfg, jax.devices(), explicit=False, abstract=True)
