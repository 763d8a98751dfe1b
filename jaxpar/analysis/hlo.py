"""Per-device accounting of a compiled program: collectives, dot FLOPs, loop trip counts, memory, XLA's cost.

Why read the HLO text: XLA's `cost_analysis()` counts the body of a while loop once, so a model whose layers run
under `jax.lax.scan` reports about 1/L of its FLOPs. Here every instruction is weighted by how many times its
computation runs per call: the product of the known trip counts of the while loops around it.

    count(entry) = 1;  count(c) = sum over call sites of count(caller) * (trip count if c is a while body, else 1)

What the text looks like (checked on the CPU backend of jax 0.10.2, 0.11.2 and 0.12):
- operands are printed by name only, `dot(%a, %b)`, so shapes come from a module-wide name -> shape table; older
  text that prints them inline, `dot(f32[8,32]{1,0} %a, ...)`, is read too.
- replica groups: explicit lists `{{0,4},{1,5}}` (0.10), mesh axes `mesh['data'=2,'pipe'=1,'tensor'=4] {'tensor'}`
  (0.11+), and the iota form `[2,4]<=[4,2]T(1,0)` that other XLA builds print (not seen on CPU); `{}` is every
  device in one group. Device ids are flat indices into `mesh.devices` (row-major over the mesh axes).
- while loops carry `backend_config={..."known_trip_count":{"n":"5"}}`; without it the body is counted once and a
  warning is recorded (`HloProgram.warnings`, `Collective.exact=False`, and `warnings.warn`).
- collectives are synchronous on CPU; async pairs (`all-reduce-start` / `-done`) are counted once, at the start.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "bf16": 16, "f16": 16, "s32": 32, "u32": 32, "f32": 32,
         "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "s4": 4, "u4": 4}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")  # also as X-start
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP = re.compile(r"\s*([\w\-]+)\(")
_CALL = re.compile(r"(\w+)=(\{[^{}]*\}|%[\w.\-]+)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')


@dataclass(frozen=True)
class Collective:
    """One collective instruction, per device. `bytes` is the full (logical) tensor the ring moves: the operand of
    all-reduce, reduce-scatter, all-to-all and collective-permute, the output of all-gather (tuples summed).
    `sent_bytes` is what one device sends per execution under ring algorithms, with N = bytes, t = group_size:
    all-reduce 2(t-1)/t*N; all-gather, reduce-scatter, all-to-all (t-1)/t*N; collective-permute N.
    `count` is executions per call; `exact` is False when a loop around it had no known trip count (count is then
    a lower bound)."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    shape: str
    elements: int
    bytes: int
    sent_bytes: float
    count: int
    computation: str
    exact: bool = True


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str  # output shape text, layouts included
    op: str
    args: str  # text between the op's parentheses
    attrs: str  # everything after them


@dataclass
class HloProgram:
    """A parsed HLO module: computations, execution counts, while-body trip counts and parse warnings."""

    computations: dict[str, list[_Instr]]
    shapes: dict[str, str]  # instruction name -> output shape text (names are unique in a module)
    entry: str | None = None  # the ENTRY computation
    counts: dict[str, int] = field(default_factory=dict)
    exact: dict[str, bool] = field(default_factory=dict)
    trip_counts: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # computation -> [(callee, executions per call: the trip count for a loop's body and condition, else 1, site)]
    calls: dict[str, list[tuple[str, int, _Instr]]] = field(default_factory=dict)

    def instructions(self):
        """Yields (computation, instruction, executions per call) for every instruction that runs."""
        for comp, instrs in self.computations.items():
            for ins in instrs:
                if self.counts.get(comp, 0):
                    yield comp, ins, self.counts[comp]

    def operand_shapes(self, ins: _Instr) -> list[str]:
        """Shape text of each operand: printed inline (`f32[4]{0} %x`) or looked up by name (`%x`)."""
        out = []
        for arg in _split_top(ins.args):
            head, _, name = arg.strip().rpartition(" ")
            shape = head.strip() or self.shapes.get(name.lstrip("%"), "")
            if not shape:
                self.warnings.append(f"{ins.name}: no shape for operand {arg.strip()!r}")
            out.append(shape)
        return out


