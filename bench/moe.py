"""Mixture of experts side by side: step time per expert layout, and tokens/s against the dense model of equal
active parameters, on 8 simulated devices.

    python -m bench.moe [--layouts 1x1,2x1,4x1,8x1,2x2,4x2] [--steps 2] [--rounds 3] [--capacity 0]
                        [--format table|json]

The MoE: a 4-layer Llama of width 64 whose MLPs are 8 SwiGLU experts of width 96, top 2 (dropless unless
--capacity); the dense model: the same Llama with one SwiGLU of width 192 — the same active parameters (2·96 = 192)
and FLOPs per token. A global batch of 16 sequences of 128 tokens. Each `EPxTP` layout runs expert EP × tensor TP
with data filling the 8 devices; the dense model runs data 8. Interleaved rounds of `--steps` steps, medians.

What it shows on a CPU: the cost of routing (sort, all-to-all, unsort) and of XLA:CPU's `ragged_dot`, which runs
each local expert's matmul over every sorted row and masks (X_local times the active FLOPs), so MoE/dense here is a
floor for the dispatch overhead, not what a GPU's grouped GEMM gives. The simulated devices share two cores: the
layouts compare overheads, not speed-ups.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import step_medians, with_devices

DEVICES = 8
MODEL = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "train.seq_len=128", "train.batch_size=16", "parallel.pipe=1", "parallel.repeats=1",
         "parallel.microbatches=1", "parallel.data=-1"]
MOE = ["moe.n_experts=8", "moe.top_k=2", "moe.d_ff=96"]
DENSE_D_FF = 192  # 2 active experts of 96


def config_for(expert: int, tensor: int, capacity: float = 0.0):
    """The MoE at (expert, tensor) — or the dense model of equal active parameters at expert 0."""
    from jaxpar.config import load_config

    if expert == 0:
        over = MODEL + [f"model.d_ff={DENSE_D_FF}", "parallel.tensor=1"]
        return load_config("configs/tiny.py", over).resolve_for_devices(DEVICES)
    over = MODEL + MOE + [f"moe.capacity_factor={capacity}", f"parallel.expert={expert}", f"parallel.tensor={tensor}"]
    return load_config("configs/moe_tiny.py", over).resolve_for_devices(DEVICES)


def time_rows(layouts: list[tuple[int, int]], steps: int, rounds: int, capacity: float) -> list[dict]:
    """Per layout (expert 0 = dense): median step time, tokens/s, and the ratio to the dense step."""
    configs = {(ep, tp): config_for(ep, tp, capacity) for ep, tp in [(0, 1)] + layouts}
    times = step_medians(configs, steps, rounds)
    rows = []
    for (ep, tp), t in times.items():
        config = configs[(ep, tp)]
        tokens = config.train.batch_size * config.train.seq_len
        rows.append({"layout": "dense" if ep == 0 else f"expert {ep} x tensor {tp}", "expert": ep, "tensor": tp,
                     "data": config.parallel.data, "step_ms": t * 1e3, "tokens_per_s": tokens / t,
                     "dense_over_this": times[(0, 1)] / t})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x1,2x1,4x1,8x1,2x2,4x2", help="EPxTP layouts of the MoE")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=float, default=0.0, help="moe.capacity_factor (0: dropless)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    with_devices("bench.moe", DEVICES, argv)  # the device count is fixed when jax starts
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    rows = time_rows(layouts, args.steps, args.rounds, args.capacity)
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'layout':<20}{'data':>6}{'step ms':>10}{'tokens/s':>11}{'dense/this':>12}")
    for r in rows:
        print(f"{r['layout']:<20}{r['data']:>6}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['dense_over_this']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
