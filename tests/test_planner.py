"""The planner (jaxpar.planner): state bytes exact against the real sharded state, the memory prediction against the
compiled step, and the search's pick — a layout that compiles within a budget the naive layouts exceed."""

from __future__ import annotations

import json
import math

import jax
import pytest

from jaxpar.analysis.verify import abstract_step, compiled_memory
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.planner import cost, expected, memory, profile as machine, search
from jaxpar.planner.memory import predict_memory, state_bytes

FLAT = ["parallel.pipe=1", "parallel.repeats=1", "parallel.microbatches=1"]


def _shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("path, overrides", [
    ("configs/tiny.py", FLAT + ["parallel.tensor=1", "parallel.zero=1", "train.grad_accum=2"]),
    ("configs/tiny.py", ["parallel.zero=3"]),  # data 2 × pipe 2 × tensor 2, stacks stage-major
    ("configs/tiny.py", FLAT + ["parallel.tensor=4", "parallel.sequence_parallel=true"]),  # kv heads replicated
    ("configs/moe_tiny.py", FLAT + ["parallel.expert=2", "parallel.tensor=2", "parallel.zero=1"]),
    ("configs/moe_tiny.py", ["parallel.expert=2", "parallel.tensor=1", "parallel.zero=3", "moe.load_ema=0.9"]),
    ("configs/deepseek_tiny.py", ["parallel.zero=1"]),  # MLA's replicated latents, the correction-bias buffer
], ids=["zero1-accum", "zero3-pipe-tensor", "gqa-replicated-kv", "moe-expert-tensor", "buffer-zero3-pipe",
        "deepseek-mla-bias"])
def test_state_bytes_are_the_sums_of_the_real_shards(path, overrides):
    """params, optimizer and batch bytes per device equal the abstract TrainState's shards (nothing compiled) — a
    model's buffers (expert_load) among the params, without moments."""
    config = load_config(path, overrides).resolve_for_devices(8)
    _, state, batch = abstract_step(config)
    predicted = state_bytes(config)
    assert predicted["params"] == _shard_bytes(state.params)
    assert predicted["optimizer"] == _shard_bytes(state.opt_state) + _shard_bytes(state.step)
    assert predicted["batch"] == _shard_bytes(batch)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_a_table_stash_slot_holds_what_the_policy_saves(remat):
    """The memory model reads a schedule table's slots off the executor's own chunk trace (`memory.table_chunk`,
    `executor.Chunk`); under remat the stash then holds what autodiff of the plain model saves under the policy and
    nothing more (a 4-byte scalar aside). RECORD checkpoints each period, and a checkpoint keeps its inputs: the
    zero probes among them, a dys slot's worth, which the executor makes again in B instead of stashing. Traced
    only, nothing compiled."""
    config = load_config("configs/tiny.py", ["parallel.schedule=zb_h1", "parallel.repeats=1",
                                             f"parallel.remat={remat}"]).resolve_for_devices(8)
    local = memory.local_model(config.model, memory.degrees_of(config))
    seq, k = config.train.seq_len, config.model.n_layers // config.parallel.pipe
    chunk = memory.table_chunk(local, seq, remat, k)
    saved = sum(nbytes for _, nbytes, *_ in memory.residuals(local, seq, remat, False).stacked)
    assert 0 <= sum(nbytes for _, nbytes, *_ in chunk.stash) - saved <= 8, (chunk.stash, saved)
    assert len(chunk.dys) == len(chunk.tape) + 3  # q, k, v from one input; gate, up from one


