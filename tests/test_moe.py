"""Mixture of experts (jaxpar.parallel.expert, jaxpar.model.moe): the block against a per-token loop, value and every
gradient, dropless and with capacity; dropped assignments against Σ_e max(0, load_e − C); the whole model at expert
1, 2, 4, 8 × tensor 1, 2, with and without the pipeline, against the single-device model; a mixed dense / MoE
stack likewise, its layer groups, its compile size against depth and its KV-cache decoding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig, MoEConfig, ParallelConfig
from jaxpar.model import Transformer, moe, moe_objective
from jaxpar.parallel.expert import capacity, route
from jaxpar.train.step import loss_and_grads

from _parity import assert_grads_match, on_layout, single_device

# Odd sizes: 5 experts of width 6 (top 2), a shared expert of width 10, d_model 12, 7-token rows.
D, X, K, FE, FS = 12, 5, 2, 6, 10


def _block_params(rng, shared: bool):
    shapes = dict(router=(D, X), we_gate=(X, D, FE), we_up=(X, D, FE), we_down=(X, FE, D))
    if shared:
        shapes.update(ws_gate=(D, FS), ws_up=(D, FS), ws_down=(FS, D), ws_score=(D,))
    return {name: jnp.asarray(rng.normal(0, 0.5, shape), jnp.float32) for name, shape in shapes.items()}


def _swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def loop_reference(p, h, m: MoEConfig, rows_weight: float):
    """The block written token by token: each token through its top-k experts, weighted; assignments over an
    expert's capacity skipped in GShard's order (all first choices of the row, then the second ones, each in token
    order). Returns (output [B, T, D], the aux-loss objective term, dropped count). The choices (which experts,
    which assignments fit) are made on concrete values first; the differentiable part recomputes the weights."""
    B, T, _ = h.shape
    logits = np.asarray(jnp.einsum("btd,dx->btx", h, p["router"]))
    C = math.ceil(m.capacity_factor * T * m.top_k / X) if m.capacity_factor else T * m.top_k
    choice = np.argsort(-logits, axis=-1, kind="stable")[..., :m.top_k]  # [B, T, k] (softmax keeps the order)
    kept, dropped = np.zeros(choice.shape, bool), 0
    for b in range(B):
        taken = np.zeros(X, int)
        for j in range(m.top_k):
            for t in range(T):
                e = choice[b, t, j]
                kept[b, t, j] = taken[e] < C
                dropped += not kept[b, t, j]
                taken[e] += 1

    def forward(p, h):
        out, aux, z = [], 0.0, 0.0
        for b in range(B):
            probs = jax.nn.softmax(h[b] @ p["router"], axis=-1)  # [T, X]
            rows = []
            for t in range(T):
                top = probs[t, choice[b, t]]
                gates = top / top.sum() if m.norm_topk_prob else top
                y = sum(gates[j] * _swiglu(h[b, t], p["we_gate"][e], p["we_up"][e], p["we_down"][e])
                        for j, e in enumerate(choice[b, t]) if kept[b, t, j])
                if "ws_gate" in p:
                    y = y + jax.nn.sigmoid(h[b, t] @ p["ws_score"]) * _swiglu(h[b, t], p["ws_gate"], p["ws_up"],
                                                                              p["ws_down"])
                rows.append(y)
            out.append(jnp.stack(rows))
            f = np.bincount(choice[b].ravel(), minlength=X) / (T * m.top_k)
            aux = aux + X * (f * probs.mean(0)).sum()
            z = z + (jax.nn.logsumexp(h[b] @ p["router"], axis=-1) ** 2).mean()
        return jnp.stack(out), rows_weight * (m.aux_loss_coef * aux + m.z_loss_coef * z)

    return forward, dropped


@pytest.mark.parametrize("capacity_factor,norm_topk,shared", [(0.0, True, False), (0.0, False, True),
                                                              (0.8, True, True)], ids=["dropless", "qwen", "capacity"])
def test_moe_block_matches_token_loop(capacity_factor, norm_topk, shared):
    """The block's output and the gradients of (Σ out·w + aux objective) w.r.t. the input and every parameter equal
    the per-token loop's (fp32, rtol 1e-5). With capacity 0.8 the row drops assignments; the count is checked too."""
    rng = np.random.default_rng(7)
    m = MoEConfig(n_experts=X, top_k=K, d_ff=FE, norm_topk_prob=norm_topk, capacity_factor=capacity_factor,
                  aux_loss_coef=0.3, z_loss_coef=0.05, shared_d_ff=FS if shared else 0, shared_gate=shared)
    cfg = ModelConfig(d_model=D, n_layers=3, n_heads=2, moe=m)
    p = _block_params(rng, shared)
    h = jnp.asarray(rng.normal(0, 1, (3, 7, D)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (3, 7, D)), jnp.float32)  # a random cotangent for the output
    forward, dropped = loop_reference(p, h, m, 1.0 / (h.shape[0] * cfg.n_layers))

    def want_fn(p, h):
        out, aux = forward(p, h)
        return (out * w).sum() + aux, out

    def got_fn(p, h):
        out, stats = moe(p, h, cfg)
        return (out * w).sum() + moe_objective(stats, cfg, h.shape[0]), out

    (_, want), want_grads = jax.value_and_grad(want_fn, argnums=(0, 1), has_aux=True)(p, h)
    (_, got), got_grads = jax.jit(jax.value_and_grad(got_fn, argnums=(0, 1), has_aux=True))(p, h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_match(got_grads[0], want_grads[0])
    np.testing.assert_allclose(got_grads[1], want_grads[1], rtol=1e-5, atol=1e-6 * np.abs(want_grads[1]).max())
    routing = route(jnp.einsum("btd,dx->btx", h, p["router"]), K, norm_topk, capacity_factor)
    assert int(routing.dropped) == dropped and (dropped > 0) == (capacity_factor > 0)


def test_dropped_assignments_follow_the_capacity_formula():
    """Under capacity, dropped = Σ_rows Σ_e max(0, load_e − C) with C = ceil(cf·T·k/X), for skewed and balanced
    routing, at several capacity factors; dropless drops nothing."""
    rng = np.random.default_rng(3)
    B, T = 6, 31
    skew = jnp.asarray(rng.normal(0, 1, (B, T, X)) + np.linspace(0, 3, X), jnp.float32)  # expert 4 is popular
    for logits in (skew, jnp.asarray(rng.normal(0, 1, (B, T, X)), jnp.float32)):
        for cf in (0.5, 1.0, 1.25, 2.0):
            C = capacity(T, K, X, cf)
            assert C == math.ceil(cf * T * K / X)
            r = route(logits, K, True, cf)
            formula = int(np.maximum(np.asarray(r.load) - C, 0).sum())
            assert int(r.dropped) == formula
            assert int(r.load.sum()) == B * T * K
        assert int(route(logits, K, True, 0.0).dropped) == 0
    assert int(route(skew, K, True, 1.0).dropped) > 0


# The whole model: llama with MoE layers (GQA 4:2, shared gated expert, z-loss), 8 experts so expert 8 holds one each.
MODEL = dict(vocab_size=131, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=24, max_seq_len=24,
             scan_unroll=1, init_std=0.1)
MOE = dict(n_experts=8, top_k=2, d_ff=10, shared_d_ff=12, shared_gate=True, aux_loss_coef=0.1, z_loss_coef=0.01)
B, T = 16, 12


# "mixed": 6 layers, dense at 0 and 3 (moe.dense_layers) — two stacks, scanned in periods (d, m, m); a two-stage
# pipeline's chunks are one period each.
MIXED = dict(n_layers=6), dict(dense_layers=(0, 3))


@pytest.fixture(scope="module", params=["dropless", "capacity", "mixed"])
def reference(request):
    cf = 1.0 if request.param == "capacity" else 0.0
    model, moe = MIXED if request.param == "mixed" else ({}, {})
    cfg = ModelConfig(**{**MODEL, **model}, moe=MoEConfig(**MOE, **moe, capacity_factor=cf))
    batch = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    params, loss, grads = single_device(cfg, batch)
    graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
    sums = jax.jit(loss_and_grads(graphdef, stats=True))(params, batch)[2]  # the routing statistics of the step
    return request.param, cfg, batch, params, loss, grads, sums


LAYOUTS = [  # (pipe, expert, tensor, microbatches, sequence_parallel, schedule); data fills the 8 devices
    (1, 1, 1, 1, False, ""), (1, 2, 1, 1, False, ""), (1, 4, 1, 1, False, ""), (1, 8, 1, 1, False, ""),
    (1, 1, 2, 1, False, ""), (1, 2, 2, 1, False, ""), (1, 4, 2, 1, False, ""), (1, 2, 2, 1, True, ""),
    (2, 2, 2, 2, False, "circular"), (2, 4, 1, 4, False, "circular-skip"),  # -skip: parallel.skip_bubble
    (2, 2, 2, 2, True, "circular"), (2, 2, 2, 2, False, "1f1b"),
    (2, 2, 1, 4, False, "zbv"), (2, 1, 2, 4, True, "zb_h1")]


# (pipe, expert, tensor, sequence_parallel, schedule) of LAYOUTS the capacity model runs: 7 of the 14 (all 14 pass,
# measured 2026-12-04: the other seven add ~50 s of CPU time and no code path these do not take).
CAPACITY_LAYOUTS = [(1, 8, 1, False, ""), (1, 4, 2, False, ""), (1, 2, 2, True, ""), (2, 2, 2, True, "circular"),
                    (2, 2, 2, False, "1f1b"), (2, 2, 1, False, "zbv"), (2, 1, 2, True, "zb_h1")]


@pytest.mark.parametrize("pipe,expert,tensor,microbatches,sp,schedule", LAYOUTS, ids=lambda x: str(x))
def test_moe_model_matches_reference(reference, pipe, expert, tensor, microbatches, sp, schedule):
    """Loss and every gradient of the MoE model on (data, pipe, expert, tensor) ± sequence parallelism, under the
    circular pipeline (once skipping its bubble) and the schedule tables (B/W split at the experts' group), equal the
    single-device model's."""
    name, cfg, batch, params, want_loss, want_grads, want_sums = reference
    if name == "capacity" and (pipe, expert, tensor, sp, schedule) not in CAPACITY_LAYOUTS:
        pytest.skip("capacity runs seven layouts (the dispatch code is the dropless one with a smaller chunk; SP's "
                    "capacity places across shards, expert × tensor, the pipeline and the schedule tables' B/W "
                    "replay of the drops are the new parts)")
    if name == "mixed" and (pipe, expert, tensor, sp, schedule) not in [
            (1, 8, 1, False, ""), (2, 2, 2, False, "circular"), (2, 1, 2, True, "zb_h1")]:
        pytest.skip("the mixed stack runs three layouts (its new parts: two stacks, each in pipeline order, and a "
                    "period per scan step, under autodiff and under the schedule tables' tape)")
    parallel = ParallelConfig(pipe=pipe, expert=expert, tensor=tensor, microbatches=microbatches,
                              sequence_parallel=sp, schedule=(schedule or "circular").removesuffix("-skip"),
                              repeats=2 if schedule == "zbv" else 1, skip_bubble=schedule.endswith("-skip"))
    loss, grads, sums = on_layout(cfg, params, batch, parallel, stats=True)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)
    # The routing statistics the step reports, per MoE layer in model order [L_moe, …] (metrics.jsonl logs their
    # sums), under autodiff, the circular pipeline and the schedule tables alike: each layer's per-expert load and
    # dropped count exactly, its aux and z sums to rounding.
    assert sums["load"].shape == want_sums["load"].shape == (cfg.moe_layer_count, MOE["n_experts"])
    np.testing.assert_array_equal(sums["load"], want_sums["load"])
    np.testing.assert_array_equal(sums["dropped"], want_sums["dropped"])
    np.testing.assert_allclose([sums["aux"], sums["z"]], [want_sums["aux"], want_sums["z"]], rtol=1e-5)


