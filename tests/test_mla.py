"""Multi-head latent attention (the `mla` kind, jaxpar.model.mla_attention) and the deepseek family's model side:

(a) the layer equals a plain reference written here from DeepSeek-V2 §2.1's equations (and transformers' YaRN and
    interleaved-pair RoPE), value and gradients, fp32, at positions well past the first few;
(b) decoding with the latent cache in the absorbed form equals the cache-free forward, logit for logit and token for
    token, rows of different lengths — on one device and on explicit tensor-parallel plans (with SP's prefill);
(c) a tiny deepseek model at tensor 2, tensor 2 + SP (MoE with a dense first layer), context 2 (both impls) and a
    1F1B pipeline with tensor 2 + SP equals the single-device model, loss and gradients;
(d) the cache holds L·B·S·(r + R) values — the planner's count, and the compiled decode program's cache argument —
    against the equivalent GQA model's 2·K·E a slot.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, lay_out, on_layout, single_device
from jaxpar import model as model_lib
from jaxpar.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig, check_layout
from jaxpar.flops import layer_forward_flops
from jaxpar.infer import decode
from jaxpar.model import KVCache, Transformer
from jaxpar.plan import make_plan
from jaxpar.planner.memory import kv_cache_bytes, local_model

# Odd sizes: d_model 24, 4 heads, latent r 11, rope R 8 (4 pairs), nope 6 → Eqk 14, value 5 (narrower than Eqk:
# v padded) or 17 (wider: q and k padded), query rank 7.
BASE = dict(family="deepseek", vocab_size=263, d_model=24, n_layers=2, n_heads=4, kv_lora_rank=11,
            qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=7, d_ff=40, max_seq_len=64,
            init_std=0.2, scan_unroll=1)
YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_mscale=0.8,
            rope_mscale_all_dim=0.6, rope_interleave=True)
CASES = {
    "qlora-yarn-interleave": dict(BASE, **YARN),
    "direct-q-wide-v": dict(BASE, q_lora_rank=0, v_head_dim=17),
    "qlora-yarn-default-mscale": dict(BASE, rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=8,
                                      rope_beta_fast=8.0, rope_beta_slow=0.5),
}


# -----------------------------------------------------------------------------------------------------------------
# (a) the reference, from the equations (no jaxpar code)


def _ref_yarn(E, theta, factor, context, beta_fast, beta_slow):
    """YaRN's per-pair frequencies: pairs rotating more than beta_fast times over the original context keep θ^(-2i/E),
    those rotating less than beta_slow times are divided by `factor`, a linear ramp in the pair index between
    (its ends: the dims d(b) = E·ln(context/(2πb))/(2 ln θ), floored / ceiled and clipped to [0, E−1])."""
    base = 1.0 / theta ** (np.arange(0, E, 2) / E)
    d = lambda b: E * math.log(context / (b * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    lo, hi = max(math.floor(d(beta_fast)), 0), min(math.ceil(d(beta_slow)), E - 1)
    hi = hi + 0.001 if lo == hi else hi
    interp = np.clip((np.arange(E // 2) - lo) / (hi - lo), 0, 1)  # 1: interpolated
    return (base / factor * interp + base * (1 - interp)).astype(np.float32)


def _ref_mscale(factor, coef):
    return 0.1 * coef * math.log(factor) + 1.0 if factor > 1 else 1.0


def _ref_rms(x, g, eps):
    return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _ref_rope(x, pos, freq, interleave, amp):
    """Rotate pairs of x [..., T, R] by pos·freq, cos and sin multiplied by amp; pairs (2i, 2i+1) or (i, i+R/2).
    Returned in the input's own dim order (a different permutation from the model's: dot products are the same)."""
    ang = pos[:, None] * freq[None, :]  # [T, R/2]
    c, s = jnp.cos(ang) * amp, jnp.sin(ang) * amp
    R = x.shape[-1]
    idx_a = np.arange(0, R, 2) if interleave else np.arange(R // 2)
    idx_b = idx_a + 1 if interleave else idx_a + R // 2
    a, b = x[..., idx_a], x[..., idx_b]
    out = jnp.zeros_like(x)
    out = out.at[..., idx_a].set(a * c - b * s)
    return out.at[..., idx_b].set(b * c + a * s)


def reference_mla(p, h, cfg):
    """One sequence's MLA, head by head: h [T, D] → [T, D]. Positions 0..T-1, causal."""
    T = h.shape[0]
    r, R, N, Ev, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.n_heads
    pos = jnp.arange(T, dtype=jnp.float32)
    yarn = cfg.rope_scaling == "yarn"
    if yarn:
        freq = _ref_yarn(R, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_beta_fast,
                         cfg.rope_beta_slow)
        amp = (_ref_mscale(cfg.rope_factor, cfg.rope_mscale) / _ref_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
               if cfg.rope_mscale_all_dim else _ref_mscale(cfg.rope_factor, 1.0))
        m = _ref_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) if cfg.rope_mscale_all_dim else 1.0
    else:
        freq, amp, m = (1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R)).astype(np.float32), 1.0, 1.0
    scale = (N + R) ** -0.5 * m * m
    if "wq_a" in p:
        cq = _ref_rms(h @ p["wq_a"], p["q_a_norm"], cfg.norm_eps)  # c_t^Q = W^DQ h_t (normalised)
        q = cq @ p["wq_b"].reshape(cfg.q_lora_rank, -1)
    else:
        q = h @ p["wq"].reshape(cfg.d_model, -1)
    q = q.reshape(T, H, N + R)
    ckv = h @ p["wkv_a"]
    c = _ref_rms(ckv[:, :r], p["kv_a_norm"], cfg.norm_eps)  # c_t^KV
    k_r = _ref_rope(ckv[:, r:], pos, freq, cfg.rope_interleave, amp)  # k_t^R = RoPE(W^KR h_t), shared by all heads
    outs = []
    for i in range(H):
        up = c @ p["wkv_b"][:, i, :]  # [T, N + Ev]: k^C and v^C of head i
        k_c, v = up[:, :N], up[:, N:]
        q_c, q_r = q[:, i, :N], _ref_rope(q[:, i, N:], pos, freq, cfg.rope_interleave, amp)
        s = (q_c @ k_c.T + q_r @ k_r.T) * scale
        s = jnp.where(np.tril(np.ones((T, T), bool)), s, -jnp.inf)
        outs.append(jax.nn.softmax(s, -1) @ v)  # [T, Ev]
    return jnp.concatenate(outs, -1) @ p["wo"].reshape(H * Ev, cfg.d_model)


