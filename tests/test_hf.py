"""Hugging Face interop and KV-cache generation against fixtures written by `transformers` itself.

tests/fixtures/hf/<family>/ hold tiny random models saved by transformers (safetensors + config.json), their logits
for fixed inputs and their greedy continuations (tests/fixtures/hf/make_hf_fixtures.py): Llama (GQA, llama3 RoPE
scaling, theta 5e4, sharded index), Mistral (sliding window 16 < generated length), Qwen2 (MQA, q/k/v biases, tied,
theta 1e6), GPT-2 (fused c_attn, tied) and Qwen3 (the q/k norm, head_dim 24 ≠ 64/4, sliding window 8 on every
layer through use_sliding_window / max_window_layers 0), Phi-3 (fused qkv_proj with GQA's unequal parts and
gate_up_proj, sliding window 16) and Gemma 3 (sliding and full layers with local and global RoPE, pre- and post-norms
of 1 + w, √d embeddings, GeGLU, query_pre_attn_scalar). Parity: logits within fp32 max-abs 1e-4 on 1 device and at
tensor 2, 4; greedy tokens equal transformers' and jaxpar's own cache-free decoding.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxpar.cli import main
from jaxpar.config import Config, ConfigError, DataConfig, ParallelConfig, TrainConfig
from jaxpar.infer import decode
from jaxpar.infer.sampling import generate_uncached
from jaxpar.infer.text import generate_text, load
from jaxpar.interop import hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "qwen3", "phi3", "gemma3")


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_config_maps_the_family_features(name):
    cfg = hf.model_config(hf.read_config(FIXTURES / name), FIXTURES / name)
    expected = {"llama": dict(n_kv_heads=2, rope_scaling="llama3", rope_theta=50000.0, tie_embeddings=False),
                "mistral": dict(n_kv_heads=2, sliding_window=16, rope_theta=1e6),
                "qwen2": dict(n_kv_heads=1, qkv_bias=True, tie_embeddings=True, rope_theta=1e6),
                "gpt2": dict(family="gpt2", tie_embeddings=True),
                "qwen3": dict(n_kv_heads=2, head_dim=24, qk_norm=True, qkv_bias=False, sliding_window=8,
                              tie_embeddings=False),
                "phi3": dict(n_heads=8, n_kv_heads=2, head_dim=8, d_ff=80, sliding_window=16, rope_theta=1e4,
                             qk_norm=False, tie_embeddings=False),
                "gemma3": dict(family="gemma", n_kv_heads=2, head_dim=24, qk_norm=True, sliding_window=8,
                               full_attention_every=3, local_rope_theta=1e4, rope_theta=1e6, rope_scaling="linear",
                               rope_factor=2.0, query_pre_attn_scalar=20.0, tie_embeddings=True)}[name]
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize("tensor", [1, 2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, tensor):
    """Import onto a (data=1, tensor) mesh; the forward matches transformers' logits (fp32, max-abs 1e-4)."""
    loaded = load(FIXTURES / name, tensor=tensor)
    assert loaded.mesh.shape["tensor"] == tensor
    ids = jnp.asarray(reference(name)["input_ids"])
    with jax.set_mesh(loaded.mesh):
        logits = jax.jit(lambda m, x: m(x))(loaded.model, ids)
    want = load_file(str(FIXTURES / name / "reference_logits.safetensors"))["logits"]
    got = np.asarray(logits)[..., :want.shape[-1]]
    print(f"{name} tensor {tensor}: max |Δ| {np.abs(got - want).max():.2e} (logits reach {np.abs(want).max():.1f})")
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("name,data,tensor", [(name, 1, 1) for name in FAMILIES] + [
    (name, data, tensor) for name in ("llama", "gpt2", "qwen3", "gemma3") for data, tensor in ((2, 2), (1, 4))])
def test_greedy_generation_matches_transformers(name, data, tensor):
    """32 greedy tokens for two prompts of different lengths in one (left-padded) batch equal transformers'
    greedy output, at every layout."""
    cases = reference(name)["greedy"]
    loaded = load(FIXTURES / name, data=data, tensor=tensor)
    new = loaded.generate([c["prompt"] for c in cases], max_new_tokens=32, eos_token_id=None, return_prompt=False)
    assert new.tolist() == [c["new_tokens"] for c in cases]


