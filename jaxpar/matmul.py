"""The matmul seam: every use of a weight matrix in the model goes through one small policy object.

The model never writes `x @ w.astype(dtype)` itself. It hands the stored parameter to the parallel context
(`par.column`, `par.row`, `par.embed`), and the context hands it to its `Einsum` at the one place the contraction
happens. That is the seam the weight formats plug into, the way gemma's `Einsum` module and torchtitan's float8
converters do it:

    plain (this file)      stored float weight → cast to the activation's dtype → einsum, float32 accumulation
    int8 / int4 (this file) stored `Quantized(q, scale)` → dequantized to the activation's dtype → the same einsum
    fp8 (later)            a scaled low-precision dot, float32 accumulation
    LoRA (later)           x·W + (x·A)·B, with W frozen

Tensor parallelism wraps the policy rather than replacing it: a column-parallel group applies its entry collective
(f or the sequence all-gather) and then this policy per weight; a row-parallel matmul applies this policy and then
its exit collective. So a new weight format is one new policy class and touches neither the model nor the
collectives.

The policy must be hashable (a frozen dataclass): the sequence-parallel matmul group is a `custom_vjp` that takes it
as a static argument.

Token dimensions are flattened before the contraction. The model's activations are [B, T, ...]; contracted as they
are, the weight gradient of `btd,df->btf` contracts two dimensions (b and t), and XLA's CPU compiler lays that dot
out by physically transposing the [B, T, F] gradient inside a loop fusion, at a cache miss per element — on the tiny
model those transposes were a quarter of the whole single-device step. Contracting tokens as one dimension N = B·T
(a free reshape of the leading, row-major dimensions) gives every dot one contracting dimension and no transpose, on
every backend; the products and sums are the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quantized:
    """A weight matrix stored as integers with float32 scales (weight-only quantization, symmetric):

        W ≈ q · scale,  q int8 in [-127, 127] or int4 in [-7, 7]

    scale has q's rank: each dim of q of size d is split into scale's n groups of d/n consecutive entries (n = d:
    every entry its own, an output channel; n = 1: one group across the dim, a contracted dim of int8's per-channel
    scale). `families.base.Param.scale` gives the shape from the matrix's contracted dims; nothing here needs them.

    A pytree of two arrays: the layer scan slices both, shard_map gives each rank its share of both (the scale's
    logical axes follow its weight's), and `Einsum.operand` dequantizes at the one place the contraction reads it.
    Layer parameters arrive in this form from `model.Blocks.stacked` (`name` and `name_scale`)."""

    q: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype) -> Array:
        """q · scale in `dtype` (the product in float32, then rounded once)."""
        w = self.q.astype(jnp.float32).reshape(_split(self.q.shape, self.scale.shape))
        w = w * self.scale.astype(jnp.float32).reshape([x for n in self.scale.shape for x in (n, 1)])
        return w.reshape(self.q.shape).astype(dtype)


QUANT_DTYPES = {"int8": (jnp.int8, 127), "int4": (jnp.int4, 7)}  # format → (storage dtype, largest |q|)


def _split(shape, groups) -> list[int]:
    """Each dim d of `shape` as (n, d/n) for its n groups."""
    return [x for d, n in zip(shape, groups) for x in (n, d // n)]


def quantize(w: Array, scale_shape: tuple[int, ...], fmt: str) -> Quantized:
    """Round w to `fmt` ('int8' / 'int4') with one symmetric scale per group of `scale_shape` (`Quantized`):
    scale = max |w| over the group / qmax (1 for an all-zero group), q = round(w / scale)."""
    dtype, qmax = QUANT_DTYPES[fmt]
    x = w.astype(jnp.float32).reshape(_split(w.shape, scale_shape))
    amax = jnp.abs(x).max(axis=tuple(range(1, x.ndim, 2)), keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = jnp.clip(jnp.round(x / scale), -qmax, qmax).astype(dtype).reshape(w.shape)
    return Quantized(q, scale.reshape(scale_shape))


@dataclasses.dataclass(frozen=True)
class Einsum:
    """The plain policy: the stored weight (float32 master, or whatever `param_dtype` is) is cast to the activation's
    dtype — the compute dtype, bf16 on GPUs — and contracted with float32 accumulation."""

    def __call__(self, equation: str, x: Array, w: Array) -> Array:
        """einsum(equation, x, w) → float32. x is already in the compute dtype; w as stored (or as `operand`
        made it: applying that again changes nothing)."""
        return token_einsum(equation, x, self.operand(w, x.dtype))

    def operand(self, w: Array, dtype) -> Array:
        """The stored weight as the contraction reads it, for activations in `dtype` (a `Quantized` one
        dequantized). (The pipeline executor prepares a chunk's weights with it once a tick, so what its backward
        closes over is one copy.)"""
        return w.dequantize(dtype) if isinstance(w, Quantized) else w.astype(dtype)

    def ragged(self, x: Array, w: Array, group_sizes: Array) -> Array:
        """Grouped matmul (the experts of an MoE layer): rows x [M, K] sorted by group, w [G, K, N], group_sizes
        [G] → float32 [M, N], row i times w[its group]; rows past Σ group_sizes give zeros."""
        return jax.lax.ragged_dot(x, self.operand(w, x.dtype), group_sizes, preferred_element_type=jnp.float32)

    def table(self, w: Array, dtype) -> Array:
        """A weight read by rows (the embedding lookup) in the compute dtype `dtype`."""
        return w.astype(dtype)


PLAIN = Einsum()


@functools.lru_cache(maxsize=None)
def _flattened(equation: str) -> tuple[int, str]:
    """(k, equation') where x's first k letters are token dimensions — absent from the weight and leading the
    output in the same order — and equation' contracts them as one (k < 2: nothing to flatten, equation unchanged)."""
    inputs, out = equation.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    k = 0
    while k < len(xs) and xs[k] not in ws and out[k : k + 1] == xs[k]:
        k += 1
    if k < 2:
        return 0, equation
    n = next(c for c in "NMLKJ" if c not in equation)
    return k, f"{n}{xs[k:]},{ws}->{n}{out[k:]}"


def token_einsum(equation: str, x: Array, w: Array) -> Array:
    """einsum(equation, x, w) with float32 accumulation, the leading token dimensions of x (e.g. b, t) contracted
    as one (see the module docstring for why)."""
    k, flat = _flattened(equation)
    if not k:
        return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    y = jnp.einsum(flat, x.reshape(-1, *x.shape[k:]), w, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:k], *y.shape[1:])
