"""Model FLOPs per token (training and inference), recomputation, and the peak FLOP/s of the device: MFU and HFU.

Only matmuls are counted (elementwise work — norms, softmax, RoPE, the optimizer — is a few percent at most and no
accelerator's peak figure is about it). Notation: h d_model, a query heads, K kv heads, E head_dim, F d_ff,
V vocab, L layers, s sequence length. Per token and per layer, forward (`layer_forward_flops`, the one formula the
analysis compares compiled programs against too):

    q, k, v projections   2·h·E·(a + 2K)          (GQA: k and v are K heads wide, not a)
    output projection     2·a·E·h
    MLP                   2·h·F·n, n = the family's D×F matrices (llama's SwiGLU: gate, up, down = 3; gpt2: 2)
    MoE MLP (active)      2·h·X (router) + 3·2·h·(k·F_e + F_s) (k experts and the shared one, SwiGLU) + 2·h (the
                          shared expert's score): the active parameters, as 6·N_active counts them
    attention             2·a·E·c (scores q·kᵀ) + 2·a·E·c (probabilities · v) = 4·a·E·c

where c is the number of keys a query attends to, averaged over the sequence. And once per token, the LM head
2·h·V. The embedding lookup is a gather (no FLOPs), so tied and untied embeddings cost the same here — which is why
the "6·N" shortcut over *all* parameters overcounts an untied model by 6·h·V per token.

**Causal mask convention.** Model FLOPs count only the (query, key) pairs the mask keeps: with a causal mask query
i sees i + 1 keys, so c = (s + 1)/2 — the attention term is (almost exactly) halved; a sliding window W keeps
c = mean over i of min(i + 1, W). That is the work the math needs. What the hardware executes depends on the kernel:
XLA's attention (model.attention 'xla', and every CPU run) computes the whole s × s score matrix and masks it
afterwards (c = s, not halved); cuDNN's flash attention skips the fully masked tiles (c ≈ the causal count).

**Training** = 3 × forward: the forward pass, the gradient with respect to the inputs and the gradient with respect
to the weights each cost one forward's matmuls.

**MFU vs HFU.** MFU = model FLOPs per second / peak, counting the causal pairs and no recomputation: it does not
reward a model for doing extra work. HFU (hardware FLOPs utilisation) counts what the device executes: the full
square on XLA's attention path, and the recomputation of `parallel.remat` —
    'full': every layer's forward runs again in the backward pass (+1 forward of the layers, less the MLP's down
            projection: its output is only added to the residual stream, which the layer scan carries, so no
            backward rule needs it and XLA drops that recomputation);
    'dots': matmul outputs without batch dimensions are saved (projections, MLP), but the attention score and
            probability·value products have batch dimensions (batch, heads), so they are recomputed
            (+1 forward of the attention term only).
The circular pipeline's bubble iterations are counted in neither: their stages run on filler data (the executed
over useful ratio of `jaxpar analyze`), time that lowers both.

**Peak FLOP/s** come from the NVIDIA datasheets, dense (the "with sparsity" figures are twice these), per GPU. With
JAX's default matmul precision a float32 matmul on Ampere and later runs on TF32 tensor cores, so float32 compute is
compared with the TF32 peak unless `jax_default_matmul_precision` asks for true float32. CPUs have no entry: there,
report achieved FLOP/s only (`mfu` is None).
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import ModelConfig
from jaxpar.families import attention_kind, family

TERA = 1e12

# Dense peak TFLOP/s per GPU by compute type (NVIDIA datasheets; H200 NVL and H100 NVL are the PCIe-form cards;
# float8: e4m3/e5m2 tensor cores, twice bfloat16's).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 SXM": {"bfloat16": 989.4, "tf32": 494.7, "float32": 66.9, "float8": 1978.9},
    "H200 NVL": {"bfloat16": 835.5, "tf32": 417.5, "float32": 60.0, "float8": 1671.0},
    "H100 SXM": {"bfloat16": 989.4, "tf32": 494.7, "float32": 66.9, "float8": 1978.9},
    "H100 NVL": {"bfloat16": 835.5, "tf32": 417.5, "float32": 60.0, "float8": 1671.0},
    "H100 PCIe": {"bfloat16": 756.0, "tf32": 378.0, "float32": 51.2, "float8": 1513.0},
    "A100": {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5},  # SXM4 and PCIe, 40 and 80 GB alike
}

# jax's `device_kind` strings → table rows, first match wins (lower-cased substring tests, most specific first):
# "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe".
_KINDS = (("h200 nvl", "H200 NVL"), ("h200", "H200 SXM"), ("h100 nvl", "H100 NVL"), ("h100 pcie", "H100 PCIe"),
          ("h100", "H100 SXM"), ("a100", "A100"))


def device_row(device_kind: str) -> str | None:
    """The `PEAK_TFLOPS` row for a jax `device.device_kind`, or None (CPUs and anything not in the table)."""
    kind = device_kind.lower()
    return next((row for key, row in _KINDS if key in kind), None)


def peak_flops(device_kind: str, dtype: str, matmul_precision: str | None = None) -> float | None:
    """Peak dense matmul FLOP/s of one device for compute `dtype` ('bfloat16', 'float16', 'float32'), or None.

    float32 maps to the TF32 tensor-core peak unless `matmul_precision` (jax's `jax_default_matmul_precision`) is
    'highest' or 'float32', which ask XLA for true float32 arithmetic."""
    row = device_row(device_kind)
    if row is None:
        return None
    if dtype in ("bfloat16", "float16"):
        key = "bfloat16"
    elif dtype == "float8":
        return PEAK_TFLOPS[row]["float8"] * TERA if "float8" in PEAK_TFLOPS[row] else None
    elif dtype == "float32":
        key = "float32" if (matmul_precision or "").lower() in ("highest", "float32", "f32_f32_f32") else "tf32"
    else:
        return None
    return PEAK_TFLOPS[row][key] * TERA


def attended_keys(seq_len: int, *, causal: bool = True, window: int = 0) -> float:
    """Keys per query averaged over a sequence of `seq_len`: s without a mask; (s + 1)/2 causal; with a sliding
    window W (the query's own position included) mean over i of min(i + 1, W)."""
    s = seq_len
    if not causal:
        return float(s)
    if not window or window >= s:
        return (s + 1) / 2
    # i < W: i + 1 keys (sum W(W+1)/2); i ≥ W: W keys each.
    return (window * (window + 1) / 2 + (s - window) * window) / s


@dataclasses.dataclass(frozen=True)
class ForwardFlops:
    """Matmul FLOPs of one forward pass per token, whole model (divide by devices for a share): `layers_dense`
    (projections and MLP, all L layers; `down_projection` is the MLP-down part of it), `attention` (scores and
    probabilities·values, all L layers, for the keys counted), `head` (the LM head)."""

    layers_dense: float
    attention: float
    head: float
    down_projection: float = 0.0  # the MLP's last matmul, part of layers_dense (full remat does not redo it)

    @property
    def total(self) -> float:
        return self.layers_dense + self.attention + self.head


@dataclasses.dataclass(frozen=True)
class LayerFlops:
    """One layer's forward matmul FLOPs per token: `dense` (projections and MLP; `down_projection` is the MLP-down
    part of it) and `attention` (scores and probabilities·values for the keys counted)."""

    dense: float
    attention: float
    down_projection: float


def layer_forward_flops(cfg: ModelConfig, keys: float, tensor: int = 1, moe: bool | None = None) -> LayerFlops:
    """One layer's forward matmul FLOPs per token on one of `tensor` ranks (the Megatron split: MLP columns divided
    by t; the attention as its kind splits, `AttentionKind.flops` — GQA's query heads divided by t, its kv heads
    too unless there are fewer of them than ranks, when each rank computes the one it attends with). `keys`: how
    many keys each query's attention costs. tensor = 1 is the whole layer. moe: an MoE layer (True) or a dense one
    (False); None: the mean over the model's layers (a mixed stack has both kinds, `ModelConfig.layer_kinds`)."""
    if moe is None:
        n_moe, L = cfg.moe_layer_count, cfg.n_layers
        if n_moe in (0, L):
            return layer_forward_flops(cfg, keys, tensor, moe=n_moe == L)
        a, b = layer_forward_flops(cfg, keys, tensor, True), layer_forward_flops(cfg, keys, tensor, False)
        mean = lambda x, y: (n_moe * x + (L - n_moe) * y) / L  # noqa: E731
        return LayerFlops(*(mean(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))
    h, F, t = cfg.d_model, cfg.d_ff, tensor
    if moe:  # the *active* MLP: the router, k experts, the shared expert and its score
        m = cfg.moe
        down = 2 * (m.top_k * m.d_ff + m.shared_d_ff) / t * h
        mlp = 2 * h * m.n_experts + 3 * down + (2 * h if m.shared_gate else 0)
    else:
        down = 2 * F / t * h
        mlp = family(cfg).mlp_matrices(cfg) * 2 * h * F / t
    projections, core = attention_kind(cfg).flops(cfg, keys, t)  # GQA: q, k, v, o; scores and their product with V
    return LayerFlops(dense=projections + mlp, attention=core, down_projection=down)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, keys: float | None = None) -> ForwardFlops:
    """Forward matmul FLOPs per token of a sequence of `seq_len`; `keys` (default: the causal count of
    `attended_keys`, honouring each layer's sliding window — `cfg.layer_windows` — averaged over the layers, as the
    attention term is linear in it) is how many keys each query's attention costs."""
    if keys is None:
        windows = cfg.layer_windows
        keys = sum(attended_keys(seq_len, window=w) for w in windows) / len(windows)
    layer, L = layer_forward_flops(cfg, keys), cfg.n_layers
    return ForwardFlops(layers_dense=L * layer.dense, attention=L * layer.attention,
                        head=2 * cfg.d_model * cfg.vocab_size, down_projection=L * layer.down_projection)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (the MFU numerator): 3 × forward, causal pairs only, no recomputation."""
    return 3 * forward_flops_per_token(cfg, seq_len).total


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, *, remat: str = "none",
                             full_attention: bool = True) -> float:
    """Matmul FLOPs the device executes per trained token (the HFU numerator): 3 × forward, plus one more forward
    of the layers with remat 'full' or of the attention term with remat 'dots' or 'selective' (the core attention's
    matmuls, scores and their product with V, are what both recompute); `full_attention` counts the whole
    score square (XLA's path) instead of the causal pairs."""
    keys = float(seq_len) if full_attention else None
    fwd = forward_flops_per_token(cfg, seq_len, keys=keys)
    recompute = {"none": 0.0, "full": fwd.layers_dense - fwd.down_projection + fwd.attention,
                 "dots": fwd.attention, "selective": fwd.attention}[remat]
    return 3 * fwd.total + recompute


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int) -> float:
    """Inference: forward FLOPs per prompt token when a prompt of `prompt_len` is processed at once (causal)."""
    return forward_flops_per_token(cfg, prompt_len).total


def decode_flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """Inference: FLOPs of generating one token with `context_len` positions in the KV cache (its own included):
    the projections, MLP and head for one token, and attention over min(context_len, window) cached keys (each
    layer's window, averaged over the layers)."""
    windows = cfg.layer_windows
    keys = sum(min(context_len, w) if w else context_len for w in windows) / len(windows)
    return forward_flops_per_token(cfg, 1, keys=float(keys)).total


def utilisation(flops_per_step: float, step_seconds: float, n_devices: int, peak: float | None) -> dict[str, float]:
    """{'tflops_per_device': achieved TFLOP/s per device, 'mfu': fraction of `peak`} for `flops_per_step` spread
    over `n_devices`; 'mfu' only when the peak is known (not on CPUs)."""
    per_device = flops_per_step / step_seconds / n_devices
    out = {"tflops_per_device": per_device / TERA}
    if peak:
        out["mfu"] = per_device / peak
    return out


def training_peak(cfg: ModelConfig, seq_len: int, device) -> float | None:
    """The peak FLOP/s an MFU of training `cfg` is measured against on `device`: `device_peak` of the compute dtype,
    or with FP8 matmuls (`model.matmul`, jaxpar.fp8) the time-weighted mix of peaks its FLOPs run at — the rowwise
    recipe runs the block's matmuls forward and for the input gradient in FP8 (2 of their 3 passes), their weight
    gradient, the attention core and the LM head at the compute dtype's peak: P = total / (f8/P8 + f16/P16). A device
    without an FP8 peak (or a CPU) → `device_peak` alone."""
    base = device_peak(device, cfg.dtype)
    if cfg.matmul == "float" or base is None:
        return base
    fp8 = peak_flops(device.device_kind, "float8")
    if fp8 is None:
        return base
    fwd = forward_flops_per_token(cfg, seq_len)
    in_fp8 = 2 * fwd.layers_dense
    return 3 * fwd.total / (in_fp8 / fp8 + (3 * fwd.total - in_fp8) / base)


def device_peak(device, dtype: str) -> float | None:
    """`peak_flops` for a jax device and compute dtype, under the current default matmul precision."""
    import jax

    return peak_flops(device.device_kind, dtype, jax.config.jax_default_matmul_precision)
