"""`jaxpar probe`: measure the machine this process runs on and write the `Profile` the time model reads.

What is measured, with every local device busy at once (as in a train step: on CPU the simulated devices share the
cores, so each rate is what one device gets while the others run too):

    matmul     achieved FLOP/s per device of a token-major [M, w] @ [w, w] per compute dtype and width w (narrow
               matmuls run below the large ones' rate: the time model takes the rate at a layout's narrowest width)
    links      per collective and group size g (an axis of degree g inside the host): bus bandwidth in bytes/s per
               device — all-reduce 2(g−1)/g·S, all-to-all (g−1)/g·S, permute (a ring shift) S bytes sent for an
               S-byte buffer, divided by the median time
    latency    what an all-reduce of one float adds to a loop of compute (what a collective costs however small,
               the wait for the other devices included)
    overhead   the time per iteration of a scan over a tiny matmul (what a layer application costs besides its FLOPs)
    pipeline   the time per byte of a microbatch that an iteration of the circular pipeline adds to its stages' work
               (the loop's selects, buffer updates and permute; ~20 ms per MB on 8 simulated devices on 2 cores)
    fresh      the time per byte of memory a program allocates afresh at each call (XLA:CPU's temporaries: page
               faults, ~1.5 ms per MB per device on 8 simulated devices on 2 cores; ~0 where an allocator pools)
    overlap    how much of a permute hides behind an independent matmul (what collective matmul and the ring rely on)

Across hosts nothing is measured (one process sees one host): `inter_host` keeps the network default unless the
profile is edited. The profile names the machine it was measured on (`machine`); the planner refuses a profile whose
machine differs from the one it runs on, since its rates describe other hardware.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import flops
from jaxpar.planner.profile import GB, Profile, host_memory_bytes, machine, profile_for

# Collectives as an axis of the step runs them, and the bytes each device sends for an S-byte buffer over g devices
# (bus bandwidth: what one device's links carry, so every group size compares with the link rate).
KINDS = {
    "all_reduce": lambda g: 2 * (g - 1) / g,
    "all_to_all": lambda g: (g - 1) / g,
    "permute": lambda g: 1.0,
}


def device_memory_gb(device) -> float:
    """Memory one device may use: the allocator's limit on an accelerator; on CPU the host's memory shared by the
    process's devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] / GB
    return host_memory_bytes() / max(1, jax.local_device_count()) / GB


def _median_seconds(fn, *args, repeats: int, chain: bool = False) -> float:
    """Median seconds of `fn(*args)` after a call that compiles and warms up; `chain`: each call takes the previous
    one's result as its argument (a donated buffer is consumed by the call that reads it)."""
    out = jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        args = (out,) if chain else args
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Row:
    """Every device on one mesh axis "d": `put` places an array of a per-device shape on each (stacked along the
    first dim), `run` jits a per-device function over all of them at once (`shard_map`, every argument and result
    split over "d")."""

    def __init__(self, devices: list):
        self.n, self.mesh = len(devices), Mesh(np.array(devices), ("d",))

    def put(self, shape: tuple, fill: float = 1.0, dtype=jnp.float32) -> jax.Array:
        return jax.device_put(jnp.full((self.n * shape[0], *shape[1:]), fill, dtype),
                              NamedSharding(self.mesh, P("d")))

    def run(self, f, args: int = 1, outs: int = 1, check_vma: bool = True):
        spec = lambda k: P("d") if k == 1 else (P("d"),) * k  # noqa: E731
        return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=spec(args), out_specs=spec(outs),
                                     check_vma=check_vma))


def matmul_rate(devices: list, kind: str, width: int, repeats: int, rows: int | None = None,
                dtype: str | None = None) -> float:
    """Achieved FLOP/s per device of a [rows, width] @ [width, width] (rows: `width` unless given — a token-major
    matmul has many more rows than its width) on every device at once. kind: the operands' dtype, or "float8": the
    FP8 rowwise policy's product (jaxpar.fp8) of operands in `dtype`."""
    row, rows = _Row(devices), rows or width
    if kind == "float8":
        from jaxpar.fp8 import Fp8Rowwise

        product = lambda a, b: Fp8Rowwise()("nk,km->nm", a, b)  # noqa: E731
    else:
        product, dtype = (lambda a, b: a @ b), kind
    x, w = row.put((rows, width), dtype=dtype), row.put((width, width), dtype=dtype)
    return 2 * rows * width**2 / _median_seconds(row.run(product, args=2), x, w, repeats=repeats)


def _collective(kind: str, axis: str, g: int):
    if kind == "all_reduce":
        return lambda a: jax.lax.psum(a, axis)
    if kind == "all_to_all":
        return lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    return lambda a: jax.lax.ppermute(a, axis, [(i, (i + 1) % g) for i in range(g)])


