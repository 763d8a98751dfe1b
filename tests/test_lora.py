"""LoRA: adapters on chosen weight matrices, the rest frozen. The adapted model against the explicit
W + (alpha/r)·A·B on one device — the loss, and the adapters' gradients as the chain rule through the merged
weight gives them — on every layout kind; only the adapters are differentiated and only they carry optimizer
state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _parity import assert_grads_match, on_layout
from jaxpar.config import ConfigError, LoRAConfig, MoEConfig, ModelConfig, ParallelConfig
from jaxpar.model import Transformer, learnable, trainable
from jaxpar.train.step import loss_and_grads

TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# 4 layers, MoE in layers 1 and 3 (their attention adapted, the experts not), 2 kv heads (replicated at tensor 4)
CFG = dict(vocab_size=263, d_model=24, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=20, max_seq_len=16,
           init_std=0.2, scan_unroll=1,
           moe=MoEConfig(n_experts=4, top_k=2, d_ff=12, aux_loss_coef=0.0, dense_layers=(0, 2)))
RANK, ALPHA = 3, 6.0
B, T = 16, 16


def merged(params: dict, adapters: dict, scale: float) -> dict:
    """The base parameters with each adapted W replaced by W + scale·A·B (A [L, in…, r], B [L, r, out…])."""
    out = {stack: dict(layers) if isinstance(layers, dict) else layers for stack, layers in params.items()}
    for (stack, name), (a, b) in adapters.items():
        L, r = a.shape[0], a.shape[-1]
        product = jnp.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1))  # [L, in, out]
        out[stack][name] = params[stack][name] + scale * product.reshape(params[stack][name].shape)
    return out


@pytest.fixture(scope="module")
def reference():
    """(cfg with LoRA, its params with random adapters (B non-zero), batch, loss, the adapters' gradients)."""
    plain = ModelConfig(**CFG)
    cfg = ModelConfig(**CFG, lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    graphdef, base = nnx.split(Transformer(plain, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(3)
    pure = nnx.to_pure_dict(params)
    adapters = {}
    for stack in ("blocks", "dense_blocks"):
        for name in TARGETS:
            if name + "_lora_a" in pure[stack]:
                pure[stack][name + "_lora_b"] = jnp.asarray(
                    0.3 * rng.standard_normal(pure[stack][name + "_lora_b"].shape), jnp.float32)
                adapters[stack, name] = (pure[stack][name + "_lora_a"], pure[stack][name + "_lora_b"])
    nnx.replace_by_pure_dict(params, pure)
    # the adapted model's base weights are the plain model's (adapters draw from keys of their own)
    np.testing.assert_array_equal(pure["blocks"]["wq"], nnx.to_pure_dict(base)["blocks"]["wq"])
    batch = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    base_pure = nnx.to_pure_dict(base)
    plain_loss = loss_and_grads(graphdef)

    def loss_of(adapters):
        state = jax.tree.map(lambda x: x, base)
        nnx.replace_by_pure_dict(state, merged(base_pure, adapters, ALPHA / RANK))
        return plain_loss(state, batch)[0]

    loss, grads = jax.jit(jax.value_and_grad(loss_of))(adapters)
    want = {stack: {} for stack in ("blocks", "dense_blocks")}
    for (stack, name), (da, db) in grads.items():
        want[stack][name + "_lora_a"], want[stack][name + "_lora_b"] = da, db
    return cfg, params, batch, loss, want


def test_only_the_adapters_train(reference):
    cfg, params, batch, want_loss, want = reference
    learn = nnx.to_pure_dict(learnable(params))
    assert {k for layers in learn.values() for k in layers} == {f"{n}_lora_{x}" for n in TARGETS for x in "ab"}
    assert sum(x.size for x in jax.tree.leaves(learn)) < 0.25 * sum(x.size for x in jax.tree.leaves(
        trainable(params)))
    graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want)


def test_b_zero_starts_as_the_base_model(reference):
    cfg, params, batch, _, _ = reference
    fresh = Transformer(cfg, rngs=nnx.Rngs(0))
    plain = Transformer(ModelConfig(**CFG), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(fresh(batch[:, :-1]), plain(batch[:, :-1]), rtol=1e-6, atol=1e-6)


LAYOUTS = {
    "(data, pipe, tensor) = (2, 2, 2) circular SP, accumulation 2": (
        dict(data=2, pipe=2, tensor=2, microbatches=2, sequence_parallel=True), 2),
    "(data, expert, tensor) = (2, 2, 2) SP": (dict(data=2, expert=2, tensor=2, sequence_parallel=True), 1),
    "tensor 4 (kv heads replicated), expert 2": (dict(expert=2, tensor=4), 1),
    "(data, tensor) = (4, 2) SP, collective matmul": (dict(data=4, tensor=2, sequence_parallel=True,
                                                          overlap="collective_matmul"), 1),
    "(data, context, tensor) = (2, 2, 2) SP ring": (dict(data=2, context=2, tensor=2, sequence_parallel=True,
                                                         context_impl="ring"), 1),
    "(pipe, expert, tensor) = (2, 2, 2) ZB-H1 SP": (dict(pipe=2, expert=2, tensor=2, microbatches=4,
                                                          sequence_parallel=True, schedule="zb_h1"), 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapters_match_the_merged_weights_on_every_layout(reference, layout):
    cfg, params, batch, want_loss, want = reference
    parallel, accumulate = LAYOUTS[layout]
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**parallel), grad_accum=accumulate)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want)


# LoRA dropout: masks from global coordinates (jaxpar.matmul.LoRADropout), so every layout drops the same entries
# and the one-device run is the reference, values and gradients. The layouts: a circular pipeline with SP and
# accumulation (side inputs per microbatch, layer seeds in storage order), replicated kv heads (the adapters cut by
# kv_weight), context parallelism (zigzag coordinates) with SP, and a schedule table (seeds as chunk constants).
DROPOUT = 0.3
DROPOUT_LAYOUTS = ["(data, pipe, tensor) = (2, 2, 2) circular SP, accumulation 2",
                   "tensor 4 (kv heads replicated), expert 2", "(data, context, tensor) = (2, 2, 2) SP ring",
                   "(pipe, expert, tensor) = (2, 2, 2) ZB-H1 SP"]


@pytest.fixture(scope="module")
def dropped(reference):
    """(cfg with lora.dropout, params, the batch with its tokens' coordinates at step 7, one-device loss and
    gradients)."""
    import dataclasses

    from jaxpar.train.step import dropout_coords

    cfg, params, batch, plain_loss, _ = reference
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dropout=DROPOUT))
    batch = {"tokens": batch, "coords": dropout_coords(jnp.int32(7), B, T + 1, seed=0)}
    graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    assert abs(float(loss) - float(plain_loss)) > 1e-2  # the adapters' inputs were dropped
    # without coordinates (evaluation) nothing is dropped: the adapted model exactly
    np.testing.assert_allclose(jax.jit(loss_and_grads(graphdef))(params, batch["tokens"])[0], plain_loss, rtol=1e-5)
    return cfg, params, batch, loss, grads


@pytest.mark.parametrize("layout", DROPOUT_LAYOUTS)
def test_dropout_drops_the_same_entries_on_every_layout(dropped, layout):
    cfg, params, batch, want_loss, want = dropped
    parallel, accumulate = LAYOUTS[layout]
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**parallel), grad_accum=accumulate)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want)


