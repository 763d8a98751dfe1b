"""Pipeline schedules as data: for every tick and stage, one action — F, B or W of a (microbatch, chunk) — or idle.

Terms (p stages, v chunks per stage, m microbatches, L layers): the model's layers are cut into C = p·v chunks of
k = L/C consecutive layers; `placement[c]` is the stage that holds chunk c (round-robin `c mod p` for every schedule
but ZB-V, whose V puts chunks c and 2p−1−c on stage c). A microbatch runs F of chunks 0 … C−1 in order, then the
backward in the reverse order; each chunk's backward is two actions, as in the zero-bubble papers:

    F(j, c)  forward: the chunk's layers on microbatch j's activation; the last chunk also runs head, loss and the
             loss gradient, so its B can follow at once.
    B(j, c)  input gradient: ∂loss/∂(chunk input), sent on to chunk c − 1 (the first chunk's goes into the embedding).
    W(j, c)  weight gradient: ∂loss/∂(chunk weights), accumulated; nothing depends on it but the optimizer step.

A tick is one unit of time and every action takes one (F = B = W, the papers' accounting). A schedule is a placement
and, per stage, a policy that picks the next action; `build` plays the ticks: a stage runs an action only when what
it needs was produced at an earlier tick (F(j, c−1), B(j, c+1) or its own F(j, c), B(j, c)) — a send made at tick t
is received at t + 1. The result, a `Table`, is all the executor (`jaxpar.parallel.executor.execute`) needs, and its
bubble and memory are counted here, from the table:

    gpipe             v = 1: all F, then all B/W — every microbatch in flight at the peak
    circular          v chunks round-robin, all F then all B/W: the table of `circular.circular`, whose backward
                      autodiff writes (that loop is the reference; `parallel.schedule=circular` runs it)
    1f1b              v = 1: p−s−1 warm-up forwards, then one F and one backward (B, W) in turn: ≤ p − s
                      microbatches in flight on stage s, whatever m is
    interleaved_1f1b  Megatron-Core's order over v ≥ 2 chunks (m a multiple of p): in flight bounded in m
    zb_h1             Qi et al.'s ZB-H1: 1F1B's warm-up, stage s defers each W by s microbatches; ≤ p in flight
                      (1F1B's peak), and only the ramp down left idle
    zbv               the V placement, 2 chunks per stage, a greedy order (B, else W, else F below 2p chunk-
                      activations in flight: 1F1B's p microbatches of a whole stage)

Bubbles, each the table's own count (`formula_bubble` derives them): 2(p−1)/(3vm+2(p−1)) for the fixed orders
(gpipe and 1f1b at v = 1), (p−1)/(3m+p−1) for ZB-H1, (p−1)/(6m+p−1) for ZB-V (in half-stage ticks).

"In flight" counts a (microbatch, chunk) from its F to its W: what the stage must keep (the vjp residuals).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.errors import ConfigError

F, B, W = "F", "B", "W"

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # F | B | W
    microbatch: int
    chunk: int  # the model chunk: layers chunk·k … chunk·k + k − 1

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclasses.dataclass(frozen=True)
class Table:
    """ticks[t][s]: the action stage s runs at tick t (None: idle)."""

    name: str
    stages: int
    chunks: int  # v, chunks per stage
    microbatches: int
    placement: tuple[int, ...]  # placement[c]: the stage that holds chunk c
    ticks: tuple[tuple[Action | None, ...], ...]

    @property
    def n_chunks(self) -> int:
        return self.stages * self.chunks

    def local_chunk(self, c: int) -> int:
        """Index of chunk c among its stage's chunks (0 … v−1), in increasing chunk order."""
        return sum(1 for d in range(c) if self.placement[d] == self.placement[c])

    @property
    def n_ticks(self) -> int:
        return len(self.ticks)

    @property
    def bubble(self) -> float:
        """Idle share of all (tick, stage) cells."""
        idle = sum(a is None for row in self.ticks for a in row)
        return idle / (self.n_ticks * self.stages)

    def in_flight(self) -> list[int]:
        """Per stage, the most (microbatch, chunk) pairs between their F and their W at any tick."""
        peak = [0] * self.stages
        live = [0] * self.stages
        for row in self.ticks:
            for s, a in enumerate(row):
                if a is not None and a.kind == F:
                    live[s] += 1
                    peak[s] = max(peak[s], live[s])
                elif a is not None and a.kind == W:
                    live[s] -= 1
        return peak

    def when(self) -> dict[Action, int]:
        """The tick of every action."""
        return {a: t for t, row in enumerate(self.ticks) for a in row if a is not None}


