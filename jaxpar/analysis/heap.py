"""Where a compiled step's temporary allocation goes: each computation's own peak, stacked along its calls.

XLA:CPU does not hand a loop body's or a conditional branch's temporaries the memory that its callers' temporaries
leave free at that moment. Read off the dumps of train steps (`--xla_dump_to`: the buffer assignment, each value's
offset and size, beside the live-range file's flattened schedule), the temp allocation equals, within a few
percent, the sum along the heaviest chain of calls

    allocation ≈ max over chains (entry → loop body → … → branch)  Σ  own(c)
    own(c)     = the most bytes the values defined in computation c hold at once (by XLA's live ranges), leaving out
                 those at a slot an enclosing computation also uses (a loop's state, aliased by its body)

while the most bytes live at once in the whole module can be half of it. Measured (bench/RESULTS.md, "At scale"):
the tiny model's zbv step under accumulation 4 on 8 simulated devices, 47.6 MB allocated, 49.6 stacked, 35.9 live
at once; llama_8b's zbv step under accumulation 4 on 64, 115.1 GB allocated, 120.8 stacked, 59.3 live at once.

So on XLA:CPU a schedule table's step holds its entry computation's own temporaries (the optimizer's update, the
gradient reductions), the accumulation loop's (the tick loop's state: the slots), the tick's and the largest
branch's (B's: the chunk's backward, with its layer loop) one above the other. `heap_chain` reads a dump directory
and gives that chain, so `jaxpar plan --verify` can show where a compiled figure comes from.
"""

from __future__ import annotations

import collections
import pathlib
import re

from jaxpar.analysis.hlo import parse_hlo

_VALUE = re.compile(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^\s+([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NESTING = ("while", "conditional", "call")  # the call sites whose callee holds temporaries of its own


def _files(dump_dir: pathlib.Path) -> tuple[str, str, str] | None:
    """(optimized HLO text, buffer assignment, live ranges) of the largest module dumped in `dump_dir` (a backend may
    dump small modules of its own beside the step's, e.g. an autotuner's), or None."""
    found = list(dump_dir.glob("*after_optimizations-buffer-assignment.txt"))
    if not found:
        return None
    largest = max(found, key=lambda p: p.stat().st_size)
    stem = str(largest).removesuffix("-buffer-assignment.txt")
    paths = [pathlib.Path(stem + ".txt"), largest, pathlib.Path(stem + "-live-range.txt")]
    if not all(p.exists() for p in paths):
        return None
    return tuple(p.read_text() for p in paths)


def _peak(slots: dict[tuple[int, int], list[tuple[int, int]]]) -> int:
    """The most bytes the slots' values hold at once ((offset, size) → live ranges [a, b] in schedule steps)."""
    changes = collections.Counter()
    for (_, size), ranges in slots.items():
        for a, b in ranges:
            changes[a] += size
            changes[b + 1] -= size
    held = most = 0
    for step in sorted(changes):
        held += changes[step]
        most = max(most, held)
    return most


def heap_chain(dump_dir: str | pathlib.Path) -> dict | None:
    """{'allocation': XLA's temp bytes, 'stacked': Σ own peaks along the heaviest chain, 'live': the most temp bytes
    live at once in the module, 'chain': [(label, own bytes), …] from the entry down}, or None where the dump lacks
    a file (one module's buffer assignment, live ranges and text)."""
    files = _files(pathlib.Path(dump_dir))
    if files is None:
        return None
    text, assignment, live_ranges = files
    prog = parse_hlo(text)
    owner = {ins.name: comp for comp, instrs in prog.computations.items() for ins in instrs}
    entry = prog.entry
    callees: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)  # comp → [(callee, label)]
    parents: dict[str, set[str]] = collections.defaultdict(set)
    for comp, calls in prog.calls.items():
        branch = collections.Counter()
        for callee, _, site in calls:
            if site.op not in _NESTING or (site.op == "while" and f"condition=%{callee}" in site.attrs):
                continue
            where = _OP_NAME.search(site.attrs)
            where = where.group(1).removeprefix("jit(step)/").removeprefix("shard_map/") if where else site.name
            # a loop's body is implied by the loop: jax 0.12.1 names a nested loop "while/body/while" where
            # earlier releases wrote "while/while"; one spelling for every release
            where = where.replace("/body/eval_jaxpr/", "/").replace("/body/", "/")
            if site.op == "conditional":  # its branches in order
                label = f"branch {branch[site.name]} of {where}"
                branch[site.name] += 1
            else:
                label = f"{'loop' if site.op == 'while' else site.op} {where}"
            callees[comp].append((callee, label))
            parents[callee].add(comp)

    ranges = {name: (int(a), int(b)) for name, a, b in _RANGE.findall(live_ranges)}
    temp = assignment.split("preallocated-temp:", 1)
    if len(temp) < 2:
        return None
    values = _VALUE.findall(temp[1].split("\nallocation", 1)[0])
    own: dict[str, dict[tuple[int, int], list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    everything: dict[tuple[int, int], list] = collections.defaultdict(list)
    for name, index, size, offset in values:
        span = ranges.get(name + (index or "{}"))
        if span is None:
            continue
        key = (int(offset), int(size))
        own[owner.get(name, "?")][key].append(span)
        everything[key].append(span)

    def ancestors(comp: str, seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for parent in parents.get(comp, ()):
            if parent not in seen:
                out |= {parent} | ancestors(parent, seen | {comp})
        return out

    own_peak = {}
    for comp, slots in own.items():
        above = set().union(*(own[a].keys() for a in ancestors(comp) if a in own))
        own_peak[comp] = _peak({k: v for k, v in slots.items() if k not in above})

    def heaviest(comp: str, seen: frozenset) -> tuple[int, list]:
        best = (0, [])
        for callee, label in callees.get(comp, ()):
            if callee not in seen:
                total, chain = heaviest(callee, seen | {callee})
                total += own_peak.get(callee, 0)
                if total > best[0]:
                    best = (total, [(label, own_peak.get(callee, 0))] + chain)
        return best

    below, chain = heaviest(entry, frozenset({entry}))
    top = max((offset + size for offset, size in everything), default=0)
    return {"allocation": top, "stacked": own_peak.get(entry, 0) + below, "live": _peak(everything),
            "chain": [("entry", own_peak.get(entry, 0))] + chain}


def format_chain(heap: dict) -> str:
    """One line: the chain's own peaks (GB, or MB for a small program), their sum, the allocation and the bytes
    live at once."""
    unit, scale = ("GB", 1e9) if heap["allocation"] >= 1e9 else ("MB", 1e6)
    parts = ", ".join(f"{label} {own / scale:.2f}" for label, own in heap["chain"] if own >= 0.01 * heap["allocation"])
    return (f"XLA:CPU's temp allocation by computation (each one's own peak, stacked along its calls; {unit}): "
            f"{parts} = {heap['stacked'] / scale:.2f} stacked, {heap['allocation'] / scale:.2f} allocated, "
            f"{heap['live'] / scale:.2f} live at once")