def _shape_rule_stream(e, d_model: int) -> bool:
    """The rule the tags replaced: a residual as wide as the model is the residual stream."""
    return 0 < len(e.shape) <= 3 and e.shape[-1] == d_model


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_residuals_are_classified_by_their_checkpoint_names_where_widths_coincide(remat):
    """d_ff / tensor = d_model (tiny with d_ff 256 over tensor 2: the MLP's hidden [.., 128] is as wide as the
    residual stream). Each residual carries the `checkpoint_name` it is, is computed from or is passed on to
    (`Entry.tag`), and sequence parallelism acts by the tag: the stream's residuals split over `tensor`, the MLP's
    hidden (computed on the gathered sequence) whole; under `dots` the row-parallel outputs (attn_out) are kept
    whole-sequence and the column ones (q, k, v, gate, up) not at all. The width rule took the hidden for the
    stream (and gate and up for row outputs). The schedule table's tape and dys split by their groups' tags alike.
    Traced only."""
    config = load_config("configs/tiny.py", FLAT + ["model.d_ff=256", "parallel.tensor=2",
                                                    "parallel.sequence_parallel=true", f"parallel.remat={remat}"]
                         ).resolve_for_devices(8)
    local = memory.local_model(config.model, memory.degrees_of(config))
    seq, t, h = config.train.seq_len, config.parallel.tensor, local.d_model
    assert local.d_ff == h
    entries = memory.residuals(local, seq, remat, False).stacked
    hidden = [e for e in entries if e.tag in memory.HIDDEN]
    stream = [e for e in entries if e.tag in memory.STREAM]
    assert hidden and all(e.shape[-1] == h for e in hidden)
    assert all(_shape_rule_stream(e, h) for e in hidden)  # where the width rule went wrong
    if remat == "none":
        assert {e.tag for e in entries} >= {"layer_in", "attn_in", "q", "k", "v", "context", "mlp_in", "mlp_gate",
                                            "mlp_up", "mlp_hidden"}
        assert memory._scaled(hidden, config, seq) == sum(e.nbytes for e in hidden)  # whole sequence
        assert memory._scaled(stream, config, seq) == sum(e.nbytes for e in stream) / t  # split over tensor
    else:
        assert sorted(e.tag for e in entries if e.dot) == ["attn_out", "k", "mlp_gate", "mlp_up", "q", "v"]
        assert memory._scaled(hidden, config, seq) == 0  # column outputs: recomputed from the gathered shard
        row, between = [e for e in stream if e.dot], [e for e in stream if not e.dot]
        assert [e.tag for e in row] == ["attn_out"] and between
        assert memory._scaled(row, config, seq) == sum(e.nbytes for e in row)  # the partial sums, whole
        assert memory._scaled(between, config, seq) == sum(e.nbytes for e in between) / t  # the layer's input
    chunk = memory.table_chunk(local, seq, remat, 2)
    assert [e.tag for e in chunk.tape] == ["attn_in", "context", "mlp_in", "mlp_hidden"]
    assert [e.tag for e in chunk.dys] == ["q", "k", "v", "attn_out", "mlp_gate", "mlp_up", "mlp_out"]


def test_expert_rows_are_classified_by_their_checkpoint_names_where_widths_coincide():
    """An MoE layer whose experts' d_ff equals d_model (moe_tiny with moe.d_ff 128, expert 2): on XLA:CPU the dense
    `ragged_dot` keeps the model-width expert rows (`expert_in`, `expert_out`) once per local expert, the hidden
    (gate, up, their product) and the routing weights [M, 1] once; the width rule multiplied the hidden too."""
    config = load_config("configs/moe_tiny.py", FLAT + ["moe.d_ff=128", "parallel.expert=2", "parallel.tensor=1"]
                         ).resolve_for_devices(8)
    local = memory.local_model(config.model, memory.degrees_of(config))
    seq, h = config.train.seq_len, local.d_model
    routed = memory._routed_factor(config, memory.CORRECTIONS["cpu"])
    assert routed[1] == routed[0] * config.moe.n_experts // config.parallel.expert > routed[0]
    rows = [e for e in memory.residuals(local, seq, "none", True).layer
            if len(e.shape) == 2 and e.shape[0] == seq * config.moe.top_k]
    model_rows = [e for e in rows if e.tag in memory.EXPERT_ROWS]
    hidden = [e for e in rows if e.tag in memory.HIDDEN]
    assert {e.tag for e in model_rows} == {"expert_in", "expert_out"} and all(e.shape[-1] == h for e in model_rows)
    assert len(hidden) >= 3 and all(e.shape[-1] == h for e in hidden)  # as wide as the model
    for e in rows:
        assert memory._scaled([e], config, seq, routed) == e.nbytes * routed[e in model_rows], e
    assert memory.corrections("gpu") == memory.Corrections() == memory.corrections("rocm")