def needs(a: Action, n_chunks: int) -> list[Action]:
    """What action a waits for (each must run at an earlier tick): F the previous chunk's F; B its own F and the
    next chunk's B (the last chunk's B takes the loss gradient its own F made); W its own B."""
    j, c = a.microbatch, a.chunk
    if a.kind == F:
        return [Action(F, j, c - 1)] if c else []
    if a.kind == B:
        return [Action(F, j, c)] + ([Action(B, j, c + 1)] if c < n_chunks - 1 else [])
    return [Action(B, j, c)]


def placement(name: str, stages: int, chunks: int) -> tuple[int, ...]:
    """placement[c]: the stage that holds chunk c — round-robin, or ZB-V's V (chunks s and 2p − 1 − s on stage s)."""
    if name == "zbv":
        return tuple(range(stages)) + tuple(reversed(range(stages)))
    return tuple(c % stages for c in range(stages * chunks))


def formula_bubble(name: str, stages: int, chunks: int, microbatches: int) -> float:
    """Idle share of the table at F = B = W (one tick each), from the schedule's shape.

    The fixed-order schedules (gpipe, circular, 1f1b, interleaved_1f1b) idle 2(p − 1) ticks per stage: the first
    microbatch's F down the p stages and its B back up. Megatron's (p − 1)/(v·m + p − 1) counts the backward as one
    action (B and W fused, sent after both); here the input gradient is sent at B, before W, so the ramp back up is
    p − 1 single ticks, not p − 1 double ones. ZB-H1 defers W far enough that only the ramp down is left: p − 1 of
    3m ticks, Qi et al.'s (p − 1)(T_F + T_B − T_W). ZB-V's ticks are half-stage chunks: the last stage cannot start
    before tick p − 1, and after that no stage idles: p − 1 of 6m + p − 1 ticks."""
    p, v, m = stages, chunks, microbatches
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "zbv":
        return (p - 1) / (6 * m + p - 1)
    return 2 * (p - 1) / (3 * v * m + 2 * (p - 1))


def check(name: str, stages: int, chunks: int, microbatches: int) -> tuple[str, object, str, str] | None:
    """Why (name, p, v, m) is not a schedule `build` makes, as (config field, value, rule, fix) — None when it is."""
    p, v, m = stages, chunks, microbatches
    if name not in SCHEDULES:
        return "parallel.schedule", name, "not a pipeline schedule", f"use one of {', '.join(SCHEDULES)}"
    if p < 2:
        return ("parallel.schedule", name, "a pipeline schedule needs parallel.pipe >= 2 stages",
                "set parallel.pipe >= 2, or leave parallel.schedule at 'circular'")
    if name in ("gpipe", "1f1b", "zb_h1") and v != 1:
        return ("parallel.repeats", v, f"{name} runs one chunk per stage", "set parallel.repeats=1, or use "
                "interleaved_1f1b for several chunks per stage")
    if name == "zbv" and v != 2:
        return "parallel.repeats", v, "zbv places exactly 2 chunks per stage (the V)", "set parallel.repeats=2"
    if name == "interleaved_1f1b" and v < 2:
        return ("parallel.repeats", v, "interleaved_1f1b interleaves >= 2 chunks per stage",
                "set parallel.repeats >= 2, or use 1f1b")
    if name == "interleaved_1f1b" and (m % p or m < p):
        fix = f"use microbatches {p}" if m < p else f"use microbatches {m // p * p} or {(m // p + 1) * p}"
        return ("parallel.microbatches", m, f"interleaved_1f1b sends microbatches round the stages in groups of "
                f"parallel.pipe = {p}, so it needs a multiple of {p}", fix)
    if m < 1:
        return "parallel.microbatches", m, "must be >= 1", "use microbatches >= 1"
    return None


# -----------------------------------------------------------------------------------------------------------------
# Per-stage policies: a fixed sequence (run its next action once that action's inputs exist), or ZB-V's greedy
# choice among the ready actions.


@dataclasses.dataclass
class _Stage:
    order: list[Action] | None  # fixed-order policies: the whole sequence; greedy ones: None
    live: int = 0  # (microbatch, chunk) between F and W