@pytest.mark.parametrize("name", ["mistral", "gpt2"])
def test_kv_cache_decoding_equals_cache_free_decoding(name):
    """The KV cache changes the cost, not the result: sampled (temperature, top-k) tokens with one seed equal
    jaxpar's cache-free loop (a full forward per token) — and Mistral's window (16) is shorter than the text."""
    loaded = load(FIXTURES / name)
    prompt = np.asarray([reference(name)["greedy"][1]["prompt"]], np.int32)
    kw = dict(temperature=0.7, top_k=20)
    cached = decode.generate(loaded.model, prompt, max_new_tokens=24, do_sample=True, seed=3, return_prompt=False,
                             **kw)
    graphdef, params = nnx.split(loaded.model)
    logits_fn = jax.jit(lambda t: nnx.merge(graphdef, params)(t)[..., :loaded.config.model.vocab_size])
    # The cache-free loop samples step t with fold_in(rng, t) as the cached one does, so one seed gives one text.
    free = generate_uncached(logits_fn, prompt, max_new_tokens=24, max_len=prompt.shape[1] + 24,
                             rng=jax.random.key(3), **kw)
    np.testing.assert_array_equal(cached, free)


def test_generate_api_masks_stops_and_seeds():
    loaded = load(FIXTURES / "llama")
    case = reference("llama")["greedy"][0]
    prompt, want = case["prompt"], case["new_tokens"]
    # [B, T] ids with an attention mask (right-padded here) give what the ragged list gives.
    ids = np.zeros((2, 12), np.int32)
    ids[0, :len(prompt)] = prompt
    ids[1, :3] = prompt[:3]
    mask = (np.arange(12)[None] < np.array([[len(prompt)], [3]])).astype(np.int32)
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, return_prompt=False)
    assert out[0].tolist() == want[:8]
    np.testing.assert_array_equal(out, loaded.generate([prompt, prompt[:3]], max_new_tokens=8, eos_token_id=None,
                                                       return_prompt=False))
    # Stop tokens: a row that emits one is padded afterwards; the loop ends when every row has.
    stop = want[3]
    out = loaded.generate([prompt], max_new_tokens=32, eos_token_id=[stop], pad_token_id=-1, return_prompt=False)
    first = want.index(stop)
    assert out[0].tolist() == want[:first + 1] and out.shape[1] == first + 1
    # Sampling: one seed, one output; another seed, another.
    a = loaded.generate([prompt], max_new_tokens=16, do_sample=True, temperature=1.5, seed=1, eos_token_id=None)
    b = loaded.generate([prompt], max_new_tokens=16, do_sample=True, temperature=1.5, seed=1, eos_token_id=None)
    c = loaded.generate([prompt], max_new_tokens=16, do_sample=True, temperature=1.5, seed=2, eos_token_id=None)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (1, 8 + 16)  # the prompt, left-padded to a multiple of 8, then the new tokens
    with pytest.raises(ValueError, match="max_seq_len"):
        loaded.generate([prompt], max_new_tokens=1000)
    with pytest.raises(ValueError, match="top_p"):
        loaded.generate([prompt], do_sample=True, top_p=0.0)


def test_kv_cache_is_sharded_by_kv_heads_and_batch():
    """At (data 2, tensor 2) each device holds its batch half and its kv head of the cache (Llama fixture: K=2)."""
    loaded = load(FIXTURES / "llama", data=2, tensor=2)
    tokens, lengths = decode.right_pad([[1, 2, 3], [4, 5]])
    graphdef, params = nnx.split(loaded.model)
    with jax.set_mesh(loaded.mesh):
        compiled = decode._generate.lower(graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                          jax.random.key(0), max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0,
                                          stop=(), pad_token_id=0).compile()
    cfg = loaded.config.model
    local = f"f32[{cfg.n_layers},1,{tokens.shape[1] + 8},1,{cfg.head_dim}]"  # [L, B/2, S, K/2, E]
    assert local in compiled.as_text()


