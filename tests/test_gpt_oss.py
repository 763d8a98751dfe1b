"""gpt-oss (GptOssForCausalLM) against a fixture transformers wrote (tests/fixtures/hf/gpt_oss: a sliding and a full
layer, attention sinks, q/k/v/o biases, YaRN with unrounded ramp ends, 6 experts top-2 with a router bias, expert
biases and the clamped SwiGLU at limit 1.5, the fused interleaved gate_up_proj), and its mechanisms on every layout
kind — the router and expert biases, the clamped SwiGLU, the o bias, YaRN on GQA, the sinks and the alternating
windows — against the single-device model, loss and every gradient."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxpar.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from jaxpar.infer.text import load
from jaxpar.interop import hf
from jaxpar.model import Transformer
from jaxpar.train.step import loss_and_grads

from _parity import assert_grads_match, on_layout

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "gpt_oss"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
LOGITS = load_file(str(FIXTURE / "reference_logits.safetensors"))["logits"]


def test_config_maps_every_gpt_oss_feature():
    cfg = hf.model_config(hf.read_config(FIXTURE), FIXTURE)
    assert cfg.moe == MoEConfig(n_experts=6, top_k=2, d_ff=32, norm_topk_prob=True, aux_loss_coef=0.01,
                                router_bias=True, expert_bias=True, swiglu_limit=1.5, swiglu_alpha=1.702)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.attention_sinks, cfg.qk_norm) == (True, True, True, False)
    assert (cfg.sliding_window, cfg.full_attention_every, cfg.layer_windows) == (8, 2, (8, 0))
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_truncate) == ("yarn", 4.0, 32,
                                                                                                 False)


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_logits_match_transformers(tensor):
    loaded = load(FIXTURE, tensor=tensor)
    with jax.set_mesh(loaded.mesh):
        got = np.asarray(jax.jit(lambda m, x: m(x))(loaded.model, jnp.asarray(REFERENCE["input_ids"])))
    got = got[..., :LOGITS.shape[-1]]
    print(f"gpt_oss tensor {tensor}: max |Δ| {np.abs(got - LOGITS).max():.2e} (logits reach "
          f"{np.abs(LOGITS).max():.1f})")
    assert np.abs(got - LOGITS).max() < 1e-4


def test_each_mechanism_is_exercised():
    """Turned off one at a time on the same weights, each mechanism moves the logits away from transformers': the
    clamp (limit 1.5) bites, YaRN's unrounded ramp and its cos/sin factor, the window of the sliding layer."""
    loaded = load(FIXTURE)
    cfg, state = loaded.model.cfg, nnx.state(loaded.model)
    for change in (dict(moe=dataclasses.replace(cfg.moe, swiglu_limit=1e6)), dict(rope_truncate=True),
                   dict(full_attention_every=0), dict(rope_scaling="none")):
        other = nnx.merge(nnx.graphdef(Transformer(dataclasses.replace(cfg, **change), rngs=nnx.Rngs(0))), state)
        got = np.asarray(other(jnp.asarray(REFERENCE["input_ids"])))[..., :LOGITS.shape[-1]]
        assert np.abs(got - LOGITS).max() > 1e-3, change


@pytest.mark.parametrize("data,tensor", [(1, 1), (2, 2)])
def test_greedy_generation_matches_transformers(data, tensor):
    cases = REFERENCE["greedy"]
    loaded = load(FIXTURE, data=data, tensor=tensor)
    new = loaded.generate([c["prompt"] for c in cases], max_new_tokens=32, eos_token_id=None, return_prompt=False)
    assert new.tolist() == [c["new_tokens"] for c in cases]