@pytest.mark.parametrize("overrides", [
    ["parallel.skip_bubble=true"],  # the tiny preset: circular pipeline over 2 stages, tensor 2; the bubble skipped
    FLAT + ["parallel.tensor=1", "parallel.zero=1"],
    ["parallel.schedule=zbv", "parallel.repeats=2", "parallel.microbatches=4", "train.grad_accum=4",
     "train.batch_size=128"],
], ids=["circular-pipeline", "data-zero1", "zbv-accumulation"])
def test_memory_prediction_against_the_compiled_step(overrides):
    """Resident bytes (the step's arguments) exactly; the total within 20 % of the compiled peak, the issue's bar for
    the worst layout (bench/plan.py measures the spread over 33 layouts: see bench/RESULTS.md). And where XLA:CPU's
    temp allocation goes (`analysis.heap`): each computation's own peak, stacked along the calls, is the allocation
    within 5 % — the table's step stacks the accumulation loop (the slots), the tick and a branch — while the bytes
    live at once can be far fewer (35.9 of the zbv step's 47.6 MB)."""
    config = load_config("configs/tiny.py", overrides).resolve_for_devices(8)
    measured = compiled_memory(config, heap=True)
    predicted = predict_memory(config, "cpu")
    assert predicted.resident == measured["argument_bytes"]
    assert abs(predicted.total / measured["peak_bytes"] - 1) < 0.20, (predicted, measured)
    heap = measured["heap"]
    assert heap["allocation"] == measured["temp_bytes"] and heap["live"] <= heap["allocation"]
    assert abs(heap["stacked"] / heap["allocation"] - 1) < 0.05, heap
    labels = [label for label, _ in heap["chain"]]
    assert labels[0] == "entry" and (len(labels) > 1) == (config.parallel.pipe > 1)
    if config.parallel.schedule == "zbv":
        assert labels[1:3] == ["loop while", "loop while/while"] and labels[3].startswith("branch"), labels


PIPED = ["model.n_layers=5", "parallel.pipe=2", "parallel.microbatches=4"]  # the dense layer and 2 MoE layers a stage


@pytest.mark.parametrize("overrides", [[], PIPED + ["model.mtp_depth=1"], PIPED + ["parallel.schedule=1f1b"]],
                         ids=["preset", "pipe-circular-mtp", "pipe-1f1b"])
def test_deepseek_memory_prediction_against_the_compiled_step(overrides):
    """deepseek_tiny as preset (data 2 × expert 2 × tensor 2): multi-head latent attention, a dense first layer
    beside the MoE layers (sigmoid, group-limited routing, the correction-bias buffer, a shared expert); then over
    pipe 2 × expert 2 × tensor 2, the dense layer beside the embedding — with an MTP module beside the head under
    the circular pipeline, and under 1F1B. Resident bytes exactly, the total within 20 % of the compiled peak
    (measured +0.6 %, −11 % and −14 %; deepseek_v3 on 256 simulated devices: bench/RESULTS.md)."""
    config = load_config("configs/deepseek_tiny.py", overrides).resolve_for_devices(8)
    measured = compiled_memory(config)
    predicted = predict_memory(config, "cpu")
    assert predicted.resident == measured["argument_bytes"]
    assert abs(predicted.total / measured["peak_bytes"] - 1) < 0.20, (predicted, measured)


def test_mla_layer_matmuls_are_its_projections_and_core_by_hand():
    """`cost.layer_matmuls` reads the attention kind: deepseek_tiny's MLA on tensor 2 (a = 2 local heads of
    Eqk = 24 + 8 and Ev = 24; q through rank 64, the kv latent 32 + the rope key 8), then the MoE layer's top-2
    experts of 88/2 and the shared expert's, each SwiGLU's three matmuls. FLOPs per token, width √(K·N)."""
    config = load_config("configs/deepseek_tiny.py", ["parallel.tensor=2"]).resolve_for_devices(8)
    D, s, a, F = 128, 128, 2, 44
    by_hand = [(2 * D * 64, math.sqrt(D * 64)),  # q_a [D → rq], replicated
               (2 * 64 * a * 32, math.sqrt(64 * a * 32)),  # q_b [rq → a·Eqk]
               (2 * D * 40, math.sqrt(D * 40)),  # kv_a [D → r + R], replicated
               (2 * 32 * a * 48, math.sqrt(32 * a * 48)),  # kv_b [r → a·(N + Ev)]
               (2 * a * 24 * D, math.sqrt(a * 24 * D)),  # o [a·Ev → D]
               (2 * 32 * s * a, math.sqrt(32 * s)), (2 * 24 * s * a, math.sqrt(s * 24))]  # scores, context
    by_hand += [(2 * 2 * D * F, math.sqrt(D * F))] * 3 + [(2 * D * F, math.sqrt(D * F))] * 3
    got = cost.layer_matmuls(config)
    assert len(got) == len(by_hand)
    for (flops, width), (f, w) in zip(got, by_hand):
        assert flops == pytest.approx(f, rel=1e-12) and width == pytest.approx(w, rel=1e-12)
    # the attention FLOPs agree with the kind's own count over s keys (`AttentionKind.flops`)
    from jaxpar.families import attention_kind

    projections, core = attention_kind(config.model).flops(config.model, s, 2)
    assert sum(f for f, _ in by_hand[:7]) == pytest.approx(projections + core, rel=1e-12)


