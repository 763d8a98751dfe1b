"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") over the mesh axis `tensor`.

Outside the tensor-parallel regions (norms, residual adds, dropout) every rank holds a slice of the sequence,
activations [B, T/t, D] instead of replicated [B, T, D]. The region boundaries of `jaxpar.parallel.tensor` change:

    enter:  f (identity / all-reduce)  →  ḡ = all-gather on T forward,   reduce-scatter on T backward
    exit:   g (all-reduce / identity)  →  g̅ = reduce-scatter on T forward, all-gather on T backward

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire per boundary are unchanged
(ring: 2(t−1)/t·N for the all-reduce, (t−1)/t·N for each half) while every activation outside the regions shrinks by t.

One more detail from the paper (§4.2.2): the column-parallel matmul needs its *gathered* input again in the backward
pass (for dW = Xᵀ·dY). Saving it would keep a full [B, T, D] per matmul group alive and undo the saving, so
`gather_matmuls` keeps only the local shard and all-gathers it again in the backward pass — one extra all-gather per
column-parallel group, i.e. two per layer (attention and MLP), on top of the f/g-equivalent traffic.
"""

from __future__ import annotations

import functools

import jax

Array = jax.Array
SEQ = 1  # the sequence dim of [B, T, ...] activations


def _gather(x: Array, axis: str) -> Array:
    return jax.lax.all_gather(x, axis, axis=SEQ, tiled=True)


def _scatter(x: Array, axis: str) -> Array:
    return jax.lax.psum_scatter(x, axis, scatter_dimension=SEQ, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_scatter_seq(x: Array, axis: str) -> Array:
    """Exit of a region: partial sums [B, T, D] → this rank's summed sequence shard [B, T/t, D]."""
    return _scatter(x, axis)


def _rs_fwd(x, axis):
    return _scatter(x, axis), None


def _rs_bwd(axis, _, dy):
    return (_gather(dy, axis),)


reduce_scatter_seq.defvjp(_rs_fwd, _rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_matmuls(h: Array, weights: tuple[Array, ...], equations: tuple[str, ...], axis: str, dot) -> list[Array]:
    """Entry of a region fused with its column-parallel matmuls: all-gather h [B, T/t, D] on the sequence, then
    `dot(eq_i, h_full, w_i)` for each weight (`dot`: the matmul policy of jaxpar.matmul). Saves only the shard h;
    the backward gathers it again, computes dW_i and dh_full = Σ_i dY_i·W_iᵀ, and reduce-scatters dh_full back to
    sequence shards."""
    return _matmuls(_gather(h, axis), weights, equations, dot)


def _matmuls(h_full, weights, equations, dot):
    return [dot(eq, h_full, w) for eq, w in zip(equations, weights)]


def _gm_fwd(h, weights, equations, axis, dot):
    return gather_matmuls(h, weights, equations, axis, dot), (h, weights)


def _gm_bwd(equations, axis, dot, residuals, dys):
    h, weights = residuals
    h_full = _gather(h, axis)  # the re-gather of §4.2.2
    _, vjp = jax.vjp(lambda x, ws: _matmuls(x, ws, equations, dot), h_full, weights)
    dh_full, dws = vjp(list(dys))
    return _scatter(dh_full, axis), dws


gather_matmuls.defvjp(_gm_fwd, _gm_bwd)


def local_gather(x: Array, axis: str) -> Array:
    """The whole sequence from every rank's shard [B, T/t, …] → [B, T, …]: an all-gather on T, whose gradient (the
    autodiff transpose) reduce-scatters — for inputs a caller contracts itself (the MoE layer's tokens, its
    routing)."""
    return _gather(x, axis)


def local_seq(x: Array, axis: str) -> Array:
    """This rank's sequence shard of a replicated full-sequence array [B, T, …] → [B, T/t, …] (no communication)."""
    n = x.shape[SEQ] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * n, n, axis=SEQ)
