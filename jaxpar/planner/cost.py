"""Step time of a layout, predicted: FLOPs over the achievable rate, plus each mesh axis's bytes over its links.

    step = compute + Σ_axis exposed(bytes_axis / bandwidth_axis + collectives_axis · latency_axis)
    compute = executed matmul FLOPs per device · (1 + remat's recomputation) / achievable FLOP/s
              (a schedule table's useful FLOPs / (1 − its bubble); the circular loop executes its bubble iterations,
              so they are in its executed FLOPs already. On devices that share their cores, `Profile.shared_cores`,
              a bubble that runs nothing costs nothing — a table's, and the loop's with `parallel.skip_bubble`)
              + a fixed cost per layer application (kernel launches: what makes many small microbatches or
              accumulation chunks slower than few large ones) + the pipeline loop's own work per iteration (its
              selects, buffer updates and permute over a microbatch's [mb, s, h]: probed per byte,
              `Profile.pipeline_byte`) + the pages of the step's temporaries where the runtime allocates them
              afresh each step (XLA:CPU; probed per byte, `Profile.fresh_byte`; 0 on GPUs)
    achievable FLOP/s: each of a layer's matmuls (`layer_matmuls`) at the probed rate of its width, so tensor
              parallelism's narrower matmuls run slower where the machine's do

Bytes per device per step are `jaxpar.planner.expected`'s formulas — the ones `jaxpar analyze` checks against the
compiled program: tensor (Megatron's all-reduces, SP's gathers), pipe (the stages' permutes), context (K/V
gathers or the ring), expert (the all-to-alls) and data (the gradient all-reduce, 2(d−1)/d of the gradient shard;
ZeRO-1 the same volume as a reduce-scatter and an all-gather of the update; ZeRO-3 adds the parameters' gathers in
the forward and the backward, 2(d−1)/d more).

Links: the mesh is row-major with `tensor` innermost (jaxpar.mesh), so an axis stays inside a host when its degree
times the degrees of the axes inside it is at most the devices per host — it then runs at the host's link rate
(NVLink), else at the network's per device. A probed profile (`jaxpar probe`) has the host's rate per collective and
group size: the pipeline's and the ring's permutes, the experts' all-to-alls and everything else's all-reduces (or
their halves) each at what was measured for an axis of that degree.

Overlap, as the step runs today (what to change when the step changes):
    tensor    exposed: each all-reduce sits between the matmuls that need it; collective_matmul hides it behind the
              partial matmuls: the profile's `overlap` fraction of it, up to the compute time (which the ring's
              hiding shares: both hide behind the same matmuls)
    pipe      exposed: a permute per iteration, between two stage computations
    context   all_gather exposed; ring hidden behind each block's attention (as collective matmul's)
    expert    exposed: the dispatch all-to-all precedes the experts' matmuls, the combine follows them
    data      exposed: gradients are reduced once, after the backward, before the optimizer
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.config import Config
from jaxpar import flops
from jaxpar.families import attention_kind
from jaxpar.parallel import pipeline, schedule
from jaxpar.parallel.axes import AXES, DATA, EXPERT, TENSOR
from jaxpar.plan import padded_vocab
from jaxpar.planner import expected
from jaxpar.planner.memory import Memory, param_bytes, predict_memory
from jaxpar.planner.profile import Profile

@dataclasses.dataclass(frozen=True)
class Timing:
    """Predicted seconds of one train step and where they go; `comm` by mesh axis (exposed seconds)."""

    compute: float
    comm: dict[str, float]
    bubble: float
    tokens: int
    model_flops: float  # per device per step (the MFU numerator)

    @property
    def step(self) -> float:
        return self.compute + sum(self.comm.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step

    @property
    def comm_share(self) -> float:
        return sum(self.comm.values()) / self.step

    def mfu(self, peak: float | None) -> float | None:
        """Model FLOPs utilisation against `peak` FLOP/s (None without a peak)."""
        return self.model_flops / self.step / peak if peak else None

    def as_dict(self) -> dict:
        """Seconds by part, tokens/s and the communication share, for JSON."""
        return {"step_s": self.step, "compute_s": self.compute, "comm_s": self.comm, "bubble": self.bubble,
                "tokens_per_s": self.tokens_per_s, "comm_share": self.comm_share}


def inside_host(config: Config, devices_per_host: int) -> dict[str, bool]:
    """Per mesh axis: whether its groups stay inside one host (the axis and every axis inside it fit a host)."""
    out, span = {}, 1
    for axis in reversed(AXES):
        span *= getattr(config.parallel, axis)
        out[axis] = span <= devices_per_host or getattr(config.parallel, axis) == 1
    return out


def pipeline_ticks(config: Config, d: dict) -> float:
    """A step's pipeline iterations (circular: forward and backward each run them) or schedule-table ticks (one F, B
    or W each), accumulation chunks included; `d` = `expected._dims(config, …)`."""
    p = config.parallel
    if p.schedule == "circular":
        return d["iterations"]
    return schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches).n_ticks * d["A"]


def axis_collectives(config: Config) -> dict[str, float]:
    """How many collectives each mesh axis runs per step (each pays the link's latency, however small): Megatron's
    4 per layer application (6 with SP's gathers and scatters), a permute per pipeline iteration or tick each way,
    2 per layer for context parallelism's K/V (2(c−1) ring steps), 4 all-to-alls per MoE layer, and one bucketed
    gradient reduction over data."""
    p = config.parallel
    d = expected._dims(config, padded_vocab(config.model, p.tensor))
    out = {a: 0.0 for a in AXES}
    if p.tensor > 1:
        out[TENSOR] = d["layer_execs"] * (6 if p.sequence_parallel else 4)
    if p.pipe > 1:
        out["pipe"] = 2 * pipeline_ticks(config, d)
    if p.context > 1:
        out["context"] = d["layer_execs"] * (2 * (p.context - 1) if p.context_impl == "ring" else 2)
    if p.expert > 1:
        out[EXPERT] = 4 * d["moe_layer_execs"]
    if p.data > 1:  # ZeRO: reduce-scatter the gradients, all-gather the update (and stage 3 the weights per layer)
        out[DATA] = (2.0 if p.zero else 1.0) + (2 * d["layer_execs"] if p.zero >= 3 else 0)
    return out


def axis_bytes(config: Config) -> dict[str, float]:
    """Bytes each device sends per step on each mesh axis (see the module docstring)."""
    p = config.parallel
    V = padded_vocab(config.model, p.tensor)
    out = {a: 0.0 for a in AXES}
    out[TENSOR] = expected.tensor_bytes(config, V)["total"]
    if p.pipe > 1:
        if p.schedule == "circular":
            out["pipe"] = expected.pipeline_bytes(config)["permute_bytes"]
        else:
            table = schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches)
            sends = pipeline.Pipeline(p.pipe, p.repeats, p.microbatches, config.model.pipelined_layers,
                                      p.schedule).program.sends()
            out["pipe"] = expected.schedule_permute_bytes(config, table.n_ticks,
                                                          (sends["down"] > 0) + (sends["up"] > 0))
    out["context"] = expected.context_bytes(config)
    if config.moe.enabled:
        out[EXPERT] = expected.expert_bytes(config)["total"]
    d = p.data
    if d > 1:  # the gradients as the step holds them before reducing: not split over data
        out[DATA] = 2 * (d - 1) / d * param_bytes(config) * (2 if p.zero >= 3 else 1)
    return out


def _kind(config: Config, axis: str) -> str:
    """The collective that carries `axis`'s bytes (whose probed bandwidth applies): the pipeline's and the ring's
    permutes, the experts' all-to-alls, and all-reduces (or their halves, gathers and scatters) elsewhere."""
    if axis == "pipe" or (axis == "context" and config.parallel.context_impl == "ring"):
        return "permute"
    return "all_to_all" if axis == EXPERT else "all_reduce"


def layer_matmuls(config: Config) -> list[tuple[float, float]]:
    """One layer's matmuls as a tensor rank runs them: (FLOPs per token, square-equivalent width √(K·N)) each — the
    attention kind's (`AttentionKind.matmuls`: GQA's q [h → a/t·E], k and v [h → K/t·E], o [a/t·E → h] and the
    core's per-head [s, E] @ [E, s] and [s, s] @ [s, E]; MLA's latent down- and up-projections and its core), then
    the MLP's [h → F/t] (two under SwiGLU) and [F/t → h] (an MoE layer's top_k experts' instead, and its shared
    expert's). The backward's matmuls have the same K·N."""
    m, t, s = config.model, config.parallel.tensor, config.train.seq_len
    h = m.d_model
    out = list(attention_kind(m).matmuls(m, t, s))
    glu = 3 if m.family != "gpt2" else 2

    def mlp(width: int, copies: float):
        f = max(width // t, 1)
        return [(copies * 2 * h * f, math.sqrt(h * f))] * glu

    if m.moe.enabled:
        out += mlp(m.moe.d_ff, m.moe.top_k) + (mlp(m.moe.shared_d_ff, 1) if m.moe.shared_d_ff else [])
    else:
        out += mlp(m.d_ff, 1)
    return out


def matmul_rate(config: Config, profile: Profile) -> float:
    """The achievable FLOP/s of a layer's matmuls on `profile` (`layer_matmuls`): each at the probed rate of its
    square-equivalent width, combined as their FLOPs take time (Σ flops / Σ flops/rate). Tensor parallelism narrows
    the projections and the MLP, and narrow matmuls run below the large ones' rate."""
    mats = layer_matmuls(config)
    return sum(f for f, _ in mats) / sum(f / layer_matmul_rate(config, profile, round(w)) for f, w in mats)


def layer_matmul_rate(config: Config, profile: Profile, width: int) -> float:
    """The achievable FLOP/s of a block matmul of `width` in training: the compute dtype's rate, or with FP8
    matmuls (`model.matmul`, jaxpar.fp8) on a profile that rates float8 the time-weighted mix — the rowwise recipe
    runs the forward and the input gradient in FP8 (2 of the 3 passes) and the weight gradient in the compute
    dtype: 1 / (⅔/r8 + ⅓/r). A profile without a float8 rate runs them at the compute dtype's."""
    rate = profile.rate(config.model.dtype, width)
    if config.model.matmul == "float" or "float8" not in (profile.matmul or profile.flops):
        return rate
    return 1.0 / (2.0 / 3.0 / profile.rate("float8", width) + 1.0 / 3.0 / rate)


def predict_time(config: Config, profile: Profile, devices_per_host: int, memory: Memory | None = None) -> Timing:
    """The step time of `config` (resolved for its devices) on `profile`'s machines; `memory`: its predicted memory
    (`predict_memory`; computed here when the profile charges fresh memory and none is given)."""
    m, p, t = config.model, config.parallel, config.train
    V = padded_vocab(m, p.tensor)
    f = expected.step_flops(config, V)
    recompute = (flops.hardware_flops_per_token(m, t.seq_len, remat=p.remat, full_attention=True)
                 / flops.hardware_flops_per_token(m, t.seq_len, remat="none", full_attention=True))
    rate = matmul_rate(config, profile)
    # A bubble is idle time on devices of their own; where the devices share their cores (simulated CPU devices)
    # the compute a stage skips goes to the others: a table's idle ticks run nothing, and so does the circular
    # loop's bubble with `parallel.skip_bubble` (without it the loop runs its layers on filler there).
    if p.pipe > 1 and p.schedule != "circular":
        bubble = schedule.build(p.schedule, p.pipe, p.repeats, p.microbatches).bubble
        compute = f["useful"] * recompute / rate / (1 if profile.shared_cores else 1 - bubble)
    else:
        bubble = pipeline.bubble_fraction(p.pipe, p.repeats, p.microbatches) if p.pipe > 1 else 0.0
        skipped = p.pipe > 1 and p.skip_bubble and profile.shared_cores
        compute = f["useful" if skipped else "executed"] * recompute / rate
    # Fixed costs per layer application: more microbatches, accumulation chunks or bubble iterations pay them.
    d = expected._dims(config, V)
    compute += d["layer_execs"] * profile.layer_overhead
    if p.pipe > 1:  # the pipeline loop's own work per iteration, in proportion to a microbatch's [mb, s, h]
        iterations = pipeline_ticks(config, d) / (1 if p.schedule == "circular" else 2)  # a tick: half of one
        compute += iterations * d["mb"] * d["s"] * m.d_model * d["beta"] * profile.pipeline_byte
    if profile.fresh_byte:  # a runtime that allocates the step's temporaries afresh (XLA:CPU) pays for their pages
        memory = memory or predict_memory(config, "cpu")
        compute += (memory.gradients + memory.activations + memory.workspace) * profile.fresh_byte
    inside = inside_host(config, devices_per_host)
    comm, count, hide = {}, axis_collectives(config), compute
    for axis, sent in axis_bytes(config).items():
        bandwidth = profile.bandwidth(_kind(config, axis), getattr(p, axis), inside[axis])
        seconds = sent / bandwidth + count[axis] * (profile.latency if inside[axis] else profile.latency_inter)
        if (axis == TENSOR and p.overlap == "collective_matmul") or (axis == "context" and p.context_impl == "ring"):
            # Both hide behind the same matmuls: they share one budget of hideable compute.
            hidden = min(seconds * profile.overlap, hide)
            seconds, hide = seconds - hidden, hide - hidden
        comm[axis] = seconds
    tokens = t.batch_size * t.seq_len
    return Timing(compute, comm, bubble, tokens, f["model_flops_per_device"])