@pytest.mark.parametrize("layout", ["parallel.expert=4 parallel.tensor=2 moe.capacity_factor=1.0",
                                    "parallel.expert=8",
                                    "parallel.expert=2 parallel.pipe=2 parallel.tensor=2 parallel.microbatches=2 "
                                    "parallel.sequence_parallel=true moe.capacity_factor=1.0 moe.sparse_step=2"])
def test_expert_bytes_follow_the_formula(layout):
    """From the compiled train step: all-to-all bytes on `expert` = `expected.expert_bytes` (dispatch + combine,
    forward and backward, plus the counts) exactly; with cf = 1 and T·k/X whole, the row bytes are DESIGN's
    2·(ep−1)/ep·N·k·h·β each way; tensor-axis bytes = Megatron's count plus the shared expert's region and the
    routing's (the gates' gradient all-reduce; under SP the row statistics and the routing's gathers). `jaxpar
    analyze` reports the same section. The last layout mixes dense and MoE layers (sparse_step 2): only its MoE
    layers' applications count."""
    from jaxpar.planner import expected
    from jaxpar.analysis.report import analyze, format_table
    from jaxpar.config import load_config

    fields = [f"model.{k}={v}" for k, v in MODEL.items() if k not in ("scan_unroll", "init_std")]
    fields += [f"moe.{k}={v}" for k, v in MOE.items()]
    config = load_config(None, fields + ["model.vocab_size=263", "train.seq_len=12", "train.batch_size=16"]
                         + layout.split())
    report = analyze(config, activations=False)
    ex = report["expert"]
    assert ex["sent_bytes"] == ex["expected_sent_bytes"] > 0
    if config.parallel.tensor > 1:  # the shared expert's and the routing's tensor traffic (expected.moe_tensor_bytes)
        assert report["ratio"]["tensor_sent_bytes"] == pytest.approx(1.0)
    if config.moe.capacity_factor == 1.0:  # the rows are exactly the formula; the int32 counts come beside them
        want = expected.expert_bytes(config.resolve_for_devices(8))
        assert want["rows"] == want["balanced"] and want["total"] == want["rows"] + want["counts"]
    assert "expert ep=" in format_table(report)