def _layer(cfg, seed=0):
    """Layer 0's parameters of a fresh deepseek model (the norms' scales perturbed off 1)."""
    stacks = Transformer(cfg, rngs=nnx.Rngs(seed)).stacks()["blocks"]
    p = {k: v[0] for k, v in stacks.items()}
    rng = np.random.default_rng(seed)
    for k in ("q_a_norm", "kv_a_norm"):
        if k in p:
            p[k] = jnp.asarray(1 + 0.3 * rng.standard_normal(p[k].shape), jnp.float32)
    return p


@pytest.mark.parametrize("case", list(CASES))
def test_mla_equals_the_paper(case):
    cfg = ModelConfig(**CASES[case])
    p = _layer(cfg)
    keys = [k for k in p if k in ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")]
    T = 19
    h = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, cfg.d_model)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, cfg.d_model)), jnp.float32)

    def ours(w, h):
        out, _ = model_lib.mla_attention({**p, **w}, h, model_lib.default_positions(2, T), None, cfg)
        return out

    def ref(w, h):
        return jnp.stack([reference_mla({**p, **w}, h[b], cfg) for b in range(2)])

    w = {k: p[k] for k in keys}
    np.testing.assert_allclose(jax.jit(ours)(w, h), ref(w, h), rtol=1e-5, atol=1e-6)
    g_ours = jax.jit(jax.grad(lambda w, h: (ours(w, h) * probe).sum(), argnums=(0, 1)))(w, h)
    g_ref = jax.grad(lambda w, h: (ref(w, h) * probe).sum(), argnums=(0, 1))(w, h)
    for k in keys:
        scale = np.abs(g_ref[0][k]).max()
        assert np.abs(g_ours[0][k] - g_ref[0][k]).max() <= 1e-5 * scale, k
    np.testing.assert_allclose(g_ours[1], g_ref[1], rtol=1e-5, atol=1e-5 * np.abs(g_ref[1]).max())


