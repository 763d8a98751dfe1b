"""Pipeline schedules side by side: compiled memory against m, and step time, at (data, pipe, tensor) = (2, 2, 2).

    python -m bench.schedules [--mults 1,2,4,8] [--steps 4] [--rounds 3] [--no-time] [--format table|json]

1. Memory. For each schedule and m = p·mult microbatches at a fixed microbatch size (2 rows of 64 tokens per data
   shard: the batch grows with m), the train step's compiled temporaries (`memory_analysis().temp_size_in_bytes`,
   lowered from abstract state: nothing runs) and their ratio to the m = p program. GPipe and the circular loop keep
   every microbatch's activations until the backward, so theirs grow with m; 1F1B, ZB-H1 and ZB-V keep at most p
   (ZB-V: 2p half-stage chunks), so theirs stay put. Beside it, each table's ticks, bubble and peak in flight, and
   the bubble by the compiled program's executed FLOPs (`jaxpar.analysis.report.schedule_flops`): the stages run
   the ticks in lockstep, so a tick lasts as long as its busiest stage's action (of the layers alone, and with the
   head and loss, which the stage holding the last chunk runs in its F).
2. Step time at m = 4 (the bench layout), every schedule's compiled step timed in interleaved rounds of `--steps`
   steps, medians, and the ratio circular / schedule (> 1: faster than the circular loop). On simulated CPU
   devices the stages share the host's cores, so a bubble costs nothing and extra work does: the times show
   overheads, not a pipeline's speed-up (a GPU run of bench/gpu.sh shows that).
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import step_medians, with_devices

DEVICES = 8
SCHEDULES = {"circular": 2, "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}  # name: chunks
MODEL = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=16",
         "model.d_ff=192", "model.max_seq_len=64", "train.seq_len=64"]
LAYOUT = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"]
ROWS = 2  # rows per microbatch per data shard


def config_for(name: str, microbatches: int):
    from jaxpar.config import load_config

    over = MODEL + LAYOUT + [f"parallel.schedule={name}", f"parallel.repeats={SCHEDULES[name]}",
                             f"parallel.microbatches={microbatches}", f"train.batch_size={2 * ROWS * microbatches}"]
    return load_config("configs/tiny.py", over).resolve_for_devices(DEVICES)


def compiled_step(config):
    from bench.pipeline import abstract_step

    step, state, batch = abstract_step(config)
    return step.lower(state, batch).compile()


def memory_rows(mults: list[int]) -> list[dict]:
    from jaxpar.analysis.report import schedule_flops
    from jaxpar.parallel import schedule

    rows = []
    for name, v in SCHEDULES.items():
        base = None
        for k in mults:
            m = 2 * k
            compiled = compiled_step(config_for(name, m))
            temp = compiled.memory_analysis().temp_size_in_bytes
            base = base or temp
            table = schedule.build(name, 2, v, m)
            # the executor's lockstep bubble by executed FLOPs: its layer work alone, and with the head and loss
            executed = {} if name == "circular" else schedule_flops(compiled, schedule.lower(table))
            rows.append({"schedule": name, "chunks": v, "microbatches": m, "temp_bytes": temp,
                         "vs_m_eq_p": temp / base, "ticks": table.n_ticks, "bubble": table.bubble,
                         "bubble_layers": executed.get("bubble_layers"), "bubble_executed":
                         executed.get("bubble_executed"), "peak_in_flight": max(table.in_flight())})
    return rows


def time_rows(steps: int, rounds: int) -> list[dict]:
    times = step_medians({name: config_for(name, 4) for name in SCHEDULES}, steps, rounds)
    return [{"schedule": name, "step_ms": t * 1e3, "circular_over_this": times["circular"] / t}
            for name, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.schedules", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mults", default="1,2,4,8", help="m = p·mult microbatches for the memory table")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="memory table only")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    with_devices("bench.schedules", DEVICES, argv)  # the device count is fixed when jax starts
    mem = memory_rows([int(x) for x in args.mults.split(",")])
    times = [] if args.no_time else time_rows(args.steps, args.rounds)
    if args.format == "json":
        print(json.dumps({"memory": mem, "time": times}, indent=2))
        return 0
    print("compiled temporaries per device, (data, pipe, tensor) = (2, 2, 2), microbatch = 2 rows x 64 tokens")
    print("bubble: the table's; then by executed FLOPs in lockstep ticks, of the layer work and with the head")
    print(f"{'schedule':17s} {'v':>2} {'m':>3} {'temp MB':>9} {'vs m=p':>7} {'ticks':>6} {'bubble':>7} {'layers':>7} "
          f"{'w/ head':>7} {'in flight':>9}")

    def opt(x):
        return f"{x:7.3f}" if x is not None else f"{'-':>7}"

    for r in mem:
        print(f"{r['schedule']:17s} {r['chunks']:2d} {r['microbatches']:3d} {r['temp_bytes'] / 2**20:9.2f} "
              f"{r['vs_m_eq_p']:7.2f} {r['ticks']:6d} {r['bubble']:7.3f} {opt(r['bubble_layers'])} "
              f"{opt(r['bubble_executed'])} {r['peak_in_flight']:9d}")
    if times:
        print(f"\nstep time at m = 4, medians of {args.rounds} interleaved rounds of {args.steps} steps")
        for r in times:
            print(f"{r['schedule']:17s} {r['step_ms']:8.1f} ms   circular/this {r['circular_over_this']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
