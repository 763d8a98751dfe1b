"""Config: presets and recipes load, overrides parse to the declared types, and every config that cannot run is refused.

Each refusal must be a `ConfigError` whose one-line message names the field and carries a "Fix:" part. Sizes that
should fail a divisibility rule are primes (7 heads, vocab 257, batch 31) so no accidental factor lets them pass.
These tests only parse and validate: nothing here traces or compiles, and only the CLI tests start a process.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar.config import SECTIONS, Config, ConfigError, ModelConfig, ParallelConfig, config_from_dict, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.py")
PRESETS = sorted(ROOT.glob("configs/*.py")) + sorted(ROOT.glob("recipes/*.yaml"))
# A device count each preset is meant for; presets not listed get 8 (one host, or the simulated CPU devices).
DEVICES = {"llama_8b": 64, "mixtral_8x7b": 64, "qwen2_moe_57b": 128, "deepseek_v3": 256}


def _tiny(**sections) -> dict:
    """A small valid config dict (tiny's shapes, tensor 2) with some sections' keys replaced."""
    d = {
        "model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256},
        "parallel": {"tensor": 2},
        "train": {"batch_size": 32, "seq_len": 128},
    }
    for name, keys in sections.items():
        d[name] = {**d.get(name, {}), **keys}
    return d


def _raises(field: str, fn, *args, one_line: bool = True, **kwargs) -> str:
    """Assert `fn(*args, **kwargs)` raises a ConfigError for `field`, with the field and a fix in its message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    err, msg = info.value, str(info.value)
    assert err.field == field, msg
    assert field in msg and "Fix:" in msg, msg
    if one_line:
        assert "\n" not in msg, msg  # one line, so the CLI can print it as is
    assert isinstance(err, ValueError)
    return msg


# ---------------------------------------------------------------------------------------------------------------------
# Presets and recipes.


def test_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"tiny.py", "gpt2_small.py", "llama_1b.py", "llama_8b.py", "tiny_gpt2.yaml", "tiny_long.yaml",
            "long_context.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_preset_loads_and_resolves(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, Config)
    n = DEVICES.get(path.stem, 8)
    resolved = cfg.resolve_for_devices(n)
    data, pipe, expert, context, tensor = resolved.mesh_shape
    assert expert == 1 or resolved.moe.enabled  # experts to split, or nothing on the axis
    assert data > 0 and data * pipe * expert * context * tensor == n
    # The resolved config survives the JSON round trip that WORKDIR/config.json relies on.
    assert config_from_dict(json.loads(resolved.to_json())) == resolved


def test_deepseek_v3_preset_is_deepseek_v3s_size():
    """configs/deepseek_v3.py's docstring figures: 671.0B parameters, 37.6B of them active per token (a token runs
    8 of the 256 routed experts of each of the 58 MoE layers; DeepSeek-AI report 671B and 37B)."""
    from jaxpar.model import count_params

    m = load_config("configs/deepseek_v3.py").model
    total = count_params(m)
    idle = (m.moe.n_experts - m.moe.top_k) * 3 * m.d_model * m.moe.d_ff * m.moe_layer_count
    assert (round(total / 1e9, 1), round((total - idle) / 1e9, 1)) == (671.0, 37.6)


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.py")), ids=lambda p: p.name)
def test_preset_is_a_commented_config_dict(path):
    """ml_collections ConfigDict of known sections; every key line carries a trailing comment; a docstring."""
    import importlib.util

    import ml_collections

    spec = importlib.util.spec_from_file_location(f"preset_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__ and "tokens per step" in module.__doc__
    cfg = module.get_config()
    assert isinstance(cfg, ml_collections.ConfigDict)
    assert set(cfg.to_dict()) <= set(SECTIONS)
    for line in path.read_text().splitlines():
        if line.strip().startswith("config.") and "=" in line and "ConfigDict()" not in line:
            assert "  # " in line, f"{path.name}: key without a comment: {line.strip()}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("recipes/*.yaml")), ids=lambda p: p.name)
def test_recipe_keys_are_commented(path):
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert " # " in line, f"{path.name}: key without a comment: {line.strip()}"


def test_tiny_preset_shape():
    """The demo model's structure; its sizes may be tuned, but it stays byte-level, GQA and tensor-parallel on 8."""
    cfg = load_config(TINY)
    m, p = cfg.model, cfg.parallel
    assert (m.family, m.vocab_size, cfg.data.tokenizer) == ("llama", 256, "bytes")
    assert m.n_kv_heads < m.n_heads and m.head_dim == m.d_model // m.n_heads
    assert (p.data, p.tensor) == (-1, 2)
    assert cfg.resolve_for_devices(8).mesh_shape == (2, 2, 1, 1, 2)  # the demo layout: data, pipe, tensor


def test_recipe_with_base_overrides_base():
    cfg = load_config(str(ROOT / "recipes" / "tiny_gpt2.yaml"))
    base = load_config(TINY)
    assert cfg.model.family == "gpt2" and base.model.family == "llama"
    assert cfg.model.tie_embeddings is True and base.model.tie_embeddings is False
    assert cfg.train.lr == 1e-3 != base.train.lr
    assert cfg.model.d_ff == 4 * cfg.model.d_model  # derived for gpt2, not llama's 8/3
    # Keys the recipe does not name come from the base, not from the dataclass defaults.
    assert (cfg.train.steps, cfg.model.d_model, cfg.parallel.tensor) == (
        base.train.steps, base.model.d_model, base.parallel.tensor)


def test_recipe_base_deep_merges(tmp_path):
    """A base given by absolute path; siblings of an overridden key survive."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\nmodel:\n  n_layers: 8\ntrain:\n  steps: 7\n")
    trusted = [pathlib.Path(TINY).parent]  # a base outside the recipe's tree must be trusted explicitly
    cfg, base = load_config(str(recipe), config_roots=trusted), load_config(TINY)
    assert (cfg.model.n_layers, cfg.train.steps) == (8, 7)
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.train.lr) == (base.model.n_heads, base.model.n_kv_heads,
                                                                      base.train.lr)
    # Command-line overrides apply on top of the recipe.
    assert load_config(str(recipe), ["train.steps=3"], trusted).train.steps == 3


def test_recipe_base_outside_its_tree_is_refused_unless_trusted(tmp_path):
    """A base is code (a .py base runs), so a recipe may reach only into its own tree — the project holding it —
    unless the caller trusts another directory; a chain of bases is held to the same roots."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "evil.py").write_text("raise SystemExit('ran')\n")
    project = tmp_path / "project"
    (project / "recipes").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    (project / "configs").mkdir()
    (project / "configs" / "mid.yaml").write_text(f"base: {outside / 'evil.py'}\n")
    (project / "recipes" / "ok.yaml").write_text("base: ../configs/mid.yaml\n")
    (project / "recipes" / "sibling.yaml").write_text(f"base: {TINY}\n")
    with pytest.raises(ConfigError, match=r"^base = .*evil.py.*outside the recipe's tree .*project.*--config-root"):
        load_config(str(project / "recipes" / "ok.yaml"))  # reaches the project's configs/, whose base leaves it
    with pytest.raises(ConfigError, match="outside the recipe's tree"):
        load_config(str(project / "recipes" / "sibling.yaml"))
    assert load_config(str(project / "recipes" / "sibling.yaml"), config_roots=[pathlib.Path(TINY).parent])
    with pytest.raises(ConfigError, match=r"sys.exit\('ran'\)"):  # trusted: it runs (and exiting is an error)
        load_config(str(project / "recipes" / "ok.yaml"), config_roots=[outside])


# ---------------------------------------------------------------------------------------------------------------------
# Overrides.


@pytest.mark.parametrize(
    "override, section, name, expected",
    [
        ("model.d_model=64", "model", "d_model", 64),
        ("train.lr=1e-3", "train", "lr", 1e-3),
        ("model.tie_embeddings=true", "model", "tie_embeddings", True),
        ("model.tie_embeddings=False", "model", "tie_embeddings", False),
        ("model.family=gpt2", "model", "family", "gpt2"),
        ("config.train.steps=3", "train", "steps", 3),
        ("config.model.rope_theta=500000", "model", "rope_theta", 500000.0),
        ("data.path=corpus/a b.txt", "data", "path", "corpus/a b.txt"),
    ],
)
def test_override_applies_with_declared_type(override, section, name, expected):
    value = getattr(getattr(load_config(TINY, [override]), section), name)
    assert value == expected
    assert type(value) is type(expected)  # 3 stays int, "1e-3" becomes float, "true" becomes bool


def test_overrides_without_file_start_from_defaults():
    cfg = load_config(None, ["model.n_layers=5"])
    assert cfg.model.n_layers == 5 and cfg.model.d_model == ModelConfig().d_model


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: unknown names and wrong types.


def test_unknown_key_suggests_the_close_one():
    msg = _raises("model.d_modle", config_from_dict, _tiny(model={"d_modle": 64}))
    assert "did you mean 'model.d_model'" in msg


def test_unknown_key_in_override_suggests_the_close_one():
    msg = _raises("model.d_modle", load_config, TINY, ["model.d_modle=64"])
    assert "did you mean 'model.d_model'" in msg


def test_unknown_section():
    msg = _raises("modle", config_from_dict, {"modle": {"d_model": 64}})
    assert "did you mean 'model'" in msg
    _raises("optim", load_config, TINY, ["optim.lr=1e-3"])


@pytest.mark.parametrize(
    "section, name, value",
    [
        ("model", "d_model", "64"),  # str for int
        ("model", "d_model", 64.0),  # float for int
        ("model", "tie_embeddings", 1),  # int for bool
        ("model", "n_layers", True),  # bool for int (bool is an int subclass in Python)
        ("train", "lr", "1e-3"),  # str for float (what YAML 1.1 makes of `lr: 1e-3`)
        ("model", "family", 2),  # int for str
    ],
)
def test_wrong_type(section, name, value):
    msg = _raises(f"{section}.{name}", config_from_dict, _tiny(**{section: {name: value}}))
    assert "must be" in msg


@pytest.mark.parametrize("override", ["model.d_model=abc", "model.d_model=64.5", "model.tie_embeddings=maybe",
                                      "train.lr=fast"])
def test_unparsable_override(override):
    _raises(override.split("=")[0], load_config, TINY, [override])


def test_override_without_equals():
    with pytest.raises(ConfigError, match="Fix:"):
        load_config(TINY, ["model.d_model"])


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: ranges and choices.


@pytest.mark.parametrize(
    "section, name, value",
    [
        *[("model", n, v) for n in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len") for v in (0, -1)],
        ("model", "n_kv_heads", -1),  # 0 means "derived", so only negatives are refused
        ("model", "head_dim", -1),
        ("model", "d_ff", -1),
        ("model", "rope_theta", 0.0),
        *[("train", n, v) for n in ("batch_size", "seq_len", "steps", "grad_accum", "log_every") for v in (0, -1)],
        ("train", "lr", 0.0),
        ("train", "lr", -1e-3),
        ("train", "warmup_steps", -1),
        ("train", "b2", 1.5),
        ("parallel", "tensor", 0),
        ("parallel", "data", 0),  # -1 fills, 0 is not a degree
        ("parallel", "data", -2),
        ("checkpoint", "keep", 0),
        ("checkpoint", "every", -1),
    ],
)
def test_out_of_range(section, name, value):
    _raises(f"{section}.{name}", config_from_dict, _tiny(**{section: {name: value}}))


@pytest.mark.parametrize(
    "section, name, value, hint",
    [
        ("model", "family", "gpt3", "'gpt2'"),
        ("model", "dtype", "bf16", None),
        ("model", "dtype", "bfloat", "'bfloat16'"),
        ("model", "param_dtype", "float64", None),
        ("parallel", "remat", "sometimes", None),
        ("data", "source", "web", None),
    ],
)
def test_bad_choice(section, name, value, hint):
    msg = _raises(f"{section}.{name}", config_from_dict, _tiny(**{section: {name: value}}))
    assert "must be one of" in msg
    if hint:
        assert f"did you mean {hint}" in msg


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: divisibility and cross-section rules.


def test_n_heads_not_divisible_by_tensor():
    # 7 heads of 10 (d_model 70) cannot split over 2 tensor shards.
    _raises("model.n_heads", config_from_dict, _tiny(model={"d_model": 70, "n_heads": 7, "n_kv_heads": 7}))


def test_n_kv_heads_not_divisible_by_tensor():
    # 6 query heads split 3 + 3, but 3 kv heads cannot.
    _raises("model.n_kv_heads", config_from_dict, _tiny(model={"d_model": 48, "n_heads": 6, "n_kv_heads": 3}))


def test_n_kv_heads_must_divide_n_heads():
    msg = _raises("model.n_kv_heads", config_from_dict,
                  _tiny(model={"d_model": 70, "n_heads": 7, "n_kv_heads": 3}, parallel={"tensor": 1}))
    assert "[1, 7]" in msg  # the fix lists the valid choices


def test_d_model_not_divisible_by_n_heads_when_head_dim_derived():
    _raises("model.n_heads", config_from_dict, _tiny(model={"d_model": 128, "n_heads": 7, "n_kv_heads": 7},
                                                     parallel={"tensor": 1}))
    # An explicit head_dim lifts the rule.
    cfg = config_from_dict(_tiny(model={"d_model": 128, "n_heads": 7, "n_kv_heads": 7, "head_dim": 18},
                                 parallel={"tensor": 1}))
    assert cfg.model.head_dim == 18


def test_odd_head_dim_refused_for_rope():
    # RoPE rotates pairs of dims, so a llama head of 7 dims is refused.
    _raises("model.head_dim", config_from_dict, _tiny(model={"head_dim": 7}))
    gpt2 = config_from_dict(_tiny(model={"family": "gpt2", "head_dim": 7}))  # learned positions: no pairing
    assert gpt2.model.head_dim == 7


def test_d_ff_not_divisible_by_tensor():
    _raises("model.d_ff", config_from_dict, _tiny(model={"d_ff": 353}))


def test_vocab_not_divisible_by_tensor_is_padded_not_refused():
    # Like Megatron's make-vocab-size-divisible-by: jaxpar.plan.make_plan pads the embedding instead.
    assert config_from_dict(_tiny(model={"vocab_size": 257})).model.vocab_size == 257


def test_sequence_parallel_needs_seq_len_divisible_by_tensor():
    _raises("train.seq_len", config_from_dict, _tiny(parallel={"sequence_parallel": True}, train={"seq_len": 127}))
    assert config_from_dict(_tiny(parallel={"sequence_parallel": True})).parallel.sequence_parallel


def test_vocab_too_small_for_bytes():
    _raises("model.vocab_size", config_from_dict, _tiny(model={"vocab_size": 254}))


def test_seq_len_above_max_seq_len():
    _raises("train.seq_len", config_from_dict, _tiny(model={"max_seq_len": 127}, train={"seq_len": 128}))


def test_text_source_needs_path():
    _raises("data.path", config_from_dict, _tiny(data={"source": "text"}))
    _raises("data.path", config_from_dict, _tiny(data={"source": "tokens"}))
    assert config_from_dict(_tiny(data={"source": "text", "path": "corpus.txt"})).data.path == "corpus.txt"


def test_zero_stage_must_be_0_1_or_3():
    _raises("parallel.zero", config_from_dict, _tiny(parallel={"zero": 2}))
    assert config_from_dict(_tiny(parallel={"zero": 3})).parallel.zero == 3


@pytest.mark.parametrize("name, value", [("repeats", 2), ("microbatches", 4)])
def test_pipeline_counts_without_a_pipeline_are_refused(name, value):
    msg = _raises(f"parallel.{name}", config_from_dict, _tiny(parallel={"pipe": 1, name: value}))
    assert "parallel.pipe > 1" in msg


def test_n_layers_not_divisible_by_pipe_times_repeats():
    _raises("model.n_layers", Config, model=ModelConfig(n_layers=5), parallel=ParallelConfig(pipe=2, microbatches=2))


# ---------------------------------------------------------------------------------------------------------------------
# Refusals that need the device count.


def test_mesh_product_must_match_devices():
    cfg = config_from_dict(_tiny(parallel={"data": 3, "tensor": 2}, train={"batch_size": 33}))
    msg = _raises("parallel.data", cfg.resolve_for_devices, 8)
    assert "3*1*1*1*2 = 6" in msg  # data*pipe*expert*context*tensor
    assert cfg.resolve_for_devices(6).mesh_shape == (3, 1, 1, 1, 2)


def test_tensor_must_divide_devices():
    cfg = config_from_dict(_tiny(model={"d_model": 126, "n_heads": 3, "n_kv_heads": 3, "vocab_size": 258,
                                        "d_ff": 336},
                                 parallel={"tensor": 3}))
    _raises("parallel.tensor", cfg.resolve_for_devices, 8)


def test_data_fill():
    cfg = config_from_dict(_tiny())
    assert cfg.parallel.data == -1
    assert cfg.resolve_for_devices(8).mesh_shape == (4, 1, 1, 1, 2)
    assert cfg.resolve_for_devices(2).mesh_shape == (1, 1, 1, 1, 2)


@pytest.mark.parametrize(
    "train, parallel",
    [
        ({"batch_size": 31}, {}),  # 31 over data = 8 / 2 = 4 shards
        ({"batch_size": 32, "grad_accum": 3}, {}),  # 32 over data * grad_accum = 4 * 3 = 12 chunks
        ({"batch_size": 36, "grad_accum": 2}, {"data": 4}),  # 36 over 4 * 2 = 8 (36 = 4 * 3 * 3 needs accum 1 or 3)
    ],
)
def test_batch_not_divisible_by_data_times_accum(train, parallel):
    cfg = config_from_dict(_tiny(train=train, parallel=parallel))
    _raises("train.batch_size", cfg.resolve_for_devices, 8)


def test_batch_divisible_by_data_times_accum():
    cfg = config_from_dict(_tiny(train={"batch_size": 36, "grad_accum": 3}, parallel={"data": 4}))
    assert cfg.resolve_for_devices(8).mesh_shape == (4, 1, 1, 1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals from files.


def test_missing_config_file(tmp_path):
    _raises("--config", load_config, str(tmp_path / "nope.py"))


def test_missing_base(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: nope.py\n")
    _raises("--config", load_config, str(recipe))


def test_malformed_yaml_is_one_line_naming_where(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  d_model: [64\n")
    msg = _raises("--config", load_config, str(recipe))  # one line (the CLI prints it as is)
    assert "YAML" in msg and "line " in msg  # where the error is still belongs in the line


def test_recipe_with_empty_section_keeps_base(tmp_path):
    # `model:` whose keys are all commented out is YAML null; it must not wipe the base's model section.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\nmodel:\n  # family: gpt2\n")
    assert load_config(str(recipe), config_roots=[pathlib.Path(TINY).parent]).model.n_kv_heads == 2


def test_override_into_empty_section(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n")
    assert load_config(str(recipe), ["model.d_model=64"]).model.d_model == 64


def test_circular_base(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    _raises("base", load_config, str(tmp_path / "a.yaml"))


def test_yaml_of_wrong_shape(tmp_path):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- 1\n- 2\n")
    _raises("--config", load_config, str(recipe))
    recipe.write_text("model: 3\n")
    _raises("model", load_config, str(recipe))


def test_unknown_file_type(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("")
    _raises("--config", load_config, str(path))


def test_py_config_without_get_config(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("x = 1\n")
    _raises("--config", load_config, str(path))


# ---------------------------------------------------------------------------------------------------------------------
# The dataclasses themselves.


def test_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.d_model = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train
    for section in SECTIONS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, section), dataclasses.fields(getattr(cfg, section))[0].name, None)


def test_derived_sizes_are_concrete():
    m = config_from_dict({"model": {"d_model": 96, "n_heads": 3}, "train": {"seq_len": 64}}).model
    assert (m.n_kv_heads, m.head_dim, m.d_ff) == (3, 32, 256)  # n_heads, 96/3, 32*ceil(8*96/3/32)
    g = config_from_dict({"model": {"family": "gpt2", "d_model": 96, "n_heads": 3}}).model
    assert g.d_ff == 4 * 96


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_field_has_help(section):
    """The README's config reference is generated from these strings."""
    for f in dataclasses.fields(SECTIONS[section]):
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f"{section}.{f.name}"


# ---------------------------------------------------------------------------------------------------------------------
# The command line: a bad config is one line on stderr and exit status 2, never a traceback.



@pytest.mark.parametrize(
    "flag, field",
    [("--config.model.n_heads=3", "model.n_heads"), ("--config.model.d_modle=64", "model.d_modle")],
)
def test_cli_bad_config_is_one_line(tmp_path, flag, field):
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.py", flag,
           "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert field in lines[0] and "Traceback" not in proc.stderr


def test_yaml_reads_exponent_floats_and_python_config_errors_are_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 1e-3\n")
    assert load_config(str(recipe)).train.lr == 1e-3
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    return 1 / 0\n")
    msg = _raises("--config", load_config, str(broken))
    assert "ZeroDivisionError" in msg


def test_non_finite_float_is_refused():
    _raises("train.lr", load_config, None, ["train.lr=inf"])


# ---------------------------------------------------------------------------------------------------------------------
# Issue 35: what a YAML recipe may expand to, long values in messages, the context-parallel wording, int4's default
# group, and schedule tables checked without `assert`.


def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines + [f"model: {{d_model: *a{levels - 1}}}"]) + "\n"


@pytest.mark.parametrize("body, needle", [
    (_bomb(9), "alias bomb"),  # a MemoryError traceback before
    (_bomb(7), "alias bomb"),  # a 39 MB one-line error before
    ("model: {d_model: &x [1, *x]}\n", "expand forever"),
    ("model: {d_model: " + "[" * 3000 + "]" * 3000 + "}\n", "too deeply"),
    ("model: {d_model: [&a0 [x, x, x, x, x, x, x, x, x], " + ", ".join(  # 7k values: under the bound, quoted cut
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 4)) + "]}\n", "model.d_model = [['x'"),
    ("model: {d_model: [" + ", ".join(["12345"] * 20000) + "]}\n", "model.d_model = [12345"),
    ("model: {d_model: '" + "y" * 100000 + "'}\n", "model.d_model = 'yyy"),
], ids=["bomb9", "bomb7", "recursive", "deep", "bomb4", "long-list", "long-string"])
def test_yaml_expansion_is_bounded_and_messages_stay_short(tmp_path, body, needle):
    path = tmp_path / "recipe.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert needle in str(err.value) and len(str(err.value)) < 400, str(err.value)[:500]


def test_a_recipe_may_reuse_values_by_alias(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {d_model: &w 64, n_heads: 4}\nmoe: {}\ntrain: {seq_len: *w, batch_size: 8}\n")
    config = load_config(str(path))
    assert config.model.d_model == config.train.seq_len == 64


def test_context_parallel_message_reads_as_arithmetic():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.py", ["parallel.context=128", "parallel.pipe=1", "parallel.repeats=1",
                                        "parallel.microbatches=1", "train.seq_len=200"])
    assert "divisible by 2 × parallel.context = 2 × 128 = 256:" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.py", ["parallel.context=2", "parallel.sequence_parallel=true", "train.seq_len=12"])
    assert "2 × parallel.context × parallel.tensor = 2 × 2 × 2 = 8 (sequence parallel" in str(err.value)


def test_int4_default_group_fits_the_demo_model():
    """`convert --quantize int4` / `load(quantize='int4')` without a group size on configs/tiny.py (d_ff 352, which
    128 does not divide): the largest group up to 128 that divides every quantized width (32), and at load the
    largest that a tensor split also leaves whole (tensor 2 splits w_down's 352 inputs into 176: 16); an explicit
    group that does not divide is still refused. The quantized model runs and stays near the float one."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.infer.text import _quantized
    from jaxpar.model import Transformer, abstract_model, quantize_state
    from jaxpar.store.checkpoint import quantize_config

    model = load_config("configs/tiny.py").model
    assert model.int4_groups()[:3] == [32, 16, 8]
    q = quantize_config(model, "int4", None)
    assert q.weight_group == 32 and q.weights_label == "int4 in groups of 32"
    assert [_quantized(model, "int4", None, t).weight_group for t in (1, 2, 4)] == [32, 16, 8]
    with pytest.raises(ConfigError, match="model.weight_group = 128.*use model.weight_group 32"):
        quantize_config(model, "int4", 128)
    float_model = Transformer(model, rngs=nnx.Rngs(0))
    graphdef, _ = abstract_model(q)
    quantized = nnx.merge(graphdef, quantize_state(nnx.state(float_model, nnx.Param), q))
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    want, got = float_model(tokens), quantized(tokens)
    assert got.shape == want.shape and bool(jnp.isfinite(got).all())
    # 4 bits of a random init (no outliers to spare) in groups of 32: ~15 % relative RMS on the logits
    assert float(jnp.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())) < 0.3


def test_a_schedule_table_that_breaks_the_rules_is_a_config_error():
    """`schedule.validate` sees tables built by hand: it raises, it does not `assert` (gone under `python -O`)."""
    from jaxpar.parallel import schedule

    table = schedule.build("1f1b", 2, 1, 4)
    schedule.validate(table)
    with pytest.raises(ConfigError, match="misses"):
        schedule.validate(dataclasses.replace(table, ticks=table.ticks[:-1]))
    with pytest.raises(ConfigError, match="runs twice"):
        schedule.validate(dataclasses.replace(table, ticks=table.ticks + table.ticks[-1:]))
    swapped = tuple(row[::-1] for row in table.ticks)
    with pytest.raises(ConfigError, match="stage"):
        schedule.validate(dataclasses.replace(table, ticks=swapped))