def test_yarn_softmax_scale_and_factor():
    """DeepSeek-V2's own numbers: factor 40, mscale = mscale_all_dim = 0.707 → cos/sin factor 1 and softmax scale
    192^-0.5 · (0.0707·ln 40 + 1)²; the scale uses mscale_all_dim, never mscale."""
    cfg = ModelConfig(**dict(BASE, qk_nope_head_dim=128, qk_rope_head_dim=64, rope_scaling="yarn", rope_factor=40.0,
                             rope_mscale=0.707, rope_mscale_all_dim=0.707, rope_original_max_len=4096))
    assert model_lib.rope_attention_factor(cfg) == pytest.approx(1.0)
    assert model_lib.mla_softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.0707 * math.log(40) + 1) ** 2)
    other = dataclasses.replace(cfg, rope_mscale=1.0)
    assert model_lib.mla_softmax_scale(other) == model_lib.mla_softmax_scale(cfg)
    assert model_lib.rope_attention_factor(other) == pytest.approx(
        (0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))
    unset = dataclasses.replace(cfg, rope_mscale=0.0)  # transformers without the mscale key: 0.1·ln f + 1
    assert model_lib.rope_attention_factor(unset) == pytest.approx(0.1 * math.log(40) + 1)


# -----------------------------------------------------------------------------------------------------------------
# (b) absorbed-latent decoding equals the cache-free forward

PROMPTS = [[5, 9, 200, 7, 31, 8, 77, 3, 140, 2, 6], [1, 2, 3], [250, 17, 17, 4, 99, 61, 8, 3, 12, 44, 45, 46, 47, 48],
           [42]]


def _greedy_without_cache(model, prompts, n):
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(np.argmax(np.asarray(model(jnp.asarray([seq], jnp.int32))[0, -1]))))
        out.append(seq[len(prompt):])
    return np.asarray(out)


@pytest.fixture(scope="module")
def decoder():
    cfg = ModelConfig(**CASES["qlora-yarn-interleave"])
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    return cfg, model, _greedy_without_cache(model, PROMPTS, 6)


