"""What a model family is: the contract each file of jaxpar/families/ fills in.

A family is data, not code paths: which shared layer functions of jaxpar.model it uses (a norm, a position scheme,
an MLP), the parameters a layer holds (shape, logical axes, initialiser), its config rules, and its Hugging Face
mapping (architectures, config.json keys, tensor names). The model, the HF interop, the FLOP formulas and the config
checks read these fields; none of them branches on a family's name. Adding a family is adding a file (and its line
in `jaxpar/families/__init__.py`); a family that needs a layer kind the model does not have adds that one function
to jaxpar.model.

This module and the family files import no jax: the config imports them to validate and derive sizes, and a config
error must print before jax loads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

# Dimension letters (as in jaxpar.model): D d_model, H query heads, K kv heads, E head_dim, F d_ff, P positions.


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: its shape (without the stacked layer dim), the logical axis of each dim, its initialiser.

    init: 'normal' N(0, init_std); 'out' N(0, init_std/√(2·n_layers)) for projections that write into the residual
    stream (GPT-2 / Megatron); 'half' N(0, init_std/2) (GPT-2's position table); 'ones'; 'zeros'.
    decay: whether weight decay applies — carried onto the nnx.Param as metadata, which the optimizer reads
    (GPT-2 / Megatron practice: not on norm scales or biases).
    contract: for a weight matrix the model contracts through the matmul seam, the dims its input contracts
    (consecutive: wq [D, H, E] → (0,), wo [H, E, D] → (0, 1)); its other dims are output channels. Empty: not a
    matmul weight, or one kept in float (the router). These are the matrices weight-only quantization stores as
    integers (`quantized`).
    role: for a weight the model contracts through the matmul seam, the role it is contracted under
    (jaxpar.matmul.ROLES: attention, mlp, experts, router, embedding, head), whose policy the plan binds; None for
    anything else. The model names the same role where it uses the weight (a test holds the two together).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str
    decay: bool = True  # AdamW weight decay applies (matrices, embeddings); False for norm scales and biases
    contract: tuple[int, ...] = ()
    role: str | None = None

    def scale(self, group: int | None) -> "Param":
        """The scale of this matrix quantized in groups of `group` consecutive input elements (row-major over the
        contracted dims; None: one group per output channel, the whole contracted width) → its Param: the matrix's
        shape with each contracted dim cut to its number of groups, the matrix's logical axis where a dim keeps
        more than one group (the scale then shards with its weight), None where it keeps one (replicated: every
        rank's share of that group reads the same scale).

        E.g. wo [H=4, E=64, D] in groups of 128: two heads a group → scale [2, 1, D], axes ("heads", None, "embed").
        ValueError (the message names the width and the group sizes that work) when the groups do not tile the
        contracted dims: a group must divide the contracted width and be a multiple or divisor of each dim it
        spans."""
        dims = [self.shape[i] for i in self.contract]
        width = 1
        for d in dims:
            width *= d
        group = width if group is None else group
        if group < 1 or width % group:
            raise ValueError(f"a group of {group} does not divide the contracted width {width}")
        shape, axes, rest = list(self.shape), list(self.axes), group
        for i in reversed(self.contract):  # the innermost contracted dim first: groups run along it
            d = self.shape[i]
            if rest >= d:
                if rest % d:
                    raise ValueError(f"a group of {group} spans {rest / d:g} rows of {d}: it must be a multiple or a "
                                     f"divisor of {d}")
                shape[i], axes[i], rest = 1, None, rest // d
            else:
                if d % rest:
                    raise ValueError(f"a group of {rest} elements does not divide a dim of {d}")
                shape[i], rest = d // rest, 1
        return Param(tuple(shape), tuple(axes), "ones", decay=False)


@dataclasses.dataclass(frozen=True)
class CacheArray:
    """One array of a layer's decoding cache, held as [L, B, S, *shape]: one slot of one row on one tensor rank.

    axes: the logical axis of each of `shape`'s dims — how GSPMD lays the cache out (`jaxpar.sharding`'s rules).
    split: the dim whose tensor ranks' shares lie side by side in the explicit path's global array (its shard_map
    spec splits that dim over `tensor`); None: every tensor rank holds the array whole (a latent cache)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    split: int | None = None


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    params(cfg) → its parameters by name (the projections; a family adds its norms and biases around them).
    cache(cfg, tensor) → its decoding cache's arrays by name, as one tensor rank of `tensor` holds them.
    check(cfg, tensor) → raise ConfigError for a tensor degree this kind cannot split over (naming the field).
    shared(cfg, tensor) → how many tensor ranks hold the same heads (1: every rank its own share): GQA with fewer kv
        heads than ranks replicates them — the logical axes in `shared_axes` are then held whole
        (`jaxpar.plan.plan_rules`), and `TensorParallel.kv_replicas` picks each rank's head.
    flops(cfg, keys, tensor) → forward FLOPs per token on one rank: (projections, the core attention over `keys`
        keys per query).
    local(cfg, tensor) → the ModelConfig fields of one tensor rank's share, as a plain model (the memory planner
        traces it: `jaxpar.planner.memory.local_model`).
    traffic(cfg, tensor, sequence) → (tensor halves, context elements) per token of one layer application in
        training: the values its tensor-parallel boundaries move forward and backward, counted in halves (an
        all-gather or reduce-scatter of one value a token is one, an all-reduce two; `sequence`: under SP), and
        the key + value elements a rank's attention gathers over `context` per token — what
        `jaxpar.planner.expected` predicts the compiled program's bytes from.
    matmuls(cfg, tensor, seq) → the layer's attention matmuls as one rank of `tensor` runs them in training over
        sequences of `seq` tokens, each (FLOPs per token, square-equivalent width √(K·N)): the projections, then the
        core's per-head scores and their product with the values (`jaxpar.planner.cost.layer_matmuls` rates each
        at its width; the backward's have the same K·N).
    """

    name: str
    params: Callable[[object], dict[str, Param]]
    cache: Callable[[object, int], dict[str, CacheArray]]
    check: Callable[[object, int], None]
    shared: Callable[[object, int], int]
    flops: Callable[[object, float, int], tuple[float, float]]
    local: Callable[[object, int], dict[str, int]]
    traffic: Callable[[object, int, bool], tuple[float, float]]
    matmuls: Callable[[object, int, int], list[tuple[float, float]]]
    shared_axes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Rule:
    """jaxpar parameter `param` ⇄ Hugging Face tensor `name` ("{l}" = layer index for stacked params).

    layers: for a stacked param, the model layer each entry of its stack is (`ModelConfig.layer_stacks`: a mixed
    dense / MoE model keeps two stacks); None: entry l is layer l.

    to_jax: the HF tensor → the jaxpar array (one layer's, for stacked params); to_hf: the inverse. Several rules
    may share one HF tensor (GPT-2's fused c_attn, Phi-3's qkv_proj and gate_up_proj): each takes its `part` of
    `parts` slices along `axis` — equal slices, or of `sizes` (each part's extent along `axis`: Phi-3's qkv_proj
    rows are H·E queries, then K·E keys and K·E values), or with `interleave` every parts-th entry from `part` on
    (gpt-oss's gate_up_proj: gate, up, gate, up, … along its last axis). to_jax / to_hf see the rule's slice only.
    """

    param: str
    name: str
    to_jax: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]
    part: int = 0
    parts: int = 1
    layers: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = ()
    axis: int = -1
    interleave: bool = False

    @property
    def stacked(self) -> bool:
        return "{l}" in self.name

    def piece(self, x):
        """This rule's slice of the (fused) HF tensor x."""
        if self.parts == 1:
            return x
        index = [slice(None)] * x.ndim
        if self.interleave:
            index[self.axis] = slice(self.part, None, self.parts)
            return x[tuple(index)]
        if not self.sizes:
            n = x.shape[self.axis] // self.parts
            start, stop = self.part * n, (self.part + 1) * n
        else:
            start = sum(self.sizes[:self.part])
            stop = start + self.sizes[self.part]
        index[self.axis] = slice(start, stop)
        return x[tuple(index)]

    def fuse(self, pieces: list) -> Any:
        """The HF tensor from each part's slice, in part order (NumPy arrays): the inverse of `piece`."""
        import numpy as np  # (families import no jax, and NumPy only where a tensor is written)

        if len(pieces) == 1:
            return pieces[0]
        if not self.interleave:
            return np.concatenate(pieces, axis=self.axis)
        axis = self.axis % pieces[0].ndim
        stacked = np.stack(pieces, axis=axis + 1)  # [..., n, parts, ...] → entry i·parts + part
        return stacked.reshape(*pieces[0].shape[:axis], -1, *pieces[0].shape[axis + 1:])

    def fused_shape(self, piece: tuple[int, ...]) -> tuple[int, ...]:
        """The whole HF tensor's shape, from the shape of this rule's slice of it."""
        if self.parts == 1:
            return tuple(piece)
        shape = list(piece)
        shape[self.axis] = sum(self.sizes) if self.sizes else piece[self.axis] * self.parts
        return tuple(shape)

    def model_layers(self, n_layers: int) -> tuple[int, ...]:
        """The model layer of each entry of the stacked param, in stack order."""
        return tuple(range(n_layers)) if self.layers is None else self.layers


def same(x):
    """The identity: a tensor stored the same way in both layouts."""
    return x


@dataclasses.dataclass(frozen=True)
class HuggingFace:
    """A family's Hugging Face mapping.

    architectures: HF class name → model_type, for every class this family imports.
    read(keys, model_type) → (ModelConfig fields, {jaxpar field: config.json key}); `keys` is the type-checked
        config.json reader of jaxpar.interop.hf (`keys.integer("n_embd")`, `keys.error(message)` → an HFError).
    write(cfg, out, base): fill config.json dict `out` for cfg (`base`: the imported config.json, or None).
    exportable(cfg): raise ConfigError for a cfg the architecture it exports as cannot express.
    tensors(cfg, names) → [Rule]: the tensor table; `names` (the tensors present, or None) settles naming variants.
    """

    architectures: Mapping[str, str]
    read: Callable[[Any, str], tuple[dict, dict]]
    write: Callable[[Any, dict, dict | None], None]
    exportable: Callable[[Any], None]
    tensors: Callable[[Any, set[str] | None], list[Rule]]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family. norm / positions / mlp name the shared layer functions of jaxpar.model it is built from."""

    name: str
    summary: str  # one line, for the config reference
    norm: str  # 'rms' (RMSNorm: scale), 'rms_offset' (RMSNorm times 1 + scale, the scale born zero: Gemma) or
    # 'layer' (LayerNorm: scale and bias)
    positions: str  # 'rope' (rotary, in attention) or 'learned' (a position table added to the embedding)
    mlp: str  # 'swiglu' (gate, up, down), 'geglu' (the same with the tanh GELU: Gemma) or 'gelu' (up, down, biases)
    layer_params: Callable[[Any, bool], dict[str, Param]]  # (cfg, moe) → one layer's parameters, in initialisation
    # order; moe: the layer holds the mixture of experts (cfg.moe) in place of the dense MLP
    default_d_ff: Callable[[int], int]  # d_model → the MLP width a d_ff of 0 means
    check: Callable[[Any], None]  # cfg → raise ConfigError for what the family cannot run
    hf: HuggingFace
    attention: str = "gqa"  # its attention kind: an entry of jaxpar.families.attention.ATTENTION_KINDS
    embed_scale: bool = False  # token embeddings multiplied by √d_model (Gemma)

    def mlp_matrices(self, cfg) -> int:
        """How many D×F weight matrices one layer's dense MLP holds (3 for a gated MLP, 2 for a plain one): FLOP
        formulas. (An MoE layer's active matrices: `jaxpar.flops`.)"""
        return 3 if self.mlp in ("swiglu", "geglu") else 2

    @property
    def norm_init(self) -> str:
        """The initialiser of a norm's scale: 'zeros' where the norm multiplies by 1 + scale, else 'ones'."""
        return "zeros" if self.norm == "rms_offset" else "ones"


def swiglu_d_ff(d_model: int) -> int:
    """A SwiGLU family's default MLP width: 8/3·d_model rounded up to a multiple of 32 (SwiGLU's three matrices cost
    what a 4·d_model MLP's two do)."""
    return 32 * math.ceil(8 * d_model / 3 / 32)


def mlp_params(cfg, moe: bool) -> dict[str, Param]:
    """A SwiGLU layer's MLP half: the mixture of experts (`moe_params`) when `moe`, else the dense SwiGLU
    w_gate, w_up [D, F]; w_down [F, D] (F = cfg.d_ff)."""
    if moe:
        return moe_params(cfg)
    D, F = cfg.d_model, cfg.d_ff
    return {"w_gate": Param((D, F), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
            "w_up": Param((D, F), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
            "w_down": Param((F, D), ("mlp", "embed"), "out", contract=(0,), role="mlp")}


def moe_params(cfg) -> dict[str, Param]:
    """A mixture-of-experts MLP in place of the dense SwiGLU (cfg.moe, n_experts X, expert width F_e, shared width
    F_s): the router, the experts stacked on a leading `experts` axis, and the optional shared expert.

        router [D, X]                                  (replicated: every rank scores every expert)
        we_gate, we_up [X, D, F_e]; we_down [X, F_e, D] ("experts" split over `expert`, "mlp" over `tensor`)
        ws_gate, ws_up [D, F_s]; ws_down [F_s, D]      shared expert (Qwen2-MoE), when moe.shared_d_ff > 0
        ws_score [D]                                   its sigmoid gate, when moe.shared_gate
        router_b [X]                                   the router's bias, when moe.router_bias (gpt-oss)
        we_gate_b, we_up_b [X, F_e]; we_down_b [X, D]  the experts' biases, when moe.expert_bias (gpt-oss): the
                                                       first two split like their matrices' outputs; the down bias
                                                       whole on every rank (added from the routing, outside the
                                                       experts' region: `jaxpar.model.moe`)
    """
    D, X, F = cfg.d_model, cfg.moe.n_experts, cfg.moe.d_ff
    params = {"router": Param((D, X), ("embed", None), "normal", role="router"),
              "we_gate": Param((X, D, F), ("experts", "embed", "mlp"), "normal", contract=(1,), role="experts"),
              "we_up": Param((X, D, F), ("experts", "embed", "mlp"), "normal", contract=(1,), role="experts"),
              "we_down": Param((X, F, D), ("experts", "mlp", "embed"), "out", contract=(1,), role="experts")}
    if cfg.moe.router_bias:
        params["router_b"] = Param((X,), (None,), "zeros", decay=False)
    if cfg.moe.expert_bias:
        params.update(we_gate_b=Param((X, F), ("experts", "mlp"), "zeros", decay=False),
                      we_up_b=Param((X, F), ("experts", "mlp"), "zeros", decay=False),
                      we_down_b=Param((X, D), (None, "embed"), "zeros", decay=False))
    if cfg.moe.shared_d_ff:
        Fs = cfg.moe.shared_d_ff
        params.update(ws_gate=Param((D, Fs), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
                      ws_up=Param((D, Fs), ("embed", "mlp"), "normal", contract=(0,), role="mlp"),
                      ws_down=Param((Fs, D), ("mlp", "embed"), "out", contract=(0,), role="mlp"))
        if cfg.moe.shared_gate:
            params["ws_score"] = Param((D,), ("embed",), "normal", role="router")
    return params
