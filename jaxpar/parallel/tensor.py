"""Megatron tensor parallelism (Shoeybi et al. 2019) as explicit collectives over the mesh axis `tensor`.

Every collective of a tensor-parallel layer is one of two operators from the paper, written here once:

    f  (`copy_to_tensor`):     forward identity,   backward all-reduce   — where a replicated activation enters a
                                                                            tensor-parallel region
    g  (`reduce_from_tensor`): forward all-reduce, backward identity     — where partial sums leave it

A transformer MLP is the canonical picture (t = tensor degree, A column-split, B row-split):

    X ──f──► [X·A_1 | … | X·A_t] ──GeLU/SwiGLU──► [Y_1 | … | Y_t] ──► Σ_i Y_i·B_i ──g──► Z
             column-parallel (no comm)              local              row-parallel

Attention is the same with heads as the split: QKV column-parallel by heads, each rank attends with its local
heads, the output projection row-parallel. The embedding is split by vocab rows (a lookup of local rows plus g) and
the LM head by vocab columns; the cross-entropy then reduces three per-token scalars (max, sum of exps, target logit)
across `tensor`, so full-vocab logits are never gathered.

`TensorParallel` implements the model's tensor-parallel boundaries for `jaxpar.parallel.context.Parallel`, the one
object the model talks to (the model calls `par.column`, `par.row`, `par.embed`, … and never names a mesh axis;
without a TensorParallel those are the plain single-device computation). Sequence parallelism (`sequence=True`,
Korthikanti et al. 2022) swaps f/g for the all-gather / reduce-scatter pair of `jaxpar.parallel.sequence`.

All functions here run inside `jax.shard_map` (manual axes) on *local* shards; their gradients are written out with
`custom_vjp` so no collective is left for autodiff to infer. The shard_maps run with `check_vma=True`: JAX tracks
which mesh axes each value varies over, so a missing psum (a partial sum leaving the step as if it were whole) is a
trace-time error. The custom rules therefore state those types too: f's output varies over `tensor` (each rank's
branch differs from there on), g's cotangent is re-marked as varying (`jaxpar.parallel.vma.vary`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxpar.matmul import Adapted, Einsum, token_einsum
from jaxpar.parallel import overlap, sequence as seq
from jaxpar.parallel.vma import vary

Array = jax.Array
NEG_INF = -1e30  # finite "minus infinity": exp() underflows to 0 without inf - inf = nan anywhere


# ---------------------------------------------------------------------------------------------------------------------
# The two operators of the paper.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tensor(x: Array, axis: str) -> Array:
    """f: identity forward; all-reduce of the gradient backward (each rank's branch contributed part of dL/dx)."""
    return vary(x, axis)


def _copy_fwd(x, axis):
    return vary(x, axis), None


def _copy_bwd(axis, _, dy):
    return (jax.lax.psum(dy, axis),)


copy_to_tensor.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tensor(x: Array, axis: str) -> Array:
    """g: all-reduce forward (sum the ranks' partial results); identity backward (the sum's gradient is replicated)."""
    return jax.lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return jax.lax.psum(x, axis), None


def _reduce_bwd(axis, _, dy):
    return (vary(dy, axis),)  # the same cotangent on every rank, typed as the varying partial sums it belongs to


reduce_from_tensor.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def shared_head(y: Array, axis: str, replicas: int) -> Array:
    """The output y [..., 1, E] of a kv head that `replicas` consecutive ranks of `axis` share (GQA with fewer kv heads
    than ranks: `TensorParallel.kv_weight`): identity forward; backward, each rank gets the head's *whole* output
    gradient — the sum of every sharing rank's part — divided by `replicas`. The matmul before it then sees the
    gradient one device's matmul sees (scaled by a power of two where replicas is one, which a scaled format's
    quantization commutes with), and its input and weight gradients, summed over the sharing ranks as before, are
    unchanged in value. For a policy that quantizes the output gradient (FP8: its scale spans the whole head)."""
    return y


def _shared_fwd(y, axis, replicas):
    return y, None


def _shared_bwd(axis, replicas, _, dy):
    heads = jax.lax.axis_size(axis) // replicas
    head = jax.lax.axis_index(axis) // replicas
    # every head's summed gradient on every rank: each rank adds its part into its head's slot [..., K, E]
    whole = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((*dy.shape[:-2], heads, dy.shape[-1]), dy.dtype), dy, head, axis=dy.ndim - 2), axis)
    return (vary(jax.lax.dynamic_slice_in_dim(whole, head, 1, axis=dy.ndim - 2) / replicas, axis),)


shared_head.defvjp(_shared_fwd, _shared_bwd)


# ---------------------------------------------------------------------------------------------------------------------
# Vocab-parallel embedding and cross-entropy.