def test_text_in_text_out_through_the_tokenizer():
    loaded = load(FIXTURES / "gpt2", tensor=2)
    case = reference("gpt2")["greedy"][0]
    (text,) = generate_text(loaded, [case["prompt_text"]], max_new_tokens=32, temperature=0.0, stop=[])
    assert loaded.tokenizer.encode(case["prompt_text"]) == case["prompt"]
    assert text == loaded.tokenizer.decode(case["new_tokens"])


@pytest.mark.parametrize("name", FAMILIES)
def test_import_export_reproduces_every_tensor_bit_for_bit(name, tmp_path):
    hf.import_to_workdir(FIXTURES / name, tmp_path / "workdir")
    hf.export_workdir(tmp_path / "workdir", tmp_path / "out", max_shard_bytes=200_000)
    want, got = tensors(FIXTURES / name), tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf.model_config(exported, tmp_path) == hf.model_config(hf.read_config(FIXTURES / name), FIXTURES / name)
    if len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1:  # sharded: the index lists every tensor
        index = json.loads((tmp_path / "out" / hf.INDEX).read_text())["weight_map"]
        assert sorted(index) == sorted(want)


def test_convert_cli_round_trip_and_generate_from_hf_dir(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(FIXTURES / "qwen2"), "--to", str(tmp_path / "w")]) == 0
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert tensors(tmp_path / "hf").keys() == tensors(FIXTURES / "qwen2").keys()
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "def f(", "--max-new-tokens", "4",
                 "--greedy", "--tensor", "1"]) == 0
    assert capsys.readouterr().out.startswith("def f(")
    assert main(["convert", "--from-hf", str(FIXTURES / "qwen2")]) == 2  # no destination: one-line config error


def damaged_copy(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def test_truncated_safetensors_file_is_a_clear_error(tmp_path):
    d = damaged_copy(tmp_path, "gpt2")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(hf.HFError, match=r"model\.safetensors: damaged safetensors file"):
        load(d)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    d = damaged_copy(tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFError, match=r"config.json.*FalconForCausalLM.*not supported.*LlamaForCausalLM"):
        load(d)


def test_missing_tensor_and_shape_mismatch_name_the_tensor(tmp_path):
    d = damaged_copy(tmp_path, "mistral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(hf.HFError, match=r"tensor 'model\.layers\.2\.[a-z_.]+' is missing"):
        load(d)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(hf.HFError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.[a-z_]+\.weight' has "
                                         r"shape \((96, 64|64, 96)\)"):
        load(d)


def test_pickle_checkpoints_are_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copyfile(FIXTURES / "gpt2" / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hf.HFError, match="never loads pickles"):
        load(d)


def test_inference_layout_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.n_heads"):
        load(FIXTURES / "gpt2", tensor=3, devices=jax.devices()[:3])  # 4 heads do not split 3 ways


@pytest.mark.parametrize("name,layout", [
    ("gpt2", dict(data=2, pipe=2, tensor=2, microbatches=2)),
    ("gemma3", dict(data=2, pipe=2, tensor=2, microbatches=2)),  # a (sliding, sliding, full) period a stage
    ("gpt_oss", dict(data=2, expert=2, tensor=2)),  # its 6 experts over expert 2
])
def test_training_starts_from_hf_weights_on_a_pipelined_layout(tmp_path, name, layout):
    """--init-from-hf at (data, pipe, tensor) = (2, 2, 2) (gpt-oss: (data, expert, tensor)): after one step every
    parameter is within one Adam step (≈ lr per element) of the Hugging Face tensor it came from — so each landed in
    the right place (pipeline layer order, vocab padding, head split, experts)."""
    from jaxpar.train import fit
    from jaxpar.plan import make_plan

    base = Config(train=TrainConfig(batch_size=4, seq_len=16, steps=1, lr=1e-3, warmup_steps=0, eval_every=0,
                                    eval_batches=1),
                  data=DataConfig(source="synthetic"))
    config = hf.init_config(base, FIXTURES / name)  # (the layout after: `expert` needs the imported experts)
    config = dataclasses.replace(config, parallel=ParallelConfig(**layout))
    assert config.data.tokenizer.endswith("tokenizer.json") and config.model.vocab_size == 515
    result = fit(config, tmp_path / "run", progress=False)
    plan = make_plan(result.config.model, result.config.parallel, result.mesh)
    trained = nnx.to_pure_dict(plan.to_canonical(result.state.params))
    cfg = config.model
    from jaxpar.model import abstract_model

    _, abstract = abstract_model(cfg)
    original = nnx.to_pure_dict(hf.load_params(FIXTURES / name, cfg, abstract))
    deltas = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), trained, original)
    assert max(jax.tree.leaves(deltas)) < 1.5e-3  # one AdamW step moves each element by about lr
    assert max(jax.tree.leaves(deltas)) > 1e-4  # and training did move them
    if name != "gpt2":
        return
    with pytest.raises(ConfigError, match="model.n_layers"):  # a model section that is not the checkpoint's
        bad = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=4))
        fit(bad, tmp_path / "bad", progress=False)


