"""DeepSeekMoE routing (jaxpar.parallel.expert.route / select) and auxiliary-loss-free balancing (the buffer
`e_score_correction_bias`, jaxpar.model.bias_update), on a llama-family MoE model — independent of the deepseek
family.

Routing against a NumPy transcription of Hugging Face's DeepSeek-V2 (softmax; greedy and group_limited_greedy) and
DeepSeek-V3 (sigmoid, noaux_tc: biased group-limited selection) routers, masked experts −inf where a 0 would pick a
dropped group's expert; the bias changes which experts, never the gates; the update rule on hand-made loads; and
the whole model with a non-zero bias at (data, expert, tensor + SP), the circular pipeline and a schedule table
against one device — loss, gradients, the step's global loads and the buffer after training, bit for bit — and a
checkpoint that restores the buffer bit for bit onto other layouts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import FIT_LAYOUTS, assert_grads_match, canonical_host, on_layout, restore_on
from jaxpar.config import ModelConfig, MoEConfig, ParallelConfig, load_config
from jaxpar.model import MODEL_STATE, Transformer, bias_update, buffers_of, trainable, update_buffers
from jaxpar.parallel.expert import route
from jaxpar.train import fit
from jaxpar.train.step import loss_and_grads

# ---------------------------------------------------------------------------------------------------------------------
# The reference: Hugging Face's routers (transformers 5.x DeepseekV2TopkRouter / DeepseekV3TopkRouter), in NumPy.


def _topk(a, k):
    """Indices of the k largest entries along the last axis (ties: the lower index, as a stable sort)."""
    return np.argsort(-a, axis=-1, kind="stable")[..., :k]


def _group_mask(group_scores, topk_group, per_group):
    """[N, G] group scores → [N, X] bool: the experts of each token's topk_group best groups."""
    mask = np.zeros(group_scores.shape, bool)
    np.put_along_axis(mask, _topk(group_scores, topk_group), True, axis=-1)
    return np.repeat(mask, per_group, axis=-1)


