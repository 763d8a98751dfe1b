"""Hugging Face interop of the mixture-of-experts models, Mixtral, Qwen2-MoE and Qwen3-MoE, against fixtures written by
`transformers` itself (tests/fixtures/hf/make_hf_fixtures.py).

tests/fixtures/hf/mixtral: 4 experts top-2 (always renormalised), sliding window 16, untied, one file.
tests/fixtures/hf/qwen2_moe: 4 experts top-2 with norm_topk_prob false, a shared expert with its sigmoid gate, q/k/v
biases, tied, sharded over 3 files (a layer's experts spread across them).
tests/fixtures/hf/qwen2_moe_mixed: a mixed dense / MoE stack, 8 layers with decoder_sparse_step 2 and mlp_only_layers
[1, 5]: MoE layers 3 and 7 (norm_topk_prob true, a gated shared expert), the other six dense (intermediate_size 96);
untied, sharded. Its two halves hold the same kinds of layers, so it runs on a 2-stage pipeline.
tests/fixtures/hf/qwen3_moe: 6 experts top-2 (norm_topk_prob true), no shared expert, the q/k norm, head_dim 16 with
d_model 48 (≠ 48/4), tied, one file; transformers 5.24 saves its expert count as num_local_experts.
tests/fixtures/hf/deepseek_v2, deepseek_v3: DeepSeek's MLA and routing (tests/test_hf_deepseek.py describes them).
Every routing decision of the reference inputs is clear (the k-th and (k+1)-th router probabilities differ by
> 1e-3), so a float32 port routes alike.

Checked: config.json → ModelConfig (the moe section), import → export bit for bit (and a fresh config.json for each
architecture), the fused layout transformers 5 can also save, an expert × tensor sharded import that reads only each
shard's experts (the mixed model's also under a pipeline), logits within fp32 max-abs 1e-4 of transformers', 32 greedy
tokens through the KV cache equal to transformers' greedy, the loss on expert layouts (the mixed model's on a
pipeline), and the unsupported or inexpressible options as one-line typed errors naming the key.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
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

from jaxpar.config import ConfigError, MoEConfig, ParallelConfig
from jaxpar.infer.text import load
from jaxpar.interop import hf
from jaxpar.model import abstract_model
from jaxpar.plan import make_plan
from jaxpar.sharding import param_shardings, param_specs
from jaxpar.train.step import sharded_loss_and_grads

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MOE = ("mixtral", "qwen2_moe", "qwen2_moe_mixed", "qwen3_moe")
EXPERT_TENSORS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),  # (block, (gate, up, down)) of the hub layout
                  "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "qwen2_moe_mixed": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(str(file)))
    return out


def model_config(directory: pathlib.Path):
    return hf.model_config(hf.read_config(directory), directory)


@functools.cache
def loaded(name: str, data: int = 1, tensor: int = 1):
    """The fixture on a (data, tensor) inference mesh, loaded once for the module's forward and generation tests."""
    return load(FIXTURES / name, data=data, tensor=tensor)


def params_of(directory: pathlib.Path, cfg, plan=None) -> nnx.State:
    """The imported params, on one device or on `plan`'s mesh and layout."""
    _, abstract = abstract_model(cfg if plan is None else plan.model, None if plan is None else plan.padded_vocab)
    if plan is None:
        return hf.load_params(directory, cfg, abstract)
    return hf.load_params(directory, cfg, abstract, plan, param_shardings(abstract, plan.mesh, plan.rules))


# -----------------------------------------------------------------------------------------------------------------
# config.json and tensors


