"""The Hugging Face export, checked against the format itself rather than against jaxpar's own reader.

Without torch and transformers in CI, `test_hf.py::test_export_loads_in_transformers` skips; this file checks the
same promise independently, with nothing but NumPy and the HF conventions written out below:

1. A hand-written safetensors parser (8-byte little-endian header length, JSON header, raw little-endian data —
   no `safetensors` library, no `jaxpar.interop.hf`) reads every file, and the tensor names, shapes and dtypes must be
   exactly those `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` / `GPT2LMHeadModel` build for the
   exported config.json; every file carries `{"format": "pt"}`; the index's weight_map and total_size are right.
2. A NumPy forward pass of each HF architecture, written from the HF modeling conventions, is first shown faithful
   to transformers on the fixtures (their logits, made by transformers 5.24 itself; see
   tests/fixtures/hf/make_hf_fixtures.py) and then run on the export of models trained in jaxpar, where it must
   give jaxpar's own logits.

The NumPy forward runs in float64, so its differences to either side are the other side's float32 rounding.

HF conventions used (transformers' modeling_llama / modeling_mistral / modeling_qwen2 / modeling_gpt2):

* Llama family: torch Linear weights [out, in] (y = x @ W.T + b); q_proj rows head-major (row h·E + e); RMSNorm
  w · x / sqrt(mean(x²) + eps); RoPE rotate-half (dim d pairs with d + E/2), inv_freq θ^(−2k/E), with 'linear' or
  'llama3' rescaling; GQA: query head h reads kv head h // (H/K); scale E^−½; SwiGLU down(silu(gate x) · up x);
  Qwen2 adds q/k/v biases; Mistral windows every layer (keys i − W < j ≤ i); tied heads have no lm_head.weight.
* GPT-2: Conv1D weights [in, out] (y = x @ W + b); c_attn [D, 3D] columns [q | k | v]; learned positions wpe;
  pre-LayerNorm blocks; gelu_new (tanh); ln_f; logits = h @ wte.T (tied) or lm_head.weight [V, D] (untied).
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ConfigError, ModelConfig, load_config
from jaxpar.infer.text import load
from jaxpar.interop.hf import export_workdir, save_params
from jaxpar.model import abstract_model
from jaxpar.train import fit

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
ROOT = pathlib.Path(__file__).parent.parent

# -----------------------------------------------------------------------------------------------------------------
# safetensors, by hand: [u64 little-endian n][n bytes of JSON header][data]. Header: name → {"dtype", "shape",
# "data_offsets": [begin, end)} with offsets into the data, which they must cover exactly (no holes, no overlaps);
# optional "__metadata__": {str: str}.

WIDTH = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
TORCH_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # config.json's torch_dtype → header dtype


def read_safetensors(file: pathlib.Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(metadata, name → float64 array, name → header dtype) of one safetensors file, checking its layout."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert 8 + n <= len(data) and data[8:9] == b"{", f"{file}: header length {n} of a {len(data)}-byte file"
    header = json.loads(data[8:8 + n])
    buffer = memoryview(data)[8 + n:]
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), metadata
    tensors, dtypes, spans = {}, {}, []
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        assert dtype in WIDTH, f"{file}: {name} has dtype {dtype}, not a float weight"
        assert end - begin == math.prod(shape) * WIDTH[dtype], f"{file}: {name}'s offsets disagree with its shape"
        raw = np.frombuffer(buffer[begin:end], np.uint8)
        if dtype == "BF16":  # the top half of a float32: shift the 16 bits up
            value = (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
        else:
            value = raw.view({"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype])
        tensors[name], dtypes[name] = value.reshape(shape).astype(np.float64), dtype
        spans.append((begin, end))
    spans.sort()
    assert [b for b, _ in spans] == [0] + [e for _, e in spans[:-1]], f"{file}: holes or overlaps in the data"
    assert spans[-1][1] == len(buffer), f"{file}: {len(buffer) - spans[-1][1]} bytes after the last tensor"
    return metadata, tensors, dtypes


def read_hf_dir(path: pathlib.Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(config.json, tensors, dtypes) of an HF directory — one model.safetensors or the index's shards — checking the
    index against the files: weight_map names every tensor of every shard, each in the file that holds it, and
    total_size is the bytes of all tensors."""
    config = json.loads((path / "config.json").read_text())
    index_file = path / "model.safetensors.index.json"
    files = sorted(p.name for p in path.glob("model*.safetensors"))
    tensors, dtypes, where = {}, {}, {}
    for file in files:
        metadata, t, d = read_safetensors(path / file)
        assert metadata.get("format") == "pt", f"{file}: metadata {metadata} (transformers wants format 'pt')"
        assert not set(t) & set(tensors), f"{file}: tensors also in another file"
        tensors.update(t)
        dtypes.update(d)
        where.update({name: file for name in t})
    if index_file.exists():
        assert "model.safetensors" not in files
        index = json.loads(index_file.read_text())
        assert index["weight_map"] == where
        assert index["metadata"]["total_size"] == sum(t.size * WIDTH[dtypes[n]] for n, t in tensors.items())
    else:
        assert files == ["model.safetensors"], files
    return config, tensors, dtypes


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor that `save_pretrained` writes for this config.json (the HF modules' parameters;
    a tied head is the embedding, so no lm_head.weight)."""
    arch = config["architectures"][0]
    V, out = config["vocab_size"], {}
    if arch == "GPT2LMHeadModel":
        D, F, P = config["n_embd"], config.get("n_inner") or 4 * config["n_embd"], config["n_positions"]
        out.update({"transformer.wte.weight": (V, D), "transformer.wpe.weight": (P, D),
                    "transformer.ln_f.weight": (D,), "transformer.ln_f.bias": (D,)})
        for l in range(config["n_layer"]):
            p = f"transformer.h.{l}."
            out.update({p + "ln_1.weight": (D,), p + "ln_1.bias": (D,), p + "ln_2.weight": (D,), p + "ln_2.bias": (D,),
                        p + "attn.c_attn.weight": (D, 3 * D), p + "attn.c_attn.bias": (3 * D,),
                        p + "attn.c_proj.weight": (D, D), p + "attn.c_proj.bias": (D,),
                        p + "mlp.c_fc.weight": (D, F), p + "mlp.c_fc.bias": (F,),
                        p + "mlp.c_proj.weight": (F, D), p + "mlp.c_proj.bias": (D,)})
        tied = config.get("tie_word_embeddings", True)
    else:
        assert arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), arch
        D, F, H = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
        K = config.get("num_key_value_heads") or H
        E = config.get("head_dim") or D // H
        out.update({"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)})
        for l in range(config["num_hidden_layers"]):
            p = f"model.layers.{l}."
            out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                        p + "self_attn.q_proj.weight": (H * E, D), p + "self_attn.k_proj.weight": (K * E, D),
                        p + "self_attn.v_proj.weight": (K * E, D), p + "self_attn.o_proj.weight": (D, H * E),
                        p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                        p + "mlp.down_proj.weight": (D, F)})
            if arch == "Qwen2ForCausalLM":  # q/k/v biases; o_proj has none
                out.update({p + "self_attn.q_proj.bias": (H * E,), p + "self_attn.k_proj.bias": (K * E,),
                            p + "self_attn.v_proj.bias": (K * E,)})
            if arch == "Qwen3ForCausalLM":  # the q/k norm: one scale [E] each, shared by the heads
                out.update({p + "self_attn.q_norm.weight": (E,), p + "self_attn.k_norm.weight": (E,)})
        tied = config.get("tie_word_embeddings", False)
    if not tied:
        out["lm_head.weight"] = (V, D)
    return out


def check_format(path: pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """read_hf_dir plus: exactly the expected names and shapes, every tensor in config.json's dtype."""
    config, tensors, dtypes = read_hf_dir(path)
    want = expected_tensors(config)
    assert sorted(tensors) == sorted(want), sorted(set(tensors) ^ set(want))
    assert {n: t.shape for n, t in tensors.items()} == want
    dtype = TORCH_DTYPE[config.get("torch_dtype") or config.get("dtype")]
    assert set(dtypes.values()) == {dtype}, set(dtypes.values())
    return config, tensors