def link_bandwidth(devices: list, kind: str, group: int, nbytes: int, repeats: int) -> float:
    """Bus bandwidth (bytes/s per device) of `kind` over groups of `group` devices, all groups at once."""
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // group, group), ("rest", "g"))
    elems = max(group, nbytes // 4 // group * group)  # all_to_all splits the buffer into g parts
    x = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P(("rest", "g"))))
    fn = jax.jit(jax.shard_map(_collective(kind, "g", group), mesh=mesh, in_specs=P(("rest", "g")),
                               out_specs=P(("rest", "g"))))
    return KINDS[kind](group) * elems * 4 / _median_seconds(fn, x, repeats=repeats)


def overlap_fraction(devices: list, size: int, nbytes: int, repeats: int, rounds: int = 3) -> float:
    """How much of a permute hides behind an independent matmul in the same program, as a fraction of the shorter
    of the two: (t_matmul + t_permute − t_both) / min(t_matmul, t_permute), the median of `rounds` estimates,
    clipped to [0, 1]. On a GPU the permute runs on its own engines (→ 1); simulated CPU devices share the cores, so
    the copy competes with the matmul."""
    row = _Row(devices)
    a, b = row.put((size, size)), row.put((max(1, nbytes // 4),))
    shift = [(i, (i + 1) % row.n) for i in range(row.n)]
    mm = lambda x: x @ x  # noqa: E731
    perm = lambda y: jax.lax.ppermute(y, "d", shift)  # noqa: E731
    f_mm, f_perm, f_both = row.run(mm), row.run(perm), row.run(lambda x, y: (mm(x), perm(y)), args=2, outs=2)
    fractions = []
    for _ in range(rounds):  # one estimate a round, the three timed together; their median (one is noisy on CPU)
        t_mm = _median_seconds(f_mm, a, repeats=repeats)
        t_perm = _median_seconds(f_perm, b, repeats=repeats)
        t_both = _median_seconds(f_both, a, b, repeats=repeats)
        fractions.append((t_mm + t_perm - t_both) / min(t_mm, t_perm))
    return float(np.clip(statistics.median(fractions), 0.0, 1.0))


def collective_latency(devices: list, repeats: int, trips: int = 16, split: int = 4) -> float:
    """Seconds a collective costs however small, as a step meets it: between layers' worth of compute. A loop whose
    trips run `split` matmuls then an all-reduce of one float, against one whose trips put such an all-reduce after
    each matmul (the same compute, `split` − 1 more collectives a trip); at least an idle all-reduce's time.
    Devices with their own engines see the collective's own latency; simulated CPU devices time-sliced on shared
    cores also wait at every collective for the slowest of them to arrive — a cost that grows with the
    collectives a step runs, not with their bytes."""
    row = _Row(devices)
    rows, width = (4096, 4096) if devices[0].platform != "cpu" else (512, 256)
    x, w, one = row.put((rows, width), 0.01), row.put((width, width), 1 / width), row.put((1,))

    def loop(every: int):
        def body(a, b):
            def trip(c, _):
                for i in range(split):
                    c = jnp.tanh(c @ b)
                    if (i + 1) % every == 0:
                        c = c + jax.lax.psum(c[:1, :1], "d")
                return c, None

            return jax.lax.scan(trip, a, None, length=trips)[0]

        return row.run(body, args=2, check_vma=False)

    alone = _median_seconds(row.run(lambda a: jax.lax.psum(a, "d")), one, repeats=repeats)
    loaded = (_median_seconds(loop(1), x, w, repeats=repeats)
              - _median_seconds(loop(split), x, w, repeats=repeats)) / (trips * (split - 1))
    return max(alone, loaded)


def layer_overhead(devices: list, repeats: int, trips: int = 64) -> float:
    """Seconds per iteration of a scan over a tiny matmul on every device: a layer application's fixed cost."""
    row = _Row(devices)

    def body(a):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c.T[:, :8]), None), a, None, length=trips)[0]

    return _median_seconds(row.run(body), row.put((8, 8)), repeats=repeats) / trips