def test_absorbed_decode_equals_the_forward(decoder):
    """Prefill (right-padded rows of 1 … 14 tokens) and 5 single-token steps through the latent cache: every real
    position's logits equal the cache-free forward's (fp32), and greedy tokens equal the cache-free greedy loop's."""
    cfg, model, want = decoder
    B, P = len(PROMPTS), max(map(len, PROMPTS))
    tokens = np.zeros((B, P), np.int32)
    for b, pr in enumerate(PROMPTS):
        tokens[b, :len(pr)] = pr
    lengths = jnp.asarray([len(pr) for pr in PROMPTS], jnp.int32)
    step = jax.jit(lambda m, t, c, counts: m.decode(t, c, counts=counts))
    logits, cache = step(model, jnp.asarray(tokens), KVCache.empty(cfg, B, P + 6), lengths)
    seqs = [list(pr) for pr in PROMPTS]
    got = [[np.asarray(logits[b, i]) for i in range(len(pr))] for b, pr in enumerate(PROMPTS)]
    nxt = jnp.argmax(logits[jnp.arange(B), lengths - 1], -1)
    for _ in range(5):
        for b in range(B):
            seqs[b].append(int(nxt[b]))
        logits, cache = step(model, nxt[:, None].astype(jnp.int32), cache, None)
        for b in range(B):
            got[b].append(np.asarray(logits[b, 0]))
        nxt = jnp.argmax(logits[:, 0], -1)
    for b in range(B):
        full = np.asarray(model(jnp.asarray([seqs[b]], jnp.int32))[0])  # [len, V]
        np.testing.assert_allclose(np.stack(got[b]), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    np.testing.assert_array_equal(decode.generate(model, PROMPTS, max_new_tokens=6)[:, -6:], want)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp2", "tp2-sp"])
def test_explicit_tensor_parallel_decode(decoder, sequence):
    """The explicit path at (data 2, tensor 2): every rank holds the whole latent cache and its heads' share of the
    absorbed up-projections; with SP the prefill's latents are made whole (`Parallel.whole`) before the store."""
    cfg, model, want = decoder
    plan = make_plan(cfg, ParallelConfig(data=2, tensor=2, sequence_parallel=sequence), jax.devices()[:4])
    placed = nnx.merge(*lay_out(cfg, nnx.state(model, nnx.Param), plan))
    np.testing.assert_array_equal(decode.generate(placed, PROMPTS, max_new_tokens=6, plan=plan)[:, -6:], want)
    if not sequence:  # the same placed weights, partitioned by GSPMD (the cache laid out by its logical axes)
        np.testing.assert_array_equal(decode.generate(placed, PROMPTS, max_new_tokens=6, mesh=plan.mesh)[:, -6:],
                                      want)


# -----------------------------------------------------------------------------------------------------------------
# (c) layouts equal the single device

B, T = 8, 32
MOE = dict(CASES["qlora-yarn-interleave"], n_layers=3,
           moe=MoEConfig(n_experts=4, top_k=2, d_ff=20, shared_d_ff=12, dense_layers=(0,), capacity_factor=0.0))


@pytest.mark.parametrize("name,fields,layouts", [
    ("moe", MOE, [dict(tensor=2), dict(tensor=2, sequence_parallel=True)]),
    ("dense", dict(CASES["direct-q-wide-v"], n_layers=2),
     [dict(context=2, context_impl="all_gather"), dict(context=2, tensor=2, context_impl="ring"),
      dict(pipe=2, tensor=2, sequence_parallel=True, microbatches=2, schedule="1f1b")]),  # the tape's B/W split
])
def test_layouts_equal_one_device(name, fields, layouts):
    cfg = ModelConfig(**fields)
    batch = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    params, want_loss, want_grads = single_device(cfg, batch)
    for layout in layouts:
        parallel = ParallelConfig(data=8 // math.prod(layout.get(a, 1) for a in ("pipe", "context", "tensor")),
                                  **layout)
        loss, grads = on_layout(cfg, params, batch, parallel)[:2]
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        assert_grads_match(grads, want_grads)


def test_lora_dropout_on_every_mla_matrix_equals_one_device():
    """LoRA with dropout on every matrix of MLA's dense layers — the replicated latent projections (wq_a, wkv_a:
    `Parallel.dot` on this rank's tokens), the head-split ones, the MLP — at (data, tensor) = (4, 2) with SP equals
    one device, values and gradients (jaxpar.matmul.LoRADropout)."""
    from jaxpar.config import LoRAConfig
    from jaxpar.train.step import dropout_coords, loss_and_grads

    targets = ("w_down", "w_gate", "w_up", "wkv_a", "wkv_b", "wo", "wq_a", "wq_b")
    cfg = ModelConfig(**dict(CASES["qlora-yarn-interleave"], n_layers=2),
                      lora=LoRAConfig(rank=3, alpha=6.0, targets=targets, dropout=0.3))
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    pure, rng = nnx.to_pure_dict(params), np.random.default_rng(3)
    for k in [k for k in pure["blocks"] if k.endswith("_lora_b")]:  # B ≠ 0: every adapter's gradients flow
        pure["blocks"][k] = jnp.asarray(0.3 * rng.standard_normal(pure["blocks"][k].shape), jnp.float32)
    nnx.replace_by_pure_dict(params, pure)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    batch = {"tokens": tokens, "coords": dropout_coords(jnp.int32(3), B, T + 1, seed=0)}
    want_loss, want_grads = jax.jit(loss_and_grads(nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))))(params, batch)
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(data=4, tensor=2, sequence_parallel=True))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)


# -----------------------------------------------------------------------------------------------------------------
# (d) cache bytes, the planner and the checks


def _gqa_twin(cfg):
    """The GQA model of the same heads and head width (llama family, K = H)."""
    return ModelConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       head_dim=cfg.head_dim, d_ff=cfg.d_ff, max_seq_len=cfg.max_seq_len)


