"""Hugging Face mapping of the llama family's mixture-of-experts layers: Mixtral, Qwen2-MoE and Qwen3-MoE.

Qwen3-MoE is Qwen2-MoE's mapping without the shared expert (no shared_expert_* keys or tensors) and with the
llama family's q/k norm (`qk_norm`: self_attn.q_norm / k_norm); its names and the other keys are Qwen2-MoE's.

Both are the llama layer with the SwiGLU MLP replaced by `jaxpar.families.base.moe_params` (router, stacked experts,
optional shared expert) and compute exactly what jaxpar's MoE block does: router logits h·router in float32, softmax
over all X experts, the top k kept (renormalised to sum 1 when moe.norm_topk_prob), out = Σ_k p_k·SwiGLU_e(h), plus
sigmoid(h·ws_score)·SwiGLU_shared(h) for Qwen2-MoE.

    config.json (Mixtral)            config.json (Qwen2-MoE)              jaxpar
    num_local_experts                num_experts                          moe.n_experts
    num_experts_per_tok              num_experts_per_tok                  moe.top_k
    intermediate_size                moe_intermediate_size                moe.d_ff (Mixtral: model.d_ff too)
    —                                intermediate_size                    model.d_ff (the dense layers' width)
    (always renormalises)            norm_topk_prob                       moe.norm_topk_prob
    —                                shared_expert_intermediate_size      moe.shared_d_ff, moe.shared_gate (> 0)
    router_aux_loss_coef             router_aux_loss_coef                 moe.aux_loss_coef
    router_jitter_noise: must be 0   qkv_bias (default true)              model.qkv_bias
    sliding_window (all layers)      decoder_sparse_step                  moe.sparse_step
    (every layer MoE)                mlp_only_layers                      moe.dense_layers

Qwen2-MoE's layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers — jaxpar's rule
for moe.sparse_step and moe.dense_layers — and its other layers keep a dense SwiGLU of width intermediate_size
(model.d_ff). A mixed model keeps two stacks of layer parameters (`ModelConfig.layer_stacks`): `blocks` holds the MoE
layers, `dense_blocks` the dense ones (w_gate, w_up, w_down ⇄ mlp.gate_proj, up_proj, down_proj), and each rule of
a stacked parameter names the model layers of its stack (`Rule.layers`), so "{l}" is always the model layer.

transformers adds the load-balancing loss only with output_router_logits; jaxpar's training adds it whenever
moe.aux_loss_coef > 0 (set it to 0 for transformers' default fine-tuning). The qkv_bias key is transformers 5's:
older versions always build Qwen2-MoE's biases, so an export with qkv_bias false needs transformers >= 5.

Tensors per layer l and expert e (torch Linear [out, in], so every matrix is transposed; F = expert width):

    jaxpar                  Mixtral (hub layout)                             Qwen2-MoE (hub layout)
    router [D, X]           block_sparse_moe.gate.weight [X, D]              mlp.gate.weight [X, D]
    we_gate[e] [D, F]       block_sparse_moe.experts.{e}.w1.weight [F, D]    mlp.experts.{e}.gate_proj.weight
    we_up[e] [D, F]         block_sparse_moe.experts.{e}.w3.weight [F, D]    mlp.experts.{e}.up_proj.weight
    we_down[e] [F, D]       block_sparse_moe.experts.{e}.w2.weight [D, F]    mlp.experts.{e}.down_proj.weight
    ws_gate, ws_up [D, Fs]  —                                                mlp.shared_expert.{gate,up}_proj.weight
    ws_down [Fs, D]         —                                                mlp.shared_expert.down_proj.weight
    ws_score [D]            —                                                mlp.shared_expert_gate.weight [1, D]

(names under `model.layers.{l}.`). One HF tensor per (layer, expert) is an `ExpertRule` whose name holds "{e}": the
importer reads, for each device's shard, only the experts that shard covers. transformers 5 keeps experts fused in
memory and `save_pretrained(save_original_format=False)` writes them that way — `mlp.gate.weight` (Mixtral's
block_sparse_moe renamed), `mlp.experts.gate_up_proj` [X, 2F, D] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [X, D, F]. That layout imports too (an ExpertRule without "{e}": each expert is one slice
of the fused tensor, read alone); export always writes the hub layout, which every transformers version loads.

Qwen2-MoE always builds a shared expert and its gate; with shared_expert_intermediate_size 0 the expert has width 0
(tensors [0, D] and [D, 0]: transformers 5.24 saves and loads them) and adds exactly zero, whatever its gate's
[1, D] weight. jaxpar reads that as no shared expert (moe.shared_d_ff 0): those tensors are `ZeroRule`s, which
import checks and skips and export writes as zeros.

Export picks the architecture by the features: Mixtral when it holds the model (every layer MoE, no shared expert,
no q/k/v biases, top-k renormalised), else Qwen2-MoE (dense layers through decoder_sparse_step / mlp_only_layers,
q/k/v biases through its qkv_bias key, norm_topk_prob either way; without a shared expert one of width 0). A
ConfigError refuses what neither holds: a shared expert without its sigmoid gate, which Qwen2-MoE always applies.
capacity_factor and z_loss_coef are training settings that config.json has no key for (transformers routes
dropless, as jaxpar does at capacity_factor 0); they are not exported.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError
from jaxpar.families.base import Rule

ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}
FUSED = ".mlp.experts.gate_up_proj"  # a tensor name ending that marks transformers 5's fused expert layout
SHARED_GATE = ".mlp.shared_expert_gate.weight"  # one every Qwen2-MoE checkpoint has (and no Mixtral one)


class ExpertRule(Rule):
    """A Rule for a parameter with a leading experts axis: per layer [X, ...], to_jax / to_hf convert ONE expert's
    tensor (e.g. w1 [F, D] ⇄ we_gate[e] [D, F]).

    With "{e}" in the name (the hub layout) each expert is its own HF tensor. Without it (the fused layout) the
    name is one tensor per layer holding every expert on its first axis, [X, parts·R, C]; expert e of this rule is
    rows part·R:(part+1)·R of entry e (gate_up_proj: gate is part 0 of 2, up part 1). Fused rules are import-only.
    """

    @property
    def per_expert(self) -> bool:
        """One HF tensor per expert (the hub layout), not one fused tensor per layer."""
        return "{e}" in self.name


@dataclasses.dataclass(frozen=True)
class ZeroRule(Rule):
    """An HF tensor that no jaxpar parameter holds because it cannot change the output: Qwen2-MoE's shared expert
    of width 0 (gate_proj, up_proj [0, D]; down_proj [D, 0]) and its gate [1, D], which scales that expert's zero.
    `shape`: the HF tensor's (one layer's). Import checks the shape where the tensor is present and reads nothing
    else of it; export writes zeros. `param`: the jaxpar parameter it would be, which the model does not have."""

    shape: tuple[int, ...] = ()


def read(keys, model_type: str) -> tuple[dict, dict]:
    """The `moe` fields (a dict: ModelConfig builds the MoEConfig) of a Mixtral / Qwen2-MoE config.json and their
    key names ({'moe.top_k': 'num_experts_per_tok', …}, for ModelConfig's errors)."""
    aux = keys.number("router_aux_loss_coef", 0.001)  # both configs' default
    if model_type == "mixtral":
        jitter = keys.number("router_jitter_noise", 0.0)
        if jitter:
            raise keys.bad("router_jitter_noise", jitter, "jaxpar's router has no jitter (multiplicative noise on "
                           "the router input while training); set it to 0.0 to import the weights")
        names = {"moe.n_experts": "num_local_experts", "moe.d_ff": "intermediate_size"}
        moe = dict(n_experts=keys.integer("num_local_experts"), d_ff=keys.integer("intermediate_size"),
                   norm_topk_prob=True)
    else:
        names = {"moe.n_experts": "num_experts", "moe.d_ff": "moe_intermediate_size",
                 "moe.shared_d_ff": "shared_expert_intermediate_size", "moe.norm_topk_prob": "norm_topk_prob",
                 "moe.sparse_step": "decoder_sparse_step", "moe.dense_layers": "mlp_only_layers"}
        # Qwen2-MoE always builds the shared expert and its gate; at width 0 both add nothing (the module docstring).
        # Qwen3-MoE has none.
        shared = 0 if model_type == "qwen3_moe" else keys.integer("shared_expert_intermediate_size", minimum=0)
        step, n_layers = keys.integer("decoder_sparse_step", 1), keys.integer("num_hidden_layers")
        # transformers 5 saves Qwen3-MoE's count as num_local_experts (its attribute_map); the hub's files say
        # num_experts
        count = "num_local_experts" if "num_local_experts" in keys.d and "num_experts" not in keys.d else "num_experts"
        names["moe.n_experts"] = count
        moe = dict(n_experts=keys.integer(count), d_ff=keys.integer("moe_intermediate_size"),
                   norm_topk_prob=keys.flag("norm_topk_prob", False), shared_gate=shared > 0, shared_d_ff=shared,
                   sparse_step=step, dense_layers=_dense_layers(keys, step, n_layers))
    moe.update(top_k=keys.integer("num_experts_per_tok"), aux_loss_coef=aux)
    names.update({"moe.top_k": "num_experts_per_tok", "moe.aux_loss_coef": "router_aux_loss_coef"})
    return moe, names


def _dense_layers(keys, step: int, n_layers: int) -> tuple[int, ...]:
    """Qwen2-MoE's mlp_only_layers, checked: distinct layer indices below num_hidden_layers (transformers ignores
    the others silently; here they are a typo to report) that leave, with decoder_sparse_step `step`, some layer
    MoE."""
    dense = keys.raw("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise keys.bad("mlp_only_layers", dense, "must be a list of layer indices (integers from 0); write e.g. "
                       "[0, 3], or [] for none")
    wrong = sorted({i for i in dense if not 0 <= i < n_layers})
    if wrong:
        raise keys.bad("mlp_only_layers", dense, f"layers {wrong} do not exist: num_hidden_layers = {n_layers} "
                       f"(indices 0..{n_layers - 1}); list only layers 0..{n_layers - 1}")
    twice = sorted({i for i in dense if dense.count(i) > 1})
    if twice:
        raise keys.bad("mlp_only_layers", dense, f"lists layers {twice} more than once; list each dense layer once")
    if not any((i + 1) % step == 0 and i not in dense for i in range(n_layers)):
        key, value = ("decoder_sparse_step", step) if step > n_layers else ("mlp_only_layers", dense)
        raise keys.bad(key, value, f"leaves none of the {n_layers} layers an MoE layer (layer i is one when (i + 1) "
                       "% decoder_sparse_step == 0 and i is not in mlp_only_layers); jaxpar imports Qwen2-MoE models "
                       "with MoE layers (one without is a dense Qwen2: give its weights Qwen2ForCausalLM's names)")
    return tuple(sorted(dense))


def mixed(cfg) -> bool:
    """Whether some layers of the MoE model cfg are dense (`ModelConfig.layer_stacks` then holds two stacks)."""
    return "dense_blocks" in cfg.layer_stacks


def architecture(cfg, base: dict | None = None) -> tuple[str, str]:
    """(HF class, model_type) an MoE cfg exports as: Qwen3-MoE for the q/k norm; Mixtral when it holds the model
    (every layer MoE, no shared expert, no q/k/v biases, top-k renormalised) and `base` (the imported config.json,
    if any) is no Qwen2-MoE; else Qwen2-MoE, which holds every model Mixtral does."""
    moe = cfg.moe
    if cfg.qk_norm:
        return "Qwen3MoeForCausalLM", "qwen3_moe"
    if (moe.shared_d_ff or mixed(cfg) or cfg.qkv_bias or not moe.norm_topk_prob
            or (base or {}).get("architectures") == ["Qwen2MoeForCausalLM"]):
        return "Qwen2MoeForCausalLM", "qwen2_moe"
    return "MixtralForCausalLM", "mixtral"


def exportable(cfg) -> None:
    """Raise ConfigError for an MoE cfg that neither Mixtral nor Qwen2-MoE holds (see the module docstring)."""
    moe = cfg.moe
    if cfg.qk_norm and moe.shared_d_ff:
        raise ConfigError("moe.shared_d_ff", moe.shared_d_ff, "Qwen3-MoE, the Hugging Face MoE architecture with the "
                          "q/k norm, has no shared expert", "export a model trained with moe.shared_d_ff=0")
    if moe.shared_d_ff and not moe.shared_gate:
        raise ConfigError("moe.shared_gate", False, "Qwen2-MoE, the Hugging Face architecture with a shared expert, "
                          "always scales it by sigmoid(x·w)", "export a model trained with moe.shared_gate=true")


def write(cfg, out: dict, model_type: str) -> None:
    """The MoE keys of config.json dict `out` (model_type 'mixtral', 'qwen2_moe' or 'qwen3_moe'; the llama keys are
    written by the family's `write`)."""
    moe = cfg.moe
    out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef)
    if model_type == "mixtral":
        out.update(num_local_experts=moe.n_experts, intermediate_size=moe.d_ff, router_jitter_noise=0.0)
    elif model_type == "qwen3_moe":
        out.update(num_experts=moe.n_experts, moe_intermediate_size=moe.d_ff, norm_topk_prob=moe.norm_topk_prob,
                   decoder_sparse_step=moe.sparse_step, mlp_only_layers=list(moe.dense_layers))
    else:
        out.update(num_experts=moe.n_experts, moe_intermediate_size=moe.d_ff, shared_expert_intermediate_size=
                   moe.shared_d_ff, norm_topk_prob=moe.norm_topk_prob, qkv_bias=cfg.qkv_bias,
                   decoder_sparse_step=moe.sparse_step, mlp_only_layers=list(moe.dense_layers))


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """The MoE tensor rules of the MoE layers (`model.layers.{l}.`; of a mixed model, the `blocks` stack's layers):
    the hub layout, or the fused one when `names` (the tensors present) holds it."""
    lay, T = "model.layers.{l}.", (lambda x: x.T, lambda x: x.T)
    layers = cfg.layer_stacks["blocks"] if mixed(cfg) else None  # None: every layer, in order
    # A model Mixtral could hold has Qwen2-MoE's names when its checkpoint was one (which always has shared_expert_gate)
    qwen2 = architecture(cfg)[1] == "qwen2_moe" or any(n.endswith(SHARED_GATE) for n in names or ())
    qwen = qwen2 or cfg.qk_norm  # Qwen2-MoE's and Qwen3-MoE's names
    if names is not None and any(n.endswith(FUSED) for n in names):
        experts = lay + "mlp.experts."
        rules = [Rule("blocks.router", lay + "mlp.gate.weight", *T, layers=layers),
                 ExpertRule("blocks.we_gate", experts + "gate_up_proj", *T, part=0, parts=2, layers=layers),
                 ExpertRule("blocks.we_up", experts + "gate_up_proj", *T, part=1, parts=2, layers=layers),
                 ExpertRule("blocks.we_down", experts + "down_proj", *T, layers=layers)]
    else:
        block = lay + ("mlp." if qwen else "block_sparse_moe.")
        gate, up, down = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        rules = [Rule("blocks.router", block + "gate.weight", *T, layers=layers)] + [
            ExpertRule(f"blocks.we_{p}", block + f"experts.{{e}}.{w}.weight", *T, layers=layers)
            for p, w in (("gate", gate), ("up", up), ("down", down))]
    if cfg.moe.shared_d_ff:
        rules += [Rule(f"blocks.ws_{p}", lay + f"mlp.shared_expert.{p}_proj.weight", *T, layers=layers)
                  for p in ("gate", "up", "down")]
    elif qwen2:  # Qwen2-MoE's shared expert of width 0 and its gate: no jaxpar parameter (see ZeroRule)
        D = cfg.d_model
        rules += [ZeroRule(f"blocks.ws_{p}", lay + f"mlp.shared_expert.{p}_proj.weight", *T, layers=layers,
                           shape=shape) for p, shape in (("gate", (0, D)), ("up", (0, D)), ("down", (D, 0)))]
    if cfg.moe.shared_gate:  # the [1, D] Linear that scores each token for the shared expert
        rules.append(Rule("blocks.ws_score", lay + SHARED_GATE[1:], lambda x: x.reshape(-1),
                          lambda x: x.reshape(1, -1), layers=layers))
    elif qwen2:
        rules.append(ZeroRule("blocks.ws_score", lay + SHARED_GATE[1:], lambda x: x.reshape(-1),
                              lambda x: x.reshape(1, -1), layers=layers, shape=(1, cfg.d_model)))
    return rules


__all__ = ["ARCHITECTURES", "ExpertRule", "ZeroRule", "architecture", "exportable", "mixed", "read", "tensors",
           "write"]
