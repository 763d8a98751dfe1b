"""Auxiliary-loss-free balancing (DeepSeek-V3, issue 38): `deepseek_tiny` trained twice from the default corpus, the
correction-bias update on (the config's γ) and off (`moe.bias_update_rate=0`), both with aux_loss_coef 0; the
expert-load curves and losses of both runs to one JSON.

    python -m bench.balance [--steps N] [--rate γ] [--workdirs /tmp/deepseek_balance] [--collect]
                            [--out bench/results/deepseek_balance.json]

The two runs go one after the other (on a 2-core machine two at once are no faster), each the plain CLI command
recorded in the JSON, into WORKDIRS_on and WORKDIRS_off (removed first). --collect skips training and reads those
workdirs' metrics.jsonl. --steps shortens both runs equally (default: the config's schedule, 600 steps); --rate
sets the γ of the run with the update on; --also records other workdirs' curves (runs stopped early) beside them,
and the exploratory runs the JSON already records stay.

Curves, every train.log_every = 10 steps: `moe_max_over_mean_load` (the worst MoE layer's busiest expert over the
mean expert load of that step), `moe_imbalance` (the same with the loads summed over the MoE layers), `loss`; and
the held-out loss every train.eval_every steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "configs/deepseek_tiny.py"
ENV = {"PYTHONPATH": ".", "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
CURVE = ("step", "moe_max_over_mean_load", "moe_imbalance", "loss")


def command(workdir: str, rate: float | None, steps: int | None) -> list[str]:
    """The train command of one run (run from the repository root, with ENV): rate None the config's γ."""
    argv = ["jaxpar", "train", "--config", CONFIG, "--workdir", workdir, "--no-progress"]
    if rate is not None:
        argv.append(f"--config.moe.bias_update_rate={rate:g}")
    if steps:
        argv.append(f"--config.train.steps={steps}")
    return argv


def collect(workdir: pathlib.Path) -> dict:
    """One run's curves from its metrics.jsonl and config.json."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "moe_max_over_mean_load" in r]
    evals = [r for r in records if "eval_loss" in r]
    config = json.loads((workdir / "config.json").read_text())
    times = sorted(r["step_time_s"] for r in train[1:] if "step_time_s" in r)  # the first step compiles
    return {
        "bias_update_rate": config["moe"]["bias_update_rate"],
        "aux_loss_coef": config["moe"]["aux_loss_coef"],
        "steps": config["train"]["steps"],
        "curve": {k: [round(r[k], 5) if isinstance(r[k], float) else r[k] for r in train] for k in CURVE},
        "eval": {"step": [r["step"] for r in evals], "eval_loss": [round(r["eval_loss"], 5) for r in evals]},
        "final_loss": round(train[-1]["loss"], 5),
        "final_eval_loss": round(evals[-1]["eval_loss"], 5) if evals else None,
        "median_step_s": round(times[len(times) // 2], 3) if times else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.balance", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train.steps of both runs (default: the config's)")
    parser.add_argument("--rate", type=float, default=None, help="γ of the run with the update on (default: the "
                        "config's moe.bias_update_rate)")
    parser.add_argument("--workdirs", default="/tmp/deepseek_balance", help="the runs go to WORKDIRS_on, _off")
    parser.add_argument("--collect", action="store_true", help="read existing workdirs instead of training")
    parser.add_argument("--also", nargs="*", default=[], metavar="NAME=WORKDIR",
                        help="more (exploratory, possibly stopped) runs to record under 'exploratory'")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "deepseek_balance.json"))
    args = parser.parse_args(argv)
    jaxpar = pathlib.Path(sys.executable).with_name("jaxpar")
    runs = {}
    for name, rate in (("on", args.rate), ("off", 0.0)):
        workdir = f"{args.workdirs}_{name}"
        argv_run = command(workdir, rate, args.steps)
        if not args.collect:
            shutil.rmtree(workdir, ignore_errors=True)
            start = time.perf_counter()
            subprocess.run([str(jaxpar), *argv_run[1:]], cwd=ROOT, env={**os.environ, **ENV}, check=True)
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        run = collect(pathlib.Path(workdir))
        run["command"] = " ".join([*(f"{k}={v}" for k, v in ENV.items()), *argv_run])
        runs[name] = run
        c = run["curve"]
        print(f"{name}: step {c['step'][-1]} max/mean {c['moe_max_over_mean_load'][-1]:.3f} "
              f"all layers {c['moe_imbalance'][-1]:.3f} loss {run['final_loss']:.4f} held-out {run['final_eval_loss']}")
    # the exploratory runs recorded before stay (their workdirs are long gone); --also adds to them or replaces one
    previous = pathlib.Path(args.out)
    exploratory = json.loads(previous.read_text()).get("exploratory", {}) if previous.exists() else {}
    for item in args.also:
        name, workdir = item.split("=", 1)
        run = collect(pathlib.Path(workdir))
        run["command"] = " ".join([*(f"{k}={v}" for k, v in ENV.items()),
                                   *command(workdir, run["bias_update_rate"], None)])
        run["stopped_at_step"] = run["curve"]["step"][-1]
        exploratory[name] = run
    out = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "config": CONFIG,
           "date": datetime.date.today().isoformat(),
           "machine": "CPU, 8 simulated devices (data 2 × expert 2 × tensor 2) on 2 shared cores", "runs": runs,
           **({"exploratory": exploratory} if exploratory else {})}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)  # a list a line
    pathlib.Path(args.out).write_text(text + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
