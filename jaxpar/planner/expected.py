"""Analytic expectations for one train step, per device, to set beside what the compiled program does.

Notation: b rows per data shard (per device), s seq_len, h d_model, a query heads, E head_dim, K kv heads, F d_ff,
V padded vocab, L layers, t tensor degree, β bytes per activation element (the compute dtype), A grad_accum chunks.
Ring algorithms: an all-reduce of N bytes sends 2(t−1)/t·N per device; an all-gather or reduce-scatter (t−1)/t·N.

Tensor-axis traffic (Megatron; Korthikanti et al. 2022 for SP), N = b·s·h·β — for GQA; another attention kind's
region moves what its `AttentionKind.traffic` says (MLA: its latents enter, 2·(q_lora + r + R + h) halves):
    per layer, TP:     fwd g(attn out) + g(mlp out), bwd f(attn in) + f(mlp in)        = 4 all-reduces  = 8(t−1)/t·N
    per layer, TP+SP:  fwd 2 AG + 2 RS, bwd 2 RS + 2 AG, + 2 re-gathers of the column-parallel inputs (§4.2.2)
                                                                                       = 10 halves      = 10(t−1)/t·N
    embedding:         TP: g fwd (1 all-reduce);   SP: RS fwd + AG bwd
    LM head:           TP: f bwd (1 all-reduce);   SP: AG fwd + RS bwd (XLA reuses the forward gather in the backward
                       here: same value, no loop boundary between them)
    loss:              3 per-token scalars (max, Σexp, target logit) as all-reduces of b·s·4 bytes — never b·s·V
    small terms:       GQA with K < t: the f on replicated kv weights all-reduces their gradients (2·h·K·E·4 per layer);
                       SP: the f on tensor-replicated params used on sequence shards (norm scales, output biases,
                       gpt2 positions) all-reduces their gradients.
Data-axis traffic: one all-reduce of the local gradient shard.
Context-axis traffic (s = S/c tokens of a row per device, N = b·s·K_loc·E per layer): all-gather K/V 4·(c−1)·N·β
(gathered forward, gradients reduce-scattered backward); ring (c−1)·4·N·β + 2c·N·4 (`context_bytes`).

FLOPs (matmuls only, per device; training = 3 × forward: forward, input gradient, weight gradient):
    forward per token, per layer: 2h·E·(a_loc + 2·K_loc) + 4·s·E·a_loc + 2·a_loc·E·h + 2·h·F/t·n (n: the family's
    MLP matrices, 3 for SwiGLU, 2 for GELU; `jaxpar.flops.layer_forward_flops`)
    with a_loc = a/t and K_loc = max(K/t, 1) (replicated kv heads are computed on every rank);
    the full causal score matrix is computed (masking does not halve the work here, so it is not halved); plus the
    LM head 2·h·V/t per token. Model FLOPs per token (the 6N + 12·L·h·s rule; `jaxpar.flops`) are reported beside it.

Activation memory per layer (Korthikanti et al. 2022, 16-bit, GELU MLP of 4h, with dropout):
    no parallelism s·b·h·(34 + 5·a·s/h);  TP: s·b·h·(10 + 24/t + 5·a·s/(h·t));  TP+SP: s·b·h·(34/t + 5·a·s/(h·t)).
Our block differs (SwiGLU, GQA, no dropout, float32 in tests), so the absolute numbers are a reference; what must
hold is the scaling: with SP everything per layer divides by t.
"""

from __future__ import annotations

import functools
import math

import jax
from flax import nnx

from jaxpar import flops
from jaxpar.config import Config
from jaxpar.families import attention_kind
from jaxpar.model import abstract_model
from jaxpar.parallel import expert, pipeline
from jaxpar.parallel.axes import GRAD_AXES, MESH_AXES, TENSOR


def rows_per_data_shard(config: Config) -> int:
    """b: the batch rows of one data-parallel shard — the global batch over the gradient axes' degrees (data, and
    expert: MoE ranks are data-parallel outside their layers). A pipeline splits them further over its stages."""
    return config.train.batch_size // math.prod(getattr(config.parallel, a) for a in GRAD_AXES)


