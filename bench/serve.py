"""Serving benchmark in the style of vLLM's `bench serve`, on the engine itself (`jaxpar.serve.Engine`; the HTTP layer
is left out — `jaxpar serve` adds a JSON encode and an SSE write per token): continuous batching against static
batching of the same requests, with the same rows, pages, chunk size and programs.

Workloads (seeded), lengths drawn log-uniform: *mixed* — chat-like, prompts of 8–64 tokens and outputs of 8–192
(what static batching is bad at: a batch waits for its longest member); *mixed-long* — prompts and outputs both
8–120 (prefill-heavy: a prefill call costs about a decode step on this machine, so there is less to gain); *uniform*
— every prompt 64 tokens and every output 64, the control where static batching should tie. Arrivals: all at once
(saturation), and open-loop Poisson at several rates (requests submitted at their arrival times whatever the engine
is doing). Greedy with `ignore_eos`, so every request emits exactly its drawn output length in both modes, and the
tokens are asserted identical between the two modes (batch invariance makes that exact). The model is
configs/tiny.py's at random weights (a workdir's when given: the speed is the same); both programs are compiled and
warmed up before timing.

Reported per run: request and output-token throughput, the decode and prefill program calls (the decode calls'
ratio between the modes is what a scheduler can gain at most when prefill is free), p50/p99 time to first token
(TTFT), time per output token after the first (TPOT) and end-to-end latency, and the peak of KV pages in use against
a contiguous cache sized for max_batch rows of max_seq_len positions.

    PYTHONPATH=. python bench/serve.py [--quick] [--rows 16] [--requests 256] [--poisson-requests 64]
        [--repeats 3] [--out bench/results/serve.json] [--versus-hf PYTHON]

`--versus-hf PYTHON` (a Python with torch and transformers) adds Hugging Face transformers' own `generate` on the
same model exported (`jaxpar.interop.hf.save_params`), the mixed workload all at once, in batches of `--rows`
(`bench/hf_generate.py`: static batching as `generate` does it, left-padded, greedy, fp32, torch's threads on the
same cores): its output tokens/s against the engine's two modes, and how many requests got the same tokens.

Each run repeats `--repeats` times, the two modes interleaved; a row is the run of median throughput, and the ratio
the median of the repetitions' ratios with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.serve import Engine, EngineConfig, SamplingParams  # noqa: E402


WORKLOADS = {"mixed": ((8, 64), (8, 192)), "mixed-long": ((8, 120), (8, 120)), "uniform": ((64, 64), (64, 64))}


def workload(kind: str, n: int, seed: int, scale: float = 1.0) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs of WORKLOADS[kind]: (prompt, output) length ranges, drawn log-uniform
    (a range of one length: that length); `scale` shrinks every length (the quick run)."""
    rng = np.random.default_rng(seed)
    ranges = [(max(1, round(lo * scale)), max(1, round(hi * scale))) for lo, hi in WORKLOADS[kind]]
    out = []
    for _ in range(n):
        p, o = (int(round(np.exp(rng.uniform(np.log(lo), np.log(hi))))) for lo, hi in ranges)
        out.append((rng.integers(1, 256, p).tolist(), o))
    return out


