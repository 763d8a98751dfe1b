"""Every command × bad input: exit status 2, one line on stderr naming the input, no traceback — and the same input
through the Python API raises a typed `JaxparError` (ConfigError, HFError, CheckpointError, …), never a bare
KeyError / ZeroDivisionError / AttributeError.

The table runs the CLI in-process (`jaxpar.cli.main`, stderr captured): that is the same code a shell runs, minus
interpreter start-up, so the ~70 rows cost seconds rather than minutes. A few rows also run as real processes
(`test_real_process_*`) to cover what only a real process shows (argv bytes that are not UTF-8, Python's own
traceback printing).

To add a command, flag or config field: add its rows here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
from typing import Callable

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config
from jaxpar.errors import JaxparError
from jaxpar.store import checkpoint
from jaxpar.store.lock import WorkdirLock
from jaxpar.train import fit

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
ONE = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.repeats=1", "parallel.microbatches=1",
       "model.d_model=40", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "train.batch_size=8",
       "train.seq_len=24", "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=1",
       "data.source=synthetic"]


class Paths:
    """Inputs built once for the whole table (module fixture `ctx`)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.workdir = root / "trained"  # a real 2-step run at ONE
        fit(load_config("configs/tiny.py", ONE + ["train.steps=2"]), self.workdir, devices=jax.devices()[:1],
            progress=False)
        self.export = root / "export"  # its params-only export
        assert main(["convert", "--from", str(self.workdir), "--to", str(self.export)]) == 0
        self.int8 = root / "int8"  # its export with int8 weights
        assert main(["convert", "--from", str(self.workdir), "--to", str(self.int8), "--quantize", "int8"]) == 0
        self.broken = root / "broken"  # the same run, its config.json cut short by hand
        shutil.copytree(self.workdir, self.broken)
        (self.broken / "config.json").write_text('{"model": {"d_model": ')
        self.gutted = root / "gutted"  # the same run, its only step missing the params item
        shutil.copytree(self.workdir, self.gutted)
        shutil.rmtree(self.gutted / "checkpoints" / "2" / "params")
        self.fifo = root / "fifo"  # a workdir whose .lock is a named pipe
        self.fifo.mkdir()
        os.mkfifo(self.fifo / ".lock")
        self.file = root / "a_file"
        self.file.write_text("not a directory\n")
        self.empty = root / "empty"
        self.empty.mkdir()
        self.full = root / "full"
        self.full.mkdir()
        (self.full / "keep.txt").write_text("precious\n")
        self.configs = root / "configs"
        self.configs.mkdir()
        for name, body in {
            "exits.py": "import sys\ndef get_config():\n    sys.exit(0)\n",
            "none.py": "def get_config():\n    return None\n",
            "raises.py": "def get_config():\n    raise RuntimeError('boom')\n",
            "no_get_config.py": "x = 1\n",
            "bad.yaml": "model: {d_model: [1, 2\n",
            "list.yaml": "- 1\n- 2\n",
            "outside.yaml": f"base: {ROOT / 'configs' / 'tiny.py'}\n",
            "dir_base.yaml": "base: .\n",
            # nine levels of nine aliases each: 9^9 values once expanded (a billion laughs)
            "bomb.yaml": "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
                f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)) + "model: {d_model: *a8}\n",
            "recursive.yaml": "model: {d_model: &x [1, *x]}\n",
            "long.yaml": "model: {d_model: [" + ", ".join(["12345"] * 20000) + "]}\n",
            **{f"{name}.json": json.dumps({**dataclasses.asdict(__import__(  # machine profiles, one field wrong each
                "jaxpar.planner.profile", fromlist=["profile"]).profile_for("h100")), **edit}) for name, edit in {
                    "negative_link": {"intra_host": -1.0}, "overlap_5": {"overlap": 5},
                    "nan_cost": {"pipeline_byte": float("nan")}, "negative_memory": {"memory_gb": -3}}.items()},
        }.items():
            (self.configs / name).write_text(body)
        self.chat = root / "chat"  # chat data for SFT, each file wrong in one way (twice over: a split needs two)
        self.chat.mkdir()
        talk = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."}]
        for name, row in {"messages": {"messages": talk}, "no_assistant": {"messages": talk[:1]},
                          "long": {"prompt": "x" * 40, "completion": "y"}, "no_pairs": {"text": "x"},
                          "half_pair": {"prompt": "2+2=", "chosen": "4"},  # preference pairs for DPO
                          "mixed_pair": {"prompt": "2+2=", "chosen": talk[1:], "rejected": "5"}}.items():
            (self.chat / f"{name}.jsonl").write_text((json.dumps(row) + "\n") * 2)
        self.hf = {kind: self._bad_hf(kind) for kind in HF_DAMAGE}
        from jaxpar.planner import profile as machine  # a probed profile, as another machine would have written it

        here = machine.machine()
        other = dataclasses.replace(machine.profile_for("h100"), machine={**here, "cpu": "Another CPU 9000"})
        machine.write(other, self.configs / "other.json")

    def _bad_hf(self, kind: str) -> pathlib.Path:
        dst = self.root / f"hf_{kind}"
        source = "qwen2" if kind == "i32_tensor" else ("deepseek_v3" if kind.startswith("deepseek") else "llama")
        shutil.copytree(FIXTURES / source, dst)
        HF_DAMAGE[kind](dst)
        return dst


def _edit_config(edit: Callable[[dict], object]) -> Callable[[pathlib.Path], None]:
    def apply(d: pathlib.Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        out = edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg if out is None else out))
    return apply


def _i32_header(d: pathlib.Path) -> None:
    """One tensor's header dtype F32 → I32 (same byte size): the bytes decode, as garbage integers."""
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__" and header[k]["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))  # keep the header's length so the data offsets stay valid
    assert len(new) == n
    f.write_bytes(raw[:8] + new + raw[8 + n:])


