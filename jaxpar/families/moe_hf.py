"""Hugging Face mapping of the llama family's mixture-of-experts layers: Mixtral and Qwen2-MoE.

Both are the llama layer with the SwiGLU MLP replaced by `jaxpar.families.base.moe_params` (router, stacked experts,
optional shared expert) and compute exactly what jaxpar's MoE block does: router logits h·router in float32, softmax
over all X experts, the top k kept (renormalised to sum 1 when moe.norm_topk_prob), out = Σ_k p_k·SwiGLU_e(h), plus
sigmoid(h·ws_score)·SwiGLU_shared(h) for Qwen2-MoE.

    config.json (Mixtral)            config.json (Qwen2-MoE)              jaxpar
    num_local_experts                num_experts                          moe.n_experts
    num_experts_per_tok              num_experts_per_tok                  moe.top_k
    intermediate_size                moe_intermediate_size                moe.d_ff (Mixtral: model.d_ff too)
    —                                intermediate_size                    model.d_ff (dense width: no layer uses it)
    (always renormalises)            norm_topk_prob                       moe.norm_topk_prob
    —                                shared_expert_intermediate_size      moe.shared_d_ff (> 0), moe.shared_gate
    router_aux_loss_coef             router_aux_loss_coef                 moe.aux_loss_coef
    router_jitter_noise: must be 0   qkv_bias (default true)              model.qkv_bias
    sliding_window (all layers)      decoder_sparse_step 1, mlp_only_layers []: every layer MoE (else an HFError)

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

Export picks the architecture by the features: Qwen2-MoE for a shared expert (which it always gates; q/k/v biases
optional through its qkv_bias key), else Mixtral (no biases, top-k always renormalised). A ConfigError refuses what
neither holds: an ungated shared expert, q/k/v biases without a shared expert, norm_topk_prob false without one.
capacity_factor and z_loss_coef are training settings that config.json has no key for (transformers routes
dropless, as jaxpar does at capacity_factor 0); they are not exported.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families.base import Rule

ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe"}
FUSED = ".mlp.experts.gate_up_proj"  # a tensor name ending that marks transformers 5's fused expert layout


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
        step = keys.integer("decoder_sparse_step", 1)
        if step != 1:
            raise keys.bad("decoder_sparse_step", step, "jaxpar does not support mixed dense/MoE stacks yet (layer "
                           f"i is MoE only when (i + 1) % {step} == 0); every layer must be MoE: decoder_sparse_step 1")
        dense = keys.raw("mlp_only_layers", [])
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise keys.bad("mlp_only_layers", dense, "must be a list of layer indices")
        if dense:
            raise keys.bad("mlp_only_layers", dense, "jaxpar does not support mixed dense/MoE stacks yet (these "
                           "layers would be dense); every layer must be MoE: mlp_only_layers []")
        names = {"moe.n_experts": "num_experts", "moe.d_ff": "moe_intermediate_size",
                 "moe.shared_d_ff": "shared_expert_intermediate_size", "moe.norm_topk_prob": "norm_topk_prob"}
        # Qwen2-MoE always builds the shared expert and its gate (a width of 0 would give empty tensors).
        moe = dict(n_experts=keys.integer("num_experts"), d_ff=keys.integer("moe_intermediate_size"),
                   norm_topk_prob=keys.flag("norm_topk_prob", False), shared_gate=True,
                   shared_d_ff=keys.integer("shared_expert_intermediate_size"))
    moe.update(top_k=keys.integer("num_experts_per_tok"), aux_loss_coef=aux)
    names.update({"moe.top_k": "num_experts_per_tok", "moe.aux_loss_coef": "router_aux_loss_coef"})
    return moe, names


def architecture(cfg) -> tuple[str, str]:
    """(HF class, model_type) an MoE cfg exports as: Qwen2-MoE for a shared expert, else Mixtral."""
    return ("Qwen2MoeForCausalLM", "qwen2_moe") if cfg.moe.shared_d_ff else ("MixtralForCausalLM", "mixtral")


def exportable(cfg) -> None:
    """Raise ConfigError for an MoE cfg that neither Mixtral nor Qwen2-MoE holds (see the module docstring)."""
    moe = cfg.moe
    if moe.shared_d_ff and not moe.shared_gate:
        raise ConfigError("moe.shared_gate", False, "Qwen2-MoE, the Hugging Face architecture with a shared expert, "
                          "always scales it by sigmoid(x·w)", "export a model trained with moe.shared_gate=true")
    if not moe.shared_d_ff and cfg.qkv_bias:
        raise ConfigError("model.qkv_bias", True, "an MoE model without a shared expert exports as Mixtral, which has "
                          "no q/k/v biases (Qwen2-MoE has them, but always with a gated shared expert)",
                          "export a model with qkv_bias=false, or with moe.shared_d_ff > 0 and moe.shared_gate=true")
    if not moe.shared_d_ff and not moe.norm_topk_prob:
        raise ConfigError("moe.norm_topk_prob", False, "an MoE model without a shared expert exports as Mixtral, which "
                          "always renormalises the top-k router probabilities",
                          "export a model with moe.norm_topk_prob=true, or with a gated shared expert (Qwen2-MoE)")


def write(cfg, out: dict, model_type: str) -> None:
    """The MoE keys of config.json dict `out` (model_type 'mixtral' or 'qwen2_moe'; the llama keys are written by
    the family's `write`)."""
    moe = cfg.moe
    out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef)
    if model_type == "mixtral":
        out.update(num_local_experts=moe.n_experts, intermediate_size=moe.d_ff, router_jitter_noise=0.0)
    else:
        out.update(num_experts=moe.n_experts, moe_intermediate_size=moe.d_ff, shared_expert_intermediate_size=
                   moe.shared_d_ff, norm_topk_prob=moe.norm_topk_prob, qkv_bias=cfg.qkv_bias, decoder_sparse_step=1,
                   mlp_only_layers=[])


