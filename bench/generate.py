"""Benchmark: decoding with the KV cache vs the cache-free reference, side by side in one run.

    python bench/generate.py [--quick] [--tensor 1 2 4] [--tables 1 2 3] [--json out.json]
    python bench/generate.py --accuracy WORKDIR [--group-size 32] [--tensor 2]     (table 4 only)

For tensor ∈ {1, 2, 4} (a (data=1, pipe=1, tensor=t) mesh on the first t simulated devices, parameters placed by
the rules table, GSPMD partitioning the computation — and, in table 1, the same weights under the explicit
tensor-parallel shard_map with the vocab-parallel sampler, `decode.generate(..., plan=)`) it prints two tables.

1. End to end: B prompts of P tokens extended by N greedy tokens with `jaxpar.infer.decode.generate` (prefill, then
   a `lax.while_loop` of one-token steps reading a KV cache, all in one jit) and with
   `jaxpar.infer.sampling.generate_uncached` (every step re-runs the full causal forward over a fixed [B, P + N]
   buffer).
   tokens/s = B·N / median wall time (compiled once beforehand; prefill included in the cached path), the speed-up,
   and the fraction of generated tokens on which the two agree (a sanity check, not a timing: both are greedy on
   the same weights, so they differ only where float rounding flips a near-tie).
2. Per token against the context c: one jitted cached step (`model.decode` of one token per row with c − 1 slots
   already filled, so it attends over c keys, its own included) over a cache of max(c) slots (KV: one executable
   for every c, the positions are traced) and over a cache of exactly c slots (KV fit: what `decode.generate`
   allocates when P + N = c); and one cache-free step (the full forward over c tokens: what producing token c + 1
   costs without a cache). The fastest of a few calls in ms (each step emits one token per row), the ratio
   no-cache / KV, and each step's matmul MFLOP per device counted from the compiled HLO (`dot_flops`).

3. Weight formats: the same weights in fp32, bf16 (compute and parameters), and bf16 compute with the layers'
   matrices stored int8 (a scale per output channel) or int4 (a scale per group of g inputs, g the largest of 128,
   64, 32 that every tensor degree of the run can split), decoded by the explicit TP path (`decode.generate(...,
   plan=)`) at each tensor degree: end-to-end tokens/s (the workload of table 1), one compiled decode step's time
   (`decode.explicit_decode_step`, fastest of a few calls), the parameter MB a device holds (from the arrays' dtypes:
   int4 packs two a byte, as XLA stores it), tokens/s relative to fp32 at the same degree, and the fraction of
   greedy tokens equal to fp32's. The model here has d_ff = 4·d_model, so every width splits into groups of 2^k.

4. `--accuracy WORKDIR` (a trained model, e.g. `make demo`'s runs/demo): bf16, int8 and int4 (groups of
   `--group-size`) at the first `--tensor` degree — held-out loss over 32 windows of the run's sequence length from
   the held-out split (`infer.text.held_out_loss`), its change against bf16, and the fraction of 200 greedy tokens
   after "def " equal to bf16's.

How to read it: KV stays flat in c — the same executable with the same FLOPs whatever c is, since attention reads
the whole buffer, masked. Its cost is set by the buffer, not by how much of it is filled: KV fit grows with c
(attention over c slots; on this CPU mostly memory traffic — per layer the scan slices that layer's whole k and v
out of the stacked cache, writes one slot, writes the slice back and transposes k for the score dot, several
buffer-sized copies against ~33 MFLOP of matmuls at the default size) and meets KV at c = max(c). The cache-free
step's FLOPs grow linearly in c (its attention part quadratically) and its time faster still: XLA's CPU attention
materialises the f32 scores [B, K, H/K, c, c] (33.5 MB per layer at c = 512) and passes over them several times
(mask, transposed copy, max, exp, normalise), so past c ≈ 256 that c² memory traffic dominates. The end-to-end
speed-up is the per-step effect summed over N steps, plus one prefill.

On simulated CPU devices every "device" shares the same host cores, so tensor > 1 is not faster here (it adds the
collectives and per-device dispatch); the point is that both paths run sharded and the ratios hold. On real
accelerators run the same script with real devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.analysis import dot_flops  # noqa: E402
from jaxpar.config import ModelConfig, ParallelConfig  # noqa: E402
from jaxpar.infer import decode, sampling  # noqa: E402
from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.model import KVCache, Transformer, abstract_model, quantize_state  # noqa: E402
from jaxpar.plan import make_plan  # noqa: E402
from jaxpar.sharding import param_shardings  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the model, the end-to-end workload and the contexts of the per-step sweep."""

    model: ModelConfig
    batch: int  # B prompts
    prompt: int  # P tokens each (a multiple of 8: right_pad adds no padding, both paths see the same tokens)
    new_tokens: int  # N generated per prompt
    contexts: tuple[int, ...]  # c of the per-step sweep; the cache buffer has max(contexts) slots
    repeats: int  # timed end-to-end runs (after one warm-up run that compiles)
    # Timed calls per single-step measurement. Steps take milliseconds and the host's cores are shared, so one
    # burst of other work can cover most of a short run: the minimum is the least disturbed estimate of the step.
    step_repeats: int


