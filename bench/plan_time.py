"""The planner's time model against measured step times, on this machine's probed profile (8 simulated devices).

    python -m bench.plan_time [--steps 3] [--rounds 3] [--format table|json]

The machine is probed first (`jaxpar.planner.probe.measure`: matmul FLOP/s, bandwidth per collective and group size,
latency, layer overhead, overlap — every device busy at once, so the simulated devices' sharing of the cores is in
every rate). Then each layout below is predicted (`cost.predict_time`) and timed (`bench.step_medians`: compiled,
warmed up, rounds interleaved so a slow spell hits all alike), and the two orders compared by Spearman's rank
correlation. The layouts span what the search chooses among: data, tensor, SP, pipe (circular and a table),
context, ZeRO-3, remat and accumulation.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import step_medians, with_devices

DEVICES = 8
FLAT = ["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]
LAYOUTS = {
    "data8": FLAT + ["parallel.tensor=1"],
    "data8 remat=full": FLAT + ["parallel.tensor=1", "parallel.remat=full"],
    "data8 accum4": FLAT + ["parallel.tensor=1", "train.grad_accum=4"],
    "data8 zero3": FLAT + ["parallel.tensor=1", "parallel.zero=3"],
    "data4 tensor2": FLAT + ["parallel.tensor=2"],
    "data2 tensor4": FLAT + ["parallel.tensor=4"],
    "data2 tensor4 sp": FLAT + ["parallel.tensor=4", "parallel.sequence_parallel=true"],
    "data4 context2": FLAT + ["parallel.tensor=1", "parallel.context=2"],
    "data4 pipe2 m4": ["parallel.tensor=1", "parallel.repeats=1", "parallel.microbatches=4"],
    "data2 pipe2 tensor2 v2 m4": [],  # the tiny preset
    "data2 pipe4 1f1b m8": ["parallel.tensor=1", "parallel.pipe=4", "parallel.repeats=1", "parallel.microbatches=8",
                            "parallel.schedule=1f1b"],
}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    from scipy import stats

    return float(stats.spearmanr(a, b).statistic)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    with_devices("bench.plan_time", DEVICES, argv)
    import jax

    from jaxpar.config import load_config
    from jaxpar.planner import cost, probe

    profile = probe.measure(jax.devices())
    configs = {k: load_config("configs/tiny.py", o).resolve_for_devices(DEVICES) for k, o in LAYOUTS.items()}
    predicted = {k: cost.predict_time(c, profile, DEVICES) for k, c in configs.items()}
    measured = step_medians(configs, args.steps, args.rounds)
    keys = list(LAYOUTS)
    rho = spearman([predicted[k].step for k in keys], [measured[k] for k in keys])
    rows = [{"layout": k, "predicted_s": predicted[k].step, "compute_s": predicted[k].compute,
             "comm_s": sum(predicted[k].comm.values()), "measured_s": measured[k]} for k in keys]
    if args.format == "json":
        print(json.dumps({"profile": profile.source, "spearman": rho, "rows": rows}, indent=1))
        return 0
    print(f"profile: {profile.name} ({profile.source}); matmul {profile.flops['float32'] / 1e9:.3g} GFLOP/s per "
          f"device, all-reduce(8) {profile.intra_host / 1e9:.3g} GB/s, latency {profile.latency * 1e6:.0f} µs, "
          f"layer overhead {profile.layer_overhead * 1e6:.0f} µs, overlap {profile.overlap:.2f}")
    print(f"{'layout':28} {'predicted ms':>12} {'compute':>8} {'comm':>8} {'measured ms':>12} {'ratio':>6}")
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"{r['layout']:28} {r['predicted_s'] * 1e3:12.1f} {r['compute_s'] * 1e3:8.1f} {r['comm_s'] * 1e3:8.1f} "
              f"{r['measured_s'] * 1e3:12.1f} {r['predicted_s'] / r['measured_s']:6.2f}")
    print(f"Spearman rank correlation, predicted vs measured step time over {len(rows)} layouts: {rho:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
