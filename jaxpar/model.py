"""Decoder-only transformer in Flax NNX: the layer functions every family shares, and the modules that hold them.

What differs between families (the Llama family, GPT-2) is data in jaxpar/families/: which norm, position scheme and
MLP a family uses and which parameters a layer holds. The functions here read those fields; none branches on a
family's name.

Dimension letters used in shapes and einsums (gemma style):
    B batch, T query positions, S key positions, D d_model, H query heads, K kv heads, G = H/K query heads per kv
    head, E head_dim, F d_ff, V vocab, L layers.

Design:
- Parameters carry *logical* axes as metadata (`logical_axes=("embed", "mlp")`); `jaxpar.sharding` maps them to the
  mesh. The model imports nothing about meshes or devices.
- The L layers are one `Blocks` module whose parameters are stacked on a leading `layers` axis; the forward is a
  `jax.lax.scan` over that axis, so compile time does not grow with depth and the pipeline can view the stack as
  `[repeats, stages, layers_per_stage, …]` without touching the model. A model whose layers differ in kind (dense
  MLPs among mixtures of experts) holds one such stack per kind, and the forward scans the layers in groups of one
  period of the pattern (`layer_groups`).
- The math reads head counts from weight *shapes* (`wq.shape[-2]`), never from the config, so the same code runs on
  full weights on one device and on a tensor-parallel shard (H/t local heads) inside `shard_map`. Where a parallel
  strategy may act (a tensor-parallel region begins or ends, the embedding, the loss, attention over keys) the model
  calls the `Parallel` context handed in from outside (`par.column`, `par.row`, `par.embed`, …,
  jaxpar.parallel.context); the default is the single-device one, whose methods are the plain computation.
- Weight matrices are never contracted here: they go to the context as stored, and its matmul policy
  (jaxpar.matmul) casts and contracts them — the one seam quantized or adapted weights replace.
- Numerics: master parameters in `param_dtype`; matmuls in `dtype`; the residual stream, norms, softmax and logits in
  float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.families import Param, attention_kind, family
from jaxpar.matmul import QUANT_DTYPES, Adapted, Quantized, mix32, quantize
from jaxpar.parallel.context import SINGLE_DEVICE, Parallel, segment_mask
from jaxpar.parallel.tensor import NEG_INF
from jaxpar.sharding import constrain

Array = jax.Array

# The activations a block names (`checkpoint_name`), for policies that save only named values: each linear layer's
# input and output — the norms' outputs, q/k/v after RoPE, the attention context (before the output projection),
# the MLP's gate/up and hidden — so what such a policy leaves to recompute is the core attention (scores, softmax,
# their product with V), Megatron's selective recomputation (Korthikanti et al. 2022, §4).
CHECKPOINT_NAMES = ("attn_in", "q", "k", "v", "context", "attn_out", "mlp_in", "mlp_gate", "mlp_up", "mlp_hidden",
                    "mlp_out")

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
    "selective": jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES),  # recompute the core attention
}


def _param(rngs: nnx.Rngs, spec: Param, cfg: ModelConfig, *, layers: int | None = None,
           pad: tuple[tuple[int, int], ...] | None = None, dtype=None, axis: str = "layers",
           frozen: bool | None = None) -> nnx.Param:
    """A parameter from its family spec: stacked on a leading axis of `layers` entries when given (logical axis
    `axis`: see `Blocks`), then zero `pad`, in `dtype` (default `param_dtype`); its logical axes and weight-decay
    flag ride along as metadata, and so does `frozen` (default: whether the model has LoRA adapters, which are then
    the only parameters that train: `learnable`). Only the normal initialisers draw from `rngs`, so the draws (and
    the values a seed gives) follow the order the family lists its parameters in."""
    shape, axes = spec.shape, spec.axes
    if layers is not None:
        shape, axes = (layers, *shape), (axis, *axes)
    std = {"normal": cfg.init_std, "out": cfg.init_std / math.sqrt(2 * cfg.n_layers), "half": cfg.init_std / 2}
    if spec.init in std:  # "out": GPT-2 / Megatron scale the projections that write into the residual stream
        value = std[spec.init] * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = jnp.full(shape, 1.0 if spec.init == "ones" else 0.0, jnp.float32)
    if pad is not None:
        value = jnp.pad(value, pad)
    frozen = bool(cfg.lora.rank) if frozen is None else frozen
    return nnx.Param(value.astype(jnp.dtype(dtype or cfg.param_dtype)), logical_axes=axes, weight_decay=spec.decay,
                     **({"frozen": True} if frozen else {}))


def _adapters(spec: Param, cfg: ModelConfig, name: str, layers: int, axis: str) -> tuple[nnx.Param, nnx.Param]:
    """LoRA's A [layers, in…, r] and B [layers, r, out…] for the matrix `spec` (`Param.contract`: its input dims),
    with the input and output dims' logical axes (so they shard as the matrix does) and an unsplit rank. B starts at
    zero, so the adapted model starts as the base; A ~ U(±1/√fan_in) (PEFT's default, kaiming-uniform with a = √5),
    drawn from a key of its own (the stack and the name), so adding adapters changes no other value."""
    n_in, r = len(spec.contract), cfg.lora.rank
    fan_in = math.prod(spec.shape[:n_in])
    key = jax.random.PRNGKey(zlib.crc32(f"{axis}/{name}".encode()))
    a = jax.random.uniform(key, (layers, *spec.shape[:n_in], r), jnp.float32, -1.0, 1.0) / math.sqrt(fan_in)
    dtype = jnp.dtype(cfg.param_dtype)
    return (nnx.Param(a.astype(dtype), logical_axes=(axis, *spec.axes[:n_in], None), weight_decay=False),
            nnx.Param(jnp.zeros((layers, r, *spec.shape[n_in:]), dtype),
                      logical_axes=(axis, None, *spec.axes[n_in:]), weight_decay=False))


class Blocks(nnx.Module):
    """A stack of transformer blocks of one kind: the family's layer parameters (jaxpar.families), each stacked on a
    leading `layers` axis — e.g. llama's wq [n, D, H, E], w_gate [n, D, F]; gpt2's b_up [n, F]. A model holds one
    stack (`blocks`: all L layers), or two when its layers mix dense MLPs and mixtures of experts
    (`ModelConfig.layer_stacks`: `blocks` the MoE layers, `dense_blocks` the dense ones).

    The stacked axis's logical name says who may split it: `layers` (a pipeline's stages own contiguous layers:
    `pipe` splits it, and a pipeline stores it in its own order, `Plan.stack_order`); `prefix_layers`, DeepSeek's
    leading dense layers (`ModelConfig.prefix_layers`), which a pipeline runs beside the embedding on every stage;
    `mtp_layers`, the MTP modules' blocks, which run after the last layer beside the head. The last two no mesh
    axis splits, and they stay in model order on every layout.

    A quantized model (`cfg.weights` int8 / int4) stores each matrix the family marks as contracted (`Param.contract`)
    as integers `name` [n, …] with float32 scales `name_scale` [n, …] (`ModelConfig.scale_param`), zeros here: the
    values come from `quantize_state`, a checkpoint or an import."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool | None = None, layers: int | None = None,
                 axis: str = "layers"):
        moe = cfg.moe.enabled if moe is None else moe
        layers = cfg.n_layers if layers is None else layers
        quantized = cfg.quantized_params(moe)
        for name, spec in family(cfg).layer_params(cfg, moe).items():
            if name in quantized:
                setattr(self, name, _param(rngs, dataclasses.replace(spec, init="zeros"), cfg, layers=layers,
                                           dtype=QUANT_DTYPES[cfg.weights][0], axis=axis))
                setattr(self, name + "_scale", _param(rngs, cfg.scale_param(spec), cfg, layers=layers,
                                                      dtype=jnp.float32, axis=axis))
            else:
                setattr(self, name, _param(rngs, spec, cfg, layers=layers, axis=axis))
        for name, spec in cfg.lora_params(moe).items():  # LoRA: the adapters, the only parameters that train
            a, b = _adapters(spec, cfg, name, layers, axis)
            setattr(self, name + "_lora_a", a)
            setattr(self, name + "_lora_b", b)
        for name, spec in layer_buffers(cfg, moe).items():  # no draws: the parameters' values are unchanged
            setattr(self, name, Buffer(jnp.full((layers, *spec.shape), spec.init, jnp.float32),
                                       logical_axes=(axis, *spec.axes)))
        self.cfg = cfg

    def stacked(self) -> dict[str, Array]:
        """The stacked parameters by name, each [n, …] (the local share of the stack inside shard_map); a quantized
        matrix as one `Quantized(name, name_scale)`; and the buffers the layer's forward reads (`BufferSpec.forward`),
        as constants (no gradient reaches them through the layer)."""
        out = layer_operands({name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}, self.cfg)
        out.update(forward_buffers({name: v for name, v in vars(self).items() if isinstance(v, Buffer)}, self.cfg))
        return out


def layer_operands(values: dict[str, Array], cfg: ModelConfig) -> dict[str, Array]:
    """A stack's parameter arrays by name → the operands its layers contract: a quantized matrix as one
    `Quantized(name, name_scale)`, an adapted one (LoRA) as `Adapted(W, name_lora_a, name_lora_b)`, the rest as
    they are. (`Blocks.stacked`, and a schedule table's chunk, which holds its trained and frozen arrays apart.)"""
    out = {name: Quantized(a, values[name + "_scale"]) if name + "_scale" in values else a
           for name, a in values.items() if not name.endswith(("_scale", "_lora_a", "_lora_b"))}
    for name in [n for n in out if n + "_lora_a" in values]:  # LoRA: W, A and B as one weight
        out[name] = Adapted(out[name], values[name + "_lora_a"], values[name + "_lora_b"], cfg.lora.scale, name)
    return out


def layer_seeds(stacks: Stacks, order: Callable[[int], np.ndarray] | None = None, axis: str | None = None) -> Stacks:
    """`stacks` with each stack's "lora_seed" uint32 [n] beside its parameters: the seed of LoRA dropout's masks in
    each layer (`jaxpar.matmul.LoRADropout`), mix32(crc32(stack name) + j) for the layer at index j of its stack in
    model order — so it travels with the layer through every reordering and split of the stack, as a parameter does.

    Without `order` each stack is whole and in model order. A pipeline's stage holds n consecutive entries of its
    stacks as stored, axis_index(axis)·n …: order(N) is a stack of N layers' storage order (`Pipeline.stack_order`)."""
    out = {}
    for name, params in stacks.items():
        n = jax.tree.leaves(params)[0].shape[0]
        index = np.arange(n) if order is None else order(n * jax.lax.axis_size(axis))
        seeds = mix32(jnp.asarray(index, jnp.uint32) + np.uint32(zlib.crc32(name.encode())))
        if order is not None:
            seeds = jax.lax.dynamic_slice_in_dim(seeds, jax.lax.axis_index(axis) * n, n)
        out[name] = {**params, "lora_seed": seeds}
    return out


