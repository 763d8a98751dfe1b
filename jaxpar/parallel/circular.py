"""The circular pipeline over the mesh axis `pipe` (GPipe is the one-repeat case): one loop, differentiated by
autodiff (`jaxpar.parallel.pipeline` holds the counts and the layer order; `executor` runs the schedule tables).

Counts (p = stages, v = repeats, m = microbatches, L = layers, q = m/p, k = L/(p·v) layers per stage per pass):
- Layer l = (r·p + s)·k + i runs on stage s in pass r. The stacked layer axis is kept *stage-major* in memory,
  position (s·v + r)·k + i (`pipeline_order`), so an even split over `pipe` hands stage s exactly its v·k layers and
  the local view [v, k, …] is the [repeats, stages, layers_per_stage, …] array with the stage dim sharded away.
- Stage s at iteration t works on microbatch j = (t − s) mod m in pass r = ⌊(t − s)/m⌋, valid when 0 ≤ t − s < v·m.
  The last valid work is stage p−1 at t = v·m + p − 2, so `iterations = v·m + p − 1`; every stage idles p − 1 of them:
  bubble fraction (p − 1)/(v·m + p − 1). By default a stage runs its layers in the bubble too, on placeholder
  inputs, and the results are discarded. With `skip_bubble` (`parallel.skip_bubble`) a `lax.cond` on 0 ≤ t − s < v·m
  takes a branch that returns zeros instead. On real devices the bubble is idle time either way; on devices that
  share cores (simulated CPU devices) it is compute the other stages get back. The price is memory: XLA's
  conditional takes its operands and gives its results as buffers of its own, so an iteration's activations are
  copied into the branch and its residuals out of it (forward and backward). Not with layers that run
  collective-permutes (collective matmul's ring, ring attention): XLA waits for every device of the mesh at each,
  so they cannot sit in a branch only some stages take (the config refuses it).
- A microbatch leaves stage p−1 after pass r at t = r·m + j + p − 1 and arrives at stage 0 at t + 1; it is needed
  there at (r+1)·m + j, so m ≥ p. If m > p it waits m − p iterations in `park` (stage 0 only uses it).

Buffers, per device (mb = rows per microbatch, … = [T or T/t under SP, D]):
    io    [q, mb, …]  this stage's share of the microbatch stream. Starts as its own q embedded microbatches and
                      ends holding q finished ones (`output_order`). Column c = t mod q is the stream slot of
                      iteration t: stage 0 reads its input from it (pass 0), stage 0 writes a finished microbatch into
                      it (last pass), then the column moves one stage on (s → s+1, p−1 → 0) — one microbatch per
                      stage per iteration, so over the run every input passes stage 0 and every output is carried off
                      it. Moving one way, the column k times rotated brings stage 0 the column stage −k mod p started
                      with, so microbatch j (the input stage 0 takes at iteration j) is the one stage −⌊j/q⌋ mod p
                      embedded in its slot j mod q.
    shift [mb, …]     the activation the previous stage sent this iteration (s → s+1, p−1 → 0).
    park  [m, mb, …]  stage 0's waiting room for pass r+1 inputs (only when v > 1 and m > p).

Why inputs and outputs are spread: embedding, final norm, LM head and loss then run outside the loop on each stage's
own q microbatches, with `pipe` acting as a batch axis — no stage repeats another's embedding or head work. A stage
ends up with different microbatches than it started with (`output_order`); the loss pairs them with the right targets
(token ids, all-gathered over `pipe`: 4 bytes a token, against h·β for the activations).

Gradients come from autodiff through the loop (the buffer moves are linear: selects, slices and ppermutes).
The io column and the shift travel the same way, so each iteration sends them together, as one collective-permute
of the two stacked microbatch activations (one more in the backward): a collective's fixed cost — a rendezvous of
every device, a launch — is paid once per iteration, not twice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import vma
from jaxpar.parallel.pipeline import bubble_fraction, iterations

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Slot:
    microbatch: int
    repeat: int


def schedule(stages: int, repeats: int, microbatches: int) -> list[list[Slot | None]]:
    """table[t][s]: the (microbatch, repeat) stage s runs at iteration t, or None in the bubble."""
    table = []
    for t in range(iterations(stages, repeats, microbatches)):
        row = []
        for s in range(stages):
            u = t - s
            row.append(Slot(u % microbatches, u // microbatches) if 0 <= u < repeats * microbatches else None)
        table.append(row)
    return table


def format_schedule(stages: int, repeats: int, microbatches: int) -> str:
    """The schedule as a text grid: one row per stage, one column per iteration, cells `j.r` (microbatch.repeat)."""
    table = schedule(stages, repeats, microbatches)
    width = max(len(f"{microbatches - 1}.{repeats - 1}"), 3)
    lines = ["iter   " + " ".join(f"{t:>{width}}" for t in range(len(table)))]
    for s in range(stages):
        cells = [f"{c.microbatch}.{c.repeat}" if (c := row[s]) else "-" for row in table]
        lines.append(f"stage{s} " + " ".join(f"{c:>{width}}" for c in cells))
    f = bubble_fraction(stages, repeats, microbatches)
    lines.append(f"iterations {len(table)} = v·m + p − 1 = {repeats}·{microbatches} + {stages} − 1;  "
                 f"bubble (p − 1)/(v·m + p − 1) = {f:.3f}")
    return "\n".join(lines)


def output_order(stages: int, repeats: int, microbatches: int) -> np.ndarray:
    """[p, q]: for each io slot when `circular` returns, the io slot (as s·q + c, stage-major) whose embedded
    microbatch it then holds finished — the same buffer rules as the loop, replayed on labels. The loss reads the
    targets of the rows it holds through it."""
    p, m = stages, microbatches
    q = m // p
    n = iterations(p, repeats, m)
    # Label the inputs by the iteration stage 0 takes them (see the module docstring): stage s starts with
    # microbatches ((p − s) mod p)·q + c in its slots c.
    io = ((p - np.arange(p)[:, None]) % p) * q + np.arange(q)[None, :]
    for t in range(n + 1):  # the last step (t = N) is the epilogue write
        c, u = t % q, t - p
        if 0 <= u < repeats * m and u // m == repeats - 1:
            io[0, c] = 1000 + u % m  # a finished microbatch, labelled apart from inputs
        if t < n:
            io[:, c] = np.roll(io[:, c], 1)  # s → s+1
    assert (io >= 1000).all(), "every io slot must end holding a finished microbatch"
    j = io - 1000  # the finished microbatch each slot holds; it started at stage −⌊j/q⌋ mod p, slot j mod q
    final = (-(j // q) % p) * q + j % q
    assert sorted(final.reshape(-1)) == list(range(m))
    return final


def circular(stage_fn: Callable[..., Array], stage_params, inputs: Array, *, stages: int, repeats: int,
             microbatches: int, axis: str = "pipe", stats: bool = False, side=None, skip_bubble: bool = False):
    """Run the pipeline on this stage's microbatches. Call inside shard_map with `axis` bound.

    stage_fn(params_of_one_pass, x [mb, …]) → [mb, …]: this stage's k layers.
    stage_params: pytree whose leaves lead with [v, …] (this stage's layers, one entry per pass).
    inputs: io [q, mb, …]. Returns io [q, mb, …] holding the finished microbatches `output_order(...)[s]`.
    side: None, or a pytree of [m, …] in microbatch-label order (label j: the input stage 0 takes at iteration j,
    which stage −⌊j/q⌋ mod p embedded in its slot j mod q) — what a microbatch's layers read beside their input
    (packed documents' positions and segment ids); stage_fn is then called as stage_fn(params, x, side[j]) for the
    microbatch j it works on.
    stats: stage_fn returns (y, a pytree of sums) — the MoE layers' statistics, per layer — and the pipeline returns
    (io, their totals over this stage's real work per pass, each leaf [v, …]: row r is pass r's layers, the stage's
    chunk r): bubble iterations are left out.
    skip_bubble: bubble iterations skip stage_fn (module docstring); never where stage_fn runs collective-permutes.
    """
    p, v, m = stages, repeats, microbatches
    q = m // p
    s = jax.lax.axis_index(axis)
    to_next = [(i, (i + 1) % p) for i in range(p)]  # shift and io column: s → s+1, the last stage wraps to the first
    use_park = v > 1 and m > p

    def stage_zero_receive(io, park, shift, t):
        """What stage 0 does with the activation arriving from stage p−1 (its iteration t−1 output of microbatch
        u mod m, u = t − p): keep it as a finished output (last pass) or park it for the next pass."""
        u = t - p
        c = t % q
        finished = (s == 0) & (u >= 0) & (u // m == v - 1)
        io = io.at[c].set(jnp.where(finished, shift, io[c]))
        if use_park:
            wait = (s == 0) & (u >= 0) & (u // m < v - 1)
            j = jnp.maximum(u, 0) % m
            park = park.at[j].set(jnp.where(wait, shift, park[j]))
        return io, park

    def run(work):
        params_r, x, side_j = work
        return stage_fn(params_r, x) if side is None else stage_fn(params_r, x, side_j)

    def iteration(carry, t):
        io, shift, park = carry
        c = t % q
        u = t - s  # this stage works on microbatch u mod m, pass u // m
        if p == m or v == 1:
            later_pass = shift
        else:
            later_pass = park[t % m]
        first = jnp.where(t < m, io[c], later_pass)  # stage 0's input
        x = jnp.where(s == 0, first, shift)
        r = jnp.clip(u // m, 0, v - 1)
        params_r = jax.tree.map(lambda a: a[r], stage_params)
        side_j = None if side is None else jax.tree.map(lambda a: a[jnp.mod(u, m)], side)
        work = (params_r, x, side_j)
        real = (u >= 0) & (u < v * m)  # the stage holds a real microbatch; else the bubble
        if skip_bubble:
            y = jax.lax.cond(real, run, lambda w: jax.tree.map(vma.zeros, jax.eval_shape(run, w)), work)
        else:
            y = run(work)
        done = None
        if stats:  # this iteration's sums count only if the stage held a real microbatch, in row r
            y, done = y
            row = (jnp.arange(v) == r) & real  # [v]
            done = jax.tree.map(lambda a: jnp.where(row.reshape(v, *[1] * a.ndim), a[None], 0).astype(a.dtype), done)
        io, park = stage_zero_receive(io, park, shift, t)
        sent = jax.lax.ppermute(jnp.stack([io[c], y]), axis, to_next)  # [2, mb, …]: one collective for both
        io, shift = io.at[c].set(sent[0]), sent[1]
        return (io, shift, park), done

    shift = jnp.zeros_like(inputs[0])
    # zeros_like keeps the inputs' varying-axes type (check_vma: a scan carry must keep its type).
    park = jnp.broadcast_to(shift, (m,) + shift.shape) if use_park else jnp.zeros((), inputs.dtype)
    n = iterations(p, v, m)
    (io, shift, park), per_iteration = jax.lax.scan(iteration, (inputs, shift, park), jnp.arange(n))
    io, _ = stage_zero_receive(io, park, shift, n)  # epilogue: the last microbatch arrives after the last iteration
    return (io, jax.tree.map(lambda a: a.sum(0), per_iteration)) if stats else io