# -----------------------------------------------------------------------------------------------------------------
# The forward passes, in float64. B batch, T positions, D width, H query heads, K kv heads, E head width.


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
    """Causal softmax attention: q, k, v [B, H, T, E] → [B, T, H·E]. Query i sees keys j ≤ i (and j > i − window)."""
    B, H, T, E = q.shape
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    scores = np.where(allowed, q @ k.swapaxes(-1, -2) / math.sqrt(E), -np.inf)  # [B, H, T, T]
    return (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * E)


def rope_inv_freq(config: dict, E: int) -> np.ndarray:
    """inv_freq [E/2] (transformers' modeling_rope_utils: default, linear, llama3), from either config spelling."""
    params = config.get("rope_parameters") or {**(config.get("rope_scaling") or {}),
                                                "rope_theta": config.get("rope_theta", 10000.0)}
    inv = 1.0 / params.get("rope_theta", config.get("rope_theta", 10000.0)) ** (np.arange(0, E, 2) / E)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear":
        return inv / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)  # long wavelengths: interpolated fully
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)  # in between: blended
        return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    assert kind == "default", kind
    return inv


def llama_windows(config: dict) -> list[int | None]:
    """The sliding window of each layer (None: full causal), by the Mistral and Qwen2 / Qwen3 config rules."""
    L, arch = config["num_hidden_layers"], config["architectures"][0]
    if arch == "MistralForCausalLM":
        return [config.get("sliding_window")] * L
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and config.get("use_sliding_window"):
        kinds = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention" for i in range(L)]
        return [config["sliding_window"] if kind == "sliding_attention" else None for kind in kinds]
    return [None] * L


