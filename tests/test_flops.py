"""FLOP formulas (`jaxpar.flops`) against what XLA compiles, and the device peak table.

Causal-mask convention: model FLOPs (MFU's numerator) count only the (query, key) pairs the causal mask keeps,
(s + 1)/2 keys per query — the attention term halved. XLA's attention (every CPU run) computes the whole s × s score
matrix and masks it afterwards, so a compiled step is compared with `hardware_flops_per_token(full_attention=True)`.

Loops: XLA's `cost_analysis()` counts a while-loop body once, whatever its trip count, and the layers run under a
scan. So `cost_analysis()` is compared at n_layers = 1 (the one body is the whole model; it also counts elementwise
work — norms, softmax, activations, Adam — so it reads 1–2% above the matmul formula: 1.8% for both cases here)
and, more tightly, with the HLO's matmul count (`jaxpar.analysis.dot_flops`, which multiplies loop
bodies by their trip counts: tests/test_analysis.py checks it at several layers).
"""

import dataclasses
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar import flops
from jaxpar.analysis import cost, dot_flops
from jaxpar.config import ModelConfig, load_config
from jaxpar.model import KVCache, Transformer
from jaxpar.train import build_trainer

B, S = 8, 64
# d_model large next to S and the vocab, so matmuls dominate the elementwise work cost_analysis also counts.
BASE = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=704", "model.vocab_size=256",
        f"model.max_seq_len={S}", f"train.seq_len={S}", f"train.batch_size={B}", "model.attention=xla"]


def compiled_step(overrides):
    config = load_config(None, BASE + overrides)
    trainer = build_trainer(config, None)
    batch = jax.ShapeDtypeStruct((B, S + 1), jnp.int32)
    return config, trainer.train_step.lower(trainer.state, batch).compile()


@pytest.mark.parametrize("overrides, remat", [
    (["model.family=llama"], "dots"),  # GQA, untied head; the attention products are recomputed
    (["model.family=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true"], "full"),  # tied; whole layer again
], ids=["llama-gqa-untied-remat-dots", "gpt2-tied-remat-full"])
def test_train_flops_match_cost_analysis(overrides, remat):
    config, compiled = compiled_step(overrides + ["model.n_layers=1", f"parallel.remat={remat}"])
    want = flops.hardware_flops_per_token(config.model, S, remat=remat, full_attention=True) * B * S
    got = cost(compiled)["flops"]
    print(f"cost_analysis {got / 1e9:.4f} GFLOP, formula {want / 1e9:.4f} GFLOP, ratio {got / want:.4f}")
    assert want <= got <= 1.02 * want  # the matmuls, plus under 2% of elementwise work
    # The matmuls alone agree exactly; the model FLOPs (causal pairs, no recomputation) are fewer.
    assert dot_flops(compiled) == pytest.approx(want, rel=1e-3)
    assert flops.train_flops_per_token(config.model, S) * B * S < want


def test_inference_flops_match_compiled_prefill_and_decode():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=128, max_seq_len=S,
                      attention="xla")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.ShapeDtypeStruct((2, S), jnp.int32)
    prefill = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, tokens).compile()
    keys_full = flops.forward_flops_per_token(cfg, S, keys=S).total  # what XLA executes: the whole square
    assert dot_flops(prefill) == pytest.approx(keys_full * 2 * S, rel=1e-3)
    assert flops.prefill_flops_per_token(cfg, S) < keys_full  # the model count keeps the causal pairs only
    # One decode step reads all S cache slots (masked): the formula at context S.
    cache = KVCache.empty(cfg, 2, S)
    decode = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).decode(t, c)).lower(
        params, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache).compile()
    assert dot_flops(decode) == pytest.approx(flops.decode_flops_per_token(cfg, S) * 2, rel=1e-3)


def test_causal_and_window_key_counts():
    assert flops.attended_keys(8, causal=False) == 8
    assert flops.attended_keys(8) == 4.5  # (1 + 2 + … + 8) / 8
    assert flops.attended_keys(8, window=3) == (1 + 2 + 3 * 6) / 8
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=128)
    fwd, full = flops.forward_flops_per_token(cfg, 128), flops.forward_flops_per_token(cfg, 128, keys=128)
    assert fwd.attention == pytest.approx(full.attention * 129 / 256)  # (s + 1)/2 of s: "halved"
    assert fwd.head == full.head == 2 * 64 * 128  # tied or not: one head matmul; the embedding lookup is free
    tied = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=128, tie_embeddings=True)
    assert flops.train_flops_per_token(tied, 128) == flops.train_flops_per_token(cfg, 128)
    assert flops.decode_flops_per_token(cfg, 100) - flops.decode_flops_per_token(cfg, 50) == 2 * 4 * 4 * 16 * 50


@pytest.mark.parametrize("kind, dtype, precision, tflops", [
    ("NVIDIA H200", "bfloat16", None, 989.4),
    ("NVIDIA H100 80GB HBM3", "bfloat16", None, 989.4),
    ("NVIDIA H100 PCIe", "float16", None, 756.0),
    ("NVIDIA H100 NVL", "bfloat16", None, 835.5),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", None, 312.0),
    ("NVIDIA A100-SXM4-40GB", "float32", None, 156.0),  # JAX's default precision: TF32 tensor cores
    ("NVIDIA A100 80GB PCIe", "float32", "highest", 19.5),  # true float32
    ("NVIDIA H200", "float32", "float32", 66.9),
    ("NVIDIA H100 80GB HBM3", "float8", None, 1978.9),
    ("NVIDIA A100-SXM4-80GB", "float8", None, None),  # no FP8 tensor cores
])
def test_peak_table(kind, dtype, precision, tflops):
    assert flops.peak_flops(kind, dtype, precision) == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_an_fp8_run_is_measured_against_the_mix_of_peaks_its_flops_run_at():
    """model.matmul = fp8_rowwise: the block's matmuls forward and for the input gradient at the FP8 peak, the rest
    (their weight gradient, the attention core, the head) at bf16's — a time-weighted (harmonic) mix; float runs and
    devices without FP8 keep the compute dtype's peak."""
    from types import SimpleNamespace

    cfg = ModelConfig(family="llama", vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                      head_dim=128, d_ff=5632, max_seq_len=2048, dtype="bfloat16")
    h100, a100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3"), SimpleNamespace(device_kind="NVIDIA A100")
    fp8 = dataclasses.replace(cfg, matmul="fp8_rowwise")
    fwd = flops.forward_flops_per_token(cfg, 2048)
    f8, rest = 2 * fwd.layers_dense, 3 * fwd.total - 2 * fwd.layers_dense
    want = 3 * fwd.total / (f8 / 1978.9e12 + rest / 989.4e12)
    assert flops.training_peak(fp8, 2048, h100) == pytest.approx(want)
    assert 989.4e12 < want < 1978.9e12
    assert flops.training_peak(cfg, 2048, h100) == pytest.approx(989.4e12)
    assert flops.training_peak(fp8, 2048, a100) == pytest.approx(312.0e12)


def test_cpu_has_no_peak_and_reports_achieved_flops_only():
    assert flops.peak_flops("cpu", "float32") is None
    assert flops.device_peak(jax.devices()[0], "float32") is None
    assert flops.utilisation(2e12, 1.0, 2, None) == {"tflops_per_device": 1.0}
    assert flops.utilisation(2e12, 1.0, 2, 2e12) == {"tflops_per_device": 1.0, "mfu": 0.5}
