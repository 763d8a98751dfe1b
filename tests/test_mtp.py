"""Multi-token prediction (DeepSeek-V3 §2.2): the MTP modules' loss against a plain reference written from the
paper's equations on top of the main model's hidden states (value and gradients, fp32), packed documents (no target
crosses a boundary), the whole step with MTP at parallel layouts against one device, the config's refusals, and
self-speculative decoding (the draft's tokens verified: exactly greedy decoding's).

The reference (`reference_mtp`) takes from jaxpar only the main model's last hidden state h⁰ (before the final
norm), its embedding table and its head; the MTP modules — RMSNorms, the [emb; h] projection, one llama block
(GQA attention with rotate-half RoPE, SwiGLU) and the cross-entropy over valid positions — are written here.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, lay_out
from jaxpar.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxpar.model import Transformer, default_positions, mtp_targets, run_layers, trainable
from jaxpar.plan import make_plan
from jaxpar.sharding import param_specs
from jaxpar.train.step import loss_and_grads, mtp_loss, next_token_loss, sharded_loss_and_grads

# Odd sizes: vocab 67, d_model 20, 5 query heads of 4 sharing 1 kv head, d_ff 28, rows of T = 13.
LLAMA = dict(family="llama", vocab_size=67, d_model=20, n_layers=2, n_heads=5, n_kv_heads=1, d_ff=28,
             max_seq_len=32, init_std=0.2, scan_unroll=1, mtp_depth=2)
LAMBDA = 0.3


def _rms(x, g, eps):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _rope(x, pos, theta):  # x [B, T, N, E], rotate-half pairs (i, i + E/2), ω_i = θ^(−2i/E)
    E = x.shape[-1]
    w = 1.0 / theta ** (np.arange(0, E, 2, dtype=np.float32) / E)
    a = pos[..., None].astype(jnp.float32) * w
    c, s = jnp.cos(a)[:, :, None], jnp.sin(a)[:, :, None]
    x1, x2 = x[..., :E // 2], x[..., E // 2:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _llama_block(p, x, pos, allowed, cfg):
    """One pre-norm llama block from the equations. x [B, T, D]; allowed [B, T, S] bool."""
    h = _rms(x, p["attn_norm"], cfg.norm_eps)
    q = jnp.einsum("btd,dhe->bthe", h, p["wq"])
    k = jnp.einsum("btd,dke->btke", h, p["wk"])
    v = jnp.einsum("btd,dke->btke", h, p["wv"])
    q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # query head n reads kv head n // G
    s = jnp.einsum("bthe,bshe->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    o = jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(s, -1), v)
    x = x + jnp.einsum("bthe,hed->btd", o, p["wo"])
    h = _rms(x, p["mlp_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def _ce(logits, target):
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]


def reference_mtp(model, batch, segments=None):
    """Per-depth mean cross-entropy [n] of the MTP modules over their valid positions, from the equations:
    h'ᵏ_i = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(hᵏ⁻¹_i)], hᵏ = Block_k(h'ᵏ), logits = Head(RMSNorm(hᵏ)) predicting
    t_{i+k+1}; valid when i+k+1 ≤ T and (packed) in the same document as i. batch [B, T+1]; segments [B, T+1]."""
    cfg = model.cfg
    B, T = batch.shape[0], batch.shape[1] - 1
    tokens, pos = batch[:, :T], default_positions(B, T)
    seg = None if segments is None else segments[:, :T]
    mask = None if seg is None else (jnp.tril(jnp.ones((T, T), bool))
                                     & (seg[:, :, None] == seg[:, None, :]))[:, None]
    h = run_layers(model.stacks(), model.embed_tokens(tokens, pos), pos, mask, cfg)  # h⁰: before the final norm
    allowed = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
    if seg is not None:
        allowed &= seg[:, :, None] == seg[:, None, :]
    E, head = model.embed[...], model.lm_head[...]
    out = []
    for k in range(1, cfg.mtp_depth + 1):
        i = np.arange(T)
        nxt = np.minimum(i + k, T)  # t_{i+k} (clamped past the row: those positions have no target)
        tgt_at = np.minimum(i + k + 1, T)
        e = E[batch[:, nxt]]
        m = model.mtp
        hk = jnp.concatenate([_rms(e, m.enorm[...][k - 1], cfg.norm_eps), _rms(h, m.hnorm[...][k - 1], cfg.norm_eps)],
                             -1) @ m.eh_proj[...][k - 1]
        layer = {name: v[...][k - 1] for name, v in vars(m.blocks).items() if isinstance(v, nnx.Param)}
        h = _llama_block(layer, hk, pos, allowed, cfg)
        logits = _rms(h, m.head_norm[...][k - 1], cfg.norm_eps) @ head
        valid = np.broadcast_to(i + k + 1 <= T, (B, T))
        if segments is not None:
            valid = valid & (segments[:, tgt_at] == segments[:, :T])
        ce = _ce(logits, batch[:, tgt_at])
        out.append(jnp.where(valid, ce, 0).sum() / valid.sum())
    return jnp.stack(out)


def _batch(cfg, B, T, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)


def test_targets_shift_and_documents():
    batch = jnp.arange(10)[None] + 100  # T = 9
    tokens, targets, valid = mtp_targets(batch, 2)
    np.testing.assert_array_equal(tokens[0, 0, :8], np.arange(1, 9) + 100)  # depth 1 reads t_{i+1}
    np.testing.assert_array_equal(targets[1, 0, :7], np.arange(3, 10) + 100)  # depth 2 predicts t_{i+3}
    assert valid[0, 0].tolist() == [True] * 8 + [False] and valid[1, 0].tolist() == [True] * 7 + [False] * 2
    seg = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2]])  # three packed documents
    _, targets, valid = mtp_targets(batch, 2, seg)
    i = np.arange(9)
    for k in (1, 2):
        for p in i[np.asarray(valid[k - 1, 0])]:  # every valid target is in position p's document
            assert seg[0, p + k + 1] == seg[0, p] and targets[k - 1, 0, p] == batch[0, p + k + 1]
    assert valid[0, 0].tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0]  # doc 0 = 0..3, doc 1 = 4..8 (9: doc 2)
    assert valid[1, 0].tolist() == [1, 0, 0, 0, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("packed", [False, True])
def test_mtp_loss_equals_the_equations(packed):
    cfg = ModelConfig(**LLAMA)
    B, T = 3, 13
    batch = _batch(cfg, B, T)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(1)), nnx.Param)
    segments = jnp.asarray(np.repeat([[0] * 6 + [1] * 5 + [2] * 3], B, 0)) if packed else None

    def ours(p):
        model = nnx.merge(graphdef, p)
        ins, tgt, valid = mtp_targets(batch, cfg.mtp_depth, segments)
        _, mtp_logits = model(batch[:, :T], segment_ids=None if segments is None else segments[:, :T],
                              mtp_tokens=ins)
        _, sums = mtp_loss(mtp_logits, tgt, valid, T)
        return (sums["ce"] / sums["count"]).mean()  # the exact mean over valid positions (what the step logs)

    def ref(p):
        return reference_mtp(nnx.merge(graphdef, p), batch, segments).mean()

    got, got_g = jax.value_and_grad(ours)(params)
    want, want_g = jax.value_and_grad(ref)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the main model's parameters get MTP gradients through h⁰; the final norm none (h⁰ is before it)
    got_g, want_g = nnx.to_pure_dict(got_g), nnx.to_pure_dict(want_g)
    assert np.abs(np.asarray(got_g["blocks"]["wq"])).max() > 0
    assert np.abs(np.asarray(got_g.pop("final_norm"))).max() == 0 == np.abs(want_g.pop("final_norm")).max()
    assert_grads_match(got_g, want_g, rtol=1e-5)
    if not packed:  # the step's objective: LM loss + λ · the same mean
        value, (loss, stats) = next_token_loss(graphdef, params, batch, objective=True, mtp_weight=LAMBDA)
        np.testing.assert_allclose(value - loss, LAMBDA * want, rtol=1e-5)
        np.testing.assert_allclose(loss, next_token_loss(graphdef, params, batch), rtol=1e-6)


def test_packed_documents_do_not_leak():
    """Changing a later document's tokens leaves an earlier document's MTP cross-entropies unchanged."""
    cfg = ModelConfig(**LLAMA)
    B, T = 1, 13
    batch = _batch(cfg, B, T)
    seg = jnp.asarray([[0] * 7 + [1] * 7])
    model = Transformer(cfg, rngs=nnx.Rngs(1))

    def per_position(b):
        ins, tgt, valid = mtp_targets(b, cfg.mtp_depth, seg)
        _, lg = model(b[:, :T], segment_ids=seg[:, :T], mtp_tokens=ins)
        return np.asarray(jnp.stack([_ce(l, t) for l, t in zip(lg, tgt)]) * valid), np.asarray(valid)

    a, valid = per_position(batch)
    b, _ = per_position(batch.at[:, 7:].set((batch[:, 7:] + 1) % cfg.vocab_size))
    np.testing.assert_array_equal(a[:, :, :7], b[:, :, :7])
    assert valid[:, 0, :7].sum() == 5 + 4  # doc 0 is positions 0-6: depth 1 scores i ≤ 4, depth 2 i ≤ 3


DEEPSEEK = dict(family="deepseek", vocab_size=61, d_model=16, n_layers=2, n_heads=4, kv_lora_rank=6,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, q_lora_rank=5, d_ff=24, max_seq_len=32,
                init_std=0.2, scan_unroll=1, rope_interleave=True, mtp_depth=1,
                moe=MoEConfig(n_experts=4, top_k=2, d_ff=8, shared_d_ff=8, dense_layers=(0,), capacity_factor=0.0,
                              scoring="sigmoid", n_group=2, topk_group=1, correction_bias=True, aux_loss_coef=0.0))


def _grads(cfg, params, batch, parallel=None):
    if parallel is None:
        graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
        loss, grads, sums = jax.jit(loss_and_grads(graphdef, stats=True, mtp_weight=LAMBDA))(params, batch)
        return loss, trainable(grads), sums
    plan = make_plan(cfg, parallel, jax.devices())
    graphdef, laid_out = lay_out(cfg, params, plan)
    specs = param_specs(laid_out, plan.rules, plan.param_zero_data)
    fn = sharded_loss_and_grads(graphdef, plan, param_specs=specs, stats=True, mtp_weight=LAMBDA)
    loss, grads, sums = jax.jit(fn)(laid_out, jax.device_put(batch, plan.batch_sharding))
    return loss, trainable(plan.to_canonical(grads)), sums


def test_step_layouts_equal_one_device():
    """The whole step with an MoE MTP module at (data 2, tensor 2, SP) and (data 2, expert 2, tensor 2)."""
    cfg = ModelConfig(**DEEPSEEK)
    batch = _batch(cfg, 8, 12)
    params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]  # weights and buffers (the correction bias)
    want_loss, want_grads, want_sums = _grads(cfg, params, batch)
    assert np.abs(np.asarray(want_grads["mtp"]["blocks"]["we_up"][...])).max() > 0  # the MTP experts train
    for layout in (dict(data=4, tensor=2, sequence_parallel=True), dict(data=2, expert=2, tensor=2)):
        loss, grads, sums = _grads(cfg, params, batch, ParallelConfig(**layout))
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(sums["mtp"]["ce"], want_sums["mtp"]["ce"], rtol=1e-5)
        np.testing.assert_array_equal(sums["mtp"]["count"], want_sums["mtp"]["count"])
        assert_grads_match(grads, want_grads)


def test_step_under_a_schedule_table_equals_one_device():
    """Two MTP modules (depth 2: module 2 reads module 1's hidden states) under a 1F1B table over pipe 2: the stage
    that finishes a microbatch runs the modules beside the head, their loss joins the objective through the
    executor's head and their sums come back with it — the loss, the MTP sums and every gradient equal one device's.
    (The circular pipeline and ZB-V with a dense prefix: tests/test_deepseek_moe.py.)"""
    cfg = ModelConfig(**LLAMA)
    batch = _batch(cfg, 8, 12)
    params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    want_loss, want_grads, want_sums = _grads(cfg, params, batch)
    loss, grads, sums = _grads(cfg, params, batch, ParallelConfig(data=4, pipe=2, microbatches=2, schedule="1f1b"))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(sums["mtp"]["ce"], want_sums["mtp"]["ce"], rtol=1e-5)
    np.testing.assert_array_equal(sums["mtp"]["count"], want_sums["mtp"]["count"])
    assert_grads_match(grads, want_grads)


@pytest.mark.parametrize("impl", ["all_gather", "ring"])
def test_step_under_context_parallelism_equals_one_device(impl):
    """A dense MTP model at context 2: each rank holds a zigzag share of every row's positions and of its MTP
    targets, and `mtp_loss` divides by its share of the valid positions — the loss, the MTP sums and every gradient
    equal one device's."""
    cfg = ModelConfig(**LLAMA)
    batch = _batch(cfg, 8, 12)
    params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    want_loss, want_grads, want_sums = _grads(cfg, params, batch)
    loss, grads, sums = _grads(cfg, params, batch, ParallelConfig(data=4, context=2, context_impl=impl))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(sums["mtp"]["ce"], want_sums["mtp"]["ce"], rtol=1e-5)
    np.testing.assert_array_equal(sums["mtp"]["count"], want_sums["mtp"]["count"])
    assert_grads_match(grads, want_grads)


@pytest.mark.parametrize("build,field", [
    (lambda: ModelConfig(family="gpt2", mtp_depth=1), "model.mtp_depth"),
    (lambda: ModelConfig(mtp_depth=-1), "model.mtp_depth"),
    (lambda: TrainConfig(mtp_loss_weight=-0.1), "train.mtp_loss_weight"),
])
def test_refusals(build, field):
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == field


# -----------------------------------------------------------------------------------------------------------------
# self-speculative decoding


@pytest.mark.parametrize("fields", [dict(LLAMA, mtp_depth=3),
                                    dict(DEEPSEEK, mtp_depth=2, moe=MoEConfig(n_experts=4, top_k=2, d_ff=8,
                                                                              dense_layers=(0,), capacity_factor=0.0))],
                         ids=["llama-D3", "deepseek-moe-D2"])
def test_speculative_equals_greedy(fields):
    from jaxpar.infer.decode import generate
    from jaxpar.infer.speculative import speculative_generate

    cfg = ModelConfig(**dict(fields, max_seq_len=64))
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 1]]  # ragged: rows accept at their own pace
    want = generate(model, prompts, max_new_tokens=17, return_prompt=False)
    got, info = speculative_generate(model, prompts, max_new_tokens=17)
    np.testing.assert_array_equal(got, want)
    assert 0.0 <= info["acceptance"] <= 1.0 and info["rounds"] <= 16  # (on a trained model: the report's figure)