def _close(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] in "([{") - (s[j] in ")]}")
        if depth == 0:
            return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """Splits on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p for p in parts if p.strip()]


def _leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """`(f32[4,8]{1,0}, s32[])` -> [("f32", (4, 8)), ("s32", ())]; layouts, tiling and comments ignored."""
    shape = re.sub(r"/\*.*?\*/", "", re.sub(r"\{[^{}]*\}", "", shape))
    return [(dt, tuple(int(d) for d in re.findall(r"\d+", dims))) for dt, dims in _ARRAY.findall(shape)]


def _size(leaves) -> tuple[int, int]:
    """(elements, bytes) of a list of array leaves."""
    elements = [math.prod(dims) for _, dims in leaves]
    bits = [n * _BITS.get(dt, 8 if dt.startswith("f8") else 4 if dt.startswith("f4") else 0)
            for n, (dt, _) in zip(elements, leaves)]
    return sum(elements), sum(bits) // 8


def scalar_bytes(shape: str) -> int:
    """Bytes of the rank-0 leaves of a (possibly tuple, XLA-combined) shape."""
    return _size([leaf for leaf in _leaves(shape) if not leaf[1]])[1]


def _shape_text(leaves) -> str:
    text = [f"{dt}[{','.join(map(str, dims))}]" for dt, dims in leaves]
    return text[0] if len(text) == 1 else f"({', '.join(text)})"


def parse_hlo(compiled_or_text) -> HloProgram:
    """Parses `compiled.as_text()` (or the text itself) and derives every computation's execution count.
    Call sites are any `key=%comp` / `key={%a, %b}` attribute (body, condition, calls, to_apply,
    branch_computations, ...); computations nothing reaches from ENTRY count 0."""
    comps: dict[str, list[_Instr]] = {}
    shapes: dict[str, str] = {}
    entry, current = None, None
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    for line in text.splitlines():
        if line and not line[0].isspace():
            header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(", line)
            if header and line.rstrip().endswith("{"):
                current = header.group(2)
                comps[current] = []
                entry = current if header.group(1) else entry
            elif line.startswith("}"):
                current = None
            continue
        m = _DEF.match(line)
        if current is None or not m or m.end() >= len(line):
            continue
        i = m.end()
        j = _close(line, i) if line[i] == "(" else line.find(" ", i)  # a tuple shape, or up to the first space
        if j < 0:
            continue
        op = _OP.match(line, j)
        if op:
            k = _close(line, op.end() - 1)
            args = re.sub(r"/\*.*?\*/", "", line[op.end():k - 1])  # long operand lists carry /*index=5*/
            ins = _Instr(m.group(1), line[i:j], op.group(1), args, line[k:])
            comps[current].append(ins)
            shapes[ins.name] = ins.shape
    prog = HloProgram(comps, shapes, entry)
    if entry is None:
        prog.warnings.append("no ENTRY computation found")
        return prog
    callers: dict[str, list[tuple[str, int, bool]]] = {}  # callee -> [(caller, factor, trip known)]
    for comp, instrs in comps.items():
        for ins in instrs:
            if ins.op in ("async-update", "async-done"):  # the async-start already called the wrapped computation
                continue
            trip = None
            if ins.op == "while":
                found = _TRIP.search(ins.attrs)
                trip = int(found.group(1)) if found else None
                if trip is None:
                    prog.warnings.append(f"while {ins.name}: no known_trip_count; its body is counted once")
            for key, names in _CALL.findall(_STRING.sub('""', ins.attrs)):
                loop = ins.op == "while" and key in ("body", "condition")
                for callee in re.findall(r"%?([\w.\-]+)", names):
                    if callee in comps:
                        factor = trip if loop and trip is not None else 1
                        callers.setdefault(callee, []).append((comp, factor, trip is not None or not loop))
                        prog.calls.setdefault(comp, []).append((callee, factor, ins))
                        if loop and key == "body" and trip is not None:
                            prog.trip_counts[callee] = trip

    def visit(c: str) -> tuple[int, bool]:
        if c not in prog.counts:
            prog.counts[c], prog.exact[c] = (1, True) if c == entry else (0, True)
            for caller, factor, known in callers.get(c, []):
                n, ok = visit(caller)
                prog.counts[c] += n * factor
                prog.exact[c] = prog.exact[c] and ok and known
        return prog.counts[c], prog.exact[c]

    for c in comps:
        visit(c)
    return prog


def _mesh_dims(mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names, axis sizes) of a `jax.sharding.Mesh`, an `AbstractMesh` or a {name: size} dict."""
    shape = dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)
    return tuple(shape), tuple(int(s) for s in shape.values())