class MTP(nnx.Module):
    """DeepSeek-V3's multi-token prediction modules (§2.2), D = `cfg.mtp_depth` of them, each stacked on a leading
    `layers` axis of length D: for depth k = 1 … D,

        h'ᵏ_i = eh_projᵏ · [RMSNorm_enormᵏ(Emb(t_{i+k})); RMSNorm_hnormᵏ(hᵏ⁻¹_i)]      (2·d_model → d_model)
        hᵏ_i  = Blockᵏ(h'ᵏ)_i                                                         (causal over i, positions i)
        P(t_{i+k+1}) = softmax(Head(RMSNorm_headᵏ(hᵏ_i)))

    h⁰ is the main model's last hidden state *before* its final norm (hnorm normalises it); Emb and Head are the
    main model's (shared); the concatenation puts the embedding first, as the released DeepSeek-V3 checkpoint's
    eh_proj [D, 2D] reads its input (vLLM / SGLang: cat(enorm(e), hnorm(h))). Each module's output norm is its own
    (HF `shared_head.norm`). The blocks are layers of the model's kind (MoE when the model has experts: DeepSeek-V3's
    MTP layer is an MoE layer), run by the same `block` function under the same `Parallel` context.

    enorm, hnorm, head_norm [D, d]; eh_proj [D, 2d, d]; blocks: `Blocks(layers=D)`, all on the `mtp_layers` axis
    (no mesh axis splits it: under a pipeline every stage holds the modules and runs them on the rows whose last
    hidden states it holds, beside the head). The blocks' MoE statistics are not reported (their correction bias,
    if any, keeps its value; no aux loss)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n, D = cfg.mtp_depth, cfg.d_model
        ones = Param((D,), ("norm",), "ones", decay=False)
        self.enorm = _param(rngs, ones, cfg, layers=n, axis="mtp_layers")
        self.hnorm = _param(rngs, ones, cfg, layers=n, axis="mtp_layers")
        self.eh_proj = _param(rngs, Param((2 * D, D), (None, "embed"), "normal"), cfg, layers=n, axis="mtp_layers")
        self.head_norm = _param(rngs, ones, cfg, layers=n, axis="mtp_layers")
        self.blocks = Blocks(cfg, rngs=rngs, layers=n, axis="mtp_layers")
        self.cfg = cfg

    def depth(self, k: int) -> tuple[dict[str, Array], dict[str, Array]]:
        """Module k's (0-based) own parameters {enorm, hnorm, eh_proj, head_norm} and its block's, unstacked."""
        own = {name: getattr(self, name)[...][k] for name in ("enorm", "hnorm", "eh_proj", "head_norm")}
        return own, jax.tree.map(lambda a: a[k], self.blocks.stacked())


def mtp_step(own: dict[str, Array], layer: dict[str, Array], h: Array, e: Array, positions: Array,
             mask: Array | None, cfg: ModelConfig, par: Parallel = SINGLE_DEVICE) -> Array:
    """One MTP module (`MTP`) before its head: the previous depth's hidden h and the embedding e of the tokens
    k ahead, both float32 [B, T(/t), D] → hᵏ [B, T(/t), D] float32. eh_proj is a weight every tensor rank holds
    whole, applied to this rank's tokens (no region: `par.dot`)."""
    u = jnp.concatenate([norm(e, par.replicated(own["enorm"]), None, cfg),
                         norm(h, par.replicated(own["hnorm"]), None, cfg)], -1)  # [B, T, 2D] compute dtype
    x = par.dot("btc,cd->btd", u, par.replicated(own["eh_proj"]), "head").astype(cfg.dtype).astype(jnp.float32)
    return block(layer, x, positions, mask, cfg, par)[0]


def mtp_targets(batch: Array, depth: int, segment_ids: Array | None = None) -> tuple[Array, Array, Array]:
    """The MTP modules' inputs and targets from rows batch int [B, T+1] (positions i = 0 … T-1 are the main model's
    inputs): → (tokens [n, B, T] — t_{i+k} for depth k = 1 … n, 0 past the row —, targets [n, B, T] — t_{i+k+1} —,
    valid bool [n, B, T]). A position is valid when its target exists (i+k+1 ≤ T: the last k positions of each row
    have none) and, with packed documents (segment_ids int [B, T+1], one id per document), lies in the same
    document as position i — so no target crosses a document boundary (the input t_{i+k} lies between them)."""
    B, T1 = batch.shape
    T = T1 - 1
    padded = jnp.pad(batch, ((0, 0), (0, depth)))  # [B, T+1+n]
    i = jnp.arange(T)
    tokens = jnp.stack([padded[:, k:k + T] for k in range(1, depth + 1)])
    targets = jnp.stack([padded[:, k + 1:k + 1 + T] for k in range(1, depth + 1)])
    valid = jnp.stack([jnp.broadcast_to(i + k + 1 <= T, (B, T)) for k in range(1, depth + 1)])
    if segment_ids is not None:
        seg = jnp.pad(segment_ids, ((0, 0), (0, depth)), constant_values=-1)
        valid &= jnp.stack([seg[:, k + 1:k + 1 + T] == seg[:, :T] for k in range(1, depth + 1)])
    return tokens, targets, valid


class Buffer(nnx.Variable):
    """Model state that is not a parameter: the step updates it from its statistics, outside the gradient.

    A buffer is stored, sharded, reordered and checkpointed exactly as a parameter is (it carries logical axes, and
    a layer's buffer is stacked on the leading `layers` axis with the layer's parameters), so it restores onto any
    layout and travels through `jaxpar convert`; but the optimizer never sees it (no gradient, no Adam moments, no
    weight decay: `trainable`), and each training step replaces it with `update_buffers(buffers, this step's
    per-layer statistics)`. Where a Hugging Face format has the tensor it is exported; where not (`expert_load`),
    an import starts it at its initial value.

    Kinds (`layer_buffers`): `expert_load` [L_moe, X] float32 (`moe.load_ema` > 0), the exponential moving average
    of each expert's share of its layer's routed assignments (1/X each when balanced); `e_score_correction_bias`
    [L_moe, X] float32 (`moe.correction_bias`), DeepSeek-V3's routing bias, which the forward reads (as a constant:
    `Blocks.stacked`) and `bias_update` moves (Hugging Face's mlp.gate.e_score_correction_bias)."""


MODEL_STATE = (nnx.Param, Buffer)  # what a checkpoint, a layout change and an export carry: `abstract_model`'s state


class BufferSpec(NamedTuple):
    """One layer's buffer: its shape and logical axes (without the stacked layer dim), the value it starts at, and
    whether the layer's forward reads it (as a constant: `Blocks.stacked` hands it to the layer beside the weights)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: float
    forward: bool = False


def layer_buffers(cfg: ModelConfig, moe: bool) -> dict[str, BufferSpec]:
    """The buffers one layer holds (an MoE layer when `moe`), by name."""
    out, X = {}, cfg.moe.n_experts
    if moe and cfg.moe.load_ema:
        out["expert_load"] = BufferSpec((X,), ("experts",), 1.0 / X)
    if moe and cfg.moe.correction_bias:
        # Replicated: every rank routes its tokens over all X experts (the router is replicated too), whatever
        # `expert` splits.
        out["e_score_correction_bias"] = BufferSpec((X,), (None,), 0.0, forward=True)
    return out


def forward_buffers(stack: dict, cfg: ModelConfig) -> dict[str, Array]:
    """Of one stack's buffers {name: Buffer or array [n, …]}, those its layers' forward reads, as constant arrays."""
    reads = {name for moe in (False, True) for name, spec in layer_buffers(cfg, moe).items() if spec.forward}
    return {name: jax.lax.stop_gradient(v[...]) for name, v in stack.items() if name in reads}


def update_buffers(buffers: nnx.State, stats: dict[str, Array], cfg: ModelConfig) -> nnx.State:
    """The step's update of the model's buffers (model layer order, canonical: `Plan.to_canonical`) from its MoE
    statistics summed over the step's rows, one row per MoE layer (each leaf [L_moe, …], model order).

    expert_load [L_moe, X] ← d·expert_load + (1 − d)·load / Σ_x load, d = moe.load_ema (a layer that routed
    nothing keeps its value); e_score_correction_bias [L_moe, X] by `bias_update` (moe.bias_update_rate > 0)."""
    buffers = jax.tree.map(lambda v: v, buffers)  # a new State; the caller's is left alone
    if "blocks" in buffers and "expert_load" in buffers["blocks"]:
        d = cfg.moe.load_ema
        load = stats["load"].astype(jnp.float32)  # [L_moe, X]
        total = load.sum(-1, keepdims=True)
        old = buffers["blocks"]["expert_load"][...]
        share = jnp.where(total > 0, load / jnp.maximum(total, 1.0), old)
        buffers["blocks"]["expert_load"] = buffers["blocks"]["expert_load"].replace(d * old + (1 - d) * share)
    if "blocks" in buffers and "e_score_correction_bias" in buffers["blocks"] and cfg.moe.bias_update_rate:
        new = bias_update(buffers["blocks"]["e_score_correction_bias"][...], stats["load"], cfg.moe.bias_update_rate,
                          cfg.moe.bias_recenter)
        buffers["blocks"]["e_score_correction_bias"] = buffers["blocks"]["e_score_correction_bias"].replace(new)
    return buffers


def bias_update(bias: Array, load: Array, rate: float, recenter: bool) -> Array:
    """DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2), one step: bias [L_moe, X] float32, load [L_moe, X] the
    step's assignments per expert (every row of the step, every microbatch and shard: global) →

        b_e ← b_e + γ·sign(mean_x load_x − load_e)     (then b ← b − mean_x b_x with `recenter`)

    an overloaded expert's bias falls and an underloaded one's rises, by γ whatever the size of the imbalance (an
    expert at exactly the mean keeps its bias). Float32 and elementwise per layer: the same bits at every layout."""
    load = load.astype(jnp.float32)
    bias = bias + jnp.float32(rate) * jnp.sign(load.mean(-1, keepdims=True) - load)
    return bias - bias.mean(-1, keepdims=True) if recenter else bias


def initial_buffers(abstract: nnx.State, cfg: ModelConfig) -> nnx.State:
    """The buffers of (abstract) model state `abstract` at their initial values, on the default device — where a
    model is built from weights alone (a Hugging Face import) its buffers start as a new model's do."""
    inits = {**layer_buffers(cfg, False), **layer_buffers(cfg, cfg.moe.enabled)}
    return jax.tree_util.tree_map_with_path(
        lambda path, v: v.replace(jnp.full(v.shape, inits[str(path[-1].key)].init, v.dtype)), buffers_of(abstract),
        is_leaf=lambda x: isinstance(x, nnx.Variable))