def _mix(x):
    """lowbias32, written again in numpy (uint32 arithmetic wraps)."""
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def _keep(coords, features, layer, name, rate):
    """The documented mask in numpy: keep[token, feature] = mix(mix(coord ^ w) ^ mix(feature·φ + w)) ≥ rate·2³²."""
    import zlib

    w = _mix(np.uint32(layer) ^ np.uint32(zlib.crc32(name.encode())))
    with np.errstate(over="ignore"):
        feat = _mix(np.arange(features, dtype=np.uint32) * np.uint32(0x9E3779B9) + w)
    return _mix(_mix(coords ^ w)[..., None] ^ feat) >= np.uint32(round(rate * 2.0**32))


def test_dropout_is_the_documented_mask():
    """A column group and a row matmul under LoRA dropout against h·W + s·((keep ⊙ h)/(1 − p))·A·B with `keep`
    computed in numpy from the formula; the mask keeps 1 − p of the entries, and draws apart for another weight,
    layer or token; without coordinates or at rate 0 the context is the plain one."""
    from jaxpar.matmul import Adapted
    from jaxpar.parallel.context import Parallel

    rng = np.random.default_rng(0)
    rate, scale, layer = 0.4, 1.5, 12345
    h = rng.standard_normal((3, 5, 7)).astype(np.float32)  # [B, T, D]
    coords = rng.integers(0, 2**32, (3, 5), dtype=np.uint32)
    wq = Adapted(*(rng.standard_normal(s).astype(np.float32) for s in ((7, 2, 3), (7, 2), (2, 2, 3))), scale, "wq")
    wo = Adapted(*(rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 7), (2, 3, 2), (2, 7))), scale, "wo")
    par = Parallel().with_noise(rate, jnp.asarray(coords)).at_layer(jnp.uint32(layer))
    (got,) = par.column(jnp.asarray(h), (wq,), ("btd,dhe->bthe",), "attention")
    kept = h * _keep(coords, 7, layer, "wq", rate) / (1 - rate)
    want = np.einsum("btd,dhe->bthe", h, wq.base) + scale * np.einsum("btr,rhe->bthe", kept @ wq.a, wq.b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    o = rng.standard_normal((3, 5, 2, 3)).astype(np.float32)  # [B, T, H, E]: the feature index is h·E + e
    kept = o * _keep(coords, 6, layer, "wo", rate).reshape(3, 5, 2, 3) / (1 - rate)
    want = np.einsum("bthe,hed->btd", o, wo.base) + scale * np.einsum("bthe,her->btr", kept, wo.a) @ wo.b
    np.testing.assert_allclose(par.row(jnp.asarray(o), wo, "bthe,hed->btd", "attention"), want, rtol=1e-5, atol=1e-5)
    # statistics over 2^16 entries: 1 − p kept; another weight, layer or token agrees as independent masks would
    many = rng.integers(0, 2**32, (4, 256), dtype=np.uint32)
    a, b = _keep(many, 64, layer, "wq", rate), _keep(many, 64, layer, "wk", rate)
    c, d = _keep(many, 64, layer + 1, "wq", rate), _keep(many + np.uint32(1), 64, layer, "wq", rate)
    assert abs(a.mean() - (1 - rate)) < 0.01
    for other in (b, c, d):
        assert abs((a == other).mean() - ((1 - rate) ** 2 + rate**2)) < 0.01
    assert Parallel().with_noise(rate, None).noise is None and Parallel().with_noise(0.0, coords).noise is None


@pytest.mark.parametrize("fields,needle", [
    (dict(lora=LoRAConfig(rank=2, targets=("q_proj",))), "lora.targets"),
    (dict(lora=LoRAConfig(rank=2, targets=("we_gate",))), "lora.targets"),
    (dict(lora=LoRAConfig(rank=2, targets=("router",))), "lora.targets"),
])
def test_targets_that_are_not_adaptable_are_refused(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(**{**CFG, **fields})


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """recipes/lora_tiny.yaml from the llama fixture, 40 steps at (data, pipe, tensor) = (2, 2, 2) SP."""
    import os

    from jaxpar.config import load_config
    from jaxpar.interop import hf
    from jaxpar.train import fit

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        config = load_config("recipes/lora_tiny.yaml", ["train.steps=40", "train.eval_every=40",
                                                        "train.log_every=40"])
        workdir = tmp_path_factory.mktemp("lora") / "w"
        result = fit(hf.init_config(config, FIXTURES / "llama"), workdir, progress=False)
    finally:
        os.chdir(here)
    return workdir, result


def test_the_lora_recipe_learns_and_keeps_the_base(lora_run):
    """The adapters learn the chat format (held-out loss on the assistant's tokens under 0.5 of the first step's);
    every frozen weight is exactly the imported one; the optimizer's state holds the adapters alone."""
    from jaxpar.infer.text import load

    workdir, result = lora_run
    first, last = result.history[0], result.history[-1]
    assert last["eval_loss"] < 0.5 * first["loss"], (first, last)
    trained = nnx.to_pure_dict(nnx.state(load(workdir).model, nnx.Param))
    imported = nnx.to_pure_dict(nnx.state(load(FIXTURES / "llama").model, nnx.Param))
    for stack in ("blocks",):
        for name in ("wq", "w_down", "attn_norm"):
            np.testing.assert_array_equal(np.asarray(trained[stack][name]), np.asarray(imported[stack][name]))
    opt = sum(x.size for x in jax.tree.leaves(result.state.opt_state) if hasattr(x, "size") and x.ndim)
    adapters = sum(x.size for x in jax.tree.leaves(learnable(result.state.params)))
    assert opt == 2 * adapters  # Adam's two moments, of the adapters only


def test_merged_and_peft_exports(lora_run, tmp_path):
    """--to-hf writes W + (alpha/r)·A·B: the exported model's logits equal the adapted model's, and so do the
    serving engine's greedy tokens on the adapted workdir; --to-peft writes PEFT's tensors and config (PEFT itself
    loads them in `test_transformers_and_peft_load_the_exports`, where it is installed)."""
    import json

    from safetensors.numpy import load_file

    from jaxpar.cli import main
    from jaxpar.infer.text import load

    workdir, _ = lora_run
    assert main(["convert", "--from", str(workdir), "--to-hf", str(tmp_path / "merged")]) == 0
    assert main(["convert", "--from", str(workdir), "--to-peft", str(tmp_path / "peft")]) == 0
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 515, (2, 40)))
    adapted, merged = load(workdir), load(tmp_path / "merged")
    # fp32: merged W + s·A·B against x·W + s·(x·A)·B — the bar, max |Δ| ≤ 1e-4 (measured 1.6e-5)
    np.testing.assert_allclose(merged.model(ids)[..., :515], adapted.model(ids)[..., :515], rtol=0, atol=1e-4)
    settings = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert settings["r"] == 8 and settings["lora_alpha"] == 16.0 and settings["peft_type"] == "LORA"
    assert settings["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (8, 64) and b.shape == (64, 8)  # [r, hidden], [heads·head_dim, r]
    # the serving engine runs the adapted workdir as it is (adapters unmerged, tensor 2): its greedy tokens are the
    # merged export's plain greedy generation's
    from jaxpar.serve import Engine, EngineConfig, SamplingParams

    prompts = [[7, 300, 41, 12, 99], [3, 5, 8, 13, 21, 34, 55, 89, 144]]
    want = merged.generate(prompts, max_new_tokens=16, return_prompt=False)
    served = load(workdir, tensor=2)
    engine = Engine(served.model, EngineConfig(max_batch=4, page_size=4, prefill_chunk=8, prefill_rows=2),
                    plan=served.plan)
    with jax.set_mesh(served.mesh):
        got = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert got == np.asarray(want).tolist()


def test_transformers_and_peft_load_the_exports(lora_run, tmp_path):
    """Where torch, transformers and peft are installed (not in CI): the merged export in transformers and the PEFT
    export on the transformers base model give the adapted model's logits (max |Δ| ≤ 1e-4; measured 2.3e-5 and
    3.2e-5 with transformers 5.24, peft 0.21.2)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from jaxpar.cli import main
    from jaxpar.infer.text import load

    workdir, _ = lora_run
    assert main(["convert", "--from", str(workdir), "--to-hf", str(tmp_path / "merged")]) == 0
    assert main(["convert", "--from", str(workdir), "--to-peft", str(tmp_path / "peft")]) == 0
    ids = np.random.default_rng(0).integers(0, 515, (2, 40))
    want = np.asarray(load(workdir).model(jnp.asarray(ids)))[..., :515]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base.float(), tmp_path / "peft")
    with torch.no_grad():
        for model in (merged.float().eval(), adapted.eval()):
            np.testing.assert_allclose(model(torch.tensor(ids)).logits.numpy(), want, rtol=0, atol=1e-4)


def test_qlora_trains_adapters_over_int8_weights(monkeypatch, tmp_path):
    """LoRA over an int8 base (QLoRA-style), with LoRA dropout 0.1: the import quantizes the Hugging Face weights as
    `jaxpar convert --quantize int8` does, they stay frozen integers, the adapters learn (held-out loss under 0.5 of
    the first step's), the merged export is a float model, and the PEFT export records the dropout."""
    from jaxpar.cli import main
    from jaxpar.config import load_config
    from jaxpar.infer.text import load
    from jaxpar.interop import hf
    from jaxpar.train import fit

    monkeypatch.chdir(ROOT)
    config = load_config("recipes/lora_tiny.yaml", ["model.weights=int8", "lora.dropout=0.1", "train.steps=40",
                                                    "train.eval_every=40", "train.log_every=40"])
    result = fit(hf.init_config(config, FIXTURES / "llama"), tmp_path / "w", progress=False)
    first, last = result.history[0], result.history[-1]
    assert last["eval_loss"] < 0.5 * first["loss"], (first, last)
    stored = nnx.to_pure_dict(result.state.params)["blocks"]
    assert stored["wq"].dtype == jnp.int8 and "wq_scale" in stored and "wq_lora_a" in stored
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "merged")]) == 0
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-peft", str(tmp_path / "peft")]) == 0
    settings = __import__("json").loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert settings["lora_dropout"] == 0.1
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 515, (2, 24)))
    merged = load(tmp_path / "merged")
    assert merged.config.model.weights == "float"
    np.testing.assert_allclose(merged.model(ids)[..., :515], load(tmp_path / "w").model(ids)[..., :515], rtol=0,
                               atol=1e-4)