def test_layouts_are_valid_configs_and_fixed_fields_stay():
    """Every enumerated layout passes the config's checks for 8 devices, keeps the fixed fields and keeps tensor
    inside a host; each degree combination that divides 8 appears."""
    config = load_config("configs/tiny.py", ["parallel.remat=none"])
    found = list(search.layouts(config, 8, devices_per_host=2, fixed={"remat"}))
    assert found and all(c.parallel.remat == "none" and c.parallel.tensor <= 2 for c in found)
    assert all(math.prod(c.mesh_shape) == 8 for c in found)
    assert {c.mesh_shape for c in found} >= {(8, 1, 1, 1, 1), (4, 1, 1, 1, 2), (2, 2, 1, 1, 2), (1, 4, 1, 2, 1)}


def test_the_pick_compiles_within_a_budget_that_rules_out_the_naive_layouts():
    """8 simulated devices, the tiny model, a budget below what data parallelism without remat needs: the planner's
    winner compiles, and its compiled peak is within the budget up to the prediction's error. Measured on jax 0.12.1
    (not asserted at these figures): the pick, data8 remat=dots, predicted at 25.2 MB against a 27.1 MB budget,
    compiles to 27.2 MB (the prediction 7 % low, inside the 20 % the predictor promises; under the budget before
    0.12.1), so the bar is the budget plus 10 % — still far below the naive layout's 45 MB."""
    config = load_config("configs/tiny.py", ["parallel.context=1"])
    naive = predict_memory(load_config("configs/tiny.py", FLAT + ["parallel.tensor=1"]).resolve_for_devices(8))
    budget_gb = 0.6 * naive.total / 1e9
    result = search.plan(config, 8, machine.profile_for("h100"), memory_gb=budget_gb, fixed={"context"})
    winner = result["winner"]
    assert winner["memory"]["total"] <= budget_gb * 1e9 and "why" in result
    chosen = load_config("configs/tiny.py", [f"parallel.{k}={v}" for k, v in winner["parallel"].items()]
                         + [f"train.grad_accum={winner['grad_accum']}"]).resolve_for_devices(8)
    measured = compiled_memory(chosen)
    assert measured["peak_bytes"] <= 1.1 * budget_gb * 1e9, (winner["layout"], measured["peak_bytes"], budget_gb)
    assert abs(winner["memory"]["total"] / measured["peak_bytes"] - 1) < 0.20
    assert "data8" not in {r["layout"] for r in result["ranked"]}  # the naive layout was dropped by the budget