# Weights and buffers back into one model state (flax >= 0.11 deprecates State.merge for merge_state; older releases
# have only the former).
merge_state = getattr(nnx, "merge_state", None) or nnx.State.merge


def trainable(state: nnx.State) -> nnx.State:
    """The parameters of a model state (the weights a checkpoint or an export holds); `buffers_of` the rest."""
    return nnx.split_state(state, nnx.Param, ...)[0]


def _learns(path, v) -> bool:
    return isinstance(v, nnx.Param) and not getattr(v, "frozen", False)


def learnable(state: nnx.State) -> nnx.State:
    """The parameters that train (what is differentiated and what the optimizer updates): every parameter, or with
    LoRA adapters (`ModelConfig.lora`) the adapters alone — the rest carry `frozen` metadata (`frozen_of`)."""
    return nnx.split_state(state, _learns, ...)[0]


def frozen_of(state: nnx.State) -> nnx.State:
    """Everything in a model state that does not train: the frozen parameters and the buffers (`learnable`'s
    complement)."""
    return nnx.split_state(state, _learns, ...)[1]


def buffers_of(state: nnx.State) -> nnx.State:
    """The buffers of a model state (an empty State when the model has none)."""
    return nnx.split_state(state, nnx.Param, ...)[1]


Stacks = dict[str, dict[str, Array]]  # stack name (`ModelConfig.layer_stacks`) → its stacked parameters [n, …]


def layer_groups(pattern: tuple[str, ...], single: bool = False) -> list[tuple[tuple[str, ...], int]]:
    """Cut a run of layers — the stack each comes from, in order — into groups (period, count): `count` repeats of
    the stack sequence `period`, each group one scan whose body runs one period.

    The cut minimises the layers the program holds (Σ period lengths), then the number of groups: a uniform stack is
    one group of period 1, Qwen2-MoE's decoder_sparse_step 2 one group of period 2, DeepSeek's first dense layers two
    groups of period 1 — compile time grows with the number of distinct groups, not with depth. `single`: one group
    (the shortest period that covers the whole run), which the pipeline's tape needs (a chunk is one scan)."""
    n = len(pattern)
    if single:
        P = next(P for P in range(1, n + 1) if n % P == 0 and pattern == pattern[:P] * (n // P))
        return [(pattern[:P], n // P)]
    best: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * (n + 1)  # best[i] = (size, groups, P, count) from i on
    for i in range(n - 1, -1, -1):
        options = []
        for P in range(1, n - i + 1):
            count = 1
            while True:
                size, groups = best[i + count * P][:2]
                options.append((P + size, 1 + groups, P, count))
                if pattern[i + count * P:i + (count + 1) * P] != pattern[i:i + P]:
                    break
                count += 1
        best[i] = min(options)
    groups, i = [], 0
    while i < n:
        _, _, P, count = best[i]
        groups.append((pattern[i:i + P], count))
        i += P * count
    return groups


def _periods(a, start: int, count: int, n: int, derive):
    """Entries start … start + count·n of stack a [N, …] as the scan's input: [count, n, …] (n per period), or
    [count, …] as it is when a period holds one layer of the stack — a uniform stack scans its own array, as it
    did before stacks were grouped: the reshape would cost the backward pass a copy of the gradients per layer
    (XLA:CPU, measured with `activation_bytes_per_layer`). derive: `Parallel.derive`."""
    def cut(a):
        part = a[start:start + count * n]
        return derive(part if n == 1 else part.reshape(count, n, *part.shape[1:]), a)

    return jax.tree.map(cut, a)  # a `Quantized` matrix: its integers and scales alike


def _whole_layers(period: tuple[str, ...], derive):
    """take(stack, array, j) for a scan body over `_periods` slices: the array itself where the period holds one
    layer of the stack, else its entry j. derive: `Parallel.derive`."""
    single = {name for name in period if period.count(name) == 1}
    return lambda name, a, j: a if name in single else jax.tree.map(lambda x: derive(x[j], x), a)


def _group_inputs(stacks: Stacks, groups, derive):
    """Per group of `layer_groups`: (period, count, its first layer's index in the run, its scan input — each stack's
    entries of the group as `_periods` gives them: {stack: {param: [count(, n), …]}}). derive: `Parallel.derive`."""
    offsets, first = dict.fromkeys(stacks, 0), 0
    for period, count in groups:
        per = {name: period.count(name) for name in stacks if name in period}
        xs = {name: {k: _periods(a, offsets[name], count, n, derive) for k, a in stacks[name].items()}
              for name, n in per.items()}
        for name, n in per.items():
            offsets[name] += count * n
        yield period, count, first, xs
        first += count * len(period)


def _period_layers(period: tuple[str, ...], layers: dict, take):
    """A period's layers in order, one parameter dict each: the j-th layer of a stack is take(stack, array, j)."""
    seen = dict.fromkeys(layers, 0)
    for name in period:
        yield {k: take(name, a, seen[name]) for k, a in layers[name].items()}
        seen[name] += 1


def _stack_stats(parts: list[dict], axis_sizes: bool = False) -> dict:
    """MoE statistics of consecutive layers, one stack [n, …]: `parts` are single layers' ({} for a dense layer:
    skipped) or, with `axis_sizes`, stacks already ([n_i, …]: concatenated). {} when no layer is an MoE layer."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    join = jnp.concatenate if axis_sizes else jnp.stack
    return jax.tree.map(lambda *a: join(a), *parts)


def stats_total(stats: dict[str, Array]) -> dict[str, Array]:
    """Per-layer MoE statistics [L, …] summed over the layers (what the metrics log; {} stays {})."""
    return jax.tree.map(lambda a: a.sum(0), stats)


def run_layers(stacks: Stacks, x: Array, positions: Array, mask: Array | None | dict[int, Array | None],
               cfg: ModelConfig, *,
               remat: str = "none", par: Parallel = SINGLE_DEVICE, stats: bool = False,
               cache: dict[str, Array] | None = None, first_layer: int = 0, pages: Array | None = None):
    """Apply the layers of `stacks` in model order; `remat` checkpoints each layer. → x, or (x, the MoE layers'
    statistics, one row per MoE layer in model order: each leaf [L_moe, …]) with `stats` (an empty dict when no
    layer is an MoE layer; see `moe`; `stats_total` sums them).

    mask: every layer's, or per window {window: mask} where the layers' windows differ (`layer_masks`); each layer
    runs under `cfg.layer_config(its window)` (its RoPE too), None meaning the kernels' causal mask within it.

    cache (decoding: every layer of the model): `KVCache.arrays`, {name: [L, B, S, *slot]}. Model layer l's attention
    writes what row b's T new tokens leave in its cache (GQA: their keys and values) into slots positions[b, 0] …
    positions[b, 0]+T-1 of each array's entry l and attends over all S slots under `mask`; the written arrays follow
    x in the result. The cache rides in the scan's carry and each layer writes only its new slots (`write_rows`, in
    place): scanning it as inputs/outputs instead would copy every layer's whole cache out and back in on every
    decode step. With `pages` int32 [B, n] (a paged cache, `PagedKVCache`) the arrays are page pools
    [L, P, page, *slot] instead: slot i of row b lives in page pages[b, i // page] at offset i % page
    (`write_pages`), and the attention reads row b's n pages in order as its [S = n·page] slots (`read_pages`) —
    the same view a contiguous cache gives it, so no attention kind knows pages exist.

    stacks: {stack name: {param: [n_s, …]}} — every layer of the model (`Transformer.stacks`), or a pipeline chunk's
    share, whose dense / MoE pattern is that of the model's Σ n_s layers from `first_layer` on (the config checks
    that every chunk has the same; a pipeline's chunks start after the `prefix_layers`, which run beside the
    embedding: `first_layer` = cfg.prefix_layers). The run is cut into `layer_groups`, each a `jax.lax.scan` over
    its periods with each stack's slice viewed as [count, per-period, …]; `cfg.scan_unroll` periods per iteration.

    Each group runs through the context (`par.scan_layers`: one period per scan step, each layer checkpointed under
    `remat`), and is the whole run where the context asks for one (`par.one_group`: a pipeline chunk under a
    schedule table, whose tape runs the scan its own way — jaxpar.parallel.weightgrad). The statistics are those
    of the periods the context's scan reports ({} where it reports none).

    Why unroll: each scan iteration is a loop trip whose layer is cut off from its neighbours — XLA cannot fuse or
    schedule across the boundary, and every activation the backward needs is written into a stacked [n, …] buffer
    with a dynamic-update-slice and read back with a dynamic-slice. A few layers per trip remove most of that (on
    the tiny model's single-device step, about a quarter of its time) while the program still holds at most
    `scan_unroll` copies of the layer, whatever the depth. (Under sequence parallelism the plan sets it to 1:
    see `jaxpar.plan.make_plan`.)"""
    sizes = {name: jax.tree.leaves(params)[0].shape[0] for name, params in stacks.items()}
    run = slice(first_layer, first_layer + sum(sizes.values()))
    pattern = cfg.layer_pattern[run]
    if {name: pattern.count(name) for name in sizes} != sizes:
        raise ValueError(f"stacks of {sizes} layers are not the model's {len(pattern)} layers from layer "
                         f"{first_layer} on ({dict(zip(*np.unique(pattern, return_counts=True)))} of each kind)")
    if cache is not None and par.tape is not None:
        raise ValueError("a KV cache is for decoding, which runs no pipeline tape")
    # A layer's kind is its stack and its window (full layers among windowed ones: `cfg.layer_windows`); the periods
    # are cut from both, so each layer of a period runs its own window and RoPE, both static.
    kinds = tuple(zip(pattern, cfg.layer_windows[run]))
    groups = layer_groups(kinds, single=par.one_group)

    def layer_step(layer, carry, at, par, window):
        """One layer with `window` on the carry under `par` (the period's, see `body`): x, or (x, the cache's
        arrays) with the cache, of which it reads and writes model layer `at`."""
        lcfg = cfg.layer_config(window)
        lmask = mask[window] if isinstance(mask, dict) else mask
        if "lora_seed" in layer:  # LoRA dropout: this layer's masks (`layer_seeds`)
            layer = dict(layer)
            par = par.at_layer(layer.pop("lora_seed"))
        if cache is None:
            x, _, layer_stats = block(layer, carry, positions, lmask, lcfg, par)
            return x, layer_stats
        x, arrays = carry
        start = positions[:, 0]  # [B]: each row's first new slot (positions hold every new token: [B, T])

        def store(new):  # {name: the new tokens' [B, T, *slot]} → (the cache with them, layer `at`'s [B, S, *slot])
            if new.keys() != arrays.keys():
                raise ValueError(f"the attention wrote cache arrays {sorted(new)}; its kind declares {sorted(arrays)}")
            if pages is None:
                written = {name: write_rows(arrays[name], a, start, at) for name, a in new.items()}
                # Read back after the write: the next layer's write then depends on this read, so XLA can update the
                # carried cache in place (a read the write does not wait for would make it copy the whole cache
                # first).
                return written, {name: a[at] for name, a in written.items()}
            written = {name: write_pages(arrays[name], a, start, at, pages) for name, a in new.items()}
            return written, {name: read_pages(a, at, pages) for name, a in written.items()}

        x, written, layer_stats = block(layer, x, positions, lmask, lcfg, par, kv_cache=store)
        return (x, written), layer_stats

    def run_period(period, windows, layers, carry, par, layer_remat=None, first=None):
        """The period's layers in order → (carry, their MoE layers' statistics stacked [m, …]). layers: {stack:
        {param: [per, …]}}, its slice of `_group_inputs`; windows: each layer's; `first`: the period's first model
        layer (traced; with the cache). layer_remat: the checkpoint `par.scan_layers` puts on each layer, or None."""
        steps = {}
        for w in set(windows):
            steps[w] = functools.partial(layer_step, par=par, window=w)
            if layer_remat is not None:
                steps[w] = layer_remat(steps[w])
        per_layer = []
        for j, layer in enumerate(_period_layers(period, layers, _whole_layers(period, par.derive))):
            carry, layer_stats = steps[windows[j]](layer, carry, None if first is None else first + j)
            per_layer.append(layer_stats)
        return carry, _stack_stats(per_layer)

    checkpoint = None if remat == "none" else functools.partial(jax.checkpoint, policy=REMAT_POLICIES[remat])
    groups_stats = []
    carry = x if cache is None else (x, cache)
    stack_groups = [(tuple(name for name, _ in period), count) for period, count in groups]
    for (period, count, first, xs), (kind, _) in zip(_group_inputs(stacks, stack_groups, par.derive), groups):
        unroll = max(1, min(cfg.scan_unroll // len(period), count))

        def body(carry, xs, par, layer_remat, period=period, windows=tuple(w for _, w in kind), first=first):
            """One period (`par.scan_layers`): `par` is the period's context (the pipeline tape's, under a schedule
            table), not run_layers' own."""
            layers, i = xs if cache is not None else (xs, None)  # the cache's layers: the group's period i's
            at = None if i is None else first_layer + first + i * len(period)
            carry, period_stats = run_period(period, windows, layers, carry, par, layer_remat, at)
            return carry, period_stats if stats else None

        if cache is not None:
            xs = (xs, jnp.arange(count))
        carry, out = par.scan_layers(body, carry, xs, unroll=unroll, remat=checkpoint)
        # Per-period statistics come out stacked [count, m, …] (no carry to type under check_vma): the group's MoE
        # layers in model order, [count·m, …].
        groups_stats.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out) if out else {})
    layer_stats = _stack_stats(groups_stats, axis_sizes=True)
    if cache is not None:
        x, cache = carry
        return (x, cache, layer_stats) if stats else (x, cache)
    x = carry
    return (x, layer_stats) if stats else x