def tensors(cfg, names: set[str] | None = None) -> list[Rule]:
    """The MoE tensor rules of one layer (`model.layers.{l}.`): the hub layout, or the fused one when `names` (the
    tensors present) holds it."""
    lay, T = "model.layers.{l}.", (lambda x: x.T, lambda x: x.T)
    qwen = architecture(cfg)[1] == "qwen2_moe"
    if names is not None and any(n.endswith(FUSED) for n in names):
        experts = lay + "mlp.experts."
        rules = [Rule("blocks.router", lay + "mlp.gate.weight", *T),
                 ExpertRule("blocks.we_gate", experts + "gate_up_proj", *T, part=0, parts=2),
                 ExpertRule("blocks.we_up", experts + "gate_up_proj", *T, part=1, parts=2),
                 ExpertRule("blocks.we_down", experts + "down_proj", *T)]
    else:
        block = lay + ("mlp." if qwen else "block_sparse_moe.")
        gate, up, down = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        rules = [Rule("blocks.router", block + "gate.weight", *T)] + [
            ExpertRule(f"blocks.we_{p}", block + f"experts.{{e}}.{w}.weight", *T)
            for p, w in (("gate", gate), ("up", up), ("down", down))]
    if cfg.moe.shared_d_ff:
        rules += [Rule(f"blocks.ws_{p}", lay + f"mlp.shared_expert.{p}_proj.weight", *T)
                  for p in ("gate", "up", "down")]
    if cfg.moe.shared_gate:  # the [1, D] Linear that scores each token for the shared expert
        rules.append(Rule("blocks.ws_score", lay + "mlp.shared_expert_gate.weight", lambda x: x.reshape(-1),
                          lambda x: x.reshape(1, -1)))
    return rules


__all__ = ["ARCHITECTURES", "ExpertRule", "architecture", "exportable", "read", "tensors", "write"]
