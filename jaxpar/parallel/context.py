"""The model's one view of parallelism: the boundaries it owns, and nothing else.

The model (jaxpar.model) speaks logical axes and calls these methods where a parallel strategy may need to act:

    column / row        enter and leave a tensor-parallel region around the matmuls of one group
    enter / whole       a replicated activation entering a region without a matmul; a sequence-sharded one made
                        whole on every rank (a replicated cache's new tokens)
    dot                 a matmul outside any region (the router: a weight every rank holds whole)
    replicated          a parameter every tensor rank holds whole, applied to (possibly sequence-sharded) tokens
    kv_weight           the kv heads this rank attends with (GQA with fewer kv heads than tensor ranks)
    kv_output           a kv projection's output: a shared head's gradient parts summed before its matmul where the
                        policy quantizes output gradients (FP8)
    embed / vocab_ids   the vocab-parallel embedding lookup and the ids of this rank's logit columns
    cross_entropy       the loss over (possibly vocab-sharded) logits
    seq_shard           this rank's part of a full-sequence array (sequence parallelism)
    attention           attention of local queries over keys that may be sharded (context parallelism:
                        all-gather K/V around the same local kernel, jaxpar.parallel.context_parallel)
    attention_mask      packed documents' mask in the form `attention` takes it (a dense bool mask, or the
                        segment ids themselves where the keys are sharded)
    context_shard       this rank's part of a full-sequence array (context parallelism's zigzag chunks)
    route               an MoE layer's routing of its tokens (its row statistics summed over sequence shards)
    experts             an MoE layer's experts on its routed tokens: dispatch (an all-to-all over `expert` when
                        the experts are split), grouped matmuls, combine (jaxpar.parallel.expert)
    scan_layers         one group of layers: a period of them per scan step, each layer checkpointed
    one_group / derive  whether a run of layers must be one such scan; a layer's slice of a stacked parameter

`Parallel()` — no strategy — is the plain single-device computation: each method below is the obvious math, so
the model with the default context *is* the reference every parallel layout is tested against. A strategy is a
field: `tensor` (jaxpar.parallel.tensor.TensorParallel), `context` (jaxpar.parallel.context_parallel) and `expert`
(jaxpar.parallel.expert.ExpertParallel), each implemented in its own file under jaxpar/parallel/, so a new strategy
widens neither the model nor another strategy.
Every weight the methods receive is contracted through the matmul policy of its role (`matmul`, a
jaxpar.matmul.Policies table the plan binds: the model names the role at each call), the seam weight formats replace.
A `tape` (jaxpar.parallel.weightgrad) sees every matmul group the model runs and runs the layer scan its own way:
the zero-bubble pipeline schedules use it to split a chunk's backward into its input gradients (B) and its weight
gradients (W). The model knows no tape; it calls these methods whichever context it has. A `noise` (LoRA dropout,
jaxpar.matmul.LoRADropout), set by the train step for the tokens it runs, makes `column`, `row` and `dot` contract
each adapted weight's adapters on a dropped copy of their input — the model knows no dropout either.
The plan (jaxpar.plan: `plan.parallel`) builds the context once per model and mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxpar.matmul import Adapted, Einsum, LoRADropout, Policies, lora_equations, token_einsum
from jaxpar.parallel.context_parallel import ContextParallel, Segments
from jaxpar.parallel.expert import ExpertParallel, GroupedFFN, Routing, route
from jaxpar.parallel.sequence import local_gather
from jaxpar.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy
from jaxpar.parallel.weightgrad import Tape

Array = jax.Array


def segment_mask(T: int, segment_ids: Array | None, window: int = 0) -> Array | None:
    """None for plain causal attention (the kernels build it); with segment_ids [B, T] the causal mask (within
    `window`) intersected with same-segment → bool [B, 1, T, S]."""
    if segment_ids is None:
        return None
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    causal = (s <= t) & ((t - s < window) if window else True)  # [T, S]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    return (causal & same)[:, None]


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The boundaries the model calls. tensor: Megatron TP/SP inside shard_map, or None (single device / GSPMD).
    context: the sequence split over `context`, or None. matmul: the policy of each matmul role (jaxpar.matmul;
    every role plain by default). tape: set by the pipeline's chunk around its layers (`with_tape`; the tape's layer
    scan sets a tape of its own around each period); None everywhere else."""

    tensor: TensorParallel | None = None
    matmul: Policies = Policies()
    context: ContextParallel | None = None
    tape: Tape | None = dataclasses.field(default=None, compare=False, repr=False)
    expert: ExpertParallel = ExpertParallel()
    noise: LoRADropout | None = dataclasses.field(default=None, compare=False, repr=False)

    def with_tape(self, tape: Tape | None) -> "Parallel":
        """This context with `tape` watching its matmul groups (jaxpar.parallel.weightgrad)."""
        return dataclasses.replace(self, tape=tape)

    def with_noise(self, rate: float, coords: Array | None) -> "Parallel":
        """This context dropping a share `rate` of the adapters' inputs (LoRA dropout) for tokens at coords uint32
        [B, T(/c)] (jaxpar.train.step); itself where coords is None or rate is 0 (evaluation, no dropout)."""
        if coords is None or not rate:
            return self
        return dataclasses.replace(self, noise=LoRADropout(rate, coords))

    def at_layer(self, seed: Array) -> "Parallel":
        """This context inside the layer of LoRA dropout seed `seed` (jaxpar.model.layer_seeds; set by run_layers)."""
        return self if self.noise is None else dataclasses.replace(
            self, noise=dataclasses.replace(self.noise, layer=seed))

    def _dropping(self, weights: Sequence) -> bool:
        """Whether some weight of a group gets its adapters' input dropped (LoRA dropout is on)."""
        if self.noise is None or not any(isinstance(w, Adapted) for w in weights):
            return False
        if self.tape is not None:  # a LoRA chunk runs without a tape (jaxpar.train.step)
            raise ValueError("LoRA dropout under a pipeline tape: the adapters' chunks run without one")
        return True

    def policy(self, role: str) -> Einsum:
        """The matmul policy of `role` (jaxpar.matmul.ROLES)."""
        return self.matmul.for_role(role)

    def column(self, h: Array, weights: Sequence[Array], equations: Sequence[str], role: str) -> list[Array]:
        """Matmuls of one column-parallel group sharing the input h [B, T, D] (compute dtype), its weights of
        matmul role `role` → float32 outputs."""
        dot = self.policy(role)

        def group(h, weights):
            if self.tensor is not None:
                return self.tensor.column(h, weights, equations, dot)
            return [dot(eq, h, w) for eq, w in zip(equations, weights)]

        if self._dropping(weights):  # the bases as a group; each adapter on its own dropped copy of h
            outs = group(h, [w.base if isinstance(w, Adapted) else w for w in weights])
            coords = self.seq_shard(self.noise.coords)  # h's tokens (a sequence shard under SP)
            return [y + self._column_adapter(h, w, eq, coords) if isinstance(w, Adapted) else y
                    for y, w, eq in zip(outs, weights, equations)]
        return group(h, weights) if self.tape is None else self.tape.group(h, weights, group, role)

    def _column_adapter(self, h: Array, w: Adapted, equation: str, coords: Array, whole: bool = False) -> Array:
        """scale·(dropout(h)·A)·B → float32: an adapter of a column group — or with `whole`, of a weight every rank
        holds whole (`dot`). The adapters' parameters are typed as they come (invariant, or varying where
        `kv_weight` cut them); where they meet sequence shards, autodiff sums their gradients over the shards."""
        down, up = lora_equations(equation)
        a, b = w.a.astype(h.dtype), w.b.astype(h.dtype)
        dropped = self.noise(h, w.name, coords)
        if self.tensor is not None and not whole:
            return w.scale * self.tensor.column_adapter(dropped, a, b, down, up)
        return w.scale * token_einsum(up, token_einsum(down, dropped, a).astype(h.dtype), b)

    def row(self, x: Array, w: Array, equation: str, role: str) -> Array:
        """The matmul that closes a region: x (compute dtype) · w (of matmul role `role`) → float32 [B, T, D].
        Rounded to the compute dtype once, as the tensor-parallel partial sums are for the wire, so the reference
        and every layout agree."""
        dot = self.policy(role)

        def group(x, weights):
            if self.tensor is not None:
                return [self.tensor.row(x, weights[0], equation, dot)]
            return [dot(equation, x, weights[0]).astype(x.dtype).astype(jnp.float32)]

        if self._dropping((w,)):  # the base as before; the adapter on a dropped copy of x
            down, up = lora_equations(equation)
            a, b = w.a.astype(x.dtype), w.b.astype(x.dtype)
            if self.tensor is None:
                low = token_einsum(down, self.noise(x, w.name, self.noise.coords), a).astype(x.dtype)
                adapter = token_einsum(up, low, b)
            else:  # x: every token (T/c), this rank's slice of the first input dim
                offset = jax.lax.axis_index(self.tensor.axis) * x.shape[2]
                partial = token_einsum(down, self.noise(x, w.name, self.noise.coords, offset), a)
                adapter = self.tensor.row_adapter(partial, b, up, x.dtype)
            return group(x, (w.base,))[0] + w.scale * adapter.astype(x.dtype).astype(jnp.float32)
        return (group(x, (w,)) if self.tape is None else self.tape.group(x, (w,), group, role))[0]

    def dot(self, equation: str, x: Array, w: Array, role: str) -> Array:
        """A matmul of this rank's tokens x (compute dtype) with a weight every tensor rank holds whole (the MoE
        router, a shared expert's score), by the policy of `role` → float32. No region, no collective."""
        if self._dropping((w,)):  # this rank's tokens (a sequence shard under SP)
            adapter = self._column_adapter(x, w, equation, self.seq_shard(self.noise.coords), whole=True)
            return self.policy(role)(equation, x, w.base) + adapter
        return self.policy(role)(equation, x, w)

    def enter(self, x: Array) -> Array:
        """A replicated activation (compute dtype) entering a tensor-parallel region without a matmul here (MLA's
        rope key, which every rank's heads read): f, or under SP the all-gather of the sequence shards
        [B, T/t, …] → [B, T, …]; x itself without tensor parallelism."""
        return x if self.tensor is None else self.tensor.enter(x)

    def whole(self, x: Array) -> Array:
        """This rank's tokens of a replicated activation [B, T(/t), …] → every token's [B, T, …], the same on every
        tensor rank and typed so — what a cache every rank holds whole stores (MLA's latent). Decoding only (no
        gradient rule): under SP the shards are summed into place (`TensorParallel.whole`)."""
        return x if self.tensor is None or not self.tensor.sequence else self.tensor.whole(x)

    def replicated(self, p: Array) -> Array:
        """A parameter held whole by every tensor rank (norm scales, output biases, positions)."""
        return p if self.tensor is None else self.tensor.replicated(p)

    def kv_weight(self, w: Array) -> Array:
        """The kv heads of w [..., K, E] this rank attends with."""
        return self.derive(w if self.tensor is None else self.tensor.kv_weight(w), w)

    def kv_output(self, y: Array, role: str) -> Array:
        """A kv projection's output [B, S, K, E] (float32, straight from `column`): where kv heads are replicated over
        the tensor group and the role's policy quantizes output gradients (FP8: a scale per token over the whole
        output), each rank's part of a shared head's gradient is summed before it reaches the matmul
        (`TensorParallel.kv_output`); y itself otherwise — the float path sums the parts after the matmul, as
        before."""
        if self.tensor is None or not self.policy(role).whole_output_grad:
            return y
        return self.tensor.kv_output(y)

    def derive(self, result, source):
        """result, a function of `source` alone (a layer's slice of a stacked parameter, a rank's kv heads): a tape
        traces the weights its groups see back through it to the arrays they came from (`Tape.derive`)."""
        return result if self.tape is None else self.tape.derive(result, source)

    @property
    def one_group(self) -> bool:
        """Whether a run of layers must be a single `scan_layers` (a tape feeds one scan's periods)."""
        return self.tape is not None

    def scan_layers(self, period: Callable, carry, xs, *, unroll: int = 1, remat: Callable | None = None):
        """One group of layers: `period` once for each entry of xs' leading axis (its `count` periods), carry
        threaded → (carry, its outputs stacked [count, …]).

        period(carry, xs_i, par, layer_remat) → (carry, ys_i) runs one period's layers under `par` (the context they
        call) and wraps each in layer_remat (fn → fn; None: no checkpoint). remat: jax.checkpoint with the run's
        policy bound, or None; this method chooses where it applies and its prevent_cse. unroll: periods per loop
        trip, as `jax.lax.scan` takes it.

        Here a `jax.lax.scan` with each layer checkpointed; under a tape (the pipeline's chunk), the tape's scan
        (`Tape.scan`: it runs the period under a tape of its own and may report no outputs: None)."""
        if self.tape is not None:
            return self.tape.scan(self, period, carry, xs, unroll=unroll, remat=remat)
        count = jax.tree.leaves(xs)[0].shape[0]
        # A scan of one trip is inlined by XLA: each layer's recomputation then sits beside the forward it repeats,
        # and without CSE barriers XLA merges the two and keeps every activation alive (remat would do nothing).
        layer_remat = None if remat is None else functools.partial(remat, prevent_cse=unroll == count)
        return jax.lax.scan(lambda c, x: period(c, x, self, layer_remat), carry, xs, unroll=unroll)

    def embed(self, table: Array, tokens: Array, dtype) -> Array:
        """Token embedding: table [V, D] as stored, tokens [B, T] → float32 [B, T, D] (rows read in `dtype`)."""
        rows = self.policy("embedding").table(table, dtype)
        if self.tensor is not None:
            return self.tensor.embed(rows, tokens)
        return jnp.take(rows, tokens, axis=0).astype(jnp.float32)

    def seq_shard(self, x: Array) -> Array:
        """This rank's part of a full-sequence array [B, T, …]."""
        return x if self.tensor is None else self.tensor.seq_shard(x)

    def vocab_ids(self, local_vocab: int) -> Array:
        """Global ids of the logit columns this rank holds [V_local]."""
        return jnp.arange(local_vocab) if self.tensor is None else self.tensor.vocab_ids(local_vocab)

    def cross_entropy(self, logits: Array, targets: Array) -> Array:
        """Per-token loss [B, T] from float32 logits [B, T, V_local] (padded columns already NEG_INF)."""
        if self.tensor is not None:
            return self.tensor.cross_entropy(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, None)

    def attention(self, kernel: Callable[..., Array], q: Array, k: Array, v: Array, mask: Array | None,
                  sinks: Array | None = None, window: int = 0) -> Array:
        """kernel(q, k, v, mask[, sinks=]) over this rank's queries q [B, T, H, E] and the keys k, v [B, S, K, E]
        (sinks [H]: attention sinks, one logit per local query head, or None; window: the layer's sliding window,
        0: none, which the kernel applies itself where mask is None). With heads split by tensor parallelism each
        rank's heads are self-contained, so this is the kernel itself; with the sequence split over `context`, the
        keys of the other ranks join under the mask the strategy writes (context_parallel.ContextParallel)."""
        if self.context is not None:
            return self.context.attention(kernel, q, k, v, mask, sinks, window)
        return kernel(q, k, v, mask) if sinks is None else kernel(q, k, v, mask, sinks=sinks)

    def attention_mask(self, T: int, segment_ids: Array | None, window: int = 0) -> Array | Segments | None:
        """The mask `attention` takes for packed documents: segment_ids [B, T] (this rank's T tokens; None: plain
        causal → None) as the dense causal-and-same-segment mask (`segment_mask`, within `window`) — or, where the
        sequence is split over `context`, the ids themselves (`Segments`), from which the strategy writes the mask
        across ranks (and applies the window)."""
        if segment_ids is None:
            return None
        if self.context is not None:
            return Segments(segment_ids)
        return segment_mask(T, segment_ids, window)

    def route(self, logits: Array, top_k: int, norm_topk_prob: bool, capacity_factor: float, **options) -> Routing:
        """An MoE layer's routing of its tokens from router logits [B, T, X] (float32; jaxpar.parallel.expert.route,
        which takes `options`: scoring, groups, the gate scale, the correction bias). Under sequence parallelism the
        tokens are this rank's shard of each row and the row's statistics are summed over the tensor group."""
        sp = self.tensor is not None and self.tensor.sequence
        return route(logits, top_k, norm_topk_prob, capacity_factor, self.tensor.axis if sp else None, **options)

    def experts(self, h: Array, routing: Routing, weights: Sequence[Array], ffn: GroupedFFN,
                capacity_factor: float) -> Array:
        """An MoE layer's routed experts: Σ_j gate_j · FFN_{expert_j}(h) over each token's kept assignments.
        h [B, T, D] (compute dtype; T/t under SP) → float32 [B, T, D], rounded to the compute dtype once like `row`.
        weights [X_local, …] each, `ffn` the experts' grouped computation (jaxpar.parallel.expert.GroupedFFN), which
        contracts them by the `experts` role's policy (`policy("experts")`).
        Under tensor parallelism this is a region like an MLP's: f in (under SP: the tokens and their routing
        gathered), each rank its slice of every expert, g out (under SP: reduce-scattered). For a tape (the B/W
        split) the group's input is the tokens with their routing: W replays the experts on the same assignments."""
        def group(inputs, weights):  # one matmul group for the tape: its input is the tokens and their routing
            h, experts, gates, keep = inputs
            routed = dataclasses.replace(routing, experts=experts, gates=gates, keep=keep)
            if self.tensor is None:
                out = self.expert.run(h, routed, weights, ffn, capacity_factor)
                return [out.astype(h.dtype).astype(jnp.float32)]
            if self.tensor.sequence:
                gather = functools.partial(local_gather, axis=self.tensor.axis)
                routed = dataclasses.replace(routed, experts=gather(experts), gates=gather(gates), keep=gather(keep))
            partial = self.expert.run(self.tensor.enter(h), routed, weights, ffn, capacity_factor)
            return [self.tensor.exit(partial.astype(h.dtype)).astype(jnp.float32)]

        inputs = (h, routing.experts, routing.gates, routing.keep)
        if self.tape is None:
            return group(inputs, weights)[0]
        return self.tape.group(inputs, weights, group, "experts")[0]

    def context_shard(self, x: Array) -> Array:
        """This rank's part of a full-sequence array [B, S, …] under context parallelism (→ [B, S/c, …]); x itself
        otherwise. The step takes tokens, targets and positions through it before the model sees them."""
        return x if self.context is None else self.context.shard(x)

    def sequence_sum(self, x: Array) -> Array:
        """The sum over the whole sequence of a quantity this rank summed over its part (x [R, …]: per row): itself,
        or under context parallelism the sum of every rank's — typed as varying over `context` (an all-gather, not
        a psum), so that autodiff hands each rank the whole cotangent for its own part, as a loss that is a
        nonlinear function of per-row sums (DPO's) needs: a psum's result is typed invariant, and the step's mean
        over `context` would then scale every rank's gradient by 1/c."""
        if self.context is None:
            return x
        return jax.lax.all_gather(x, self.context.axis).sum(0)

    def sequence_total(self, x: Array) -> Array:
        """`sequence_sum` typed invariant over `context` (a psum): for values that leave a shard_map whole, and
        take no gradient."""
        return x if self.context is None else jax.lax.psum(x, self.context.axis)


SINGLE_DEVICE = Parallel()
