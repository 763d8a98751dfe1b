"""Mixture of experts: routing, and tokens to their experts and back — locally, or by all-to-all over `expert`.

Notation: B rows (sequences), T tokens a row, N = B·T tokens, D d_model, X experts, k top_k, A = N·k assignments
(token, choice), ep the expert degree, Xl = X/ep experts a rank holds, C the per-row capacity of an expert.

Routing (`route`, GShard/Switch with Mixtral's and Qwen2-MoE's top-k):

    p = softmax(h·W_r)  [B, T, X] (float32)      top-k experts e_j and their probabilities p_j, j < k
    gates g_j = p_j / Σ_j p_j  (norm_topk_prob)   or  p_j
    out(t) = Σ_j g_j · FFN_{e_j}(h_t)             (a dropped assignment contributes nothing)

and DeepSeek's (`select`): scores s = softmax (V2) or σ(h·W_r) (V3, each expert on its own); the experts are chosen
by s + b, b the layer's correction bias (model state, moved by the step: jaxpar.model.bias_update), among the
topk_group best of n_group expert groups; the gates are the chosen experts' *unbiased* s (renormalised, + 1e-20 for
sigmoid as V3 does), × routed_scale. The bias decides which experts, never how much of each.

A *row* is the routing group. Capacity, the load-balancing loss and the z-loss are per sequence, so they do not
depend on how rows are split over data, pipe, expert, microbatches or gradient accumulation — every layout computes
the same numbers as one device. (GShard's groups, with one sequence per group.) Under sequence parallelism a rank
holds a shard of each row: `route` sums the row's statistics over the tensor group and places a shard's
assignments after those of the shards before it, so the routing is still the whole row's.

- Capacity (`moe.capacity_factor` cf > 0): expert e takes at most C = ceil(cf·T·k/X) assignments of a row, first
  choices before second ones and, within a choice, earlier tokens first (GShard's priority). Dropped assignments
  per row = Σ_e max(0, load_e − C). cf = 0 is dropless: every assignment is computed.
- Load balancing (Switch): L_aux = X · Σ_e f_e · P_e per row, f_e = load_e / (T·k) the share of the row's
  assignments expert e receives, P_e the mean router probability of e (sigmoid scores: the mean of σ_e / Σ_x σ_x,
  DeepSeek-V3's sequence-wise balance loss, which is this one up to its coefficient). Balanced routing gives 1
  (Hugging Face's `load_balancing_loss_func` reports k times this: its f counts tokens, not assignments).
- z-loss (ST-MoE): mean over the row's tokens of logsumexp(router logits)².
Both enter the objective as coef × their mean over rows and MoE layers (jaxpar.model.moe_objective): each layer
returns its sums beside the activations, the layer scan and the circular pipeline (bubble ticks masked out) add
them up, and the step adds the weighted total to the loss it differentiates. The loss it reports is the LM loss.
(In a schedule table, which carries no loss through its ticks, each chunk attaches its microbatch's term to its
output instead: jaxpar.parallel.executor.add_to_objective.)

Dispatch. Assignments are sorted by expert (stable: the priority order within an expert), dropped ones last; the
rows of a local expert are then contiguous, and the experts run as grouped matmuls over the sorted rows
(`jax.lax.ragged_dot`: no padding to capacity — rows past the groups' total come out zero).

    ep = 1:   sort → grouped SwiGLU → unsort → Σ_j g_j·y_j

    ep > 1:   sort by expert (so by owning rank d = e // Xl) → send[d] = the rows for rank d, padded to S rows
              → all_to_all over `expert` → recv[s] = the rows rank s sends me, sorted by my local experts
              → sort the ep·S received rows by local expert → grouped SwiGLU → unsort
              → all_to_all back → each assignment's result in its sorted slot → unsort → Σ_j g_j·y_j

Static shapes need a chunk size S for every (source, destination) pair: with capacity, S = B·Xl·C (every row's
quota for my experts); dropless, the worst case S = N·min(k, Xl) (every token sending all its k choices to one
rank). Only S·D floats per pair cross the wire, plus the per-(rank, local expert) counts [ep, Xl] (int32) from
which the receiver knows which rows are whose. XLA:CPU has no `ragged_all_to_all` ("not supported by XLA:CPU
ThunkEmitter", jax 0.12); GPU and TPU have it, and would move only the rows actually routed — this file uses the
dense all-to-all on every backend, so the bytes on the wire are the chunk sizes above on all of them:

    per MoE layer, forward: 2 · (ep − 1) · S · D · β  (dispatch + combine; the backward moves the same again)

which with cf = 1 and T·k/X whole is the DESIGN formula 2·(ep−1)/ep·N·k·D·β (jaxpar.planner.expected.expert_bytes
counts it, with the counts, and the tests compare it with the compiled program).

Tensor parallelism inside each expert: experts split their hidden dim over `tensor` like a dense MLP. The routing
runs outside the tensor region (every tensor rank routes the same tokens the same way), the tokens enter it with f
(under SP: the tokens and their routing all-gathered), each rank computes its F/t slice of every expert, and the
combined partial sums leave through g (under SP: a reduce-scatter) — one all-reduce of [B, T, D] per MoE layer, as
for a dense MLP, plus the gates' gradient all-reduce [N, k] in the backward (jaxpar.parallel.context.Parallel.experts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


# ---------------------------------------------------------------------------------------------------------------------
# Routing: which experts each token goes to, with what weight, and which assignments fit.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Routing:
    """One MoE layer's routing of rows [B, T].

    experts [B, T, k] int32   the chosen experts, best first
    gates   [B, T, k] float32 their weights in the output
    keep    [B, T, k] bool    the assignment is computed (always, dropless)
    load    [B, X]    int32   assignments each expert received per row, before dropping
    aux     float32 scalar    Σ over rows of the load-balancing loss X·Σ_e f_e·P_e
    z       float32 scalar    Σ over rows of the z-loss (mean over tokens of logsumexp²)
    dropped int32 scalar      dropped assignments, Σ over rows of Σ_e max(0, load_e − C)
    (Under sequence parallelism experts, gates and keep are this rank's tokens'; the rest are whole rows'.)
    """

    experts: Array
    gates: Array
    keep: Array
    load: Array
    aux: Array
    z: Array
    dropped: Array


def capacity(seq_len: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """C = ceil(cf·T·k/X): the most assignments of one row an expert takes (0: dropless, no limit)."""
    return math.ceil(capacity_factor * seq_len * top_k / n_experts) if capacity_factor > 0 else 0


def route(logits: Array, top_k: int, norm_topk_prob: bool, capacity_factor: float, seq_axis: str | None = None,
          *, scoring: str = "softmax", n_group: int = 1, topk_group: int = 1, routed_scale: float = 1.0,
          bias: Array | None = None) -> Routing:
    """Routing from router logits [B, T, X] (float32): scores, top-k (group-limited, biased), capacity, loss terms.

    seq_axis: under sequence parallelism each rank holds T = S/t tokens of every row, shard r the r-th; the row's
    statistics (load, P, the z-loss, the queue places of capacity) are then sums over the ranks of `seq_axis`, and
    come out the same on all of them.

    DeepSeek's routing (moe.scoring, n_group, topk_group, routed_scale, correction_bias; see `select`): scoring
    'sigmoid' scores each expert σ(logit) on its own (V3); bias [X] float32 (the layer's e_score_correction_bias, a
    constant) shifts the scores the experts are *chosen* by, never the gates; n_group > 1 limits a token to its
    topk_group best groups of X/n_group experts. The gates are the chosen experts' unbiased scores (renormalised with
    norm_topk_prob), × routed_scale."""
    B, T, X = logits.shape
    ranks = jax.lax.axis_size(seq_axis) if seq_axis else 1
    S = T * ranks  # the row's tokens
    total = (lambda x: jax.lax.psum(x, seq_axis)) if seq_axis else (lambda x: x)
    if scoring == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)  # [B, T, X]
    elif scoring == "sigmoid":
        probs = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown router scoring {scoring!r}")
    if bias is None and n_group == 1:  # Mixtral's and Qwen2-MoE's routing, as before (the same ops, bit for bit)
        top_p, experts = jax.lax.top_k(probs, top_k)  # [B, T, k]
    else:
        experts = select(probs, top_k, scoring, n_group, topk_group, bias)
        top_p = jnp.take_along_axis(probs, experts, axis=-1)  # the unbiased scores: the bias picks, never weighs
    if norm_topk_prob:
        # V3 adds 1e-20 to the sum (sigmoid scores, whose sum is not 1); the softmax path keeps Mixtral's division
        gates = top_p / (top_p.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    else:
        gates = top_p
    if routed_scale != 1.0:
        gates = gates * routed_scale
    chosen = jax.nn.one_hot(experts, X, dtype=jnp.int32)  # [B, T, k, X]
    counts = chosen.sum(1)  # [B, k, X]: this shard's assignments per choice and expert
    load = total(counts.sum(1))  # [B, X]
    C = capacity(S, top_k, X, capacity_factor)
    if C:
        # The place of assignment (t, j) in its expert's queue, in the order (j, t): every assignment of an
        # earlier choice, then this choice's on earlier shards, then on this shard before token t.
        row = total(counts)  # [B, k, X]
        earlier_choices = jnp.cumsum(row, axis=1) - row
        earlier_shards = 0
        if seq_axis:
            shards = jax.lax.all_gather(counts, seq_axis)  # [t, B, k, X]
            mine = jax.lax.axis_index(seq_axis)
            earlier_shards = jnp.where((jnp.arange(ranks) < mine)[:, None, None, None], shards, 0).sum(0)
        earlier_tokens = jnp.cumsum(chosen, axis=1) - chosen  # [B, T, k, X]
        before = earlier_tokens + (earlier_choices + earlier_shards)[:, None]
        keep = (before * chosen).sum(-1) < C  # [B, T, k]
    else:
        keep = jnp.ones(experts.shape, bool)
    f = load / (S * top_k)  # [B, X]: the share of the row's assignments
    # P_e: the mean over the row's tokens of e's share of the token's scores — the softmax probability itself, or
    # for sigmoid scores σ_e / Σ_x σ_x (V3's sequence-wise balance loss normalises them so; balanced routing still
    # gives 1). Unbiased: the loss measures the router, the bias is outside the gradient.
    shares = probs if scoring == "softmax" else probs / probs.sum(-1, keepdims=True)
    P = total(shares.sum(1)) / S  # [B, X]
    aux = X * (jax.lax.stop_gradient(f) * P).sum()  # f is counts: no gradient (Switch)
    z = total((jax.nn.logsumexp(logits, axis=-1) ** 2).sum(1)).sum() / S
    return Routing(experts.astype(jnp.int32), gates, keep, load, aux, z, total((~keep).sum()))


def select(scores: Array, top_k: int, scoring: str, n_group: int, topk_group: int, bias: Array | None) -> Array:
    """The k experts each token is sent to, best first: scores [B, T, X] float32 → int32 [B, T, k].

        s' = scores + bias                      (selection scores; bias None: the scores)
        group g's score = max_{e ∈ g} s'_e      (softmax: DeepSeek-V2's group_limited_greedy)
                        = Σ top-2_{e ∈ g} s'_e  (sigmoid: DeepSeek-V3's noaux_tc)
        keep the topk_group best groups (n_group > 1), s'_e = −inf outside them, top-k of s'.

    Masked experts get −inf, so no expert outside the kept groups can be chosen whatever its biased score. Hugging
    Face's DeepSeek-V2 fills 0.0 instead (its softmax scores are > 0, so the same experts win); with a correction
    bias a kept expert's s' may be < 0, and a 0 would then outrank it — an expert of a dropped group chosen. The
    two agree whenever the k-th kept expert's s' ≥ 0 (always without a bias); transformers' DeepSeek-V3 masks with
    −inf, as here. Selection only: no gradient flows through it (the gates gather the unbiased scores)."""
    B, T, X = scores.shape
    chosen_by = jax.lax.stop_gradient(scores if bias is None else scores + bias.astype(jnp.float32))
    if n_group > 1:
        grouped = chosen_by.reshape(B, T, n_group, X // n_group)
        if scoring == "sigmoid":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [B, T, G]
        else:
            group_scores = grouped.max(-1)
        _, groups = jax.lax.top_k(group_scores, topk_group)  # [B, T, topk_group]
        kept = jax.nn.one_hot(groups, n_group, dtype=jnp.bool_).any(-2)  # [B, T, G]
        chosen_by = jnp.where(jnp.repeat(kept, X // n_group, axis=-1), chosen_by, -jnp.inf)
    return jax.lax.top_k(chosen_by, top_k)[1].astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch and combine.

# The experts' computation on sorted rows: (rows [M, D], group_sizes [Xl] int32, this rank's expert weights) →
# [M, D] float32 (rows past Σ group_sizes → 0).
GroupedFFN = Callable[[Array, Array, Sequence[Array]], Array]


def _sort(keys: Array) -> tuple[Array, Array]:
    """(order, inverse): a stable sort of `keys` [M] and the permutation that undoes it."""
    order = jnp.argsort(keys, stable=True)
    return order, jnp.argsort(order)


def _group_sizes(keys: Array, groups: int) -> Array:
    """How many of `keys` [M] fall in each of groups 0 … groups−1 (keys ≥ groups are not counted)."""
    return jnp.zeros((groups,), jnp.int32).at[keys].add(1, mode="drop")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The experts' side of the parallel context.

    axis / degree: the mesh axis the experts are split over and its size (None / 1: every rank holds every expert).
    """

    axis: str | None = None
    degree: int = 1

    def run(self, h: Array, routing: Routing, weights: Sequence[Array], ffn: GroupedFFN,
            capacity_factor: float) -> Array:
        """Σ_j g_j · FFN_{e_j}(h) for kept assignments. h [B, T, D] (compute dtype, whole rows) → [B, T, D] float32
        (partial sums over `tensor` when the experts' hidden dim is split; the caller closes the region)."""
        B, T, D = h.shape
        k = routing.experts.shape[-1]
        Xl = weights[0].shape[0]  # local experts
        X = Xl * self.degree
        C = capacity(T, k, X, capacity_factor)
        # Assignments in (token, choice) order; dropped ones sort last (key X).
        keys = jnp.where(routing.keep, routing.experts, X).reshape(-1)  # [A]
        order, inverse = _sort(keys)
        rows = h.reshape(B * T, D)[order // k]  # [A, D]: token a // k of each sorted assignment
        if self.degree == 1:
            y = ffn(rows, _group_sizes(keys, X), weights)
        else:
            S = min(B * Xl * C, B * T * min(k, Xl)) if C else B * T * min(k, Xl)
            y = self._exchange(rows, keys[order], Xl, S, weights, ffn)
        y = y[inverse].reshape(B, T, k, D)  # back to (token, choice) order
        gates = jnp.where(routing.keep, routing.gates, 0.0)
        return jnp.einsum("btkd,btk->btd", y.astype(jnp.float32), gates)

    def _exchange(self, rows: Array, keys: Array, Xl: int, S: int, weights: Sequence[Array], ffn: GroupedFFN) -> Array:
        """Rows sorted by expert (`keys` [A], X = dropped) → their experts' outputs, in the same order, the experts
        being spread over the ranks of `self.axis` (Xl each). Chunks of S rows per (source, destination) pair."""
        ep, axis = self.degree, self.axis
        A, D = rows.shape
        X = Xl * ep
        counts = _group_sizes(keys, X).reshape(ep, Xl)  # [ep, Xl]: my rows for each rank's each local expert
        per_rank = counts.sum(1)  # [ep]
        start = jnp.cumsum(per_rank) - per_rank  # where rank d's rows begin in the sorted order
        slot = jnp.arange(S)
        valid = slot[None, :] < per_rank[:, None]  # [ep, S]
        src = jnp.where(valid, start[:, None] + slot[None, :], A)  # [ep, S]: sorted row of each send slot (A: none)
        send = jnp.where(valid[..., None], rows[jnp.minimum(src, A - 1)], 0).astype(rows.dtype)  # [ep, S, D]
        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [ep, S, D]: recv[s] came from rank s
        got = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)  # [ep, Xl]: rank s's rows for my experts
        # Row i of recv[s] belongs to my local expert #{x : cumsum(got[s])[x] ≤ i} (Xl: padding).
        local = (slot[None, :, None] >= jnp.cumsum(got, 1)[:, None, :]).sum(-1).reshape(-1)  # [ep·S]
        order, inverse = _sort(local)
        y = ffn(recv.reshape(ep * S, D)[order], _group_sizes(local, Xl), weights)[inverse]  # [ep·S, D]
        back = jax.lax.all_to_all(y.reshape(ep, S, D), axis, 0, 0, tiled=True)  # [ep, S, D]: back[d] from rank d
        # Each sent slot's result to its sorted row; rows that were dropped (or never sent) stay zero.
        return jnp.zeros((A, D), back.dtype).at[src.reshape(-1)].set(back.reshape(ep * S, D), mode="drop")
