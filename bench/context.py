"""Context parallelism side by side: compiled memory per device against c, and step time, on 8 simulated devices.

    python -m bench.context [--seq-len 2048] [--degrees 1,2,4,8] [--impls all_gather,ring] [--steps 2]
                            [--rounds 3] [--no-time] [--format table|json]

1. Memory. One sequence of `--seq-len` tokens per data shard (data = 8 / c, so every device holds S/c tokens of
   one row), the train step's compiled temporaries (`memory_analysis().temp_size_in_bytes`, lowered from abstract
   state: nothing runs) and their ratio to context 1. At a length where attention's [S/c, S] score matrices
   dominate, the ratio is about 1/c — for all-gather K/V, whose score rows are S long; ring attention holds one
   [S/c, S/c] block at a time and saves no scores at all.
2. Step time at a fixed global batch of 8 sequences (data = 8 / c: the same tokens per device at every c), medians
   of interleaved rounds, and the ratio to context 1. On simulated CPU devices the ranks share two cores, so this
   shows the all-gathers' and the mask's overheads, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import step_medians, with_devices

DEVICES = 8
MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.d_ff=192"]


def config_for(context: int, seq_len: int, rows: int, impl: str = "all_gather"):
    from jaxpar.config import load_config

    data = DEVICES // context
    over = MODEL + [f"model.max_seq_len={seq_len}", f"train.seq_len={seq_len}", f"train.batch_size={rows * data}",
                    f"parallel.data={data}", f"parallel.context={context}", f"parallel.context_impl={impl}",
                    "parallel.pipe=1", "parallel.tensor=1",
                    "parallel.repeats=1", "parallel.microbatches=1"]
    return load_config("configs/tiny.py", over).resolve_for_devices(DEVICES)


def cases(degrees: list[int], impls: list[str]) -> list[tuple[int, str]]:
    """(context, impl) pairs: context 1 once (no impl applies), every impl at the others."""
    return [(c, impl) for c in degrees for impl in (impls if c > 1 else impls[:1])]


def memory_rows(degrees: list[int], impls: list[str], seq_len: int) -> list[dict]:
    from bench.pipeline import abstract_step

    rows, base = [], None
    for c, impl in cases(degrees, impls):
        step, state, batch = abstract_step(config_for(c, seq_len, rows=1, impl=impl))
        temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
        base = base or temp
        rows.append({"context": c, "impl": impl if c > 1 else "-", "seq_len": seq_len, "temp_bytes": temp,
                     "vs_first": temp / base, "ideal": degrees[0] / c})
    return rows


def time_rows(degrees: list[int], impls: list[str], seq_len: int, steps: int, rounds: int) -> list[dict]:
    # 8 sequences in all at every c
    times = step_medians({(c, impl): config_for(c, seq_len, rows=c, impl=impl) for c, impl in cases(degrees, impls)},
                         steps, rounds)
    base = next(iter(times.values()))
    return [{"context": c, "impl": impl if c > 1 else "-", "step_ms": t * 1e3, "vs_first": t / base}
            for (c, impl), t in times.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--degrees", default="1,2,4,8", help="context degrees, the first the baseline")
    parser.add_argument("--impls", default="all_gather,ring", help="context_impl values to compare")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="memory table only")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    with_devices("bench.context", DEVICES, argv)  # the device count is fixed when jax starts
    degrees = [int(x) for x in args.degrees.split(",")]
    impls = args.impls.split(",")
    mem = memory_rows(degrees, impls, args.seq_len)
    times = [] if args.no_time else time_rows(degrees, impls, args.seq_len, args.steps, args.rounds)
    if args.format == "json":
        print(json.dumps({"memory": mem, "time": times}, indent=2))
        return 0
    print(f"compiled temporaries per device, one sequence of {args.seq_len} tokens per data shard (data = 8 / c)")
    print(f"{'context':>7} {'impl':>10} {'temp MB':>9} {'vs first':>8} {'1/c':>6}")
    for r in mem:
        print(f"{r['context']:7d} {r['impl']:>10} {r['temp_bytes'] / 2**20:9.2f} {r['vs_first']:8.3f} "
              f"{r['ideal']:6.3f}")
    if times:
        print(f"\nstep time, 8 sequences of {args.seq_len} tokens, medians of {args.rounds} interleaved rounds of "
              f"{args.steps} steps")
        for r in times:
            print(f"context {r['context']:d} {r['impl']:>10}  {r['step_ms']:8.1f} ms   this/first {r['vs_first']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
