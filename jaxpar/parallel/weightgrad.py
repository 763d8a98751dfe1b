"""The B/W split of the zero-bubble schedules (Qi et al. 2023): a chunk's backward as two passes.

The backward of a matmul y = x·W is two independent products:

    B  (input gradient)    dx = dy·Wᵀ    on the critical path: the previous stage is waiting for it
    W  (weight gradient)   dW = xᵀ·dy    wanted only by the optimizer, so a schedule may run it later, in a bubble

B propagates a chunk's output gradient back through all its layers to the chunk's input; W then needs, per matmul,
only that matmul's input x (kept from the forward) and its output gradient dy (kept from B). The model contracts
every weight matrix in a *group* — `Parallel.column` (matmuls sharing one input) or `Parallel.row` — so a `Tape` on
the model's parallel context sees each one, and the pipeline executor (jaxpar.parallel.executor.execute) runs the
chunk in one of three modes. The chunk's layers are one scan over its periods (`Parallel.one_group`), which the
model runs through `Parallel.scan_layers` and the tape runs its own way (`Tape.scan`):

    MEASURE  one layer (a period of a mixed stack), traced once outside any loop: which of the chunk's parameters
             are matmul weights (traced back through `derive`: a layer's slice of a stacked array, the kv heads of a
             rank) and each group's input and output shapes (the W stash and the probes are sized from them).
    RECORD   the forward F. Each group's input is collected (→ the W stash), and a zero *probe* is added to each of
             its outputs, so the chunk's vjp with respect to the probes is every group output's gradient dy
             (→ the W stash, written by B). The matmul weights are closed over, not differentiated: B computes no
             weight gradient, and the forward's residuals hold no matmul input for one.
    REPLAY   the W. Each group runs on its stashed input (what the model computed for it is ignored), and the vjp
             of the groups' outputs with respect to the weights at the stashed dys is Σ xᵀ·dy — the very
             contraction autodiff transposes, behind the same collectives (f's identity; under sequence parallelism
             the re-gather of the input and of a row group's output gradient), so the gradients are the same
             numbers. Everything else the replayed layer computes is dead code, which XLA drops — except
             inside a group that is more than matmuls (the MoE experts' SwiGLU), whose backward needs its
             hidden activations: `Tape.scan` checkpoints each replayed period, so W holds one period's, not
             the chunk's.

A group's input may be a pytree: the MoE experts' group takes (tokens, chosen experts, gates, kept), so W replays
the grouped matmuls on the very assignments F routed.

The probe sits on the group's output as the model receives it (after a row group's g or reduce-scatter), so a group
is one function of (input, weights) whatever the tensor layout, and the same code taps the plain, tensor-parallel
and sequence-parallel paths.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

Array = jax.Array

MEASURE, RECORD, REPLAY = "measure", "record", "replay"


class Tape:
    """One chunk-layer's matmul groups, in the order the model runs them.

    feed: RECORD — per group, the probes to add to its outputs (a list of arrays per group); REPLAY — per group,
    its stashed input; MEASURE — nothing. After the layer ran: `inputs` and `outputs` per group, and (MEASURE)
    `weights`, each group weight traced back to the array it was derived from, and `roles`, each one's matmul role
    (jaxpar.matmul.ROLES: the executor prepares each weight by its role's policy).

    The chunk's tape (the one the executor hands its chunk) runs the chunk's scan (`scan`): its feed's leaves are
    [k, …] over the chunk's k periods, and afterwards RECORD's `inputs` and REPLAY's `outputs` are what the periods'
    own tapes collected, stacked [k, …].
    """

    def __init__(self, mode: str, feed: Sequence | None = None):
        if mode not in (MEASURE, RECORD, REPLAY):
            raise ValueError(f"Tape mode {mode!r}: expected one of {MEASURE}, {RECORD}, {REPLAY}")
        self.mode, self.feed = mode, feed
        self.inputs: list = []  # per group: an array, or a pytree of them
        self.outputs: list[list[Array]] = []
        self.weights: list[Array] = []
        self.roles: list[str] = []
        self.steps = 1  # MEASURE: how many times the chunk's scan runs the traced unit (set by `scan`)
        self._source: dict[int, tuple[Array, Array]] = {}  # id(derived) → (derived, source): the pair keeps ids live

    def derive(self, result: Array, source: Array) -> Array:
        """Note that `result` is a function of `source` alone (MEASURE traces group weights back through it)."""
        if self.mode == MEASURE and result is not source:
            self._source[id(result)] = (result, source)
        return result

    def root(self, w: Array) -> Array:
        """The array w was derived from, through every `derive`."""
        while id(w) in self._source:
            w = self._source[id(w)][1]
        return w

    def group(self, x, weights: Sequence[Array], fn: Callable[[object, Sequence[Array]], list[Array]],
              role: str) -> list[Array]:
        """One matmul group of weights of matmul role `role`: fn(x, weights) → its outputs, run as the mode says
        (see the module docstring)."""
        i = len(self.inputs)
        if self.mode == REPLAY:
            x = self.feed[i]
        ys = list(fn(x, weights))
        if self.mode == RECORD and self.feed is not None:
            ys = [y + probe for y, probe in zip(ys, self.feed[i], strict=True)]
        if self.mode == MEASURE:
            self.weights.extend(self.root(w) for w in weights)
            self.roles.extend(role for _ in weights)
        self.inputs.append(x)
        self.outputs.append(ys)
        return ys

    def scan(self, par, period: Callable, carry, xs, *, unroll: int = 1, remat: Callable | None = None):
        """The chunk's layer scan under this tape (`Parallel.scan_layers` with the tape on `par`: same arguments).

        MEASURE traces the first period alone, outside any loop, so `derive` traces its weights back to the chunk's
        arrays, and notes the periods the scan runs (`steps`) → (carry, None). RECORD and REPLAY scan `feed` (leaves
        [count, …]) beside the periods, give each period a tape of its own, and keep what those collected, stacked
        [count, …]: the group inputs (RECORD → `inputs`) or outputs (REPLAY → `outputs`); RECORD → (carry, the
        periods' outputs), REPLAY → (carry, None), W wanting nothing else. No layer is checkpointed alone: RECORD
        checkpoints the whole period under `remat` (the tape lives in its body). REPLAY checkpoints each period
        with nothing saved, whatever `remat`: W's vjp then runs no forward of its own, and its backward recomputes
        one period at a time. A group of matmuls alone needs nothing but its stashed input, but the MoE experts'
        group is a whole SwiGLU (gate and up, SiLU·mul, down), whose weight gradients need its hidden activations;
        without the checkpoint the vjp's forward scan stacks them for every layer of the chunk (mixtral_8x7b's
        zb_h1 step: bench/RESULTS.md). The FLOPs are the same: that forward only ever fed the transpose."""
        count = jax.tree.leaves(xs)[0].shape[0]
        if self.mode == MEASURE:
            self.steps = count
            return period(carry, jax.tree.map(lambda a: self.derive(a[0], a), xs), par, None)[0], None

        def tapped(carry, xs_feed):
            layers, feed = xs_feed
            tape = Tape(self.mode, feed)
            carry, ys = period(carry, layers, par.with_tape(tape), None)
            return carry, (tape.inputs, ys) if self.mode == RECORD else (tape.outputs, None)

        step = tapped
        if self.mode == REPLAY:  # nothing saved, whatever `remat` (see above)
            step = jax.checkpoint(tapped, policy=None, prevent_cse=unroll == count)
        elif remat is not None:
            step = remat(tapped, prevent_cse=unroll == count)
        carry, (collected, ys) = jax.lax.scan(step, carry, (xs, self.feed), unroll=unroll)
        if self.mode == RECORD:
            self.inputs = collected
        else:
            self.outputs = collected
        return carry, ys
