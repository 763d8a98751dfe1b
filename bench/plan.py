"""The planner's memory model against the compiled program, layout by layout, on 8 simulated devices.

    python -m bench.plan [--only tiny,moe,long] [--format table|json] [--out FILE]

For each layout (tiny, MoE and long-context models; data, tensor, sequence parallel, pipe with every schedule,
expert, context, ZeRO, remat, gradient accumulation) the train step is compiled from abstract state (nothing is
allocated) and its `memory_analysis()` set beside `jaxpar.planner.memory.predict_memory`:

    resident   arguments (params + optimizer state + batch) — predicted exactly, so the error column must read 0
    temp       XLA's temporaries (gradients + activations + workspace)
    peak       arguments + outputs − aliased + temporaries, against the predicted total

and the summary prints the median and largest |error| of the total. `--out` keeps the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench import with_devices

DEVICES = 8
FLAT = ["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]
LONG = ["train.seq_len=1024", "model.max_seq_len=1024", "train.batch_size=8", "model.n_layers=2"] + FLAT

# (model, config file, overrides): the tiny model's defaults are data 2 × pipe 2 × tensor 2, the MoE's pipe 2 ×
# expert 2 × tensor 2; the long-context one is tiny at 1,024 tokens, one row per device at data 8.
LAYOUTS = [
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=1"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=1", "parallel.zero=1"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=1", "parallel.zero=3"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=1", "parallel.remat=full"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=1", "parallel.remat=dots"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=2"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=2", "train.grad_accum=2"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=4"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=4", "parallel.sequence_parallel=true"]),
    ("tiny", "configs/tiny.py", FLAT + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                        "parallel.remat=full"]),
    ("tiny", "configs/tiny.py", []),
    ("tiny", "configs/tiny.py", ["parallel.remat=full"]),
    ("tiny", "configs/tiny.py", ["parallel.tensor=1", "parallel.repeats=1", "parallel.microbatches=2"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=1f1b", "parallel.repeats=1"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=interleaved_1f1b"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=zb_h1", "parallel.repeats=1"]),
    ("tiny", "configs/tiny.py", ["parallel.pipe=4", "parallel.tensor=1", "parallel.repeats=1"]),
    ("tiny", "configs/tiny.py", ["parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.zero=0",
                                 "parallel.data=1"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=zb_h1", "parallel.repeats=1", "parallel.remat=dots"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=zbv", "parallel.remat=dots", "train.grad_accum=2"]),
    ("tiny", "configs/tiny.py", ["parallel.schedule=1f1b", "parallel.repeats=1", "parallel.sequence_parallel=true",
                                 "parallel.remat=dots"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=1", "parallel.tensor=1"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=2", "parallel.tensor=1"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=4", "parallel.tensor=1"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=8", "parallel.tensor=1"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=2", "parallel.tensor=2"]),
    ("moe", "configs/moe_tiny.py", FLAT + ["parallel.expert=2", "parallel.tensor=1", "parallel.remat=full"]),
    ("moe", "configs/moe_tiny.py", []),
    ("moe", "configs/moe_tiny.py", ["parallel.schedule=zbv", "parallel.remat=dots"]),
    ("long", "configs/tiny.py", ["parallel.tensor=1"]),
    ("long", "configs/tiny.py", ["parallel.tensor=1", "parallel.context=2"]),
    ("long", "configs/tiny.py", ["parallel.tensor=1", "parallel.context=4"]),
    ("long", "configs/tiny.py", ["parallel.tensor=1", "parallel.context=8"]),
    ("long", "configs/tiny.py", ["parallel.tensor=1", "parallel.context=2", "parallel.context_impl=ring"]),
    ("long", "configs/tiny.py", ["parallel.tensor=2", "parallel.context=2"]),
    ("long", "configs/tiny.py", ["parallel.tensor=2", "parallel.context=2", "parallel.sequence_parallel=true"]),
    ("long", "configs/tiny.py", ["parallel.tensor=2", "parallel.remat=full"]),
]


def measure(name: str, path: str, overrides: list[str]) -> dict:
    """Compile one layout from abstract state and set its memory_analysis beside the prediction."""
    import jax

    from bench.pipeline import abstract_step
    from jaxpar.analysis.hlo import memory
    from jaxpar.config import load_config
    from jaxpar.planner.memory import activation_bytes, predict_memory

    config = load_config(path, (LONG if name == "long" else []) + overrides).resolve_for_devices(DEVICES)
    start = time.perf_counter()
    predicted = predict_memory(config, "cpu")
    act = activation_bytes(config, "cpu")
    predict_s = time.perf_counter() - start
    step, state, batch = abstract_step(config)
    measured = memory(step.lower(state, batch).compile())
    jax.clear_caches()
    return {"model": name, "layout": " ".join(o.removeprefix("parallel.") for o in overrides) or "(preset)",
            "mesh": dict(zip(("data", "pipe", "expert", "context", "tensor"), config.mesh_shape)),
            "predicted": predicted.as_dict(), "activation_parts": act, "measured": measured,
            "predict_seconds": predict_s}


def error(row: dict) -> float:
    """Relative error of the predicted total against the compiled peak."""
    return row["predicted"]["total"] / row["measured"]["peak_bytes"] - 1


def format_table(rows: list[dict]) -> str:
    mb = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    lines = [f"{'model':5} {'layout':60} {'resident':>8} {'err':>5} {'temp':>8} {'pred':>8} {'peak':>8} "
             f"{'pred':>8} {'error':>7}", "-" * 126]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        temp = p["gradients"] + p["activations"] + p["workspace"]
        lines.append(f"{r['model']:5} {r['layout'][:60]:60} {mb(m['argument_bytes'])} "
                     f"{p['resident'] - m['argument_bytes']:5d} {mb(m['temp_bytes'])} {mb(temp)} "
                     f"{mb(m['peak_bytes'])} {mb(p['total'])} {error(r) * 100:+6.1f}%")
    errors = [abs(error(r)) for r in rows]
    lines += ["-" * 126, f"{len(rows)} layouts (MiB per device): resident exact in "
              f"{sum(r['predicted']['resident'] == r['measured']['argument_bytes'] for r in rows)}; total |error| "
              f"median {statistics.median(errors) * 100:.1f} %, max {max(errors) * 100:.1f} %"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="tiny,moe,long", help="models to run: tiny, moe, long")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--out", help="write the raw rows as JSON here")
    args = parser.parse_args(argv)
    with_devices("bench.plan", DEVICES, argv)
    only = set(args.only.split(","))
    rows = []
    for name, path, overrides in LAYOUTS:
        if name in only:
            rows.append(measure(name, path, overrides))
            print(f"  {name} {rows[-1]['layout']}: {error(rows[-1]) * 100:+.1f} %", file=sys.stderr, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows) if args.format == "json" else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
