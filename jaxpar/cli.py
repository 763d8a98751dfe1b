"""`jaxpar` command line: thin wrappers over library functions.

    jaxpar train    --config FILE [--workdir DIR] [--config.section.field=VALUE ...]
    jaxpar generate --workdir DIR|HF_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
                    [--top-p P] [--greedy] [--data D] [--tensor T] [--gspmd | --sequence-parallel
                    [--overlap collective_matmul]]
    jaxpar analyze  --config FILE [--format json|table] [--config.section.field=VALUE ...]
    jaxpar plan     --config FILE --devices N [--hosts H] [--memory-gb M] [--top K] [--format table|json]
                    [--device-kind KIND | --profile FILE] [--verify] [--config.parallel.field=VALUE ...]
    jaxpar probe    [--out FILE]
    jaxpar schedule [--schedule NAME] --pipe P --microbatches M [--chunks V] [--png FILE]
    jaxpar convert  --from DIR | --from-hf HF_DIR   --to DIR2 | --to-hf HF_DIR2 | --to-peft DIR2   [--step N]
                    [--dtype bfloat16] [--drop-mtp]
    jaxpar launch   --processes N [--devices-per-process K] -- jaxpar train ...
    jaxpar serve    --model DIR|HF_DIR [--tensor T] [--host 127.0.0.1 --port 8000] [--api-key KEY]
                    [--quantize int8|int4] [--max-batch B] [--page-size S] [--prefill-chunk C] [--max-queue Q]

`train` also takes the multi-process flags `--coordinator HOST:PORT --num-processes N --process-id K
[--local-device-ids 0,1] [--peer-timeout S]` (or SLURM / Open MPI / JAXPAR_* variables; see jaxpar/distributed.py).

A configuration that cannot run is reported as one line on stderr (exit status 2), before anything compiles.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxpar.config import load_config
from jaxpar.errors import JaxparError, OutputError, UsageError


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other user error."""

    def error(self, message: str):
        self.exit(2, f"jaxpar: usage error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _split_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """Pull `--config.a.b=v` / `--config.a.b v` out of argv; return (overrides, leftovers)."""
    overrides, rest, i = [], [], 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--config."):
            key = arg[len("--config."):]
            if "=" not in key and i + 1 < len(extra):
                key, i = f"{key}={extra[i + 1]}", i + 1
            overrides.append(key)
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def _train(args, overrides: list[str]) -> int:
    if args.profile_steps:
        overrides = [*overrides, f"train.profile_steps={args.profile_steps}"]
    config = load_config(args.config, overrides, args.config_root)  # every ConfigError: here or in fit()
    if args.init_from_hf:
        from jaxpar.interop import hf

        config = hf.init_config(config, args.init_from_hf)
    from jaxpar import distributed, perf

    perf.configure_gpu_flags()  # XLA's GPU performance flags, before any backend starts (a no-op off NVIDIA GPUs)
    perf.retain_host_memory()  # freed host memory is reused, not faulted in again every step (before XLA's threads)
    try:  # before anything touches a JAX backend; nothing happens for a single process
        distributed.initialize(distributed.resolve(
            args.coordinator, args.num_processes, args.process_id, args.local_device_ids,
            peer_timeout_s=args.peer_timeout, init_timeout_s=args.init_timeout))
    except distributed.DistributedError as e:
        print(f"jaxpar: distributed setup error: {e}", file=sys.stderr)
        return 2
    from jaxpar.train import fit  # imported late so config errors print fast

    from jaxpar.train.loop import TrainingDiverged

    try:
        result = fit(config, args.workdir, progress=not args.no_progress)
    except TrainingDiverged as e:
        print(f"jaxpar: training stopped: {_one_line(e)}", file=sys.stderr)
        return 1
    except JaxparError:
        raise
    except Exception as e:
        distributed.fail(e)  # multi-process: name a lost peer, or exit 1 without waiting on the dead one
        raise
    if result.preempted:
        print(f"preempted at step {int(result.state.step)}: checkpoint saved; run the same command to resume")
        return 0
    if not result.history:
        print(f"done: nothing to do, the workdir is already at step {int(result.state.step)} (train.steps = "
              f"{result.config.train.steps}); raise train.steps to train further")
        return 0
    print(f"done: { {k: round(v, 4) for k, v in result.history[-1].items() if not isinstance(v, list)} }")
    return 0


def _generate(args, overrides: list[str]) -> int:
    if overrides:
        raise UsageError(f"--config.{overrides[0]}: generate takes no config overrides (the model's config comes "
                         "from the workdir's config.json; --data and --tensor choose the layout)")
    from jaxpar.errors import GenerateError
    from jaxpar.infer.text import generate_text, load

    for flag, value in (("--num-samples", args.num_samples), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise GenerateError(f"{flag} {value}: must be >= 1")
    if not 0 <= args.seed < 2**32:
        raise GenerateError(f"--seed {args.seed}: must lie in [0, 2**32)")
    loaded = load(args.workdir, step=args.step, data=args.data, tensor=args.tensor, explicit=not args.gspmd,
                  sequence_parallel=args.sequence_parallel, overlap=args.overlap, quantize=args.quantize,
                  group_size=args.group_size)
    if args.quantize and args.group_size is None:  # the group the default picked, where the model fixed it
        print(f"jaxpar: weights {loaded.config.model.weights_label}", file=sys.stderr)
    temperature = 0.0 if args.greedy else args.temperature
    for text in generate_text(loaded, [args.prompt] * args.num_samples, max_new_tokens=args.max_new_tokens,
                              seed=args.seed, temperature=temperature, top_k=args.top_k, top_p=args.top_p):
        print(args.prompt + text)
        print("-" * 40)
    return 0


def _serve(args, overrides: list[str]) -> int:
    if overrides:
        raise UsageError(f"--config.{overrides[0]}: serve takes no config overrides (the model's config comes "
                         "from its directory; the flags choose the layout and the engine's sizes)")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: must lie in [1, 65535]")
    from jaxpar.serve.engine import EngineConfig
    from jaxpar.serve.server import serve

    EngineConfig(max_batch=args.max_batch, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                 max_queue=args.max_queue)  # its checks, before the model loads
    serve(args.model, host=args.host, port=args.port, tensor=args.tensor, api_key=args.api_key,
          quantize=args.quantize, max_batch=args.max_batch, page_size=args.page_size,
          prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, name=args.name)
    return 0


def _analyze(args, overrides: list[str]) -> int:
    config = load_config(args.config, overrides, args.config_root)
    import json

    from jaxpar.analysis.report import analyze, format_table

    report = analyze(config, activations=not args.no_activations)
    print(format_table(report) if args.format == "table" else json.dumps(report, indent=2, default=float))
    return 0


def _plan(args, overrides: list[str]) -> int:
    from jaxpar.planner import profile as machine, search

    if args.top < 1:
        raise UsageError(f"--top {args.top}: show at least one layout")
    if args.profile and args.device_kind:
        raise UsageError("--profile and --device-kind both name the machine; pass one")
    config = load_config(args.config, overrides, args.config_root)
    profile = (machine.load_profile(args.profile) if args.profile
               else machine.profile_for(args.device_kind or "h100"))
    # A parallel field (or train.grad_accum) set on the command line stays as set; the planner chooses the rest.
    fixed = {o.partition("=")[0].split(".", 1)[1] for o in overrides
             if o.startswith("parallel.") or o.startswith("train.grad_accum")}
    result = search.plan(config, args.devices, profile, hosts=args.hosts, memory_gb=args.memory_gb, fixed=fixed)
    if args.verify:  # the winner compiled ahead of time on simulated CPU devices, its memory beside the prediction
        from jaxpar.analysis import verify

        result["verify"] = verify.verify(search.layout_config(config, result["winner"]), args.devices)
    if args.format == "json":  # strict JSON: a non-finite number is written as null
        print(search.as_json(result))
    else:
        print(search.format_plan(result, args.top))
        if args.verify:
            print(verify.format_verify(result["verify"], args.devices, result["memory_gb"]))
    # --verify fails (exit 1) when the compiled peak is more than 20 % off the prediction, or over the budget.
    if args.verify and (abs(result["verify"]["error"]) > 0.2
                        or result["verify"]["compiled"]["peak_bytes"] > result["memory_gb"] * 1e9):
        return 1
    return 0


def _probe(args, overrides: list[str]) -> int:
    if overrides:
        raise UsageError(f"--config.{overrides[0]}: probe takes no config (it measures the machine)")
    out = pathlib.Path(args.out) if args.out else None
    if out is not None:  # refused before measuring: only a new file, or a regular file it replaces whole
        from jaxpar.planner.profile import check_out

        check_out(out)
    import dataclasses
    import json

    from jaxpar.planner import probe, profile as machine

    profile = probe.measure()
    if out is None:
        print(json.dumps(dataclasses.asdict(profile), indent=2, sort_keys=True))
        return 0
    try:
        machine.write(profile, out)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot be written ({e.strerror or e})") from None
    fast = max(profile.flops.values())
    print(f"probed {profile.name}: {fast / 1e12:.3g} TFLOP/s per device, all-reduce "
          f"{profile.intra_host / 1e9:.3g} GB/s, collective latency {profile.latency * 1e6:.0f} µs; written to {out} "
          f"(`jaxpar plan --profile {out}`)")
    return 0


def _schedule(args, overrides: list[str]) -> int:
    from jaxpar.config import ParallelConfig
    from jaxpar.parallel import circular, schedule

    if args.repeats is None:
        args.repeats = 2 if args.schedule == "zbv" else 1
    # The same rules as a training config (schedule, chunks, microbatches against pipe), reported the same way.
    ParallelConfig(pipe=args.pipe, repeats=args.repeats, microbatches=args.microbatches, schedule=args.schedule)
    if args.schedule == "circular":  # the autodiff loop's forward iterations, then its table of F/B/W ticks
        print(circular.format_schedule(args.pipe, args.repeats, args.microbatches), end="\n\n")
    table = schedule.build(args.schedule, args.pipe, args.repeats, args.microbatches)
    print(schedule.format_table(table))
    if args.png:
        try:
            schedule.draw(table, args.png)
        except OSError as e:
            raise OutputError(f"--png {args.png}: cannot be written ({e.strerror or e})") from None
        print(f"drawn to {args.png}")
    return 0


def _convert(args, overrides: list[str]) -> int:
    if args.dst_peft is not None:  # LoRA's adapters alone, as PEFT writes them
        if args.src is None or args.dst is not None or args.dst_hf is not None or args.src_hf is not None:
            raise UsageError("--to-peft takes a workdir trained with adapters: `jaxpar convert --from WORKDIR "
                             "--to-peft DIR`")
        if args.quantize or args.group_size is not None or args.dtype or args.drop_mtp:
            raise UsageError("--to-peft writes the adapters as trained (float32); drop --quantize, --group-size, "
                             "--dtype and --drop-mtp")
        from jaxpar.interop.peft import export_peft

        step = export_peft(args.src, args.dst_peft, step=args.step)
        print(f"exported the LoRA adapters of step {step} of {args.src} to {args.dst_peft} (PEFT: "
              "adapter_model.safetensors + adapter_config.json)")
        return 0
    if (args.src is None) == (args.src_hf is None) or (args.dst is None) == (args.dst_hf is None):
        raise UsageError("convert needs exactly one of --from/--from-hf and one of --to/--to-hf, e.g. "
                         "`jaxpar convert --from-hf DIR --to WORKDIR`")
    from jaxpar.interop import hf
    from jaxpar.store.lock import check_new_output

    if args.dst_hf is not None:  # absent or empty, before seconds of reading (the export re-checks atomically;
        check_new_output(args.dst_hf, "--to-hf")  # --to: convert and import_to_workdir check it themselves)
    if args.src_hf is not None and args.step is not None:
        raise UsageError(f"--step {args.step}: a Hugging Face directory has no steps; drop --step with --from-hf")
    if args.dst_hf is not None and (args.quantize or args.group_size is not None):
        raise UsageError(f"--quantize/--group-size with --to-hf {args.dst_hf}: the export writes float weights; "
                         "quantize into a workdir (--to DIR)")
    if args.group_size is not None and args.quantize != "int4":
        raise UsageError(f"--group-size {args.group_size}: groups are int4's; add --quantize int4")
    if args.drop_mtp and (args.src_hf is None or args.dst is None):
        raise UsageError("--drop-mtp: it leaves a Hugging Face checkpoint's multi-token-prediction layers out of an "
                         "import; use it with --from-hf DIR --to WORKDIR")
    quant = dict(quantize=args.quantize, group_size=args.group_size)
    if args.src_hf is not None and args.dst is not None:
        hf.import_to_workdir(args.src_hf, args.dst, dtype=args.dtype, drop_mtp=args.drop_mtp, **quant)
        print(f"imported {args.src_hf} into {args.dst} (params-only workdir, step 0: `jaxpar generate --model {args.dst}`)")
    elif args.src is not None and args.dst_hf is not None:
        step = hf.export_workdir(args.src, args.dst_hf, step=args.step, dtype=args.dtype)
        print(f"exported step {step} of {args.src} to {args.dst_hf} (Hugging Face safetensors + config.json)")
    elif args.src_hf is not None:
        raise UsageError(f"--to-hf {args.dst_hf}: Hugging Face to Hugging Face is not a conversion; use --to WORKDIR")
    else:
        from jaxpar.store.checkpoint import convert

        step = convert(args.src, args.dst, step=args.step, dtype=args.dtype, **quant)
        print(f"exported step {step} of {args.src} to {args.dst} (params only, canonical layout)")
    if args.quantize:  # the group the default picked, where no --group-size was given
        from jaxpar.store.checkpoint import read_saved_config

        print(f"weights: {read_saved_config(args.dst).model.weights_label}")
    return 0


def _launch(args, overrides: list[str]) -> int:
    from jaxpar.launch import launch

    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    # The child command's own --config.* overrides were pulled out with ours; they belong to it.
    command += [f"--config.{o}" for o in overrides]
    return launch(command, args.processes, args.devices_per_process, port=args.port, grace_s=args.grace)


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand (the README's CLI reference lists the same)."""
    parser = _Parser(prog="jaxpar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    roots = dict(action="append", default=[], metavar="DIR",
                 help="also trust config files under DIR as a YAML recipe's base: (a base is code and runs)")
    train = sub.add_parser("train", help="train a model; overrides as --config.section.field=value")
    train.add_argument("--config", required=True, help="configs/*.py (ml_collections) or recipes/*.yaml")
    train.add_argument("--workdir", default="runs/default", help="metrics, checkpoints and config.json go here")
    train.add_argument("--config-root", **roots)
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    train.add_argument("--profile-steps", type=int, default=0, metavar="N",
                       help="jax.profiler trace of N steps (from the second) into WORKDIR/profile")
    train.add_argument("--init-from-hf", metavar="HF_DIR", help="start from a Hugging Face model's weights: the "
                       "model section comes from its config.json, the tokenizer from its tokenizer.json")
    multi = train.add_argument_group("multi-process (default: one process, or what SLURM / Open MPI / JAXPAR_* say)")
    multi.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    multi.add_argument("--num-processes", type=int, help="number of JAX processes in the run")
    multi.add_argument("--process-id", type=int, help="this process's rank, 0-based")
    multi.add_argument("--local-device-ids", help="comma-separated local GPU ordinals of this process (default: all "
                                                  "visible; one process per GPU: its ordinal)")
    multi.add_argument("--peer-timeout", type=int, default=60, help="seconds before a lost peer process stops the run")
    multi.add_argument("--init-timeout", type=int, default=300, help="seconds to wait for every process to connect")
    train.set_defaults(run=_train)
    gen = sub.add_parser("generate", help="sample text from a trained workdir or a Hugging Face model directory")
    gen.add_argument("--workdir", "--model", required=True, help="a jaxpar workdir or a Hugging Face model directory")
    gen.add_argument("--data", type=int, default=1, help="data-parallel degree (independent samples)")
    gen.add_argument("--tensor", type=int, default=None, help="tensor-parallel degree (default: as trained; 1 for HF)")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    gen.add_argument("--gspmd", action="store_true", help="leave tensor parallelism to GSPMD (the comparison "
                     "baseline) instead of the explicit shard_map collectives")
    gen.add_argument("--sequence-parallel", action="store_true", help="prefill with sequence parallelism")
    gen.add_argument("--overlap", default="none", help="prefill collectives: none or collective_matmul (with "
                     "--sequence-parallel)")
    gen.add_argument("--quantize", choices=("int8", "int4"), default=None,
                     help="weight-only quantization of the layers' matrices at load (a quantized workdir loads as "
                          "stored)")
    gen.add_argument("--group-size", type=int, default=None, help="int4: inputs per scale (default 128)")
    gen.set_defaults(run=_generate)
    srv = sub.add_parser("serve", help="serve a workdir or a Hugging Face model directory over an OpenAI-compatible "
                                       "HTTP API (continuous batching, a paged KV cache, streaming, /metrics)")
    srv.add_argument("--model", required=True, help="a jaxpar workdir or a Hugging Face model directory")
    srv.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (explicit collectives, as training)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes")
    srv.add_argument("--quantize", choices=("int8", "int4"), default=None, help="weight-only quantization at load")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoding at once")
    srv.add_argument("--page-size", type=int, default=16, help="KV-cache positions a page holds")
    srv.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens a request prefills per step")
    srv.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429 Too Many Requests")
    srv.add_argument("--name", default=None, help="the model id /v1/models reports (default: the directory name)")
    srv.set_defaults(run=_serve)
    ana = sub.add_parser("analyze", help="compile the train step and compare collectives, FLOPs and memory with "
                                         "the analytic formulas")
    ana.add_argument("--config", required=True)
    ana.add_argument("--config-root", **roots)
    ana.add_argument("--format", choices=("json", "table"), default="json")
    ana.add_argument("--no-activations", action="store_true", help="skip the per-layer activation measurement")
    ana.set_defaults(run=_analyze)
    pla = sub.add_parser("plan", help="predict memory and step time of every layout of a model on N devices, and "
                                      "rank those that fit; --config.parallel.X=V fixes a field")
    pla.add_argument("--config", required=True)
    pla.add_argument("--config-root", **roots)
    pla.add_argument("--devices", type=int, required=True, help="devices to plan for")
    pla.add_argument("--hosts", type=int, default=1, help="hosts they are spread over (tensor stays inside one)")
    pla.add_argument("--memory-gb", type=float, default=None, help="memory budget per device (default: the "
                                                                    "device's)")
    pla.add_argument("--top", type=int, default=10, help="layouts to show")
    pla.add_argument("--format", choices=("table", "json"), default="table")
    pla.add_argument("--device-kind", default=None, help="h200, h100 or a100: datasheet defaults (default h100)")
    pla.add_argument("--profile", default=None, help="a machine profile written by `jaxpar probe`")
    pla.add_argument("--verify", action="store_true", help="compile the winner ahead of time on --devices simulated "
                     "CPU devices (nothing allocated) and compare its memory with the prediction; exit 1 when it is "
                     "over the budget or more than 20 %% off")
    pla.set_defaults(run=_plan)
    pro = sub.add_parser("probe", help="measure this machine (matmul FLOP/s, all-reduce / all-to-all / permute "
                                       "bandwidth per group size) as a profile for `jaxpar plan --profile`")
    pro.add_argument("--out", default=None, help="the profile JSON to write (default: print it)")
    pro.set_defaults(run=_probe)
    sch = sub.add_parser("schedule", help="print (and draw) a pipeline schedule: its F/B/W ticks per stage, tick "
                                          "count, bubble fraction and peak in-flight microbatches")
    sch.add_argument("--schedule", default="circular", help="circular (default), gpipe, 1f1b, interleaved_1f1b, "
                                                            "zb_h1 or zbv")
    sch.add_argument("--pipe", type=int, required=True)
    sch.add_argument("--chunks", "--repeats", dest="repeats", type=int, default=None,
                     help="chunks per stage (parallel.repeats; default: 2 for zbv, else 1)")
    sch.add_argument("--microbatches", type=int, required=True)
    sch.add_argument("--png", help="also draw it to this PNG file (matplotlib)")
    sch.set_defaults(run=_schedule)
    conv = sub.add_parser("convert", help="export a workdir's parameters (params-only workdir, or Hugging Face "
                                          "format), or import a Hugging Face model as a workdir")
    conv.add_argument("--from", dest="src", help="a jaxpar train workdir")
    conv.add_argument("--from-hf", dest="src_hf", help="a Hugging Face model directory (safetensors + config.json)")
    conv.add_argument("--to", dest="dst", help="the new jaxpar workdir (params-only)")
    conv.add_argument("--to-hf", dest="dst_hf", help="the new Hugging Face model directory (LoRA adapters merged)")
    conv.add_argument("--to-peft", dest="dst_peft", help="the new PEFT directory: a LoRA workdir's adapters alone")
    conv.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    conv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    conv.add_argument("--quantize", choices=("int8", "int4"), default=None,
                      help="store the layers' weight matrices quantized (--to only): int8 per output channel, int4 "
                           "per --group-size inputs")
    conv.add_argument("--group-size", type=int, default=None, help="int4: inputs per scale (default 128)")
    conv.add_argument("--drop-mtp", action="store_true",
                      help="--from-hf: import without the tensors of layers from num_hidden_layers on (DeepSeek-V3's "
                           "multi-token-prediction modules: the model then has model.mtp_depth 0)")
    conv.set_defaults(run=_convert)
    lau = sub.add_parser("launch", help="run a command as N local JAX processes (CPU devices, gloo collectives)")
    lau.add_argument("--processes", type=int, required=True, help="number of local processes")
    lau.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices per process")
    lau.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    lau.add_argument("--grace", type=float, default=90.0,
                     help="seconds the others get to exit by themselves after one fails, before they are killed")
    lau.add_argument("cmd", nargs=argparse.REMAINDER, help="-- jaxpar train ...")
    lau.set_defaults(run=_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 2 for any user error (`jaxpar.errors.JaxparError`: a config, a
    checkpoint, a Hugging Face directory, a locked workdir, a generation request), printed as one line on stderr."""
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    overrides, rest = _split_overrides(extra)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.run(args, overrides)
    except JaxparError as e:  # bad input, not a bug: one line naming it, no traceback
        print(f"jaxpar: {e.kind}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves and exits 0 by itself)
        print(f"jaxpar: interrupted during `{args.command}` (a training run saves only once its loop has started; "
              "its newest checkpoint is untouched)", file=sys.stderr)
        return 130


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