def test_config_maps_the_moe_features():
    mixtral, qwen = model_config(FIXTURES / "mixtral"), model_config(FIXTURES / "qwen2_moe")
    assert mixtral.moe == MoEConfig(n_experts=4, top_k=2, d_ff=32, norm_topk_prob=True, aux_loss_coef=0.02)
    assert (mixtral.d_ff, mixtral.qkv_bias, mixtral.sliding_window, mixtral.tie_embeddings) == (32, False, 16, False)
    assert qwen.moe == MoEConfig(n_experts=4, top_k=2, d_ff=32, norm_topk_prob=False, aux_loss_coef=0.001,
                                 shared_d_ff=48, shared_gate=True)
    assert (qwen.d_ff, qwen.qkv_bias, qwen.sliding_window, qwen.tie_embeddings) == (96, True, 0, True)
    assert (qwen.n_kv_heads, qwen.head_dim, qwen.rope_theta, qwen.norm_eps) == (2, 16, 1e6, 1e-6)
    assert qwen.layer_stacks == {"blocks": (0, 1)}  # every layer MoE: one stack, as before mixed stacks
    mixed = model_config(FIXTURES / "qwen2_moe_mixed")  # decoder_sparse_step 2, mlp_only_layers [1, 5]
    assert mixed.moe == MoEConfig(n_experts=4, top_k=2, d_ff=32, norm_topk_prob=True, aux_loss_coef=0.001,
                                  shared_d_ff=48, shared_gate=True, sparse_step=2, dense_layers=(1, 5))
    assert (mixed.n_layers, mixed.d_ff, mixed.qkv_bias, mixed.tie_embeddings) == (8, 96, True, False)
    assert mixed.layer_stacks == {"blocks": (3, 7), "dense_blocks": (0, 1, 2, 4, 5, 6)}
    qwen3 = model_config(FIXTURES / "qwen3_moe")  # no shared expert; the q/k norm; head_dim 16 ≠ 48/4
    assert qwen3.moe == MoEConfig(n_experts=6, top_k=2, d_ff=32, norm_topk_prob=True, aux_loss_coef=0.001)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.d_model, qwen3.tie_embeddings) == (
        True, False, 16, 48, True)


@pytest.mark.parametrize("name", MOE)
def test_import_export_reproduces_every_tensor_bit_for_bit(name, tmp_path):
    hf.import_to_workdir(FIXTURES / name, tmp_path / "workdir")
    hf.export_workdir(tmp_path / "workdir", tmp_path / "out", max_shard_bytes=200_000)
    want, got = tensors(FIXTURES / name), tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf.model_config(exported, tmp_path) == model_config(FIXTURES / name)
    original = hf.read_config(FIXTURES / name)
    for key in ("architectures", "decoder_sparse_step", "mlp_only_layers"):  # the last two: Qwen2-MoE's only
        assert exported.get(key) == original.get(key), key
    index = json.loads((tmp_path / "out" / hf.INDEX).read_text())["weight_map"]  # 200 kB shards: an index
    assert sorted(index) == sorted(want)


def test_a_fresh_config_json_picks_the_architecture_by_the_features():
    """Without the imported config.json to start from, a model Mixtral holds exports as Mixtral and every other as
    Qwen2-MoE (dense layers, q/k/v biases, unnormalised top-k: with no shared expert, one of width 0), with every
    key transformers needs (here: reads back to the same ModelConfig)."""
    mixtral, mixed = model_config(FIXTURES / "mixtral"), model_config(FIXTURES / "qwen2_moe_mixed")
    no_shared = dataclasses.replace(mixed.moe, shared_d_ff=0, shared_gate=False)
    cases = [(mixtral, "MixtralForCausalLM", None), (model_config(FIXTURES / "qwen2_moe"), "Qwen2MoeForCausalLM", 48),
             (mixed, "Qwen2MoeForCausalLM", 48), (dataclasses.replace(mixed, moe=no_shared), "Qwen2MoeForCausalLM", 0),
             (dataclasses.replace(mixtral, qkv_bias=True), "Qwen2MoeForCausalLM", 0),
             (dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, norm_topk_prob=False)),
              "Qwen2MoeForCausalLM", 0)]
    for cfg, arch, shared in cases:
        fresh = hf.hf_config(cfg)
        assert (fresh["architectures"], fresh.get("shared_expert_intermediate_size")) == ([arch], shared)
        assert hf.model_config(fresh, FIXTURES) == cfg
    assert (hf.hf_config(mixed)["decoder_sparse_step"], hf.hf_config(mixed)["mlp_only_layers"]) == (2, [1, 5])
    qwen = model_config(FIXTURES / "qwen2_moe")
    no_bias = dataclasses.replace(qwen, qkv_bias=False)  # Qwen2-MoE's qkv_bias key holds that
    assert hf.model_config(hf.hf_config(no_bias), FIXTURES) == no_bias
    windowed = dataclasses.replace(qwen, sliding_window=16)  # every layer windowed: layer_types says so
    assert hf.model_config(hf.hf_config(windowed), FIXTURES) == windowed