def _outside_index(d: pathlib.Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    shutil.copy(d / index["weight_map"][first], d.parent / "outside.safetensors")
    index["weight_map"][first] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _only_pickles(d: pathlib.Path) -> None:
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _rope_without_low(cfg: dict) -> None:
    del cfg["rope_parameters"]["low_freq_factor"]


HF_DAMAGE: dict[str, Callable[[pathlib.Path], None]] = {
    "i32_tensor": _i32_header,
    "config_list": _edit_config(lambda cfg: [cfg]),
    "zero_heads": _edit_config(lambda cfg: cfg.update(num_attention_heads=0)),
    "string_heads": _edit_config(lambda cfg: cfg.update(num_attention_heads="four")),
    "rope_no_low": _edit_config(_rope_without_low),
    "outside_index": _outside_index,
    "only_pickles": _only_pickles,
    "no_config": lambda d: (d / "config.json").unlink(),
    # issue 35: directories a conversion must not write into (`intact`: a genuine model directory; `user_config`: a
    # user's own config.json; `unsaved_run`: a run killed before its first save), files linked out of the model
    # directory, sizes no tensor has, and `mismatched`: a jaxpar workdir whose config.json its checkpoints do not fit
    "intact": lambda d: None,
    "user_config": lambda d: [shutil.rmtree(d), d.mkdir(), (d / "config.json").write_text('{"my": 1}\n')],
    "unsaved_run": lambda d: [shutil.rmtree(d), shutil.copytree(d.parent / "trained", d),
                              shutil.rmtree(d / "checkpoints")],
    "tokenizer_outside": lambda d: [(d.parent / "secret.txt").write_text("not the model's\n"),
                                    (d / "tokenizer.json").unlink(),
                                    (d / "tokenizer.json").symlink_to(d.parent / "secret.txt")],
    "config_outside": lambda d: [shutil.move(d / "config.json", d.parent / "elsewhere.json"),
                                 (d / "config.json").symlink_to(d.parent / "elsewhere.json")],
    "generation_outside": lambda d: [shutil.move(d / "generation_config.json", d.parent / "generation.json"),
                                     (d / "generation_config.json").symlink_to(d.parent / "generation.json")],
    "vocab_huge": _edit_config(lambda cfg: cfg.update(vocab_size=10**12)),
    "hidden_huge": _edit_config(lambda cfg: cfg.update(hidden_size=2**40)),
    # issue 38: DeepSeek-V3 checkpoints with what jaxpar does not implement (fp8 blocks, V3.2's indexer)
    "deepseek_fp8": _edit_config(lambda cfg: cfg.update(quantization_config={"quant_method": "fp8"})),
    "deepseek_indexer": _edit_config(lambda cfg: cfg.update(index_topk=2048, index_n_heads=64, index_head_dim=128)),
    "mismatched": lambda d: [shutil.rmtree(d), shutil.copytree(d.parent / "trained", d), (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"d_model": 40', '"d_model": 32'))],
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> Paths:
    return Paths(tmp_path_factory.mktemp("hostile"))


@dataclasses.dataclass(frozen=True)
class Case:
    """argv (with {workdir}, {export}, {int8}, {file}, {empty}, {full}, {configs}, {hf_KIND}, {tmp} filled in), the text the
    one stderr line must contain, and the API call that must raise a typed JaxparError (None: CLI-only input)."""

    id: str
    argv: str
    needle: str
    api: Callable[[Paths, pathlib.Path], object] | None = None


def _train_api(*overrides, workdir=None):
    def call(c: Paths, tmp: pathlib.Path):
        return fit(load_config("configs/tiny.py", ONE + list(overrides)), workdir(c) if workdir else tmp / "w",
                   devices=jax.devices()[:1], progress=False)
    return call


def _gen_api(path, **kwargs):
    def call(c: Paths, tmp: pathlib.Path):
        from jaxpar.infer.text import generate_text, load

        step = kwargs.pop("step", None)
        layout = {k: kwargs.pop(k) for k in ("explicit", "sequence_parallel", "overlap", "quantize", "group_size")
                  if k in kwargs}
        loaded = load(path(c), step=step, data=kwargs.pop("data", 1), tensor=kwargs.pop("tensor", None), **layout)
        return generate_text(loaded, kwargs.pop("prompts", ["def "]), max_new_tokens=kwargs.pop("n", 4), **kwargs)
    return call


def _serve_api(path, **kwargs):
    def call(c: Paths, tmp: pathlib.Path):
        from jaxpar.serve.server import serve

        return serve(str(path(c)), port=8765, **kwargs)
    return call


def _hf_import(kind):
    def call(c: Paths, tmp: pathlib.Path):
        from jaxpar.interop import hf

        return hf.import_to_workdir(c.hf[kind], tmp / "imported")
    return call


def _config_row(name: str, preset: str, overrides: list[str], field: str) -> Case:
    """A `train` row whose bad input is config overrides on a preset: `--config.KEY=VALUE` flags on the command
    line, and the same overrides through `load_config`."""
    flags = " ".join(f"--config.{o}" for o in overrides)
    return Case(f"train-{name}", f"train --no-progress --config configs/{preset} --workdir {{tmp}}/w {flags}", field,
                lambda c, t: load_config(f"configs/{preset}", list(overrides)))


TRAIN = "train --no-progress --config configs/tiny.py --workdir {tmp}/w "
MOE = "train --no-progress --config configs/moe_tiny.py --workdir {tmp}/w "
SMALL = " ".join(f"--config.{o}" for o in ONE + ["parallel.data=-1"])  # the same run on all 8 devices
DEEPSEEK = ["family=deepseek", "n_kv_heads=0", "kv_lora_rank=16", "qk_rope_head_dim=8", "qk_nope_head_dim=24",
            "v_head_dim=16"]  # tiny.py as a deepseek model (model.* overrides)
CASES = [
    # train: the config
    Case("train-unknown-key", TRAIN + "--config.model.d_modle=64", "model.d_modle",
         lambda c, t: load_config("configs/tiny.py", ["model.d_modle=64"])),
    Case("train-bad-int", TRAIN + "--config.train.steps=abc", "train.steps",
         lambda c, t: load_config("configs/tiny.py", ["train.steps=abc"])),
    Case("train-float-for-int", TRAIN + "--config.train.steps=2.5", "train.steps"),
    Case("train-nan-float", TRAIN + "--config.train.lr=nan", "train.lr",
         lambda c, t: load_config("configs/tiny.py", ["train.lr=nan"])),
    Case("train-negative-steps", TRAIN + "--config.train.steps=-3", "train.steps"),
    Case("train-heads-vs-tensor", TRAIN + "--config.parallel.tensor=3", "parallel.tensor",
         lambda c, t: load_config("configs/tiny.py", ["parallel.tensor=3"])),
    Case("train-layers-vs-stages", TRAIN + "--config.parallel.repeats=3", "model.n_layers"),
    Case("train-mesh-product", TRAIN + "--config.parallel.data=3", "parallel.data",
         lambda c, t: load_config("configs/tiny.py", ["parallel.data=3"]).resolve_for_devices(8)),
    Case("train-expert-without-moe", TRAIN + "--config.parallel.expert=2", "parallel.expert",
         lambda c, t: load_config("configs/tiny.py", ["parallel.expert=2"])),
    Case("train-experts-vs-expert", MOE + "--config.moe.n_experts=6 --config.parallel.expert=4", "moe.n_experts",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.n_experts=6", "parallel.expert=4"])),
    Case("train-top-k-over-experts", MOE + "--config.moe.top_k=9", "moe.top_k",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.top_k=9"])),
    Case("train-moe-capacity-negative", MOE + "--config.moe.capacity_factor=-1", "moe.capacity_factor",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.capacity_factor=-1"])),
    Case("train-moe-load-ema-one", MOE + "--config.moe.load_ema=1", "moe.load_ema",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.load_ema=1"])),
    Case("train-moe-load-ema-negative", MOE + "--config.moe.load_ema=-0.5", "moe.load_ema",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.load_ema=-0.5"])),
    Case("train-moe-load-ema-text", MOE + "--config.moe.load_ema=fast", "moe.load_ema",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.load_ema=fast"])),
    Case("train-load-ema-dense", TRAIN + "--config.moe.load_ema=0.9", "moe.load_ema",
         lambda c, t: load_config("configs/tiny.py", ["moe.load_ema=0.9"])),
    # DeepSeek's routing (moe.scoring, n_group, topk_group, routed_scale, correction_bias, bias_update_rate, …)
    *[_config_row(*row) for row in [
        ("moe-scoring-unknown", "moe_tiny.py", ["moe.scoring=tanh"], "moe.scoring"),
        ("moe-n-group-not-dividing", "moe_tiny.py", ["moe.n_group=3"], "moe.n_group"),
        ("moe-n-group-zero", "moe_tiny.py", ["moe.n_group=0"], "moe.n_group"),
        ("moe-topk-group-over-groups", "moe_tiny.py", ["moe.n_group=4", "moe.topk_group=5"], "moe.topk_group"),
        ("moe-sigmoid-one-expert-groups", "moe_tiny.py", ["moe.scoring=sigmoid", "moe.n_group=8"], "moe.n_group"),
        ("moe-top-k-over-group-experts", "moe_tiny.py", ["moe.n_group=4", "moe.top_k=3"], "moe.top_k"),
        ("moe-routed-scale-zero", "moe_tiny.py", ["moe.routed_scale=0"], "moe.routed_scale"),
        ("moe-correction-bias-text", "moe_tiny.py", ["moe.correction_bias=maybe"], "moe.correction_bias"),
        ("moe-bias-rate-without-bias", "moe_tiny.py", ["moe.bias_update_rate=0.001"], "moe.bias_update_rate"),
        ("moe-bias-rate-negative", "moe_tiny.py", ["moe.correction_bias=true", "moe.bias_update_rate=-0.001"],
         "moe.bias_update_rate"),
        ("moe-recenter-without-bias", "moe_tiny.py", ["moe.bias_recenter=true"], "moe.bias_recenter"),
        ("correction-bias-dense", "tiny.py", ["moe.correction_bias=true"], "moe.correction_bias"),
    ]],
    Case("train-moe-unknown-key", MOE + "--config.moe.num_experts=8", "moe.num_experts",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.num_experts=8"])),
    Case("train-moe-shared-gate-without-shared", MOE + "--config.moe.shared_gate=true", "moe.shared_gate",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.shared_gate=true"])),
    # multi-token prediction (model.mtp_depth, train.mtp_loss_weight)
    *[_config_row(*row) for row in [
        ("mtp-depth-negative", "moe_tiny.py", ["model.mtp_depth=-1"], "model.mtp_depth"),
        ("mtp-depth-text", "moe_tiny.py", ["model.mtp_depth=two"], "model.mtp_depth"),
        ("mtp-gpt2", "moe_tiny.py", ["moe.n_experts=0", "model.family=gpt2", "model.mtp_depth=1"], "model.mtp_depth"),
        ("deepseek-moe-layers-vs-stages", "deepseek_tiny.py", ["parallel.pipe=2", "parallel.microbatches=2"],
         "model.n_layers"),
        ("mtp-loss-weight-negative", "moe_tiny.py", ["train.mtp_loss_weight=-0.3"], "train.mtp_loss_weight"),
        # the q/k norm (model.qk_norm, Qwen3): a boolean, and GQA with RMSNorm only
        ("qk-norm-text", "tiny.py", ["model.qk_norm=maybe"], "model.qk_norm"),
        ("qk-norm-gpt2", "tiny.py", ["model.family=gpt2", "model.qk_norm=true"], "model.qk_norm"),
        ("qk-norm-deepseek", "deepseek_tiny.py", ["model.qk_norm=true"], "model.qk_norm"),
        # attention sinks (model.attention_sinks, gpt-oss): a boolean, llama's GQA only
        ("sinks-text", "tiny.py", ["model.attention_sinks=often"], "model.attention_sinks"),
        ("sinks-gpt2", "tiny.py", ["model.family=gpt2", "model.attention_sinks=true"], "model.attention_sinks"),
        # per-layer attention kinds (model.full_attention_every, model.local_rope_theta: Gemma 3, gpt-oss) and
        # Gemma's score scale (model.query_pre_attn_scalar); the gemma family (model.family=gemma)
        ("full-every-text", "tiny.py", ["model.full_attention_every=often"], "model.full_attention_every"),
        ("full-every-negative", "tiny.py", ["model.sliding_window=8", "model.full_attention_every=-2"],
         "model.full_attention_every"),
        ("full-every-without-window", "tiny.py", ["model.full_attention_every=2"], "model.full_attention_every"),
        ("full-every-vs-stages", "tiny.py", ["model.n_layers=6", "model.sliding_window=8",
                                             "model.full_attention_every=2", "parallel.pipe=2", "parallel.repeats=1",
                                             "parallel.microbatches=2"], "model.full_attention_every"),
        ("local-rope-without-window", "tiny.py", ["model.local_rope_theta=100"], "model.local_rope_theta"),
        ("local-rope-gpt2", "tiny.py", ["model.family=gpt2", "model.sliding_window=8", "model.local_rope_theta=100"],
         "model.local_rope_theta"),
        ("local-rope-negative", "tiny.py", ["model.sliding_window=8", "model.local_rope_theta=-1"],
         "model.local_rope_theta"),
        ("mtp-with-pattern", "deepseek_tiny.py", ["model.mtp_depth=1", "model.sliding_window=8",
                                                  "model.full_attention_every=2"], "model."),
        ("query-scalar-negative", "tiny.py", ["model.query_pre_attn_scalar=-4"], "model.query_pre_attn_scalar"),
        ("family-unknown", "tiny.py", ["model.family=gemma4"], "model.family"),
        ("gemma-sinks", "tiny.py", ["model.family=gemma", "model.attention_sinks=true"], "model.attention_sinks"),
        ("gemma-moe", "moe_tiny.py", ["model.family=gemma"], "moe.n_experts"),
        # gpt-oss's mechanisms: the o bias, YaRN's rounding, the router and expert biases, the clamped SwiGLU
        ("o-bias-text", "tiny.py", ["model.o_bias=sometimes"], "model.o_bias"),
        ("rope-truncate-text", "tiny.py", ["model.rope_truncate=maybe"], "model.rope_truncate"),
        ("yarn-factor-one-llama", "tiny.py", ["model.rope_scaling=yarn"], "model.rope_factor"),
        ("yarn-gpt2", "tiny.py", ["model.family=gpt2", "model.rope_scaling=yarn", "model.rope_factor=4"],
         "model.rope_scaling"),
        ("yarn-mscale-all-dim-gqa", "tiny.py", ["model.rope_scaling=yarn", "model.rope_factor=4",
                                                "model.rope_mscale_all_dim=1"], "model.rope_mscale_all_dim"),
        ("router-bias-dense", "tiny.py", ["moe.router_bias=true"], "moe.router_bias"),
        ("expert-bias-dense", "tiny.py", ["moe.expert_bias=true"], "moe.expert_bias"),
        ("expert-bias-text", "moe_tiny.py", ["moe.expert_bias=yes_please"], "moe.expert_bias"),
        ("swiglu-limit-negative", "moe_tiny.py", ["moe.swiglu_limit=-7"], "moe.swiglu_limit"),
        ("swiglu-limit-dense", "tiny.py", ["moe.swiglu_limit=7"], "moe.swiglu_limit"),
        ("swiglu-alpha-zero", "moe_tiny.py", ["moe.swiglu_limit=7", "moe.swiglu_alpha=0"], "moe.swiglu_alpha"),

    ]],
    Case("train-moe-gpt2", MOE + "--config.model.family=gpt2", "moe.n_experts",
         lambda c, t: load_config("configs/moe_tiny.py", ["model.family=gpt2"])),
    Case("train-moe-expert-width-vs-tensor", MOE + "--config.moe.d_ff=175", "moe.d_ff",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.d_ff=175"])),
    Case("train-moe-batch-vs-expert", MOE + "--config.train.batch_size=36", "data*expert*microbatches",
         lambda c, t: load_config("configs/moe_tiny.py", ["train.batch_size=36"]).resolve_for_devices(8)),
    Case("train-moe-context", MOE + "--config.parallel.context=2 --config.parallel.expert=1", "parallel.context",
         lambda c, t: load_config("configs/moe_tiny.py", ["parallel.context=2", "parallel.expert=1"])),
    Case("train-moe-sparse-step-zero", MOE + "--config.moe.sparse_step=0", "moe.sparse_step",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.sparse_step=0"])),
    Case("train-moe-dense-layer-missing", MOE + "--config.moe.dense_layers=1,7", "moe.dense_layers",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.dense_layers=1,7"])),
    Case("train-moe-dense-layers-not-ints", MOE + "--config.moe.dense_layers=a,b", "moe.dense_layers",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.dense_layers=a,b"])),
    Case("train-moe-no-moe-layer", MOE + "--config.moe.dense_layers=0,1,2,3", "moe.dense_layers",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.dense_layers=0,1,2,3"])),
    Case("train-dense-layers-without-moe", TRAIN + "--config.moe.dense_layers=0", "moe.dense_layers",
         lambda c, t: load_config("configs/tiny.py", ["moe.dense_layers=0"])),
    Case("train-moe-pattern-vs-pipeline", MOE + "--config.moe.dense_layers=0", "parallel.repeats",
         lambda c, t: load_config("configs/moe_tiny.py", ["moe.dense_layers=0"])),
    Case("train-overlap-unknown", TRAIN + "--config.parallel.overlap=async", "parallel.overlap",
         lambda c, t: load_config("configs/tiny.py", ["parallel.overlap=async"])),
    Case("train-overlap-without-sp", TRAIN + "--config.parallel.overlap=collective_matmul", "parallel.overlap",
         lambda c, t: load_config("configs/tiny.py", ["parallel.overlap=collective_matmul"])),
    Case("train-overlap-in-schedule-table", TRAIN + "--config.parallel.overlap=collective_matmul "
         "--config.parallel.sequence_parallel=true --config.parallel.schedule=1f1b", "parallel.overlap",
         lambda c, t: load_config("configs/tiny.py", ["parallel.overlap=collective_matmul",
                                                      "parallel.sequence_parallel=true", "parallel.schedule=1f1b"])),
    Case("train-skip-bubble-without-pipeline", TRAIN + "--config.parallel.pipe=1 --config.parallel.repeats=1 "
         "--config.parallel.microbatches=1 --config.parallel.skip_bubble=true", "parallel.skip_bubble",
         lambda c, t: load_config("configs/tiny.py", ["parallel.pipe=1", "parallel.repeats=1",
                                                      "parallel.microbatches=1", "parallel.skip_bubble=true"])),
    Case("train-skip-bubble-in-schedule-table", TRAIN + "--config.parallel.schedule=1f1b --config.parallel.repeats=1 "
         "--config.parallel.skip_bubble=true", "parallel.skip_bubble",
         lambda c, t: load_config("configs/tiny.py", ["parallel.schedule=1f1b", "parallel.repeats=1",
                                                      "parallel.skip_bubble=true"])),
    Case("train-skip-bubble-with-collective-matmul", TRAIN + "--config.parallel.overlap=collective_matmul "
         "--config.parallel.sequence_parallel=true --config.parallel.skip_bubble=true", "parallel.skip_bubble",
         lambda c, t: load_config("configs/tiny.py", ["parallel.overlap=collective_matmul",
                                                      "parallel.sequence_parallel=true", "parallel.skip_bubble=true"])),
    Case("train-context-vs-seq-len", TRAIN + "--config.parallel.context=3", "train.seq_len",
         lambda c, t: load_config("configs/tiny.py", ["parallel.context=3"])),
    Case("train-context-impl", TRAIN + "--config.parallel.context_impl=striped", "parallel.context_impl",
         lambda c, t: load_config("configs/tiny.py", ["parallel.context_impl=striped"])),
    Case("train-ring-in-a-schedule", TRAIN + "--config.parallel.context=2 --config.parallel.context_impl=ring "
         "--config.parallel.schedule=1f1b --config.parallel.repeats=1", "parallel.context_impl",
         lambda c, t: load_config("configs/tiny.py", ["parallel.context=2", "parallel.context_impl=ring",
                                                      "parallel.schedule=1f1b", "parallel.repeats=1"])),
    # multi-head latent attention and YaRN (model.* MLA fields belong to the deepseek family)
    *[Case(f"train-{name}", TRAIN + f"--config.model.{o}", f"model.{o.split('=')[0]}",
           lambda c, t, o=o: load_config("configs/tiny.py", [f"model.{o}"]))
      for name, o in [("mla-field-outside-deepseek", "kv_lora_rank=8"), ("q-lora-rank-negative", "q_lora_rank=-1"),
                      ("qk-nope-head-dim-text", "qk_nope_head_dim=wide"), ("v-head-dim-float", "v_head_dim=2.5"),
                      ("qk-rope-head-dim-llama", "qk_rope_head_dim=4"),
                      ("rope-interleave-llama", "rope_interleave=true"), ("rope-beta-slow-zero", "rope_beta_slow=0"),
                      ("rope-beta-fast-text", "rope_beta_fast=fast"), ("rope-mscale-negative", "rope_mscale=-1"),
                      ("rope-mscale-all-dim-nan", "rope_mscale_all_dim=nan")]],
    *[Case(f"train-deepseek-{name}", TRAIN + " ".join(f"--config.model.{o}" for o in DEEPSEEK + extra), needle,
           lambda c, t, extra=extra: load_config("configs/tiny.py", [f"model.{o}" for o in DEEPSEEK + extra]))
      for name, extra, needle in [
          ("no-latent", ["kv_lora_rank=0"], "model.kv_lora_rank"),
          ("odd-rope", ["qk_rope_head_dim=5"], "model.qk_rope_head_dim"),
          ("kv-heads", ["n_kv_heads=2"], "model.n_kv_heads"),
          ("head-dim", ["head_dim=36"], "model.head_dim"),
          ("yarn-factor-one", ["rope_scaling=yarn"], "model.rope_factor"),
          ("yarn-betas", ["rope_scaling=yarn", "rope_factor=4", "rope_beta_fast=0.5"], "model.rope_beta_fast")]],
    Case("train-scan-unroll-zero", TRAIN + "--config.model.scan_unroll=0", "model.scan_unroll",
         lambda c, t: load_config("configs/tiny.py", ["model.scan_unroll=0"])),
    Case("train-unknown-schedule", TRAIN + "--config.parallel.schedule=pipedream", "parallel.schedule",
         lambda c, t: load_config("configs/tiny.py", ["parallel.schedule=pipedream"])),
    Case("train-zbv-chunks", TRAIN + "--config.parallel.schedule=zbv --config.parallel.repeats=1", "parallel.repeats",
         lambda c, t: load_config("configs/tiny.py", ["parallel.schedule=zbv", "parallel.repeats=1"])),
    Case("train-schedule-without-pipe", TRAIN + "--config.parallel.pipe=1 --config.parallel.repeats=1 "
         "--config.parallel.microbatches=1 --config.parallel.schedule=1f1b", "parallel.schedule",
         lambda c, t: load_config("configs/tiny.py", ["parallel.pipe=1", "parallel.repeats=1",
                                                      "parallel.microbatches=1", "parallel.schedule=1f1b"])),
    Case("train-sp-without-tensor", TRAIN + "--config.parallel.tensor=1 --config.parallel.sequence_parallel=true",
         "parallel.sequence_parallel",
         lambda c, t: load_config("configs/tiny.py", ["parallel.tensor=1", "parallel.sequence_parallel=true"])),
    Case("train-permanent-never-saved", TRAIN + "--config.checkpoint.every=3 --config.checkpoint.permanent_every=4",
         "checkpoint.permanent_every",
         lambda c, t: load_config("configs/tiny.py", ["checkpoint.every=3", "checkpoint.permanent_every=4"])),
    Case("train-zero-without-data", TRAIN + "--config.parallel.data=1 --config.parallel.tensor=4 --config.parallel.zero=1",
         "parallel.zero", _train_api("parallel.zero=1")),
    Case("train-batch-vs-data", TRAIN + "--config.train.batch_size=30", "train.batch_size"),
    Case("train-unknown-choice", TRAIN + "--config.parallel.remat=sometimes", "parallel.remat"),
    Case("train-keep-without-auto", TRAIN + "--config.parallel.keep=tensor", "parallel.keep",
         lambda c, t: load_config("configs/tiny.py", ["parallel.keep=tensor"])),
    Case("train-keep-unknown-field", TRAIN + "--config.parallel.auto=true --config.parallel.keep=tensr",
         "did you mean 'tensor'", lambda c, t: load_config("configs/tiny.py", ["parallel.auto=true",
                                                                             "parallel.keep=tensr"])),
    Case("train-profile-without-auto", TRAIN + "--config.parallel.profile=p.json", "parallel.profile"),
    Case("train-auto-other-machine-profile", TRAIN + SMALL + " --config.parallel.auto=true "
         "--config.parallel.profile={configs}/other.json", "another machine",
         lambda c, t: _train_api("parallel.auto=true", f"parallel.profile={c.configs / 'other.json'}")(c, t)),
    Case("train-auto-missing-profile", TRAIN + "--config.parallel.auto=true --config.parallel.profile={tmp}/p.json",
         "parallel.profile"),
    Case("train-override-without-field", TRAIN + "--config.train=3", "train"),
    Case("train-unknown-section", TRAIN + "--config.optim.lr=3", "optim"),
    Case("train-negative-profile", TRAIN.replace("--config configs", "--profile-steps -1 --config configs"),
         "train.profile_steps"),
    Case("train-missing-config", "train --config nope.py --workdir {tmp}/w", "nope.py",
         lambda c, t: load_config("nope.py")),
    Case("train-config-is-dir", "train --config {empty} --workdir {tmp}/w", "not a file",
         lambda c, t: load_config(str(c.empty))),
    Case("train-config-exits", "train --config {configs}/exits.py --workdir {tmp}/w", "sys.exit(0)",
         lambda c, t: load_config(str(c.configs / "exits.py"))),
    Case("train-config-returns-none", "train --config {configs}/none.py --workdir {tmp}/w", "get_config() returned",
         lambda c, t: load_config(str(c.configs / "none.py"))),
    Case("train-config-raises", "train --config {configs}/raises.py --workdir {tmp}/w", "RuntimeError: boom",
         lambda c, t: load_config(str(c.configs / "raises.py"))),
    Case("train-config-no-get-config", "train --config {configs}/no_get_config.py --workdir {tmp}/w",
         "no get_config()", lambda c, t: load_config(str(c.configs / "no_get_config.py"))),
    Case("train-bad-yaml", "train --config {configs}/bad.yaml --workdir {tmp}/w", "not valid YAML",
         lambda c, t: load_config(str(c.configs / "bad.yaml"))),
    Case("train-yaml-list", "train --config {configs}/list.yaml --workdir {tmp}/w", "mapping of sections",
         lambda c, t: load_config(str(c.configs / "list.yaml"))),
    Case("train-yaml-base-outside-tree", "train --config {configs}/outside.yaml --workdir {tmp}/w",
         "outside the recipe's tree", lambda c, t: load_config(str(c.configs / "outside.yaml"))),
    Case("train-yaml-base-is-a-directory", "train --config {configs}/dir_base.yaml --workdir {tmp}/w", "is a directory",
         lambda c, t: load_config(str(c.configs / "dir_base.yaml"))),
    Case("train-yaml-alias-bomb", "train --config {configs}/bomb.yaml --workdir {tmp}/w", "alias bomb",
         lambda c, t: load_config(str(c.configs / "bomb.yaml"))),
    Case("train-yaml-recursive-alias", "train --config {configs}/recursive.yaml --workdir {tmp}/w", "expand forever",
         lambda c, t: load_config(str(c.configs / "recursive.yaml"))),
    Case("train-yaml-long-value", "train --config {configs}/long.yaml --workdir {tmp}/w", "model.d_model = [12345",
         lambda c, t: load_config(str(c.configs / "long.yaml"))),
    Case("train-override-empty-key", TRAIN + "--config.=3", "needs a key"),
    Case("train-seed-too-large", TRAIN + "--config.train.seed=4294967296", "train.seed",
         lambda c, t: load_config("configs/tiny.py", ["train.seed=4294967296"])),
    Case("train-data-path-missing", TRAIN + "--config.data.source=text --config.data.path={tmp}/nothing",
         "data.path"),
    Case("train-tokenizer-missing", TRAIN + "--config.data.tokenizer={tmp}/tok.json", "data.tokenizer"),
    # chat data (SFT): no template to render messages with, no assistant turn, a conversation longer than a row,
    # rows that are not conversations; each with the byte tokenizer, whose rows fit train.seq_len = 24 of ONE
    *[Case(f"train-chat-{name}", TRAIN + SMALL + f" --config.data.source=chat --config.data.path={{chat}}/{name}.jsonl",
           needle, lambda c, t, name=name: fit(load_config("configs/tiny.py", ONE + [
               "data.source=chat", f"data.path={c.chat / name}.jsonl"]), t / "w", devices=jax.devices()[:1],
               progress=False))
      for name, needle in [("messages", "has no chat template"), ("no_assistant", "line 1 has no assistant turn"),
                           ("long", "line 1 of data.path is 41 tokens"), ("no_pairs", "line 1 is neither")]],
    Case("train-chat-path-missing", TRAIN + "--config.data.source=chat --config.data.path={tmp}/none.jsonl",
         "data.path"),
    # LoRA: a target that is no adaptable matrix, a negative rank, a zero alpha; --to-peft
    # from a run without adapters, and with a flag it does not take
    Case("train-lora-target-unknown", TRAIN + "--config.lora.rank=4 --config.lora.targets=[q_proj]", "lora.targets",
         lambda c, t: load_config("configs/tiny.py", ["lora.rank=4", "lora.targets=[q_proj]"])),
    Case("train-lora-target-router", MOE + "--config.lora.rank=4 --config.lora.targets=[router]", "lora.targets",
         lambda c, t: load_config("configs/moe_tiny.py", ["lora.rank=4", "lora.targets=[router]"])),
    Case("train-lora-rank-negative", TRAIN + "--config.lora.rank=-2", "lora.rank",
         lambda c, t: load_config("configs/tiny.py", ["lora.rank=-2"])),
    Case("train-lora-alpha-zero", TRAIN + "--config.lora.rank=4 --config.lora.alpha=0", "lora.alpha",
         lambda c, t: load_config("configs/tiny.py", ["lora.rank=4", "lora.alpha=0"])),
    Case("train-lora-dropout-one", TRAIN + "--config.lora.rank=4 --config.lora.dropout=1.0", "lora.dropout",
         lambda c, t: load_config("configs/tiny.py", ["lora.rank=4", "lora.dropout=1.0"])),
    Case("train-lora-dropout-negative", TRAIN + "--config.lora.rank=4 --config.lora.dropout=-0.1", "lora.dropout",
         lambda c, t: load_config("configs/tiny.py", ["lora.rank=4", "lora.dropout=-0.1"])),
    Case("train-lora-dropout-without-adapters", TRAIN + "--config.lora.dropout=0.1", "lora.dropout",
         lambda c, t: load_config("configs/tiny.py", ["lora.dropout=0.1"])),
    Case("convert-peft-without-adapters", "convert --from {workdir} --to-peft {tmp}/peft", "lora.rank",
         lambda c, t: __import__("jaxpar.interop.peft", fromlist=["x"]).export_peft(c.workdir, t / "peft")),
    Case("convert-peft-with-quantize", "convert --from {workdir} --to-peft {tmp}/peft --quantize int8", "--to-peft"),
    Case("convert-peft-with-to", "convert --from {workdir} --to {tmp}/w2 --to-peft {tmp}/peft", "--to-peft"),
    Case("train-pack-text", TRAIN + "--config.data.pack=true", "data.pack",
         lambda c, t: load_config("configs/tiny.py", ["data.pack=true"])),
    Case("train-pack-not-bool", TRAIN + "--config.data.source=chat --config.data.path={chat}/messages.jsonl "
         "--config.data.pack=often", "data.pack"),
    Case("train-chat-with-mtp", TRAIN + "--config.data.source=chat --config.data.path={chat}/messages.jsonl "
         "--config.model.mtp_depth=1", "model.mtp_depth", lambda c, t: load_config("configs/tiny.py", [
             "data.source=chat", f"data.path={c.chat}/messages.jsonl", "model.mtp_depth=1"])),
    # FP8 (model.matmul): an unknown recipe, over integer weights
    *[Case(f"train-fp8-{name}", TRAIN + "--config.model.matmul=fp8_rowwise " + " ".join(f"--config.{o}" for o in extra),
           needle, lambda c, t, extra=extra: load_config("configs/tiny.py", ["model.matmul=fp8_rowwise", *extra]))
      for name, extra, needle in [
          ("int8", ["model.weights=int8", "lora.rank=4"], "model.matmul")]],
    Case("train-matmul-unknown", TRAIN + "--config.model.matmul=fp4", "model.matmul",
         lambda c, t: load_config("configs/tiny.py", ["model.matmul=fp4"])),
    # DPO: without pairs, pairs without DPO, a bad beta / loss / reference / objective, rows that are no pair
    Case("train-dpo-without-pairs", TRAIN + "--config.train.objective=dpo --config.data.source=chat "
         "--config.data.path={chat}/messages.jsonl", "train.objective", lambda c, t: load_config(
             "configs/tiny.py", ["train.objective=dpo", "data.source=chat", f"data.path={c.chat}/messages.jsonl"])),
    Case("train-pairs-without-dpo", TRAIN + "--config.data.source=pairs --config.data.path={chat}/half_pair.jsonl",
         "data.source", lambda c, t: load_config("configs/tiny.py", ["data.source=pairs",
                                                                     f"data.path={c.chat}/half_pair.jsonl"])),
    *[Case(f"train-dpo-{field}-{value}", TRAIN + f"--config.train.{field}={value}", f"train.{field}",
           lambda c, t, field=field, value=value: load_config("configs/tiny.py", [f"train.{field}={value}"]))
      for field, value in [("objective", "ppo"), ("dpo_beta", "0"), ("dpo_loss", "hinge"), ("dpo_reference", "sft")]],
    *[Case(f"train-dpo-{name}", TRAIN + SMALL + " --config.train.objective=dpo --config.data.source=pairs "
           f"--config.data.path={{chat}}/{name}.jsonl", needle, lambda c, t, name=name: fit(load_config(
               "configs/tiny.py", ONE + ["train.objective=dpo", "data.source=pairs",
                                         f"data.path={c.chat / name}.jsonl"]),
               t / "w", devices=jax.devices()[:1], progress=False))
      for name, needle in [("half_pair", "line 1 is not a preference pair"), ("mixed_pair", "must both be lists")]],
    # train: the workdir
    Case("train-workdir-is-file", "train --no-progress --config configs/tiny.py --workdir {file} " + SMALL,
         "not a directory", _train_api(workdir=lambda c: c.file)),
    Case("train-lock-is-a-fifo", "train --no-progress --config configs/tiny.py --workdir {fifo} " + SMALL,
         "not a regular file", _train_api(workdir=lambda c: c.fifo)),
    Case("train-resume-clipping-switched-off", "train --no-progress --config configs/tiny.py --workdir {workdir} "
         + SMALL + " --config.train.grad_clip=0", "train.grad_clip",
         _train_api("train.grad_clip=0", workdir=lambda c: c.workdir)),
    Case("train-workdir-locked", "train --no-progress --config configs/tiny.py --workdir {workdir} " + SMALL,
         "in use by pid", _train_api(workdir=lambda c: c.workdir)),  # the test holds the lock
    Case("train-resume-other-model", "train --no-progress --config configs/tiny.py --workdir {workdir} " + SMALL
         + " --config.model.d_model=48", "model.d_model", _train_api("model.d_model=48", workdir=lambda c: c.workdir)),
    Case("train-resume-other-seq-len", "train --no-progress --config configs/tiny.py --workdir {workdir} " + SMALL
         + " --config.train.seq_len=16", "train.seq_len", _train_api("train.seq_len=16", workdir=lambda c: c.workdir)),
    Case("train-params-only-workdir", "train --no-progress --config configs/tiny.py --workdir {export} " + SMALL
         + " --config.train.steps=3", "params-only export",
         _train_api("train.steps=3", workdir=lambda c: c.export)),
    Case("train-init-from-missing-hf", TRAIN + "--init-from-hf {tmp}/no_such_model", "no_such_model"),
    Case("train-init-from-hf-config-list", TRAIN + "--init-from-hf {hf_config_list}", "config.json"),
    Case("train-unknown-flag", TRAIN + "--bogus", "unrecognized arguments"),
    Case("train-no-config-flag", "train --workdir {tmp}/w", "--config"),
    # serve (the checks before the model loads; a running server's bad requests: tests/test_serve_http.py)
    Case("serve-missing-model", "serve --model {tmp}/nothing --port 8765", "does not exist",
         _serve_api(lambda c: c.root / "nothing")),
    Case("serve-port-out-of-range", "serve --model {workdir} --port 70000", "--port"),
    Case("serve-max-batch-zero", "serve --model {workdir} --max-batch 0", "max_batch",
         lambda c, t: __import__("jaxpar.serve.engine", fromlist=["EngineConfig"]).EngineConfig(max_batch=0)),
    Case("serve-page-size-negative", "serve --model {workdir} --page-size -4", "page_size"),
    Case("serve-tensor-vs-heads", "serve --model {workdir} --tensor 3", "parallel.tensor",
         _serve_api(lambda c: c.workdir, tensor=3)),
    Case("serve-config-override", "serve --model {workdir} --config.train.steps=3", "no config overrides"),
    # generate
    Case("generate-missing-workdir", "generate --workdir {tmp}/nothing --max-new-tokens 4", "does not exist",
         _gen_api(lambda c: c.root / "nothing")),
    Case("generate-not-a-workdir", "generate --workdir {empty} --max-new-tokens 4", "no config.json",
         _gen_api(lambda c: c.empty)),
    Case("generate-missing-step", "generate --workdir {workdir} --step 99 --max-new-tokens 4", "step 99",
         _gen_api(lambda c: c.workdir, step=99)),
    Case("generate-step-missing-an-item", "generate --workdir {gutted} --step 2 --max-new-tokens 4", "is damaged",
         _gen_api(lambda c: c.gutted, step=2)),
    Case("generate-seed-negative", "generate --workdir {workdir} --seed -1", "--seed"),
    Case("generate-no-samples", "generate --workdir {workdir} --num-samples 0", "--num-samples",
         _gen_api(lambda c: c.workdir, prompts=[])),
    Case("generate-no-new-tokens", "generate --workdir {workdir} --max-new-tokens 0", "--max-new-tokens",
         _gen_api(lambda c: c.workdir, n=0)),
    Case("generate-empty-prompt", "generate --workdir {workdir} --prompt= --max-new-tokens 4", "empty",
         _gen_api(lambda c: c.workdir, prompts=[""])),
    Case("generate-non-utf8-prompt", "generate --workdir {workdir} --max-new-tokens 4 --prompt=\udcffdef", "UTF-8",
         _gen_api(lambda c: c.workdir, prompts=["\udcffdef"])),
    Case("generate-negative-temperature", "generate --workdir {workdir} --max-new-tokens 4 --temperature -1",
         "temperature", _gen_api(lambda c: c.workdir, temperature=-1.0)),
    Case("generate-nan-temperature", "generate --workdir {workdir} --max-new-tokens 4 --temperature nan",
         "temperature", _gen_api(lambda c: c.workdir, temperature=float("nan"))),
    Case("generate-inf-temperature", "generate --workdir {workdir} --max-new-tokens 4 --temperature inf",
         "temperature", _gen_api(lambda c: c.workdir, temperature=float("inf"))),
    Case("generate-top-p-zero", "generate --workdir {workdir} --max-new-tokens 4 --top-p 0", "top_p",
         _gen_api(lambda c: c.workdir, top_p=0.0)),
    Case("generate-negative-top-k", "generate --workdir {workdir} --max-new-tokens 4 --top-k -1", "top_k",
         _gen_api(lambda c: c.workdir, top_k=-1)),
    Case("generate-tensor-vs-heads", "generate --workdir {workdir} --max-new-tokens 4 --tensor 3", "parallel.tensor",
         _gen_api(lambda c: c.workdir, tensor=3)),
    Case("generate-overlap-unknown", "generate --workdir {workdir} --max-new-tokens 4 --overlap async",
         "parallel.overlap", _gen_api(lambda c: c.workdir, overlap="async")),
    Case("generate-overlap-without-sp", "generate --workdir {workdir} --max-new-tokens 4 --overlap collective_matmul",
         "parallel.overlap", _gen_api(lambda c: c.workdir, overlap="collective_matmul")),
    Case("generate-sp-on-one-rank", "generate --workdir {workdir} --max-new-tokens 4 --tensor 1 --sequence-parallel",
         "parallel.sequence_parallel", _gen_api(lambda c: c.workdir, tensor=1, sequence_parallel=True)),
    Case("generate-sp-with-gspmd", "generate --workdir {workdir} --max-new-tokens 4 --gspmd --sequence-parallel",
         "parallel.sequence_parallel", _gen_api(lambda c: c.workdir, explicit=False, sequence_parallel=True)),
    Case("generate-zero-data", "generate --workdir {workdir} --max-new-tokens 4 --data 0", "parallel.data",
         _gen_api(lambda c: c.workdir, data=0)),
    Case("generate-too-many-devices", "generate --workdir {workdir} --max-new-tokens 4 --data 64", "devices",
         _gen_api(lambda c: c.workdir, data=64)),
    Case("generate-too-long", "generate --workdir {workdir} --max-new-tokens 100000", "max_seq_len",
         _gen_api(lambda c: c.workdir, n=100000)),
    Case("generate-broken-config-json", "generate --workdir {broken} --max-new-tokens 4", "cannot be read",
         _gen_api(lambda c: c.broken)),
    Case("convert-broken-config-json", "convert --from {broken} --to {tmp}/out", "cannot be read",
         lambda c, t: checkpoint.convert(c.broken, t / "out")),
    Case("generate-config-override", "generate --workdir {workdir} --config.model.d_model=3", "no config overrides"),
    Case("generate-bad-float", "generate --workdir {workdir} --temperature warm", "--temperature"),
    Case("generate-hf-config-list", "generate --model {hf_config_list} --max-new-tokens 4", "config.json",
         _gen_api(lambda c: c.hf["config_list"])),
    Case("generate-hf-zero-heads", "generate --model {hf_zero_heads} --max-new-tokens 4", "num_attention_heads",
         _gen_api(lambda c: c.hf["zero_heads"])),
    # quantized weights (ONE's widths: d_model 40, heads*head_dim 40, d_ff 128)
    Case("train-weights-unknown", TRAIN + "--config.model.weights=int3", "model.weights",
         lambda c, t: load_config("configs/tiny.py", ["model.weights=int3"])),
    Case("train-weights-int8", TRAIN + SMALL + " --config.model.weights=int8", "model.weights",
         _train_api("model.weights=int8")),
    Case("train-weight-group-zero", TRAIN + "--config.model.weights=int4 --config.model.weight_group=0",
         "model.weight_group", lambda c, t: load_config("configs/tiny.py", ["model.weights=int4",
                                                                             "model.weight_group=0"])),
    Case("train-weight-group-not-dividing", TRAIN + "--config.model.weights=int4", "w_down",
         lambda c, t: load_config("configs/tiny.py", ["model.weights=int4"])),
    Case("generate-quantize-unknown", "generate --workdir {workdir} --max-new-tokens 4 --quantize int3", "--quantize",
         _gen_api(lambda c: c.workdir, quantize="int3")),
    Case("generate-int4-group-not-dividing", "generate --workdir {workdir} --max-new-tokens 4 --quantize int4 "
         "--group-size 16", "model.weight_group", _gen_api(lambda c: c.workdir, quantize="int4", group_size=16)),
    Case("generate-int4-group-split-by-tensor", f"generate --model {FIXTURES / 'llama'} --max-new-tokens 4 "
         "--tensor 4 --quantize int4 --group-size 16", "tensor = 4",
         _gen_api(lambda c: FIXTURES / "llama", tensor=4, quantize="int4", group_size=16)),
    Case("generate-quantized-as-another-format", "generate --workdir {int8} --max-new-tokens 4 --quantize int4 "
         "--group-size 8", "stored quantized as int8", _gen_api(lambda c: c.int8, quantize="int4", group_size=8)),
    Case("convert-quantize-to-hf", "convert --from {workdir} --to-hf {tmp}/hf --quantize int8", "--quantize"),
    Case("convert-group-without-int4", "convert --from {workdir} --to {tmp}/out --group-size 8", "--group-size"),
    Case("convert-int4-group-not-dividing", "convert --from {workdir} --to {tmp}/out --quantize int4 --group-size 16",
         "model.weight_group", lambda c, t: checkpoint.convert(c.workdir, t / "out", quantize="int4", group_size=16)),
    Case("convert-quantize-twice", "convert --from {int8} --to {tmp}/out --quantize int8", "quantized already",
         lambda c, t: checkpoint.convert(c.int8, t / "out", quantize="int8")),
    Case("convert-quantized-to-hf", "convert --from {int8} --to-hf {tmp}/hf", "model.weights",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.export_workdir(c.int8, t / "hf")),
    # convert
    Case("convert-into-a-users-directory", "convert --from {workdir} --to {hf_user_config}", "already holds files",
         lambda c, t: checkpoint.convert(c.workdir, c.hf["user_config"])),
    Case("convert-into-a-run-not-saved-yet", "convert --from {workdir} --to {hf_unsaved_run}", "already holds files",
         lambda c, t: checkpoint.convert(c.workdir, c.hf["unsaved_run"])),
    Case("convert-into-its-source", "convert --from {workdir} --to {workdir}/copy", "inside the source",
         lambda c, t: checkpoint.convert(c.workdir, c.workdir / "copy")),
    Case("convert-parent-is-a-file", "convert --from {workdir} --to {file}/w", "not a directory",
         lambda c, t: checkpoint.convert(c.workdir, c.file / "w")),
    Case("convert-hf-into-itself", "convert --from-hf {hf_intact} --to {hf_intact}", "is the source",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.import_to_workdir(c.hf["intact"], c.hf["intact"])),
    Case("convert-hf-into-a-users-directory", "convert --from-hf {hf_intact} --to {hf_user_config}",
         "already holds files", lambda c, t: __import__("jaxpar.interop.hf").interop.hf.import_to_workdir(
             c.hf["intact"], c.hf["user_config"])),
    Case("convert-to-hf-into-a-model-directory", "convert --from {workdir} --to-hf {hf_intact}", "already holds files",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.export_workdir(c.workdir, c.hf["intact"])),
    Case("convert-to-hf-unwritable-parent", "convert --from {workdir} --to-hf /sys/jaxpar-unwritable/hf", "--to-hf",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.export_workdir(c.workdir, "/sys/jaxpar-unwritable/hf")),
    Case("convert-to-hf-parent-is-a-file", "convert --from {workdir} --to-hf {file}/hf", "not a directory",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.export_workdir(c.workdir, c.file / "hf")),
    Case("convert-hf-tokenizer-links-out", "convert --from-hf {hf_tokenizer_outside} --to {tmp}/out", "outside",
         _hf_import("tokenizer_outside")),
    Case("convert-hf-config-links-out", "convert --from-hf {hf_config_outside} --to {tmp}/out", "outside",
         _hf_import("config_outside")),
    Case("convert-hf-generation-config-links-out", "convert --from-hf {hf_generation_outside} --to {tmp}/out",
         "outside", _hf_import("generation_outside")),
    Case("generate-hf-tokenizer-links-out", "generate --model {hf_tokenizer_outside} --max-new-tokens 2", "outside",
         _gen_api(lambda c: c.hf["tokenizer_outside"])),
    Case("train-init-from-hf-config-links-out", TRAIN + "--init-from-hf {hf_config_outside}", "outside"),
    Case("convert-hf-deepseek-fp8", "convert --from-hf {hf_deepseek_fp8} --to {tmp}/out", "quantization_config",
         _hf_import("deepseek_fp8")),
    Case("convert-hf-deepseek-v32-indexer", "convert --from-hf {hf_deepseek_indexer} --to {tmp}/out",
         "lightning indexer", _hf_import("deepseek_indexer")),
    Case("generate-hf-deepseek-fp8", "generate --model {hf_deepseek_fp8} --max-new-tokens 2", "quantization_config"),
    Case("train-init-from-hf-deepseek-fp8", TRAIN + "--init-from-hf {hf_deepseek_fp8}", "quantization_config"),
    Case("convert-drop-mtp-not-an-import", "convert --from {workdir} --to {tmp}/out --drop-mtp", "--drop-mtp"),
    Case("convert-hf-huge-vocab", "convert --from-hf {hf_vocab_huge} --to {tmp}/out", "vocab_size",
         _hf_import("vocab_huge")),
    Case("convert-hf-huge-hidden", "convert --from-hf {hf_hidden_huge} --to {tmp}/out", "hidden_size",
         _hf_import("hidden_huge")),
    Case("generate-hf-huge-vocab", "generate --model {hf_vocab_huge} --max-new-tokens 2", "vocab_size",
         _gen_api(lambda c: c.hf["vocab_huge"])),
    Case("train-init-from-hf-huge-vocab", TRAIN + "--init-from-hf {hf_vocab_huge} " + SMALL, "vocab_size"),
    Case("convert-config-no-longer-matches", "convert --from {hf_mismatched} --to {tmp}/out",
         "does not match its checkpoints", lambda c, t: checkpoint.convert(c.hf["mismatched"], t / "out")),
    Case("generate-config-no-longer-matches", "generate --workdir {hf_mismatched} --max-new-tokens 2",
         "does not match its checkpoints", _gen_api(lambda c: c.hf["mismatched"])),
    Case("convert-missing-source", "convert --from {tmp}/nothing --to {tmp}/out", "does not exist",
         lambda c, t: checkpoint.convert(t / "nothing", t / "out")),
    Case("convert-source-without-checkpoints", "convert --from {empty} --to {tmp}/out", "no config.json"),
    Case("convert-missing-step", "convert --from {workdir} --step 99 --to {tmp}/out", "step 99",
         lambda c, t: checkpoint.convert(c.workdir, t / "o", step=99)),
    Case("convert-into-a-workdir", "convert --from {workdir} --to {export}", "already holds checkpoints",
         lambda c, t: checkpoint.convert(c.workdir, c.export)),
    Case("convert-to-hf-non-empty", "convert --from {workdir} --to-hf {full}", "already holds files"),
    Case("convert-to-hf-file", "convert --from {workdir} --to-hf {file}", "not a directory"),
    Case("convert-needs-one-source", "convert --to {tmp}/out", "exactly one"),
    Case("convert-bad-dtype", "convert --from {workdir} --to {tmp}/out --dtype int8", "--dtype"),
    Case("convert-hf-with-step", "convert --from-hf {hf_config_list} --step 3 --to {tmp}/out", "--step"),
    Case("convert-hf-missing", "convert --from-hf {tmp}/no_model --to {tmp}/out", "no_model",
         lambda c, t: __import__("jaxpar.interop.hf").interop.hf.import_to_workdir(t / "no_model", t / "out")),
    Case("convert-hf-no-config", "convert --from-hf {hf_no_config} --to {tmp}/out", "config.json",
         _hf_import("no_config")),
    Case("convert-hf-i32-tensor", "convert --from-hf {hf_i32_tensor} --to {tmp}/out", "I32", _hf_import("i32_tensor")),
    Case("convert-hf-config-list", "convert --from-hf {hf_config_list} --to {tmp}/out", "config.json",
         _hf_import("config_list")),
    Case("convert-hf-zero-heads", "convert --from-hf {hf_zero_heads} --to {tmp}/out", "num_attention_heads",
         _hf_import("zero_heads")),
    Case("convert-hf-string-heads", "convert --from-hf {hf_string_heads} --to {tmp}/out", "num_attention_heads",
         _hf_import("string_heads")),
    Case("convert-hf-rope-missing-key", "convert --from-hf {hf_rope_no_low} --to {tmp}/out", "low_freq_factor",
         _hf_import("rope_no_low")),
    Case("convert-hf-index-leaves-dir", "convert --from-hf {hf_outside_index} --to {tmp}/out", "outside",
         _hf_import("outside_index")),
    Case("convert-hf-only-pickles", "convert --from-hf {hf_only_pickles} --to {tmp}/out", "pickle",
         _hf_import("only_pickles")),
    # analyze, schedule, launch
    Case("analyze-missing-config", "analyze --config nope.py", "nope.py"),
    Case("analyze-heads-vs-tensor", "analyze --config configs/tiny.py --config.parallel.tensor=3", "parallel.tensor"),
    Case("schedule-zero-pipe", "schedule --pipe 0 --microbatches 4", "parallel.pipe"),
    Case("schedule-microbatches", "schedule --pipe 2 --microbatches 3", "parallel.microbatches"),
    Case("schedule-unwritable-png", "schedule --pipe 2 --microbatches 4 --png {file}/x.png", "--png"),
    Case("schedule-missing-flag", "schedule --pipe 2", "--microbatches"),
    Case("schedule-unknown-name", "schedule --schedule pipedream --pipe 2 --microbatches 4", "parallel.schedule"),
    Case("schedule-1f1b-chunks", "schedule --schedule 1f1b --pipe 2 --chunks 2 --microbatches 4", "parallel.repeats"),
    Case("schedule-interleaved-microbatches", "schedule --schedule interleaved_1f1b --pipe 4 --chunks 2 "
         "--microbatches 6", "parallel.microbatches"),
    Case("plan-zero-devices", "plan --config configs/tiny.py --devices 0", "--devices", lambda c, t: _plan(devices=0)),
    Case("plan-hosts-uneven", "plan --config configs/tiny.py --devices 8 --hosts 3", "--hosts",
         lambda c, t: _plan(hosts=3)),
    Case("plan-negative-memory", "plan --config configs/tiny.py --devices 8 --memory-gb -1", "--memory-gb",
         lambda c, t: _plan(memory_gb=-1.0)),
    Case("plan-fits-nothing", "plan --config configs/tiny.py --devices 1 --memory-gb 0.005 --config.parallel.pipe=1 "
         "--config.parallel.repeats=1 --config.parallel.microbatches=1 --config.parallel.context=1", "needs",
         lambda c, t: _plan(devices=1, memory_gb=0.005, fixed=dict(pipe=1, repeats=1, microbatches=1, context=1))),
    Case("plan-unknown-device-kind", "plan --config configs/tiny.py --devices 8 --device-kind tpu9",
         "--device-kind", lambda c, t: __import__("jaxpar.planner.profile").planner.profile.profile_for("tpu9")),
    Case("plan-missing-profile", "plan --config configs/tiny.py --devices 8 --profile {tmp}/none.json", "--profile",
         lambda c, t: __import__("jaxpar.planner.profile").planner.profile.load_profile(str(t / "none.json"))),
    Case("plan-not-a-profile", "plan --config configs/tiny.py --devices 8 --profile {configs}/bad.yaml", "--profile",
         lambda c, t: __import__("jaxpar.planner.profile").planner.profile.load_profile(str(c.configs / "bad.yaml"))),
    Case("plan-other-machine-profile", "plan --config configs/tiny.py --devices 8 --profile {configs}/other.json",
         "another machine", lambda c, t: __import__("jaxpar.planner.profile").planner.profile.load_profile(
             str(c.configs / "other.json"))),
    Case("plan-two-machines", "plan --config configs/tiny.py --devices 8 --profile x.json --device-kind h100",
         "--profile"),
    Case("plan-top-zero", "plan --config configs/tiny.py --devices 8 --top 0", "--top"),
    Case("plan-unknown-field", "plan --config configs/tiny.py --devices 8 --config.parallel.pipes=2",
         "parallel.pipes"),
    *[Case(f"plan-profile-{name.replace('_', '-')}", f"plan --config configs/tiny.py --devices 8 --profile "
           f"{{configs}}/{name}.json", needle, lambda c, t, name=name: __import__("jaxpar.planner.profile").planner.profile
           .load_profile(str(c.configs / f"{name}.json"))) for name, needle in (
               ("negative_link", "field intra_host = -1.0: must be a finite number > 0"),
               ("overlap_5", "field overlap = 5: must lie in [0, 1]"), ("nan_cost", "field pipeline_byte = nan"),
               ("negative_memory", "field memory_gb = -3"))],
    Case("plan-devices-without-layout", "plan --config configs/tiny.py --devices 7", "plan for 4 or 8 devices",
         lambda c, t: _plan(devices=7)),
    Case("plan-kept-field-blocks", "plan --config configs/tiny.py --devices 1 --config.parallel.tensor=2",
         "keeps parallel.tensor = 2", lambda c, t: _plan(devices=1, fixed=dict(tensor=2))),
    Case("plan-memory-not-finite", "plan --config configs/tiny.py --devices 8 --memory-gb nan", "--memory-gb nan",
         lambda c, t: _plan(memory_gb=float("nan"))),
    Case("plan-budget-below-state", "plan --config configs/tiny.py --devices 8 --memory-gb 1e-300",
         "state alone needs at least", lambda c, t: _plan(memory_gb=1e-300)),
    Case("probe-out-is-a-directory", "probe --out {empty}", "--out"),
    Case("probe-out-no-directory", "probe --out {tmp}/no/such/profile.json", "--out"),
    Case("probe-config-override", "probe --config.model.d_model=64", "probe takes no config"),
    Case("probe-out-is-a-pipe", "probe --out {fifo}/.lock", "not a regular file"),
    Case("launch-zero-processes", "launch --processes 0 -- jaxpar train --config configs/tiny.py", "--processes",
         lambda c, t: __import__("jaxpar.launch").launch.launch(["jaxpar", "train"], 0, 1)),
    Case("launch-zero-devices", "launch --processes 2 --devices-per-process 0 -- jaxpar train", "--devices-per-process"),
    Case("launch-no-command", "launch --processes 2", "no command",
         lambda c, t: __import__("jaxpar.launch").launch.launch([], 2, 1)),
    Case("no-command", "", "command"),
    Case("unknown-command", "fly", "fly"),
]


def _plan(devices: int = 8, hosts: int = 1, memory_gb: float | None = None, fixed: dict | None = None):
    """`jaxpar.planner.search.plan` on the tiny config, with `fixed` parallel fields set and kept."""
    from jaxpar.planner import profile as machine, search

    config = load_config("configs/tiny.py", [f"parallel.{k}={v}" for k, v in (fixed or {}).items()])
    return search.plan(config, devices, machine.profile_for("h100"), hosts=hosts, memory_gb=memory_gb,
                       fixed=set(fixed or ()))


def _argv(case: Case, c: Paths, tmp: pathlib.Path) -> list[str]:
    fill = {"workdir": c.workdir, "export": c.export, "int8": c.int8, "broken": c.broken, "gutted": c.gutted, "fifo": c.fifo, "file": c.file, "empty": c.empty, "full": c.full,
            "configs": c.configs, "chat": c.chat, "tmp": tmp, **{f"hf_{k}": v for k, v in c.hf.items()}}
    return [a.format(**fill) for a in case.argv.split()]


def _holding_lock(case: Case, c: Paths):
    return WorkdirLock(c.workdir) if "locked" in case.id else contextlib.nullcontext()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_bad_input_is_one_line_with_exit_2(case, ctx, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    err = io.StringIO()
    with _holding_lock(case, ctx), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(_argv(case, ctx, tmp_path))
        except SystemExit as e:  # argparse's usage errors exit from inside parse_args
            status = e.code
    lines = err.getvalue().strip().splitlines()
    lines = [line for line in lines if "Warning" not in line]  # e.g. a fallback warning is not the error line
    assert status == 2, err.getvalue()
    assert len(lines) == 1, err.getvalue()
    assert lines[0].startswith("jaxpar: ") and case.needle in lines[0], lines[0]
    assert (ctx.full / "keep.txt").read_text() == "precious\n"  # nothing was overwritten


API_CASES = [c for c in CASES if c.api is not None]


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_api_bad_input_raises_a_typed_error(case, ctx, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with _holding_lock(case, ctx), pytest.raises(JaxparError) as err:
        case.api(ctx, tmp_path)
    assert "\n" not in str(err.value).strip() and str(err.value), str(err.value)


@pytest.mark.parametrize("ids, kwargs, needle", [
    ([[999, 3]], {}, "outside the model's vocabulary"),
    ([[-1, 3]], {}, "outside the model's vocabulary"),
    ([[]], {}, "at least one token"),
    ([[1, 2]], {"do_sample": True, "top_k": 2.5}, "top_k"),
    ([[1, 2]], {"do_sample": True, "temperature": float("nan")}, "temperature"),
    ([[1, 2]], {"max_new_tokens": True}, "max_new_tokens"),
])
def test_api_only_bad_token_ids_and_settings(loaded, ids, kwargs, needle):
    """Inputs only the Python API can express (token ids, Python types) get the same typed, one-line errors."""
    from jaxpar.errors import GenerateError

    with pytest.raises(GenerateError, match=needle):
        loaded.generate(ids, **{"max_new_tokens": 2, **kwargs})


@pytest.fixture(scope="module")
def loaded(ctx):
    from jaxpar.infer.text import load

    return load(ctx.workdir)


def test_ctrl_c_outside_the_training_loop_is_one_line(monkeypatch):
    """Ctrl-C while loading or compiling (before the loop's own SIGINT handling) is one line, exit 130."""
    import jaxpar.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxpar.cli, "load_config", interrupted)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["train", "--config", "configs/tiny.py"])
    assert status == 130 and len(err.getvalue().strip().splitlines()) == 1 and "interrupted" in err.getvalue()


def test_error_types_keep_their_builtin_bases():
    """Callers that caught ValueError / FileNotFoundError before these types existed still catch them."""
    from jaxpar.errors import GenerateError, InputNotFound
    from jaxpar.interop.hf import HFError

    assert issubclass(ConfigError, ValueError) and issubclass(HFError, ValueError)
    assert issubclass(GenerateError, ValueError) and issubclass(InputNotFound, FileNotFoundError)


# ---------------------------------------------------------------------------------------------------------------------
# Real processes: what only an interpreter shows


ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _run(args: list, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          timeout=300)


def test_real_process_non_utf8_prompt_and_missing_step(ctx):
    """argv bytes that are not UTF-8 reach the prompt as surrogates; both errors are one line, no traceback."""
    for args in ([b"generate", str(ctx.workdir).encode(), b"--prompt", b"\xff\xfedef", b"--max-new-tokens", b"2"],
                 [b"generate", str(ctx.workdir).encode(), b"--step", b"99"]):
        args = [args[0], b"--workdir", *args[1:]]
        out = _run(args)
        stderr = out.stderr.decode(errors="replace")
        assert out.returncode == 2 and "Traceback" not in stderr, stderr
        assert len([line for line in stderr.strip().splitlines() if "Warning" not in line]) == 1, stderr


def test_real_process_config_that_exits_zero_does_not_pass_for_a_run(ctx, tmp_path):
    out = _run(["train", "--config", str(ctx.configs / "exits.py"), "--workdir", str(tmp_path / "w")])
    assert out.returncode == 2 and b"sys.exit(0)" in out.stderr and b"Traceback" not in out.stderr, out.stderr


def test_numpy_scalars_are_valid_sampling_settings():
    """The type checks refuse what has no meaning, not NumPy's scalars (np.float32 is no Python float)."""
    import numpy as np

    from jaxpar.infer.sampling import check_sampling_args

    check_sampling_args(np.float32(0.7), np.int64(3), np.float32(0.9))