def test_cache_bytes_planner_and_compiled(decoder):
    cfg, model, _ = decoder
    L, Bc, S, r, R = cfg.n_layers, 6, 13, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache = KVCache.empty(cfg, Bc, S)
    assert {k: v.shape for k, v in cache.arrays.items()} == {"latent": (L, Bc, S, r), "k_rope": (L, Bc, S, R)}
    assert sum(a.nbytes for a in cache.arrays.values()) == L * Bc * S * (r + R) * 4 == kv_cache_bytes(cfg, Bc, S)
    gqa = _gqa_twin(cfg)
    assert kv_cache_bytes(gqa, Bc, S) == L * Bc * S * 2 * cfg.n_heads * cfg.head_dim * 4
    for data, tensor in ((1, 1), (2, 2)):
        plan = make_plan(cfg, ParallelConfig(data=data, tensor=tensor), jax.devices()[:data * tensor])
        placed = nnx.merge(*lay_out(cfg, nnx.state(model, nnx.Param), plan))
        fn, args = decode.explicit_decode_step(placed, plan, batch=Bc, slots=S, temperature=0.0, top_k=0, top_p=1.0)
        # every rank's shard of the cache arguments: the whole latent cache of its rows, whatever the tensor degree
        local = sum(a.addressable_shards[0].data.nbytes for a in args[2].values())
        assert local == kv_cache_bytes(cfg, Bc, S, data, tensor) == L * (Bc // data) * S * (r + R) * 4
        compiled = fn.lower(*args).compile()
        sizes = compiled.memory_analysis()
        if sizes is not None:  # the program's arguments hold at least the cache (and the parameters)
            assert sizes.argument_size_in_bytes >= local
    # per token per layer: r + R values against GQA's 2·K·E (here 19 against 112)
    assert kv_cache_bytes(cfg, 1, 1) / L == (r + R) * 4
    assert kv_cache_bytes(gqa, 1, 1) / L == 2 * cfg.n_heads * cfg.head_dim * 4


def test_planner_flops_and_checks_take_the_kind():
    cfg = ModelConfig(**CASES["qlora-yarn-interleave"])
    local = local_model(cfg, {"data": 1, "pipe": 1, "expert": 1, "context": 1, "tensor": 2})
    assert (local.n_heads, local.kv_lora_rank, local.head_dim) == (2, cfg.kv_lora_rank, cfg.head_dim)
    Transformer(local, rngs=nnx.Rngs(0))  # a valid plain model of one rank's share
    D, H, r, rq, R, N, Ev = 24, 4, 11, 7, 8, 6, 5
    f1, f2 = layer_forward_flops(cfg, 10.0, 1), layer_forward_flops(cfg, 10.0, 2)
    proj = 2 * D * rq + 2 * rq * H * (N + R) + 2 * D * (r + R) + 2 * r * H * (N + Ev) + 2 * H * Ev * D
    assert f1.attention == 2 * H * (N + R + Ev) * 10 and f2.attention == f1.attention / 2
    assert f1.dense == proj + 3 * 2 * D * cfg.d_ff
    check_layout(cfg, ParallelConfig(tensor=4))
    with pytest.raises(ConfigError, match="model.n_heads"):
        check_layout(cfg, ParallelConfig(tensor=8))


@pytest.mark.parametrize("fields,needle", [
    (dict(family="llama", kv_lora_rank=8), "model.kv_lora_rank"),
    (dict(family="llama", rope_interleave=True), "model.rope_interleave"),
    (dict(family="gpt2", rope_scaling="yarn", rope_factor=4.0), "model.rope_scaling"),
    (dict(BASE, kv_lora_rank=0), "model.kv_lora_rank"),
    (dict(BASE, qk_rope_head_dim=7), "model.qk_rope_head_dim"),
    (dict(BASE, rope_scaling="yarn"), "model.rope_factor"),
    (dict(BASE, rope_scaling="yarn", rope_factor=2.0, rope_beta_fast=1.0), "model.rope_beta_fast"),
    (dict(BASE, head_dim=16), "model.head_dim"),
    (dict(BASE, n_kv_heads=2), "model.n_kv_heads"),
    (dict(BASE, q_lora_rank=-1), "model.q_lora_rank"),
])
def test_config_refusals(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(**fields)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
def test_compiled_tensor_bytes_are_the_planners(sequence):
    """The compiled step's tensor-axis bytes at tensor 2 (with and without SP) equal `planner.expected`'s, which
    reads the kind's `traffic`: the latents (q_lora, r, R) enter the head-split region, not the D-wide stream."""
    from jaxpar.analysis.report import analyze
    from jaxpar.config import load_config

    fields = {k: v for k, v in CASES["qlora-yarn-interleave"].items()}
    overrides = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
    config = load_config(None, overrides + ["model.n_kv_heads=0", "train.seq_len=16", "train.batch_size=8",
                                            "model.max_seq_len=16", "parallel.tensor=2", "parallel.pipe=1",
                                            "parallel.repeats=1", "parallel.microbatches=1",
                                            f"parallel.sequence_parallel={sequence}"])
    report = analyze(config, activations=False)
    assert report["collectives"]["exact"]
    assert report["ratio"]["tensor_sent_bytes"] == pytest.approx(1.0, abs=1e-6), report["expected"]