def _dims(config: Config, padded_vocab: int) -> dict:
    """Sizes per device. `rows`: sequences this device embeds and scores (b, or b/p with a pipeline);
    `layer_execs`: layer applications over the step and `tokens_per_exec` the tokens each one processes —
    L·A of (b/A)·s without a pipeline, (v·m + p − 1)·k·A of mb·s with one (bubbles included); A = grad_accum."""
    m, p, t = config.model, config.parallel, config.train
    b = rows_per_data_shard(config)
    # s: the tokens of a row this device holds (seq_len / context under context parallelism); S: the whole row's
    d = dict(b=b, s=t.seq_len // p.context, S=t.seq_len, c=p.context, h=m.d_model, a=m.n_heads, E=m.head_dim, K=m.n_kv_heads, F=m.d_ff, V=padded_vocab,
             L=m.n_layers, t=p.tensor, sp=p.sequence_parallel, A=t.grad_accum,
             beta=4 if m.dtype == "float32" else 2)
    if p.pipe > 1:
        k = m.pipelined_layers // (p.pipe * p.repeats)
        mb = b // p.microbatches
        n = pipeline.iterations(p.pipe, p.repeats, p.microbatches)
        d.update(rows=b // p.pipe, layer_execs=n * k * t.grad_accum, tokens_per_exec=mb // t.grad_accum * d["s"],
                 mb=mb // t.grad_accum, iterations=n * t.grad_accum)
        # a dense prefix (DeepSeek's first layers) runs beside the embedding on the stage's own b/p rows: per
        # prefix layer A·(m/p) executions of mb/A rows
        d["layer_execs"] += m.prefix_layers * t.grad_accum * (p.microbatches // p.pipe)
    else:
        d.update(rows=b, layer_execs=m.n_layers * t.grad_accum, tokens_per_exec=b // t.grad_accum * d["s"])
    # the MoE layers' share of them (every pipeline chunk holds the same dense / MoE layers: the config checks it;
    # a dense prefix runs outside the pipeline)
    if p.pipe > 1:
        d["moe_layer_execs"] = n * k * t.grad_accum * sum(m.layer_kinds[m.prefix_layers:][:k]) // k
    else:
        d["moe_layer_execs"] = d["layer_execs"] * m.moe_layer_count // m.n_layers
    return d


def tensor_bytes(config: Config, padded_vocab: int) -> dict[str, float]:
    """Expected bytes each device sends on the tensor axis in one train step, by source."""
    d = _dims(config, padded_vocab)
    t = d["t"]
    if t == 1:
        return {"layers": 0.0, "embedding": 0.0, "head": 0.0, "loss": 0.0, "param_grads": 0.0, "total": 0.0}
    half_per_token = (t - 1) / t * d["h"] * d["beta"]  # an all-gather or reduce-scatter of one token's h values
    # the MLP region's 4 (SP: 5) halves of h, and the attention kind's (GQA: as many; `AttentionKind.traffic`)
    attention, _ = attention_kind(config.model).traffic(config.model, t, d["sp"])
    per_token = (5 if d["sp"] else 4) * half_per_token + (t - 1) / t * attention * d["beta"]
    out = {
        "layers": d["layer_execs"] * d["tokens_per_exec"] * per_token,
        "embedding": 2 * d["rows"] * d["s"] * half_per_token,
        "head": 2 * d["rows"] * d["s"] * half_per_token,
        "loss": 3 * 2 * (t - 1) / t * d["rows"] * d["s"] * 4,
    }
    # All-reduced parameter gradients (float32): per layer application (inside the loops), and once per chunk.
    per_exec, per_chunk = 0.0, 0.0
    if attention_kind(config.model).shared(config.model, t) > 1:  # GQA's kv heads replicated over ranks (K < t)
        per_exec += 2 * d["h"] * d["K"] * d["E"] * 4
    if d["sp"]:  # the tensor-replicated parameters applied to sequence shards (norms, biases, gpt2's positions)
        per_layer, outside = tensor_replicated_floats(config.model)
        per_exec += per_layer * 4
        per_chunk += outside * 4
    out["param_grads"] = 2 * (t - 1) / t * (d["layer_execs"] * per_exec + d["A"] * per_chunk)
    out["moe"] = d["moe_layer_execs"] * moe_tensor_bytes(config, d)
    out["total"] = sum(out.values())
    return out


def moe_tensor_bytes(config: Config, d: dict) -> float:
    """Tensor-axis bytes one MoE layer application adds to the layer formula (whose MLP region the routed experts
    stand in for; 0 for a dense model). A shared expert is a second MLP region: 4 half-units of N·h·β (f and g,
    forward and backward; under SP its backward re-gather of the input is the routed experts' kept gather, which
    XLA shares). Every tensor rank routes the same tokens outside the experts' region and the gates [N, k] enter
    it, so their float32 gradient is all-reduced in the backward: 2(t−1)/t·N·k·4. Under SP each rank routes its
    N/t tokens: the row statistics are all-reduced forward (load [b, X] int32, Σp [b, X] and the z-loss [b] float32; the
    dropped count is a scalar, reported apart), with capacity also the per-choice counts (all-reduced and
    all-gathered, [b, k, X] int32), and the routing enters the region by all-gathers (experts int32, gates float32
    and, with capacity, keep bool — dropless it is a constant XLA folds: 9 or 8 bytes an assignment) whose gates
    come back reduce-scattered (4) — and the tokens' gather is kept for the backward rather than done
    again (the layer formula's SP re-gather of the MLP input, (t−1)/t·N·h·β, does not happen: negative here)."""
    moe, t = config.moe, d["t"]
    if not moe.enabled or t == 1:
        return 0.0
    N, k, X = d["tokens_per_exec"], moe.top_k, moe.n_experts
    shared = 4 * (t - 1) / t * N * d["h"] * d["beta"] if moe.shared_d_ff else 0.0
    if not d["sp"]:
        return shared + 2 * (t - 1) / t * N * k * 4
    b = N // d["s"]
    reduce = 2 * (t - 1) / t
    stats = reduce * (b * X * 4 + b * X * 4 + b * 4)
    if moe.capacity_factor:
        stats += reduce * b * k * X * 4 + (t - 1) * b * k * X * 4
    gathered = 9 if moe.capacity_factor else 8
    return shared + stats + (t - 1) / t * N * k * (gathered + 4) - (t - 1) / t * N * d["h"] * d["beta"]


@functools.lru_cache(maxsize=64)
def tensor_replicated_floats(model) -> tuple[float, int]:
    """(per layer, outside the layers): how many floats of the model's parameters no tensor rank splits — read from
    the parameters' logical axes (none of them one that `tensor` splits). Under SP each of them meets sequence
    shards, so its gradient is all-reduced over `tensor`."""
    tensor_split = next(a.splits for a in MESH_AXES if a.name == TENSOR)
    _, abstract = abstract_model(model)
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    per_layer = outside = 0
    for _, v in leaves:
        axes = tuple(v.get_metadata().get("logical_axes") or ())
        if not set(axes) & set(tensor_split):
            if axes[:1] in (("layers",), ("prefix_layers",)):  # (a mean over the layers when two stacks differ)
                per_layer += math.prod(v.shape) / model.n_layers
            else:
                outside += math.prod(v.shape)
    return per_layer, outside


def layer_forward_flops_per_token(config: Config) -> float:
    """Matmul FLOPs of one layer's forward pass per token, per device (`jaxpar.flops.layer_forward_flops` on one
    tensor rank's share). The full score square is counted: XLA's attention computes it and masks afterwards."""
    layer = flops.layer_forward_flops(config.model, keys=config.train.seq_len, tensor=config.parallel.tensor)
    return layer.dense + layer.attention


def step_flops(config: Config, padded_vocab: int) -> dict[str, float]:
    """Expected matmul FLOPs per device per train step (no recomputation): `executed` counts the pipeline's bubble
    iterations, `useful` does not; `model_flops_per_device` is `flops.train_flops_per_token` (the MFU numerator:
    causal attention pairs, no recomputation) over this device's share of the tokens."""
    d = _dims(config, padded_vocab)
    layer = layer_forward_flops_per_token(config)
    head = d["rows"] * d["s"] * 2 * d["h"] * d["V"] / d["t"]  # LM head on this device's own rows only
    executed = 3 * (d["layer_execs"] * d["tokens_per_exec"] * layer + head)
    useful = 3 * (d["L"] / config.parallel.pipe * d["b"] * d["s"] * layer + head)  # each stage: its L/p layers, all b
    tokens = d["b"] * d["s"] / config.parallel.pipe  # the device's share of the step's tokens
    # The MFU numerator, one definition for `analyze` and the training logs (causal pairs only, no recomputation).
    model = tokens * flops.train_flops_per_token(config.model, d["S"]) / d["t"]
    return {"executed": executed, "useful": useful, "model_flops_per_device": model}


def pipeline_bytes(config: Config) -> dict[str, float]:
    """Pipeline traffic per device per step: collective-permutes move the shift and the io-stream slot, one
    microbatch's float32 residual stream [mb, s(/t), h] each, per iteration, forward and again backward."""
    p = config.parallel
    if p.pipe == 1:
        return {"iterations": 0, "bubble_fraction": 0.0, "permute_bytes_per_iteration": 0.0, "permute_bytes": 0.0}
    d = _dims(config, config.model.vocab_size)
    s_local = d["s"] // d["t"] if d["sp"] else d["s"]
    per_iteration = 4 * d["mb"] * s_local * d["h"] * 4
    n = pipeline.iterations(p.pipe, p.repeats, p.microbatches)
    return {"iterations": n, "bubble_fraction": pipeline.bubble_fraction(p.pipe, p.repeats, p.microbatches),
            "permute_bytes_per_iteration": per_iteration,
            "permute_bytes": per_iteration * d["iterations"]}


def schedule_permute_bytes(config: Config, ticks: int, directions: int) -> float:
    """A scheduled pipeline's traffic per device per step: every tick sends one microbatch's float32 residual
    stream [mb, s(/t), h] in each direction the table uses (down s → s+1, up s → s−1), whether or not the stage
    has something to send (the collective runs on every stage)."""
    d = _dims(config, config.model.vocab_size)
    s_local = d["s"] // d["t"] if d["sp"] else d["s"]
    return ticks * directions * d["mb"] * s_local * d["h"] * 4 * d["A"]


def context_bytes(config: Config) -> float:
    """Context-axis traffic per device per step (jaxpar.parallel.context_parallel), in units of one K (or V) block
    of a layer application, N = (tokens of the application)·K_loc·E elements, K_loc = max(K/t, 1):
        all_gather  each layer gathers K and V — a ring all-gather sends (c−1) times the local share — and the
                    backward reduce-scatters their gradients, as many: 4·(c−1)·N·β
        ring        the forward passes K and V on c−1 times, (c−1)·2·N·β; the backward passes them on c−1 times
                    again and their float32 gradients c times (home): (c−1)·2·N·β + c·2·N·4
    β: the compute dtype's bytes."""
    d = _dims(config, config.model.vocab_size)
    c = d["c"]
    if c == 1:
        return 0.0
    block = d["tokens_per_exec"] * attention_kind(config.model).traffic(config.model, d["t"], d["sp"])[1] / 2
    if config.parallel.context_impl == "ring":
        per_exec = 4 * (c - 1) * block * d["beta"] + 2 * c * block * 4
    else:
        per_exec = 4 * (c - 1) * block * d["beta"]
    return d["layer_execs"] * per_exec


def expert_chunk_rows(config: Config, rows: int) -> int:
    """S: the rows one expert rank sends another per MoE layer application over `rows` sequences
    (jaxpar.parallel.expert): with capacity C, rows·(X/ep)·C; dropless, the worst case rows·s·min(k, X/ep)."""
    moe, ep, s = config.moe, config.parallel.expert, config.train.seq_len
    Xl, k = moe.n_experts // ep, moe.top_k
    C = expert.capacity(s, k, moe.n_experts, moe.capacity_factor)
    dropless = rows * s * min(k, Xl)
    return min(rows * Xl * C, dropless) if C else dropless


def expert_bytes(config: Config) -> dict[str, float]:
    """Expert-axis traffic per device per step. Each MoE layer application (over rows_exec sequences) sends, per
    direction of the all-to-all, (ep−1) chunks of S rows (`expert_chunk_rows`) of h floats: dispatch and combine
    forward, their transposes backward — 4·(ep−1)·S·h·β — plus the per-(rank, local expert) counts forward,
    (ep−1)·(X/ep)·4 bytes (int32, no backward). With cf = 1 and T·k/X whole this is 2·(ep−1)/ep·N·k·h·β each
    way, N = rows_exec·s tokens (DESIGN.md's formula). `balanced`: that formula's value."""
    d = _dims(config, config.model.vocab_size)
    moe, ep = config.moe, config.parallel.expert
    if ep == 1 or not moe.enabled:
        return {"rows": 0.0, "counts": 0.0, "total": 0.0, "balanced": 0.0}
    rows_exec = d["tokens_per_exec"] // d["s"]
    S = expert_chunk_rows(config, rows_exec)
    execs = d["moe_layer_execs"]
    rows_bytes = execs * 4 * (ep - 1) * S * d["h"] * d["beta"]
    counts = execs * (ep - 1) * (moe.n_experts // ep) * 4
    balanced = execs * 4 * (ep - 1) / ep * d["tokens_per_exec"] * moe.top_k * d["h"] * d["beta"]
    return {"rows": rows_bytes, "counts": counts, "total": rows_bytes + counts, "balanced": balanced}


def activation_bytes_per_layer(config: Config) -> dict[str, float]:
    """Korthikanti et al.'s activation memory per layer per device (16-bit), for reference."""
    d = _dims(config, config.model.vocab_size)
    sbh, ratio, t = d["s"] * d["b"] * d["h"], d["a"] * d["s"] / d["h"], d["t"]
    return {"none": sbh * (34 + 5 * ratio), "tp": sbh * (10 + 24 / t + 5 * ratio / t),
            "tp_sp": sbh * (34 / t + 5 * ratio / t)}


def ratio(measured: float, expected: float) -> float | None:
    """measured / expected, or None when nothing is expected."""
    return None if not expected else measured / expected