def hf_v2(logits, top_k, method, n_group, topk_group, scale):
    """DeepSeek-V2: softmax scores; 'greedy' top-k, or 'group_limited_greedy' (group score its max, others filled
    with 0.0); weights the chosen scores × routed_scaling_factor (transformers' V2 does not renormalise).
    → (idx, weights) [N, k]."""
    z = logits - logits.max(-1, keepdims=True)
    scores = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    if method == "group_limited_greedy":
        N, X = scores.shape
        groups = scores.reshape(N, n_group, X // n_group).max(-1)
        scores = np.where(_group_mask(groups, topk_group, X // n_group), scores, 0.0)
    idx = _topk(scores, top_k)
    return idx, np.take_along_axis(scores, idx, -1) * scale


def hf_v3(logits, bias, top_k, n_group, topk_group, norm, scale, fill=-np.inf):
    """DeepSeek-V3 (noaux_tc): sigmoid scores, chosen by scores + bias within the topk_group groups of best top-2
    biased sum (the rest filled with `fill`: −inf as transformers 5.x does); weights the *unbiased* scores,
    renormalised (+1e-20) when norm, × routed_scaling_factor. → (idx, weights) [N, k]."""
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    N, X = scores.shape
    groups = np.sort(choice.reshape(N, n_group, X // n_group), -1)[..., -2:].sum(-1)
    choice = np.where(_group_mask(groups, topk_group, X // n_group), choice, fill)
    idx = _topk(choice, top_k)
    w = np.take_along_axis(scores, idx, -1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * scale


def _by_expert(idx, w):
    """(experts, weights) of each token sorted by expert id (HF's topk is unsorted; the sum over choices is not)."""
    order = np.argsort(idx, -1)
    return np.take_along_axis(idx, order, -1), np.take_along_axis(w, order, -1)


def _ours(logits, bias=None, **kw):
    r = route(jnp.asarray(logits)[None], kw.pop("top_k"), kw.pop("norm"), 0.0, bias=bias, **kw)
    return np.asarray(r.experts[0]), np.asarray(r.gates[0])


N_TOK, X = 37, 12  # tokens, experts (4 groups of 3)


@pytest.mark.parametrize("case", ["v2-greedy", "v2-group-limited", "v3-biased", "v3-negative-bias"])
def test_route_matches_hugging_face_routers(case):
    """The experts (as a set) and their gates equal the reference's for every token, at fp32; V3 with a bias
    that changes the choice; with all biases negative, the experts of dropped groups stay out (−inf), where a 0
    fill (what transformers' V2 router uses; its V3 router masks with −inf) would choose them."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 1.5, (N_TOK, X)).astype(np.float32)
    if case.startswith("v2"):
        method = "greedy" if case == "v2-greedy" else "group_limited_greedy"
        groups = (1, 1) if method == "greedy" else (4, 2)
        want = hf_v2(logits, 3, method, *groups, 2.5)
        got = _ours(logits, top_k=3, norm=False, scoring="softmax", n_group=groups[0], topk_group=groups[1],
                    routed_scale=2.5)
    else:
        bias = rng.normal(0, 0.3, X).astype(np.float32) - (2.0 if case == "v3-negative-bias" else 0.0)
        want = hf_v3(logits, bias, 3, 4, 2, True, 2.5)
        got = _ours(logits, jnp.asarray(bias), top_k=3, norm=True, scoring="sigmoid", n_group=4, topk_group=2,
                    routed_scale=2.5)
        unbiased = hf_v3(logits, np.zeros_like(bias), 3, 4, 2, True, 2.5)[0]
        assert (np.sort(unbiased, -1) != np.sort(want[0], -1)).any()  # the bias changes which experts
        if case == "v3-negative-bias":
            zero_filled = hf_v3(logits, bias, 3, 4, 2, True, 2.5, fill=0.0)[0]
            assert (np.sort(zero_filled, -1) != np.sort(want[0], -1)).any()  # a 0 fill would go wrong here
            choice = 1 / (1 + np.exp(-logits)) + bias
            assert (choice < 0).all()  # every biased score is below the 0 a masked expert would get
            # our experts: all inside the groups of best top-2 biased sum
            groups = np.sort(choice.reshape(N_TOK, 4, 3), -1)[..., -2:].sum(-1)
            kept = _group_mask(groups, 2, 3)
            assert np.take_along_axis(kept, got[0], -1).all()
    got_idx, got_w = _by_expert(*got)
    want_idx, want_w = _by_expert(*want)
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6)


def test_gate_gradients_match_the_reference():
    """d(Σ c·gates)/d logits equals that of the reference gates (the chosen experts' sigmoid scores, renormalised
    with V3's 1e-20, × scale) at fp32 rtol 1e-5; the bias receives no gradient. Also the aux loss's P for sigmoid
    scores: the mean of σ_e / Σ_x σ_x."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(0, 1.5, (3, 7, X)), jnp.float32)  # B 3, T 7
    bias = jnp.asarray(rng.normal(0, 0.3, X), jnp.float32)
    c = jnp.asarray(rng.normal(size=(3, 7, 3)), jnp.float32)
    kw = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scale=2.5)
    idx = route(logits, 3, True, 0.0, **kw, bias=bias).experts

    def ours(logits, bias):
        r = route(logits, 3, True, 0.0, **kw, bias=bias)
        return (r.gates * c).sum() + r.aux

    def reference(logits):
        s = jax.nn.sigmoid(logits)
        g = jnp.take_along_axis(s, idx, -1)
        g = g / (g.sum(-1, keepdims=True) + 1e-20) * 2.5
        f = jax.nn.one_hot(idx, X).sum((1, 2)) / (7 * 3)  # [B, X]
        P = (s / s.sum(-1, keepdims=True)).mean(1)
        return (g * c).sum() + X * (f * P).sum()

    (d_logits, d_bias), want = jax.grad(ours, argnums=(0, 1))(logits, bias), jax.grad(reference)(logits)
    np.testing.assert_allclose(ours(logits, bias), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(d_logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(d_bias, 0.0)


def test_bias_changes_the_selection_never_the_gates():
    """A bias that lifts an expert into every token's top-k: it is chosen, and each token's gates are still its
    chosen experts' own scores (softmax probabilities; with norm_topk_prob their renormalised values)."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0, 1.0, (2, 9, 8)), jnp.float32)
    bias = jnp.zeros(8).at[5].set(10.0)
    for scoring in ("softmax", "sigmoid"):
        scores = jax.nn.softmax(logits, -1) if scoring == "softmax" else jax.nn.sigmoid(logits)
        plain = route(logits, 2, False, 0.0, scoring=scoring)
        biased = route(logits, 2, False, 0.0, scoring=scoring, bias=bias)
        assert (np.asarray(biased.experts) == 5).any(-1).all() and not (np.asarray(plain.experts) == 5).all()
        np.testing.assert_array_equal(biased.gates, jnp.take_along_axis(scores, biased.experts, -1))
        np.testing.assert_array_equal(biased.load.sum(0)[5], 2 * 9)
        normed = route(logits, 2, True, 0.0, scoring=scoring, bias=bias)
        g = jnp.take_along_axis(scores, normed.experts, -1)
        np.testing.assert_allclose(normed.gates, g / g.sum(-1, keepdims=True), rtol=1e-6)


def test_the_update_rule_on_hand_made_loads():
    """b ← b + γ·sign(mean load − load) per layer (an expert at the mean keeps its bias, a layer that routed
    nothing keeps all), then optionally minus its mean; through update_buffers on a model state, and only with
    moe.bias_update_rate > 0."""
    load = jnp.asarray([[6, 2, 4, 4], [0, 0, 0, 0], [1, 9, 3, 3]], jnp.int32)  # means 4, 0, 4
    bias = jnp.asarray([[0.5, 0.0, -0.25, 1.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    want = np.asarray([[0.5 - 0.125, 0.125, -0.25, 1.0], [0.1, 0.2, 0.3, 0.4], [0.125, -0.125, 0.125, 0.125]],
                      np.float32)
    np.testing.assert_array_equal(bias_update(bias, load, 0.125, False), want)
    np.testing.assert_allclose(bias_update(bias, load, 0.125, True), want - want.mean(-1, keepdims=True),
                               atol=1e-7)
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=3,
                      moe=MoEConfig(n_experts=4, top_k=2, d_ff=4, scoring="sigmoid", correction_bias=True,
                                    bias_update_rate=0.125))
    buffers = buffers_of(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), MODEL_STATE)[1])
    np.testing.assert_array_equal(buffers["blocks"]["e_score_correction_bias"][...], np.zeros((3, 4)))
    buffers["blocks"]["e_score_correction_bias"] = buffers["blocks"]["e_score_correction_bias"].replace(bias)
    new = update_buffers(buffers, {"load": load}, cfg)
    np.testing.assert_array_equal(new["blocks"]["e_score_correction_bias"][...], want)
    np.testing.assert_array_equal(buffers["blocks"]["e_score_correction_bias"][...], bias)  # the caller's kept
    frozen = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=0.0))
    np.testing.assert_array_equal(update_buffers(buffers, {"load": load}, frozen)["blocks"]["e_score_correction_bias"]
                                  [...], bias)


# ---------------------------------------------------------------------------------------------------------------------
# The model: a whole DeepSeek-V3-style model — latent attention (a query latent, odd sizes), a dense first layer, then
# four MoE layers with DeepSeek-V3 routing (8 experts in 4 groups, 2 groups a token, top 2, sigmoid, a non-zero bias)
# and a shared expert, and an MTP module (an MoE layer of its own). Under a pipeline the dense layer runs beside the
# embedding and the MTP module beside the head (ModelConfig.prefix_layers, MTP), the stages split the MoE layers.

ROUTING = dict(n_experts=8, top_k=2, d_ff=10, shared_d_ff=10, scoring="sigmoid", n_group=4, topk_group=2,
               routed_scale=2.5, correction_bias=True, aux_loss_coef=0.1)
MODEL = dict(family="deepseek", d_model=24, n_heads=4, n_layers=5, vocab_size=64, q_lora_rank=10, kv_lora_rank=7,
             qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, d_ff=14, rope_interleave=True, mtp_depth=1)
MTP_WEIGHT = 0.3
PARITY_LAYOUTS = {  # name: ParallelConfig fields (data fills the 8 devices)
    "(data, expert, tensor) = (2, 2, 2) SP, 2 micro-steps": dict(expert=2, tensor=2, sequence_parallel=True),
    "(data, pipe, expert, tensor) = (1, 2, 2, 2) circular": dict(pipe=2, expert=2, tensor=2, microbatches=4,
                                                                 repeats=2),
    "(data, pipe, tensor) = (2, 2, 2) ZB-V SP": dict(pipe=2, tensor=2, microbatches=4, repeats=2, schedule="zbv",
                                                     sequence_parallel=True),
}


@pytest.fixture(scope="module")
def reference():
    """One device: the model state (weights and a non-zero bias), a batch, and the step's loss, gradients and
    per-layer statistics."""
    cfg = ModelConfig(**MODEL, moe=MoEConfig(**ROUTING, dense_layers=(0,)))
    assert cfg.prefix_layers == 1 and cfg.moe_layer_count == 4
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), MODEL_STATE)
    bias = np.random.default_rng(8).normal(0, 0.05, (4, 8)).astype(np.float32)
    state["blocks"]["e_score_correction_bias"] = state["blocks"]["e_score_correction_bias"].replace(jnp.asarray(bias))
    batch = jnp.asarray(np.random.default_rng(5).integers(0, 64, (16, 13)), jnp.int32)
    loss, grads, sums = jax.jit(loss_and_grads(graphdef, stats=True, mtp_weight=MTP_WEIGHT))(state, batch)
    zero = jax.tree.map(lambda v: v, state)
    zero["blocks"]["e_score_correction_bias"] = zero["blocks"]["e_score_correction_bias"].replace(jnp.zeros((4, 8)))
    unbiased = jax.jit(loss_and_grads(graphdef, stats=True, mtp_weight=MTP_WEIGHT))(zero, batch)[2]["load"]
    assert (np.asarray(unbiased) != np.asarray(sums["load"])).any()  # the bias changes the routing
    return cfg, state, batch, loss, grads, sums


@pytest.mark.parametrize("layout", list(PARITY_LAYOUTS))
def test_model_with_a_bias_matches_one_device(reference, layout):
    """The whole DeepSeek model (latent attention, a dense first layer, a shared expert, V3 routing, an MTP module)
    with a non-zero bias (it changes which experts): the loss and every weight's gradient — the replicated latent
    projections', the dense prefix's and the MTP module's included — equal one device's (fp32 rtol 1e-5), the
    step's per-layer loads — what the bias update reads — equal exactly (summed over data, expert, the pipeline's
    microbatches, gradient accumulation's micro-steps and SP's tensor shards), so do the MTP module's valid-position
    counts (its cross-entropy sums to rtol 1e-5), and no gradient reaches the bias. (Context parallelism is refused
    for MoE models by the config.)"""
    cfg, state, batch, want_loss, want_grads, want_sums = reference
    accum = 2 if "micro-steps" in layout else 1  # gradient accumulation sums the micro-steps' loads
    loss, grads, sums = on_layout(cfg, state, batch, ParallelConfig(**PARITY_LAYOUTS[layout]), stats=True,
                                  grad_accum=accum, mtp_weight=MTP_WEIGHT)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert np.abs(np.asarray(trainable(want_grads)["mtp"]["eh_proj"][...])).max() > 0  # the MTP module trains
    assert_grads_match(trainable(grads), trainable(want_grads))
    assert not jax.tree.leaves(buffers_of(grads))  # no gradient is even formed for the bias: a constant of the loss
    np.testing.assert_array_equal(sums["load"], want_sums["load"])
    np.testing.assert_array_equal(sums["mtp"]["count"], want_sums["mtp"]["count"])
    np.testing.assert_allclose(sums["mtp"]["ce"], want_sums["mtp"]["ce"], rtol=1e-5)
    assert int(np.asarray(sums["load"]).sum()) == 4 * 16 * 12 * 2  # every layer: every token's two experts


# ---------------------------------------------------------------------------------------------------------------------
# Training: the buffer after steps at every layout, and its checkpoint.

RATE = 0.01
TRAIN = ["model.d_model=24", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "moe.n_experts=8",
         "moe.top_k=2", "moe.d_ff=10", "moe.scoring=sigmoid", "moe.n_group=4", "moe.topk_group=2",
         "moe.correction_bias=true", f"moe.bias_update_rate={RATE}", "moe.aux_loss_coef=0", "train.batch_size=16",
         "train.seq_len=16", "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1"]


def train_config(name):
    return load_config("configs/moe_tiny.py", TRAIN + FIT_LAYOUTS[name][0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name → (workdir, FitResult): two steps of `fit` at each layout, on the same batches."""
    out = {}
    for name, (_, devices) in FIT_LAYOUTS.items():
        workdir = tmp_path_factory.mktemp("run")
        out[name] = workdir, fit(train_config(name), workdir, devices=jax.devices()[:devices], progress=False)
    return out


def test_the_bias_trains_alike_everywhere_and_restores_bit_for_bit(runs):
    """After two steps (the second routed with the bias the first one set) the bias is bit-identical at every
    layout, each entry a sum of ±γ steps; the optimizer holds no state for it; a checkpoint written by the circular
    run restores it bit for bit onto one device and onto ZB-V."""
    host = {name: canonical_host(result.state.params, result.config, result.mesh) for name, (_, result) in runs.items()}
    want = host["single device"]["blocks"]["e_score_correction_bias"]
    assert want.shape == (4, 8) and np.abs(want).max() > 0
    np.testing.assert_allclose(np.abs(want) / RATE, np.round(np.abs(want) / RATE), atol=1e-4)  # multiples of γ
    for name, tree in host.items():
        np.testing.assert_array_equal(tree["blocks"]["e_score_correction_bias"], want, err_msg=name)
        np.testing.assert_allclose([r["loss"] for r in runs[name][1].history if "loss" in r],
                                   [r["loss"] for r in runs["single device"][1].history if "loss" in r], rtol=1e-4)
        assert all(r["moe_max_over_mean_load"] >= 1 for r in runs[name][1].history if "loss" in r)
        assert "e_score_correction_bias" not in str(jax.tree_util.tree_flatten_with_path(
            runs[name][1].state.opt_state)[0])

    source = "(pipe, expert, tensor) = (2, 2, 2) circular"
    for target in ("single device", "(data, pipe, tensor) = (2, 2, 2) ZB-V"):
        _, got = restore_on(runs[source][0], train_config(target), FIT_LAYOUTS[target][1])
        jax.tree.map(np.testing.assert_array_equal, got, host[source])


def test_decode_and_the_planner_read_the_bias(reference):
    """Prefill + a KV-cache decode step with the bias equal the full forward with it (which differs from the
    forward without it: the bias reaches the layers); the planner's traces of the layers (autodiff's residuals, a
    table chunk) build them with the buffer too."""
    from jaxpar.model import KVCache
    from jaxpar.planner import memory

    cfg, state, batch, *_ = reference
    graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = batch[:2, :9]
    zero = jax.tree.map(lambda v: v, state)
    zero["blocks"]["e_score_correction_bias"] = zero["blocks"]["e_score_correction_bias"].replace(jnp.zeros((4, 8)))

    def decode(state, tokens):
        m = nnx.merge(graphdef, state)
        prefill, cache = m.decode(tokens[:, :-1], KVCache.empty(cfg, 2, 12))
        return m(tokens), prefill, m.decode(tokens[:, -1:], cache)[0]

    logits, prefill, step = jax.jit(decode)(state, tokens)
    np.testing.assert_allclose(prefill, logits[:, :-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step[:, 0], logits[:, -1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(jax.jit(decode)(zero, tokens)[0], logits, atol=1e-4)
    assert memory.residuals(cfg, 12, "none", True).layer
    assert memory.table_chunk(cfg, 12, "none", 2).stash
