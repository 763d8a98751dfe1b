"""`analyze(config)`: compile the train step for a layout and set what it does beside the analytic expectations.

Sections of the report (the JSON of `jaxpar analyze`, and what notebooks and tests read):
- `collectives`: every collective of the compiled step, summed by kind and mesh axes (executions and bytes sent per
  device, loop trip counts applied), the tensor-axis total, and the largest single tensor-axis transfer;
- `flops`: matmul FLOPs from the HLO (trip counts applied) and XLA's own `cost_analysis` (which counts a loop body
  once, shown so the difference is visible);
- `memory`: the step's `memory_analysis` (arguments = params + optimizer state + batch, temp = everything else), and
  the activation memory per layer — see `activation_bytes_per_layer`;
- `expected`: the formulas of `jaxpar.planner.expected`;
- `pipeline` (pipe > 1, the circular loop): iterations, bubble fraction, executed/useful FLOPs, collective-permute
  bytes per iteration; `schedule` instead (a schedule table): ticks, bubble, peak in flight, executed FLOPs per
  stage (branch FLOPs from the program × the table's actions), collective-permute bytes against the formula. (The
  generic counts above take every branch of the tick's conditional as taken on every tick: an upper bound there.)
- `ratio`: measured / expected for tensor bytes, FLOPs and activation memory.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jaxpar.planner import expected
from jaxpar.analysis.hlo import (branch_flops, collective_summary, collectives, cost, dot_flops, scalar_bytes,
                                 loop_carried_permutes, memory)
from jaxpar.config import Config
from jaxpar.parallel import context_parallel as cp, expert, pipeline, schedule
from jaxpar.parallel.axes import CONTEXT, EXPERT, PIPE, TENSOR
from jaxpar.plan import batch_sharding
from jaxpar.train.loop import build_trainer


def _abstract_batch(config: Config, mesh) -> jax.ShapeDtypeStruct:
    t = config.train
    return jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jnp.int32, sharding=batch_sharding(mesh))


def compile_grads(config: Config, mesh) -> jax.stages.Compiled:
    """The compiled loss-and-gradients function of the train step alone (no optimizer), from abstract state."""
    trainer = build_trainer(config, mesh, abstract=True)
    with jax.set_mesh(mesh):
        return jax.jit(trainer.loss_and_grads).lower(trainer.state.params, _abstract_batch(config, mesh)).compile()


def activation_bytes_per_layer(config: Config, mesh) -> dict[str, float]:
    """Activation memory per layer per device, measured.

    How activations are separated from everything else: compile loss-and-gradients alone, where parameters are
    arguments and gradients outputs, so XLA's temp bytes hold activations saved for the backward pass plus
    workspace; then compile it again with twice the layers. The difference per added layer is one layer's
    activations — the embedding, LM head, loss and workspace buffers cancel out. Optimizer state never appears.
    Both compile with one layer per scan iteration (model.scan_unroll = 1), where each layer's saved activations
    are the [n, …] stacks the difference isolates; unrolled, XLA's buffer reuse across the unrolled layers would
    blur the per-layer share (the saved activations themselves are the same either way).
    """
    L = config.model.n_layers
    model = dataclasses.replace(config.model, scan_unroll=1)
    temps = [memory(compile_grads(dataclasses.replace(config, model=dataclasses.replace(model, n_layers=n)),
                                  mesh))["temp_bytes"] for n in (L, 2 * L)]
    return {"per_layer": (temps[1] - temps[0]) / L, "temp_bytes_at_L": temps[0], "temp_bytes_at_2L": temps[1]}


def analyze(config: Config, devices: list | None = None, *, activations: bool = True,
            compiled: jax.stages.Compiled | None = None) -> dict:
    """The report for `config` on `devices` (default: all). `activations=False` skips the two extra compilations;
    `compiled`: the train step already compiled for this config and devices (a benchmark's), else it is compiled
    here from abstract state."""
    devices = list(jax.devices() if devices is None else devices)
    config = config.resolve_for_devices(len(devices))
    trainer = build_trainer(config, devices, abstract=True)
    mesh = trainer.mesh
    if compiled is None:
        compiled = trainer.train_step.lower(trainer.state, _abstract_batch(config, mesh)).compile()

    cols = collectives(compiled, mesh)
    # Scalar-only reductions on the tensor axis are the optimizer's global gradient norm (partial sums of squares of
    # tensor-sharded gradients, inserted by the compiler outside the shard_map): reported apart from Megatron's.
    # XLA's all-reduce combiner may also merge those scalars into one of Megatron's all-reduces: their share of a
    # mixed tuple is counted with the scalars.
    scalar = [c for c in cols if c.axes == (TENSOR,) and _all_scalars(c.shape)]
    tensor_cols = [c for c in cols if c.axes == (TENSOR,) and c not in scalar]
    mixed_scalar = sum(c.sent_bytes * c.count * _scalar_share(c) for c in tensor_cols)
    tensor_sent = sum(c.sent_bytes * c.count for c in tensor_cols) - mixed_scalar
    padded = trainer.plan.padded_vocab
    want_bytes = expected.tensor_bytes(config, padded)
    want_flops = expected.step_flops(config, padded)
    measured_flops = dot_flops(compiled)
    report = {
        "config": {"mesh": dict(mesh.shape), "sequence_parallel": config.parallel.sequence_parallel,
                   "batch_per_data_shard": expected.rows_per_data_shard(config),
                   "seq_len": config.train.seq_len, "d_model": config.model.d_model,
                   "n_layers": config.model.n_layers, "padded_vocab": padded, "dtype": config.model.dtype},
        "collectives": {
            "by_kind_and_axes": collective_summary(cols),
            "tensor_sent_bytes": tensor_sent,
            "tensor_scalar_sent_bytes": sum(c.sent_bytes * c.count for c in scalar) + mixed_scalar,
            "largest_tensor_array_elements": max((_largest_leaf(c.shape) for c in tensor_cols), default=0),
            "exact": all(c.exact for c in cols),
        },
        "flops": {"dot_flops": measured_flops, "xla_cost_flops": cost(compiled)["flops"]},
        "memory": {"step": memory(compiled)},
        "expected": {"tensor_sent_bytes": want_bytes, "flops": want_flops,
                     "activation_bytes_per_layer_korthikanti": expected.activation_bytes_per_layer(config)},
        "ratio": {"tensor_sent_bytes": expected.ratio(tensor_sent, want_bytes["total"]),
                  "flops": expected.ratio(measured_flops, want_flops["executed"])},
    }
    if config.parallel.context > 1:
        report["context"] = context_section(config, cols)
        report["ratio"]["context_sent_bytes"] = expected.ratio(report["context"]["sent_bytes"],
                                                               report["context"]["expected_sent_bytes"])
    if config.moe.enabled:
        report["expert"] = expert_section(config, cols)
        report["ratio"]["expert_sent_bytes"] = expected.ratio(report["expert"]["sent_bytes"],
                                                              report["expert"]["expected_sent_bytes"])
    if config.parallel.pipe > 1 and config.parallel.schedule != "circular":
        report["schedule"] = schedule_section(config, trainer.plan.pipeline.program, compiled, cols)
    elif config.parallel.pipe > 1:
        report["pipeline"] = _pipeline_section(config, cols, measured_flops, want_flops)
    if activations:
        act = activation_bytes_per_layer(config, mesh)
        report["memory"]["activations"] = act
        korthikanti = report["expected"]["activation_bytes_per_layer_korthikanti"]
        key = "none" if config.parallel.tensor == 1 else "tp_sp" if config.parallel.sequence_parallel else "tp"
        report["ratio"]["activation_bytes_per_layer_vs_korthikanti"] = expected.ratio(act["per_layer"],
                                                                                      korthikanti[key])
    return report


def _pipeline_section(config: Config, cols, measured_flops: float, want_flops: dict) -> dict:
    """Iterations and bubble (formula), executed/useful FLOPs (measured over the model's count, beside the formula
    (v·m + p − 1)/(v·m) for the layers), and collective-permute bytes per iteration (measured and expected)."""
    p = config.parallel
    want = expected.pipeline_bytes(config)
    permute = sum(c.sent_bytes * c.count for c in cols if c.kind == "collective-permute" and c.axes == (PIPE,))
    iterations = want["iterations"] * config.train.grad_accum
    return {
        "stages": p.pipe, "repeats": p.repeats, "microbatches": p.microbatches,
        "iterations": want["iterations"], "bubble_fraction": want["bubble_fraction"],
        "executed_over_useful_flops": measured_flops / want_flops["useful"],
        "executed_over_useful_flops_layers_formula": pipeline.iterations(p.pipe, p.repeats, p.microbatches)
        / (p.repeats * p.microbatches),
        "permute_bytes_per_iteration": permute / iterations,
        "expected_permute_bytes_per_iteration": want["permute_bytes_per_iteration"],
    }


def context_section(config: Config, cols) -> dict:
    """Context parallelism: the collectives on `context` (sent bytes against `expected.context_bytes`) and the
    causal work per rank — unmasked (query, key) pairs over the layers (full and windowed layers differ), zigzag
    against contiguous chunks (max/min over ranks)."""
    p, S = config.parallel, config.train.seq_len
    on_context = [c for c in cols if c.axes == (CONTEXT,)]
    kv = [c for c in on_context if c.kind in ("all-gather", "reduce-scatter", "collective-permute")]  # K/V, dK/dV
    windows = config.model.layer_windows
    zig, flat = (sum(cp.unmasked_pairs(layout(S, p.context), w) for w in windows)
                 for layout in (cp.zigzag, cp.contiguous))
    return {"impl": p.context_impl, "degree": p.context,
            "sent_bytes": sum(c.sent_bytes * c.count for c in kv),
            "expected_sent_bytes": expected.context_bytes(config),
            # the gradients' mean over the gradient axes lands here alone when data (and pipe) are 1
            "gradient_sent_bytes": sum(c.sent_bytes * c.count for c in on_context if c not in kv),
            "by_kind": collective_summary(on_context),
            "pairs_per_rank": [int(x) for x in zig], "pairs_max_over_min": float(zig.max() / zig.min()),
            "contiguous_pairs_max_over_min": float(flat.max() / flat.min())}


def expert_section(config: Config, cols) -> dict:
    """Mixture of experts: the all-to-alls on `expert` (sent bytes against `expected.expert_bytes`: dispatch and
    combine, forward and backward, and the counts), the chunk each rank sends each other per layer, and the tokens
    a layer routes per expert when balanced."""
    p, moe = config.parallel, config.moe
    on_expert = [c for c in cols if c.axes == (EXPERT,) and c.kind == "all-to-all"]
    want = expected.expert_bytes(config)
    rows = expected.rows_per_data_shard(config) // (p.microbatches if p.pipe > 1 else 1) // config.train.grad_accum
    return {"degree": p.expert, "experts": moe.n_experts, "top_k": moe.top_k,
            "capacity": expert.capacity(config.train.seq_len, moe.top_k, moe.n_experts, moe.capacity_factor),
            "chunk_rows": expected.expert_chunk_rows(config, rows) if p.expert > 1 else 0,
            "balanced_tokens_per_expert": rows * config.train.seq_len * moe.top_k / moe.n_experts,
            "sent_bytes": sum(c.sent_bytes * c.count for c in on_expert),
            "expected_sent_bytes": want["total"], "balanced_formula_bytes": want["balanced"],
            "by_kind": collective_summary([c for c in cols if c.axes == (EXPERT,)])}


def lockstep_bubble(work) -> float:
    """The idle share of a pipeline whose stages run the ticks in lockstep (each tick ends with its sends), from
    `work` [ticks, stages] (FLOPs): a tick lasts as long as its busiest stage's work, so the step is
    Σ_t max_s work(t, s) long and the stages are busy Σ work of p times that."""
    span = float(work.max(axis=1).sum())
    return 1.0 - float(work.sum()) / (work.shape[1] * span) if span else 0.0


def schedule_flops(compiled, program) -> dict:
    """Executed matmul FLOPs per stage of a scheduled step, from the compiled program and the schedule's table.

    The executor's tick is one `conditional` with a branch per action (idle, F, B, W) and, nested in F, the
    embedding and head+loss conditionals and, in B, the embedding's backward. Each branch's FLOPs come from the HLO
    (`hlo.branch_flops`); how often stage s takes it comes from the table. Whatever is outside the tick's
    conditional (nothing but dead code here) runs on every stage."""
    n = len(schedule.BRANCHES)
    conds = branch_flops(compiled)
    ticks = [c for c in conds if len(c.branches) == n]
    if len(ticks) != 1:
        raise ValueError(f"expected one {n}-way tick conditional in the program, found {len(ticks)}")
    tick = ticks[0]
    nested = {i: sorted((c for c in conds if c.parent == (tick.name, i)), key=lambda c: max(c.branches))
              for i in range(n)}
    # F holds two: the embedding (chunk 0; a gather, ~no matmuls) and the head with its loss gradient (last chunk)
    in_f = nested[schedule.DO_F]
    embed_f, head_f = (max(in_f[0].branches), max(in_f[-1].branches)) if len(in_f) == 2 else (0, 0)
    embed_b = max(nested[schedule.DO_B][-1].branches) if nested[schedule.DO_B] else 0.0
    in_tree = sum(c.count * sum(c.branches) for c in conds if c is tick or (c.parent and c.parent[0] == tick.name))
    outside = dot_flops(compiled) - in_tree
    calls = tick.count // program.table.n_ticks  # > 1 with gradient accumulation
    kind, first, last = program.kind, program.first == 1, program.last == 1
    layers_only = sum(tick.branches[k] * (kind == k) for k in (schedule.DO_F, schedule.DO_B, schedule.DO_W))
    per_tick = layers_only + head_f * ((kind == schedule.DO_F) & last) + embed_f * ((kind == schedule.DO_F) & first) \
        + embed_b * ((kind == schedule.DO_B) & first)
    per_stage = [outside + calls * float(x) for x in per_tick.sum(axis=0)]
    return {"per_stage": per_stage, "branches": dict(zip(schedule.BRANCHES, tick.branches)),
            "bubble_executed": lockstep_bubble(per_tick), "bubble_layers": lockstep_bubble(layers_only),
            "head_and_loss": head_f, "embedding": embed_f, "embedding_backward": embed_b,
            "outside_ticks": outside,
            # what a masked step (every action's work on every tick, selected by jnp.where) would execute
            "all_branches_every_tick": outside + calls * program.table.n_ticks * (sum(tick.branches) + head_f
                                                                                + embed_f + embed_b)}


def schedule_section(config: Config, program: schedule.Program, compiled, cols) -> dict:
    """The scheduled pipeline: the table's ticks, bubble and peak in flight; executed FLOPs per stage (from the
    program); collective-permute bytes per step against `expected.schedule_permute_bytes`."""
    p = config.parallel
    table, sends = program.table, program.sends()
    permute = sum(c.sent_bytes * c.count for c in cols if c.kind == "collective-permute" and c.axes == (PIPE,))
    flops = schedule_flops(compiled, program)
    return {
        "schedule": p.schedule, "stages": p.pipe, "chunks": p.repeats, "microbatches": p.microbatches,
        "ticks": table.n_ticks, "bubble_fraction": table.bubble, "bubble_executed": flops["bubble_executed"],
        "bubble_layers": flops["bubble_layers"],
        "bubble_formula": schedule.formula_bubble(p.schedule, p.pipe, p.repeats, p.microbatches),
        "peak_in_flight": table.in_flight(), "stash_slots": program.n_stash, "inbox_slots": program.n_inbox,
        "tape_slots": program.n_tape, "dys_slots": program.n_dys,
        "actions_per_stage": {k: [int(x) for x in v] for k, v in program.actions().items()},
        "executed_flops_per_stage": flops["per_stage"], "flops": flops,
        "permute_bytes": permute,
        "expected_permute_bytes": expected.schedule_permute_bytes(
            config, table.n_ticks, (sends["down"] > 0) + (sends["up"] > 0)),
        "messages": sends,
        # every tick's sends are read only by the next tick (loop-carried): free to overlap its compute
        "permutes_loop_carried": loop_carried_permutes(compiled),
    }


def _largest_leaf(shape: str) -> int:
    """Elements of the largest array in a (possibly tuple, XLA-combined) collective shape."""
    return max((math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([^\]]*)\]", shape)),
               default=0)


def _scalar_share(c) -> float:
    """The share of a collective's bytes that its rank-0 leaves hold (an XLA-combined tuple of mixed leaves)."""
    return scalar_bytes(c.shape) / c.bytes if c.bytes else 0.0


