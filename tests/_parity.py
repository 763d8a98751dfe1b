"""Gradient parity against a reference, one scale per parameter (imported by the parity tests).

`rtol` is relative to each parameter's own largest reference gradient — and each layer of a stacked parameter
(`blocks/wq` [L, …]) is a parameter of its own: every entry must satisfy |got − want| ≤ rtol · max|want| over
that layer's slice. One scale shared by all parameters (a floor of 1e-6 · the largest gradient anywhere) lets a
parameter with small gradients pass at any relative error; elementwise rtol alone fails on entries that are zero
in exact arithmetic and come out as rounding noise.

`single_device` and `on_layout` are the two sides every layout test compares: the plain model on one device, and
the same parameters laid out for a plan and run through the step's shard_map."""

import jax
import numpy as np
from flax import nnx

from jaxpar.model import Transformer
from jaxpar.plan import make_plan
from jaxpar.sharding import param_shardings, param_specs
from jaxpar.train.step import loss_and_grads, sharded_loss_and_grads


def canonical_host(params, config, mesh=None) -> dict:
    """A trained model state (parameters and buffers, laid out for `config` on `mesh`) on the host, as the
    checkpoint stores it: layers in model order, vocab unpadded."""
    plan = make_plan(config.model, config.parallel, mesh)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(plan.to_canonical(params)))


# Layouts the model-state tests train at with `fit` (name: (config overrides, devices)): every pipeline kind's layer
# order (the circular loop's passes, ZB-V's V placement), expert and tensor parallelism, and sequence parallelism.
_FIT_ONE = ["parallel.repeats=1", "parallel.microbatches=1"]
FIT_LAYOUTS = {
    "single device": (["parallel.data=1", "parallel.pipe=1", "parallel.expert=1", "parallel.tensor=1"] + _FIT_ONE, 1),
    "(data, expert, tensor) = (2, 2, 2) SP": (["parallel.data=2", "parallel.pipe=1", "parallel.expert=2",
                                               "parallel.tensor=2", "parallel.sequence_parallel=true"] + _FIT_ONE, 8),
    "(pipe, expert, tensor) = (2, 2, 2) circular": (["parallel.data=1", "parallel.pipe=2", "parallel.expert=2",
                                                     "parallel.tensor=2", "parallel.repeats=2",
                                                     "parallel.microbatches=4"], 8),
    "(data, pipe, tensor) = (2, 2, 2) ZB-V": (["parallel.data=2", "parallel.pipe=2", "parallel.expert=1",
                                               "parallel.tensor=2", "parallel.repeats=2", "parallel.microbatches=4",
                                               "parallel.schedule=zbv"], 8),
}


def restore_on(workdir, config, devices: int):
    """The newest training checkpoint of `workdir` restored onto `config`'s layout (resolved for its first
    `devices` devices) → (the restored TrainState, the model state on the host as `canonical_host` gives it)."""
    from jaxpar.store import checkpoint
    from jaxpar.train import build_trainer

    config = config.resolve_for_devices(devices)
    like = build_trainer(config, jax.devices()[:devices], abstract=True)
    mngr = checkpoint.manager(workdir)
    try:
        state, _ = checkpoint.restore_train(mngr, like.state, like.shardings, like.plan, config.model.vocab_size)
    finally:
        mngr.close()
    return state, canonical_host(state.params, config, like.mesh)


def single_device(cfg, batch):
    """The reference: one device, no mesh, unpadded vocab, layers in model order → (params, loss, grads)."""
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    return params, loss, grads


def lay_out(cfg, params, plan):
    """Canonical params (one device's model) → (graphdef, params) for `plan`: vocab padded, layers in its order,
    placed by its rules (ZeRO-3 split if it asks)."""
    graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0), padded_vocab=plan.padded_vocab))
    laid_out = plan.from_canonical(params)
    return graphdef, jax.device_put(laid_out, param_shardings(laid_out, plan.mesh, plan.rules, plan.param_zero_data))


