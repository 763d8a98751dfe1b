"""Hugging Face interop of DeepSeek-V2 / V3 (jaxpar/families/deepseek_hf.py) against fixtures written by
`transformers` itself (tests/fixtures/hf/make_hf_fixtures.py):

tests/fixtures/hf/deepseek_v2: softmax, group_limited_greedy (8 experts in 2 groups, 1 kept, top-2), no q_lora
(q_proj), YaRN (factor 4, mscale 1, mscale_all_dim 0.8), dense layer 0, a shared expert, routed_scaling_factor 1.5.
tests/fixtures/hf/deepseek_v3: sigmoid noaux_tc (8 experts in 2 groups, 1 kept, top-2) with a random non-zero
e_score_correction_bias that changes routing decisions, q_lora 24, dense layer 0, norm_topk_prob, routed scale 1.7,
rope_interleave, YaRN (factor 4, beta 16 / 2, mscale = mscale_all_dim = 1).

Two groups of tests. The first runs on the mapping alone: config.json → ModelConfig fields for every key (both
RoPE spellings, transformers' defaults), the refusals as one-line errors naming the key, the tensor table against
the fixture files (every name, every shape, the head splits, to_hf ∘ to_jax bit for bit, the fused layout), a fresh
config.json read back, and the export's refusals. The second builds models: import → export bit for bit through the
command line, the correction bias carried as a buffer, and the MTP refusal on import.
Parity with transformers' logits and greedy tokens is in tests/test_hf_moe.py's parametrisations.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.families import deepseek_hf
from jaxpar.families.moe_hf import ExpertRule, ZeroRule
from jaxpar.interop import hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def config_json(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def read(config: dict) -> dict:
    """The ModelConfig fields deepseek_hf reads from a config.json dict (no ModelConfig built)."""
    fields, _ = deepseek_hf.read(hf._Keys(config, pathlib.Path("config.json")), config["model_type"])
    return fields


def tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("model*.safetensors")):
        out.update(load_file(str(file)))
    return out


def config_of(fields: dict, **changes) -> ModelConfig:
    """The ModelConfig of fields deepseek_hf read, with `changes` applied (`moe_*` keys to the moe section)."""
    model = {k: v for k, v in changes.items() if not k.startswith("moe_")}
    moe = {k[4:]: v for k, v in changes.items() if k.startswith("moe_")}
    return ModelConfig(**{**fields, **model, "moe": {**fields["moe"], **moe}})


# -----------------------------------------------------------------------------------------------------------------
# config.json → fields


def test_every_key_of_both_fixtures_maps_to_its_field():
    v2, v3 = read(config_json("deepseek_v2")), read(config_json("deepseek_v3"))
    common = dict(family="deepseek", n_layers=3, n_heads=4, n_kv_heads=4, head_dim=16, max_seq_len=128, norm_eps=1e-6,
                  tie_embeddings=False, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                  rope_interleave=True, rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32,
                  rope_truncate=True)
    assert v2 == dict(common, vocab_size=515, d_model=48, d_ff=80, q_lora_rank=0, rope_theta=5e4, rope_beta_fast=32.0,
                      rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=0.8, moe=dict(
                          n_experts=8, top_k=2, d_ff=24, shared_d_ff=24, shared_gate=False, dense_layers=(0,),
                          norm_topk_prob=False, aux_loss_coef=0.0, scoring="softmax", n_group=2, topk_group=1,
                          correction_bias=False, routed_scale=1.5))
    assert v3 == dict(common, vocab_size=517, d_model=64, d_ff=96, q_lora_rank=24, rope_theta=1e4, rope_beta_fast=16.0,
                      rope_beta_slow=2.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, moe=dict(
                          n_experts=8, top_k=2, d_ff=16, shared_d_ff=16, shared_gate=False, dense_layers=(0,),
                          norm_topk_prob=True, aux_loss_coef=0.0, scoring="sigmoid", n_group=2, topk_group=1,
                          correction_bias=True, routed_scale=1.7))


def _old_spelling(config: dict, kind_key: str) -> dict:
    """transformers 4 / DeepSeek's own spelling: top-level rope_theta, rope_scaling with `type` or `rope_type`."""
    config = copy.deepcopy(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope[kind_key] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    return config


@pytest.mark.parametrize("name", DEEPSEEK)
@pytest.mark.parametrize("kind_key", ["type", "rope_type"])
def test_both_rope_spellings_read_alike(name, kind_key):
    assert read(_old_spelling(config_json(name), kind_key)) == read(config_json(name))


def test_hub_style_keys_and_transformers_defaults():
    """DeepSeek's own config.json keys (scoring_func, topk_method, aux_loss_alpha, moe_layer_freq 1, seq_aux,
    ep_size) are read; a V3 config.json without the routing keys takes DeepseekV3Config's defaults; a V2 one
    with topk_method greedy ignores its group keys, as transformers does; YaRN's factor defaults to the context
    ratio, a 0 beta to transformers' 32 / 1, and mscale counts only beside mscale_all_dim."""
    v3 = config_json("deepseek_v3")
    hub = dict(v3, scoring_func="sigmoid", topk_method="noaux_tc", aux_loss_alpha=0.001, moe_layer_freq=1,
               seq_aux=True, ep_size=1)
    assert read(hub)["moe"] == dict(read(v3)["moe"], aux_loss_coef=0.001)
    bare = {k: v for k, v in v3.items() if k not in (
        "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
        "n_shared_experts", "rope_interleave", "num_nextn_predict_layers")}
    fields = read(dict(bare, num_hidden_layers=5))  # first_k_dense_replace 3 by default: 2 MoE layers
    assert (fields["moe"]["n_group"], fields["moe"]["topk_group"], fields["moe"]["routed_scale"],
            fields["moe"]["norm_topk_prob"], fields["moe"]["dense_layers"], fields["moe"]["shared_d_ff"],
            fields["rope_interleave"]) == (8, 4, 2.5, True, (0, 1, 2), 16, True)
    v2 = dict(config_json("deepseek_v2"), topk_method="greedy", n_group=None, topk_group=None)
    assert (read(v2)["moe"]["n_group"], read(v2)["moe"]["topk_group"]) == (1, 1)
    yarn = copy.deepcopy(config_json("deepseek_v2"))
    del yarn["rope_parameters"]["factor"]
    yarn["rope_parameters"].update(beta_fast=0, beta_slow=0)
    fields = read(yarn)
    assert (fields["rope_factor"], fields["rope_beta_fast"], fields["rope_beta_slow"]) == (4.0, 32.0, 1.0)  # 128/32
    yarn["rope_parameters"].update(mscale=0.7, mscale_all_dim=0)
    assert (read(yarn)["rope_mscale"], read(yarn)["rope_mscale_all_dim"]) == (1.0, 0.0)
    v3_dense = dict(v3, n_shared_experts=0, q_lora_rank=None, rope_interleave=False)
    fields = read(v3_dense)
    assert (fields["moe"]["shared_d_ff"], fields["q_lora_rank"], fields["rope_interleave"]) == (0, 0, False)
    default_rope = dict(v3, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    fields = read(default_rope)
    assert (fields["rope_theta"], "rope_scaling" in fields, "rope_mscale" in fields) == (1e4, False, False)


def _set(**kv):
    return lambda c: c.update(kv)


def _rope(**kv):
    return lambda c: c["rope_parameters"].update(kv)


def _drop(key):
    return lambda c: c.pop(key)


BAD_CONFIGS = [  # (fixture, edit of config.json's dict, the message)
    ("deepseek_v3", _set(attention_bias=True), r"attention_bias = true \(biases on q_a_proj"),
    ("deepseek_v2", _set(mlp_bias=True), r"mlp_bias = true"),
    ("deepseek_v3", _set(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported"),
    ("deepseek_v3", _set(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"quantization_config \(quant_method 'fp8'\) is not supported.*weight_scale_inv"),
    ("deepseek_v3", _set(index_topk=2048, index_n_heads=64), r"index_n_heads, index_topk: DeepSeek-V3\.2's lightning "
                                                            r"indexer"),
    ("deepseek_v3", _set(moe_layer_freq=2), r"moe_layer_freq = 2: only 1 is supported"),
    ("deepseek_v3", _set(num_key_value_heads=2), r"num_key_value_heads = 2: must equal num_attention_heads = 4"),
    ("deepseek_v2", _set(norm_topk_prob=True), r"norm_topk_prob = True: DeepseekV2ForCausalLM in transformers 5 "
                                               r"never renormalises"),
    ("deepseek_v2", _set(scoring_func="sigmoid"), r"scoring_func = 'sigmoid': DeepseekV2ForCausalLM scores experts "
                                                  r"by 'softmax' only"),
    ("deepseek_v2", _set(topk_method="noaux_tc"), r"topk_method = 'noaux_tc': DeepseekV2ForCausalLM selects experts "
                                                  r"by 'greedy' or 'group_limited_greedy'"),
    ("deepseek_v3", _set(topk_method="greedy"), r"topk_method = 'greedy': DeepseekV3ForCausalLM selects experts by "
                                                r"'noaux_tc'"),
    ("deepseek_v3", _set(scoring_func="softmax"), r"scoring_func = 'softmax': DeepseekV3ForCausalLM scores experts "
                                                  r"by 'sigmoid' only"),
    ("deepseek_v2", _set(n_group=None), r"no 'n_group'"),
    ("deepseek_v3", _set(first_k_dense_replace=3), r"first_k_dense_replace = 3: leaves none of the "
                                                   r"num_hidden_layers = 3 layers an MoE layer"),
    ("deepseek_v3", _set(first_k_dense_replace=-1), r"first_k_dense_replace = -1: must be >= 0"),
    ("deepseek_v3", _drop("q_lora_rank"), r"no 'q_lora_rank'.*null for a direct q_proj"),
    ("deepseek_v3", _set(q_lora_rank=0), r"q_lora_rank = 0: must be > 0"),
    ("deepseek_v3", _set(kv_lora_rank="16"), r"kv_lora_rank = '16': must be an integer"),
    ("deepseek_v3", _drop("n_routed_experts"), r"no 'n_routed_experts'"),
    ("deepseek_v3", _set(num_nextn_predict_layers=-1), r"num_nextn_predict_layers = -1: must be >= 0"),
    ("deepseek_v3", _set(rope_interleave="yes"), r"rope_interleave = 'yes': must be true or false"),
    ("deepseek_v3", _set(routed_scaling_factor=float("nan")), r"routed_scaling_factor = nan: must be a finite"),
    ("deepseek_v2", _rope(attention_factor=1.2), r"rope_parameters\.attention_factor \(an explicit cos/sin factor\)"),
    ("deepseek_v2", _rope(partial_rotary_factor=0.5), r"rope_parameters\.partial_rotary_factor"),
    ("deepseek_v2", _rope(truncate="no"), r"rope_parameters\.truncate = 'no': must be true or false"),
    ("deepseek_v2", _rope(mscale=0), r"rope_parameters\.mscale_all_dim = 0\.8 without mscale"),
    ("deepseek_v2", _rope(rope_type="dynamic"), r"rope_parameters\.rope_type = 'dynamic' is not supported; jaxpar's "
                                                r"deepseek family implements 'yarn'"),
    ("deepseek_v2", lambda c: c["rope_parameters"].pop("original_max_position_embeddings"),
     r"no 'rope_parameters\.original_max_position_embeddings', which yarn RoPE scaling needs"),
]


def _case_id(name: str, message: str) -> str:  # "deepseek_v3: attention_bias = true"
    return f"{name}: " + re.sub(r"\\(.)", r"\1", message).split(":")[0].split(" (")[0]


@pytest.mark.parametrize("name,edit,message", BAD_CONFIGS, ids=[_case_id(n, m) for n, _, m in BAD_CONFIGS])
def test_bad_config_json_is_a_one_line_error_naming_the_key(tmp_path, name, edit, message):
    """Through hf.model_config, the path every import takes: refused while reading config.json, before a model."""
    config = config_json(name)
    edit(config)
    with pytest.raises(hf.HFError) as info:
        hf.model_config(config, tmp_path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / 'config.json'}: ") and re.search(message, text), text


def test_the_architectures_are_registered():
    assert hf.ARCHITECTURES["DeepseekV2ForCausalLM"] == ("deepseek", "deepseek_v2")
    assert hf.ARCHITECTURES["DeepseekV3ForCausalLM"] == ("deepseek", "deepseek_v3")


# -----------------------------------------------------------------------------------------------------------------
# The tensor table against the fixture files


def jaxpar_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The agreed jaxpar shapes (one layer's, one expert's), from the parameter names of the common notes."""
    D, H, V, X = cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.moe.n_experts
    E, r, R, rq = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
    Ev, nope, F, Fs = cfg.v_head_dim, cfg.qk_nope_head_dim, cfg.moe.d_ff, cfg.moe.shared_d_ff
    shapes = {"embed": (V, D), "final_norm": (D,), "lm_head": (D, V), "dense_blocks.w_gate": (D, cfg.d_ff),
              "dense_blocks.w_up": (D, cfg.d_ff), "dense_blocks.w_down": (cfg.d_ff, D), "blocks.router": (D, X),
              "blocks.e_score_correction_bias": (X,), "blocks.we_gate": (D, F), "blocks.we_up": (D, F),
              "blocks.we_down": (F, D), "blocks.ws_gate": (D, Fs), "blocks.ws_up": (D, Fs), "blocks.ws_down": (Fs, D)}
    for stack in ("blocks", "dense_blocks"):
        shapes.update({f"{stack}.{k}": v for k, v in dict(
            attn_norm=(D,), mlp_norm=(D,), wq=(D, H, E), wq_a=(D, rq), q_a_norm=(rq,), wq_b=(rq, H, E),
            wkv_a=(D, r + R), kv_a_norm=(r,), wkv_b=(r, H, nope + Ev), wo=(H, Ev, D)).items()})
    return shapes


def each_tensor(rule, cfg):
    """(HF name, model layer, expert) of every tensor `rule` reads."""
    layers = rule.model_layers(cfg.n_layers) if rule.stacked else (None,)
    for layer in layers:
        if isinstance(rule, ExpertRule) and rule.per_expert:
            for e in range(cfg.moe.n_experts):
                yield rule.name.format(l=layer, e=e), layer, e
        elif isinstance(rule, ExpertRule):
            for e in range(cfg.moe.n_experts):
                yield rule.name.format(l=layer), layer, e
        else:
            yield (rule.name.format(l=layer) if layer is not None else rule.name), layer, None


def fused(name: str) -> dict[str, np.ndarray]:
    """The fixture in transformers 5's fused expert layout (what save_pretrained(save_original_format=False) writes,
    asserted by the fixture script): per MoE layer experts.gate_up_proj [X, 2F, D], experts.down_proj [X, D, F]."""
    hub, cfg = tensors(FIXTURES / name), config_of(read(config_json(name)))
    out = {k: v for k, v in hub.items() if ".mlp.experts." not in k}
    for layer in cfg.layer_stacks["blocks"]:
        get = lambda e, w: hub[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"]  # noqa: E731
        X = cfg.moe.n_experts
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(X)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([get(e, "down_proj") for e in range(X)])
    return out


@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("name", DEEPSEEK)
def test_the_tensor_table_names_every_tensor_with_its_shape_and_inverts_bit_for_bit(name, layout):
    files = tensors(FIXTURES / name) if layout == "hub" else fused(name)
    cfg = config_of(read(config_json(name)))
    assert cfg.layer_stacks == {"blocks": (1, 2), "dense_blocks": (0,)}
    rules = deepseek_hf.tensors(cfg, set(files))
    shapes, seen = jaxpar_shapes(cfg), set()
    for rule in rules:
        assert not isinstance(rule, ZeroRule), rule.param
        for hf_name, layer, e in each_tensor(rule, cfg):
            x = files[hf_name]
            if isinstance(rule, ExpertRule) and not rule.per_expert:  # one expert's rows of the fused tensor
                rows = x.shape[1] // rule.parts
                x = x[e, rule.part * rows:(rule.part + 1) * rows]
            y = rule.to_jax(x)
            assert y.shape == shapes[rule.param], (hf_name, rule.param, y.shape)
            assert rule.to_hf(y).tobytes() == x.tobytes(), hf_name
            seen.add(hf_name)
    assert seen == set(files)
    params = {r.param for r in rules}
    if name == "deepseek_v2":
        assert {"blocks.wq", "dense_blocks.wq"} <= params and "blocks.wq_a" not in params
        assert "blocks.e_score_correction_bias" not in params
    else:
        assert {"blocks.wq_a", "blocks.q_a_norm", "blocks.wq_b", "blocks.e_score_correction_bias"} <= params
        assert "blocks.wq" not in params


@pytest.mark.parametrize("name", DEEPSEEK)
def test_head_splits_follow_hf_row_order(name):
    """Row h·W + j of a head-major HF projection is jaxpar's [.., h, j]: per head k_nope then v in kv_b_proj, the
    query's last qk_rope_head_dim dims its rope part (no permutation); o_proj's column h·Ev + j is wo[h, j]."""
    files, cfg = tensors(FIXTURES / name), config_of(read(config_json(name)))
    rules = {r.param: r for r in deepseek_hf.tensors(cfg, set(files))}
    nope, Ev, E = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv_b = files["model.layers.1.self_attn.kv_b_proj.weight"]
    wkv_b = rules["blocks.wkv_b"].to_jax(kv_b)
    q_name, q_param = (("q_b_proj", "blocks.wq_b") if cfg.q_lora_rank else ("q_proj", "blocks.wq"))
    q = files[f"model.layers.1.self_attn.{q_name}.weight"]
    wq = rules[q_param].to_jax(q)
    o = files["model.layers.1.self_attn.o_proj.weight"]
    wo = rules["blocks.wo"].to_jax(o)
    for h in range(cfg.n_heads):
        np.testing.assert_array_equal(wkv_b[:, h, :nope], kv_b[h * (nope + Ev):h * (nope + Ev) + nope].T)
        np.testing.assert_array_equal(wkv_b[:, h, nope:], kv_b[h * (nope + Ev) + nope:(h + 1) * (nope + Ev)].T)
        np.testing.assert_array_equal(wq[:, h, nope:], q[h * E + nope:(h + 1) * E].T)  # the rope part
        np.testing.assert_array_equal(wo[h], o[:, h * Ev:(h + 1) * Ev].T)
    wkv_a = rules["blocks.wkv_a"].to_jax(files["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    assert wkv_a.shape == (cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # latent first, then the rope key


@pytest.mark.parametrize("tensor,message", [
    ("model.layers.1.self_attn.q_a_proj.weight_scale_inv", r"an fp8 weight block's scale"),
    ("model.layers.1.self_attn.indexer.wk.weight", r"DeepSeek-V3\.2's lightning indexer"),
    ("model.layers.3.eh_proj.weight", r"layer 3 >= num_hidden_layers = 3: a multi-token-prediction \(MTP\) module"),
    ("model.layers.3.shared_head.norm.weight", r"multi-token-prediction"),
])
def test_tensors_jaxpar_does_not_implement_are_refused_by_name(tensor, message):
    cfg = config_of(read(config_json("deepseek_v3")))
    with pytest.raises(ConfigError) as info:
        deepseek_hf.tensors(cfg, set(tensors(FIXTURES / "deepseek_v3")) | {tensor})
    assert info.value.field == f"tensor {tensor}" and re.search(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


def test_zero_width_shared_experts_and_a_missing_bias_are_zero_rules():
    """n_shared_experts 0 (transformers builds a width-0 MLP) and a sigmoid model without a correction bias (V3
    always holds one): tensors no parameter holds, written as zeros."""
    cfg = config_of(read(dict(config_json("deepseek_v3"), n_shared_experts=0)), moe_correction_bias=False)
    zero = {r.param: r.shape for r in deepseek_hf.tensors(cfg) if isinstance(r, ZeroRule)}
    assert zero == {"blocks.ws_gate": (0, 64), "blocks.ws_up": (0, 64), "blocks.ws_down": (64, 0),
                    "blocks.e_score_correction_bias": (8,)}


# -----------------------------------------------------------------------------------------------------------------
# The mapping's meaning: a numpy DeepSeek forward over the mapped arrays and fields equals transformers' logits


def _mscale(scale: float, m: float) -> float:
    return 0.1 * m * np.log(scale) + 1.0 if scale > 1 else 1.0


def _yarn_inv_freq(cfg) -> np.ndarray:
    """YaRN's frequencies over the R = qk_rope_head_dim rope dims (the YaRN paper's ramp between extrapolated and
    interpolated frequencies; correction range rounded outward)."""
    R, base, f = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    pos = base ** (np.arange(0, R, 2) / R)
    dim_of = lambda rot: R * np.log(cfg.rope_original_max_len / (rot * 2 * np.pi)) / (2 * np.log(base))  # noqa: E731
    low, high = max(np.floor(dim_of(cfg.rope_beta_fast)), 0), min(np.ceil(dim_of(cfg.rope_beta_slow)), R - 1)
    ramp = np.clip((np.arange(R // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    return (1 / (f * pos)) * ramp + (1 / pos) * (1 - ramp)


def numpy_forward(cfg, p: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one row, float64, from the DeepSeek-V2 paper's equations over jaxpar-layout arrays `p`
    (param → [L or per-layer list, …]; experts [X, …]) and the jaxpar fields of `cfg` — written from the papers
    and the agreed field meanings, not from transformers' code."""
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w  # noqa: E731
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    T, H, nope, R = len(ids), cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    f, moe = cfg.rope_factor, cfg.moe
    # cos/sin scale get_mscale(f, mscale) / get_mscale(f, mscale_all_dim); softmax scale × get_mscale(f, all_dim)²
    amp = _mscale(f, cfg.rope_mscale) / _mscale(f, cfg.rope_mscale_all_dim)
    scale = (nope + R) ** -0.5 * _mscale(f, cfg.rope_mscale_all_dim) ** 2
    angle = np.arange(T)[:, None] * _yarn_inv_freq(cfg)[None]  # [T, R/2]
    cos, sin = np.cos(angle) * amp, np.sin(angle) * amp

    def rope(x):  # [T, ..., R]: pairs (2i, 2i+1) when interleaved, else (i, i + R/2)
        a, b = (x[..., 0::2], x[..., 1::2]) if cfg.rope_interleave else (x[..., :R // 2], x[..., R // 2:])
        c, s_ = (cos[:, None], sin[:, None]) if x.ndim == 3 else (cos, sin)
        return np.concatenate([a * c - b * s_, b * c + a * s_], -1)  # a permutation of the pairs: dots unchanged

    x = p["embed"][ids].astype(np.float64)
    for layer in range(cfg.n_layers):
        w = {k.split(".", 1)[1]: v[layer] for k, v in p.items() if "." in k and layer in v}
        h = rms(x, w["attn_norm"])
        if cfg.q_lora_rank:
            q = np.einsum("tr,rhe->the", rms(h @ w["wq_a"], w["q_a_norm"]), w["wq_b"])
        else:
            q = np.einsum("td,dhe->the", h, w["wq"])
        kv = h @ w["wkv_a"]
        latent, k_rope = rms(kv[:, :cfg.kv_lora_rank], w["kv_a_norm"]), rope(kv[:, cfg.kv_lora_rank:])
        kvb = np.einsum("tr,rhe->the", latent, w["wkv_b"])
        k = np.concatenate([kvb[..., :nope], np.broadcast_to(k_rope[:, None], (T, H, R))], -1)
        q = np.concatenate([q[..., :nope], rope(q[..., nope:])], -1)
        z = np.einsum("she,the->hst", q, k) * scale + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(z - z.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hst,the,hed->sd", a, kvb[..., nope:], w["wo"])
        h = rms(x, w["mlp_norm"])
        if "w_gate" in w:
            x = x + (silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
            continue
        logits = h @ w["router"]
        if moe.scoring == "softmax":
            score = np.exp(logits - logits.max(-1, keepdims=True))
            score /= score.sum(-1, keepdims=True)
        else:
            score = 1 / (1 + np.exp(-logits))
        choice = score + (w["e_score_correction_bias"] if moe.correction_bias else 0)
        grouped = choice.reshape(T, moe.n_group, -1)
        group = grouped.max(-1) if moe.scoring == "softmax" else np.sort(grouped, -1)[..., -2:].sum(-1)
        kept = np.argsort(-group, -1)[:, :moe.topk_group]
        mask = np.full((T, moe.n_group), -np.inf)
        np.put_along_axis(mask, kept, 0.0, -1)
        top = np.argsort(-(choice + np.repeat(mask, moe.n_experts // moe.n_group, -1)), -1)[:, :moe.top_k]
        gate = np.take_along_axis(score, top, -1)
        if moe.norm_topk_prob:
            gate = gate / (gate.sum(-1, keepdims=True) + 1e-20)
        gate = gate * moe.routed_scale
        out = (silu(h @ w["ws_gate"]) * (h @ w["ws_up"])) @ w["ws_down"] if moe.shared_d_ff else 0
        for t in range(T):
            for e, g in zip(top[t], gate[t]):
                out_t = (silu(h[t] @ w["we_gate"][e]) * (h[t] @ w["we_up"][e])) @ w["we_down"][e]
                out = out + np.eye(T)[t][:, None] * g * out_t
        x = x + out
    return rms(x, p["final_norm"]) @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


def mapped(name: str):
    """(stand-in cfg, the fixture's tensors mapped to jaxpar's layout: unstacked params as arrays, stacked ones as
    {model layer: array}, experts stacked [X, …])."""
    files, cfg = tensors(FIXTURES / name), config_of(read(config_json(name)))
    p: dict = {}
    for rule in deepseek_hf.tensors(cfg, set(files)):
        for hf_name, layer, e in each_tensor(rule, cfg):
            y = rule.to_jax(files[hf_name]).astype(np.float64)
            if layer is None:
                p[rule.param] = y
            elif e is None:
                p.setdefault(rule.param, {})[layer] = y
            else:
                p.setdefault(rule.param, {}).setdefault(layer, []).append(y)
    for rule in p.values():
        if isinstance(rule, dict):
            for layer, y in rule.items():
                rule[layer] = np.stack(y) if isinstance(y, list) else y
    return cfg, p


@pytest.mark.parametrize("name", DEEPSEEK)
def test_a_numpy_forward_over_the_mapping_matches_transformers(name):
    """Every mapped tensor and field in use: transformers' logits of the reference batch (fp32, max-abs 1e-4) from a
    plain numpy DeepSeek over the mapped arrays. So the head splits, the latent's k_nope / v order, the rope part's
    position and pair order, YaRN's fields (mscale vs mscale_all_dim), the routing fields (groups, bias for selection
    only, renormalisation, scale) and the shared expert mean what the model side is told they mean."""
    cfg, p = mapped(name)
    want = load_file(str(FIXTURES / name / "reference_logits.safetensors"))["logits"]
    ids = np.asarray(json.loads((FIXTURES / name / "reference.json").read_text())["input_ids"])
    for row in range(len(ids)):
        assert np.abs(numpy_forward(cfg, p, ids[row]) - want[row]).max() < 1e-4, row


# -----------------------------------------------------------------------------------------------------------------
# Export: config.json and refusals


@pytest.mark.parametrize("name", DEEPSEEK)
@pytest.mark.parametrize("base", ["imported", "fresh"])
def test_the_exported_config_json_reads_back_to_the_same_fields(name, base):
    """write → read is the identity on the fields, from the imported config.json (transformers 5's rope_parameters
    kept) and from nothing (the older rope_theta + rope_scaling spelling, with DeepSeek's `type` key)."""
    fields = read(config_json(name))
    out = copy.deepcopy(config_json(name)) if base == "imported" else {}
    deepseek_hf.write(config_of(fields), out, config_json(name) if base == "imported" else None)
    assert read(out) == fields
    arch = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[name]
    assert out["architectures"] == [arch] and out["head_dim"] == 8 and out["qk_head_dim"] == 16
    if base == "imported":
        for key, value in config_json(name).items():  # every key transformers wrote keeps its value
            if key not in ("num_nextn_predict_layers",):
                assert out[key] == value, key
    else:
        assert out["rope_scaling"]["type"] == out["rope_scaling"]["rope_type"] == "yarn"
    if name == "deepseek_v3":
        assert out["num_nextn_predict_layers"] == 0 and out["topk_method"] == "noaux_tc"
    else:
        assert out["topk_method"] == "group_limited_greedy" and out["scoring_func"] == "softmax"


@pytest.mark.parametrize("name,where,field,value,refused", [
    ("deepseek_v2", "moe", "correction_bias", True, "moe.correction_bias"),
    ("deepseek_v2", "moe", "norm_topk_prob", True, "moe.norm_topk_prob"),
    ("deepseek_v2", "model", "rope_interleave", False, "model.rope_interleave"),
    ("deepseek_v3", "moe", "shared_gate", True, "moe.shared_gate"),
    ("deepseek_v3", "moe", "shared_d_ff", 24, "moe.shared_d_ff"),
    ("deepseek_v3", "moe", "dense_layers", (1,), "moe.dense_layers"),
    ("deepseek_v3", "moe", "sparse_step", 2, "moe.dense_layers"),
    ("deepseek_v3", "model", "sliding_window", 16, "model.sliding_window"),
    ("deepseek_v3", "model", "qkv_bias", True, "model.qkv_bias"),
])
def test_export_refuses_what_neither_architecture_holds(name, where, field, value, refused):
    fields = read(config_json(name))
    deepseek_hf.exportable(config_of(fields))  # the fixtures' own configs export
    with pytest.raises(ConfigError) as info:
        deepseek_hf.exportable(config_of(fields, **{("moe_" if where == "moe" else "") + field: value}))
    assert info.value.field == refused and "\n" not in str(info.value)


def test_v3_without_the_bias_and_v2_greedy_export():
    # still V3 (sigmoid); its bias tensor is written as zeros (a ZeroRule)
    v3 = config_of(read(config_json("deepseek_v3")), moe_correction_bias=False)
    out: dict = {}
    deepseek_hf.write(v3, out, None)
    assert out["architectures"] == ["DeepseekV3ForCausalLM"]
    v2 = config_of(read(config_json("deepseek_v2")), moe_n_group=1, moe_topk_group=1)
    out = {}
    deepseek_hf.write(v2, out, None)
    assert (out["architectures"], out["topk_method"]) == (["DeepseekV2ForCausalLM"], "greedy")


# -----------------------------------------------------------------------------------------------------------------
# --drop-mtp, on any family's checkpoint


def test_drop_mtp_leaves_out_only_the_layers_beyond_the_model(tmp_path, capsys):
    """The explicit skip: a Llama checkpoint with tensors of a layer past num_hidden_layers is refused (they are not
    the model's), imported with drop_mtp, and exported without them; --drop-mtp anywhere but an import is a usage
    error."""
    from jaxpar.cli import main

    src = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", src)
    extra = {"model.layers.2.eh_proj.weight": np.ones((64, 128), np.float32),
             "model.layers.2.enorm.weight": np.ones(64, np.float32)}
    index = json.loads((src / hf.INDEX).read_text())
    shard = src / index["weight_map"]["lm_head.weight"]
    files = load_file(str(shard))
    files.update(extra)
    save_file(files, str(shard), metadata={"format": "pt"})
    index["weight_map"].update({k: shard.name for k in extra})
    (src / hf.INDEX).write_text(json.dumps(index))
    assert hf.beyond_layers(set(index["weight_map"]), 2) == set(extra)
    with pytest.raises(hf.HFError, match="model.layers.2.eh_proj.weight"):
        hf.import_to_workdir(src, tmp_path / "refused")
    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "w"), "--drop-mtp"]) == 0
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "out")]) == 0
    out, want = tensors(tmp_path / "out"), tensors(FIXTURES / "llama")
    assert sorted(out) == sorted(want) and all(out[k].tobytes() == want[k].tobytes() for k in want)
    capsys.readouterr()
    assert main(["convert", "--from", str(tmp_path / "w"), "--to", str(tmp_path / "w2"), "--drop-mtp"]) == 2
    assert "--drop-mtp" in capsys.readouterr().err


# -----------------------------------------------------------------------------------------------------------------
# Real models: import and export


@pytest.mark.parametrize("name", DEEPSEEK)
def test_model_config_of_the_fixtures(name):
    cfg = hf.model_config(hf.read_config(FIXTURES / name), FIXTURES / name)
    fields = read(config_json(name))
    for key, value in fields.items():
        if key == "moe":
            for k, v in value.items():
                assert getattr(cfg.moe, k) == v, k
        else:
            assert getattr(cfg, key) == value, key
    assert cfg.layer_stacks == {"blocks": (1, 2), "dense_blocks": (0,)}


@pytest.mark.parametrize("name,layout", [("deepseek_v2", "hub"), ("deepseek_v3", "hub"), ("deepseek_v3", "fused")])
def test_command_line_import_export_reproduces_every_tensor_bit_for_bit(name, layout, tmp_path):
    """`jaxpar convert --from-hf` then `--to-hf`: every tensor bit for bit (the fused layout exports the hub's), the
    correction bias included — a Buffer in the workdir — and the config.json reads back to the same ModelConfig."""
    from jaxpar.cli import main
    from jaxpar.model import buffers_of
    from jaxpar.store import checkpoint

    src = FIXTURES / name
    if layout == "fused":
        src = tmp_path / "fused"
        src.mkdir()
        shutil.copy(FIXTURES / name / "config.json", src)
        save_file(fused(name), str(src / hf.SINGLE), metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "w")]) == 0
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "out")]) == 0
    want, got = tensors(FIXTURES / name), tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    exported = hf.read_config(tmp_path / "out")
    assert hf.model_config(exported, tmp_path) == hf.model_config(config_json(name), FIXTURES / name)
    if name == "deepseek_v3":
        _, state, _ = checkpoint.read_canonical(tmp_path / "w")
        bias = np.asarray(buffers_of(state)["blocks"]["e_score_correction_bias"][...])
        np.testing.assert_array_equal(bias, np.stack([want[f"model.layers.{l}.mlp.gate.e_score_correction_bias"]
                                                      for l in (1, 2)]))


