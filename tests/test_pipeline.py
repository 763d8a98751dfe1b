"""The circular pipeline against the plain sequential model: loss and every gradient, and its schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import hlo
from jaxpar.analysis.report import analyze
from jaxpar.config import ConfigError, ModelConfig, ParallelConfig, load_config
from jaxpar.parallel import circular, pipeline
from jaxpar.train import build_trainer, fit

from _parity import assert_grads_match, exactly_zero, on_layout, single_device

LLAMA = dict(vocab_size=263, d_model=20, n_layers=24, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=28, max_seq_len=8,
             init_std=0.1, qk_norm=True)  # with Qwen3's q/k norm (the llama family's only per-head parameters)
GPT2 = dict(LLAMA, family="gpt2", n_kv_heads=4, tie_embeddings=True, qk_norm=False)
B, T = 48, 8


def pipelined(cfg, params, batch, data, pipe, tensor, repeats, microbatches, sequence=False, remat="none",
              overlap="none", skip_bubble=False):
    parallel = ParallelConfig(data=data, pipe=pipe, tensor=tensor, repeats=repeats, microbatches=microbatches,
                              sequence_parallel=sequence, overlap=overlap, skip_bubble=skip_bubble)
    return on_layout(cfg, params, batch, parallel, remat=remat)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def family_reference(request):
    cfg = ModelConfig(**(LLAMA if request.param == "llama" else GPT2))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    return (cfg, batch, *single_device(cfg, batch))


@pytest.mark.parametrize("pipe,repeats,microbatches,skip", [(2, 1, 2, False), (2, 2, 4, False), (4, 1, 4, False),
                                                            (4, 2, 8, False), (2, 3, 6, True), (4, 1, 8, True)])
def test_pipeline_matches_reference(family_reference, pipe, repeats, microbatches, skip):
    """Loss and every gradient under the circular pipeline (skip: `parallel.skip_bubble`) equal one device's."""
    cfg, batch, params, want_loss, want_grads = family_reference
    if cfg.family == "gpt2" and (pipe, repeats, microbatches) not in [(2, 2, 4), (4, 1, 8)]:
        pytest.skip("gpt2 runs two shapes (its own parts — learned positions, the tied embedding and head on every "
                    "stage — do not depend on the schedule's shape), one with the bubble skipped")
    loss, grads = pipelined(cfg, params, batch, 8 // pipe, pipe, 1, repeats, microbatches, skip_bubble=skip)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


@pytest.mark.parametrize("mode", ["tp", "tp+sp", "tp+sp+cm"])
def test_pipeline_with_tensor_and_data_matches_reference(family_reference, mode):
    """(data, pipe, tensor) = (2, 2, 2): Megatron TP, with SP, and with SP's collectives as collective matmuls
    (llama) inside the circular pipeline's loop."""
    cfg, batch, params, want_loss, want_grads = family_reference
    if mode == "tp+sp+cm" and cfg.family != "llama":
        pytest.skip("collective matmul in the pipeline: the llama model")
    loss, grads = pipelined(cfg, params, batch, 2, 2, 2, 2, 4, mode != "tp",
                            overlap="collective_matmul" if mode == "tp+sp+cm" else "none")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


@pytest.mark.parametrize("remat", ["full", "dots", "selective"])
def test_pipeline_with_remat_matches_reference(family_reference, remat):
    """Each stage iteration recomputes its layers in the backward pass (the `parallel.remat` policy per layer);
    Megatron's selective policy (the named linear-layer activations saved, the core attention recomputed) under
    tensor parallelism in the loop, on one family (its names are the same in every family's blocks)."""
    cfg, batch, params, want_loss, want_grads = family_reference
    if remat == "selective" and cfg.family != "llama":
        pytest.skip("the selective policy's names do not depend on the family")
    loss, grads = pipelined(cfg, params, batch, 2, 2, 2, 2, 4, remat=remat)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads, zero=exactly_zero(cfg))


def test_schedule_counts():
    for p, v, m in [(2, 1, 2), (4, 2, 8), (3, 2, 9)]:
        table = circular.schedule(p, v, m)
        assert len(table) == v * m + p - 1
        busy = sum(slot is not None for row in table for slot in row)
        assert busy == p * v * m  # every stage runs every (microbatch, pass) exactly once
        assert 1 - busy / (p * len(table)) == pytest.approx(pipeline.bubble_fraction(p, v, m))
        for s in range(p):  # a stage sees each microbatch's passes in order, one iteration after the previous stage
            runs = [(t, c) for t, row in enumerate(table) if (c := row[s]) is not None]
            assert [c for _, c in runs] == [circular.Slot(j, r) for r in range(v) for j in range(m)]
            assert runs[0][0] == s