def test_plan_command_prints_the_table_and_json(capsys):
    args = ["plan", "--config", "configs/tiny.py", "--devices", "8", "--hosts", "2", "--config.parallel.pipe=1",
            "--config.parallel.repeats=1", "--config.parallel.microbatches=1", "--config.parallel.context=1"]
    assert main(args + ["--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    table = search.format_plan(result, top=3)  # what --format table prints
    assert "winner:" in table and "why:" in table and len(table.splitlines()) == 3 + 3 + 2
    ranked = result["ranked"]
    assert result["hosts"] == 2 and all(r["parallel"]["pipe"] == 1 for r in ranked)
    assert all(r["parallel"]["tensor"] <= 4 for r in ranked)  # tensor inside a host of 4
    steps = [r["time"]["step_s"] for r in ranked]
    fastest = min(steps) * (1 + search.TIE)  # the layouts tied with the fastest come first, the leanest first
    tied = sum(step <= fastest for step in steps)
    assert max(steps[:tied]) <= fastest and steps[tied:] == sorted(steps[tied:])
    totals = [r["memory"]["total"] for r in ranked[:tied]]
    assert totals == sorted(totals)


def test_fp8_matmuls_run_at_the_profiles_float8_rate():
    """With model.matmul = fp8_rowwise a block matmul runs its forward and input gradient at the profile's float8
    rate and its weight gradient at the compute dtype's: float8 at 2r gives 1/(⅔/2r + ⅓/r) = 1.5r; a profile without
    a float8 rate (an old probe) prices them as float; the H100 datasheet profile rates float8 (its FP8 peak), and
    the step it predicts is faster than bf16's."""
    import dataclasses

    base = load_config("configs/tiny.py", FLAT).resolve_for_devices(8)
    fp8 = dataclasses.replace(base, model=dataclasses.replace(base.model, matmul="fp8_rowwise"))
    r = 1e12
    rated = dataclasses.replace(machine.profile_for("h100"), matmul={"float32": {"32": r, "4096": r},
                                                                      "float8": {"32": 2 * r, "4096": 2 * r}})
    assert cost.matmul_rate(base, rated) == pytest.approx(r, rel=1e-12)
    assert cost.matmul_rate(fp8, rated) == pytest.approx(1.5 * r, rel=1e-12)
    unrated = dataclasses.replace(rated, matmul={"float32": {"32": r, "4096": r}}, flops={"float32": r})
    assert cost.matmul_rate(fp8, unrated) == pytest.approx(r, rel=1e-12)
    h100 = machine.profile_for("h100")
    assert h100.flops["float8"] == pytest.approx(2 * h100.flops["bfloat16"], rel=1e-3)
    bf16 = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype="bfloat16"))
    bf16_fp8 = dataclasses.replace(bf16, model=dataclasses.replace(bf16.model, matmul="fp8_rowwise"))
    assert cost.predict_time(bf16_fp8, h100, 8).compute < cost.predict_time(bf16, h100, 8).compute


def test_a_skipped_bubble_costs_no_time_only_where_the_devices_share_cores():
    """`parallel.skip_bubble` on the tiny preset's circular pipeline (2 stages × 2 passes, 4 microbatches: bubble
    1/9, remat none): on devices that share one pool of cores (a probed CPU profile) its compute is the useful
    FLOPs', 8/9 of the loop's executed ones; on devices of their own (H100) the bubble is idle time either way, the
    same step, and the ranking's tie-break on memory keeps the loop that computes its bubble (the skip's copies cost
    memory). A schedule table's idle ticks likewise cost nothing on shared cores (its useful FLOPs alone) and
    1/(1 − bubble) on devices of their own. The search offers the skip only to circular pipelines; `describe` names
    it. (Fixed per-layer costs set to 0 so that the matmul term stands alone.)"""
    import dataclasses

    config = load_config("configs/tiny.py", []).resolve_for_devices(8)
    with_par = lambda **kw: dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **kw))  # noqa
    skip, table = with_par(skip_bubble=True), with_par(schedule="1f1b", repeats=1)
    own = dataclasses.replace(machine.profile_for("h100"), layer_overhead=0.0)
    shared = dataclasses.replace(own, machine={"platform": "cpu"}, devices=8)
    assert shared.shared_cores and not own.shared_cores
    rate = cost.matmul_rate(config, own)
    f = expected.step_flops(config, cost.padded_vocab(config.model, config.parallel.tensor))
    assert f["useful"] / f["executed"] == pytest.approx(8 / 9, rel=1e-2)
    assert cost.predict_time(config, shared, 8).compute == pytest.approx(f["executed"] / rate, rel=1e-9)
    assert cost.predict_time(skip, shared, 8).compute == pytest.approx(f["useful"] / rate, rel=1e-9)
    assert cost.predict_time(skip, own, 8).step == cost.predict_time(config, own, 8).step
    assert predict_memory(skip, "cpu").total > predict_memory(config, "cpu").total
    ft = expected.step_flops(table, cost.padded_vocab(table.model, table.parallel.tensor))
    on_own = cost.predict_time(table, own, 8)
    assert on_own.bubble > 0
    assert on_own.compute == pytest.approx(ft["useful"] / rate / (1 - on_own.bubble), rel=1e-9)
    assert cost.predict_time(table, shared, 8).compute == pytest.approx(ft["useful"] / rate, rel=1e-9)
    fixed = {"data", "pipe", "expert", "context", "tensor", "remat", "zero"}
    labels = {search.describe(c) for c in search.layouts(config, 8, 8, fixed=fixed)}
    assert "data2xpipe2xtensor2 circular v2 m4 skip" in labels
    assert all("circular" in label for label in labels if "skip" in label)