def on_layout(cfg, params, batch, parallel, *, remat: str = "none", grad_accum: int = 1, stats: bool = False,
              matmul=None, mtp_weight: float = 0.0, dpo=None):
    """The same parameters laid out for `parallel` (a ParallelConfig) on all devices — vocab padded, layers in the
    plan's order, ZeRO-3 split if asked — through `sharded_loss_and_grads` → (loss, gradients in model order), and
    with `stats` the MoE statistics summed over the step third. matmul: the plan's matmul policies (default plain);
    mtp_weight: the MTP loss's weight (a model with MTP modules); dpo: the preference loss (jaxpar.train.dpo.DPO)."""
    plan = make_plan(cfg, parallel, jax.devices(), **({} if matmul is None else {"matmul": matmul}))
    graphdef, laid_out = lay_out(cfg, params, plan)
    specs = param_specs(laid_out, plan.rules, plan.param_zero_data)
    fn = sharded_loss_and_grads(graphdef, plan, param_specs=specs, remat=remat, grad_accum=grad_accum, stats=stats,
                                mtp_weight=mtp_weight, dpo=dpo)
    loss, grads, *sums = jax.jit(fn)(laid_out, jax.device_put(batch, plan.batch_sharding))
    return (loss, plan.to_canonical(grads), *sums)


def _flat(tree) -> dict[str, np.ndarray]:
    """{"blocks/wq/0": array, ..., "embed": array} of an nnx.State or a nested dict of arrays: each layer of a
    stacked parameter (leading layer axis, under "blocks") apart."""
    if isinstance(tree, nnx.State):
        flat = {"/".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(tree)}
    else:
        flat = {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    out = {}
    for name, a in flat.items():
        out.update({f"{name}/{i}": layer for i, layer in enumerate(a)} if name.startswith(("blocks/", "dense_blocks/")) else {name: a})
    return out


def exactly_zero(cfg) -> dict[str, str]:
    """{parameter: sibling} for gradients that are zero in exact arithmetic in this model.

    GPT-2's key bias: it adds q·bk to every score of a query row alike, and softmax ignores a shift of its row, so
    dL/dbk = Σ_t q_t · Σ_s dS_ts / √E = 0 (each row of the softmax backward dS sums to zero). Both sides hold only
    rounding noise (~1e-9 against ~6e-3 for bq, whose gradient sums the same dS against k instead of q), so it has
    no scale of its own; it is checked to be zero on bq's scale, layer by layer. (With RoPE the shift differs per
    key position: a Llama qkv_bias model has a real bk gradient.)"""
    return {"blocks/bk": "blocks/bq"} if cfg.family == "gpt2" else {}


def grad_errors(got, want, zero: dict[str, str] | None = None) -> dict[str, float]:
    """Per parameter (per layer of a stacked one): max|got − want| / max|want|, its worst error on its own scale.

    zero: {parameter: sibling} for gradients that are zero in exact arithmetic (exactly_zero): the error is
    max(|got|, |want|) over the same layer of the sibling — both must be zero to within rtol of that scale."""
    got, want, zero = _flat(got), _flat(want), zero or {}
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    errors = {}
    for name, w in want.items():
        g = got[name].astype(np.float64)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        base, _, layer = name.partition("/") if not name.startswith("blocks/") else name.rpartition("/")
        if base in zero:
            sibling = want[f"{zero[base]}/{layer}" if layer else zero[base]]
            errors[name] = float(max(np.abs(g).max(), np.abs(w).max()) / np.abs(sibling).max())
            continue
        scale = np.abs(w).max()
        assert scale > 0, f"{name}: the reference gradient is all zero; check it on a sibling's scale (zero=)"
        errors[name] = float(np.abs(g - w).max() / scale)
    return errors


def assert_grads_match(got, want, rtol: float = 1e-5, zero: dict[str, str] | None = None) -> dict[str, float]:
    """Fail unless every parameter's worst error on its own scale (grad_errors) is ≤ rtol; returns the errors.
    Prints the worst per parameter name (over its layers), seen with `pytest -s` or on failure."""
    errors = grad_errors(got, want, zero)
    by_param: dict[str, float] = {}
    for name, e in errors.items():
        base = name.rpartition("/")[0] if name.startswith(("blocks/", "dense_blocks/")) else name
        by_param[base] = max(by_param.get(base, 0.0), e)
    worst = max(errors, key=errors.get)
    print(f"worst per-parameter relative error {errors[worst]:.2e} ({worst}); "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(by_param.items())))
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= rtol}
    assert not bad, f"relative to each parameter's max |reference gradient|, above rtol {rtol}: {bad}"
    return errors