def write_rows(cache: Array, new: Array, start: Array, layer: Array | int) -> Array:
    """cache [L, B, S, …] with row b's new [B, T, …] written into slots start[b] … start[b]+T-1 of model layer
    `layer`: rows at different positions, one scatter that XLA runs in place on a carried buffer. Slots past S are
    dropped (a row's block must fit: start[b] + T ≤ S).

    The rows are the scatter's batching dimension (operand and indices alike), so each row's index is just its
    (layer, slot) and the partitioner keeps a batch split over devices as it is; `vmap` of a dynamic_update_slice
    gives the same scatter with the batch moved to the front, which transposes the whole cache around it."""
    slots = start[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)  # [B, T]
    index = jnp.stack([jnp.broadcast_to(layer, slots.shape).astype(jnp.int32), slots], -1)  # [B, T, 2]: (l, slot)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(2, new.ndim)), inserted_window_dims=(0, 2),
                                           scatter_dims_to_operand_dims=(0, 2), operand_batching_dims=(1,),
                                           scatter_indices_batching_dims=(0,))
    return jax.lax.scatter(cache, index, new.astype(cache.dtype), dims, indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def write_pages(pool: Array, new: Array, start: Array, layer: Array | int, pages: Array) -> Array:
    """A page pool [L, P, page, …] with row b's new [B, T, …] written at its positions start[b] … start[b]+T-1 of
    model layer `layer`: position i goes to page pages[b, i // page], offset i % page (pages int32 [B, n], the rows'
    block tables). Positions past a row's n pages are dropped (a chunk's padding beyond the pages it owns)."""
    page = pool.shape[2]
    slots = start[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)  # [B, T]
    entry = slots // page
    where = jnp.take_along_axis(pages, jnp.minimum(entry, pages.shape[1] - 1), axis=1)  # [B, T]: the page
    where = jnp.where(entry < pages.shape[1], where, pool.shape[1])  # out of range: dropped
    return pool.at[layer, where, slots % page].set(new.astype(pool.dtype), mode="drop")


def read_pages(pool: Array, layer: Array | int, pages: Array) -> Array:
    """Row b's pages pages[b, 0 … n-1] of model layer `layer`, in order: [B, n·page, …] — the row's positions
    0 … n·page-1, as a contiguous cache's row holds them. Only the rows' own pages are read."""
    got = pool[layer][pages]  # [B, n, page, …]
    return got.reshape(got.shape[0], got.shape[1] * got.shape[2], *got.shape[3:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """The decoding state of B rows of up to S slots: every layer's cache, as the model's attention kind lays it out
    (`AttentionKind.cache`, jaxpar.families.attention), and each row's length.

    arrays   {name: [L, B, S, *slot]} in the compute dtype — GQA's k and v [L, B, S, K, E], keys after RoPE: slot
             i of row b holds what its token at position i left there;
    lengths  [B] int32: the tokens each row holds, in slots 0 … lengths[b]-1. Rows need not be equally long: a step
             writes each row's new tokens at its own position (`write_rows`), and a query attends only to its row's
             slots up to its own position, so the slots past a row's length (a shorter prompt's padding, a previous
             longer sequence) are never read before a later token overwrites them.
    """

    arrays: dict[str, Array]
    lengths: Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, slots: int, tensor: int = 1) -> "KVCache":
        """Zeros for `batch` empty rows of `slots` slots, as one of `tensor` tensor-parallel ranks holds them (its
        share of the heads; default 1: the whole cache)."""
        arrays = {name: jnp.zeros((cfg.n_layers, batch, slots, *a.shape), cfg.dtype)
                  for name, a in attention_kind(cfg).cache(cfg, tensor).items()}
        return cls(arrays, jnp.zeros((batch,), jnp.int32))

    @property
    def slots(self) -> int:
        """S: the positions a row can hold."""
        return jax.tree.leaves(self.arrays)[0].shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """The decoding state of B rows in a pool of fixed-size pages (vLLM's PagedAttention layout): each layer's pool
    as the model's attention kind lays out a slot (`AttentionKind.cache`), each row's block table, and each row's
    length. A serving engine (`jaxpar.serve`) owns which page is whose; the model only reads and writes through the
    block tables.

    arrays   {name: [L, P, page, *slot]} in the compute dtype: page p holds `page` consecutive positions of the
             one sequence it belongs to (or of a prompt prefix several sequences share);
    pages    [B, n] int32: row b's positions i·page … (i+1)·page-1 live in page pages[b, i]. Entries past what a
             row holds may name any page (the engine points them at a page no sequence owns): positions past the
             row's length are never attended to, and a write to them only lands where the row's later tokens will
             overwrite it or no one reads;
    lengths  [B] int32, as `KVCache.lengths`.

    A row's n·page positions are its slots, S — the view attention gets (`read_pages`) is the contiguous cache's, so
    the logits are a contiguous cache's of S slots."""

    arrays: dict[str, Array]
    pages: Array
    lengths: Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, n_pages: int, page_size: int, pages_per_row: int,
              tensor: int = 1) -> "PagedKVCache":
        """A zero pool of n_pages pages of page_size positions, and `batch` empty rows of pages_per_row pages each
        (all pointing at page 0), as one of `tensor` tensor-parallel ranks holds them."""
        arrays = {name: jnp.zeros((cfg.n_layers, n_pages, page_size, *a.shape), cfg.dtype)
                  for name, a in attention_kind(cfg).cache(cfg, tensor).items()}
        return cls(arrays, jnp.zeros((batch, pages_per_row), jnp.int32), jnp.zeros((batch,), jnp.int32))

    @property
    def slots(self) -> int:
        """S = pages per row × page size: the positions a row can hold."""
        return self.pages.shape[1] * jax.tree.leaves(self.arrays)[0].shape[2]


class Transformer(nnx.Module):
    """Token ids [B, T] → logits [B, T, V] (float32).

    padded_vocab: rows of the embedding (and columns of the head), ≥ vocab_size. The extra rows are zeros and their
    logits are masked to NEG_INF, so the model computes exactly what the unpadded one does; tensor parallelism pads
    the vocab to a multiple of the tensor degree.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, padded_vocab: int | None = None):
        V, D, fam = cfg.vocab_size, cfg.d_model, family(cfg)
        self.padded_vocab = Vp = padded_vocab or V
        # Random rows for the real vocab first, then zero rows: the real rows get the same values at any padding.
        self.embed = _param(rngs, Param((V, D), ("vocab", "embed"), "normal", role="embedding"), cfg,
                            pad=((0, Vp - V), (0, 0)))
        if fam.positions == "learned":
            self.pos_embed = _param(rngs, Param((cfg.max_seq_len, D), (None, "embed"), "half"), cfg)
        stacks = cfg.layer_stacks
        self.blocks = Blocks(cfg, rngs=rngs, layers=len(stacks["blocks"]))
        if "dense_blocks" in stacks:  # a mixed dense / MoE model: its dense layers
            self.dense_blocks = Blocks(cfg, rngs=rngs, moe=False, layers=len(stacks["dense_blocks"]),
                                       axis="prefix_layers" if cfg.prefix_layers else "layers")
        self.final_norm = _param(rngs, Param((D,), ("norm",), fam.norm_init, decay=False), cfg)
        if fam.norm == "layer":
            self.final_norm_b = _param(rngs, Param((D,), ("norm",), "zeros", decay=False), cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, Param((D, V), ("embed", "vocab"), "normal", role="head"), cfg,
                                  pad=((0, 0), (0, Vp - V)))
        if cfg.mtp_depth:  # drawn last: a model's other values are the same with MTP on or off
            self.mtp = MTP(cfg, rngs=rngs)
        self.cfg = cfg

    def __call__(self, tokens: Array, *, positions: Array | None = None, segment_ids: Array | None = None,
                 remat: str = "none", par: Parallel = SINGLE_DEVICE, stats: bool = False,
                 mtp_tokens: Array | None = None, hidden: bool = False):
        """tokens int [B, T]; positions [B, T] (default 0..T-1); segment_ids [B, T]: attend only within a segment.

        Returns float32 logits [B, T, V_local]: the whole (padded) vocab on one device, this rank's vocab shard under
        tensor parallelism (the loss is then `par.cross_entropy`); with `stats`, (logits, the MoE layers'
        statistics summed over the rows, one row per MoE layer [L_moe, …] — `moe`, `run_layers`).

        mtp_tokens int [n, B, T] (n = cfg.mtp_depth; `mtp_targets`): depth k's input tokens t_{i+k} at position i;
        the result then gains an entry, the MTP modules' float32 logits [n, B, T, V_local] (`MTP`). hidden: a last
        entry, the last hidden states [B, T(/t), D] float32 before the final norm (what the MTP modules read).
        """
        B, T = tokens.shape
        if positions is None:
            positions = default_positions(B, T)
        x = self.embed_tokens(tokens, positions, par)
        mask = layer_masks(self.cfg, functools.partial(par.attention_mask, T, segment_ids))
        stacks = self.stacks() if par.noise is None else layer_seeds(self.stacks())  # LoRA dropout: layer seeds
        x, layer_stats = run_layers(stacks, x, positions, mask, self.cfg, remat=remat, par=par, stats=True)
        out = (self.logits(x, par), layer_stats) if stats else (self.logits(x, par),)
        if mtp_tokens is not None:
            out = (*out, self.mtp_logits(x, mtp_tokens, positions, mask, remat=remat, par=par))
        if hidden:
            out = (*out, x)
        return out if len(out) > 1 else out[0]

    def mtp_logits(self, h: Array, mtp_tokens: Array, positions: Array, mask: Array | None, *, remat: str = "none",
                   par: Parallel = SINGLE_DEVICE) -> Array:
        """The MTP modules in sequence from the main model's last hidden state h [B, T(/t), D] (before the final
        norm) and their input tokens mtp_tokens [n, B, T] → float32 logits [n, B, T, V_local]. `remat` checkpoints
        each module's block as `run_layers` does a layer's."""
        cfg = self.cfg
        if not hasattr(self, "mtp"):
            raise ValueError("mtp_tokens given, and the model has no MTP modules (model.mtp_depth = 0)")
        step = functools.partial(mtp_step, cfg=cfg, par=par)
        if remat != "none":
            step = jax.checkpoint(step, policy=REMAT_POLICIES[remat])
        out = []
        for k in range(mtp_tokens.shape[0]):
            own, layer = self.mtp.depth(k)
            h = step(own, layer, h, self.embed_tokens(mtp_tokens[k], positions, par), positions, mask)
            out.append(self.logits(h, par, scale=own["head_norm"]))
        return jnp.stack(out)

    def decode(self, tokens: Array, cache: KVCache | PagedKVCache, par: Parallel = SINGLE_DEVICE, *,
               positions: Array | None = None, counts: Array | None = None, hidden: bool = False
               ) -> tuple[Array, KVCache | PagedKVCache]:
        """Run the next T tokens of every row against `cache` (prefill: the right-padded prompts; decode: T = 1).

        Row b's tokens int [B, T] sit at positions[b] … positions[b]+T-1 (default `cache.lengths`: after what the
        row holds) and go to those slots; each attends to its row's slots at or before its own position (within
        the sliding window), so rows at different positions share the step. counts [B]: the real tokens among a
        row's T (a right-padded prompt; default T) — the row's length becomes positions + counts, and its padding's
        slots are overwritten by the tokens that follow. Needs positions[b] + T ≤ S.

        Returns float32 logits [B, T, V] (V_local: this rank's vocab shard under tensor parallelism, `par`, whose
        cache holds its local kv heads) and the cache with the new keys and values written — with `hidden`, then
        the last hidden states [B, T(/t), D] float32 before the final norm (`MTP`'s h⁰). Each step's matmuls
        cost O(T), independent of how full the cache is; attention reads the whole cache, masked.
        """
        T, S = tokens.shape[1], cache.slots
        start = cache.lengths if positions is None else jnp.asarray(positions, jnp.int32)  # [B]
        pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]: the new tokens' positions, and slots
        q, k = pos[:, :, None], jnp.arange(S, dtype=jnp.int32)[None, None, :]  # query / key positions

        def decode_mask(window):  # [B, 1, T, S]: earlier tokens of the row and itself (within the window); later
            keep = k <= q  # slots are stale or padding
            return (keep & (q - k < window) if window else keep)[:, None]

        x = self.embed_tokens(tokens, pos, par)
        x, arrays = run_layers(self.stacks(), x, pos, layer_masks(self.cfg, decode_mask), self.cfg, par=par,
                               cache=cache.arrays,
                               pages=getattr(cache, "pages", None))
        lengths = start + (T if counts is None else jnp.asarray(counts, jnp.int32))
        cache = dataclasses.replace(cache, arrays=arrays, lengths=lengths)
        if hidden:  # the last hidden states too (before the final norm): what the MTP modules read
            return self.logits(x, par), cache, x
        return self.logits(x, par), cache

    def stacks(self) -> Stacks:
        """The layer stacks' parameters by stack name (`ModelConfig.layer_stacks`), each [n, …]."""
        return {name: getattr(self, name).stacked() for name in self.cfg.layer_stacks}

    def embed_tokens(self, tokens: Array, positions: Array, par: Parallel = SINGLE_DEVICE) -> Array:
        """tokens [B, T] → residual stream [B, T, D] float32 ([B, T/t, D] under sequence parallelism)."""
        cfg = self.cfg
        x = par.embed(self.embed[...], tokens, cfg.dtype)
        if family(cfg).embed_scale:  # Gemma: the embedding times √d_model (in float32; HF rounds it to the dtype)
            x = x * np.float32(math.sqrt(cfg.d_model))
        if hasattr(self, "pos_embed"):  # learned positions (gpt2)
            pos = jnp.take(par.replicated(self.pos_embed[...]), par.seq_shard(positions), axis=0)
            x = x + pos.astype(jnp.float32)
        return constrain(x, ("batch", "seq", "embed"))

    def logits(self, x: Array, par: Parallel = SINGLE_DEVICE, scale: Array | None = None) -> Array:
        """Final norm and LM head: [B, T(/t), D] → float32 logits [B, T, V_local], padded vocab masked. scale: the
        norm's scale instead of the final norm's (an MTP module's own output norm, through the shared head)."""
        cfg = self.cfg
        bias = self.final_norm_b[...] if hasattr(self, "final_norm_b") else None
        scale = self.final_norm[...] if scale is None else scale
        x = norm(x, par.replicated(scale), _maybe(par.replicated, bias), cfg)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]  # [D, V_local]
        (logits,) = par.column(x, (head,), ("btd,dv->btv",), "head")  # [B, T, V_local] float32
        if self.padded_vocab != cfg.vocab_size:
            logits = jnp.where(par.vocab_ids(logits.shape[-1]) < cfg.vocab_size, logits, NEG_INF)
        return constrain(logits, ("batch", "seq", "vocab"))