def test_import_export_reproduces_every_tensor_bit_for_bit(tmp_path):
    """The fused interleaved expert tensors are split on import and interleaved again on export."""
    hf.import_to_workdir(FIXTURE, tmp_path / "workdir")
    hf.export_workdir(tmp_path / "workdir", tmp_path / "out", max_shard_bytes=200_000)
    want, got = load_file(str(FIXTURE / "model.safetensors")), {}
    for file in sorted((tmp_path / "out").glob("model*.safetensors")):
        got.update(load_file(str(file)))
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    index = json.loads((tmp_path / "out" / hf.INDEX).read_text())["weight_map"]  # sharded: the index lists all
    assert sorted(index) == sorted(want) and len(set(index.values())) > 1
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf.model_config(exported, tmp_path) == hf.model_config(hf.read_config(FIXTURE), FIXTURE)


def test_export_refuses_what_gpt_oss_cannot_hold():
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention_sinks=True,
                qkv_bias=True, o_bias=True, moe=MoEConfig(n_experts=4, router_bias=True, expert_bias=True,
                                                         swiglu_limit=7.0))
    hf.hf_config(ModelConfig(**base))  # gpt-oss holds it
    for change, field in ((dict(o_bias=False), "model.o_bias"), (dict(qk_norm=True), "model.qk_norm"),
                          (dict(moe=MoEConfig(n_experts=4, router_bias=True, expert_bias=True)), "moe.swiglu_limit"),
                          (dict(moe=MoEConfig(n_experts=4, expert_bias=True, swiglu_limit=7.0)), "moe.router_bias")):
        with pytest.raises(ConfigError, match=field):
            hf.hf_config(ModelConfig(**{**base, **change}))
    with pytest.raises(ConfigError, match="model.o_bias"):  # a dense model with an o bias: no architecture holds it
        hf.hf_config(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, o_bias=True))


# ---------------------------------------------------------------------------------------------------------------------
# The mechanisms on every layout kind

# 4 layers (sliding, full) twice: pipeline chunks of 2 hold the same kinds. 6 experts over expert 2; heads 4 over
# 2 kv heads; seq 16 with a window of 5.
OSS = dict(vocab_size=263, d_model=24, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=6, d_ff=20, max_seq_len=16,
           sliding_window=5, full_attention_every=2, attention_sinks=True, qkv_bias=True, o_bias=True,
           rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=8, rope_truncate=False, init_std=0.2,
           scan_unroll=1, moe=MoEConfig(n_experts=6, top_k=2, d_ff=20, router_bias=True, expert_bias=True,
                                        swiglu_limit=0.7, aux_loss_coef=0.01))
B, T = 16, 16


@pytest.fixture(scope="module")
def oss_reference():
    cfg = ModelConfig(**OSS)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(7)
    params = jax.tree_util.tree_map_with_path(  # the biases and sinks (born zero) drawn at random
        lambda path, a: a + 0.3 * rng.standard_normal(a.shape, np.float32) if jax.tree_util.keystr(path).split(
            "'")[-2] in ("bq", "bk", "bv", "bo", "sinks", "router_b", "we_gate_b", "we_up_b", "we_down_b") else a,
        params)
    batch = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    loss, grads = jax.jit(loss_and_grads(graphdef))(params, batch)
    return cfg, batch, params, loss, grads


OSS_LAYOUTS = {
    "(data, pipe, tensor) = (2, 2, 2) circular SP": dict(data=2, pipe=2, tensor=2, microbatches=2,
                                                         sequence_parallel=True),
    "(data, pipe, tensor) = (2, 2, 2) 1f1b": dict(data=2, pipe=2, tensor=2, microbatches=2, schedule="1f1b"),
    "(data, expert, tensor) = (2, 2, 2) SP": dict(data=2, expert=2, tensor=2, sequence_parallel=True),
    "(pipe, expert, tensor) = (2, 2, 2)": dict(pipe=2, expert=2, tensor=2, microbatches=2),
}


@pytest.mark.parametrize("layout", OSS_LAYOUTS)
def test_gpt_oss_mechanisms_match_the_single_device_model(oss_reference, layout):
    cfg, batch, params, want_loss, want_grads = oss_reference
    loss, grads = on_layout(cfg, params, batch, ParallelConfig(**OSS_LAYOUTS[layout]))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_grads_match(grads, want_grads)