def vocab_parallel_lookup(table: Array, tokens: Array, axis: str) -> Array:
    """Partial embedding sums: rows of `table` [V/t, D] that this rank owns, zeros elsewhere. → [B, T, D].

    Rank r owns ids [r·V/t, (r+1)·V/t); summing over ranks (g, or a reduce-scatter under SP) gives the lookup.
    """
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    return jnp.where(mine[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)


def vocab_parallel_cross_entropy(logits: Array, targets: Array, axis: str | None) -> Array:
    """Per-token cross-entropy [B, T] from this rank's logits [B, T, V/t] (float32); padded columns must already hold
    NEG_INF. Only per-token scalars cross ranks:

        m = max_r max_v z          (pmax; no gradient flows through it: it cancels in lse)
        lse = m + log Σ_r Σ_v exp(z − m)        (g over the per-rank sums)
        z_target = Σ_r [target ∈ rank r] · z[target − r·V/t]   (g)
        loss = lse − z_target
    """
    logits = logits.astype(jnp.float32)
    cols = logits.shape[-1]
    start = 0 if axis is None else jax.lax.axis_index(axis) * cols
    local = targets - start
    mine = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, cols - 1)[..., None], axis=-1)[..., 0]
    target_logit = jnp.where(mine, picked, 0.0)
    m = jax.lax.stop_gradient(logits.max(-1))
    if axis is not None:
        m = jax.lax.pmax(m, axis)
    sum_exp = jnp.exp(logits - m[..., None]).sum(-1)
    if axis is not None:
        sum_exp, target_logit = reduce_from_tensor(sum_exp, axis), reduce_from_tensor(target_logit, axis)
    return m + jnp.log(sum_exp) - target_logit