def test_a_mixed_model_without_a_shared_expert_exports_one_of_width_zero(tmp_path):
    """Mixtral has no dense layers, so a mixed model without a shared expert exports as Qwen2-MoE with
    shared_expert_intermediate_size 0: transformers 5.24 builds that expert with [0, D] and [D, 0] weights, and it
    adds sigmoid(x·w)·0. The export writes them (the gate as zeros) on the MoE layers only, and imports back."""
    cfg = model_config(FIXTURES / "qwen2_moe_mixed")
    params = nnx.to_pure_dict(params_of(FIXTURES / "qwen2_moe_mixed", cfg))
    for key in ("ws_gate", "ws_up", "ws_down", "ws_score"):
        del params["blocks"][key]
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_d_ff=0, shared_gate=False))
    _, state = abstract_model(cfg)
    nnx.replace_by_pure_dict(state, params)
    hf.save_params(state, cfg, tmp_path / "out")
    out, config = tensors(tmp_path / "out"), hf.read_config(tmp_path / "out")
    assert (config["architectures"], config["shared_expert_intermediate_size"]) == (["Qwen2MoeForCausalLM"], 0)
    shared = {k: v.shape for k, v in out.items() if ".shared_expert" in k}
    assert shared == {f"model.layers.{layer}.mlp.{name}.weight": shape for layer in (3, 7) for name, shape in (
        ("shared_expert.gate_proj", (0, 64)), ("shared_expert.up_proj", (0, 64)), ("shared_expert.down_proj", (64, 0)),
        ("shared_expert_gate", (1, 64)))}
    assert not out["model.layers.7.mlp.shared_expert_gate.weight"].any()
    assert hf.model_config(config, tmp_path) == cfg
    back = nnx.to_pure_dict(params_of(tmp_path / "out", cfg))
    assert jax.tree.all(jax.tree.map(np.array_equal, back, params))


