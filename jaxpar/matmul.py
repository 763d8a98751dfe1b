"""The matmul seam: every use of a weight matrix in the model goes through one small policy object.

The model never writes `x @ w.astype(dtype)` itself. It hands the stored parameter to the parallel context
(`par.column`, `par.row`, `par.embed`), and the context hands it to its `Einsum` at the one place the contraction
happens. That is the seam the weight formats plug into, the way gemma's `Einsum` module and torchtitan's float8
converters do it:

    plain (this file)      stored float weight → cast to the activation's dtype → einsum, float32 accumulation
    int8 / fp8 (later)     stored (q, scale) pair → dequantize or a scaled low-precision dot, float32 accumulation
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


@dataclasses.dataclass(frozen=True)
class Einsum:
    """The plain policy: the stored weight (float32 master, or whatever `param_dtype` is) is cast to the activation's
    dtype — the compute dtype, bf16 on GPUs — and contracted with float32 accumulation."""

    def __call__(self, equation: str, x: Array, w: Array) -> Array:
        """einsum(equation, x, w) → float32. x is already in the compute dtype; w as stored (or as `operand`
        made it: applying that again changes nothing)."""
        return token_einsum(equation, x, self.operand(w, x.dtype))

    def operand(self, w: Array, dtype) -> Array:
        """The stored weight as the contraction reads it, for activations in `dtype`. (The pipeline executor
        prepares a chunk's weights with it once a tick, so what its backward closes over is one copy.)"""
        return w.astype(dtype)

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