@pytest.mark.parametrize("pipe,repeats,microbatches", [(2, 1, 2), (2, 2, 2), (2, 3, 4), (4, 2, 8)])
def test_circular_runs_each_microbatch_through_every_layer_in_order(pipe, repeats, microbatches):
    """`circular` itself, on labels: the stage of pass r on stage s appends digit r·p + s + 1 (base 9) to what it is
    given, so a finished microbatch j reads j, 1, 2, …, p·v — every layer once, in model order — and sits in the io
    slot `output_order` names (the loss pairs it with j's targets). Covers p = m (no park) and m > p (park)."""
    p, v, m = pipe, repeats, microbatches
    mb = 3
    mesh = jax.make_mesh((p,), ("pipe",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:p])
    labels = jnp.arange(1, p * v + 1, dtype=jnp.int32).reshape(v, p).T  # [p, v]: stage s, pass r -> r·p + s + 1
    inputs = jnp.repeat(jnp.arange(m, dtype=jnp.int32)[:, None], mb, 1)  # [m, mb]: stage s starts with s·q … s·q+q−1

    def run(labels, io):  # local labels [1, v], io [q, mb]
        return circular.circular(lambda label, x: x * 9 + label, labels[0], io, stages=p, repeats=v, microbatches=m)

    out = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P("pipe"), P("pipe")), out_specs=P("pipe"),
                                check_vma=True))(labels, inputs)
    held = circular.output_order(p, v, m).reshape(-1)  # [p·q] in stage-major order, like out's rows
    layers = sum((n + 1) * 9 ** (p * v - 1 - n) for n in range(p * v))  # digits 1 … p·v
    np.testing.assert_array_equal(np.asarray(out), np.repeat((held * 9 ** (p * v) + layers)[:, None], mb, 1))


@pytest.mark.parametrize("skip", [True, False])
def test_bubble_iterations_skip_the_stage_work(skip):
    """With skip_bubble stage s runs its layers only at the iterations that hold a real microbatch (0 ≤ t − s < v·m):
    in its p − 1 bubble iterations it takes a branch that returns zeros, so on devices that share cores — simulated
    CPU devices — the bubble costs no compute. Without (the default) every iteration runs them."""
    p, v, m = 2, 2, 4
    calls = []
    mesh = jax.make_mesh((p,), ("pipe",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:p])

    def stage(label, x):
        jax.debug.callback(lambda s: calls.append(int(s)), jax.lax.axis_index("pipe"))
        return x * 9 + label

    def run(labels, io):
        return circular.circular(stage, labels[0], io, stages=p, repeats=v, microbatches=m, skip_bubble=skip)

    labels = jnp.arange(1, p * v + 1, dtype=jnp.int32).reshape(v, p).T
    inputs = jnp.repeat(jnp.arange(m, dtype=jnp.int32)[:, None], 3, 1)
    out = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P("pipe"), P("pipe")), out_specs=P("pipe"),
                                check_vma=True))(labels, inputs)
    jax.block_until_ready(out)
    jax.effects_barrier()
    per_stage = v * m if skip else pipeline.iterations(p, v, m)
    assert sorted(calls) == [s for s in range(p) for _ in range(per_stage)]


def test_pipeline_order_puts_each_stage_layers_contiguous():
    order = pipeline.pipeline_order(8, 2, 2)  # k = 2: stage 0 runs layers 0,1 (pass 0) and 4,5 (pass 1)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_config_errors_for_pipeline():
    base = ["model.n_layers=8", "model.n_heads=4", "parallel.pipe=2"]
    with pytest.raises(ConfigError, match="parallel.microbatches.*>= parallel.pipe"):
        load_config(None, base + ["parallel.microbatches=1"])
    with pytest.raises(ConfigError, match=r"parallel.microbatches = 3.*Fix: use microbatches 2 or 4"):
        load_config(None, base + ["parallel.microbatches=3"])
    with pytest.raises(ConfigError, match=r"model.n_layers = 8.*pipe \* parallel.repeats = 2\*3"):
        load_config(None, base + ["parallel.repeats=3", "parallel.microbatches=2"])
    with pytest.raises(ConfigError, match="train.batch_size"):  # 30 rows do not split into data 4 x 4 microbatches
        load_config(None, base + ["parallel.microbatches=4", "train.batch_size=30", "parallel.data=4"]
                    ).resolve_for_devices(8)
    with pytest.raises(ConfigError, match="parallel.repeats"):
        load_config(None, ["parallel.repeats=2"])


# ---------------------------------------------------------------------------------------------------------------------
# The compiled step and the loop.