def fused_copy(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """The fixture in the layout `save_pretrained(save_original_format=False)` writes (the fixture script asserts it
    is exactly this): per layer mlp.gate.weight [X, D], mlp.experts.gate_up_proj [X, 2F, D] (gate rows, then up
    rows) and mlp.experts.down_proj [X, D, F]; one file."""
    out = tmp_path / f"{name}_fused"
    out.mkdir()
    shutil.copy(FIXTURES / name / "config.json", out)
    block, (gate, up, down) = EXPERT_TENSORS[name]
    hub, X = tensors(FIXTURES / name), model_config(FIXTURES / name).moe.n_experts
    fused = {k.replace(f".{block}.gate.", ".mlp.gate."): v for k, v in hub.items() if ".experts." not in k}
    for layer in model_config(FIXTURES / name).layer_stacks["blocks"]:  # the MoE layers
        get = lambda e, w: hub[f"model.layers.{layer}.{block}.experts.{e}.{w}.weight"]  # noqa: E731
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([get(e, gate), get(e, up)]) for e in range(X)])
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([get(e, down) for e in range(X)])
    save_file(fused, str(out / hf.SINGLE), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", MOE)
def test_the_fused_expert_layout_imports_and_exports_the_hub_layout(name, tmp_path):
    fused, cfg = fused_copy(tmp_path, name), model_config(FIXTURES / name)
    got, want = nnx.to_pure_dict(params_of(fused, cfg)), nnx.to_pure_dict(params_of(FIXTURES / name, cfg))
    assert jax.tree.all(jax.tree.map(np.array_equal, got, want))
    hf.import_to_workdir(fused, tmp_path / "workdir")  # keeps the fused names in hf_source.json
    hf.export_workdir(tmp_path / "workdir", tmp_path / "out")
    hub, out = tensors(FIXTURES / name), tensors(tmp_path / "out")
    assert sorted(out) == sorted(hub) and all(out[k].tobytes() == hub[k].tobytes() for k in hub)


@pytest.mark.parametrize("name,fused,pipe", [("mixtral", False, 1), ("qwen2_moe", False, 1), ("qwen2_moe", True, 1),
                                            ("qwen2_moe_mixed", False, 2)])
def test_an_expert_sharded_import_reads_only_its_experts(name, fused, pipe, tmp_path, monkeypatch):
    """At expert 2 × tensor 2 every parameter lands where the single-device import puts it, and each expert's
    tensor is read by the two tensor ranks of the expert rank that holds it — never by the other expert rank. The
    mixed model also over pipe 2: each stack (MoE layers 3, 7; dense 0, 1, 2, 4, 5, 6) in its pipeline order, an
    expert tensor read only on the stage that holds its layer."""
    directory = fused_copy(tmp_path, name) if fused else FIXTURES / name
    cfg = model_config(FIXTURES / name)
    plan = make_plan(cfg, ParallelConfig(expert=2, tensor=2, pipe=pipe, data=-1, microbatches=pipe),
                     jax.devices()[:4 * pipe])
    reads, get = collections.Counter(), hf.SafetensorsDir.get

    def counted(self, name, shape=None, index=None):
        reads[name if index is None else (name, index[0])] += 1
        return get(self, name, shape, index)

    monkeypatch.setattr(hf.SafetensorsDir, "get", counted)
    sharded = params_of(directory, cfg, plan)
    monkeypatch.undo()
    single, canonical = nnx.to_pure_dict(params_of(directory, cfg)), nnx.to_pure_dict(plan.to_canonical(sharded))
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), canonical, single))
    shard = sharded["blocks"]["we_gate"][...].addressable_shards[0].data.shape  # [L/pipe, X/2, D, F/2]
    assert shard == (2 // pipe, 2, 64, 16)
    expert_reads = {k: n for k, n in reads.items() if "experts" in str(k)}
    if fused:  # (gate_up_proj, e) read for we_gate and we_up, (down_proj, e) for we_down, on 2 devices each
        assert sorted(expert_reads.values()) == [2] * 8 + [4] * 8  # 2 layers × 4 experts, once a tensor rank
    else:  # 2 layers × 4 experts × (gate, up, down), each read once by each of its expert rank's tensor ranks
        assert sorted(expert_reads.values()) == [2] * 24


# -----------------------------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("name,tensor", [("mixtral", 1), ("qwen2_moe", 1), ("qwen2_moe_mixed", 1), ("mixtral", 4),
                                         ("qwen3_moe", 1), ("qwen3_moe", 2), ("deepseek_v2", 1), ("deepseek_v3", 1),
                                         ("deepseek_v2", 2), ("deepseek_v3", 2)])
def test_logits_match_transformers(name, tensor):
    """One forward over four rows right-padded to one length (a causal model: padding after a row changes nothing
    before it): the reference batch [2, 13] and the two greedy texts, prompt + 31 new tokens (Mixtral's 41 tokens
    run past its window of 16). fp32 max-abs 1e-4 against transformers' logits, on one device and with heads,
    vocab and each expert's width split over tensor 4 (2 kv heads: replicated)."""
    ref, stored = reference(name), load_file(str(FIXTURES / name / "reference_logits.safetensors"))
    rows = ref["input_ids"] + [c["prompt"] + c["new_tokens"][:-1] for c in ref["greedy"]]
    T = max(len(r) for r in rows)
    ids = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    on = loaded(name, 1, tensor)
    with jax.set_mesh(on.mesh):
        logits = np.asarray(jax.jit(lambda m, x: m(x))(on.model, jnp.asarray(ids)))
    want = [*stored["logits"], stored["greedy_0_logits"], stored["greedy_1_logits"]]
    for i, w in enumerate(want):
        assert np.abs(logits[i, :len(w), :w.shape[-1]] - w).max() < 1e-4, i


@pytest.mark.parametrize("name,data,tensor", [("mixtral", 1, 1), ("qwen2_moe", 1, 1), ("qwen2_moe_mixed", 1, 1),
                                              ("qwen2_moe", 2, 2), ("qwen3_moe", 1, 4), ("deepseek_v2", 1, 1),
                                              ("deepseek_v3", 1, 1), ("deepseek_v3", 2, 2)])
