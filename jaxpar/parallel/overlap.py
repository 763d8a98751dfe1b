"""Collective matmul (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models" — the technique behind PaLM's and MaxText's overlapped tensor parallelism), for sequence
parallelism over the mesh axis `tensor` (`parallel.overlap = collective_matmul`).

Under sequence parallelism (jaxpar.parallel.sequence) a column-parallel group starts with an all-gather of the
sequence shards and a row-parallel matmul ends with a reduce-scatter onto them; each collective must finish before
its matmul starts (or start after it ends), so the wire and the matmul units take turns. Decomposed, the sequence is
t chunks (rank r holds chunk r between regions) and each collective becomes t − 1 ring steps (`ppermute`), each
independent of the partial matmul running beside it:

    all-gather → matmuls   Y = gather(h)·W          step i = 0 … t−1: rank r holds chunk (r + i) mod t, computes
      (`gather_matmuls`)                            its rows of every Y, and passes the chunk on to rank r − 1
                                                    (receiving chunk r + i + 1 from rank r + 1)
    matmul → reduce-scatter   Z_r = Σ_q (x_q·W_q) restricted to chunk r
      (`matmul_scatter`)                            step i: rank q adds its partial of chunk (q − 1 − i) mod t to the
                                                    sum it received from rank q − 1 and passes it to q + 1; after
                                                    t − 1 passes rank r holds chunk r's total

The bytes are the plain collectives': t − 1 chunks [B, T/t, ·] a device, what a ring all-gather or reduce-scatter
sends. Whether the steps overlap is the scheduler's business (XLA's async collective-permutes on GPU and TPU); the
arithmetic is the plain path's, chunk by chunk, so values and gradients agree with it to rounding.

Backward (custom_vjp, the same decomposition):
    gather_matmuls   dW_k = Σ_c h_cᵀ·dY_k,c with h re-gathered chunk by chunk as it passes (Korthikanti et al.'s
                     re-gather: only the shard is saved), and dh = reduce-scatter(Σ_k dY_k·W_kᵀ) as a ring of sums
                     — two rings in one loop, the bytes of the plain backward's all-gather and reduce-scatter.
    matmul_scatter   dZ gathered chunk by chunk: dx_c = dZ_c·Wᵀ and dW = Σ_c x_cᵀ·dZ_c.

The weights reach the ring through the matmul policy `dot` (jaxpar.matmul.Einsum) in two steps, and the ring only
runs the second: `dot.operand` prepares each stored weight once, before the loop (and its vjp runs once, on the
chunks' summed gradient, accumulated in float32 and rounded once as the plain backward's single product is);
every chunk is `dot.contract` of its rows with the prepared operands, and the input gradient is the vjp of that
contraction at one primal of the input's shape (it is linear in its input). So the ring contracts exactly what the
plain path contracts — whatever the operand does to the weight (dequantize, quantize-dequantize at a scale taken
from the weight or given as state) — and never prepares it per chunk.

All shapes [B, T, …] with the sequence on dim 1 (inputs and outputs of every equation the model passes here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array
SEQ = 1  # the sequence dim of [B, T, ...] activations


def _pass_down(x: Array, axis: str, t: int) -> Array:
    """Every rank sends x to rank r − 1 (and receives rank r + 1's)."""
    return jax.lax.ppermute(x, axis, [(r, (r - 1) % t) for r in range(t)])


def _pass_up(x: Array, axis: str, t: int) -> Array:
    """Every rank sends x to rank r + 1 (and receives rank r − 1's)."""
    return jax.lax.ppermute(x, axis, [(r, (r + 1) % t) for r in range(t)])


def _chunk(x: Array, c: Array, n: int) -> Array:
    """Sequence chunk c (traced) of x [B, t·n, …] → [B, n, …]."""
    return jax.lax.dynamic_slice_in_dim(x, c * n, n, axis=SEQ)


def _in_chunk_order(pieces: list[Array], r: Array) -> Array:
    """pieces[i] [B, n, …]: chunk (r + i) mod t → the whole sequence [B, t·n, …] in chunk order."""
    t = len(pieces)
    stacked = jnp.stack(pieces)  # [t, B, n, …], step order
    ordered = stacked[(jnp.arange(t) - r) % t]  # position c holds step (c − r) mod t, i.e. chunk c
    ordered = jnp.moveaxis(ordered, 0, SEQ)  # [B, t, n, …]
    return ordered.reshape(ordered.shape[0], t * ordered.shape[2], *ordered.shape[3:])


def _prepare(weights, dot, dtype):
    """The stored weights as the policy's contraction reads them (once, outside the ring)."""
    return tuple(dot.operand(w, dtype) for w in weights)


def _contract(h, operands, equations, dot):
    return [dot.contract(eq, h, w) for eq, w in zip(equations, operands)]


def _accumulate(total, grads):
    """total + grads, leaf by leaf, in float32 (the chunks' weight gradients; None: nothing yet)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads if total is None else jax.tree.map(jnp.add, total, grads)


def _as(grads, operands):
    """Accumulated gradients in their operands' dtypes (the one rounding of the plain path's product)."""
    return jax.tree.map(lambda g, w: g.astype(w.dtype), grads, operands)


# ---------------------------------------------------------------------------------------------------------------------
# all-gather → column-parallel matmuls


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_matmuls(h: Array, weights: tuple[Array, ...], equations: tuple[str, ...], axis: str, dot) -> list[Array]:
    """`jaxpar.parallel.sequence.gather_matmuls` decomposed: h [B, T/t, D] (this rank's sequence shard) → the
    float32 outputs `dot(eq_i, gather(h), w_i)` over the whole sequence, with the gather as t − 1 ring steps
    beside the chunks' matmuls."""
    return _gather_matmuls(h, weights, equations, axis, dot)


def _gather_matmuls(h, weights, equations, axis, dot):
    t, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    operands = _prepare(weights, dot, h.dtype)
    steps, chunk = [], h
    for i in range(t):
        steps.append(_contract(chunk, operands, equations, dot))  # the rows of chunk (r + i) mod t
        if i < t - 1:
            chunk = _pass_down(chunk, axis, t)
    return [_in_chunk_order([s[k] for s in steps], r) for k in range(len(weights))]


def _gm_fwd(h, weights, equations, axis, dot):
    return _gather_matmuls(h, weights, equations, axis, dot), (h, weights)


def _gm_bwd(equations, axis, dot, residuals, dys):
    h, weights = residuals
    t, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    n = h.shape[SEQ]
    operands, d_prepare = jax.vjp(lambda ws: _prepare(ws, dot, h.dtype), weights)  # once, outside the ring
    # a scaled policy's per-token scales of each whole output gradient, taken before the ring cuts it (FP8's)
    scales = [dot.scales(eq, dy, "output") for eq, dy in zip(equations, dys)]

    def d_input(c):  # Σ over the weights of the input gradient of output-gradient chunk c (at any primal: h)
        return sum(dot.input_grad(eq, _chunk(dy, c, n), w, h, None if s is None else _chunk(s, c, n))
                   for eq, dy, w, s in zip(equations, dys, operands, scales))

    d_ops, acc, chunk = None, None, h
    for i in range(t):
        # ring 1: the input chunk (r + i) mod t, for the weights' gradient
        c = (r + i) % t
        _, d_operands = jax.vjp(lambda ops, x=chunk: _contract(x, ops, equations, dot), operands)
        d_ops = _accumulate(d_ops, d_operands([_chunk(dy, c, n) for dy in dys])[0])
        # ring 2: the input gradient's partial sums, chunk (r − 1 − i) mod t, passed up and summed on the way
        partial = d_input((r - 1 - i) % t)
        acc = partial if acc is None else _pass_up(acc, axis, t) + partial
        if i < t - 1:
            chunk = _pass_down(chunk, axis, t)
    (dws,) = d_prepare(_as(d_ops, operands))
    return acc, dws


gather_matmuls.defvjp(_gm_fwd, _gm_bwd)


# ---------------------------------------------------------------------------------------------------------------------
# row-parallel matmul → reduce-scatter


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_scatter(x: Array, w: Array, equation: str, axis: str, dot) -> Array:
    """A row-parallel matmul and the reduce-scatter after it, decomposed: x [B, T, F/t] (local columns, the whole
    sequence) · w [F/t, D] → this rank's summed sequence shard [B, T/t, D] in x's dtype (the partial sums travel and
    add in the compute dtype, as the plain reduce-scatter's do)."""
    return _matmul_scatter(x, w, equation, axis, dot)


def _matmul_scatter(x, w, equation, axis, dot):
    t, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    n = x.shape[SEQ] // t
    (operand,) = _prepare((w,), dot, x.dtype)
    scale = dot.scales(equation, x, "input")  # a scaled policy's per-token scales of the whole x (FP8's)
    acc = None
    for i in range(t):
        c = (r - 1 - i) % t
        partial = dot.contract(equation, _chunk(x, c, n), operand, None if scale is None else _chunk(scale, c, n))
        partial = partial.astype(x.dtype)
        acc = partial if acc is None else _pass_up(acc, axis, t) + partial
    return acc


def _ms_fwd(x, w, equation, axis, dot):
    return _matmul_scatter(x, w, equation, axis, dot), (x, w)


def _ms_bwd(equation, axis, dot, residuals, dz):
    x, w = residuals
    t, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    n = x.shape[SEQ] // t
    (operand,), d_prepare = jax.vjp(lambda w_: _prepare((w_,), dot, x.dtype), w)  # once, outside the ring

    def partial(x_c, operand):
        return dot.contract(equation, x_c, operand).astype(x.dtype)

    x_like = _chunk(x, r, n)  # the input gradient does not depend on the input: any primal of a chunk's shape
    dxs, d_op, chunk = [], None, dz
    for i in range(t):
        c = (r + i) % t  # the output gradient of chunk c, gathered as it passes
        dx_c = dot.input_grad(equation, chunk.astype(jnp.float32), operand, x_like).astype(x.dtype)
        dxs.append(dx_c)
        _, d_operand = jax.vjp(lambda op, x_c=_chunk(x, c, n): partial(x_c, op), operand)
        d_op = _accumulate(d_op, d_operand(chunk)[0])
        if i < t - 1:
            chunk = _pass_down(chunk, axis, t)
    (dw,) = d_prepare((_as(d_op, operand),))
    return _in_chunk_order(dxs, r), dw


matmul_scatter.defvjp(_ms_fwd, _ms_bwd)