def test_export_loads_in_transformers(tmp_path):
    """Live round trip where transformers (and torch) are installed: jaxpar's export, loaded by transformers,
    gives jaxpar's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in FAMILIES:
        hf.import_to_workdir(FIXTURES / name, tmp_path / name)
        hf.export_workdir(tmp_path / name, tmp_path / f"{name}_hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_hf", attn_implementation="eager")
        ids = reference(name)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor(ids)).logits.numpy()
        want = load_file(str(FIXTURES / name / "reference_logits.safetensors"))["logits"]
        assert np.abs(logits - want).max() < 1e-4, name


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_over_the_whole_generated_text_match(name):
    """The no-cache forward over prompt + 31 generated tokens (41 for the longer prompt: beyond Mistral's window
    of 16, where the window changes the logits) matches transformers'."""
    loaded = load(FIXTURES / name)
    stored = load_file(str(FIXTURES / name / "reference_logits.safetensors"))
    for k, case in enumerate(reference(name)["greedy"]):
        ids = jnp.asarray([case["prompt"] + case["new_tokens"][:-1]])
        want = stored[f"greedy_{k}_logits"]
        got = np.asarray(loaded.model(ids))[0, :, :want.shape[-1]]
        assert np.abs(got - want).max() < 1e-4


# -----------------------------------------------------------------------------------------------------------------
# Hostile and damaged inputs: each is an HFError of one line naming the file (and tensor or key) at fault.