def _fixed_order(p: int, v: int, m: int, name: str, s: int) -> list[Action]:
    """The per-stage action sequence of the fixed-order schedules (a backward is B then W at once)."""
    if name == "gpipe":
        fwd = [Action(F, j, s) for j in range(m)]
        return fwd + [x for j in range(m) for x in (Action(B, j, s), Action(W, j, s))]
    if name == "circular":
        fwd = [Action(F, j, r * p + s) for r in range(v) for j in range(m)]
        bwd = [x for a in reversed(fwd) for x in (Action(B, a.microbatch, a.chunk), Action(W, a.microbatch, a.chunk))]
        return fwd + bwd
    if name == "1f1b":
        warm = min(p - s - 1, m)
        seq = [Action(F, j, s) for j in range(warm)]
        for i in range(m - warm):
            seq += [Action(F, warm + i, s), Action(B, i, s), Action(W, i, s)]
        for i in range(m - warm, m):
            seq += [Action(B, i, s), Action(W, i, s)]
        return seq
    if name == "interleaved_1f1b":
        # Megatron-Core's order: forwards walk the chunks in groups of p microbatches; backwards the same with the
        # chunks reversed; (p − s − 1)·2 + (v − 1)·p forwards of warm-up, then one forward and one backward in turn.
        n = m * v

        def fwd(i: int) -> Action:
            g, w = divmod(i, p * v)
            return Action(F, g * p + w % p, (w // p) * p + s)

        def bwd(i: int) -> Action:
            g, w = divmod(i, p * v)
            return Action(B, g * p + w % p, (v - 1 - w // p) * p + s)

        warm = min((p - s - 1) * 2 + (v - 1) * p, n)
        seq = [fwd(i) for i in range(warm)]
        for i in range(n - warm):
            b = bwd(i)
            seq += [fwd(warm + i), b, Action(W, b.microbatch, b.chunk)]
        for i in range(n - warm, n):
            b = bwd(i)
            seq += [b, Action(W, b.microbatch, b.chunk)]
        return seq
    if name == "zb_h1":
        # Qi et al.'s ZB-H1: 1F1B's warm-up, then stage s defers each W by s microbatches, so the later stages send
        # their input gradients on sooner; each stage keeps ≤ p microbatches in flight, 1F1B's peak (stage 0's).
        seq = [Action(F, j, s) for j in range(min(p - s, m))]
        for i in range(m):
            seq.append(Action(B, i, s))
            if i >= s:
                seq.append(Action(W, i - s, s))
            if p - s + i < m:
                seq.append(Action(F, p - s + i, s))
        return seq + [Action(W, i, s) for i in range(max(0, m - s), m)]
    raise ValueError(name)


def _zbv(p: int, ready: list[Action], st: _Stage) -> Action | None:
    """ZB-V's greedy order: a ready B first (it unblocks a neighbour; the later chunk, then the older microbatch),
    else a pending W (it frees memory), else an F while fewer than 2p chunk-activations are in flight — 1F1B's peak,
    p microbatches of a whole stage, in half-stage chunks. F prefers the later chunk: started microbatches move on
    before new ones enter. Played out, every stage is busy from its first F to the end but for p − 1 ticks."""
    bs = [a for a in ready if a.kind == B]
    fs = [a for a in ready if a.kind == F]
    ws = [a for a in ready if a.kind == W]
    if bs:
        return min(bs, key=lambda a: (-a.chunk, a.microbatch))
    if ws:
        return min(ws, key=lambda a: (a.microbatch, -a.chunk))
    if fs and st.live < 2 * p:
        return min(fs, key=lambda a: (-a.chunk, a.microbatch))
    return None


@functools.lru_cache(maxsize=256)
def build(name: str, stages: int, chunks: int, microbatches: int) -> Table:
    """The schedule's table (raises ValueError where `check` objects). Built once per shape — a Table is immutable,
    and the planner asks for the same ones thousands of times (uncached, this was 90 % of a search)."""
    why = check(name, stages, chunks, microbatches)
    if why:
        raise ValueError(f"{why[0]} = {why[1]!r}: {why[2]}. Fix: {why[3]}")
    p, v, m = stages, chunks, microbatches
    place = placement(name, p, v)
    C = p * v
    greedy = name == "zbv"
    st = [_Stage(None if greedy else _fixed_order(p, v, m, name, s)) for s in range(p)]
    done_at: dict[Action, int] = {}
    todo = {s: {Action(k, j, c) for k in (F, B, W) for j in range(m) for c in range(C) if place[c] == s}
            for s in range(p)}

    def ready(a: Action, t: int) -> bool:
        return all(x in done_at and done_at[x] < t for x in needs(a, C))

    ticks = []
    limit = 4 * (v * m + p) * 3 + 16
    while any(todo.values()):
        if len(ticks) > limit:
            raise RuntimeError(f"schedule {name} (p={p}, v={v}, m={m}) does not finish")
        t = len(ticks)
        row: list[Action | None] = []
        for s in range(p):
            if greedy:
                a = _zbv(p, [x for x in todo[s] if ready(x, t)], st[s])
            else:
                nxt = st[s].order[0] if st[s].order else None
                a = nxt if nxt is not None and ready(nxt, t) else None
                if a is not None:
                    st[s].order.pop(0)
            row.append(a)
        for s, a in enumerate(row):
            if a is not None:
                done_at[a] = t
                todo[s].discard(a)
                st[s].live += {F: 1, B: 0, W: -1}[a.kind]
        ticks.append(tuple(row))
    return Table(name, p, v, m, place, tuple(ticks))


def validate(table: Table) -> None:
    """Check the table is a complete, causal schedule: every F/B/W of every (microbatch, chunk) exactly once, on
    the chunk's stage, after what it needs (at an earlier tick). A table that is not raises `ConfigError` (a table
    built by hand reaches this, so it is an input check, not an `assert`)."""
    C, m = table.n_chunks, table.microbatches

    def refuse(rule: str) -> None:
        raise ConfigError("schedule table", table.name, rule, "run every F, B and W of every (microbatch, chunk) "
                          "once, on its chunk's stage, after the actions it needs")

    when = {}
    for t, row in enumerate(table.ticks):
        for s, a in enumerate(row):
            if a is None:
                continue
            if a in when:
                refuse(f"{a} runs twice (ticks {when[a]} and {t})")
            if not 0 <= a.chunk < C or table.placement[a.chunk] != s:
                refuse(f"{a} runs on stage {s}, and its chunk is not placed there")
            when[a] = t
    need = {Action(k, j, c) for k in (F, B, W) for j in range(m) for c in range(C)}
    if set(when) != need:
        missing, extra = sorted(map(str, need - set(when))), sorted(map(str, set(when) - need))
        refuse(f"misses {missing[:5]}" if missing else f"runs actions outside the table: {extra[:5]}")
    for a, t in when.items():
        for d in needs(a, C):
            if when[d] >= t:
                refuse(f"{a} at tick {t} runs before {d} (tick {when[d]}), which it needs")


def format_table(table: Table) -> str:
    """Stages as rows, ticks as columns, cells `F3.1` (kind, microbatch, chunk) or `.`; then the counts."""
    cells = [[str(a) if a else "." for a in row] for row in table.ticks]
    width = max(len(c) for row in cells for c in row)
    lines = [f"{table.name}: p={table.stages} v={table.chunks} m={table.microbatches}"]
    for s in range(table.stages):
        lines.append(f"stage{s} " + " ".join(f"{row[s]:>{width}}" for row in cells))
    f = formula_bubble(table.name, table.stages, table.chunks, table.microbatches)
    lines.append(f"ticks {table.n_ticks}; bubble {table.bubble:.3f} (formula {f:.3f})"
                 + f"; peak in flight per stage {table.in_flight()} (chunk-activations)")
    return "\n".join(lines)


def draw(table: Table, path: str | None = None, ax=None):
    """Draw the table: stages as rows, ticks as columns; F, B, W in three hues, one shade per
    microbatch; idle cells blank. Into `ax` (a matplotlib Axes) if given, else a new figure; saved to `path` if
    given. Returns the Axes."""
    import matplotlib

    if ax is None and path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hues = {F: plt.get_cmap("Blues"), B: plt.get_cmap("Oranges"), W: plt.get_cmap("Greens")}
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6, 0.32 * table.n_ticks), 0.55 * table.stages + 1.2))
    for t, row in enumerate(table.ticks):
        for s, a in enumerate(row):
            if a is None:
                continue
            shade = 0.35 + 0.5 * a.microbatch / max(table.microbatches - 1, 1)
            ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=hues[a.kind](shade), edgecolor="white"))
            ax.text(t + 0.5, s + 0.5, f"{a.microbatch}", ha="center", va="center", fontsize=6)
    ax.set_xlim(0, table.n_ticks)
    ax.set_ylim(table.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
    ax.set_xlabel("tick (blue F, orange B, green W; numbers: microbatch)")
    ax.set_title(f"{table.name} p={table.stages} v={table.chunks} m={table.microbatches}: {table.n_ticks} ticks, "
                 f"bubble {table.bubble:.3f}, peak in flight {max(table.in_flight())}", fontsize=9)
    if fig is not None:
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
            plt.close(fig)
    return ax


# -----------------------------------------------------------------------------------------------------------------
# Lowering a table to the executor's per-tick arrays.

IDLE, DO_F, DO_B, DO_W = 0, 1, 2, 3
BRANCHES = ("idle", "F", "B", "W")  # the executor's branches, by kind
NO_SEND, DOWN, UP, LOCAL = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Program:
    """A table as int arrays [ticks, stages] for the executor, with the buffer sizes it needs.

    Every action runs on its own tick, B and W apart (jaxpar.parallel.weightgrad: B derives the input gradient and
    the matmul output gradients dy, W only the weight gradients Σ xᵀ·dy, so neither repeats the other's work). The
    stages run the ticks in lockstep, so a tick lasts as long as its busiest stage's action: with F ≈ B ≈ W each
    tick is about one unit. (Fusing a B with the W the table puts right after it would make that tick two units
    long on every stage, while the neighbour, one tick behind, runs a one-unit F beside it — in 1F1B's steady state
    that idles half the stages' time.)

    Each stage keeps four slot buffers sized from the table by interval colouring (a slot is reused once its last
    reader has run); index n of each (the last slot) is scratch: writes that must go somewhere but are never read.
        inbox [n_inbox + 1, mb, …]  activations and gradients received (from a neighbour, or from itself: the loss
                                    gradient of the last chunk, and ZB-V's turn at the bottom of the V), until read
        stash [n_stash + 1, …]      each F's vjp residuals, until its B
        tape  [n_tape + 1, …]       each F's matmul-group inputs, until its W
        dys   [n_dys + 1, …]        each B's matmul-group output gradients, until its W
    The per-tick arrays:
        kind      IDLE / DO_F / DO_B / DO_W            local    the chunk's index among the stage's (0 … v−1)
        micro     the microbatch                       first / last   chunk 0 (embedding) / chunk C−1 (head, loss)
        x_slot    inbox slot read: F's input (c > 0), B's output gradient
        stash / tape / dys   the slots of the microbatch-chunk in those buffers
        send      NO_SEND / DOWN (to s+1) / UP (to s−1) / LOCAL — where F's output or B's input gradient goes
        local_slot  inbox slot a LOCAL send is written to
        recv_down / recv_up   inbox slot for what arrives at this tick from s−1 (sent DOWN) / from s+1 (sent UP)
    """

    table: Table
    n_inbox: int
    n_stash: int
    n_tape: int
    n_dys: int
    kind: np.ndarray
    local: np.ndarray
    micro: np.ndarray
    first: np.ndarray
    last: np.ndarray
    x_slot: np.ndarray
    stash: np.ndarray
    tape: np.ndarray
    dys: np.ndarray
    send: np.ndarray
    local_slot: np.ndarray
    recv_down: np.ndarray
    recv_up: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-tick arrays the executor scans over, by name (`send` is for accounting: what moves is given by
        the receivers' recv_down / recv_up and local_slot)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in
                ("table", "n_inbox", "n_stash", "n_tape", "n_dys", "send")}

    def actions(self) -> dict[str, np.ndarray]:
        """Per stage, how many ticks run each branch of the executor (idle, F, B, W)."""
        return {k: (self.kind == i).sum(axis=0) for i, k in enumerate(BRANCHES)}

    def sends(self) -> dict[str, int]:
        """How many stage-to-stage messages (one microbatch activation or gradient each) the step sends."""
        return {"down": int((self.send == DOWN).sum()), "up": int((self.send == UP).sum()),
                "local": int((self.send == LOCAL).sum())}


def _colour(intervals: list[tuple[int, int, object]]) -> tuple[dict[object, int], int]:
    """Slots for [start, end] tick intervals (inclusive), a slot reused after its interval ends; (slot by key, n)."""
    free_at: list[int] = []  # per slot, the first tick it is free again
    slot = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for i, f in enumerate(free_at):
            if f <= start:
                slot[key], free_at[i] = i, end + 1
                break
        else:
            slot[key] = len(free_at)
            free_at.append(end + 1)
    return slot, len(free_at)


def lower(table: Table) -> Program:
    """The table as the executor's per-tick arrays, with its buffers sized by interval colouring."""
    p, C = table.stages, table.n_chunks
    when = table.when()
    T = table.n_ticks

    def dest(a: Action) -> int | None:
        """The stage that consumes what action a produces (None: nothing is sent)."""
        if a.kind == F:
            return table.placement[a.chunk + 1] if a.chunk < C - 1 else table.placement[a.chunk]
        if a.kind == B and a.chunk > 0:
            return table.placement[a.chunk - 1]
        return None

    def reader(a: Action) -> Action:
        """The one reader of a's message: F's output → F of the next chunk (the last chunk's: its loss gradient →
        its own B); B's input gradient → B of the previous chunk."""
        if a.kind == F and a.chunk < C - 1:
            return Action(F, a.microbatch, a.chunk + 1)
        return Action(B, a.microbatch, a.chunk if a.kind == F else a.chunk - 1)

    intervals: dict[str, dict[int, list]] = {k: {s: [] for s in range(p)} for k in ("inbox", "stash", "tape", "dys")}
    for a, t in when.items():
        s = table.placement[a.chunk]
        b, w = Action(B, a.microbatch, a.chunk), Action(W, a.microbatch, a.chunk)
        if a.kind == F:
            intervals["stash"][s].append((t, when[b], a))
            intervals["tape"][s].append((t, when[w], a))
        elif a.kind == B:
            intervals["dys"][s].append((t, when[w], a))
        d = dest(a)
        if d is not None:
            assert when[reader(a)] > t
            intervals["inbox"][d].append((t + 1, when[reader(a)], a))
    slot: dict[str, dict] = {}
    size: dict[str, int] = {}
    for k, per_stage in intervals.items():
        slot[k], size[k] = {}, 0
        for s in range(p):
            sl, n = _colour(per_stage[s])
            slot[k].update(sl)
            size[k] = max(size[k], n)

    def arr(fill: int):
        return np.full((T, p), fill, np.int32)

    kind, local, micro, first, last = arr(IDLE), arr(0), arr(0), arr(0), arr(0)
    x_slot, send, local_slot = arr(size["inbox"]), arr(NO_SEND), arr(size["inbox"])
    stash, tape, dys = arr(size["stash"]), arr(size["tape"]), arr(size["dys"])
    recv_down, recv_up = arr(size["inbox"]), arr(size["inbox"])
    for a, t in when.items():
        s = table.placement[a.chunk]
        f, b = Action(F, a.microbatch, a.chunk), Action(B, a.microbatch, a.chunk)
        kind[t, s] = {F: DO_F, B: DO_B, W: DO_W}[a.kind]
        local[t, s], micro[t, s] = table.local_chunk(a.chunk), a.microbatch
        first[t, s], last[t, s] = a.chunk == 0, a.chunk == C - 1
        stash[t, s], tape[t, s], dys[t, s] = slot["stash"][f], slot["tape"][f], slot["dys"][b]
        if a.kind == F and a.chunk > 0:
            x_slot[t, s] = slot["inbox"][Action(F, a.microbatch, a.chunk - 1)]
        elif a.kind == B:
            producer = f if a.chunk == C - 1 else Action(B, a.microbatch, a.chunk + 1)
            x_slot[t, s] = slot["inbox"][producer]
        d = dest(a)
        if d is None:
            continue
        if d == s:
            send[t, s], local_slot[t, s] = LOCAL, slot["inbox"][a]
        elif d == (s + 1) % p:
            send[t, s] = DOWN
            recv_down[t + 1, d] = slot["inbox"][a]
        elif d == (s - 1) % p:
            send[t, s] = UP
            recv_up[t + 1, d] = slot["inbox"][a]
        else:
            raise ValueError(f"{a} on stage {s} sends to stage {d}, not a neighbour")
    return Program(table, size["inbox"], size["stash"], size["tape"], size["dys"], kind, local, micro, first, last,
                   x_slot, stash, tape, dys, send, local_slot, recv_down, recv_up)