def test_a_bfloat16_export_keeps_the_correction_bias_float32(tmp_path):
    hf.import_to_workdir(FIXTURES / "deepseek_v3", tmp_path / "w")
    hf.export_workdir(tmp_path / "w", tmp_path / "out", dtype="bfloat16")
    out = tensors(tmp_path / "out")
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert out["model.layers.1.mlp.gate.weight"].dtype != np.float32


def test_mtp_weights_are_refused_on_import_naming_mtp(tmp_path, capsys):
    """A V3 checkpoint with an MTP module (layer num_hidden_layers = 3) that its config.json does not declare
    (num_nextn_predict_layers 0): refused, not imported without it — unless the import is told to leave it out
    (--drop-mtp). (A declared module imports: tests/test_mtp.py.)"""
    src = tmp_path / "mtp"
    shutil.copytree(FIXTURES / "deepseek_v3", src)
    files = load_file(str(src / hf.SINGLE))
    files["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    files["model.layers.3.enorm.weight"] = np.ones(64, np.float32)
    save_file(files, str(src / hf.SINGLE), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(ConfigError, match=r"multi-token-prediction \(MTP\)"):
        hf.import_to_workdir(src, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    from jaxpar.cli import main

    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "w")]) == 2  # one line, exit 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tensor model.layers.3.eh_proj.weight" in lines[0] and "(MTP)" in lines[0], lines
    assert "--drop-mtp" in lines[0]
    # said explicitly: imported without them, and the export (num_nextn_predict_layers 0) holds the base model's only
    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "w"), "--drop-mtp"]) == 0
    assert main(["convert", "--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "out")]) == 0
    out = tensors(tmp_path / "out")
    assert sorted(out) == sorted(tensors(FIXTURES / "deepseek_v3"))
    assert hf.read_config(tmp_path / "out")["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("name", DEEPSEEK)
def test_a_fresh_config_json_reads_back_to_the_same_model_config(name):
    cfg = hf.model_config(hf.read_config(FIXTURES / name), FIXTURES / name)
    assert hf.model_config(hf.hf_config(cfg), FIXTURES) == cfg