# -----------------------------------------------------------------------------------------------------------------
# The math of one layer, as plain functions of (per-layer parameter dict, activations).


def _maybe(fn, x):
    return None if x is None else fn(x)


def block(p: dict[str, Array], x: Array, positions: Array, mask: Array | None, cfg: ModelConfig,
          par: Parallel = SINGLE_DEVICE, kv_cache: Callable | None = None) -> tuple[Array, object, dict[str, Array]]:
    """One pre-norm transformer block. p holds one layer's parameters (no leading L); x [B, T, D] float32
    ([B, T/t, D] under sequence parallelism: norms and residual adds run on sequence shards).

    kv_cache: the cache's store when decoding (`gqa_attention`). Returns (x, what the store returned as the cache, or
    None; the MoE layer's statistics (`moe`; {} for a dense MLP))."""
    h = checkpoint_name(norm(x, par.replicated(p["attn_norm"]), _maybe(par.replicated, p.get("attn_norm_b")), cfg),
                        "attn_in")
    a, kv = ATTENTION[family(cfg).attention](p, h, positions, mask, cfg, par, kv_cache)
    if "post_attn_norm" in p:  # Gemma: the attention's output normalised before the residual add (per token: any
        a = norm(a, par.replicated(p["post_attn_norm"]), None, cfg).astype(jnp.float32)  # sequence split)
    x = constrain(x + checkpoint_name(a, "attn_out"), ("batch", "seq", "embed"))
    h = checkpoint_name(norm(x, par.replicated(p["mlp_norm"]), _maybe(par.replicated, p.get("mlp_norm_b")), cfg),
                        "mlp_in")
    out, stats = moe(p, h, cfg, par) if "router" in p else (mlp(p, h, cfg, par), {})
    if "post_mlp_norm" in p:
        out = norm(out, par.replicated(p["post_mlp_norm"]), None, cfg).astype(jnp.float32)
    return constrain(x + checkpoint_name(out, "mlp_out"), ("batch", "seq", "embed")), kv, stats