def _axes_of(groups, mesh, what: str, warn: list[str]) -> tuple[str, ...]:
    """Mesh axes along which the members of each device-id group differ (all groups must agree)."""
    names, sizes = _mesh_dims(mesh)
    per_group = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=int), sizes)).reshape(len(sizes), -1)
        per_group.add(tuple(n for n, row in zip(names, coords) if len(set(row.tolist())) > 1))
    if len(per_group) > 1:
        warn.append(f"{what}: groups span different axes {sorted(per_group)}; reporting their union")
    union = {a for axes in per_group for a in axes}
    return tuple(n for n in names if n in union)


def replica_group_axes(text: str, mesh, warn: list[str] | None = None) -> tuple[tuple[str, ...], int]:
    """(mesh axes, group size) of the replica groups that `text` starts with, in any of the three formats:
    `{{0,1},{2,3}}` / `{}`; iota `[G,S]<=[dims]T(perm)` = iota(prod(dims)).reshape(dims).transpose(perm)
    .reshape(G, S); mesh axes `mesh['data'=2,'tensor'=4] {'tensor'}` (sub-axes `'tensor':(1)2` count their size).
    Axes of size 1 are left out, so a trivial group gives ((), 1)."""
    warn = [] if warn is None else warn
    text = text.strip()
    if text.startswith("maximal_mesh"):
        return (), 1
    if text.startswith("mesh"):
        spec = re.match(r"mesh\[([^\]]*)\]", text)
        hlo = {}
        for tok in spec.group(1).split(","):
            name, _, size = tok.replace("'", "").replace('"', "").partition("=")
            hlo[name.strip()] = int(size)
        start = text.index("{", spec.end())
        picked = {}
        for tok in text[start + 1:_close(text, start) - 1].replace("'", "").replace('"', "").split(","):
            name, _, sub = tok.strip().partition(":")
            if name:
                picked[name] = picked.get(name, 1) * (int(re.findall(r"\d+", sub)[-1]) if sub else hlo[name])
        order = list(hlo)
        axes = tuple(sorted((a for a, s in picked.items() if s > 1), key=order.index))
        return axes, math.prod(picked.values())
    if text.startswith("["):
        iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        group_shape, dims = [[int(d) for d in iota.group(k).split(",")] for k in (1, 2)]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(p) for p in iota.group(3).split(",")])
        groups = ids.reshape(group_shape[0], -1).tolist()
    else:
        inner = text[1:_close(text, 0) - 1]
        groups = [[int(d) for d in re.findall(r"\d+", g)] for g in re.findall(r"\{([^{}]*)\}", inner)]
        groups = groups or [list(range(math.prod(_mesh_dims(mesh)[1])))]  # `{}`: every device in one group
    return _axes_of(groups, mesh, text[:40], warn), len(groups[0])