def pipeline_cost(devices: list, repeats: int, microbatches: int = 4) -> float:
    """Seconds per byte of a microbatch's activations that one iteration (forward and backward) of jaxpar's circular
    pipeline costs beyond its stages' work: its selects, buffer updates and permute over [mb, T, h] (`circular.
    circular` with a one-matmul stage, 2 stages, against the same stage calls in a plain scan)."""
    from jaxpar.parallel import circular, pipeline

    n = len(devices)
    if n < 2 or n % 2:
        return 0.0
    mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("rest", "pipe"))
    mb, seq, width = (8, 1024, 1024) if devices[0].platform != "cpu" else (2, 128, 128)
    q = microbatches // 2
    x = jax.device_put(jnp.full((n * q, mb, seq, width), 0.01, jnp.float32), NamedSharding(mesh, P(("rest", "pipe"))))
    w = jax.device_put(jnp.full((2, width, width), 1 / width, jnp.float32), NamedSharding(mesh, P("pipe")))
    trips = pipeline.iterations(2, 1, microbatches)
    stage = lambda wt, a: jnp.tanh(a @ wt)  # noqa: E731

    def piped(wt, io):
        return jax.grad(lambda wt: circular.circular(stage, wt, io, stages=2, repeats=1,
                                                     microbatches=microbatches).sum())(wt)

    def plain(wt, io):
        def loss(wt):
            return jax.lax.scan(lambda c, t: (c, stage(wt[0], io[t % q])), 0.0, jnp.arange(trips))[1].sum()

        return jax.grad(loss)(wt)

    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("pipe"), P(("rest", "pipe"))),  # noqa: E731
                                          out_specs=P("pipe"), check_vma=False))
    extra = _median_seconds(run(piped), w, x, repeats=repeats) - _median_seconds(run(plain), w, x, repeats=repeats)
    return max(0.0, extra / trips / (mb * seq * width * 4))


def fresh_memory_cost(devices: list, repeats: int, megabytes: int = 32) -> float:
    """Seconds per byte of memory a program allocates afresh each run: `x + 1` into a new buffer against the same
    into its donated input, `megabytes` per device on every device at once. XLA:CPU allocates a step's temporaries
    anew at each call and the OS faults their pages in (~1.5 ms per MB per device with 8 simulated devices on 2
    cores: five times the add itself); an accelerator's allocator reuses its pool (→ ~0)."""
    row, elems = _Row(devices), (megabytes << 20) // 4
    t_fresh = _median_seconds(jax.jit(lambda a: a + 1.0), row.put((elems,), 0.0), repeats=repeats)
    t_donated = _median_seconds(jax.jit(lambda a: a + 1.0, donate_argnums=0), row.put((elems,), 0.0),
                                repeats=repeats, chain=True)
    return max(0.0, (t_fresh - t_donated) / (elems * 4))


def measure(devices: list | None = None, *, repeats: int = 7) -> Profile:
    """The profile of the machine holding `devices` (default: this process's local devices): ~12 s for 8 simulated
    CPU devices on 2 cores, most of it compiling the small programs it times."""
    devices = list(jax.local_devices() if devices is None else devices)
    dev, n = devices[0], len(devices)
    gpu = dev.platform != "cpu"
    size, nbytes = (8192, 64 << 20) if gpu else (512, 4 << 20)
    # Token-major matmuls of each width (rows: a microbatch's tokens): `cost.matmul_rate` takes each matmul of a
    # layer at the rate of its width.
    widths, rows = ((1024, 2048, 4096, 8192), 16384) if gpu else ((64, 128, 256, 512, 1024), 2048)
    table = {d: {str(w): matmul_rate(devices, d, w, repeats, rows) for w in widths} for d in ("float32", "bfloat16")}
    table["float16"] = table["bfloat16"] if gpu else table["float32"]
    # FP8 (model.matmul = fp8_rowwise): the policy's own product — on a GPU XLA rewrites it into an FP8 GEMM, on a
    # CPU it is emulated (quantize, dequantize, the compute dtype's matmul) and slower than the plain one
    table["float8"] = {str(w): matmul_rate(devices, "float8", w, repeats, rows, dtype="bfloat16" if gpu else "float32")
                       for w in widths}
    rates = {d: max(t.values()) for d, t in table.items()}
    groups = [g for g in (2, 4, 8, 16, 32, 64) if g <= n and n % g == 0]
    links = {kind: {str(g): link_bandwidth(devices, kind, g, nbytes, repeats) for g in groups} for kind in KINDS}
    widest = links["all_reduce"][str(groups[-1])] if groups else 0.0
    base = profile_for(dev.device_kind) if gpu and flops.device_row(dev.device_kind) else None
    peak = {d: flops.peak_flops(dev.device_kind, d) or 0.0 for d in ("float32", "bfloat16", "float16", "float8")} \
        if gpu else {}
    return Profile(
        name=f"{'cpu' if not gpu else (flops.device_row(dev.device_kind) or dev.device_kind)} x{n}",
        flops=rates,
        intra_host=widest or (base.intra_host if base else 1.0),
        inter_host=base.inter_host if base else (widest or 1.0),
        memory_gb=round(device_memory_gb(dev), 3),
        source=f"probed on {n} {dev.device_kind} device(s)",
        peak={k: v for k, v in peak.items() if v},
        latency=collective_latency(devices, repeats) if n > 1 else 0.0,
        latency_inter=base.latency_inter if base else Profile.latency_inter,
        layer_overhead=layer_overhead(devices, repeats),
        pipeline_byte=pipeline_cost(devices, repeats),
        fresh_byte=fresh_memory_cost(devices, repeats),
        overlap=overlap_fraction(devices, size, nbytes, repeats) if n > 1 else 1.0,
        matmul=table,
        links=links,
        machine=machine(),
        devices=n,
    )