PIPE_SMALL = ["model.vocab_size=263", "model.d_model=20", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
              "model.head_dim=6", "model.d_ff=28", "model.max_seq_len=8", "train.seq_len=8", "train.batch_size=32"]


@pytest.mark.parametrize("pipe,repeats,microbatches", [(2, 1, 2), (2, 2, 4), (4, 2, 8), (4, 1, 4)])
def test_executed_flops_within_bubble_formula(pipe, repeats, microbatches):
    """Executed / useful matmul FLOPs (loop trip counts applied, no remat) stay within the circular schedule's
    (v·m + p − 1)/(v·m); the embedding and LM head run once per row, on each stage's own rows (the expected count
    takes them at b/p rows per device — were the head run on all b rows, the measurement would miss it)."""
    config = load_config(None, PIPE_SMALL + [f"parallel.pipe={pipe}", f"parallel.repeats={repeats}",
                                             f"parallel.microbatches={microbatches}", "parallel.tensor=1"])
    report = analyze(config, activations=False)
    pp = report["pipeline"]
    assert pp["iterations"] == repeats * microbatches + pipe - 1
    assert pp["executed_over_useful_flops"] <= pp["executed_over_useful_flops_layers_formula"] * 1.02
    assert report["ratio"]["flops"] == pytest.approx(1.0, rel=5e-3)
    c = report["config"]
    rows_elsewhere = (pipe - 1) * c["batch_per_data_shard"] // pipe  # the rows the other stages embed and score
    head_all_rows = report["expected"]["flops"]["executed"] + 3 * rows_elsewhere * c["seq_len"] * 2 * c["d_model"] * \
        c["padded_vocab"]
    assert report["flops"]["dot_flops"] < 0.98 * head_all_rows
    assert pp["permute_bytes_per_iteration"] == pytest.approx(pp["expected_permute_bytes_per_iteration"], rel=1e-6)


def test_twenty_steps_track_single_device_loss_curve(tmp_path):
    base = ["model.d_model=48", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "train.steps=20",
            "train.batch_size=16", "train.seq_len=32", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=5",
            "train.eval_batches=1"]
    single = load_config("configs/tiny.py", base + ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1",
                                                    "parallel.repeats=1", "parallel.microbatches=1"])
    layout = load_config("configs/tiny.py", base)  # (data, pipe, tensor) = (2, 2, 2), 2 repeats, 4 microbatches
    want = [r["loss"] for r in fit(single, tmp_path / "one", devices=jax.devices()[:1], progress=False).history]
    got = [r["loss"] for r in fit(layout, tmp_path / "many", progress=False).history]
    assert len(got) == len(want) == 20 and want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def compiled_step(config):
    """The train step of `config` at its layout on the 8 devices, lowered and compiled from abstract state."""
    config = config.resolve_for_devices(8)
    trainer = build_trainer(config, jax.devices(), abstract=True)
    batch = jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), jnp.int32,
                                 sharding=trainer.plan.batch_sharding)
    return trainer.train_step.lower(trainer.state, batch).compile()


def test_compiled_step_does_not_grow_with_depth():
    """Layers are scanned within a stage: at the demo layout (2, 2, 2), 2 repeats, 4 microbatches, 8 and 32 layers
    compile to the same program — the same loops (the pipeline's v·m + p − 1 = 9 iterations and, inside, a scan over
    the stage's k = L/(p·v) layers, forward and backward), the same matmuls, the same size — except for the layer
    loops' trip count, 2 against 8. (Unrolled, the stack has no layer loops and 219 dots at 32 layers against 57 at
    8; at 4 layers k = 1 and XLA drops the one-trip loop.) Compile time against depth is a benchmark:
    `python -m bench`, section 3."""
    programs = {}
    for layers in (8, 32):  # one layer per scan iteration, as the trip counts below say (the default unrolls 4)
        compiled = compiled_step(load_config("configs/tiny.py", [f"model.n_layers={layers}", "model.d_model=32",
                                                                 "model.scan_unroll=1"]))
        prog = hlo.parse_hlo(compiled)
        programs[layers] = (sorted(hlo.loop_trip_counts(compiled).values()),
                            sum(ins.op == "dot" for instrs in prog.computations.values() for ins in instrs),
                            sum(map(len, prog.computations.values())))
    print(f"(trip counts, dots, instructions) by depth: {programs}")
    (trips8, dots8, size8), (trips32, dots32, size32) = programs[8], programs[32]
    assert trips8 == [2, 2, 9, 9] and trips32 == [8, 8, 9, 9], programs
    assert dots32 == dots8, programs
    assert size32 <= 1.01 * size8, programs