def test_speculative_accepts_a_right_draft():
    """Zero output norms make every logit 0, so the main model and the draft both pick token 0: every draft is
    accepted (D + 1 tokens a main-model step), and the tokens still equal greedy decoding's."""
    from jaxpar.infer.decode import generate
    from jaxpar.infer.speculative import speculative_generate

    cfg = ModelConfig(**dict(LLAMA, mtp_depth=3, max_seq_len=64))
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    model.final_norm[...] = jnp.zeros_like(model.final_norm[...])
    model.mtp.head_norm[...] = jnp.zeros_like(model.mtp.head_norm[...])
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    got, info = speculative_generate(model, prompts, max_new_tokens=17)
    np.testing.assert_array_equal(got, generate(model, prompts, max_new_tokens=17, return_prompt=False))
    assert info["acceptance"] == 1.0 and info["rounds"] == 4  # 1 + 4·4 = 17 tokens


# -----------------------------------------------------------------------------------------------------------------
# Hugging Face: the MTP layer (model.layers.{num_hidden_layers + k}.*) imported and exported bit for bit


def test_hf_mtp_layer_round_trip(tmp_path):
    """A copy of the DeepSeek-V3 fixture (3 layers, layer 0 dense) with an MTP module written in as layer 3 (an MoE
    layer: layer 2's tensors under its name, plus enorm, hnorm, eh_proj, shared_head.norm and the copies of the
    embedding and head) imports with mtp_depth 1 and exports every tensor bit for bit; imported straight onto a
    pipeline (pipe 2 × tensor 2), the dense prefix and the MTP module — which every stage holds whole — and the
    stages' MoE layers hold what the single-device import holds."""
    import json
    import pathlib
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxpar.cli import main
    from jaxpar.interop import hf

    fixture = pathlib.Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3"
    src = tmp_path / "mtp"
    shutil.copytree(fixture, src)
    files = load_file(str(src / hf.SINGLE))
    rng = np.random.default_rng(0)
    D = files["model.norm.weight"].shape[0]
    extra = {k.replace("model.layers.2.", "model.layers.3."): v + rng.normal(0, 0.01, v.shape).astype(v.dtype)
             for k, v in files.items() if k.startswith("model.layers.2.")}
    extra.update({"model.layers.3.enorm.weight": rng.normal(1, 0.1, D).astype(np.float32),
                  "model.layers.3.hnorm.weight": rng.normal(1, 0.1, D).astype(np.float32),
                  "model.layers.3.eh_proj.weight": rng.normal(0, 0.1, (D, 2 * D)).astype(np.float32),
                  "model.layers.3.shared_head.norm.weight": rng.normal(1, 0.1, D).astype(np.float32),
                  "model.layers.3.embed_tokens.weight": files["model.embed_tokens.weight"].copy(),
                  "model.layers.3.shared_head.head.weight": files["lm_head.weight"].copy()})
    files.update(extra)
    save_file(files, str(src / hf.SINGLE), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))

    assert hf.model_config(hf.read_config(fixture), fixture).mtp_depth == 0  # no MTP tensors: 0 whatever the key
    assert hf.model_config(hf.read_config(src), src).mtp_depth == 1
    hf.import_to_workdir(src, tmp_path / "w")
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "out")]) == 0
    out = load_file(str(tmp_path / "out" / hf.SINGLE))
    assert sorted(out) == sorted(files)
    assert all(out[k].tobytes() == files[k].tobytes() for k in files), [k for k in files if
                                                                      out[k].tobytes() != files[k].tobytes()]
    assert hf.read_config(tmp_path / "out")["num_nextn_predict_layers"] == 1

    from jaxpar.model import abstract_model
    from jaxpar.sharding import param_shardings

    cfg = hf.model_config(hf.read_config(src), src)
    plan = make_plan(cfg, ParallelConfig(data=-1, pipe=2, tensor=2, microbatches=2), jax.devices()[:4])
    assert cfg.prefix_layers == 1 and plan.pipeline.layers == 2
    single = nnx.to_pure_dict(hf.load_params(src, cfg, abstract_model(cfg)[1]))
    _, abstract = abstract_model(plan.model, plan.padded_vocab)
    placed = hf.load_params(src, cfg, abstract, plan, param_shardings(abstract, plan.mesh, plan.rules))
    assert placed["dense_blocks"]["wq_a"][...].addressable_shards[0].data.shape[0] == 1  # whole on every stage
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), nnx.to_pure_dict(
        plan.to_canonical(placed)), single)
