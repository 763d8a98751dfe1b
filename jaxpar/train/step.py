"""The train and eval steps: next-token loss, gradient accumulation, clipping and AdamW.

Layout comes from outside: the steps are plain functions; `compile_steps` jits them with the state and batch
shardings of a mesh (GSPMD propagates the rest from the logical constraints inside the model), or with none at all for
the single-device reference.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.sharding import constrain, logical_to_spec
from jaxpar.train.state import TrainState

Metrics = dict[str, jax.Array]


def next_token_loss(graphdef: nnx.GraphDef, params: nnx.State, batch: jax.Array, remat: str = "none") -> jax.Array:
    """Mean cross-entropy (float32, nats/token) of predicting batch[:, 1:] from batch[:, :-1]. batch int [B, T+1]."""
    model = nnx.merge(graphdef, params)
    logits = model(batch[:, :-1], remat=remat)  # [B, T, V] float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, grad_accum: int = 1,
                    remat: str = "none", schedule: optax.Schedule | None = None
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, Metrics]]:
    """(state, batch int [B, T+1]) → (state, metrics {loss, grad_norm, lr}).

    Gradient accumulation splits the batch into `grad_accum` equal chunks run one after another (a scan), so peak
    activation memory is that of B/grad_accum sequences. Chunk a takes rows a, a+A, a+2A, … (a strided split) so each
    data shard contributes B/(data·A) of its own rows to every chunk and no rows move between devices. The loss is a
    mean over equal-sized chunks, so the mean of chunk means equals the full-batch mean and the result is the same
    as without accumulation (up to summation order).
    """
    grad_fn = jax.value_and_grad(lambda p, b: next_token_loss(graphdef, p, b, remat))

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        if grad_accum == 1:
            loss, grads = grad_fn(state.params, batch)
        else:
            B, T1 = batch.shape
            chunks = batch.reshape(B // grad_accum, grad_accum, T1).swapaxes(0, 1)  # [A, B/A, T+1]
            chunks = constrain(chunks, (None, "batch", None))

            def accumulate(carry, chunk):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(state.params, chunk)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), chunks)
            loss, grads = loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": global_norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf, in float32 (what clip_by_global_norm compares against)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """(params, batch int [B, T+1]) → mean next-token loss."""
    return lambda params, batch: next_token_loss(graphdef, params, batch)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, T+1]: rows over the data axis, sequence replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch", None)))


def compile_steps(train_step, eval_step, mesh: Mesh | None, shardings):
    """jit both steps. With a mesh: explicit state/batch shardings and the mesh set while tracing (so the model's
    logical `constrain` calls resolve); the state buffer is donated so params and optimizer state update in place."""
    if mesh is None:
        return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)
    data = batch_sharding(mesh)
    train = jax.jit(train_step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(shardings.params, data))

    def with_mesh(fn):
        def call(*args):
            with jax.set_mesh(mesh):
                return fn(*args)
        call.lower = lambda *args: _lower_with_mesh(fn, mesh, *args)
        return call

    return with_mesh(train), with_mesh(evaluate)


def _lower_with_mesh(fn, mesh, *args):
    with jax.set_mesh(mesh):
        return fn.lower(*args)