def run(engine: Engine, requests, rate: float, seed: int) -> dict:
    """Submit `requests` at Poisson arrival times of `rate` per second (inf: all at once), step until all finish."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(requests)) if np.isinf(rate) else rng.exponential(1 / rate, len(requests))
    arrivals = np.cumsum(gaps) - gaps[0]
    peak = 0
    calls = engine.prefill_calls, engine.decode_calls
    start = time.perf_counter()
    submitted, handles = 0, []
    while submitted < len(requests) or engine.has_work:
        now = time.perf_counter() - start
        while submitted < len(requests) and arrivals[submitted] <= now:
            prompt, n = requests[submitted]
            handles.append(engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
            handles[-1].submitted = start + arrivals[submitted]  # latency counts from the arrival time
            submitted += 1
        if engine.has_work:
            engine.step()
            peak = max(peak, engine.pool.used)
        else:  # idle until the next arrival
            time.sleep(max(0.0, min(0.01, arrivals[submitted] - (time.perf_counter() - start))))
    wall = time.perf_counter() - start
    ttft = np.array([h.ttft for h in handles])
    e2e = np.array([h.token_times[-1] - h.submitted for h in handles])
    tpot = np.array([(h.token_times[-1] - h.token_times[0]) / (len(h.tokens) - 1) for h in handles
                     if len(h.tokens) > 1])
    tokens = sum(len(h.tokens) for h in handles)

    def pct(a):
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    return {"wall_s": wall, "requests_per_s": len(handles) / wall, "output_tokens_per_s": tokens / wall,
            "decode_calls": engine.decode_calls - calls[1], "prefill_calls": engine.prefill_calls - calls[0],
            "ttft_s": pct(ttft), "tpot_s": pct(tpot), "e2e_s": pct(e2e), "peak_pages": peak,
            "tokens": [h.tokens for h in handles]}


def versus_hf(python: str, model, cfg, saturated: dict, requests: list, rows: int) -> dict:
    """transformers' generate on `model` exported, over the saturation run's requests (`saturated`, the mixed
    workload's row of `main`, with the engine's tokens; `requests` its requests), in a subprocess of `python` → its figures beside the
    engine's, printed."""
    import subprocess
    import tempfile

    from jaxpar.interop.hf import save_params

    with tempfile.TemporaryDirectory() as tmp:
        save_params(nnx.state(model), cfg, f"{tmp}/hf")
        pathlib.Path(f"{tmp}/requests.json").write_text(json.dumps(requests))
        subprocess.run([python, str(pathlib.Path(__file__).with_name("hf_generate.py")), "--model", f"{tmp}/hf",
                        "--requests", f"{tmp}/requests.json", "--batch", str(rows), "--out", f"{tmp}/out.json"],
                       check=True)
        hf = json.loads(pathlib.Path(f"{tmp}/out.json").read_text())
    same = sum(a == b for a, b in zip(saturated["tokens"], hf.pop("tokens")))  # the engine's (equal in both modes)
    out = {"hf": hf, "same_tokens": same, "requests": len(requests),
           "continuous_vs_hf": saturated["continuous"]["output_tokens_per_s"] / hf["output_tokens_per_s"],
           "static_vs_hf": saturated["static"]["output_tokens_per_s"] / hf["output_tokens_per_s"]}
    print(f"transformers {hf['transformers']} generate (torch {hf['torch']}, {hf['threads']} threads, batches of "
          f"{rows}): {hf['output_tokens_per_s']:.1f} tok/s on the mixed workload all at once; jaxpar continuous "
          f"{out['continuous_vs_hf']:.2f}x, static {out['static_vs_hf']:.2f}x that; {same}/{len(requests)} "
          "requests with the same greedy tokens")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small requests (the test's smoke run)")
    parser.add_argument("--rows", type=int, default=16, help="the engine's max_batch")
    parser.add_argument("--requests", type=int, default=256, help="requests a saturation run")
    parser.add_argument("--poisson-requests", type=int, default=64, help="requests a Poisson run")
    parser.add_argument("--rates", default="8,16,32", help="Poisson arrival rates of the mixed workload, requests/s")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of each run (medians)")
    parser.add_argument("--workdir", default=None, help="a jaxpar workdir's model instead of random weights")
    parser.add_argument("--out", default=None)
    parser.add_argument("--versus-hf", default=None, metavar="PYTHON",
                        help="also run transformers' generate with this Python (which has torch and transformers)")
    args = parser.parse_args(argv)
    config = load_config("configs/tiny.py")
    if args.workdir:
        from jaxpar.infer.text import load

        model = load(args.workdir, tensor=1).model
    else:
        model = Transformer(config.model, rngs=nnx.Rngs(0))
    engine_config = EngineConfig(max_batch=4 if args.quick else args.rows, page_size=16, prefill_chunk=32,
                                 prefill_rows=2)
    engines = {mode: Engine(model, EngineConfig(**{**engine_config.__dict__, "static": mode == "static"}))
               for mode in ("continuous", "static")}
    for engine in engines.values():  # compile and warm both programs up
        engine.generate([[1] * 40], SamplingParams(max_tokens=3, ignore_eos=True))
    contiguous = engine_config.max_batch * engines["static"].pages_per_row
    rates = [] if args.quick else [float(r) for r in args.rates.split(",")]
    plans = [("mixed", float("inf")), ("mixed-long", float("inf")), ("uniform", float("inf"))]
    plans = plans[::2] if args.quick else plans + [("mixed", rate) for rate in rates]
    results = []
    for kind, rate in plans:
        n = 6 if args.quick else args.requests if np.isinf(rate) else args.poisson_requests
        requests = workload(kind, n, seed=0, scale=0.2 if args.quick else 1.0)
        row = {"workload": kind, "rate": "all at once" if np.isinf(rate) else rate, "requests": n}
        reps = {mode: [] for mode in engines}
        for _ in range(1 if args.quick else args.repeats):  # continuous, static, continuous, static, …
            for mode, engine in engines.items():
                reps[mode].append(run(engine, requests, rate, seed=1))
        tokens = {mode: [r.pop("tokens") for r in runs] for mode, runs in reps.items()}
        if any(t != tokens["continuous"][0] for ts in tokens.values() for t in ts):
            raise AssertionError(f"{kind} at {row['rate']}: continuous and static batching gave different tokens")
        ratios = [c["output_tokens_per_s"] / s["output_tokens_per_s"] for c, s in zip(*reps.values())]
        for mode, runs in reps.items():  # the run of median throughput stands for the mode
            row[mode] = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
        row["tokens_identical"] = True
        row["tokens"] = tokens["continuous"][0]  # for --versus-hf; not written to --out
        row["throughput_ratio"] = float(np.median(ratios))
        row["throughput_ratio_range"] = [float(min(ratios)), float(max(ratios))]
        results.append(row)
    print(f"model: configs/tiny.py ({'a workdir' if args.workdir else 'random weights'}), max_batch "
          f"{engine_config.max_batch}, pages of {engine_config.page_size}, prefill {engine_config.prefill_rows} rows "
          f"of "
          f"{engine_config.prefill_chunk}; a contiguous cache for these rows holds {contiguous} pages")
    print(f"{'workload':10} {'rate':>11} {'reqs':>4} {'mode':10} {'req/s':>6} {'tok/s':>7} {'TTFT p50/p99 s':>15} "
          f"{'TPOT p50/p99 ms':>16} {'E2E p50/p99 s':>14} {'pages':>5} {'calls d/p':>9}  cont/static")
    for row in results:
        for mode in ("continuous", "static"):
            r = row[mode]
            print(f"{row['workload']:10} {str(row['rate']):>11} {row['requests']:4d} {mode:10} "
                  f"{r['requests_per_s']:6.2f} {r['output_tokens_per_s']:7.1f} "
                  f"{r['ttft_s']['p50']:7.2f}/{r['ttft_s']['p99']:<7.2f} "
                  f"{1e3 * r['tpot_s']['p50']:7.1f}/{1e3 * r['tpot_s']['p99']:<8.1f} "
                  f"{r['e2e_s']['p50']:6.2f}/{r['e2e_s']['p99']:<7.2f} {r['peak_pages']:5d} "
                  f"{r['decode_calls']:4d}/{r['prefill_calls']:<4d}"
                  + (f"  {row['throughput_ratio']:.2f}x ({row['throughput_ratio_range'][0]:.2f}–"
                     f"{row['throughput_ratio_range'][1]:.2f})" if mode == "static" else ""))
    versus = None
    if args.versus_hf:
        versus = versus_hf(args.versus_hf, model, config.model, results[0],
                           workload("mixed", results[0]["requests"], seed=0, scale=0.2 if args.quick else 1.0),
                           engine_config.max_batch)
    if args.out:
        for row in results:
            row.pop("tokens")
        pathlib.Path(args.out).write_text(json.dumps({"engine": engine_config.__dict__, "workloads": WORKLOADS,
                                                      "versus_hf": versus,
                                                      "contiguous_pages": contiguous, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
