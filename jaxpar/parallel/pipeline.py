"""The circular pipeline over the mesh axis `pipe` (GPipe is the one-repeat case).

Counts (p = stages, v = repeats, m = microbatches, L = layers, q = m/p, k = L/(p·v) layers per stage per pass):
- Layer l = (r·p + s)·k + i runs on stage s in pass r. The stacked layer axis is kept *stage-major* in memory,
  position (s·v + r)·k + i (`pipeline_order`), so an even split over `pipe` hands stage s exactly its v·k layers and
  the local view [v, k, …] is the [repeats, stages, layers_per_stage, …] array with the stage dim sharded away.
- Stage s at iteration t works on microbatch j = (t − s) mod m in pass r = ⌊(t − s)/m⌋, valid when 0 ≤ t − s < v·m.
  The last valid work is stage p−1 at t = v·m + p − 2, so `iterations = v·m + p − 1`; every stage idles p − 1 of them:
  bubble fraction (p − 1)/(v·m + p − 1).
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

Array = jax.Array


def iterations(stages: int, repeats: int, microbatches: int) -> int:
    """Loop iterations of the circular schedule: v·m to push every microbatch through v passes, p − 1 to fill."""
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    """Idle share of a stage's iterations: (p − 1) / (v·m + p − 1)."""
    return (stages - 1) / iterations(stages, repeats, microbatches)


def pipeline_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """order[n] = the model layer stored at position n of the stacked axis (stage-major: n = (s·v + r)·k + i)."""
    k = layers // (stages * repeats)
    s, r, i = np.meshgrid(np.arange(stages), np.arange(repeats), np.arange(k), indexing="ij")
    return ((r * stages + s) * k + i).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The circular pipeline's counts: p stages, v repeats, m microbatches, L layers (the plan holds one when
    pipe > 1; `circular` and the step read them)."""

    stages: int
    repeats: int
    microbatches: int
    layers: int

    @property
    def layer_order(self) -> np.ndarray:
        """order[n] = the model layer at position n of the stacked axis in memory (`pipeline_order`)."""
        return pipeline_order(self.layers, self.stages, self.repeats)

    @property
    def iterations(self) -> int:
        return iterations(self.stages, self.repeats, self.microbatches)


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


def circular(stage_fn: Callable[[object, Array], Array], stage_params, inputs: Array, *, stages: int, repeats: int,
             microbatches: int, axis: str = "pipe") -> Array:
    """Run the pipeline on this stage's microbatches. Call inside shard_map with `axis` bound.

    stage_fn(params_of_one_pass, x [mb, …]) → [mb, …]: this stage's k layers.
    stage_params: pytree whose leaves lead with [v, …] (this stage's layers, one entry per pass).
    inputs: io [q, mb, …]. Returns io [q, mb, …] holding the finished microbatches `output_order(...)[s]`.
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
        y = stage_fn(jax.tree.map(lambda a: a[r], stage_params), x)
        io, park = stage_zero_receive(io, park, shift, t)
        sent = jax.lax.ppermute(jnp.stack([io[c], y]), axis, to_next)  # [2, mb, …]: one collective for both
        io, shift = io.at[c].set(sent[0]), sent[1]
        return (io, shift, park), None

    shift = jnp.zeros_like(inputs[0])
    # zeros_like keeps the inputs' varying-axes type (check_vma: a scan carry must keep its type).
    park = jnp.broadcast_to(shift, (m,) + shift.shape) if use_park else jnp.zeros((), inputs.dtype)
    n = iterations(p, v, m)
    (io, shift, park), _ = jax.lax.scan(iteration, (inputs, shift, park), jnp.arange(n))
    io, _ = stage_zero_receive(io, park, shift, n)  # epilogue: the last microbatch arrives after the last iteration
    return io


def draw_schedule(stages: int, repeats: int, microbatches: int, path: str) -> None:
    """Save the schedule as a picture: stages as rows, iterations as columns, one colour per microbatch, darker for
    later passes, bubbles blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = schedule(stages, repeats, microbatches)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(table)), 0.6 * stages + 1.2))
    colours = plt.get_cmap("tab20")
    for t, row in enumerate(table):
        for s, slot in enumerate(row):
            if slot is None:
                continue
            shade = 1.0 - 0.45 * slot.repeat / max(repeats - 1, 1)
            r, g, b, _ = colours(slot.microbatch % 20)
            ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=(r * shade, g * shade, b * shade), edgecolor="white"))
            ax.text(t + 0.5, s + 0.5, f"{slot.microbatch}.{slot.repeat}", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(table))
    ax.set_xticks(range(0, len(table) + 1, max(1, len(table) // 16)))
    ax.set_ylim(stages, 0)
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("iteration (cells: microbatch.pass)")
    ax.set_title(f"circular pipeline p={stages} v={repeats} m={microbatches}: {len(table)} iterations, "
                 f"bubble {bubble_fraction(stages, repeats, microbatches):.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