def test_time_model_rates_matmuls_by_width_and_charges_the_pipeline_loop_and_fresh_memory_per_byte():
    """The time model's probed CPU terms, by arithmetic: (1) a layer's matmuls each at the rate of their width —
    one rate for every width gives exactly that rate, a table that slows narrow matmuls slows tensor 4 (narrower
    projections) below tensor 1, within the table's range; (2) the pipeline loop's per-byte cost adds, for the tiny
    preset (2 stages × 2 passes, 4 microbatches of 4 rows of 128 × 128 float32), 9 iterations × 4·128·128·4 bytes;
    (3) fresh memory's per-byte cost adds the predicted gradients, activations and workspace times it."""
    import dataclasses

    import numpy as np

    flat = {t: load_config("configs/tiny.py", FLAT + [f"parallel.tensor={t}"]).resolve_for_devices(8) for t in (1, 4)}
    even = dataclasses.replace(machine.profile_for("h100"), matmul={"float32": {"32": 2e12, "4096": 2e12}})
    assert cost.matmul_rate(flat[4], even) == pytest.approx(2e12, rel=1e-12)
    sloped = dataclasses.replace(even, matmul={"float32": {"32": 1e12, "4096": 4e12}})
    rates = {t: cost.matmul_rate(c, sloped) for t, c in flat.items()}
    assert 1e12 < rates[4] < rates[1] < 4e12
    piped = load_config("configs/tiny.py").resolve_for_devices(8)
    per_byte = 1e-9
    extra = (cost.predict_time(piped, dataclasses.replace(even, pipeline_byte=per_byte), 8).compute
             - cost.predict_time(piped, even, 8).compute)
    assert extra == pytest.approx(9 * 4 * 128 * 128 * np.dtype(piped.model.dtype).itemsize * per_byte, rel=1e-9)
    mem = predict_memory(flat[1], "cpu")  # (3) a runtime that allocates afresh pays per byte of the temporaries
    fresh = (cost.predict_time(flat[1], dataclasses.replace(even, fresh_byte=per_byte), 8).compute
             - cost.predict_time(flat[1], even, 8).compute)
    assert fresh > 0 and fresh == pytest.approx((mem.gradients + mem.activations + mem.workspace) * per_byte, rel=1e-9)


# ---------------------------------------------------------------------------------------------------------------------
# Inputs the planner refuses, and how fast (issue 35)


@pytest.mark.parametrize("edit, field", [
    ({"intra_host": -1.0}, "field intra_host"), ({"inter_host": 0}, "field inter_host"),
    ({"overlap": 5}, "field overlap"), ({"pipeline_byte": float("nan")}, "field pipeline_byte"),
    ({"latency": float("inf")}, "field latency"), ({"memory_gb": -3}, "field memory_gb"),
    ({"flops": {"bfloat16": 1e12}}, "field flops"), ({"flops": {"float32": True}}, "field flops"),
    ({"links": {"all_reduce": {"two": 1e9}}}, "field links['all_reduce']"),
    ({"links": {"all_reduce": {"2": -1e9}}}, "field links['all_reduce']['2']"),
    ({"links": {"broadcast": {}}}, "field links"), ({"matmul": {"float32": {"64": float("nan")}}}, "field matmul"),
    ({"devices": -1}, "field devices"), ({"name": 3}, "field name"), ({"speed": 1}, "field speed"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_every_profile_field_is_checked_and_named(tmp_path, edit, field):
    """A machine profile's every field: numbers finite, rates and sizes > 0, fixed costs >= 0, the overlap a
    fraction, tables keyed by known names and whole numbers — refused by name (file and field), never by `assert`
    (a check `python -O` would skip), and the same rules hold for a profile built in Python."""
    import dataclasses

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**dataclasses.asdict(machine.profile_for("h100")), **edit}))
    with pytest.raises(machine.ConfigError) as err:
        machine.load_profile(str(path))
    assert str(err.value).startswith(f"--profile {path}: {field}"), str(err.value)
    if "speed" not in edit:
        with pytest.raises(machine.ConfigError, match="field"):
            dataclasses.replace(machine.profile_for("h100"), **edit)