def norm(x: Array, scale: Array, bias: Array | None, cfg: ModelConfig) -> Array:
    """The family's norm in float32 → compute dtype: RMSNorm ('rms'; 'rms_offset' multiplies by 1 + scale, Gemma's),
    or LayerNorm ('layer': centred first, and a bias), over x's last dim: x [B, T, D] (or [B, T, H, E] per head: the
    q/k norm)."""
    kind, x, scale = family(cfg).norm, x.astype(jnp.float32), scale.astype(jnp.float32)
    if kind == "layer":
        x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * (1.0 + scale if kind == "rms_offset"
                                                                             else scale)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(cfg.dtype)


def gqa_attention(p: dict[str, Array], h: Array, positions: Array, mask: Array | None, cfg: ModelConfig,
                  par: Parallel = SINGLE_DEVICE, kv_cache: Callable | None = None) -> tuple[Array, object]:
    """Causal self-attention with GQA (the attention kind `gqa`, jaxpar.families.attention). h [B, T, D] (compute
    dtype) → ([B, T, D] float32, the cache or None).

    Query head n belongs to kv group n // G (Hugging Face's `repeat_kv` order), so a contiguous slice of query heads
    and the matching slice of kv heads form a self-contained tensor-parallel shard. QKV is column-parallel (local
    heads), the output projection row-parallel. With `kv_cache` — the store `run_layers` hands every attention kind:
    store({name: the new tokens' [B, T, *slot]}) → (the cache with them written, this layer's {name: [B, S, *slot]})
    for the arrays the kind's cache declares, here k and v [·, K, E] — the queries attend over the layer's S slots
    under `mask` and the cache comes back beside the output.
    """
    dt = cfg.dtype
    wk, wv = par.kv_weight(p["wk"]), par.kv_weight(p["wv"])
    q, k, v = par.column(h, (p["wq"], wk, wv), ("btd,dhe->bthe", "bsd,dke->bske", "bsd,dke->bske"), "attention")
    q, k, v = q.astype(dt), par.kv_output(k, "attention").astype(dt), par.kv_output(v, "attention").astype(dt)
    # q [B, T, H, E]; k, v [B, S, K, E] (local heads under tensor parallelism; S = T, the full sequence)
    if "bq" in p:  # gpt2, and the llama family with qkv_bias (Qwen2)
        bk, bv = par.kv_weight(p["bk"]), par.kv_weight(p["bv"])
        q, k, v = q + p["bq"].astype(dt), k + bk.astype(dt), v + bv.astype(dt)
    if "q_norm" in p:  # Qwen3: RMSNorm over each head's E dims, before RoPE (head_dim is never split: any layout)
        q, k = norm(q, par.replicated(p["q_norm"]), None, cfg), norm(k, par.replicated(p["k_norm"]), None, cfg)
    if family(cfg).positions == "rope":  # (YaRN's attention factor scales cos and sin: gpt-oss)
        inv_freq, factor = rope_frequencies(q.shape[-1], cfg), rope_attention_factor(cfg)
        q, k = rope(q, positions, inv_freq, scale=factor), rope(k, positions, inv_freq, scale=factor)
    q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "head_dim")), "q")
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "k")
    v = checkpoint_name(v, "v")
    new_cache = None
    if kv_cache is not None:
        new_cache, layer = kv_cache({"k": k, "v": v})
        k, v = layer["k"], layer["v"]  # [B, S, K, E]: the layer's cache, the new slots written
    # sinks [H] (the local heads; gpt-oss): the kernel's, or ring attention's, extra softmax logit per head
    if cfg.query_pre_attn_scalar:  # Gemma: scores scaled by 1/√s, not the kernels' 1/√E — q·√(E/s) before them
        q = q * np.float32(math.sqrt(q.shape[-1] / cfg.query_pre_attn_scalar)).astype(q.dtype)
    o = checkpoint_name(par.attention(functools.partial(attend, cfg=cfg), q, k, v, mask, sinks=p.get("sinks"),
                                      window=cfg.sliding_window), "context")  # [B, T, H, E]
    out = par.row(o, p["wo"], "bthe,hed->btd", "attention")  # [B, T, D] float32 ([B, T/t, D] under SP)
    if "bo" in p:
        out = out + par.replicated(p["bo"]).astype(jnp.float32)
    return out, new_cache