@pytest.mark.parametrize("mixed", [{}, dict(dense_layers=(0, 2))])
def test_flops_count_active_parameters(mixed):
    """FLOPs per token count the active parameters: 6·N_active + attention, where N_active holds the router, k of
    the X experts and the shared expert (the MoE holds X/k times the routed experts' weights); in a mixed stack the
    dense layers' MLPs whole."""
    from jaxpar import flops
    from jaxpar.model import count_params

    cfg = ModelConfig(**MODEL, moe=MoEConfig(**MOE, **mixed))
    m, L, h = cfg.moe, cfg.n_layers, cfg.d_model
    experts = cfg.moe_layer_count * m.n_experts * 3 * h * m.d_ff
    active = count_params(cfg) - experts * (m.n_experts - m.top_k) / m.n_experts
    norms = L * 2 * h + h  # no matmul FLOPs
    fwd = flops.forward_flops_per_token(cfg, 12, keys=0.0)
    assert fwd.total == pytest.approx(2 * (active - norms - cfg.vocab_size * h))  # the embedding is a lookup
    dense = ModelConfig(**MODEL)
    assert flops.forward_flops_per_token(dense, 12).attention == flops.forward_flops_per_token(cfg, 12).attention


def test_fit_logs_expert_load_and_its_checkpoint_restores_anywhere(tmp_path):
    """`fit` of a mixed dense / MoE stack on (pipe, expert, tensor) = (2, 2, 2) logs the MoE statistics: per-expert
    load over every row and MoE layer (summing to batch·seq_len·k·L_moe assignments), its imbalance max/mean, the
    dropped share (0 dropless) and the aux and z-losses, in metrics.jsonl; its checkpoint (both stacks in model
    order) restores at (data, expert) = (2, 4) bit for bit."""
    import json

    from jaxpar.config import load_config
    from jaxpar.train import fit

    overrides = ["moe.n_experts=4", "moe.top_k=2", "moe.d_ff=16", "model.d_model=24", "model.n_heads=2",
                 "moe.sparse_step=2", "parallel.repeats=1",  # a mixed stack: layers 1, 3 MoE; chunks (dense, MoE)
                 "model.n_kv_heads=2", "model.n_layers=4", "parallel.expert=2", "train.batch_size=8",
                 "train.seq_len=16", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                 "train.eval_batches=1", "data.source=synthetic"]
    config = load_config("configs/moe_tiny.py", overrides)
    result = fit(config, tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        load = np.array(r["moe_load"])
        assert load.shape == (4,) and load.sum() == 8 * 16 * 2 * 2  # rows · tokens · k · MoE layers
        assert r["moe_imbalance"] == pytest.approx(load.max() / load.mean()) and r["moe_imbalance"] >= 1
        assert r["moe_dropped"] == 0.0 and r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
    # The checkpoint is canonical ([layers, experts, …] in model order): it restores bit for bit onto another expert,
    # tensor and pipe layout — parameters, both Adam moments and the step.
    from test_checkpoint import assert_states_equal, canonical_state

    from jaxpar.store import checkpoint
    from jaxpar.train import build_trainer

    other = load_config("configs/moe_tiny.py", overrides + ["parallel.expert=4", "parallel.tensor=1",
                                                            "parallel.pipe=1", "parallel.repeats=1",
                                                            "parallel.microbatches=1"]).resolve_for_devices(8)
    like = build_trainer(other, jax.devices(), abstract=True)
    mngr = checkpoint.manager(tmp_path)
    try:
        state, _ = checkpoint.restore_train(mngr, like.state, like.shardings, like.plan, other.model.vocab_size)
    finally:
        mngr.close()
    assert_states_equal(canonical_state(state, other, like.mesh),
                        canonical_state(result.state, result.config, result.mesh))


def test_moe_with_zero3_remat_and_accumulation_matches_reference(reference):
    """ZeRO-3 (parameters split over `data` too, the experts' gradients reduce-scattered after their division by
    ep), full remat and gradient accumulation at (data, expert, tensor) = (2, 2, 2): loss and every gradient equal
    the single-device model's (the mixed stack: remat checkpoints each layer of a period)."""
    name, cfg, batch, params, want_loss, want_grads, _ = reference
    if name == "capacity":
        pytest.skip("the dropless model covers the reductions")
    parallel = ParallelConfig(expert=2, tensor=2, zero=3, remat="full")
    loss, grads = on_layout(cfg, params, batch, parallel, remat="full", grad_accum=2)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


def test_layer_groups_cut_a_pattern_into_periodic_scans():
    """Mixed stacks scan in groups of one period: the cut minimises the layers the program holds, then the groups."""
    from jaxpar.model import layer_groups

    assert layer_groups(("m",) * 5) == [(("m",), 5)]
    assert layer_groups(("d", "m") * 3) == [(("d", "m"), 3)]  # Qwen2-MoE's decoder_sparse_step 2
    assert layer_groups(("d",) * 2 + ("m",) * 5) == [(("d",), 2), (("m",), 5)]  # DeepSeek's first dense layers
    assert layer_groups(("d", "m", "m") * 2) == [(("d", "m", "m"), 2)]
    assert layer_groups(("d", "d", "d", "m"), single=True) == [(("d", "d", "d", "m"), 1)]  # a pipeline chunk
    assert layer_groups(("d", "m", "d", "m"), single=True) == [(("d", "m"), 2)]


@pytest.mark.parametrize("moe_fields", [dict(dense_layers=(0, 1))])
def test_mixed_stack_matches_a_layer_loop_compiles_flat_and_decodes(moe_fields):
    """A mixed stack in two groups (DeepSeek's first dense layers; the periodic decoder_sparse_step patterns run in
    the layout tests and the HF fixture): the scanned model's logits equal a plain loop over its layers in model
    order; its program holds as many matmuls at 7 as at 13 layers (compile size does not grow with depth);
    prefill + one KV-cache decode step equal the full forward."""
    from flax import nnx

    from jaxpar.model import KVCache, Transformer, block, default_positions

    def model(n_layers):
        fields = dict(MODEL, n_layers=n_layers, scan_unroll=1)
        return ModelConfig(**fields, moe=MoEConfig(**dict(MOE, shared_gate=False), **moe_fields))

    cfg = model(7)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)

    def forward(params, tokens):
        return nnx.merge(graphdef, params)(tokens)

    def loop(params, tokens):
        m = nnx.merge(graphdef, params)
        positions = default_positions(*tokens.shape)
        x, stacks, seen = m.embed_tokens(tokens, positions), m.stacks(), {name: 0 for name in cfg.layer_stacks}
        for name in cfg.layer_pattern:
            x = block({k: a[seen[name]] for k, a in stacks[name].items()}, x, positions, None, cfg)[0]
            seen[name] += 1
        return m.logits(x)

    def decode(params, tokens):
        m = nnx.merge(graphdef, params)
        cache = KVCache.empty(cfg, 2, 12)
        prefill, cache = m.decode(tokens[:, :-1], cache)
        return prefill, m.decode(tokens[:, -1:], cache)[0]

    logits = jax.jit(forward)(params, tokens)
    np.testing.assert_allclose(jax.jit(loop)(params, tokens), logits, rtol=1e-5, atol=1e-5)
    prefill, step = jax.jit(decode)(params, tokens)
    np.testing.assert_allclose(prefill, logits[:, :-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step[:, 0], logits[:, -1], rtol=1e-5, atol=1e-5)

    def matmuls(cfg):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        text = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, tokens).as_text()
        return text.count("dot_general") + text.count("ragged_dot")

    assert matmuls(cfg) == matmuls(model(13)) > 0