def test_no_assert_checks_input():
    """`assert` vanishes under `python -O`: the package keeps it only for invariants no input reaches (the pipeline's
    own label replay and a validated table's lowering)."""
    import ast
    import pathlib

    allowed = {("circular.py", "output_order"), ("schedule.py", "lower")}
    found = []
    for path in pathlib.Path(cost.__file__).parents[1].rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path.name, fn.name) not in allowed:
                found += [f"{path.name}:{n.lineno} in {fn.name}" for n in ast.walk(fn) if isinstance(n, ast.Assert)]
    assert not found, found


def test_a_budget_below_the_state_floor_is_refused_before_any_layout_is_predicted(monkeypatch):
    """`plan --memory-gb 1e-300` (176-262 s before): the parameters and Adam moments alone exceed the budget on any
    device count up to 4096, so nothing is traced or predicted."""
    def boom(*args, **kwargs):
        raise AssertionError("a layout was predicted")

    monkeypatch.setattr(search, "predict_memory", boom)
    monkeypatch.setattr(search, "predict_time", boom)
    config = load_config("configs/tiny.py")
    with pytest.raises(search.PlanError, match="state alone needs at least 0.00121 GB per device.*0.00965 GB.*"
                       "up to 4096"):
        search.plan(config, 8, machine.profile_for("h100"), memory_gb=1e-300)
    floor = memory.state_floor(config, 8)
    assert floor <= sum(state_bytes(load_config("configs/tiny.py", ["parallel.zero=3"]).resolve_for_devices(8))
                        .values())


def test_no_valid_layout_names_the_fields_that_block_it_and_the_device_counts_that_work():
    config = load_config("configs/tiny.py")
    with pytest.raises(search.PlanError, match=r"on 7 devices, whatever the fields .* plan for 4 or 8 devices"):
        search.plan(config, 7, machine.profile_for("h100"))
    msg = search.blocked(config, 1, fixed={"tensor", "remat"}, release="RELEASE")
    assert "keeps parallel.tensor = 2" in msg and "parallel.tensor=1" in msg and msg.endswith("Fix: RELEASE")
    assert "remat" not in msg  # only the fields that block are named


def test_plan_json_is_strict(monkeypatch, capsys):
    """`plan --format json` writes RFC 8259 JSON: a non-finite number is null, never Infinity / NaN."""
    result = {"winner": {"time": {"step_s": float("inf"), "mfu": float("nan")}}, "ranked": [1.5, -float("inf")]}
    monkeypatch.setattr(search, "plan", lambda *a, **k: result)

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    assert main(["plan", "--config", "configs/tiny.py", "--devices", "8", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert out == {"winner": {"time": {"step_s": None, "mfu": None}}, "ranked": [1.5, None]}


def test_probe_out_replaces_only_a_regular_file(tmp_path, monkeypatch, capsys):
    """`probe --out` refuses a symlink, a pipe or a directory before measuring; `profile.write` replaces a regular file
    whole through a temporary file beside it (none left behind)."""
    import os

    from jaxpar.errors import OutputError
    from jaxpar.planner import probe

    monkeypatch.setattr(probe, "measure", lambda *a, **k: pytest.fail("measured before refusing --out"))
    (tmp_path / "target").write_text("keep\n")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.mkfifo(tmp_path / "pipe")
    for name, needle in (("link", "symbolic link"), ("pipe", "not a regular file"), (".", "directory")):
        assert main(["probe", "--out", str(tmp_path / name)]) == 2
        assert needle in capsys.readouterr().err
        with pytest.raises(OutputError, match=needle):
            machine.write(machine.profile_for("h100"), tmp_path / name)
    assert (tmp_path / "target").read_text() == "keep\n" and (tmp_path / "link").is_symlink()
    out = tmp_path / "profile.json"
    out.write_text("old")
    machine.write(machine.profile_for("h100"), out)
    assert machine.load_profile(str(out)) == machine.profile_for("h100")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe", "profile.json", "target"]
