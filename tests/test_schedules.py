"""Pipeline schedules as tables (jaxpar.parallel.schedule) and the executor that runs them (executor.execute):
the tables' ticks, bubble and memory against the formulas, and loss and every gradient against the sequential
single-device reference for every schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, load_config
from jaxpar.flops import layer_forward_flops
from jaxpar.parallel import schedule

from _parity import assert_grads_match, exactly_zero, on_layout, single_device

TABLES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]  # run by the executor; circular is the autodiff loop
CHUNKS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2, "circular": 2}


# ---------------------------------------------------------------------------------------------------------------------
# The tables: pure Python, every shape.

@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_tables_are_complete_causal_and_match_their_bubble_formula(name):
    for p in (2, 3, 4, 5, 8):
        for mult in (1, 2, 4, 8):
            v, m = CHUNKS[name] if name != "interleaved_1f1b" or p != 3 else 3, mult * p
            table = schedule.build(name, p, v, m)
            schedule.validate(table)
            busy = sum(a is not None for row in table.ticks for a in row)
            assert busy == 3 * p * v * m  # F, B and W of every (microbatch, chunk), once
            assert table.bubble == pytest.approx(schedule.formula_bubble(name, p, v, m), abs=1e-12), (p, v, m)


def test_peak_in_flight_is_the_schedules_memory():
    """Chunk-activations alive (F done, W not yet) per stage: GPipe and circular keep all v·m; 1F1B p − s whatever
    m is; ZB-H1 at most p (1F1B's peak); ZB-V at most 2p half-stage chunks (1F1B's p microbatches of a stage)."""
    for p in (2, 4):
        for m in (p, 4 * p, 8 * p):
            assert schedule.build("gpipe", p, 1, m).in_flight() == [m] * p
            assert schedule.build("circular", p, 2, m).in_flight() == [2 * m] * p
            assert schedule.build("1f1b", p, 1, m).in_flight() == [p - s for s in range(p)]
            assert max(schedule.build("zb_h1", p, 1, m).in_flight()) == p
            assert max(schedule.build("zbv", p, 2, m).in_flight()) <= 2 * p
            # interleaved: bounded in m too (Megatron's warm-up of (p − s − 1)·2 + (v − 1)·p forwards, + 1)
            assert max(schedule.build("interleaved_1f1b", p, 2, m).in_flight()) <= 2 * (p - 1) + p + 1


def test_zero_bubble_tables_beat_1f1b():
    for p, m in [(4, 8), (4, 16), (8, 16)]:
        one_f = schedule.build("1f1b", p, 1, m)
        zb = schedule.build("zb_h1", p, 1, m)
        zbv = schedule.build("zbv", p, 2, m)
        assert one_f.n_ticks - 3 * m == 2 * (p - 1)  # idle ticks per stage
        assert zb.n_ticks - 3 * m == p - 1  # half of ours, a third of Megatron's fused-backward 1F1B
        assert zbv.n_ticks - 6 * m == p - 1  # in half-stage ticks: a quarter of ours
        assert zbv.bubble < zb.bubble < one_f.bubble


def test_lowering_sizes_buffers_from_the_table():
    """The slot buffers (interval colouring of the table's lifetimes) are what the schedule keeps alive: each F's
    matmul inputs (tape) until its W — the peak in flight — its residuals (stash) only until its B, and the matmul
    output gradients (dys) from B to W: one slot where every W directly follows its B. 1F1B's inbox needs 2 slots
    whatever m."""
    for name in TABLES:
        for p, m in [(2, 4), (4, 8), (4, 16)]:
            table = schedule.build(name, p, CHUNKS[name], m)
            prog = schedule.lower(table)
            assert prog.n_tape == max(table.in_flight()) >= prog.n_stash
            assert (prog.n_dys == 1) == (name not in ("zb_h1", "zbv")) and prog.n_dys <= prog.n_tape
            assert all((prog.actions()[k] == table.chunks * m).all() for k in "FBW")  # every action its own tick
            sends = prog.sends()
            C = p * table.chunks
            assert sends["down"] + sends["up"] + sends["local"] == m * (C - 1) * 2 + m  # F and B hops, + loss grad
    assert schedule.lower(schedule.build("1f1b", 4, 1, 32)).n_inbox == 2


@pytest.mark.parametrize("fields,match", [
    (["parallel.schedule=pipedream"], r"parallel.schedule = 'pipedream': not a pipeline schedule.*Fix: use one of"),
    (["parallel.schedule=1f1b", "parallel.pipe=1"], r"parallel.schedule = '1f1b': .*pipe >= 2"),
    (["parallel.schedule=zbv", "parallel.pipe=2", "parallel.microbatches=2"], r"parallel.repeats = 1: zbv places "
     r"exactly 2 chunks.*Fix: set parallel.repeats=2"),
    (["parallel.schedule=1f1b", "parallel.pipe=2", "parallel.repeats=2", "parallel.microbatches=2"],
     r"parallel.repeats = 2: 1f1b runs one chunk per stage"),
    (["parallel.schedule=interleaved_1f1b", "parallel.pipe=2", "parallel.microbatches=2"],
     r"parallel.repeats = 1: interleaved_1f1b interleaves >= 2 chunks"),
])
def test_schedule_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.n_layers=8", "model.n_heads=4"] + fields)


# ---------------------------------------------------------------------------------------------------------------------
# The executor against the sequential reference.

LLAMA = dict(vocab_size=263, d_model=20, n_layers=24, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=28, max_seq_len=8,
             scan_unroll=1, init_std=0.1, qk_norm=True)  # with Qwen3's q/k norm
GPT2 = dict(LLAMA, family="gpt2", n_kv_heads=4, tie_embeddings=True, qk_norm=False)
B, T = 64, 8


def run(cfg, params, batch, *, name, remat="none", grad_accum=1, **layout):
    return on_layout(cfg, params, batch, ParallelConfig(schedule=name, **layout), remat=remat, grad_accum=grad_accum)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def reference(request):
    cfg = ModelConfig(**(LLAMA if request.param == "llama" else GPT2))
    batch = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    return (cfg, batch, *single_device(cfg, batch))


SHAPES = {  # (pipe, chunks, microbatches): m = p = 2 (the fewest: warm-up and cool-down only) and p = 4, m = 4p
    # (a steady state); 3 chunks. (p = 4, m = p ran too until it was cut for CI time: the same warm-up/cool-down
    # table as p = 2 with more stages, which the executor runs by the same code.)
    "gpipe": [(2, 1, 2), (4, 1, 16)],
    "1f1b": [(2, 1, 2), (4, 1, 16)],
    "interleaved_1f1b": [(2, 2, 2), (2, 3, 4), (4, 2, 16)],
    "zb_h1": [(2, 1, 2), (4, 1, 16)],
    "zbv": [(2, 2, 2), (4, 2, 16)],
}  # the tables at every shape between are checked without a compile (test_tables_are_complete_causal_…)


@pytest.mark.parametrize("name,pipe,chunks,microbatches",
                         [(n, *s) for n in TABLES for s in SHAPES[n]], ids=lambda x: str(x))
def test_schedule_matches_reference(reference, name, pipe, chunks, microbatches):
    cfg, batch, params, want_loss, want_grads = reference
    if cfg.family == "gpt2" and ((pipe, microbatches) != (4, 16) or name in ("gpipe", "zb_h1")):
        pytest.skip("gpt2 (the tied head) runs one shape of 1f1b, interleaved_1f1b and zbv")
    loss, grads = run(cfg, params, batch, name=name, data=8 // pipe, pipe=pipe, tensor=1, repeats=chunks,
                      microbatches=microbatches)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


@pytest.mark.parametrize("name,sequence", [("1f1b", False), ("1f1b", True), ("interleaved_1f1b", False),
                                           ("zb_h1", True), ("zbv", False), ("zbv", True)],
                         ids=lambda x: {False: "tp", True: "tp+sp"}.get(x, x))
def test_schedule_with_tensor_and_data_matches_reference(reference, name, sequence):
    """(data, pipe, tensor) = (2, 2, 2): Megatron TP (and SP) collectives inside the executor's switch branches —
    fused B (1f1b, interleaved) and split B/W (zb_h1, zbv: under SP the W replays the input's re-gather). The
    branches run the same chunk code whatever the table, so gpipe's table adds nothing here."""
    cfg, batch, params, want_loss, want_grads = reference
    if cfg.family == "gpt2" and (sequence or name != "zbv"):
        pytest.skip("gpt2 runs TP without SP, on ZB-V (embedding and tied head on one stage)")
    loss, grads = run(cfg, params, batch, name=name, data=2, pipe=2, tensor=2, repeats=CHUNKS[name],
                      microbatches=4, sequence_parallel=sequence)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


@pytest.mark.parametrize("name,remat,zero,grad_accum", [("1f1b", "full", 3, 1), ("zbv", "dots", 3, 1),
                                                         ("zb_h1", "selective", 0, 1), ("zbv", "none", 0, 2)])
def test_schedule_with_remat_zero_and_accumulation_matches_reference(reference, name, remat, zero, grad_accum):
    """Remat policies inside the chunk's vjp (full, dots, and Megatron's selective: the named activations saved),
    ZeRO-3's gathered parameters and reduce-scattered gradients, and gradient accumulation (the executor runs once
    per accumulation chunk)."""
    cfg, batch, params, want_loss, want_grads = reference
    if cfg.family == "gpt2":
        pytest.skip("remat, ZeRO and accumulation do not depend on the family")
    loss, grads = run(cfg, params, batch, name=name, data=4, pipe=2, tensor=1, repeats=CHUNKS[name],
                      microbatches=4, remat=remat, zero=zero, grad_accum=grad_accum)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


# ---------------------------------------------------------------------------------------------------------------------
# The compiled program: executed FLOPs per stage, bytes sent.

SMALL = ["model.vocab_size=263", "model.d_model=20", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=6", "model.d_ff=28", "model.max_seq_len=8", "train.seq_len=8", "train.batch_size=32",
         "parallel.tensor=1"]


@pytest.mark.parametrize("name,pipe,chunks,microbatches", [("1f1b", 2, 1, 4), ("interleaved_1f1b", 4, 2, 8),
                                                           ("zbv", 4, 2, 8)])
def test_executed_flops_and_bytes_follow_the_table(name, pipe, chunks, microbatches):
    """Each stage runs only its own actions' branches: the FLOPs of each branch (from the compiled program) times
    the table's counts, summed over the stages, are exactly the plain step's matmul FLOPs on the same rows, and far
    below every branch on every tick (what a masked step would pay). A split B and W share the backward's work:
    B + W = BW, W is the chunk's weight gradients (= the forward's weight matmuls) and B the rest. Collective-permute
    bytes: one message per tick in each direction the table uses."""
    from jaxpar.analysis.report import analyze

    layout = [f"parallel.pipe={pipe}", f"parallel.repeats={chunks}", f"parallel.microbatches={microbatches}",
              f"parallel.schedule={name}", f"parallel.data={8 // pipe}"]
    report_config = load_config(None, SMALL + layout)
    report = analyze(report_config, activations=False)
    flat = analyze(load_config(None, SMALL + [f"parallel.data={8 // pipe}"]), devices=jax.devices()[:8 // pipe],
                   activations=False)
    sc, fl = report["schedule"], report["schedule"]["flops"]
    table = schedule.build(name, pipe, chunks, microbatches)
    assert sc["ticks"] == table.n_ticks and sc["bubble_fraction"] == pytest.approx(sc["bubble_formula"])
    print(f"{name}: per stage {sc['executed_flops_per_stage']}, branches {fl['branches']}, plain "
          f"{flat['flops']['dot_flops']}, bubble: table {sc['bubble_fraction']:.4f}, executed layers "
          f"{sc['bubble_layers']:.4f}, with head {sc['bubble_executed']:.4f}")
    assert sum(sc["executed_flops_per_stage"]) == pytest.approx(flat["flops"]["dot_flops"], rel=1e-9)
    f, b, w = (fl["branches"][k] for k in "FBW")
    assert fl["branches"]["idle"] == 0
    # W: the forward's weight matmuls once more (xᵀ·dy for each); B: the rest of the backward — the input
    # gradients (as many FLOPs again) and the attention's backward (twice its forward)
    layer = layer_forward_flops(report_config.model, keys=report_config.train.seq_len)  # XLA: the whole T × T
    assert w == pytest.approx(f * layer.dense / (layer.dense + layer.attention), rel=1e-9)
    assert b == pytest.approx(f * (layer.dense + 2 * layer.attention) / (layer.dense + layer.attention), rel=1e-9)
    assert max(sc["executed_flops_per_stage"]) < 0.5 * fl["all_branches_every_tick"]
    assert sc["permute_bytes"] == pytest.approx(sc["expected_permute_bytes"], rel=1e-9)
    # each tick's messages are loop-carried: read by the next tick only, so they can overlap the next tick's compute
    carried = sc["permutes_loop_carried"]
    assert len(carried) == (sc["messages"]["down"] > 0) + (sc["messages"]["up"] > 0) and all(carried.values()), carried
    # the last chunk's stage also runs the head and loss: the imbalance it costs, measured
    assert fl["head_and_loss"] > 0


def test_the_stash_keeps_no_compute_dtype_copy_of_the_weights():
    """In bf16 every matmul reads a bf16 cast of its float32 weight. Cast inside the chunk, that cast would be a
    residual of F's vjp — a copy of the chunk's weights in every in-flight microbatch's stash; the executor casts
    once a tick (`Einsum.operand`) and B takes it from the live parameters. On a model whose weights outweigh a
    microbatch's activations, the bf16 step's temporaries are then no larger than the float32 step's (before:
    5.47 MB against 3.83)."""
    from jaxpar.train import build_trainer

    def temp(dtype):
        config = load_config(None, [
            "model.vocab_size=263", "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
            "model.head_dim=16", "model.d_ff=512", "model.max_seq_len=8", "train.seq_len=8", "train.batch_size=8",
            "parallel.data=4", "parallel.pipe=2", "parallel.tensor=1", "parallel.repeats=1",
            "parallel.microbatches=2", "parallel.schedule=gpipe", f"model.dtype={dtype}"]).resolve_for_devices(8)
        trainer = build_trainer(config, jax.devices(), abstract=True)
        rows = jax.ShapeDtypeStruct((8, 9), jnp.int32, sharding=trainer.plan.batch_sharding)
        return trainer.train_step.lower(trainer.state, rows).compile().memory_analysis().temp_size_in_bytes

    assert temp("bfloat16") <= temp("float32")


@pytest.mark.parametrize("name", ["zbv"])
def test_twenty_steps_under_a_schedule_track_single_device_loss_curve(tmp_path, name):
    """`fit` at the demo layout (data, pipe, tensor) = (2, 2, 2), 4 microbatches, under the schedule: the same
    losses as one device, step by step."""
    from jaxpar.train import fit

    base = ["model.d_model=48", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "train.steps=20",
            "train.batch_size=16", "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=5",
            "train.eval_batches=1"]
    single = load_config("configs/tiny.py", base + ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1",
                                                    "parallel.repeats=1", "parallel.microbatches=1"])
    layout = load_config("configs/tiny.py", base + [f"parallel.schedule={name}", f"parallel.repeats={CHUNKS[name]}"])
    want = [r["loss"] for r in fit(single, tmp_path / "one", devices=jax.devices()[:1], progress=False).history]
    got = [r["loss"] for r in fit(layout, tmp_path / "many", progress=False).history]
    assert len(got) == len(want) == 20 and want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-4)