def rewrite_header(file: pathlib.Path, edit) -> None:
    """Rewrite the JSON header of safetensors `file` in place with `edit(header)`; the data bytes stay as they are
    (so a dtype edited to one of the same width, F32 → I32, still passes the file's own size checks)."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; writers pad the header to 8 bytes
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def one_line_error(fn, pattern: str) -> str:
    with pytest.raises(hf.HFError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and re.search(pattern, message), message
    return message


def test_integer_tensor_is_refused_from_its_header(tmp_path, capsys):
    """An F32 tensor relabelled I32 (same width, so the file is otherwise valid) used to import as garbage weights
    with exit 0; the header's dtype is now checked before the data is read."""
    d = damaged_copy(tmp_path, "gpt2")
    name = "transformer.h.1.mlp.c_fc.weight"
    rewrite_header(d / "model.safetensors", lambda h: h[name].update(dtype="I32"))
    assert main(["convert", "--from-hf", str(d), "--to", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(
        rf"jaxpar: Hugging Face error: \S*model\.safetensors: tensor '{re.escape(name)}' has dtype I32; jaxpar "
        r"imports weights stored as F32, F16, BF16, F64 — not a floating-point weight.*\n", err), err
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_fp8_tensor_is_refused_as_quantized(tmp_path):
    """FP8 values without their scale tensors are garbage (the old reader crashed in NumPy instead)."""
    d = damaged_copy(tmp_path, "gpt2")
    name = "transformer.h.0.attn.c_proj.weight"
    weights = load_file(str(d / "model.safetensors"))
    weights[name] = np.zeros(weights[name].shape, np.uint8)  # one byte per value, as F8_E4M3
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    rewrite_header(d / "model.safetensors", lambda h: h[name].update(dtype="F8_E4M3"))
    one_line_error(lambda: hf.import_to_workdir(d, tmp_path / "w"),
                   rf"model\.safetensors: tensor '{re.escape(name)}' has dtype F8_E4M3; .* quantized")


def test_half_and_double_precision_weights_import_rounded_to_the_param_dtype(tmp_path):
    """F16, BF16 and F64 tensors (mixed in one file) load as the run's float32 params: the stored values, exactly
    (F16/BF16 widen exactly; F64 rounds to nearest)."""
    import ml_dtypes
    from jaxpar.model import abstract_model

    d = damaged_copy(tmp_path, "gpt2")
    weights = load_file(str(d / "model.safetensors"))
    stored = dict(weights)
    stored["transformer.wte.weight"] = weights["transformer.wte.weight"].astype(ml_dtypes.bfloat16)
    stored["transformer.h.0.mlp.c_fc.weight"] = weights["transformer.h.0.mlp.c_fc.weight"].astype(np.float16)
    stored["transformer.wpe.weight"] = weights["transformer.wpe.weight"].astype(np.float64) + 1e-12
    save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.model_config(hf.read_config(d), d)
    _, abstract = abstract_model(cfg)
    params = nnx.to_pure_dict(hf.load_params(d, cfg, abstract))
    np.testing.assert_array_equal(params["embed"], stored["transformer.wte.weight"].astype(np.float32))
    np.testing.assert_array_equal(params["blocks"]["w_up"][0], stored["transformer.h.0.mlp.c_fc.weight"])
    np.testing.assert_array_equal(params["pos_embed"], stored["transformer.wpe.weight"].astype(np.float32))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


def _set(**kv):
    return lambda c: c.update(kv)


def _rope(**kv):
    return lambda c: c["rope_parameters"].update(kv)


def _drop(key):  # "a.b" deletes c["a"]["b"]
    def edit(c):
        *outer, last = key.split(".")
        for k in outer:
            c = c[k]
        del c[last]
    return edit


def _old_rope_spelling(scaling):  # transformers 4's top-level rope_theta + rope_scaling
    def edit(c):
        del c["rope_parameters"]
        c.update(rope_theta=10000.0, rope_scaling=scaling)
    return edit


def _qwen2_windows_from(max_window_layers):  # transformers < 4.53's spelling: no layer_types
    def edit(c):
        del c["layer_types"]
        c.update(use_sliding_window=True, sliding_window=8, max_window_layers=max_window_layers)
    return edit


BAD_CONFIGS = [  # (fixture, edit of config.json's dict (or its replacement), the message)
    ("llama", lambda c: [c], r"config\.json: holds a JSON list, not an object"),
    ("llama", lambda c: "llama", r"config\.json: holds a JSON str, not an object"),
    ("llama", _set(num_attention_heads=0), r"config\.json: num_attention_heads = 0: must be > 0$"),
    ("llama", _set(num_attention_heads=-4), r"config\.json: num_attention_heads = -4: must be > 0$"),
    ("llama", _set(num_attention_heads="4"), r"config\.json: num_attention_heads = '4': must be an integer$"),
    ("llama", _set(num_attention_heads=4.0), r"config\.json: num_attention_heads = 4\.0: must be an integer$"),
    ("llama", _set(num_attention_heads=True), r"config\.json: num_attention_heads = True: must be an integer$"),
    ("llama", _set(num_key_value_heads=3), r"config\.json: num_key_value_heads = 3: must divide "
                                           r"num_attention_heads = 4"),
    ("llama", _set(num_key_value_heads=0), r"config\.json: num_key_value_heads = 0: must be > 0"),
    ("llama", _set(head_dim=15), r"config\.json: head_dim = 15: must be even for RoPE"),
    ("phi3", _set(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}),
     r"config\.json: partial_rotary_factor = 0\.75: rotates only part of each head"),
    ("phi3", _set(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     r"config\.json: rope_parameters\.rope_type = 'longrope' is not supported"),
    ("qwen3", _set(attention_bias=True), r"config\.json: attention_bias = True: biases q, k, v and o_proj in "
                                         r"Qwen3, and jaxpar's llama family has no o_proj bias"),
    ("qwen3", _set(layer_types=["full_attention", "sliding_attention"]), r"config\.json: a sliding window on "
                                                                          r"layers \[1\] only"),
    ("llama", _set(rms_norm_eps=0), r"config\.json: rms_norm_eps = 0\.0: must be > 0"),
    ("llama", _set(rms_norm_eps=float("nan")), r"config\.json: rms_norm_eps = nan: must be a finite number"),
    ("llama", _set(tie_word_embeddings="false"), r"config\.json: tie_word_embeddings = 'false': must be true or "
                                                 r"false"),
    ("llama", _set(hidden_act=["silu"]), r"config\.json: hidden_act = \['silu'\]: must be a string"),
    ("llama", _set(vocab_size=None), r"config\.json: no 'vocab_size', which a llama model needs"),
    ("llama", _drop("hidden_size"), r"config\.json: no 'hidden_size', which a llama model needs"),
    ("llama", _set(architectures=[["LlamaForCausalLM"]]), r"config\.json: architectures = .* is not supported"),
    ("llama", _set(architectures="LlamaForCausalLM"), r"config\.json: architectures = .* is not supported"),
    ("llama", _drop("rope_parameters.low_freq_factor"), r"config\.json: no 'rope_parameters\.low_freq_factor', "
                                                        r"which llama3 RoPE scaling needs"),
    ("llama", _rope(factor="8"), r"config\.json: rope_parameters\.factor = '8': must be a number$"),
    ("llama", _rope(rope_theta=-1), r"config\.json: rope_parameters\.rope_theta = -1\.0: must be > 0"),
    ("llama", _rope(rope_type=None, type=7), r"config\.json: rope_parameters\.type = 7: must be a string"),
    ("llama", _rope(low_freq_factor=4.0, high_freq_factor=1.0), r"config\.json: rope_parameters\.high_freq_factor "
                                                                r"= 1\.0: must exceed rope_parameters\.low_freq_"
                                                                r"factor = 4\.0"),
    ("llama", _set(rope_parameters="llama3"), r"config\.json: rope_parameters = 'llama3': must be a JSON object"),
    ("llama", _old_rope_spelling({"type": "linear"}), r"config\.json: no 'rope_scaling\.factor', which linear RoPE "
                                                      r"scaling needs"),
    ("llama", _old_rope_spelling([8.0]), r"config\.json: rope_scaling = \[8\.0\]: must be a JSON object"),
    ("mistral", _set(sliding_window=-1), r"config\.json: sliding_window = -1: must be > 0"),
    ("mistral", _set(sliding_window="16"), r"config\.json: sliding_window = '16': must be an integer"),
    ("qwen2", _set(use_sliding_window="yes"), r"config\.json: use_sliding_window = 'yes': must be true or false"),
    ("qwen2", _set(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
     r"config\.json: a sliding window on layers \[0\] only .* is not supported"),
    ("qwen2", _set(use_sliding_window=True, sliding_window=8, layer_types="sliding_attention"),
     r"config\.json: layer_types = 'sliding_attention': must list"),
    ("qwen2", _qwen2_windows_from("1"), r"config\.json: max_window_layers = '1': must be an integer"),
    ("qwen2", _qwen2_windows_from(1), r"config\.json: a sliding window on layers \[1\] only .* is not supported"),
    ("gemma3", _set(final_logit_softcapping=30.0), r"config\.json: final_logit_softcapping = 30\.0: soft-caps "
                                                    r"logits with tanh"),
    ("gemma3", _set(hidden_activation="gelu"), r"config\.json: hidden_activation = 'gelu': jaxpar's gemma family "
                                               r"gates its MLP with the tanh GELU"),
    ("gemma3", _set(use_bidirectional_attention=True), r"config\.json: use_bidirectional_attention = True: makes "
                                                       r"attention bidirectional"),
    ("gemma3", _set(layer_types=["sliding_attention", "full_attention", "full_attention"] * 2),
     r"config\.json: layer_types: full attention on layers \[1, 2, 4, 5\] is not every k-th layer"),
    ("gemma3", _set(layer_types=["sliding_attention"] * 5), r"config\.json: layer_types = .*: must list "
                                                            r"'full_attention' or 'sliding_attention' for each of "
                                                            r"the num_hidden_layers = 6 layers"),
    ("gemma3", _set(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"config\.json: rope_parameters\.full_attention\.rope_type = 'yarn' is not supported for Gemma 3"),
    ("gemma3", _set(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4,
                                                           "factor": 2.0}}),
     r"config\.json: rope_parameters\.sliding_attention\.rope_type = 'linear': jaxpar's sliding layers take an "
     r"unscaled RoPE"),
    ("gemma3", _set(query_pre_attn_scalar=-2), r"config\.json: query_pre_attn_scalar = -2\.0: must be >= 0"),
    ("gpt_oss", _set(quantization_config={"quant_method": "mxfp4"}), r"config\.json: quantization_config = "
                                                                     r".*'mxfp4'.*: the experts are stored quantized "
                                                                     r"\(MXFP4 blocks and scales\)"),
    ("gpt_oss", _set(layer_types=["full_attention", "sliding_attention"]), r"config\.json: layer_types: full "
                                                                            r"attention on layers \[0\] is not every "
                                                                            r"other layer"),
    ("gpt_oss", _set(hidden_act="gelu"), r"config\.json: hidden_act = 'gelu' is not supported; jaxpar's llama "
                                         r"family uses SwiGLU \(silu\)"),
    ("gpt_oss", _set(swiglu_limit=-1.0), r"config\.json: swiglu_limit = -1\.0: must be >= 0"),
    ("gpt_oss", _rope(truncate="no"), r"config\.json: rope_parameters\.truncate = 'no': must be true or false"),
    ("gpt2", _set(n_head=0), r"config\.json: n_head = 0: must be > 0$"),
    ("gpt2", _set(n_head=5), r"config\.json: n_head = 5: must divide n_embd = 64$"),
    ("gpt2", _set(n_embd="64"), r"config\.json: n_embd = '64': must be an integer$"),
    ("gpt2", _set(n_inner=0), r"config\.json: n_inner = 0: must be > 0$"),
    ("gpt2", _set(layer_norm_epsilon="1e-5"), r"config\.json: layer_norm_epsilon = '1e-5': must be a number$"),
    ("gpt2", _set(scale_attn_weights=False), r"config\.json: scale_attn_weights = false is not supported"),
]


def _case_id(name: str, message: str) -> str:  # "llama: num_attention_heads = 0: must be > 0"
    return f"{name}: " + re.sub(r"\\(.)", r"\1", message).split("config.json: ")[1].rstrip("$")


@pytest.mark.parametrize("name,edit,message", BAD_CONFIGS, ids=[_case_id(n, m) for n, _, m in BAD_CONFIGS])
def test_bad_config_json_is_a_one_line_error_naming_the_key(tmp_path, name, edit, message):
    d = damaged_copy(tmp_path, name)
    config = json.loads((d / "config.json").read_text())
    replaced = edit(config)
    (d / "config.json").write_text(json.dumps(config if replaced is None else replaced))
    one_line_error(lambda: hf.model_config(hf.read_config(d), d), message)


def test_config_errors_reach_the_command_line_as_one_line(tmp_path, capsys):
    """num_attention_heads = 0 used to end `jaxpar convert` in a ZeroDivisionError traceback."""
    d = damaged_copy(tmp_path, "llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    assert main(["convert", "--from-hf", str(d), "--to", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err == (f"jaxpar: Hugging Face error: {d / 'config.json'}: num_attention_heads = 0: "
                                       "must be > 0\n")


def test_a_run_override_error_stays_a_config_error():
    """ModelConfig errors about the run's own choices (here cuDNN attention in float32) are not config.json's."""
    with pytest.raises(ConfigError, match="model.attention"):
        hf.model_config(hf.read_config(FIXTURES / "llama"), FIXTURES / "llama", attention="cudnn")


@pytest.mark.parametrize("call", ["read_config", "init_config", "import_to_workdir", "load_params",
                                  "checkpoint_names"])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_path_that_is_not_a_directory_is_a_one_line_error(tmp_path, call, kind):
    from jaxpar.model import abstract_model

    path = tmp_path / "nothing"
    if kind == "file":
        path.write_text("{}")
    cfg = hf.model_config(hf.read_config(FIXTURES / "gpt2"), FIXTURES / "gpt2")
    calls = {"read_config": lambda: hf.read_config(path), "init_config": lambda: hf.init_config(Config(), path),
             "import_to_workdir": lambda: hf.import_to_workdir(path, tmp_path / "w"),
             "load_params": lambda: hf.load_params(path, cfg, abstract_model(cfg)[1]),
             "checkpoint_names": lambda: hf.checkpoint_names(path)}
    want = r"nothing: no such directory" if kind == "missing" else r"nothing: a file, not a directory"
    one_line_error(calls[call], want)


def _index_entry(d: pathlib.Path, file: str) -> None:
    """Point the llama fixture's index entries for its first shard at `file`."""
    index = json.loads((d / hf.INDEX).read_text())
    first = "model-00001-of-00003.safetensors"
    index["weight_map"] = {n: (file if f == first else f) for n, f in index["weight_map"].items()}
    (d / hf.INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_weight_files_outside_the_directory_are_refused(tmp_path, how):
    """The index is data: an entry naming `../x`, `/abs/x` or a link that leaves the directory used to be read.
    Here the outside file is a genuine shard, so only the location check stops it."""
    d = damaged_copy(tmp_path, "llama")
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model-00001-of-00003.safetensors", outside)
    if how == "parent":
        _index_entry(d, "../outside.safetensors")
    elif how == "absolute":
        _index_entry(d, str(outside))
    else:
        (d / "model-00001-of-00003.safetensors").symlink_to(outside)
    one_line_error(lambda: hf.checkpoint_names(d), rf"model\.safetensors\.index\.json: weight_map entry "
                                                   r"'model\.embed_tokens\.weight' names '.*', which resolves to "
                                                   rf"{re.escape(str(outside.resolve()))}, outside")


def test_a_single_file_linked_from_outside_is_refused(tmp_path):
    d = damaged_copy(tmp_path, "gpt2")
    shutil.move(d / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (d / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    one_line_error(lambda: hf.checkpoint_names(d), r"model\.safetensors: resolves to .*elsewhere\.safetensors, "
                                                   r"outside")


def test_hub_cache_snapshots_linking_into_blobs_are_read(tmp_path):
    """huggingface_hub's cache stores `<repo>/snapshots/<rev>/model.safetensors` as a link to `<repo>/blobs/<sha>`:
    that one way out of the directory stays allowed."""
    repo = tmp_path / "models--tiny--gpt2"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(FIXTURES / "gpt2" / file, repo / "blobs" / f"sha-{file}")
        (snapshot / file).symlink_to(f"../../blobs/sha-{file}")
    assert hf.checkpoint_names(snapshot) == hf.checkpoint_names(FIXTURES / "gpt2")


@pytest.mark.parametrize("index,message", [
    ([], r"not a safetensors index"), ({"weight_map": ["a"]}, r"not a safetensors index"),
    ({"weight_map": {"model.norm.weight": 3}}, r"not a safetensors index"),
    ({"weight_map": {"model.norm.weight": "."}}, r"weight_map entry 'model\.norm\.weight' names '\.', which is not "
                                                 r"a regular file")])
def test_a_malformed_index_is_a_one_line_error(tmp_path, index, message):
    d = damaged_copy(tmp_path, "llama")
    (d / hf.INDEX).write_text(json.dumps(index))
    one_line_error(lambda: hf.checkpoint_names(d), rf"model\.safetensors\.index\.json: {message}")


def test_export_refuses_a_dtype_that_is_not_a_float(tmp_path):
    from jaxpar.model import abstract_model

    cfg = hf.model_config(hf.read_config(FIXTURES / "gpt2"), FIXTURES / "gpt2")
    abstract = abstract_model(cfg)[1]  # refused before any weight is read
    one_line_error(lambda: hf.save_params(abstract, cfg, tmp_path / "out", dtype="int8"), r"dtype 'int8' cannot be "
                                                                                           r"exported")
    assert not (tmp_path / "out").exists()
