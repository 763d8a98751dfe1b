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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Einsum:
    """The plain policy: the stored weight (float32 master, or whatever `param_dtype` is) is cast to the activation's
    dtype — the compute dtype, bf16 on GPUs — and contracted with float32 accumulation."""

    def __call__(self, equation: str, x: Array, w: Array) -> Array:
        """einsum(equation, x, w) → float32. x is already in the compute dtype; w as stored."""
        return jnp.einsum(equation, x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    def table(self, w: Array, dtype) -> Array:
        """A weight read by rows (the embedding lookup) in the compute dtype `dtype`."""
        return w.astype(dtype)


PLAIN = Einsum()
