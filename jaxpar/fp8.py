"""FP8 matmuls as a policy of the matmul seam (jaxpar.matmul): `model.matmul = "fp8_rowwise"`.

Each of a block's matmuls y = x·W (attention, MLP, the experts' grouped matmuls; the router, embedding and head stay
in float) runs its three products as torchtitan's "rowwise with high-precision weight gradient" recipe does:

    forward     y  = Q₄(x) · Q₄(W)        x: one scale per token (row) over its contracted dims;
                                          W: one scale per output channel over the contracted dims
    input grad  dx = Q₅(dy) · Q₄(W)ᵀ      dy: one scale per token over the output dims (e5m2, the wider range
                                          gradients need); W: one scale per input channel over the output dims
    weight grad dW = xᵀ · dy              in the compute dtype (the product that sums over every token of the
                                          step: see below)

Q₄ / Q₅ quantize to float8 e4m3 (max 448) / e5m2 (max 57344) at scale = amax / max of their group, and the
products accumulate in float32. The code is the quantize–dequantize form: a value is rounded to float8 and
multiplied back by its scale before a plain einsum, which is the pattern XLA's GPU compiler rewrites into FP8 GEMMs
(on CPU the same numbers, emulated).

Why rowwise scales, and why the weight gradient stays high: a scale is a function of its group's amax, and a group
here never spans two tokens — so the quantized values of a token are the same whatever the layout cuts around it
(data shards, pipeline microbatches, accumulation chunks, context ranks, collective matmul's ring chunks). Only
tensor parallelism splits a group, by splitting the dims it spans: a row-parallel weight's input dims (so x's and
W's forward amaxes are reduced over `tensor`), a column-parallel weight's output dims (dy's and W's input-grad
amaxes). `Einsum.along` tells the policy which, and it takes a `pmax` over that axis: the same amax, so the same
numbers, as one device. One more split: a kv head several tensor ranks share (n_kv_heads < tensor) gets each
rank's part of its output gradient, and quantizing parts is not quantizing their sum — `whole_output_grad` asks the
context to sum them before the matmul (`Parallel.kv_output`). A scale spanning tokens — a tensorwise activation scale, or the weight gradient's
contraction over all tokens — would need every token of the step before the first microbatch's matmul; that is
delayed scaling's job (an amax history as model state), not a current-scaling recipe's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxpar.matmul import Adapted, Einsum, lora_equations, token_einsum

Array = jax.Array

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}  # the largest finite value of each format


def qdq(v: Array, amax: Array, fmt, dtype) -> Array:
    """v rounded to float8 `fmt` at scale = amax / max(fmt) (amax broadcastable to v: one per group; an all-zero
    group gets scale 1), dequantized to `dtype`: Q(v)·scale."""
    top = MAX[fmt]
    # amax / top underflows for an amax below top·2⁻¹²⁶ (tiny output gradients: the rows an outlier feature's norm
    # shrinks), and x / 0 is Inf or NaN: the scale never goes below float32's smallest normal, where every |v| ≤ amax
    # still fits (|v| / tiny ≤ top)
    scale = jnp.where(amax > 0, jnp.maximum(amax / top, jnp.finfo(jnp.float32).tiny), 1.0).astype(jnp.float32)
    q = jnp.clip(v.astype(jnp.float32) / scale, -top, top).astype(fmt)
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _amax(v: Array, axes: tuple[int, ...], split: str | None) -> Array:
    """max |v| over `axes` (kept as size-1 dims), and over mesh axis `split` when those dims are split over it."""
    amax = jnp.abs(v.astype(jnp.float32)).max(axis=axes, keepdims=True) if axes else jnp.abs(v.astype(jnp.float32))
    return amax if split is None else jax.lax.pmax(amax, split)


@functools.lru_cache(maxsize=None)
def _dims(equation: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """For einsum(equation, x, w) = y: (x's contracted axes, w's contracted axes, w's output axes, y's axes that
    are w's output dims)."""
    inputs, out = equation.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    return (tuple(i for i, c in enumerate(xs) if c in ws), tuple(i for i, c in enumerate(ws) if c in xs),
            tuple(i for i, c in enumerate(ws) if c not in xs), tuple(i for i, c in enumerate(out) if c in ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def fp8_einsum(equation: str, x: Array, w: Array, x_amax: Array | None, split_in: str | None,
               split_out: str | None) -> Array:
    """einsum(equation, x, w) → float32 by the rowwise FP8 recipe (module docstring). x [tokens…, in…] in the
    compute dtype, w [in…, out…] prepared (`Einsum.operand`); x_amax: x's per-token amaxes if taken from a whole
    tensor x is a chunk of (collective matmul's ring), else None (taken here); split_in / split_out: the mesh axis
    splitting w's input / output dims (tensor parallelism), or None."""
    x_in, w_in, _, _ = _dims(equation)
    xq = qdq(x, _amax(x, x_in, split_in) if x_amax is None else x_amax, E4M3, x.dtype)
    wq = qdq(w, _amax(w, w_in, split_in), E4M3, x.dtype)
    return token_einsum(equation, xq, wq)


def _einsum_fwd(equation, x, w, x_amax, split_in, split_out):
    return fp8_einsum(equation, x, w, x_amax, split_in, split_out), (x, w, x_amax)


def input_grad(equation: str, dy: Array, w: Array, x: Array, split_out: str | None,
               dy_amax: Array | None = None) -> Array:
    """The FP8 input gradient Q₅(dy)·Q₄(W)ᵀ of `fp8_einsum` (float32): dy per token (its amaxes `dy_amax` when
    taken from a whole tensor dy is a chunk of), W per input channel; x: any array of the input's shape."""
    _, _, w_out, y_out = _dims(equation)
    dyq = qdq(dy, _amax(dy, y_out, split_out) if dy_amax is None else dy_amax, E5M2, x.dtype)
    wq = qdq(w, _amax(w, w_out, split_out), E4M3, x.dtype)
    _, vjp = jax.vjp(lambda x_: token_einsum(equation, x_, wq), x)
    return vjp(dyq.astype(jnp.float32))[0]


def _einsum_bwd(equation, split_in, split_out, residuals, dy):
    x, w, x_amax = residuals
    _, weight_grad = jax.vjp(lambda w_: token_einsum(equation, x, w_), w)
    dx, (dw,) = input_grad(equation, dy, w, x, split_out), weight_grad(dy)
    return dx.astype(x.dtype), dw.astype(w.dtype), None if x_amax is None else jnp.zeros_like(x_amax)


fp8_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def _ragged(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_ragged(x: Array, w: Array, group_sizes: Array, split_in: str | None, split_out: str | None) -> Array:
    """The experts' grouped matmul (`Einsum.ragged`: rows x [M, K] sorted by expert, w [G, K, N]) by the rowwise
    recipe: a scale per row of x, per (expert, output channel) of w; backward as `fp8_einsum`'s."""
    xq = qdq(x, _amax(x, (1,), split_in), E4M3, x.dtype)
    wq = qdq(w, _amax(w, (1,), split_in), E4M3, x.dtype)
    return _ragged(xq, wq, group_sizes)


def _ragged_fwd(x, w, group_sizes, split_in, split_out):
    return fp8_ragged(x, w, group_sizes, split_in, split_out), (x, w, group_sizes)


def _ragged_bwd(split_in, split_out, residuals, dy):
    x, w, group_sizes = residuals
    dyq = qdq(dy, _amax(dy, (1,), split_out), E5M2, x.dtype)
    wq = qdq(w, _amax(w, (2,), split_out), E4M3, x.dtype)
    _, input_grad = jax.vjp(lambda x_: _ragged(x_, wq, group_sizes), x)
    _, weight_grad = jax.vjp(lambda w_: _ragged(x, w_, group_sizes), w)
    (dx,), (dw,) = input_grad(dyq.astype(jnp.float32)), weight_grad(dy)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


fp8_ragged.defvjp(_ragged_fwd, _ragged_bwd)


@dataclasses.dataclass(frozen=True)
class Fp8Rowwise(Einsum):
    """The rowwise FP8 policy (module docstring); split_in / split_out: set by `along` where tensor parallelism
    contracts a split weight."""

    split_in: str | None = None
    split_out: str | None = None
    whole_output_grad = True  # dy quantized per token over the whole output (`Parallel.kv_output`)

    def along(self, inputs: str | None = None, outputs: str | None = None) -> "Fp8Rowwise":
        """This policy with its amaxes over a weight's input / output dims reduced over those mesh axes."""
        return dataclasses.replace(self, split_in=inputs, split_out=outputs)

    def product(self, equation: str, x: Array, w: Array, x_scale: Array | None = None) -> Array:
        """`fp8_einsum` of x and one prepared weight (x_scale: x's per-token amaxes, taken from the whole tensor)."""
        return fp8_einsum(equation, x, w, x_scale, self.split_in, self.split_out)

    def scales(self, equation: str, v: Array, side: str) -> Array:
        """The per-token amaxes of a whole input x (side "input") or output gradient dy ("output"), reduced over
        the mesh axis that splits the dims they span."""
        x_in, _, _, y_out = _dims(equation)
        return _amax(v, x_in, self.split_in) if side == "input" else _amax(v, y_out, self.split_out)

    def input_grad(self, equation: str, dy: Array, w: Array, x: Array, dy_scale: Array | None = None) -> Array:
        """`input_grad` of the FP8 product (an adapted weight's adapters by the plain rule)."""
        if isinstance(w, Adapted):
            down, up = lora_equations(equation)
            _, vjp = jax.vjp(lambda x_: w.scale * token_einsum(up, token_einsum(down, x_, w.a).astype(x.dtype), w.b),
                             x)
            return input_grad(equation, dy, w.base, x, self.split_out, dy_scale) + vjp(dy)[0]
        return input_grad(equation, dy, w, x, self.split_out, dy_scale)

    def ragged(self, x: Array, w: Array, group_sizes: Array) -> Array:
        """`fp8_ragged`: the experts' grouped matmul."""
        return fp8_ragged(x, self.operand(w, x.dtype), group_sizes, self.split_in, self.split_out)


RECIPES = {"fp8_rowwise": Fp8Rowwise()}  # model.matmul → the policy of the block's matmuls
