"""The model alone, on one device: shapes, an independent NumPy forward, masks, GQA and remat."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model import Transformer, count_params

from _parity import assert_grads_match

# Prime sizes where a mix-up of two dims would still type-check with round numbers.
PRIME = dict(vocab_size=263, d_model=22, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=6, d_ff=13, max_seq_len=11)


def make(family="llama", **kw) -> Transformer:
    return Transformer(ModelConfig(family=family, **{**PRIME, **kw}), rngs=nnx.Rngs(0))


def tokens(B=2, T=11, V=263, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tie", [False, True])
def test_shapes_with_prime_dims(family, tie):
    model = make(family, tie_embeddings=tie)
    logits = model(tokens())
    assert logits.shape == (2, 11, 263) and logits.dtype == jnp.float32
    b = model.blocks
    assert b.wq.shape == (3, 22, 6, 6) and b.wk.shape == (3, 22, 2, 6) and b.wo.shape == (3, 6, 6, 22)
    assert b.w_up.shape == (3, 22, 13) and b.w_down.shape == (3, 13, 22)
    assert hasattr(model, "lm_head") != tie
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == count_params(model.cfg)


# ---------------------------------------------------------------------------------------------------------------------
# An independent forward pass in NumPy float64, written from the papers' equations, layer by layer.


def numpy_forward(model: Transformer, toks: np.ndarray) -> np.ndarray:
    cfg = model.cfg
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    B, T = toks.shape
    x = p["embed"][toks]  # [B, T, D]
    if cfg.family == "gpt2":
        x = x + p["pos_embed"][np.arange(T)]

    def rms(x, g, b=None):
        if cfg.family == "gpt2":
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(var + cfg.norm_eps) * g + b
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.norm_eps) * g

    def rope(v):  # v [B, T, N, E]; rotate pairs (i, i+E/2)
        E = v.shape[-1]
        ang = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(0, E, 2) / E)  # [T, E/2]
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        a, b = v[..., : E // 2], v[..., E // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    L, H, K = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads
    for l in range(L):
        lp = {k: v[l] for k, v in p["blocks"].items()}
        h = rms(x, lp["attn_norm"], lp.get("attn_norm_b"))
        q = np.einsum("btd,dhe->bthe", h, lp["wq"])
        k = np.einsum("btd,dhe->bthe", h, lp["wk"])
        v = np.einsum("btd,dhe->bthe", h, lp["wv"])
        if "bq" in lp:  # gpt2; llama with qkv_bias (Qwen2)
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        if cfg.family != "gpt2":
            q, k = rope(q), rope(k)
        out = np.zeros_like(q)
        for head in range(H):
            kv = head // (H // K)  # query head -> its kv group
            s = q[:, :, head] @ k[:, :, kv].transpose(0, 2, 1) / np.sqrt(q.shape[-1])  # [B, T, S]
            t_, s_ = np.arange(T)[:, None], np.arange(T)[None, :]
            visible = (s_ <= t_) & ((t_ - s_ < cfg.sliding_window) if cfg.sliding_window else True)
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, :, head] = (w / w.sum(-1, keepdims=True)) @ v[:, :, kv]
        x = x + np.einsum("bthe,hed->btd", out, lp["wo"]) + lp.get("bo", 0)
        h = rms(x, lp["mlp_norm"], lp.get("mlp_norm_b"))
        if cfg.family == "gpt2":
            u = h @ lp["w_up"] + lp["b_up"]
            act = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
            x = x + act @ lp["w_down"] + lp["b_down"]
        else:
            g = h @ lp["w_gate"]
            x = x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]
    x = rms(x, p["final_norm"], p.get("final_norm_b"))
    head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("gpt2", True), ("gpt2", False)])
def test_forward_matches_numpy_reference(family, tie):
    model = make(family, tie_embeddings=tie, init_std=0.2)  # larger init: every term matters in the comparison
    toks = tokens()
    got = np.asarray(model(toks))
    want = numpy_forward(model, np.asarray(toks))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kw", [dict(sliding_window=4), dict(qkv_bias=True), dict(sliding_window=1)])
def test_window_and_qkv_bias_match_numpy_reference(kw):
    """Sliding window (the kernel's local_window_size) and Qwen2-style q/k/v biases against the NumPy forward."""
    model = make("llama", init_std=0.2, **kw)
    if "qkv_bias" in kw:
        for name in ("bq", "bk", "bv"):
            param = getattr(model.blocks, name)
            param[...] = 0.3 * jax.random.normal(jax.random.key(len(name)), param.shape)
    toks = tokens()
    np.testing.assert_allclose(np.asarray(model(toks)), numpy_forward(model, np.asarray(toks)), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family,window", [("llama", 0), ("llama", 3), ("gpt2", 0)])
def test_kv_cache_decode_equals_full_forward(family, window):
    """Prefill right-padded prompts of different lengths, then decode one token at a time: every row's logits equal
    the full causal forward over that row's tokens alone."""
    from jaxpar.model import KVCache

    model = make(family, sliding_window=window)
    lengths = (4, 7)  # real prompt lengths (row 0 is right-padded by 3); tokens() rows have 11
    rows = np.asarray(tokens(seed=4))
    P = max(lengths)
    prompt = np.zeros((2, P), np.int32)
    for b, n in enumerate(lengths):
        prompt[b, :n] = rows[b, :n]
    cache = KVCache.empty(model.cfg, 2, P + 4)
    decode = jax.jit(lambda m, t, c, n=None: m.decode(t, c, counts=n))  # one compilation per token count
    logits, cache = decode(model, jnp.asarray(prompt), cache, jnp.asarray(lengths))
    got = [[np.asarray(logits[b, n - 1])] for b, n in enumerate(lengths)]
    for step in range(3):  # feed the next real token of each row
        nxt = jnp.asarray([[rows[b, n + step]] for b, n in enumerate(lengths)])
        logits, cache = decode(model, nxt, cache)
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    for b, n in enumerate(lengths):
        full = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(rows[b:b + 1, :n + 3])))[0]  # [n+3, V]
        np.testing.assert_allclose(np.stack(got[b]), full[n - 1:n + 3], rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [n + 3 for n in lengths]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_causal_mask_future_tokens_do_not_change_past_logits(family):
    model = make(family)
    a = tokens(seed=1)
    b = a.at[:, 6:].set((a[:, 6:] + 17) % 263)  # change positions 6..10 only
    la, lb = model(a), model(b)
    np.testing.assert_array_equal(np.asarray(la[:, :6]), np.asarray(lb[:, :6]))
    assert not np.allclose(la[:, 6:], lb[:, 6:])


def test_segment_mask_isolates_packed_documents():
    model = make("llama")
    toks = tokens(B=1, seed=2)
    seg = jnp.array([[0] * 5 + [1] * 6])
    pos = jnp.array([list(range(5)) + list(range(6))])
    packed = model(toks, positions=pos, segment_ids=seg)
    alone = model(toks[:, 5:])  # the second document on its own
    np.testing.assert_allclose(np.asarray(packed[:, 5:]), np.asarray(alone), rtol=1e-5, atol=1e-6)


def test_gqa_equals_multi_head_with_repeated_kv_weights():
    """GQA with K kv heads is MHA whose head n uses kv head n // G: repeat each kv weight G times and compare."""
    gqa = make("llama")
    mha = make("llama", n_kv_heads=6)
    G = 6 // 2
    for name in ("wk", "wv"):
        getattr(mha.blocks, name)[...] = jnp.repeat(getattr(gqa.blocks, name)[...], G, axis=2)
    for name in ("embed", "lm_head", "final_norm"):
        getattr(mha, name)[...] = getattr(gqa, name)[...]
    for name in ("wq", "wo", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm"):
        getattr(mha.blocks, name)[...] = getattr(gqa.blocks, name)[...]
    toks = tokens(seed=3)
    np.testing.assert_allclose(np.asarray(gqa(toks)), np.asarray(mha(toks)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["full", "dots", "selective"])
def test_remat_matches_no_remat_in_value_and_grads(policy):
    model = make("llama")
    graphdef, params = nnx.split(model, nnx.Param)
    toks = tokens(seed=4)

    def loss(p, remat):
        return nnx.merge(graphdef, p)(toks, remat=remat).mean()

    l0, g0 = jax.value_and_grad(loss)(params, "none")
    l1, g1 = jax.value_and_grad(loss)(params, policy)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    assert_grads_match(g1, g0)
    # And it saves memory: the layers fit one scan trip here (n_layers <= scan_unroll), which XLA inlines — the case
    # where a checkpoint without CSE barriers was merged back into the forward and saved nothing (one policy shows
    # it: both go through the same checkpoint).
    assert model.cfg.n_layers <= model.cfg.scan_unroll
    if policy != "full":
        return
    temp = {r: jax.jit(jax.value_and_grad(loss), static_argnums=1).lower(params, r).compile().memory_analysis()
            .temp_size_in_bytes for r in ("none", policy)}
    assert temp[policy] < 0.8 * temp["none"], temp


def test_selective_remat_saves_the_named_activations_and_recomputes_the_core_attention():
    """Megatron's selective recomputation as a policy of named checkpoints: what the layers save for their backward
    (the layer scan's stacked outputs) is one array per named activation of the block (each linear layer's input
    and output), and nothing of the core attention — no [.., T, T] score or probability array, which no remat
    keeps."""
    import contextlib
    import io
    import re

    from jaxpar.model import CHECKPOINT_NAMES

    model = make("llama")
    graphdef, params = nnx.split(model, nnx.Param)
    toks = tokens(seed=4)
    L, (B, T) = model.cfg.n_layers, toks.shape

    def layer_residuals(remat):  # the shapes the layer scan stacks for the backward, one line each
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # (jax's public residual report prints)
            jax.ad_checkpoint.print_saved_residuals(lambda p: nnx.merge(graphdef, p)(toks, remat=remat).mean(),
                                                    params)
        shapes = [tuple(int(d) for d in m.group(1).split(",")) for line in out.getvalue().splitlines()
                  if "output of scan" in line and (m := re.match(r"\w+\[([\d,]+)\]", line))]
        return [s for s in shapes if s[0] == L and len(s) > 3]  # [L, …] activations (not [L, D, F] weights)

    selective, none = layer_residuals("selective"), layer_residuals("none")
    assert len(selective) == len(CHECKPOINT_NAMES) and all(s[1:3] == (B, T) for s in selective), selective
    assert not [s for s in selective if s[-2:] == (T, T)], selective
    assert [s for s in none if s[-2:] == (T, T)], none  # (the check can fail: without remat the scores are kept)


def test_bf16_compute_keeps_float32_params_and_logits():
    model = make("llama", dtype="bfloat16")
    logits = model(tokens())
    assert logits.dtype == jnp.float32 and model.blocks.wq.dtype == jnp.float32
    ref = make("llama")(tokens())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=5e-2)


# ---------------------------------------------------------------------------------------------------------------------
# The matmul seam and the attention kernel choice.


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_weight_matrix_goes_through_the_matmul_policy(family):
    """A policy that scales each weight by a per-parameter factor sees every matrix of the model exactly as often as
    the model uses it, and changes the logits only through it: the seam is the one place weights meet activations
    (what an int8 / fp8 / LoRA policy will rely on)."""
    import dataclasses

    from jaxpar.matmul import Einsum, Policies
    from jaxpar.parallel.context import Parallel

    seen = []

    @dataclasses.dataclass(frozen=True)
    class Recording(Einsum):
        def __call__(self, equation, x, w):
            seen.append(w.shape[-2:] if w.ndim > 2 else w.shape)
            return super().__call__(equation, x, w)

        def table(self, w, dtype):
            seen.append(("table", *w.shape))
            return super().table(w, dtype)

    model = make(family, n_layers=1)  # one layer: the scan body is traced once
    plain = model(tokens())
    recorded = model(tokens(), par=Parallel(matmul=Policies.every(Recording())))
    np.testing.assert_array_equal(recorded, plain)  # the default policy is the plain computation
    D, H, K, E, F, V = 22, 6, 2, 6, 13, 263
    want = [("table", V, D), (H, E), (K, E), (K, E), (E, D)] + ([(D, F)] if family == "gpt2" else [(D, F), (D, F)])
    want += [(F, D), (D, V)]
    assert seen == want

    @dataclasses.dataclass(frozen=True)
    class Zero(Einsum):
        def __call__(self, equation, x, w):
            return super().__call__(equation, x, w * 0)

    zeroed = model(tokens(), par=Parallel(matmul=Policies.every(Zero())))
    np.testing.assert_array_equal(zeroed, jnp.zeros_like(zeroed))  # the policy, not the model, applies the weights


def test_attention_kernel_is_chosen_where_the_config_meets_its_devices():
    import dataclasses

    from jaxpar.config import resolve_attention
    from jaxpar.plan import make_plan

    @dataclasses.dataclass
    class Device:
        platform: str
        device_kind: str

    h100, cpu = Device("gpu", "NVIDIA H100 80GB HBM3"), Device("cpu", "cpu")
    bf16 = ModelConfig(**PRIME | dict(head_dim=64, n_kv_heads=2), dtype="bfloat16")
    assert resolve_attention(bf16, h100).attention == "cudnn"
    assert resolve_attention(bf16, cpu).attention == "xla"
    assert resolve_attention(dataclasses.replace(bf16, dtype="float32"), h100).attention == "xla"  # cuDNN: 16-bit
    assert resolve_attention(dataclasses.replace(bf16, head_dim=6), h100).attention == "xla"  # head width it takes
    assert resolve_attention(dataclasses.replace(bf16, attention="xla"), h100).attention == "xla"  # asked for
    assert make_plan(bf16).model.attention == "xla"  # on this machine's CPU; the model itself never probes


@pytest.mark.parametrize("equation", ["btd,df->btf", "bthe,hed->btd", "btd,dhe->bthe", "td,df->tf"])
def test_token_einsum_equals_einsum_in_value_and_gradients(equation):
    """The matmul seam contracts the leading token dimensions as one (jaxpar.matmul.token_einsum): the same values
    and the same gradients for both operands as the plain einsum, on odd sizes."""
    from jaxpar.matmul import token_einsum

    sizes = dict(b=3, t=5, d=7, f=11, h=2, e=3)
    xs, rest = equation.split(",")
    ws = rest.split("->")[0]
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, tuple(sizes[c] for c in xs))
    w = jax.random.normal(kw, tuple(sizes[c] for c in ws))
    cot = jax.random.normal(kc, jnp.einsum(equation, x, w).shape)
    ours, ours_vjp = jax.vjp(lambda a, b: token_einsum(equation, a, b), x, w)
    ref, ref_vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b, preferred_element_type=jnp.float32), x, w)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(ours_vjp(cot), ref_vjp(cot)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