def mla_attention(p: dict[str, Array], h: Array, positions: Array, mask: Array | None, cfg: ModelConfig,
                  par: Parallel = SINGLE_DEVICE, kv_cache: Callable | None = None) -> tuple[Array, object]:
    """Multi-head latent attention (DeepSeek-V2 §2.1; the attention kind `mla`). h [B, T, D] (compute dtype) →
    ([B, T, D] float32, the cache or None). Letters: r kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim,
    Eqk = N + R, Ev v_head_dim; H the local heads (wkv_b.shape[-2]).

        q = h·wq, or RMSNorm(h·wq_a)·wq_b                       [B, T, H, Eqk] = [q_nope N | q_rope R]
        [c | k_r] = h·wkv_a;  c ← RMSNorm(c)                    the latent [B, S, r], the shared rope key [B, S, R]
        [k_nope | v] = c·wkv_b                                  [B, S, H, N], [B, S, H, Ev]
        q_rope, k_r ← RoPE (pairs (2i, 2i+1) when rope_interleave; YaRN frequencies and cos/sin factor)
        o = softmax(scale · (q_nope·k_nopeᵀ + q_rope·k_rᵀ) + mask) · v;  out = o·wo
        scale = Eqk^-0.5 · mscale², mscale = 0.1·rope_mscale_all_dim·ln(rope_factor) + 1 under YaRN with
        rope_mscale_all_dim ≠ 0, else 1 (`mla_softmax_scale`, as transformers' DeepSeek V2/V3)

    Tensor parallelism splits the heads. The down-projections wq_a and wkv_a (and their norms) are replicated:
    every rank computes them for its tokens outside any region, like the MoE router (`par.dot`), and only their
    narrow outputs enter the head-split region — the query latent and the kv latent through `par.column` with
    wq_b / wkv_b, the rope key through `par.enter` — so the region's entry moves r (+ rq, + R) values a token
    instead of D: under sequence parallelism the all-gathers carry B·T·(rq + r + R) elements a layer (GQA's
    B·T·D, with rq → D when queries are projected directly), and their backward reduce-scatters as many. (Pushing
    a replicated weight's matmul through `column` instead would be wrong: f's backward would sum t identical
    copies of its gradient.)

    Training (no cache) runs the expanded form through `par.attention`, so context parallelism gathers or rings the
    per-head keys and values like GQA's (K = H). The kernels take q, k, v of one width and scale by its -½
    power: v is zero-padded to Eqk (or q, k to Ev when Ev > Eqk — zeros add nothing to a score) and the context
    sliced back, and the softmax scale is folded into q (q · scale · √width), so every kernel's 1/√width gives
    the DeepSeek scale.

    Decoding (kv_cache: `run_layers`' store) caches per token the normalised latent c [r] and the rotated rope key
    [R] — the same on every tensor rank — and attends in the absorbed form (§2.1.2): W_UK (wkv_b's key part) is
    folded into the query, q_nope·W_UK → [B, T, H, r], scored against the cached latents beside q_rope·k_rᵀ; the
    context stays in latent space (probs·c [B, T, H, r]) until W_UV (wkv_b's value part) lifts it to Ev, then wo.
    The same numbers as the expanded form, without ever expanding the cache to per-head keys and values.
    """
    dt = cfg.dtype
    r, R, N = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    if "wq_a" in p:  # the low-rank query path (V2, V3): its latent is replicated, wq_b splits heads
        cq = norm(par.dot("btd,dr->btr", h, p["wq_a"], "attention"), par.replicated(p["q_a_norm"]), None, cfg)
        (q,) = par.column(cq, (p["wq_b"],), ("btr,rhe->bthe",), "attention")
    else:  # V2-Lite: queries straight from the stream
        (q,) = par.column(h, (p["wq"],), ("btd,dhe->bthe",), "attention")
    q = q.astype(dt)  # [B, T, H, Eqk] (full sequence, local heads)
    kv = par.dot("btd,dc->btc", h, p["wkv_a"], "attention")  # [B, T, r + R] float32 (T/t under SP), replicated
    latent = norm(kv[..., :r], par.replicated(p["kv_a_norm"]), None, cfg)  # [B, T, r] compute dtype
    k_rope = kv[..., r:].astype(dt)  # [B, T, R], before RoPE
    inv_freq, factor = rope_frequencies(R, cfg), rope_attention_factor(cfg)
    rotate = functools.partial(rope, positions=positions, inv_freq=inv_freq, interleave=cfg.rope_interleave,
                               scale=factor)
    q_nope, q_rope = q[..., :N], rotate(q[..., N:])
    scale = mla_softmax_scale(cfg)

    if kv_cache is not None:
        # The new tokens' latents and rope keys, whole on every tensor rank (`par.whole`: under a sequence-parallel
        # prefill the shards are summed into place, typed as the replicated cache they go to).
        new_cache, layer = kv_cache({"latent": par.whole(latent),
                                     "k_rope": rotate(par.whole(k_rope)[:, :, None, :])[:, :, 0]})
        c, k_r = layer["latent"], layer["k_rope"]  # [B, S, r], [B, S, R]: the layer's cache, new slots written
        w = par.policy("attention").operand(p["wkv_b"], dt)  # [r, H, N + Ev] (local heads)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., :N], preferred_element_type=jnp.float32).astype(dt)
        scores = (jnp.einsum("bthr,bsr->bhts", q_lat, c, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthe,bse->bhts", q_rope, k_r, preferred_element_type=jnp.float32)) * scale
        if mask is None:  # causal over T == S
            mask = (jnp.arange(scores.shape[-1])[None, :] <= jnp.arange(scores.shape[-2])[:, None])[None, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)  # [B, H, T, S] float32
        ctx = jnp.einsum("bhts,bsr->bthr", probs.astype(dt), c, preferred_element_type=jnp.float32).astype(dt)
        o = jnp.einsum("bthr,rhv->bthv", ctx, w[..., N:], preferred_element_type=jnp.float32).astype(dt)
        o = checkpoint_name(o, "context")  # [B, T, H, Ev]
        return par.row(o, p["wo"], "bthe,hed->btd", "attention"), new_cache

    (kvb,) = par.column(latent, (p["wkv_b"],), ("bsr,rhe->bshe",), "attention")  # [B, S, H, N + Ev] float32
    k_nope, v = kvb[..., :N].astype(dt), kvb[..., N:].astype(dt)
    k_r = rotate(par.enter(k_rope)[:, :, None, :])  # [B, S, 1, R]: the shared rope key, entering the region
    H, Ev = q.shape[-2], v.shape[-1]
    width = max(N + R, Ev)
    q = jnp.concatenate([q_nope, q_rope], -1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_r, (*k_r.shape[:2], H, R))], -1)
    fold = scale * math.sqrt(width)  # the kernel divides by √width: q carries the rest of the DeepSeek scale
    q = q if fold == 1.0 else (q.astype(jnp.float32) * fold).astype(dt)
    def pad(x):  # zeros to `width`: no score, no output (concatenated: jnp.pad would keep its scalar for the backward)
        extra = width - x.shape[-1]
        return x if not extra else jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], -1)

    q = checkpoint_name(constrain(pad(q), ("batch", "seq", "heads", "head_dim")), "q")
    k = checkpoint_name(constrain(pad(k), ("batch", "seq", "heads", "head_dim")), "k")
    v = checkpoint_name(pad(v), "v")
    o = par.attention(functools.partial(attend, cfg=cfg), q, k, v, mask)[..., :Ev]  # [B, T, H, Ev]
    o = checkpoint_name(o, "context")
    return par.row(o, p["wo"], "bthe,hed->btd", "attention"), None


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale as transformers' DeepSeek V2/V3 compute it: Eqk^-0.5, times mscale² under YaRN with
    rope_mscale_all_dim ≠ 0, mscale = 0.1·rope_mscale_all_dim·ln(rope_factor) + 1 (rope_factor > 1)."""
    scale = cfg.head_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        m = _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        scale = scale * m * m
    return scale


def _yarn_mscale(factor: float, coef: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * coef * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor RoPE's cos and sin are multiplied by (transformers' `attention_factor`): 1, or under YaRN
    mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) when both coefficients are non-zero, else
    0.1·ln(factor) + 1 (DeepSeek sets both coefficients equal: 1; rope_mscale 0 is transformers' absent key)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f = cfg.rope_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(_yarn_mscale(f, cfg.rope_mscale) / _yarn_mscale(f, cfg.rope_mscale_all_dim))
    return _yarn_mscale(f)


# Attention kind (`Family.attention`, jaxpar.families.attention.ATTENTION_KINDS) → its layer function, fn(p, h,
# positions, mask, cfg, par, kv_cache) → ([B, T, D] float32, the cache or None); `block` calls it.
ATTENTION = {"gqa": gqa_attention, "mla": mla_attention}


def attend(q: Array, k: Array, v: Array, mask: Array | None, cfg: ModelConfig, sinks: Array | None = None) -> Array:
    """softmax(q·kᵀ/√E + mask) v for GQA, through `jax.nn.dot_product_attention` (XLA or cuDNN flash attention).

    q [B, T, H, E]; k, v [B, S, K, E] with K dividing H (query head n reads kv head n // (H/K)); → [B, T, H, E].
    mask None: causal with T == S (query t sees keys s ≤ t), within `cfg.sliding_window` when set — the kernels
    then skip the masked blocks instead of reading a mask. Otherwise a bool [B|1, 1, T, S] mask saying which keys
    each query sees (segments, decoding). Logits and softmax run in float32 (the kernels accumulate in float32).

    sinks [H] (gpt-oss's attention sinks): head n's softmax runs over its scores and one more logit, sinks[n],
    whose weight goes to no value — o = Σ_s e^{z_s − m} v_s / (Σ_s e^{z_s − m} + e^{sink − m}), m the largest of
    them — so a query may attend to nothing. `dot_product_attention` has no such term: `attend_with_sinks`.
    """
    if sinks is not None:
        return attend_with_sinks(q, k, v, mask, cfg, sinks)
    impl = "xla" if cfg.attention == "auto" else cfg.attention
    if mask is None:
        window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else None  # (left, right): W keys, itself included
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window, implementation=impl)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)


def attend_with_sinks(q: Array, k: Array, v: Array, mask: Array | None, cfg: ModelConfig, sinks: Array) -> Array:
    """`attend` with attention sinks, written out: scores [B, K, G, T, S] in float32 (G = H/K query heads a kv head
    serves), the mask (None: causal, within the sliding window), the softmax over the scores and the head's sink,
    the sink's share dropped. → [B, T, H, E] in q's dtype."""
    B, T, H, E = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    z = jnp.einsum("btkge,bske->bkgts", q.reshape(B, T, K, G, E), k,
                   preferred_element_type=jnp.float32) * (E ** -0.5)
    if mask is None:
        i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
        keep = (j <= i) & ((i - j < cfg.sliding_window) if cfg.sliding_window else True)  # [T, S]
    else:
        keep = mask[:, :, None]  # [B|1, 1, 1, T, S]
    z = jnp.where(keep, z, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G, 1, 1), (B, K, G, T, 1))
    m = jnp.maximum(z.max(-1, keepdims=True), sink)  # finite: the sink is, even where a row sees no key
    w = jnp.exp(z - m)
    probs = w / (w.sum(-1, keepdims=True) + jnp.exp(sink - m))
    o = jnp.einsum("bkgts,bske->btkge", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, E).astype(q.dtype)


def mlp(p: dict[str, Array], h: Array, cfg: ModelConfig, par: Parallel = SINGLE_DEVICE) -> Array:
    """The family's MLP: up (and gate) column-parallel, its activation local, down row-parallel.
    h [B, T, D] (compute dtype) → [B, T, D] float32."""
    act = ACTIVATIONS[family(cfg).mlp](p, h, cfg, par)  # [B, T, F] (F/t local), compute dtype
    act = constrain(act, ("batch", "seq", "mlp"))
    out = par.row(act, p["w_down"], "btf,fd->btd", "mlp")
    if "b_down" in p:
        out = out + par.replicated(p["b_down"]).astype(jnp.float32)
    return out


def moe(p: dict[str, Array], h: Array, cfg: ModelConfig, par: Parallel = SINGLE_DEVICE
        ) -> tuple[Array, dict[str, Array]]:
    """A mixture of SwiGLU experts in place of the MLP (Mixtral, Qwen2-MoE; jaxpar.parallel.expert has the math).
    h [B, T, D] (compute dtype) → ([B, T, D] float32, statistics):

        Σ_j g_j · SwiGLU_{e_j}(h)  [+ sigmoid(h·ws_score) ·] SharedSwiGLU(h)

    router [D, X]; we_gate, we_up [X, D, F_e]; we_down [X, F_e, D] (X/ep local experts, F_e/t local columns);
    ws_* the shared expert; e_score_correction_bias [X] float32 (a buffer, moe.correction_bias) the bias the
    experts are chosen by (DeepSeek-V3). Statistics, summed over the B rows: `aux` (load-balancing loss) and `z`
    (z-loss), which the step adds to the objective (`moe_objective`), `load` [X] (assignments per expert) and
    `dropped`."""
    m = cfg.moe
    logits = par.dot("btd,dx->btx", h, p["router"], "router")  # [B, T, X] float32 (T/t under SP)
    if "router_b" in p:  # gpt-oss
        logits = logits + par.replicated(p["router_b"]).astype(jnp.float32)
    bias = p.get("e_score_correction_bias")  # [X] float32 model state (moe.correction_bias): a constant here
    routing = par.route(logits, m.top_k, m.norm_topk_prob, m.capacity_factor, scoring=m.scoring, n_group=m.n_group,
                        topk_group=m.topk_group, routed_scale=m.routed_scale,
                        bias=None if bias is None else jax.lax.stop_gradient(bias))
    ffn = functools.partial(grouped_swiglu, dot=par.policy("experts"), dtype=cfg.dtype, limit=m.swiglu_limit,
                            alpha=m.swiglu_alpha, split=None if par.tensor is None else par.tensor.axis)
    weights = (p["we_gate"], p["we_up"], p["we_down"])
    if "we_gate_b" in p:  # the gate and up biases ride with their matrices into the experts' region (split alike)
        weights += (p["we_gate_b"], p["we_up_b"])
    out = par.experts(h, routing, weights, ffn, m.capacity_factor)
    if "we_down_b" in p:
        # Σ_j g_j·(FFN_j(h) + b_j) = Σ_j g_j·FFN_j(h) + Σ_j g_j·b_j: the down bias is added here, from the routing,
        # once — inside the region every tensor rank's partial sum would carry it, and the expert ranks hold others'
        gates = jnp.where(routing.keep, routing.gates, 0.0)  # [B, T, k] (T/t under SP: this rank's tokens)
        b = par.replicated(p["we_down_b"]).astype(jnp.float32)  # [X, D]
        out = out + jnp.einsum("btk,btkd->btd", gates, b[routing.experts])
    if "ws_gate" in p:  # the shared expert: a dense SwiGLU every token passes
        gate, up = par.column(h, (p["ws_gate"], p["ws_up"]), ("btd,df->btf", "btd,df->btf"), "mlp")
        shared = par.row((jax.nn.silu(gate) * up).astype(cfg.dtype), p["ws_down"], "btf,fd->btd", "mlp")
        if "ws_score" in p:
            shared = shared * jax.nn.sigmoid(par.dot("btd,d->bt", h, p["ws_score"], "router"))[..., None]
        out = out + shared
    stats = dict(aux=routing.aux, z=routing.z, load=routing.load.sum(0), dropped=routing.dropped)  # whole rows
    return out, stats


def moe_objective(stats: dict[str, Array], cfg: ModelConfig, rows: int) -> Array:
    """What the MoE layers add to the training objective, from their statistics summed over `rows` rows (one layer's,
    or per layer [L_moe, …]: summed over them): coef × the mean over rows and MoE layers of the load-balancing loss
    and of the z-loss (0 when dense)."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    m = cfg.moe
    return (m.aux_loss_coef * stats["aux"].sum() + m.z_loss_coef * stats["z"].sum()) / (rows * cfg.moe_layer_count)


def grouped_swiglu(rows: Array, group_sizes: Array, weights, *, dot, dtype, limit: float = 0.0,
                   alpha: float = 1.702, split: str | None = None) -> Array:
    """The experts' SwiGLU on rows sorted by expert: rows [M, D] (compute dtype), group_sizes [X] (rows of each
    expert, in order; the rest are padding), weights (we_gate, we_up [X, D, F], we_down [X, F, D][, we_gate_b,
    we_up_b [X, F]: each row's expert's bias added to its gate and up]) → [M, D] float32.

    limit > 0: gpt-oss's clamped SwiGLU, (clip(up, −limit, limit) + 1) · g · σ(alpha · g) with g = min(gate, limit)
    (transformers' GptOssExperts), in float32.

    split: the mesh axis splitting the experts' hidden width F (tensor parallelism: gate and up split their
    outputs over it, down its inputs — `Einsum.along`), or None."""
    w_gate, w_up, w_down, *biases = weights
    dot, down = dot.along(outputs=split), dot.along(inputs=split)
    rows = checkpoint_name(rows, "expert_in")  # (named for the memory planner; no policy saves it)
    gate, up = dot.ragged(rows, w_gate, group_sizes), dot.ragged(rows, w_up, group_sizes)  # [M, F] float32
    if biases:  # row r belongs to expert ids[r] (the padding after Σ group_sizes to the last: its output is unused)
        ids = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
        gate, up = gate + biases[0].astype(jnp.float32)[ids], up + biases[1].astype(jnp.float32)[ids]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    if limit:
        g = jnp.minimum(gate, limit)
        hidden = (jnp.clip(up, -limit, limit) + 1.0) * g * jax.nn.sigmoid(alpha * g)
    else:
        hidden = jax.nn.silu(gate) * up
    return checkpoint_name(down.ragged(checkpoint_name(hidden.astype(dtype), "mlp_hidden"), w_down, group_sizes),
                           "expert_out")


def swiglu(p: dict[str, Array], h: Array, cfg: ModelConfig, par: Parallel) -> Array:
    """silu(h·W_gate) ⊙ (h·W_up): two matrices in one column-parallel group (llama)."""
    gate, up = par.column(h, (p["w_gate"], p["w_up"]), ("btd,df->btf", "btd,df->btf"), "mlp")
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    return checkpoint_name((jax.nn.silu(gate) * up).astype(cfg.dtype), "mlp_hidden")


def geglu(p: dict[str, Array], h: Array, cfg: ModelConfig, par: Parallel) -> Array:
    """gelu(h·W_gate) ⊙ (h·W_up) with the tanh GELU (Gemma's gelu_pytorch_tanh): SwiGLU's matrices and groups."""
    gate, up = par.column(h, (p["w_gate"], p["w_up"]), ("btd,df->btf", "btd,df->btf"), "mlp")
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    return checkpoint_name((jax.nn.gelu(gate, approximate=True) * up).astype(cfg.dtype), "mlp_hidden")


def gelu(p: dict[str, Array], h: Array, cfg: ModelConfig, par: Parallel) -> Array:
    """gelu(h·W_up + b_up) with GPT-2's tanh GELU ("gelu_new")."""
    (up,) = par.column(h, (p["w_up"],), ("btd,df->btf",), "mlp")  # [B, T, F]
    up = checkpoint_name(up, "mlp_up")
    return checkpoint_name(jax.nn.gelu((up + p["b_up"]).astype(cfg.dtype), approximate=True), "mlp_hidden")


ACTIVATIONS = {"swiglu": swiglu, "geglu": geglu, "gelu": gelu}  # Family.mlp → the layer function


def rope_frequencies(E: int, cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies ω_i = 1 / theta^(2i/E), i < E/2 (float32 [E/2]), after `cfg.rope_scaling`:

    - linear: ω / factor (positions interpolated by `factor`);
    - llama3 (Llama 3.1): with the pretraining context C = rope_original_max_len and wavelength λ = 2π/ω, keep ω
      where λ < C/high_freq_factor, use ω/factor where λ > C/low_freq_factor, and in between blend
      (1-a)·ω/factor + a·ω with a = (C/λ - low_freq_factor) / (high_freq_factor - low_freq_factor).
    A constant of the config, computed in NumPy as Hugging Face does (float32).
    """
    inv_freq = (1.0 / cfg.rope_theta ** (np.arange(0, E, 2, dtype=np.float32) / np.float32(E))).astype(np.float32)
    if cfg.rope_scaling == "linear":
        inv_freq = inv_freq / np.float32(cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        context = cfg.rope_original_max_len
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
        a = (context / wavelen - low) / (high - low)
        blended = (1 - a) * scaled / factor + a * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        inv_freq = np.where(medium, blended, scaled).astype(np.float32)
    elif cfg.rope_scaling == "yarn":
        inv_freq = _yarn_frequencies(E, cfg)
    return inv_freq


def _yarn_frequencies(E: int, cfg: ModelConfig) -> np.ndarray:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters` computes it: with C =
    rope_original_max_len, the dim d where a frequency makes b rotations over C is d(b) = E·ln(C / (2πb)) / (2·ln θ);
    low = ⌊d(beta_fast)⌋ ≥ 0, high = ⌈d(beta_slow)⌉ ≤ E − 1 (unrounded without `rope_truncate`); pair i's ramp
    a_i = clip((i − low) / (high − low), 0, 1) and ω_i = ω/factor · a_i + ω · (1 − a_i) — fast pairs kept, slow pairs interpolated, a blend between."""
    theta, factor, context = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len
    pos = theta ** (np.arange(0, E, 2, dtype=np.float32) / np.float32(E))
    extrapolated, interpolated = (1.0 / pos).astype(np.float32), (1.0 / (np.float32(factor) * pos)).astype(np.float32)

    def dim(rotations):
        return E * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim(cfg.rope_beta_fast), dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:  # whole dims (transformers' default; gpt-oss keeps the fractional ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, E - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(E // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def rope(x: Array, positions: Array, inv_freq: np.ndarray | Array, interleave: bool = False,
         scale: float = 1.0) -> Array:
    """Rotary embedding. x [B, T, N, E]; positions [B, T]; inv_freq [E/2]; cos and sin multiplied by `scale`
    (YaRN's attention factor, `rope_attention_factor`).

    Pair i rotates by angle pos · ω_i:  [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin], with the pairs
    (i, i + E/2) (Hugging Face's rotate-half convention), or (2i, 2i + 1) with `interleave` (DeepSeek's
    complex-pair order) — whose result comes out as transformers' does, the rotated even dims then the odd ones:
    q and k are permuted alike, so their dot products are the interleaved rotation's.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]  # [B, T, 1, E/2]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    x1, x2 = (x32[..., 0::2], x32[..., 1::2]) if interleave else jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def default_positions(B: int, T: int) -> Array:
    """Positions 0..T-1 for every row: int32 [B, T]."""
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def layer_masks(cfg: ModelConfig, make: Callable[[int], Array | None]) -> Array | None | dict[int, Array | None]:
    """The attention mask(s) of cfg's layers from make(window) → mask: the one mask where every layer has the same
    window, else {window: its mask} for the windows the layers have (full and windowed: `cfg.layer_windows`),
    from which `run_layers` hands each layer its own."""
    windows = sorted(set(cfg.layer_windows))
    return make(windows[0]) if len(windows) == 1 else {w: make(w) for w in windows}


def attention_mask(T: int, segment_ids: Array | None, window: int = 0) -> Array | None:
    """None for plain causal attention (the kernels build it, see `attend`); with segment_ids [B, T] the causal
    mask (within `window`) intersected with same-segment → bool [B, 1, T, S] (`Parallel.attention_mask` gives the
    form the context's attention takes)."""
    return segment_mask(T, segment_ids, window)


def quantize_state(params: nnx.State, cfg: ModelConfig, shardings: nnx.State | None = None) -> nnx.State:
    """A float model's params (State; any layout, vocab padded or not) → the State of the quantized model `cfg`
    describes (`cfg.weights` int8 / int4): every matrix that model stores with a `name_scale` becomes `name`
    (integers) and `name_scale` (`jaxpar.matmul.quantize`, in the groups the scale's shape gives); the rest is
    unchanged. Computed where the arrays are and placed with `shardings` (the quantized model's; None: where jit
    puts them), so every device quantizes its own share."""
    pure = nnx.to_pure_dict(params)
    _, like = abstract_model(cfg, pure["embed"].shape[0])
    out = jax.tree.map(lambda x: x, like)  # the State structure and metadata; values replaced next
    scales = {stack: {name[:-len("_scale")]: v.shape for name, v in layers.items() if name.endswith("_scale")}
              for stack, layers in nnx.to_pure_dict(like).items() if stack in cfg.layer_stacks}

    def quantized(pure):
        out = dict(pure)
        for stack, shapes in scales.items():
            out[stack] = dict(pure[stack])
            for name, shape in shapes.items():
                w = quantize(pure[stack][name], shape, cfg.weights)
                out[stack][name], out[stack][name + "_scale"] = w.q, w.scale
        return out

    placed = None if shardings is None else nnx.to_pure_dict(shardings)
    nnx.replace_by_pure_dict(out, jax.jit(quantized, out_shardings=placed)(pure))
    return out


def merge_adapters(params: nnx.State, cfg: ModelConfig) -> tuple[nnx.State, ModelConfig]:
    """A LoRA model's state (`cfg.lora`; any vocab padding, layers in model order) → (the plain model's state, its
    config): each adapted W becomes W + (alpha/r)·A·B in float32, rounded to W's dtype once, and the adapters are
    dropped. Quantized weights (QLoRA) are dequantized first: the merged model is a float model."""
    lora = cfg.lora
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(lora, rank=0, dropout=0.0), weights="float")
    pure = nnx.to_pure_dict(params)
    dtype = jnp.dtype(cfg.param_dtype)
    for stack, layers in pure.items():
        if not isinstance(layers, dict):
            continue
        for name in [n for n in layers if n + "_scale" in layers]:  # a quantized matrix, back to float
            layers[name] = Quantized(layers[name], layers.pop(name + "_scale")).dequantize(dtype)
        for name in [n.removesuffix("_lora_a") for n in layers if n.endswith("_lora_a")]:
            a, b, w = layers.pop(name + "_lora_a"), layers.pop(name + "_lora_b"), layers[name]
            L, r = a.shape[0], a.shape[-1]
            product = jnp.matmul(a.reshape(L, -1, r).astype(jnp.float32), b.reshape(L, r, -1).astype(jnp.float32))
            layers[name] = (w.astype(jnp.float32) + lora.scale * product.reshape(w.shape)).astype(w.dtype)
    _, like = abstract_model(plain, pure["embed"].shape[0])
    state = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(state, pure)
    return state, plain


def abstract_model(cfg: ModelConfig, padded_vocab: int | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract model state: the parameters and the buffers, `MODEL_STATE`) — shapes, dtypes and logical
    axes, no memory."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), padded_vocab=padded_vocab))
    return nnx.split(model, MODEL_STATE)


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters, from the abstract model (no allocation)."""
    return sum(x.size for x in jax.tree.leaves(trainable(abstract_model(cfg)[1])))