DEFAULT = Sizes(ModelConfig(family="llama", vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                            max_seq_len=1024), batch=4, prompt=64, new_tokens=64, contexts=(64, 128, 256, 512),
                repeats=3, step_repeats=10)
QUICK = Sizes(ModelConfig(family="llama", vocab_size=512, d_model=128, n_layers=2, n_heads=8, n_kv_heads=4,
                          max_seq_len=512), batch=4, prompt=32, new_tokens=16, contexts=(32, 64, 128, 256), repeats=2,
              step_repeats=5)


def seconds(fn: Callable[[], object], repeats: int, stat: Callable[[list[float]], float] = statistics.median
            ) -> float:
    """`stat` (median, or min) of the wall times of `repeats` calls of `fn()`, each until its result is ready,
    after one warm-up call that pays for compilation."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return stat(times)


def place_model(cfg: ModelConfig, params: nnx.State, tensor: int):
    """`params` on a mesh of the first `tensor` devices (data 1, tensor `tensor`), sharded by the rules table with the vocab
    padded to a multiple of tensor: the layout `jaxpar.infer.text.load` gives a trained model. Every degree
    gets the same weights (initialised once: compiling the init costs more than a quick run's measurements).
    → (mesh, graphdef, params, the explicit plan of the same layout: `decode.generate(..., plan=)` runs it)."""
    parallel = ParallelConfig(data=1, pipe=1, tensor=tensor)
    plan = make_plan(cfg, parallel, jax.devices()[:tensor], explicit=False)  # GSPMD inserts the collectives
    graphdef, abstract = abstract_model(cfg, plan.padded_vocab)
    placed = jax.device_put(plan.from_canonical(params), param_shardings(abstract, plan.mesh, plan.rules))
    return plan.mesh, graphdef, placed, make_plan(cfg, parallel, plan.mesh)


def make_forward(graphdef: nnx.GraphDef) -> Callable:
    """jit(params, tokens [B, T]) → logits [B, T, V]: the cache-free path's whole step. Params are an argument, not
    a closure, so they are not baked into the executable as constants."""
    return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


def make_cached_step(graphdef: nnx.GraphDef) -> Callable:
    """jit(params, tok [B], cache arrays, positions [B]) → (logits [B, V], cache arrays): one KV-cache decode step
    (`decode.decode_step`).

    The cache's arrays (GQA: k and v [L, B, S, K, E]) are donated, so the one-slot-a-row write is in place as it is
    inside decode's `while_loop`; without donation every call would also copy the whole cache (2·L·B·S·K·E floats),
    a cost that grows with S and that real decoding does not pay. `positions` is traced: one compilation serves
    every context.
    """

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, tok, arrays, positions):
        model = nnx.merge(graphdef, params)
        logits, cache = decode.decode_step(model, tok[:, None], positions, KVCache(arrays, positions))
        return logits[:, 0], decode.laid_out(cache, model.cfg).arrays

    return step


def end_to_end(sizes: Sizes, mesh, graphdef, params, explicit, rng: np.random.Generator) -> dict:
    """Tokens/s of KV-cache generate (GSPMD, and explicit TP with `explicit`, the plan) vs cache-free generate for
    the same greedy workload."""
    B, Pn, N = sizes.batch, sizes.prompt, sizes.new_tokens
    prompts = rng.integers(0, sizes.model.vocab_size, (B, Pn)).astype(np.int32)
    model = nnx.merge(graphdef, params)
    cached = functools.partial(decode.generate, model, prompts, max_new_tokens=N, mesh=mesh, return_prompt=False)
    forward = functools.partial(make_forward(graphdef), params)

    def cache_free() -> np.ndarray:
        with jax.set_mesh(mesh):
            return sampling.generate_uncached(forward, prompts, max_new_tokens=N, max_len=Pn + N,
                                              rng=jax.random.key(0), temperature=0.0)

    explicit_tp = functools.partial(decode.generate, model, prompts, max_new_tokens=N, plan=explicit,
                                    return_prompt=False)
    kv_s = seconds(cached, sizes.repeats)
    explicit_s = seconds(explicit_tp, sizes.repeats)
    free_s = seconds(cache_free, sizes.repeats)
    agree = float((cached() == cache_free()).mean())
    return {"kv_tokens_per_s": B * N / kv_s, "free_tokens_per_s": B * N / free_s, "speedup": free_s / kv_s,
            "agree": agree, "explicit_tokens_per_s": B * N / explicit_s,
            "explicit_agree": float((explicit_tp() == cached()).mean())}


class CachedStep:
    """One compiled cached step over a cache of `slots` slots, timed with its donated buffers fed back in."""

    def __init__(self, step: Callable, params: nnx.State, cfg: ModelConfig, batch: int, slots: int, mesh):
        replicated = NamedSharding(mesh, P())
        # The cache laid out as decode lays it out (kv heads over tensor); its contents do not change the cost.
        empty = jax.jit(lambda: decode.laid_out(KVCache.empty(cfg, batch, slots), cfg).arrays)
        self.params, self.arrays = params, empty()
        self.tok = jax.device_put(np.zeros((batch,), np.int32), replicated)
        self.replicated, self.batch = replicated, batch
        self.compiled = step.lower(params, self.tok, self.arrays, self.tok).compile()
        self.flops = dot_flops(self.compiled)

    def seconds(self, context: int, repeats: int) -> float:
        """Fastest of `repeats` calls of the step that writes slot context − 1, so attends over `context` keys."""
        positions = jax.device_put(np.full((self.batch,), context - 1, np.int32), self.replicated)

        def call() -> jax.Array:
            logits, self.arrays = self.compiled(self.params, self.tok, self.arrays, positions)
            return logits

        return seconds(call, repeats, min)


def per_step(sizes: Sizes, mesh, graphdef, params, rng: np.random.Generator) -> list[dict]:
    """ms and matmul FLOPs per device of one cached step and one cache-free step at each context c."""
    cfg, B = sizes.model, sizes.batch
    replicated = NamedSharding(mesh, P())
    rows = []
    with jax.set_mesh(mesh):
        step, forward = make_cached_step(graphdef), make_forward(graphdef)
        # One executable for every c (the positions are traced): its FLOPs cannot depend on c.
        fixed = CachedStep(step, params, cfg, B, max(sizes.contexts), mesh)
        for c in sizes.contexts:
            # The same step over a buffer of exactly c slots (what decode.generate allocates for P + N = c): the
            # attention and cache traffic of a step scale with the buffer, not with how much of it is filled.
            fitted = CachedStep(step, params, cfg, B, c, mesh)
            tokens = jax.device_put(rng.integers(0, cfg.vocab_size, (B, c)).astype(np.int32), replicated)
            compiled_fwd = forward.lower(params, tokens).compile()
            kv_s = fixed.seconds(c, sizes.step_repeats)
            fitted_s = fitted.seconds(c, sizes.step_repeats)
            free_s = seconds(functools.partial(compiled_fwd, params, tokens), sizes.step_repeats, min)
            rows.append({"context": c, "kv_ms": kv_s * 1e3, "kv_fitted_ms": fitted_s * 1e3, "free_ms": free_s * 1e3,
                         "ratio": free_s / kv_s, "kv_mflop": fixed.flops / 1e6, "kv_fitted_mflop": fitted.flops / 1e6,
                         "free_mflop": dot_flops(compiled_fwd) / 1e6})
    return rows


FORMATS = ("fp32", "bf16", "int8", "int4")


def format_config(cfg: ModelConfig, fmt: str, group: int) -> ModelConfig:
    """The model config of weight format `fmt` (table 3): fp32, or bf16 compute with bf16 / int8 / int4 weights."""
    if fmt == "fp32":
        return cfg
    cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
    return cfg if fmt == "bf16" else dataclasses.replace(cfg, weights=fmt, weight_group=group)


def int4_group(cfg: ModelConfig, tensors: list[int]) -> int:
    """The largest int4 group size in (128, 64, 32, 16) whose groups every tensor degree in `tensors` can split."""
    for group in (128, 64, 32, 16):
        try:
            for t in tensors:
                make_plan(format_config(cfg, "int4", group), ParallelConfig(data=1, tensor=t), jax.devices()[:t])
            return group
        except ConfigError:
            continue
    raise SystemExit(f"no int4 group size fits d_model {cfg.d_model} at tensor {tensors}")


def param_megabytes(params: nnx.State) -> float:
    """MB of parameters one device holds (int4 packed two a byte)."""
    total = 0
    for a in jax.tree.leaves(params):
        bits = (jnp.iinfo if jnp.issubdtype(a.dtype, jnp.integer) else jnp.finfo)(a.dtype).bits
        total += a.addressable_shards[0].data.size * bits // 8
    return total / 1e6


def weight_formats(sizes: Sizes, tensors: list[int], rng: np.random.Generator) -> dict:
    """Table 3: decode speed and weight bytes of every format at every tensor degree (explicit TP)."""
    cfg = dataclasses.replace(sizes.model, d_ff=4 * sizes.model.d_model)
    group = int4_group(cfg, tensors)
    B, Pn, N = sizes.batch, sizes.prompt, sizes.new_tokens
    prompts = rng.integers(0, cfg.vocab_size, (B, Pn)).astype(np.int32)
    weights = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rows = {}
    for t in tensors:
        reference = None
        for fmt in FORMATS:
            fcfg = format_config(cfg, fmt, group)
            plan = make_plan(fcfg, ParallelConfig(data=1, tensor=t), jax.devices()[:t])
            state = weights if fmt == "fp32" else jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights)
            if fcfg.weights != "float":
                state = quantize_state(state, fcfg)
            graphdef, abstract = abstract_model(fcfg, plan.padded_vocab)
            params = jax.device_put(plan.from_canonical(state), param_shardings(abstract, plan.mesh, plan.rules))
            model = nnx.merge(graphdef, params)
            run = functools.partial(decode.generate, model, prompts, max_new_tokens=N, plan=plan, return_prompt=False)
            total = seconds(run, sizes.repeats)
            tokens = run()
            reference = tokens if reference is None else reference
            step, example = decode.explicit_decode_step(model, plan, B, Pn + N, temperature=0.0, top_k=0, top_p=1.0)
            step_s = seconds(functools.partial(step, *example), sizes.step_repeats, min)
            rows[(t, fmt)] = {"tensor": t, "format": fmt, "tokens_per_s": B * N / total, "step_ms": step_s * 1e3,
                              "param_mb": param_megabytes(params), "same_as_fp32": float((tokens == reference).mean())}
    return {"group": group, "d_ff": cfg.d_ff, "rows": list(rows.values())}


def accuracy(workdir: str, group: int, tensor: int) -> list[dict]:
    """Table 4: held-out loss and greedy agreement of the trained `workdir` in bf16, int8 and int4."""
    from jaxpar.data import load_tokens
    from jaxpar.infer.text import generate_tokens, held_out_loss, load

    rows, base = [], None
    for fmt, g in (("bf16", None), ("int8", None), ("int4", group)):
        loaded = load(workdir, tensor=tensor, dtype="bfloat16", quantize=None if fmt == "bf16" else fmt, group_size=g)
        T = loaded.config.train.seq_len
        stream = load_tokens(loaded.config.data, loaded.tokenizer, "eval", seq_len=T)
        windows = np.asarray(stream[:32 * (T + 1)]).reshape(32, T + 1)
        loss = held_out_loss(loaded, windows)
        text = generate_tokens(loaded, np.array([list(b"def ")], np.int32), max_new_tokens=200, temperature=0.0)[0]
        base = base or (loss, text)
        rows.append({"format": fmt, "loss": loss, "change": loss / base[0] - 1,
                     "same_greedy": float((text == base[1]).mean())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and workload (under a minute)")
    parser.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4], help="tensor degrees to run")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3],
                        help="which tables to run (1 and 2 are measured together)")
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--accuracy", metavar="WORKDIR", help="table 4 only: quantized accuracy of a trained run")
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size for --accuracy")
    args = parser.parse_args()
    if args.accuracy:
        t = args.tensor[0] if args.tensor != [1, 2, 4] else 2
        rows = accuracy(args.accuracy, args.group_size, t)
        print(f"4. {args.accuracy} at tensor {t}, bf16 compute: held-out loss (32 windows) and 200 greedy tokens")
        head = f"{'format':>6} | {'loss':>7} {'change':>8} | {'same greedy':>11}"
        print(head + "\n" + "-" * len(head))
        for r in rows:
            print(f"{r['format']:>6} | {r['loss']:>7.4f} {r['change']:>+8.3%} | {r['same_greedy']:>11.0%}")
        return
    sizes = QUICK if args.quick else DEFAULT
    m = sizes.model
    print(f"model: llama, d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads ({m.n_kv_heads} kv), vocab "
          f"{m.vocab_size}, {m.dtype}; {jax.devices()[0].platform} x {len(jax.devices())} simulated devices "
          "sharing the host's cores (tensor > 1 adds collectives here, not speed)\n")
    results = {"sizes": {"batch": sizes.batch, "prompt": sizes.prompt, "new_tokens": sizes.new_tokens,
                         "d_model": m.d_model, "n_layers": m.n_layers}, "tensor": {}}
    weights = nnx.state(Transformer(m, rngs=nnx.Rngs(0)), nnx.Param)  # eager, on the first device
    for t in args.tensor if {1, 2} & set(args.tables) else ():
        mesh, graphdef, params, explicit = place_model(m, weights, t)
        rng = np.random.default_rng(0)
        results["tensor"][t] = {"end_to_end": end_to_end(sizes, mesh, graphdef, params, explicit, rng),
                                "per_step": per_step(sizes, mesh, graphdef, params, rng)}
    if 3 in args.tables:
        results["formats"] = weight_formats(sizes, args.tensor, np.random.default_rng(0))
    print_tables(sizes, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def print_tables(sizes: Sizes, results: dict) -> None:
    """Tables 1 and 2 (measured together) when run, then table 3 when run."""
    if results["tensor"]:
        print_step_tables(sizes, results)
    if "formats" in results:
        f = results["formats"]
        print(f"\n3. weight formats, explicit TP decoding (d_ff {f['d_ff']}, int4 groups of {f['group']}): the table 1 "
              "workload; step = one compiled decode step, fastest call")
        head = f"{'t':>2} {'format':>6} | {'tok/s':>7} {'/fp32':>6} | {'step ms':>7} | {'param MB/dev':>12} | {'same':>5}"
        print(head + "\n" + "-" * len(head))
        base = {r["tensor"]: r for r in f["rows"] if r["format"] == "fp32"}
        for r in f["rows"]:
            print(f"{r['tensor']:>2} {r['format']:>6} | {r['tokens_per_s']:>7.0f} "
                  f"{r['tokens_per_s'] / base[r['tensor']]['tokens_per_s']:>6.2f} | {r['step_ms']:>7.2f} | "
                  f"{r['param_mb']:>12.3f} | {r['same_as_fp32']:>5.0%}")


def print_step_tables(sizes: Sizes, results: dict) -> None:
    print(f"1. end to end: {sizes.batch} prompts x {sizes.prompt} tokens + {sizes.new_tokens} new (greedy); "
          f"median of {sizes.repeats}")
    head = (f"{'t':>2} | {'KV cache tok/s':>14} {'no cache tok/s':>14} {'speed-up':>8} | {'same tokens':>11} | "
            f"{'explicit TP tok/s':>17} {'/GSPMD':>6} {'same':>5}")
    print(head + "\n" + "-" * len(head))
    for t, r in results["tensor"].items():
        e = r["end_to_end"]
        print(f"{t:>2} | {e['kv_tokens_per_s']:>14.0f} {e['free_tokens_per_s']:>14.0f} {e['speedup']:>7.1f}x | "
              f"{e['agree']:>11.0%} | {e['explicit_tokens_per_s']:>17.0f} "
              f"{e['explicit_tokens_per_s'] / e['kv_tokens_per_s']:>6.2f} {e['explicit_agree']:>5.0%}")

    S = max(sizes.contexts)
    print(f"\n2. one step (one token per row, batch {sizes.batch}) against the context c. KV: a cache of {S} slots "
          f"(one executable for every c);\n   KV fit: a cache of exactly c slots (recompiled per c). ratio = no-cache / "
          f"KV. MFLOP = matmul FLOPs per device from the compiled HLO")
    head = (f"{'t':>2} {'c':>5} | {'KV ms':>7} {'KV fit ms':>9} {'no-cache ms':>11} {'ratio':>6} | "
            f"{'KV MFLOP':>8} {'KV fit MFLOP':>12} {'no-cache MFLOP':>14}")
    print(head + "\n" + "-" * len(head))
    for t, r in results["tensor"].items():
        for s in r["per_step"]:
            print(f"{t:>2} {s['context']:>5} | {s['kv_ms']:>7.2f} {s['kv_fitted_ms']:>9.2f} {s['free_ms']:>11.2f} "
                  f"{s['ratio']:>6.1f} | {s['kv_mflop']:>8.1f} {s['kv_fitted_mflop']:>12.1f} "
                  f"{s['free_mflop']:>14.1f}")


if __name__ == "__main__":
    main()