def collectives(compiled_or_text, mesh) -> list[Collective]:
    """Every collective of the compiled program with its mesh axes, sizes, bytes and execution count."""
    prog = parse_hlo(compiled_or_text)
    out = []
    for comp, ins, n in prog.instructions():
        kind = ins.op.removesuffix("-start")  # an async pair is counted once, at its start
        if kind not in _KINDS:
            continue
        operands = prog.operand_shapes(ins)
        if kind == "collective-permute" and "slice_sizes=" in ins.attrs:
            operands = operands[:1]  # in-place form: (input, output buffer, input offsets, output offsets)
        moved = [leaf for s in operands for leaf in _leaves(s)]
        if kind == "collective-permute":
            at = ins.attrs.find("source_target_pairs=")
            pairs = [] if at < 0 else re.findall(r"\{(\d+),(\d+)\}", ins.attrs[at:_close(ins.attrs, at + 20)])
            axes = _axes_of([[int(s), int(t)] for s, t in pairs], mesh, ins.name, prog.warnings) if pairs else ()
            t = math.prod(dict(zip(*_mesh_dims(mesh)))[a] for a in axes)
        else:
            at = ins.attrs.find("replica_groups=")
            axes, t = replica_group_axes(ins.attrs[at + 15:] if at >= 0 else "{}", mesh, prog.warnings)
            if kind == "all-gather":  # the gathered output: the last len(operands) leaves (async: (inputs, outputs))
                moved = _leaves(ins.shape)[-len(moved):] if moved else []
        elements, nbytes = _size(moved)
        sent = {"all-reduce": 2 * (t - 1) / t, "collective-permute": 1.0 if axes else 0.0}.get(kind, (t - 1) / t)
        out.append(Collective(kind, axes, t, _shape_text(moved), elements, nbytes, sent * nbytes, n, comp,
                              prog.exact.get(comp, True)))
    _warn(prog)
    return out


def summary_key(kind: str, axes: tuple[str, ...]) -> str:
    """`("all-reduce", ("data", "tensor"))` -> "all-reduce@data,tensor"; no axes -> "all-reduce@-"."""
    return f"{kind}@{','.join(axes) or '-'}"


def collective_summary(cols: list[Collective]) -> dict[str, dict]:
    """{"kind@axes": {"count": executions, "sent_bytes": count-weighted, "bytes": count-weighted}}, JSON-ready."""
    out: dict[str, dict] = {}
    for c in cols:
        s = out.setdefault(summary_key(c.kind, c.axes), {"count": 0, "sent_bytes": 0.0, "bytes": 0})
        s["count"] += c.count
        s["sent_bytes"] += c.sent_bytes * c.count
        s["bytes"] += c.bytes * c.count
    return dict(sorted(out.items()))


def _instr_flops(prog: HloProgram, ins: _Instr) -> float:
    """FLOPs of one execution of a dot (2 · output elements · contracted size) or convolution; 0 for anything else."""
    if ins.op not in ("dot", "convolution"):
        return 0.0
    out, _ = _size(_leaves(ins.shape))
    operands = [_leaves(s) for s in prog.operand_shapes(ins)]
    if ins.op == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        contracted = [int(d) for d in re.findall(r"\d+", dims.group(1))] if dims else []
        k = math.prod(operands[0][0][1][d] for d in contracted)
    else:
        labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
        kernel = operands[1][0][1]
        k = math.prod(d for i, d in enumerate(kernel) if labels and i != labels.group(1).find("o"))
    return 2.0 * out * k


def dot_flops(compiled_or_text) -> float:
    """Sum over dots of 2 * prod(output dims) * prod(lhs contracting dims) * executions per call; convolutions
    count 2 * prod(output dims) * prod(kernel dims other than the output feature). Matmuls that the backend
    lowered to a custom-call are not seen. Every branch of a conditional counts as if taken each time
    (`branch_flops` says what each branch costs)."""
    prog = parse_hlo(compiled_or_text)
    total = sum(_instr_flops(prog, ins) * n for _, ins, n in prog.instructions())
    _warn(prog)
    return total


@dataclass(frozen=True)
class Conditional:
    """A `conditional` (lax.cond / lax.switch): `count` executions per call of its computation (as `parse_hlo`
    counts it), the dot FLOPs of each branch per execution — the branch's own dots and those of everything it calls,
    loop trip counts applied, except inside a nested conditional, which is listed on its own with `parent` =
    (conditional name, branch index) — and its name."""

    name: str
    count: int
    branches: tuple[float, ...]
    parent: tuple[str, int] | None