def test_greedy_generation_matches_transformers(name, data, tensor):
    """32 greedy tokens with the KV cache, two prompts (5 and 9 tokens) in one left-padded batch, on one device and
    with the prompts over data 2 and each layer over tensor 2."""
    cases = reference(name)["greedy"]
    new = loaded(name, data, tensor).generate([c["prompt"] for c in cases], max_new_tokens=32, eos_token_id=None,
                                return_prompt=False)
    assert new.tolist() == [c["new_tokens"] for c in cases]


def cross_entropy(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean next-token cross-entropy of `ids` [B, T+1] under `logits` [B, T+1, V] (float64)."""
    z = logits[:, :-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean())


@pytest.mark.parametrize("name,expert,tensor,pipe", [("mixtral", 4, 2, 1), ("qwen2_moe", 2, 2, 1),
                                                   ("qwen2_moe_mixed", 2, 2, 2), ("qwen3_moe", 2, 2, 2),
                                                   ("deepseek_v2", 2, 2, 1),
                                                   ("deepseek_v3", 4, 2, 1), ("gpt_oss", 2, 2, 1)])
def test_loss_on_an_expert_layout_matches_transformers(name, expert, tensor, pipe):
    """Imported straight onto (data, pipe, expert, tensor) of the 8 devices and run through the training step's
    shard_map (tokens reach their experts by all-to-all; the mixed model's dense and MoE stacks over 2 pipeline
    stages, 2 microbatches), the loss of the reference batch (its 2 rows, repeated to fill the batch axes) is the
    cross-entropy of transformers' logits. The load-balancing loss is switched off: it has no counterpart in those
    logits."""
    cfg = model_config(FIXTURES / name)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=0.0))
    plan = make_plan(cfg, ParallelConfig(expert=expert, tensor=tensor, pipe=pipe, data=-1, microbatches=pipe),
                     jax.devices())
    graphdef, abstract = abstract_model(cfg, plan.padded_vocab)
    params = hf.load_params(FIXTURES / name, cfg, abstract, plan,
                            param_shardings(abstract, plan.mesh, plan.rules, plan.param_zero_data))
    step = sharded_loss_and_grads(graphdef, plan, param_specs=param_specs(params, plan.rules, plan.param_zero_data))
    ids = np.asarray(reference(name)["input_ids"] * 4, np.int32)  # [8, 13]
    loss, _ = jax.jit(step)(params, jax.device_put(jnp.asarray(ids), plan.batch_sharding))
    want = cross_entropy(np.tile(load_file(str(FIXTURES / name / "reference_logits.safetensors"))["logits"],
                                 (4, 1, 1)), ids)
    assert abs(float(loss) - want) < 2e-5


def test_export_loads_in_transformers(tmp_path):
    """Live round trip where transformers (and torch) are installed: jaxpar's export gives transformers' logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in MOE + ("deepseek_v2", "deepseek_v3"):
        hf.import_to_workdir(FIXTURES / name, tmp_path / name)
        hf.export_workdir(tmp_path / name, tmp_path / f"{name}_hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_hf", attn_implementation="eager")
        with torch.no_grad():
            logits = model(torch.tensor(reference(name)["input_ids"])).logits.numpy()
        want = load_file(str(FIXTURES / name / "reference_logits.safetensors"))["logits"]
        assert np.abs(logits - want).max() < 1e-4, name


# -----------------------------------------------------------------------------------------------------------------
# What jaxpar does not support, or Hugging Face cannot hold: one-line typed errors naming the key or field


def _set(**kv):
    return lambda c: c.update(kv)


BAD_CONFIGS = [  # (fixture, edit of config.json's dict, the message)
    ("mixtral", _set(router_jitter_noise=0.1), r"config\.json: router_jitter_noise = 0\.1: jaxpar's router has no "
                                               r"jitter"),
    ("qwen2_moe", _set(mlp_only_layers="1"), r"config\.json: mlp_only_layers = '1': must be a list of layer indices"),
    ("qwen2_moe_mixed", _set(mlp_only_layers=[1.0]), r"config\.json: mlp_only_layers = \[1\.0\]: must be a list of "
                                                     r"layer indices \(integers from 0\); write e\.g\. \[0, 3\]"),
    ("qwen2_moe_mixed", _set(mlp_only_layers=[5, 8]), r"config\.json: mlp_only_layers = \[5, 8\]: layers \[8\] do not "
                                                      r"exist: num_hidden_layers = 8 \(indices 0\.\.7\); list only"),
    ("qwen2_moe_mixed", _set(mlp_only_layers=[-1]), r"config\.json: mlp_only_layers = \[-1\]: layers \[-1\] do not "
                                                    r"exist"),
    ("qwen2_moe_mixed", _set(mlp_only_layers=[5, 1, 5]), r"config\.json: mlp_only_layers = \[5, 1, 5\]: lists layers "
                                                         r"\[5\] more than once; list each dense layer once$"),
    ("qwen2_moe_mixed", _set(mlp_only_layers=[1, 3, 5, 7]), r"config\.json: mlp_only_layers = \[1, 3, 5, 7\]: leaves "
                                                            r"none of the 8 layers an MoE layer"),
    ("qwen2_moe_mixed", _set(decoder_sparse_step=9), r"config\.json: decoder_sparse_step = 9: leaves none of the 8 "
                                                     r"layers an MoE layer"),
    ("qwen2_moe", _set(decoder_sparse_step=0), r"config\.json: decoder_sparse_step = 0: must be > 0$"),
    ("qwen2_moe_mixed", _set(decoder_sparse_step="2"), r"config\.json: decoder_sparse_step = '2': must be an "
                                                       r"integer$"),
    ("mixtral", _set(num_experts_per_tok=5), r"config\.json: num_experts_per_tok = 5: must be <= num_local_experts = "
                                             r"4"),
    ("qwen2_moe", _set(num_experts_per_tok=5), r"config\.json: num_experts_per_tok = 5: must be <= num_experts = 4"),
    ("mixtral", _set(num_local_experts=0), r"config\.json: num_local_experts = 0: must be > 0$"),
    ("qwen2_moe", _set(shared_expert_intermediate_size=-1), r"config\.json: shared_expert_intermediate_size = -1: "
                                                            r"must be >= 0$"),
    ("qwen2_moe", _set(norm_topk_prob="no"), r"config\.json: norm_topk_prob = 'no': must be true or false$"),
    ("qwen2_moe", _set(moe_intermediate_size=None), r"config\.json: no 'moe_intermediate_size', which a qwen2_moe "
                                                    r"model needs"),
    ("mixtral", _set(router_aux_loss_coef=-1), r"config\.json: router_aux_loss_coef = -1\.0: must be"),
]


def _case_id(name: str, message: str) -> str:  # "mixtral: router_jitter_noise = 0.1"
    return f"{name}: " + re.sub(r"\\(.)", r"\1", message).split("config.json: ")[1].split(":")[0].rstrip("$")


@pytest.mark.parametrize("name,edit,message", BAD_CONFIGS, ids=[_case_id(n, m) for n, _, m in BAD_CONFIGS])
def test_bad_moe_config_json_is_a_one_line_error_naming_the_key(tmp_path, name, edit, message):
    config = json.loads((FIXTURES / name / "config.json").read_text())
    edit(config)
    with pytest.raises(hf.HFError) as info:
        hf.model_config(config, tmp_path)
    assert "\n" not in str(info.value) and re.search(message, str(info.value)), str(info.value)


def test_export_refuses_what_neither_architecture_holds():
    """A shared expert without its gate: Qwen2-MoE always applies sigmoid(x·w) (the only MoE model neither holds)."""
    for name in ("qwen2_moe", "qwen2_moe_mixed"):
        qwen = model_config(FIXTURES / name)
        with pytest.raises(ConfigError) as info:
            hf.hf_config(dataclasses.replace(qwen, moe=dataclasses.replace(qwen.moe, shared_gate=False)))
        assert info.value.field == "moe.shared_gate"
