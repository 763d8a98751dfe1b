"""Training state, born sharded.

`create_state` never materialises an unsharded copy: the model is first built abstractly (`nnx.eval_shape`), its
logical axes become `NamedSharding`s through the rules table, and the real initialisation runs under
`jit(out_shardings=…)`, so every device only ever allocates its own shard. Because JAX's threefry RNG is
partitionable, the values are the same whatever the layout — the sharded and single-device runs start identical.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import ModelConfig, TrainConfig
from jaxpar.model import MODEL_STATE, Transformer, abstract_model, learnable
from jaxpar.plan import Plan
from jaxpar.sharding import param_shardings


@flax.struct.dataclass
class TrainState:
    """step: int32 []; params: nnx.State, the model's state — its fp32 master weights (nnx.Param) and its buffers
    (jaxpar.model.Buffer: updated by the step outside the gradient); opt_state: optax state mirroring the weights
    that train (`jaxpar.model.learnable(params)`: every weight, or with LoRA the adapters alone).

    One tree for weights and buffers: everything that moves a model (layouts, checkpoints, convert, exports,
    fingerprints) carries both with no code of its own; the step and the optimizer split them."""

    step: jax.Array
    params: nnx.State
    opt_state: Any


def lr_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 → lr over warmup_steps, then cosine decay to lr·min_lr_ratio at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.lr, warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1), end_value=train.lr * train.min_lr_ratio)


def decay_mask(params: nnx.State) -> nnx.State:
    """True where AdamW's weight decay applies: the `weight_decay` metadata each parameter carries from its family
    spec (jaxpar.families.base.Param.decay — matrices and embeddings yes, norm scales and biases no)."""
    return jax.tree.map(lambda v: bool(v.get_metadata().get("weight_decay", True)), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the warmup + cosine schedule."""
    adamw = optax.adamw(lr_schedule(train), b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
                        mask=decay_mask)
    if train.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)
    return adamw


def state_shardings(abstract_state: TrainState, plan: Plan) -> TrainState:
    """NamedShardings on the plan's mesh for a (abstract) TrainState: parameters by the plan's rules; optimizer
    moments mirror their parameter (their nnx.Variable nodes carry the same logical axes); scalars (step, Adam
    count) replicated.
    ZeRO adds the data axis: to the moments at stage 1, to parameters too at stage 3."""
    mesh = plan.mesh
    replicated = NamedSharding(mesh, P())

    def opt_leaf(x):
        if isinstance(x, nnx.State):
            return param_shardings(x, mesh, plan.rules, plan.opt_zero_data)
        return replicated

    opt = jax.tree.map(opt_leaf, abstract_state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
    params = param_shardings(abstract_state.params, mesh, plan.rules, plan.param_zero_data)
    return TrainState(step=replicated, params=params, opt_state=opt)


def create_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, plan: Plan = Plan(), *,
                 abstract: bool = False) -> tuple[nnx.GraphDef, TrainState, TrainState | None]:
    """Initialise (graphdef, state, shardings). On the plan's mesh, the state is created already sharded; without
    one, on the default device (the plain single-device path). abstract=True returns ShapeDtypeStructs carrying the shardings
    (for compiling and analysing a step without allocating it)."""

    def init() -> TrainState:
        model = Transformer(model_cfg, rngs=nnx.Rngs(params=seed), padded_vocab=plan.padded_vocab)
        # Built in model order (already vocab-padded); the plan stores the layers in pipeline order.
        params = plan.from_canonical(nnx.state(model, MODEL_STATE))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(learnable(params)))

    graphdef, _ = abstract_model(model_cfg, plan.padded_vocab)
    if plan.mesh is None:
        return graphdef, jax.jit(init)(), None
    shapes = jax.eval_shape(init)
    shardings = state_shardings(shapes, plan)
    if abstract:
        return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                                      shardings), shardings
    return graphdef, jax.jit(init, out_shardings=shardings)(), shardings