# ---------------------------------------------------------------------------------------------------------------------
# The tensor-parallel implementation of the model's boundaries (jaxpar.parallel.context.Parallel delegates here).


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Megatron tensor (and sequence) parallelism over one mesh axis, bound inside `shard_map`.

    axis: the mesh axis of the tensor group.
    sequence: sequence parallelism — outside the regions activations are sharded on the sequence dim (dim 1), and
              the boundaries become all-gather (enter) / reduce-scatter (exit).
    kv_replicas: GQA with fewer kv heads K than tensor ranks t: kv weights are replicated and rank r uses kv head
              r // (t/K) (the head its local query heads attend with); kv_replicas = t/K, 1 otherwise.
    overlap:  with `sequence`, each column group's all-gather and each row matmul's reduce-scatter decomposed into
              ring steps beside the partial matmuls (collective matmul, jaxpar.parallel.overlap).

    The matmuls themselves are the caller's `dot` policy (jaxpar.matmul): this class only places the collectives
    around them.
    """

    axis: str = "tensor"
    sequence: bool = False
    kv_replicas: int = 1
    overlap: bool = False  # under SP, collective matmuls (jaxpar.parallel.overlap) in place of the whole collectives

    def column(self, h: Array, weights: Sequence[Array], equations: Sequence[str], dot: Einsum) -> list[Array]:
        """Column-parallel matmuls sharing one input: h (sequence shard under SP, else replicated) → full-sequence
        float32 outputs with the weights' local column split. One f (or one all-gather) for the whole group."""
        dot = dot.along(outputs=self.axis)
        if self.sequence:
            gather = overlap.gather_matmuls if self.overlap else seq.gather_matmuls
            return gather(h, tuple(weights), tuple(equations), self.axis, dot)
        h = copy_to_tensor(h, self.axis)
        return [dot(eq, h, w) for eq, w in zip(equations, weights)]

    def row(self, x: Array, w: Array, equation: str, dot: Einsum) -> Array:
        """Row-parallel matmul: local partial product, then g (or reduce-scatter to sequence shards under SP).
        The partial sums cross the wire in the compute dtype (bf16 on GPUs, as Megatron does); the result is
        float32 for the residual stream."""
        dot = dot.along(inputs=self.axis)
        if self.sequence and self.overlap:
            return overlap.matmul_scatter(x, w, equation, self.axis, dot).astype(jnp.float32)
        return self.exit(dot(equation, x, w).astype(x.dtype)).astype(jnp.float32)

    def column_adapter(self, h: Array, a: Array, b: Array, down: str, up: str) -> Array:
        """(h·A)·B_local → float32 for one column-parallel weight's adapters (LoRA dropout's path: h already
        dropped, `jaxpar.matmul.LoRADropout`), A whole, B split like the weight's outputs. Under SP h is this rank's
        sequence shard: the rank-r activation h·A is gathered instead of h (r entries a token, not D); else f enters
        the region as the weight's own group does."""
        if self.sequence:
            return token_einsum(up, seq.local_gather(token_einsum(down, h, a).astype(h.dtype), self.axis), b)
        return token_einsum(up, token_einsum(down, copy_to_tensor(h, self.axis), a).astype(h.dtype), b)

    def row_adapter(self, partial: Array, b: Array, up: str, dtype) -> Array:
        """A row-parallel weight's adapter output from this rank's partial rank-r activation (x_local·A_local,
        float32 [B, T, r]) → float32 [B, T(/t), …]: the partials summed over the group (g: r entries a token, where
        the weight's own exit moves D), rounded to `dtype`, then ·B (whole) on this rank's tokens (its sequence
        shard under SP)."""
        low = reduce_from_tensor(partial, self.axis).astype(dtype)
        return token_einsum(up, seq.local_seq(low, self.axis) if self.sequence else low, b)

    def enter(self, h: Array) -> Array:
        """Enter a region whose matmuls the caller runs itself (the MoE experts' grouped matmuls): f on the
        replicated input, or under SP the all-gather of the sequence shards [B, T/t, …] → [B, T, …] (whose
        backward reduce-scatters). Unlike `column`, the gathered input is kept for the backward, not re-gathered."""
        return seq.local_gather(h, self.axis) if self.sequence else copy_to_tensor(h, self.axis)

    def whole(self, x: Array) -> Array:
        """Sequence shards [B, T/t, …] → the whole sequence [B, T, …], typed invariant over the tensor group (an
        all-gather's result is typed varying): each rank's shard placed in zeros and summed (a psum of the T-long
        array: t/(t−1) × an all-gather's bytes). For values every rank then holds whole, forward only."""
        n, t = x.shape[1], jax.lax.axis_size(self.axis)
        full = jnp.zeros((x.shape[0], n * t, *x.shape[2:]), x.dtype)
        return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(self.axis) * n, 1),
                            self.axis)

    def exit(self, partial: Array) -> Array:
        """Sum partial results over the tensor group: g, or a reduce-scatter onto sequence shards under SP."""
        if self.sequence:
            return seq.reduce_scatter_seq(partial, self.axis)
        return reduce_from_tensor(partial, self.axis)

    def replicated(self, p: Array) -> Array:
        """A tensor-replicated parameter applied to sequence shards (SP norms, output biases, positions): each rank
        sees only part of the tokens, so its gradient is partial — f sums it. Identity without SP."""
        return copy_to_tensor(p, self.axis) if self.sequence else p

    def kv_weight(self, w: Array) -> Array:
        """The kv heads this rank attends with. w [..., K_local, E] → [..., K_local or 1, E].

        Replicated kv heads (K < t): every rank slices its one head out of the full weight; the slices' gradients
        land in different rows (or the same row on the t/K ranks sharing it), so f sums them into the full gradient.
        """
        if self.kv_replicas == 1:
            return w
        head = jax.lax.axis_index(self.axis) // self.kv_replicas
        cut = lambda w: jax.tree.map(  # noqa: E731
            lambda a: jax.lax.dynamic_slice_in_dim(copy_to_tensor(a, self.axis), head, 1, axis=-2), w)
        if isinstance(w, Adapted):  # the heads are the base's and B's output dims; A (the inputs') is whole
            return dataclasses.replace(w, base=cut(w.base), a=copy_to_tensor(w.a, self.axis), b=cut(w.b))
        # tree.map: a quantized weight (jaxpar.matmul.Quantized) slices its integers and its scales alike
        return cut(w)

    def kv_output(self, y: Array) -> Array:
        """A kv projection's output y [..., K_local or 1, E]: with replicated kv heads each rank's share of a shared
        head's output gradient made whole before it reaches the matmul (`shared_head`); y itself otherwise."""
        return y if self.kv_replicas == 1 else shared_head(y, self.axis, self.kv_replicas)

    def embed(self, table: Array, tokens: Array) -> Array:
        """Vocab-parallel lookup. table [V/t, D] (compute dtype), tokens [B, T] (full sequence) → float32
        [B, T or T/t under SP, D]."""
        return self.exit(vocab_parallel_lookup(table, tokens, self.axis)).astype(jnp.float32)

    def seq_shard(self, x: Array) -> Array:
        """This rank's part of a full-sequence array [B, T, …] (its sequence shard under SP; all of it otherwise)."""
        return seq.local_seq(x, self.axis) if self.sequence else x

    def vocab_ids(self, local_vocab: int) -> Array:
        """Global ids of this rank's vocab columns [V/t]."""
        return jax.lax.axis_index(self.axis) * local_vocab + jnp.arange(local_vocab)

    def cross_entropy(self, logits: Array, targets: Array) -> Array:
        """Per-token loss [B, T] from local-vocab logits [B, T, V/t]; targets [B, T]."""
        return vocab_parallel_cross_entropy(logits, targets, self.axis)