def branch_flops(compiled_or_text) -> list[Conditional]:
    """Every conditional of the program with the FLOPs of each of its branches (what a branch costs when taken)."""
    prog = parse_hlo(compiled_or_text)
    calls = prog.calls

    def own(comp: str) -> tuple[float, list[str]]:
        """(FLOPs of comp and its non-conditional callees, the computations holding them)."""
        total = sum(_instr_flops(prog, ins) for ins in prog.computations[comp])
        held = [comp]
        for callee, factor, site in calls.get(comp, []):
            if site.op == "conditional":
                continue
            f, h = own(callee)
            total += factor * f
            held += h
        return total, held

    out, parent_of = [], {}
    for comp, instrs in prog.computations.items():
        for ins in instrs:
            if ins.op != "conditional":
                continue
            branches = [callee for callee, _, site in calls.get(comp, []) if site is ins]
            flops = []
            for i, b in enumerate(branches):
                f, held = own(b)
                flops.append(f)
                for h in held:
                    parent_of[h] = (ins.name, i)
            out.append((ins.name, comp, tuple(flops)))
    _warn(prog)
    return [Conditional(name, prog.counts.get(comp, 0), flops, parent_of.get(comp)) for name, comp, flops in out]


def loop_trip_counts(compiled_or_text) -> dict[str, int]:
    """While-body computation name -> known trip count (per entry into the loop; nesting is not multiplied)."""
    prog = parse_hlo(compiled_or_text)
    _warn(prog)
    return dict(prog.trip_counts)


def memory(compiled) -> dict[str, int]:
    """Bytes per device from `compiled.memory_analysis()`, 0 where an attribute is missing, and
    peak_bytes = argument + output - alias + temp (XLA's own `peak_memory_in_bytes` as xla_peak_bytes if given)."""
    stats = compiled.memory_analysis()
    stats = stats[0] if isinstance(stats, (list, tuple)) and stats else stats
    get = lambda attr: int(getattr(stats, attr, 0) or 0)  # noqa: E731
    out = {k: get(f"{k.removesuffix('_bytes')}_size_in_bytes")
           for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes")}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    out["xla_peak_bytes"] = get("peak_memory_in_bytes")
    return out


def cost(compiled) -> dict[str, float]:
    """`compiled.cost_analysis()` normalised (a dict on new jax, a list of one dict on older): flops,
    bytes_accessed, transcendentals. XLA counts a while-loop body ONCE, whatever its trip count: for scanned layers
    use `dot_flops`, which multiplies by trip counts."""
    raw = compiled.cost_analysis()
    raw = (raw[0] if raw else {}) if isinstance(raw, (list, tuple)) else (raw or {})
    return {"flops": float(raw.get("flops", 0.0)), "bytes_accessed": float(raw.get("bytes accessed", 0.0)),
            "transcendentals": float(raw.get("transcendentals", 0.0))}


def _warn(prog: HloProgram) -> None:
    for message in dict.fromkeys(prog.warnings):
        warnings.warn(f"jaxpar.analysis.hlo: {message}", stacklevel=3)


def loop_carried_permutes(compiled_or_text) -> dict[str, bool]:
    """Each collective-permute inside a while body → whether its result only feeds the body's ROOT tuple (through
    bitcasts and copies): then it is read by the next iteration, nothing in its own iteration waits for it, and an
    asynchronous backend can run it under the next iteration's compute."""
    prog = parse_hlo(compiled_or_text)
    forwarding = ("bitcast", "copy", "reshape", "get-tuple-element", "collective-permute-done")
    out = {}
    for body in prog.trip_counts:
        instrs = prog.computations[body]
        root = instrs[-1].name  # the text prints ROOT last
        users: dict[str, list[_Instr]] = {}
        for ins in instrs:
            for used in re.findall(r"%([\w.\-]+)", ins.args):
                users.setdefault(used, []).append(ins)

        def reaches_only_root(name: str) -> bool:
            us = users.get(name, [])
            return bool(us) and all(u.name == root or (u.op in forwarding and reaches_only_root(u.name)) for u in us)

        for ins in instrs:
            if ins.op in ("collective-permute", "collective-permute-start"):
                out[ins.name] = reaches_only_root(ins.name)
    return out
