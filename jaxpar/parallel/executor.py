"""The table executor: any schedule of `jaxpar.parallel.schedule` (1F1B, interleaved 1F1B, ZB-H1, ZB-V, GPipe's
table), run tick by tick as its lowered table (`Program`) says, with explicit vjps.

Each tick every stage runs one branch — idle, F (forward), B (the backward to the activations) or W (the weight
gradients, from the tape's matmul inputs and B's output gradients) — on one microbatch of one of its chunks, and
sends activations and their gradients between stages with `ppermute`. `Chunk` fixes, before the loop, what a chunk's
F stashes for its B and W; `execute` runs the ticks (its docstring has the whole contract).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.schedule import DO_B, DO_F, Program
from jaxpar.parallel.vma import vary, varying_axes
from jaxpar.parallel.weightgrad import MEASURE, RECORD, REPLAY, Tape

Array = jax.Array


def _split_residuals(vjp_fn, known, other_trace, zero=()):
    """Sort the leaves of a vjp closure: ('param', i) — known[i], the chunk's parameters or the weights as the
    matmuls read them, taken again from the live parameters; ('zero', leaf) — one of `zero`, the zero probes (a
    checkpointed period keeps its inputs, the probes among them: all zeros, made again for B, not stashed);
    ('const', leaf) — values from outside the chunk (identical in two independent traces: masks, positions), and
    concrete arrays (not tracers, so functions of nothing traced: jax ≥ 0.12.1 keeps a numpy constant such as
    RoPE's inverse frequencies as a fresh `TypedNdArray` leaf in each trace; stashed, it would come back from the
    buffers as varying over the pipe axis, which the checkpointed period's jaxpr does not accept);
    ('stash', n) — activations the backward needs, kept per microbatch. `other_trace`: the leaves of a second
    trace."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    pid = {id(x): i for i, x in reversed(list(enumerate(known)))}
    zid = {id(x) for x in zero}
    kinds, n = [], 0
    for leaf, other in zip(leaves, other_trace):
        if id(leaf) in pid:
            kinds.append(("param", pid[id(leaf)]))
        elif id(leaf) in zid:
            kinds.append(("zero", leaf))
        elif leaf is other or not isinstance(leaf, jax.core.Tracer):
            kinds.append(("const", leaf))
        else:
            kinds.append(("stash", n))
            n += 1
    return treedef, kinds, leaves


class Chunk:
    """One chunk as the table executor runs it (`execute`), traced before the loop — dead code, which XLA drops.

    One layer traced at the top level (MEASURE) tells which parameters are matmul weights and sizes the probes
    (each group's outputs) and the tape (each group's input), [k, …] for the chunk's k periods (`Tape.steps`; a
    period is one layer unless the chunk mixes dense and MoE layers). Two traces of the chunk's forward then fix its
    vjp closure's structure and types: which leaves are parameters, zero probes or constants, and which the stash
    must hold. The refs (`stash_ref`, `tape_ref`, `dys_ref`: one chunk's worth of each slot) are what the
    executor's buffers hold a slot, and what the planner's memory model counts (`jaxpar.planner.memory`).

    chunk_fn, operand: as `execute` takes them; chunk_a, chunk_b: the chunk's parameters, twice (two traces); x0: a
    microbatch's input [mb, …]; like(x, ref): x typed as ref is (inside shard_map, as varying over the pipe axis);
    consts: the chunk's constants (`execute`'s), or None."""

    def __init__(self, chunk_fn: Callable, chunk_a, chunk_b, x0: Array, operand: Callable[[Array, str], Array],
                 like: Callable = lambda x, ref: x, consts=None):
        self.chunk_fn, self.operand, self.like = chunk_fn, operand, like
        self.params_ref = chunk_a
        param_leaves, self.param_def = jax.tree.flatten(chunk_a)
        measured = Tape(MEASURE)
        chunk_fn(chunk_a, x0, measured, consts)
        role_of = {}  # id(weight) → its matmul role, as the model contracted it
        for w, role in zip(measured.weights, measured.roles):
            if role_of.setdefault(id(w), role) != role:
                raise ValueError(f"a weight of the chunk is contracted as both {role_of[id(w)]} and {role}: "
                                 "the executor prepares each weight once, by one role's policy")
        self.is_matmul = [id(leaf) in role_of for leaf in param_leaves]
        self.roles = [role_of[id(leaf)] for leaf in param_leaves if id(leaf) in role_of]  # part(…, True)'s
        if measured.weights and not any(self.is_matmul):
            raise ValueError("the chunk contracts none of its parameters through Parallel.column / Parallel.row: "
                             "the executor's W has no weight gradients to derive")
        # (a chunk run without a tape — LoRA's, whose weight gradients are the small adapters' — records no group:
        # B derives every gradient, and W has nothing to do)
        k = measured.steps  # the chunk's scan runs k periods of layers (k layers in a uniform stack)
        self.probe_ref = [[like(jnp.zeros((k, *y.shape), y.dtype), y) for y in ys] for ys in measured.outputs]
        # the groups' inputs, flat (a group's input may be a pytree: the MoE experts' tokens and routing)
        tape_leaves, self.tape_def = jax.tree.flatten(measured.inputs)
        self.tape_ref = [like(jnp.zeros((k, *x.shape), x.dtype), x) for x in tape_leaves]
        self.dys_ref, self.dys_def = jax.tree.flatten(self.probe_ref)
        self.y0, vjp_a, _, self.stats_ref, known_a, probes_a = self.vjp(chunk_a, x0, consts)
        _, vjp_b, _, _, _, _ = self.vjp(chunk_b, x0 + 0, consts)
        self.treedef, self.kinds, self.leaves_a = _split_residuals(vjp_a, known_a, jax.tree.leaves(vjp_b), probes_a)
        self.stash_ref = [leaf for leaf, kind in zip(self.leaves_a, self.kinds) if kind[0] == "stash"]

    def zeros(self, ref):
        """Zeros shaped and typed as the pytree `ref` (through `like`)."""
        return jax.tree.map(lambda r: self.like(jnp.zeros(r.shape, r.dtype), r), ref)

    def part(self, params, matmul: bool) -> list:
        """The leaves of a chunk's parameter pytree that are matmul weights (matmul=True), or the others."""
        return [leaf for leaf, w in zip(jax.tree.leaves(params), self.is_matmul) if w == matmul]

    def join(self, weights: list, others: list):
        """The chunk's parameter pytree from its two `part`s."""
        weights, others = iter(weights), iter(others)
        return jax.tree.unflatten(self.param_def, [next(weights) if w else next(others) for w in self.is_matmul])

    def known(self, params_r, consts_r=None) -> list:
        """What B takes from the live parameters rather than the stash: the chunk's parameters, its weights as
        the matmuls read them (`operand`, by each weight's role: cast once here, or every in-flight microbatch's
        residuals would hold a compute-dtype copy of the chunk's weights), and its constants."""
        weights = self.part(params_r, True)
        return (jax.tree.leaves(params_r) + [self.operand(w, role) for w, role in zip(weights, self.roles)]
                + jax.tree.leaves(consts_r))

    def vjp(self, params_r, x, consts_r=None):
        """(y, vjp of (non-matmul params, x, probes), the groups' inputs, the chunk's statistics,
        known(params_r, consts_r), the probes' leaves). The constants are closed over: no gradient is derived."""
        leaves = self.known(params_r, consts_r)
        n = len(self.is_matmul)
        weights = leaves[n:n + sum(self.is_matmul)]  # closed over: B derives no weight gradient, F keeps no input

        def record(others, x, probes):
            tape = Tape(RECORD, probes)
            y, stats = self.chunk_fn(self.join(weights, others), x, tape, consts_r)
            return y, (tape.inputs, stats)

        probes = self.zeros(self.probe_ref)
        y, vjp_fn, (inputs, stats) = jax.vjp(record, self.part(params_r, False), x, probes, has_aux=True)
        return y, vjp_fn, inputs, stats, leaves, jax.tree.leaves(probes)

    def forward(self, params_r, x, consts_r=None):
        """F: (y, vjp, the groups' inputs, statistics, the stash: the closure's activations, typed as the refs)."""
        y, vjp_fn, inputs, stats, known_f, probes_f = self.vjp(params_r, x, consts_r)
        _, kinds_f, leaves = _split_residuals(vjp_fn, known_f, self.leaves_a, probes_f)
        if [k[0] for k in kinds_f] != [k[0] for k in self.kinds]:
            raise AssertionError("the chunk's vjp closure changed shape between traces")
        stash = [self.like(leaf, ref) for leaf, kind, ref in zip(leaves, kinds_f, self.leaves_a)
                 if kind[0] == "stash"]
        return y, vjp_fn, inputs, stats, stash

    def rebuild(self, params_r, stash, consts_r=None):
        """B: the vjp closure again, from the live parameters (and constants), fresh zero probes and a stash slot."""
        plist = self.known(params_r, consts_r)
        leaves = [plist[k[1]] if k[0] == "param" else k[1] if k[0] == "const" else
                  self.zeros(k[1]) if k[0] == "zero" else stash[k[1]] for k in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_to_objective(y: Array, term: Array, weight: float) -> Array:
    """y, unchanged; in the backward pass `term` receives the gradient `weight`, as if weight·term had been added to
    the objective. The executor differentiates each chunk from its output's gradient alone (no loss is carried
    through the ticks), so a chunk's own objective term — the MoE layers' load-balancing and z-losses of one
    microbatch, weight 1/m like its loss — enters the gradients this way (Megatron's MoEAuxLossAutoScaler). The
    executor runs no bubble work, so every attached term belongs to a real microbatch."""
    return y


def _add_fwd(y, term, weight):
    return y, term


def _add_bwd(weight, term, dy):
    return dy, jnp.zeros_like(term) + jnp.asarray(weight, term.dtype)


add_to_objective.defvjp(_add_fwd, _add_bwd)


def execute(program: Program, chunk_fn: Callable, layers, rest, tokens: Array, targets: Array, embed_fn: Callable,
            head_loss_fn: Callable, *, axis: str = "pipe",
            operand: Callable[[Array, str], Array] = lambda w, role: w, constants=None, side=None):
    """Run a schedule's ticks on this stage. Call inside shard_map with `axis` bound.

    chunk_fn(chunk_params, x [mb, …], tape, chunk_constants) → (y [mb, …], statistics): one chunk's k layers under
    `tape` (jaxpar.parallel.weightgrad), run as one scan by the tape on the model's context (`Parallel.with_tape`,
    which `jaxpar.model.run_layers` scans through); statistics: a pytree of sums the chunk reports (the MoE layers'
    routing statistics; {} for none), read from F (RECORD). What the tape collected is on it afterwards (`Tape.scan`:
    RECORD's `inputs`, REPLAY's `outputs`, [k, …]). A chunk that adds a term of its own to the objective (the MoE
    layers' aux losses) attaches it to y with `add_to_objective`.
    layers: pytree, leaves [v, …]: this stage's chunks in increasing chunk order (`Program.local`).
    rest: the parameters outside the chunks (embedding, final norm, head), held whole by every stage.
    tokens: int [m, mb, T] (or a pytree of [m, mb, …]): every microbatch's inputs; targets (a pytree of [m, mb, …]):
    what the head scores each
    against (the step passes the token rows [m, mb, T+1] — with their loss mask where the batch has one —, which
    the MTP modules read beyond the next-token targets).
    embed_fn(rest, tokens [mb, T] (its pytree)) → x [mb, …];  head_loss_fn(rest, y [mb, …], targets [mb, …]) → (mean loss,
    sums: a pytree the head reports, {} for none — summed over the microbatches, not differentiated). A head that
    adds terms of its own to the objective (the MTP loss) attaches them to the loss with `add_to_objective`.
    operand(w, role): a matmul weight as the contraction of its role reads it (jaxpar.matmul: the role's policy's
    `Einsum.operand`; the role is the one the model named for the weight, which the tape records).
    constants: None, or a pytree with leaves [v, …] like `layers` that the chunks read but are not differentiated
    for (the layers' buffers: jaxpar.model.Buffer); chunk_fn gets the chunk's (None without constants), and no
    gradient is computed or returned for them.
    side: None, or a pytree of [m, …] — what each microbatch's chunks read beside their input (packed documents'
    positions and segment ids); chunk_fn then gets (the chunk's constants, the microbatch's side) as its constants,
    at F, at B (which rebuilds the closure from them) and at W alike.

    Returns (loss, layer_grads, rest_grads, stats, head_sums), this stage's share: loss = Σ_j loss_j / m over the
    microbatches whose last chunk it holds; the complete gradients of its chunks; the gradients of `rest` from the
    microbatches it embedded or finished; its chunks' statistics summed over every F (each microbatch once per
    chunk), per chunk like the gradients (each leaf [v, …], row r the chunk `layers` holds in row r); the head's
    sums over the microbatches it finished. Summed over `axis`, loss, rest_grads and head_sums are the step's.

    Each tick every stage runs one branch of a `lax.switch` on its action — idle, F, B or W — so an idle tick
    computes nothing. The chunk runs under a tape (`jaxpar.parallel.weightgrad`), which splits its backward in two:

        F  `jax.vjp` of the chunk with respect to its input, its non-matmul parameters (norms, biases) and zero
           probes on the matmul outputs; the weights are closed over. Stashes the residuals (the vjp closure's
           leaves that are activations, not weights, outside constants or the zero probes) and every matmul group's
           input (tape).
        B  rebuilds the closure from its stash: the input gradient (sent on; the first chunk's goes into the
           embedding), the non-matmul parameters' gradients, and every matmul's output gradient dy (kept in dys).
        W  Σ xᵀ·dy over the chunk's matmuls, from the tape and dys slots.

    So B and W split the backward's work as Qi et al. do, and nothing is derived twice. The branches return small
    values and the buffers are written after the switch (scratch slots take what is not for keeping): a branch that
    passes the buffers through and updates them itself makes XLA:CPU copy them every tick (measured: 2-3x the step
    time).

    What a stage sends at tick t (F's output or B's input gradient) travels in one collective-permute per direction
    used at the end of the tick and is read at t + 1 or later from the inbox.
    """
    table = program.table
    p, m = table.stages, table.microbatches
    s = jax.lax.axis_index(axis)

    def like(x, ref):
        # typed as ref is, and as varying over `axis`: every stage picks its own branch, so whatever leaves a branch
        # varies over `axis` whether or not it was computed from something that did
        return vary(x, tuple(varying_axes(ref) | {axis}))

    def micro(tree, j):  # microbatch j of a pytree of [m, …]
        return jax.tree.map(lambda a: a[j], tree)

    x0 = embed_fn(rest, micro(tokens, 0))

    def consts_of(r, j):  # chunk r's constants, with microbatch j's side where there is one
        own = None if constants is None else jax.tree.map(lambda a: a[r], constants)
        return own if side is None else (own, micro(side, j))

    chunk = Chunk(chunk_fn, jax.tree.map(lambda a: a[0], layers), jax.tree.map(lambda a: a[0], layers), x0,
                  operand, like, consts_of(0, 0))
    zeros = chunk.zeros
    chunk_a, stash_ref, tape_ref, dys_ref = chunk.params_ref, chunk.stash_ref, chunk.tape_ref, chunk.dys_ref
    stats_ref, y0 = chunk.stats_ref, chunk.y0
    loss_ref, head_ref = head_loss_fn(rest, y0, micro(targets, 0))
    msg_ref = vary(jnp.zeros_like(y0), tuple(varying_axes(x0) | varying_axes(y0) | {axis}))  # inbox, messages

    def typed_rest(tree):  # gradients of `rest`, typed as the branches' common output
        return jax.tree.map(like, tree, rest)

    def nothing():
        """A branch's outputs, all zero: (stash, tape, dys, message, chunk grads, rest grads, loss, statistics,
        head sums)."""
        return (zeros(stash_ref), zeros(tape_ref), zeros(dys_ref), zeros(msg_ref), zeros(chunk_a), zeros(rest),
                zeros(loss_ref), zeros(stats_ref), zeros(head_ref))

    def forward(g, params_r, consts_r, inbox):
        j = g["micro"]
        x = jax.lax.cond(g["first"] == 1, lambda: like(embed_fn(rest, micro(tokens, j)), msg_ref),
                         lambda: like(inbox[g["x_slot"]], msg_ref))
        y, vjp_fn, inputs, stats, stash = chunk.forward(params_r, x, consts_r)

        def head(y):
            def scaled(r_, y_):
                loss, sums = head_loss_fn(r_, y_, micro(targets, j))
                return loss / m, sums

            (loss, sums), (d_rest, dy) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(rest, y)
            return (like(loss, loss_ref), typed_rest(d_rest), like(dy, msg_ref),
                    jax.tree.map(like, sums, head_ref))

        def no_head(y):
            return like(jnp.zeros((), loss_ref.dtype), loss_ref), zeros(rest), like(y, msg_ref), zeros(head_ref)

        loss, d_rest, msg, sums = jax.lax.cond(g["last"] == 1, head, no_head, y)
        _, _, dys, _, d_chunk, _, _, _, _ = nothing()
        return (stash, [like(a, r) for a, r in zip(jax.tree.leaves(inputs), tape_ref)], dys, msg, d_chunk, d_rest,
                loss, jax.tree.map(like, stats, stats_ref), sums)

    def input_grads(g, params_r, consts_r, inbox, stash_buf):
        """B: from the stash and the output gradient in the inbox."""
        stash, tape, _, _, d_chunk, _, loss, stats, sums = nothing()
        d_others, dx, d_probes = chunk.rebuild(params_r, [b[g["stash"]] for b in stash_buf],
                                               consts_r)(inbox[g["x_slot"]])
        dys = [like(d, r) for d, r in zip(jax.tree.leaves(d_probes), dys_ref)]
        d_chunk = jax.tree.map(like, chunk.join(chunk.part(d_chunk, True), d_others), chunk_a)
        j = g["micro"]

        def embed_grad(dx):
            _, vjp_e = jax.vjp(lambda r_: embed_fn(r_, micro(tokens, j)), rest)
            return typed_rest(vjp_e(like(dx, x0))[0])

        d_rest = jax.lax.cond(g["first"] == 1, embed_grad, lambda dx: zeros(rest), dx)
        return stash, tape, dys, like(dx, msg_ref), d_chunk, d_rest, loss, stats, sums

    def weight_grads(g, params_r, consts_r, tape_buf, dys_buf):
        """W: Σ xᵀ·dy over the chunk's matmuls, each group replayed on its stashed input."""
        stash, tape, dys, msg, d_chunk, d_rest, loss, stats, sums = nothing()
        if not any(chunk.is_matmul):  # no tape (LoRA's chunks): B derived every gradient
            return stash, tape, dys, msg, d_chunk, d_rest, loss, stats, sums
        others = chunk.part(params_r, False)

        def replay(weights):
            tape = Tape(REPLAY, jax.tree.unflatten(chunk.tape_def, [b[g["tape"]] for b in tape_buf]))
            chunk_fn(chunk.join(weights, others), zeros(msg_ref), tape, consts_r)
            return tape.outputs

        _, vjp_w = jax.vjp(replay, chunk.part(params_r, True))
        (d_weights,) = vjp_w(jax.tree.unflatten(chunk.dys_def, [b[g["dys"]] for b in dys_buf]))
        d_chunk = jax.tree.map(like, chunk.join(d_weights, chunk.part(d_chunk, False)), chunk_a)
        return stash, tape, dys, msg, d_chunk, d_rest, loss, stats, sums

    sends = program.sends()
    to_next = [(i, (i + 1) % p) for i in range(p)]
    to_prev = [(i, (i - 1) % p) for i in range(p)]

    def keep(bufs, values, write):
        return [b.at[write].set(x) for b, x in zip(bufs, values)]

    def tick(carry, row):
        inbox, stash_buf, tape_buf, dys_buf, down, up, grads, d_rest_sum, loss_sum, stats_sum, head_sum = carry
        g = {k: v[s] for k, v in row.items()}
        if sends["down"]:
            inbox = inbox.at[g["recv_down"]].set(down)
        if sends["up"]:
            inbox = inbox.at[g["recv_up"]].set(up)
        params_r, consts_r = jax.tree.map(lambda a: a[g["local"]], layers), consts_of(g["local"], g["micro"])
        branches = [  # in the order of the kinds: IDLE, DO_F, DO_B, DO_W (jaxpar.parallel.schedule)
            nothing,
            lambda: forward(g, params_r, consts_r, inbox),
            lambda: input_grads(g, params_r, consts_r, inbox, stash_buf),
            lambda: weight_grads(g, params_r, consts_r, tape_buf, dys_buf),
        ]
        stash, tape, dys, msg, d_chunk, d_rest, loss, stats, sums = jax.lax.switch(
            g["kind"], [lambda _, b=b: b() for b in branches], None)
        # Slots that are not this tick's target are the scratch slot (the last): the writes need no select.
        stash_buf = keep(stash_buf, stash, jnp.where(g["kind"] == DO_F, g["stash"], program.n_stash))
        tape_buf = keep(tape_buf, tape, jnp.where(g["kind"] == DO_F, g["tape"], program.n_tape))
        dys_buf = keep(dys_buf, dys, jnp.where(g["kind"] == DO_B, g["dys"], program.n_dys))
        inbox = inbox.at[g["local_slot"]].set(msg)
        grads = jax.tree.map(lambda acc, d: acc.at[g["local"]].add(d), grads, d_chunk)
        d_rest_sum = jax.tree.map(jnp.add, d_rest_sum, d_rest)
        stats_sum = jax.tree.map(lambda acc, d: acc.at[g["local"]].add(d), stats_sum, stats)  # 0 but after F
        # Both directions carry this tick's message; a receiver keeps it only where the table says it is its own.
        if sends["down"]:
            down = jax.lax.ppermute(msg, axis, to_next)
        if sends["up"]:
            up = jax.lax.ppermute(msg, axis, to_prev)
        head_sum = jax.tree.map(jnp.add, head_sum, sums)
        return (inbox, stash_buf, tape_buf, dys_buf, down, up, grads, d_rest_sum, loss_sum + loss, stats_sum,
                head_sum), None

    def buffer(refs, n):
        return [jnp.broadcast_to(zeros(r), (n + 1, *r.shape)) for r in refs]

    carry = (buffer([msg_ref], program.n_inbox)[0], buffer(stash_ref, program.n_stash),
             buffer(tape_ref, program.n_tape), buffer(dys_ref, program.n_dys), zeros(msg_ref), zeros(msg_ref),
             zeros(layers), zeros(rest), zeros(loss_ref),
             jax.tree.map(lambda r: jnp.broadcast_to(zeros(r), (jax.tree.leaves(layers)[0].shape[0], *r.shape)),
                          stats_ref), zeros(head_ref))
    rows = {k: jnp.asarray(v) for k, v in program.arrays().items()}
    (_, _, _, _, _, _, grads, d_rest, loss, stats, head_sums), _ = jax.lax.scan(tick, carry, rows)
    return loss, grads, d_rest, stats, head_sums