def llama_forward(config: dict, w: dict[str, np.ndarray], ids: np.ndarray, *, rope_pairs: str = "half",
                  windows: list[int | None] | None = None) -> np.ndarray:
    """Logits [B, T, V] of LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (which
    RMS-normalises each query and key head before RoPE). `rope_pairs='interleaved'` (the
    GPT-J/Meta-checkpoint convention, wrong for HF files) and `windows` exist for the negative controls."""
    B, T = ids.shape
    D, H, eps = config["hidden_size"], config["num_attention_heads"], config["rms_norm_eps"]
    K = config.get("num_key_value_heads") or H
    E = config.get("head_dim") or D // H
    windows = llama_windows(config) if windows is None else windows

    def rms_norm(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

    angles = np.arange(T)[:, None] * rope_inv_freq(config, E)[None, :]  # [T, E/2]
    if rope_pairs == "half":  # dim d pairs with d + E/2
        cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

        def rope(x):  # [B, n, T, E]
            return x * cos + np.concatenate([-x[..., E // 2:], x[..., :E // 2]], -1) * sin
    else:  # dim 2i pairs with 2i + 1
        cos, sin = np.cos(np.repeat(angles, 2, -1)), np.sin(np.repeat(angles, 2, -1))

        def rope(x):
            pairs = x.reshape(*x.shape[:-1], E // 2, 2)
            return x * cos + np.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape) * sin

    def project(x, name, n):  # torch Linear: x @ W.T (+ b), then heads: [B, T, n·E] → [B, n, T, E]
        y = x @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)
        return y.reshape(B, T, n, E).transpose(0, 2, 1, 3)

    h = w["model.embed_tokens.weight"][ids]  # [B, T, D]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q, k = project(x, p + "self_attn.q_proj", H), project(x, p + "self_attn.k_proj", K)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3
            q, k = rms_norm(q, w[p + "self_attn.q_norm.weight"]), rms_norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        v = project(x, p + "self_attn.v_proj", K)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # repeat_kv: kv head j → heads j·H/K + …
        h = h + attend(q, k, v, windows[l]) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"])
    return h @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def gpt2_forward(config: dict, w: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of GPT2LMHeadModel."""
    B, T = ids.shape
    D, H, eps = config["n_embd"], config["n_head"], config.get("layer_norm_epsilon", 1e-5)
    pre = "transformer."

    def layer_norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def conv1d(x, name):  # GPT-2's Conv1D: x @ W + b with W [in, out]
        return x @ w[name + ".weight"] + w[name + ".bias"]

    def heads(x):  # [B, T, D] → [B, H, T, D/H]
        return x.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)

    h = w[pre + "wte.weight"][ids] + w[pre + "wpe.weight"][np.arange(T)]
    for l in range(config["n_layer"]):
        p = f"{pre}h.{l}."
        q, k, v = np.split(conv1d(layer_norm(h, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        h = h + conv1d(attend(heads(q), heads(k), heads(v), None), p + "attn.c_proj")
        u = conv1d(layer_norm(h, p + "ln_2"), p + "mlp.c_fc")
        gelu = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        h = h + conv1d(gelu, p + "mlp.c_proj")
    h = layer_norm(h, pre + "ln_f")
    return h @ w.get("lm_head.weight", w[pre + "wte.weight"]).T


def forward(config: dict, w: dict[str, np.ndarray], ids, **kw) -> np.ndarray:
    ids = np.asarray(ids)
    fn = gpt2_forward if config["architectures"][0] == "GPT2LMHeadModel" else llama_forward
    return fn(config, w, ids, **kw)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# -----------------------------------------------------------------------------------------------------------------
# 1. The checker against transformers' own files and logits


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "qwen3"])
def test_numpy_forward_matches_transformers(name):
    """On transformers-made fixtures: the hand parser and expected names accept them, and the NumPy forward gives
    transformers' logits (a batch of 2×13 and the 36- and 40-token greedy texts) to float32 rounding."""
    config, weights = check_format(FIXTURES / name)
    _, stored, _ = read_safetensors(FIXTURES / name / "reference_logits.safetensors")
    reference = json.loads((FIXTURES / name / "reference.json").read_text())
    errors = [relative_error(forward(config, weights, reference["input_ids"]), stored["logits"])]
    for k, case in enumerate(reference["greedy"]):
        ids = [case["prompt"] + case["new_tokens"][:-1]]
        errors.append(relative_error(forward(config, weights, ids)[0], stored[f"greedy_{k}_logits"]))
    print(f"{name}: NumPy forward against transformers' logits, relative error {max(errors):.2e}")
    assert max(errors) < 5e-6, errors  # measured: llama 2.5e-6, qwen2 1.5e-6, mistral 1.2e-6, gpt2 1.0e-6
    if name == "mistral":  # the window (16) is exercised: without it the 40-token text's logits differ
        ids = [reference["greedy"][1]["prompt"] + reference["greedy"][1]["new_tokens"][:-1]]
        full = forward(config, weights, ids, windows=[None] * config["num_hidden_layers"])[0]
        assert relative_error(full, stored["greedy_1_logits"]) > 1e-2
    if name == "llama":  # the RoPE convention is exercised: interleaved pairs give other logits
        wrong = forward(config, weights, reference["input_ids"], rope_pairs="interleaved")
        assert relative_error(wrong, stored["logits"]) > 1e-2


# -----------------------------------------------------------------------------------------------------------------
# 2. The checker on the export of models trained in jaxpar

VOCAB = 263  # prime sizes: a transposed or mis-split axis cannot line up by accident
COMMON = ["data.source=synthetic", "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1",
          "parallel.microbatches=1", "train.batch_size=4", "train.seq_len=24", "train.steps=3", "train.lr=1e-2",
          "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
          f"model.vocab_size={VOCAB}", "model.d_model=40", "model.n_layers=3", "model.max_seq_len=48",
          "model.init_std=0.2"]  # init_std 0.2, not 0.02: attention far from uniform, so a layout error shows
TRAINED = {
    # untied head, GQA 4q/2kv with head_dim 10, llama3 RoPE with all three regimes: of the 5 wavelengths
    # 2π·5000^(k/5) = 6.3, 35, 190, … one is below original_max/high = 10 (kept), one between 10 and 40 (blended),
    # three above 40 (divided by the factor)
    "llama": ["model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=72", "model.rope_theta=5000.0",
              "model.rope_scaling=llama3", "model.rope_factor=4.0", "model.rope_original_max_len=40"],
    # tied head, 4 heads of 10, n_inner 88
    "gpt2": ["model.family=gpt2", "model.n_heads=4", "model.n_kv_heads=0", "model.d_ff=88",
             "model.tie_embeddings=true"],
}
IDS = np.random.RandomState(1).randint(0, VOCAB, size=(2, 29)).astype(np.int32)  # T = 29 < max_seq_len 48


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family → workdir of a model trained 3 steps by jaxpar.train.fit on one device."""
    out = {}
    for family, overrides in TRAINED.items():
        config = load_config(str(ROOT / "configs" / "tiny.py"), COMMON + overrides)
        workdir = tmp_path_factory.mktemp(family)
        result = fit(config, workdir, devices=jax.devices()[:1], progress=False)
        assert result.history[-1]["loss"] < result.history[0]["loss"]  # it trained
        out[family] = workdir
    return out


def jaxpar_logits(workdir: pathlib.Path) -> np.ndarray:
    loaded = load(workdir, tensor=1, devices=jax.devices()[:1])
    return np.asarray(loaded.model(IDS))[..., :VOCAB]


@pytest.mark.parametrize("family,arch,sharded", [("llama", "LlamaForCausalLM", True), ("gpt2", "GPT2LMHeadModel",
                                                                                     False)])
def test_export_of_a_trained_model_matches_jaxpar(trained, tmp_path, family, arch, sharded):
    """The export has HF's names, shapes, dtype, metadata and (llama: sharded) index, its config.json describes the
    trained model, and the NumPy forward of the files gives jaxpar's logits."""
    export_workdir(trained[family], tmp_path / "hf", max_shard_bytes=100_000 if sharded else 2 << 30)
    assert (len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1) == sharded
    config, weights = check_format(tmp_path / "hf")
    assert config["architectures"] == [arch]
    want = jaxpar_logits(trained[family])
    error = relative_error(forward(config, weights, IDS), want)
    print(f"{family}: NumPy forward of the export against jaxpar's logits, relative error {error:.2e}")
    assert error < 3e-6, error  # measured: llama 8.2e-7, gpt2 3.9e-7
    if family == "llama":  # the trained weights make the RoPE convention matter here too
        assert relative_error(forward(config, weights, IDS, rope_pairs="interleaved"), want) > 1e-2


def test_bfloat16_export_rounds_each_weight_to_nearest_even(trained, tmp_path):
    """`--dtype bfloat16`: every tensor BF16, config.json says so, and each value is its float32 export rounded to
    nearest, ties to even (checked on the bits)."""
    export_workdir(trained["llama"], tmp_path / "f32")
    export_workdir(trained["llama"], tmp_path / "bf16", dtype="bfloat16")
    config, bf16 = check_format(tmp_path / "bf16")
    assert (config.get("torch_dtype") or config.get("dtype")) == "bfloat16"
    _, f32 = check_format(tmp_path / "f32")
    for name, x in f32.items():
        bits = x.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).view(np.float32)
        np.testing.assert_array_equal(bf16[name], rounded, err_msg=name)


def test_command_line_export_writes_the_same_files(trained, tmp_path):
    """`jaxpar convert --from W --to-hf D` (a real process) writes what export_workdir writes."""
    export_workdir(trained["gpt2"], tmp_path / "api")
    run = subprocess.run([sys.executable, "-m", "jaxpar.cli", "convert", "--from", str(trained["gpt2"]), "--to-hf",
                          str(tmp_path / "cli")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    files = sorted(p.name for p in (tmp_path / "api").iterdir())
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == files
    for file in files:
        assert (tmp_path / "cli" / file).read_bytes() == (tmp_path / "api" / file).read_bytes(), file


# -----------------------------------------------------------------------------------------------------------------
# 3. The other architectures a fresh jaxpar model exports as (random weights; no training needed)

VARIANTS = {  # ModelConfig → the architecture its features select
    "MistralForCausalLM": dict(n_heads=4, n_kv_heads=2, sliding_window=7, rope_theta=1e6),
    "Qwen2ForCausalLM": dict(n_heads=4, n_kv_heads=1, qkv_bias=True, tie_embeddings=True, sliding_window=7),
    "LlamaForCausalLM": dict(n_heads=2, tie_embeddings=True, rope_scaling="linear", rope_factor=2.0),
    "Qwen3ForCausalLM": dict(n_heads=4, n_kv_heads=2, head_dim=6, qk_norm=True, sliding_window=7),
    "GPT2LMHeadModel": dict(family="gpt2", n_heads=5, tie_embeddings=False),
}


def random_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) with every parameter random — norm scales 1 + N(0, 0.1), the rest N(0, 0.2), biases
    included — so each one shows in the logits (and without an eager init, which costs seconds)."""
    graphdef, abstract = abstract_model(cfg)
    noise = np.random.RandomState(2)

    def fill(path, x):
        name = jax.tree_util.keystr(path)  # e.g. "['blocks']['attn_norm']"
        norm = "norm" in name and "norm_b" not in name
        return ((1.0 if norm else 0.0) + noise.normal(0, 0.1 if norm else 0.2, x.shape)).astype(x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


@pytest.mark.parametrize("arch", VARIANTS)
def test_export_of_each_architecture_matches_jaxpar(tmp_path, arch):
    """Sliding windows (Mistral; Qwen2 with biases, tied; Qwen3 with the q/k norm and head_dim 6 ≠ 40/4), a tied
    Llama with linear RoPE, an untied GPT-2: each
    exports under its architecture with a config.json that gives transformers' computation jaxpar's logits."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=40, n_layers=2, d_ff=56, max_seq_len=48, **VARIANTS[arch])
    graphdef, params = random_params(cfg)
    save_params(params, cfg, tmp_path / "hf")
    config, weights = check_format(tmp_path / "hf")
    assert config["architectures"] == [arch]
    error = relative_error(forward(config, weights, IDS), np.asarray(nnx.merge(graphdef, params)(IDS)))
    assert error < 1e-5, error
    if cfg.sliding_window:  # T = 29 > window 7: the exported window decides the logits
        assert set(llama_windows(config)) == {7}


def test_export_refuses_a_gpt2_that_gpt2_cannot_express(tmp_path):
    """GPT2LMHeadModel has no kv heads and no window: exporting either would make files transformers misreads."""
    base = dict(family="gpt2", vocab_size=VOCAB, d_model=40, n_layers=1, n_heads=4, max_seq_len=48)
    for extra, field in ((dict(n_kv_heads=2), "model.n_kv_heads"), (dict(sliding_window=8), "model.sliding_window"),
                         (dict(head_dim=8), "model.head_dim")):
        cfg = ModelConfig(**base, **extra)
        with pytest.raises(ConfigError, match=field):
            save_params(abstract_model(cfg)[1], cfg, tmp_path / field)  # refused before any weight is read
        assert not (tmp_path / field).exists()


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2_moe_mixed"])
def test_half_precision_export_and_reimport_keep_every_value(tmp_path, name):
    """`jaxpar convert --to-hf --dtype bfloat16 | float16` of an imported F32 fixture: every tensor's header dtype
    BF16 / F16 and config.json's dtype saying so, each value its float32 rounded to nearest, ties to even (on the
    bits, read by the hand-written parser above); that export imported again (`convert --from-hf`: a workdir in that
    dtype) and exported once more, every safetensors file reproduces byte for byte — the half-precision round trip
    is exact; and importing the F32 fixture straight into that dtype (`convert --from-hf --dtype`) rounds each value
    the same way (its export: the same bytes again)."""
    import ml_dtypes

    from jaxpar.cli import main

    assert main(["convert", "--from-hf", str(FIXTURES / name), "--to", str(tmp_path / "f32")]) == 0
    _, want, stored = read_hf_dir(FIXTURES / name)
    assert set(stored.values()) == {"F32"}  # the fixtures are float32: every value below is a real rounding
    for dtype, tag, half in (("bfloat16", "BF16", ml_dtypes.bfloat16), ("float16", "F16", np.float16)):
        out, back, again = tmp_path / dtype, tmp_path / f"{dtype}-workdir", tmp_path / f"{dtype}-again"
        assert main(["convert", "--from", str(tmp_path / "f32"), "--to-hf", str(out), "--dtype", dtype]) == 0
        config, got, dtypes = read_hf_dir(out)
        assert (config.get("torch_dtype") or config.get("dtype")) == dtype
        assert sorted(got) == sorted(want) and set(dtypes.values()) == {tag}, set(dtypes.values())
        rounded = 0
        for key, x in want.items():
            cast = x.astype(np.float32).astype(half)  # NumPy / ml_dtypes: round to nearest, ties to even
            assert np.isfinite(cast.astype(np.float32)).all(), key  # nothing overflowed the half format
            np.testing.assert_array_equal(got[key], cast.astype(np.float64), err_msg=f"{dtype} {key}")
            rounded += int((cast.astype(np.float64) != x).sum())
        assert rounded > 0  # the cast changed values: the check above is not of an identity
        assert main(["convert", "--from-hf", str(out), "--to", str(back)]) == 0
        assert json.loads((back / "config.json").read_text())["model"]["param_dtype"] == dtype
        assert main(["convert", "--from", str(back), "--to-hf", str(again)]) == 0
        files = sorted(p.name for p in out.glob("model*.safetensors*"))
        assert files and sorted(p.name for p in again.glob("model*.safetensors*")) == files
        direct, direct_out = tmp_path / f"{dtype}-import", tmp_path / f"{dtype}-import-export"
        assert main(["convert", "--from-hf", str(FIXTURES / name), "--to", str(direct), "--dtype", dtype]) == 0
        assert main(["convert", "--from", str(direct), "--to-hf", str(direct_out)]) == 0
        for file in files:
            assert (again / file).read_bytes() == (out / file).read_bytes(), f"{dtype} {file}"
            assert (direct_out / file).read_bytes() == (out / file).read_bytes(), f"{dtype} import {file}"