def _all_scalars(shape: str) -> bool:
    """True for `f32[]` or a tuple of rank-0 arrays."""
    return all(dims == "" for dims in re.findall(r"\[([^\]]*)\]", shape))


def format_table(report: dict) -> str:
    """The report as a few human-readable lines."""
    c, e, r = report["config"], report["expected"], report["ratio"]
    rows = [f"mesh {c['mesh']}  SP={c['sequence_parallel']}  b/shard={c['batch_per_data_shard']}  s={c['seq_len']}  "
            f"h={c['d_model']}  L={c['n_layers']}  V={c['padded_vocab']}  {c['dtype']}", "",
            f"{'collective':<28}{'count':>8}{'sent MB/dev':>14}"]
    for key, v in report["collectives"]["by_kind_and_axes"].items():
        rows.append(f"{key:<28}{v['count']:>8}{v['sent_bytes'] / 1e6:>14.3f}")
    rows += ["",
             f"{'':<28}{'measured':>14}{'expected':>14}{'ratio':>8}",
             _row("tensor-axis MB sent/dev", report["collectives"]["tensor_sent_bytes"] / 1e6,
                  e["tensor_sent_bytes"]["total"] / 1e6, r["tensor_sent_bytes"]),
             _row("matmul GFLOP/dev", report["flops"]["dot_flops"] / 1e9, e["flops"]["executed"] / 1e9, r["flops"])]
    if "activations" in report["memory"]:
        act = report["memory"]["activations"]["per_layer"] / 1e6
        rows.append(_row("activations MB/layer/dev", act, None, None)
                    + f"   (Korthikanti 16-bit: {e['activation_bytes_per_layer_korthikanti']['none'] / 1e6:.2f} "
                      f"none, {e['activation_bytes_per_layer_korthikanti']['tp'] / 1e6:.2f} tp, "
                      f"{e['activation_bytes_per_layer_korthikanti']['tp_sp'] / 1e6:.2f} tp+sp)")
    if "pipeline" in report:
        pp = report["pipeline"]
        rows.append(f"pipeline: p={pp['stages']} v={pp['repeats']} m={pp['microbatches']}: {pp['iterations']} "
                    f"iterations, bubble {pp['bubble_fraction']:.3f}; executed/useful FLOPs "
                    f"{pp['executed_over_useful_flops']:.3f} (layers alone: (v·m+p−1)/(v·m) = "
                    f"{pp['executed_over_useful_flops_layers_formula']:.3f}); permute KB/iteration "
                    f"{pp['permute_bytes_per_iteration'] / 1e3:.1f} (expected "
                    f"{pp['expected_permute_bytes_per_iteration'] / 1e3:.1f})")
    if "schedule" in report:
        sc = report["schedule"]
        per_stage = ", ".join(f"{f / 1e9:.3f}" for f in sc["executed_flops_per_stage"])
        rows.append(f"schedule {sc['schedule']}: p={sc['stages']} v={sc['chunks']} m={sc['microbatches']}: "
                    f"{sc['ticks']} ticks, bubble {sc['bubble_fraction']:.3f} (formula {sc['bubble_formula']:.3f}), "
                    f"peak in flight {sc['peak_in_flight']}; executed GFLOP per stage [{per_stage}] (every branch "
                    f"on every tick: {sc['flops']['all_branches_every_tick'] / 1e9:.3f}); permute MB "
                    f"{sc['permute_bytes'] / 1e6:.3f} (expected {sc['expected_permute_bytes'] / 1e6:.3f}); bubble by "
                    f"executed FLOPs {sc['bubble_layers']:.3f} (layers), {sc['bubble_executed']:.3f} (with the head)")
    if "expert" in report:
        ex = report["expert"]
        rows.append(f"expert ep={ex['degree']} X={ex['experts']} k={ex['top_k']} C={ex['capacity'] or 'dropless'}: "
                    f"all-to-all MB sent/dev {ex['sent_bytes'] / 1e6:.3f} "
                    f"(expected {ex['expected_sent_bytes'] / 1e6:.3f}"
                    f", balanced formula {ex['balanced_formula_bytes'] / 1e6:.3f}); chunk {ex['chunk_rows']} rows, "
                    f"{ex['balanced_tokens_per_expert']:.1f} tokens/expert/layer when balanced")
    if "context" in report:
        cx = report["context"]
        rows.append(f"context {cx['impl']} c={cx['degree']}: K/V MB sent/dev {cx['sent_bytes'] / 1e6:.3f} (expected "
                    f"{cx['expected_sent_bytes'] / 1e6:.3f}); causal pairs per rank max/min "
                    f"{cx['pairs_max_over_min']:.2f} (contiguous chunks: {cx['contiguous_pairs_max_over_min']:.2f})")
    step = report["memory"]["step"]
    rows.append(f"step memory/dev: arguments {step['argument_bytes'] / 1e6:.2f} MB, temp {step['temp_bytes'] / 1e6:.2f}"
                f" MB, peak {step['peak_bytes'] / 1e6:.2f} MB;  XLA cost_analysis flops (loop bodies once): "
                f"{report['flops']['xla_cost_flops'] / 1e9:.3f} G")
    return "\n".join(rows)


def _row(name, measured, want, ratio) -> str:
    fmt = lambda x: f"{x:>14.3f}" if x is not None else f"{'—':>14}"  # noqa: E731
    return f"{name:<28}{fmt(measured)}{fmt(want)}{(f'{ratio:>8.3f}' if ratio is not None else f'{chr(8212):>8}')}"
